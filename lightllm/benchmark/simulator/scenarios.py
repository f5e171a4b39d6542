"""The seed report's benchmark scenarios (its six, plus the long-then-stream cost case).

Workloads come from :mod:`lightllm.benchmark.workloads`, so the simulator and the real
serving benchmark send identical arrival schedules.

The seed's second multi-GPU report ran 24 groups: six scenarios x two modes (normal, 1P1D) x two
prefill budgets (1024, 4096).  It lists them as long first, interleaved, sustained (8K, 25% long,
60 req/s: its representative scenario), 4K prompts at 20 req/s (low load), 16K at 120 req/s
(overload) and short-majority; each is a named scenario here (:data:`SEED_SCENARIOS`).  It also
measured a long-first burst followed by a sustained short stream on 1P1D / 1024 as one of its two
"costs"; that is ``long_then_stream``.  The seed published exact parameters only for some of
them; the titles say where a parameter is our reading.

The numbers the seed published live in :mod:`lightllm.benchmark.simulator.published`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from lightllm.benchmark.workloads import SCHEDULE_FROM_SEED, ScheduledRequest, WorkloadConfig, build_workload

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

    @property
    def reads_seed(self) -> bool:
        """Whether the schedule depends on the seed (the simulator builds no prompt text, so a
        fixed-time generator's schedule does not)."""
        return self.workload.name in SCHEDULE_FROM_SEED

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
            "long first (seed scenario): 48 long 16K prompts at 0-47 ms, then 48 short 128-token prompts at 60-107 ms",
            WorkloadConfig(name="long_first"),
        ),
        ScenarioSpec(
            "interleaved",
            "interleaved (seed scenario): 192 requests at 500 req/s, the first of every 4 long (16K)",
            WorkloadConfig(name="interleaved"),
        ),
        ScenarioSpec(
            "sustained",
            "sustained (seed scenario, its representative one): Poisson 60 req/s for 8 s, 25% long (8K)",
            WorkloadConfig(name="sustained", long_len=8192, long_fraction=0.25, request_rate=60.0, duration_s=8.0),
        ),
        # The seed names "4K/20 requests per second, low load" only; the Poisson shape, 8 s and
        # 25% long are taken from its representative scenario (our reading).
        ScenarioSpec(
            "low_load",
            "low load (seed scenario, 4K at 20 req/s): Poisson 20 req/s for 8 s, 25% long (4K)",
            WorkloadConfig(name="sustained", long_len=4096, long_fraction=0.25, request_rate=20.0, duration_s=8.0),
        ),
        # The seed's cost case spells this one out: 16K long, 90% short, 120 req/s.
        ScenarioSpec(
            "sustained_overload",
            "overload (seed scenario, 16K at 120 req/s): Poisson 120 req/s for 8 s, 10% long (16K)",
            WorkloadConfig(name="sustained", long_len=16384, long_fraction=0.10, request_rate=120.0, duration_s=8.0),
        ),
        # The seed names "short requests in the majority" only.  Its representative scenario is
        # already 75% short, so a short-majority case must be more so: 90% short, with the
        # representative scenario's 8K long prompts and 60 req/s (our reading).
        ScenarioSpec(
            "short_majority",
            "short-majority (seed scenario): Poisson 60 req/s for 8 s, 10% long (8K)",
            WorkloadConfig(name="sustained", long_len=8192, long_fraction=0.10, request_rate=60.0, duration_s=8.0),
        ),
        ScenarioSpec(
            "long_then_stream",
            "long then stream (the seed's 1P1D / 1024 cost case): 16 long 16K prompts at 0-47 ms, "
            "then 8 s of short prompts at 120 req/s",
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

# The seed's six scenarios, in the order its report lists them.
SEED_SCENARIOS: Tuple[str, ...] = (
    "long_first",
    "interleaved",
    "sustained",
    "low_load",
    "sustained_overload",
    "short_majority",
)

# seed_six: the seed's 24 groups (with both modes and budgets); seed_all adds its cost case.
SCENARIO_GROUPS: Dict[str, Tuple[str, ...]] = {
    "seed_all": SEED_SCENARIOS + ("long_then_stream",),
    "seed_six": SEED_SCENARIOS,
}


def refuse_unread_seed(scenarios: List[ScenarioSpec]) -> None:
    """Raise ``ValueError`` when a typed ``--seed`` would change nothing for ``scenarios`` (none of
    them reads it), naming the scenarios that do read it."""
    if any(spec.reads_seed for spec in scenarios):
        return
    readers = ", ".join(name for name, spec in SCENARIOS.items() if spec.reads_seed)
    names = ", ".join(spec.name for spec in scenarios)
    raise ValueError(f"--seed changes nothing for {names}: {'its' if len(scenarios) == 1 else 'their'} arrivals are "
                     f"at fixed times (the seed draws the arrivals of {readers})")


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
