"""Tokens per engine step: rank 0 counts them into the shared stats block, /metrics reads them.

A step's tokens are the ones its forward passes took in (``StepReport.forward_token_num``): every
prefill-chunk token (prompt tokens the prefix cache did not hold, and a resumed request's
recomputed ones) plus one per decode row.  Only rank 0 publishes steps, so with TP > 1 each step
is counted once; a step that ran no forward is not observed.  The bucket bounds are vLLM's for
``vllm:iteration_tokens_total`` (1, then powers of two from 8 to 16384).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from lightllm.server.core.objs.prefill_wait_histogram import bucket_increments

ITERATION_TOKEN_BUCKETS: Tuple[int, ...] = (1,) + tuple(2**power for power in range(3, 15))

_PREFIX = "iteration_tokens_"
# Cumulative bucket counts (``le_inf`` is the count), then the sum; appended to ShmStats.STAT_FIELDS.
ITERATION_TOKEN_FIELDS: Tuple[str, ...] = tuple(
    [f"{_PREFIX}le_{bound}" for bound in ITERATION_TOKEN_BUCKETS] + [f"{_PREFIX}le_inf", f"{_PREFIX}sum"]
)

FAMILY_NAME = "lightllm_iteration_tokens"


class IterationTokenCounts:
    """Rank 0's running histogram of tokens per step (the values it writes to the stats block)."""

    def __init__(self) -> None:
        self._counts: List[int] = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self._sum = 0

    def observe(self, tokens: int) -> None:
        """One step that took ``tokens`` tokens into its forwards."""
        self._counts = [count + step for count, step in
                        zip(self._counts, bucket_increments(tokens, ITERATION_TOKEN_BUCKETS))]
        self._sum += tokens

    def fields(self) -> Dict[str, int]:
        """Stats-block field -> value."""
        values = dict(zip(ITERATION_TOKEN_FIELDS, self._counts))
        values[ITERATION_TOKEN_FIELDS[-1]] = self._sum
        return values


def iteration_tokens_family(snapshot: Dict[str, int], strategy: str) -> Iterable[HistogramMetricFamily]:
    """The Prometheus histogram of a stats ``snapshot``'s iteration-token fields."""
    family = HistogramMetricFamily(
        FAMILY_NAME, "Tokens taken into the forward passes of one engine step (prefill-chunk tokens plus decode rows)",
        labels=["strategy"])
    *bound_fields, inf_field, sum_field = ITERATION_TOKEN_FIELDS
    # Bounds written as prometheus_client (and so vLLM) writes them: le="8.0".
    buckets = [(floatToGoString(bound), snapshot.get(field, 0)) for bound, field in zip(ITERATION_TOKEN_BUCKETS, bound_fields)]
    buckets.append(("+Inf", snapshot.get(inf_field, 0)))
    family.add_metric([strategy], buckets, sum_value=snapshot.get(sum_field, 0))
    yield family
