"""Layout of the prefill-wait statistics in the shared stats block, and their /metrics form.

Model rank 0 measures how long each request waited for its prompt to be prefilled (from
admission to the step that completed its prompt), on two clocks: processed prefill tokens (the
clock of the overtaking bound) and wall seconds, and how many tokens of later work overtook it
(the quantity the bound limits, ``--prefill_max_overtake_tokens`` +
``--prefill_overtake_fraction`` x FCFS wait).  It writes cumulative histogram buckets, sums and
counts, the longest wait and the most-overtaken request still waiting, the number of protected
requests and the bound's parameters into :class:`~lightllm.server.core.objs.shm_stats.ShmStats`; the HTTP process turns them
into Prometheus histograms and gauges at scrape time.  Each field has one writer (rank 0).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# Upper bounds (inclusive) of the token buckets: powers of two from 256 to 4M, so that requests near
# the default overtaking allowance (2048 + 0.15 x FCFS wait) fall in buckets of their own (with
# powers of four, 1,100 and 4,000 overtaken tokens shared one).
WAIT_TOKEN_BUCKETS: Tuple[int, ...] = tuple(2**power for power in range(8, 23))
# Upper bounds of the seconds buckets, stored in microseconds so the block stays int64.
WAIT_US_BUCKETS: Tuple[int, ...] = tuple(
    int(s * 1_000_000) for s in (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
)

HIST_PREFIX = "prefill_wait_hist_"
LONGEST_TOKENS_FIELD = "prefill_wait_longest_tokens"
LONGEST_US_FIELD = "prefill_wait_longest_us"
LONGEST_OVERTAKEN_FIELD = "prefill_overtaken_longest_tokens"
PROTECTED_FIELD = "prefill_overtake_protected_requests"
BOUND_BASE_FIELD = "prefill_overtake_bound_base_tokens"
BOUND_FRACTION_PPM_FIELD = "prefill_overtake_bound_fraction_ppm"  # millionths: the block is int64
BOUND_ENABLED_FIELD = "prefill_overtake_bound_enabled"


def _bucket_fields(unit: str, bounds: Sequence[int]) -> List[str]:
    return [f"{HIST_PREFIX}{unit}_le_{b}" for b in bounds] + [
        f"{HIST_PREFIX}{unit}_le_inf",
        f"{HIST_PREFIX}{unit}_sum",
    ]


TOKEN_FIELDS = _bucket_fields("tokens", WAIT_TOKEN_BUCKETS)
US_FIELDS = _bucket_fields("us", WAIT_US_BUCKETS)
OVERTAKEN_FIELDS = _bucket_fields("overtaken", WAIT_TOKEN_BUCKETS)
OVERTAKE_GAUGE_FIELDS: Tuple[str, ...] = (
    LONGEST_OVERTAKEN_FIELD,
    PROTECTED_FIELD,
    BOUND_BASE_FIELD,
    BOUND_FRACTION_PPM_FIELD,
    BOUND_ENABLED_FIELD,
)

# Appended to ShmStats.STAT_FIELDS.  The ``le_inf`` bucket doubles as the count.
PREFILL_WAIT_FIELDS: Tuple[str, ...] = (
    LONGEST_TOKENS_FIELD,
    LONGEST_US_FIELD,
    *TOKEN_FIELDS,
    *US_FIELDS,
    *OVERTAKEN_FIELDS,
    *OVERTAKE_GAUGE_FIELDS,
)


def bucket_increments(value: int, bounds: Sequence[int]) -> List[int]:
    """0/1 per cumulative bucket (``le_b`` for each bound, then ``le_inf``) for one observation."""
    return [1 if value <= b else 0 for b in bounds] + [1]


def histogram_families(snapshot: Dict[str, int], strategy: str) -> Iterable[object]:
    """Prometheus families for the prefill-wait fields of a stats ``snapshot``."""
    for field, scale, name, unit in (
        (LONGEST_TOKENS_FIELD, 1, "lightllm_prefill_wait_longest_tokens", "processed prefill tokens"),
        (LONGEST_US_FIELD, 1e6, "lightllm_prefill_wait_longest_seconds", "seconds"),
    ):
        doc = f"Longest current prefill wait of a request still waiting for its first token, in {unit}"
        gauge = GaugeMetricFamily(name, doc, labels=["strategy"])
        gauge.add_metric([strategy], snapshot.get(field, 0) / scale)
        yield gauge
    for field, scale, name, doc in (
        (LONGEST_OVERTAKEN_FIELD, 1, "lightllm_prefill_overtaken_longest_tokens",
         "Most prefill tokens of later work served ahead of a request still waiting for its first token"),
        (PROTECTED_FIELD, 1, "lightllm_prefill_overtake_protected_requests",
         "Waiting requests that used up their overtaking allowance and now go before all later work"),
        (BOUND_BASE_FIELD, 1, "lightllm_prefill_overtake_bound_base_tokens",
         "Overtaking bound: allowance = base_tokens + fraction x FCFS wait (--prefill_max_overtake_tokens)"),
        (BOUND_FRACTION_PPM_FIELD, 1e6, "lightllm_prefill_overtake_bound_fraction",
         "Overtaking bound: allowance = base_tokens + fraction x FCFS wait (--prefill_overtake_fraction)"),
        (BOUND_ENABLED_FIELD, 1, "lightllm_prefill_overtake_bound_enabled",
         "1 when the overtaking bound protects requests, 0 with --disable_prefill_overtake_bound"),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=["strategy"])
        gauge.add_metric([strategy], snapshot.get(field, 0) / scale)
        yield gauge
    for fields, bounds, scale, name, doc in (
        (TOKEN_FIELDS, WAIT_TOKEN_BUCKETS, 1, "lightllm_prefill_wait_tokens",
         "Prefill wait from admission until the prompt is done (its first token), in processed prefill tokens"),
        (US_FIELDS, WAIT_US_BUCKETS, 1e6, "lightllm_prefill_wait_seconds",
         "Prefill wait from admission until the prompt is done (its first token), in seconds"),
        (OVERTAKEN_FIELDS, WAIT_TOKEN_BUCKETS, 1, "lightllm_prefill_overtaken_tokens",
         "Prefill tokens of later work served ahead of a request before its first token (what the bound limits)"),
    ):
        family = HistogramMetricFamily(name, doc, labels=["strategy"])
        *bound_fields, inf_field, sum_field = fields
        # Bounds spelled as prometheus_client spells every other histogram's ("1.0", "256.0"):
        # Prometheus compares le as text, so a selector or a join on le must find one spelling.
        buckets = [(floatToGoString(b / scale), snapshot.get(f, 0)) for b, f in zip(bounds, bound_fields)]
        buckets.append(("+Inf", snapshot.get(inf_field, 0)))
        family.add_metric([strategy], buckets, sum_value=snapshot.get(sum_field, 0) / scale)
        yield family
