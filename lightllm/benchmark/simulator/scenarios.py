"""The seed report's benchmark scenarios, and the numbers the seed report published for them.

Workloads come from :mod:`lightllm.benchmark.workloads`, so the simulator and the real
serving benchmark send identical arrival schedules.

The ``PUBLISHED_*`` tables are reference data copied from the seed benchmark report (H100
80GB, Qwen3.5-0.8B, text only, short prompts 128 tokens, long prompts 4K/8K/16K, 128 output
tokens, ``running_max_req_size = 256``).  They are what a real server measured, shown next to
the simulated numbers; the simulator never reads them to produce its own results.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, NamedTuple, Tuple

from lightllm.benchmark.workloads import ScheduledRequest, WorkloadConfig, build_workload

MODES: Tuple[str, ...] = ("normal", "1p1d")
SEED_BUDGETS: Tuple[int, ...] = (1024, 4096)
SEED_RUNNING_MAX_REQ_SIZE = 256


@dataclasses.dataclass(frozen=True)
class ScenarioSpec:
    """A named workload of the seed report.

    Attributes:
        name: key used on the command line.
        title: one line for report headings.
        workload: generator settings; ``seed`` is replaced by the run's seed.
    """

    name: str
    title: str
    workload: WorkloadConfig

    def build(self, seed: int = 0) -> List[ScheduledRequest]:
        """The arrival schedule for ``seed`` (only the ``sustained`` generator draws from it)."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        return build_workload(dataclasses.replace(self.workload, seed=seed))


SCENARIOS: Dict[str, ScenarioSpec] = {
    spec.name: spec
    for spec in (
        ScenarioSpec(
            "long_first",
            "long first: 48 long 16K prompts at 0-47 ms, then 48 short 128-token prompts at 60-107 ms",
            WorkloadConfig(name="long_first"),
        ),
        ScenarioSpec(
            "interleaved",
            "interleaved: 192 requests at 500 req/s, the first of every 4 long (16K)",
            WorkloadConfig(name="interleaved"),
        ),
        ScenarioSpec(
            "sustained",
            "sustained: Poisson 60 req/s for 8 s, 25% long (8K)",
            WorkloadConfig(name="sustained", long_len=8192, long_fraction=0.25, request_rate=60.0, duration_s=8.0),
        ),
        ScenarioSpec(
            "sustained_overload",
            "sustained overload: Poisson 120 req/s for 8 s, 10% long (16K)",
            WorkloadConfig(name="sustained", long_len=16384, long_fraction=0.10, request_rate=120.0, duration_s=8.0),
        ),
        ScenarioSpec(
            "long_then_stream",
            "long then stream: 16 long 16K prompts at 0-47 ms, then 8 s of short prompts at 120 req/s",
            WorkloadConfig(
                name="sustained",
                long_len=16384,
                long_fraction=0.0,
                request_rate=120.0,
                duration_s=8.0,
                initial_long_count=16,
                long_spread_ms=47.0,
                stream_start_ms=60.0,
            ),
        ),
    )
}

SCENARIO_GROUPS: Dict[str, Tuple[str, ...]] = {"seed_all": tuple(SCENARIOS)}


def resolve_scenarios(names: List[str]) -> List[ScenarioSpec]:
    """Scenario specs for ``names`` (group names such as ``seed_all`` expand), duplicates dropped."""
    resolved: List[ScenarioSpec] = []
    for name in names:
        members = SCENARIO_GROUPS.get(name, (name,))
        for member in members:
            if member not in SCENARIOS:
                valid = ", ".join(list(SCENARIOS) + list(SCENARIO_GROUPS))
                raise ValueError(f"scenario must be one of {valid}; got {name!r}")
            if SCENARIOS[member] not in resolved:
                resolved.append(SCENARIOS[member])
    return resolved


class PublishedRow(NamedTuple):
    """One strategy's row of the seed report's absolute table (medians of three runs)."""

    short_ttft_p50_ms: float
    short_ttft_p95_ms: float
    long_ttft_p95_ms: float
    output_tok_s: float


# Published in the seed report: normal mode, batch_max_tokens = chunked_prefill_size = 1024.
PUBLISHED_SEED_ABSOLUTE: Dict[str, Dict[str, PublishedRow]] = {
    "long_first": {
        "default": PublishedRow(1636, 2724, 20083, 477.61),
        "promote_shortest": PublishedRow(335, 407, 20139, 475.01),
        "hrrn": PublishedRow(369, 430, 20239, 473.50),
    },
    "interleaved": {
        "default": PublishedRow(4197, 7713, 19896, 808.22),
        "promote_shortest": PublishedRow(308, 409, 20358, 791.10),
        "hrrn": PublishedRow(375, 505, 20345, 792.14),
    },
}
PUBLISHED_SEED_ABSOLUTE_CONFIG = {"mode": "normal", "budget": 1024}


class PublishedChange(NamedTuple):
    """Percent change versus ``default`` published in the seed report (negative latency = better)."""

    short_ttft_p95_pct: float
    long_e2e_p95_pct: float
    output_tok_s_pct: float


# Published in the seed report: the "sustained" scenario (8K long, 25% long, 60 req/s, 8 s),
# keyed by (mode, budget); paired log-ratio means over GPUs and rounds.
PUBLISHED_SEED_SUSTAINED_CHANGES: Dict[Tuple[str, int], Dict[str, PublishedChange]] = {
    ("normal", 1024): {
        "promote_shortest": PublishedChange(+1.6, +13.1, -10.1),
        "hrrn": PublishedChange(-9.1, +5.7, -4.7),
    },
    ("normal", 4096): {
        "promote_shortest": PublishedChange(+57.0, +26.8, -14.7),
        "hrrn": PublishedChange(+1.7, +3.9, -2.2),
    },
    ("1p1d", 1024): {
        "promote_shortest": PublishedChange(-93.3, +6.1, -4.0),
        "hrrn": PublishedChange(-92.8, -0.9, +0.9),
    },
    ("1p1d", 4096): {
        "promote_shortest": PublishedChange(-22.1, +30.0, -8.3),
        "hrrn": PublishedChange(-3.5, -1.9, +0.6),
    },
}

# Published in the seed report, as prose: "long_then_stream" on 1P1D / 1024 versus default.
PUBLISHED_SEED_LONG_THEN_STREAM_NOTE = (
    "1P1D / 1024, 16 long 16K then 8 s of short requests at 120 req/s: hrrn short TTFT P95 -63.6%, "
    "long E2E P95 +65.5%; promote_shortest long E2E P95 +73.8% (all versus default)"
)
# Published in the seed report, as prose: "sustained_overload" on 1P1D / 4096.
PUBLISHED_SEED_OVERLOAD_NOTE = (
    "1P1D / 4096, 16K long, 90% short, 120 req/s: hrrn versus promote_shortest long E2E P95 +10.3%, "
    "output throughput -5.6%"
)
