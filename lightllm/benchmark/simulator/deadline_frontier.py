"""What a short-prompt TTFT target costs the long prompts when the order knows the target.

:mod:`~lightllm.benchmark.simulator.frontier` serves the earliest short prompts as early as
possible.  This module measures the other clairvoyant way to buy a short-TTFT P95: serve each
short prompt *just in time*, in the step in which it falls due ``due_s`` seconds after its
arrival, and not before.  Every short prompt served ahead of the long ones costs them its prefill
wherever in the backlog it is served, so serving the fewest short prompts early is the cheapest
way to bring every short prompt's TTFT to ``due_s``: an order that holds each short prompt until
it is due serves exactly the ones that would otherwise miss.

A P95 also lets 5% of the short prompts miss.  :class:`ShortsByDeadline` can *spare* the
earliest ``spared`` short prompts (leave them at their first-come place, behind every long
prompt, though the planner may still fit one into budget a step leaves over), which is where an order that knows the metric would spend that 5%: the earliest wait
behind the most long work.  Sparing them makes those prompts slower than under ``default``, so
the sweep also counts the short prompts that end up slower than first come, first served, and
their P99.

Both are yardsticks, not server strategies: they read the simulator's virtual clock and the
workload's arrival times.  They run without the overtaking bound (it would pull the long
prompts forward and hide what the order alone costs); ``hrrn`` runs under the bound given on
the command line (the server's default unless told otherwise).  TTFT is decided on the node that
prefills, so a 1P1D cell simulates its prefill node only.

    python -m lightllm.benchmark.simulator.deadline_frontier --mode 1p1d --budget 1024 \\
        --due-ms 2000,2050,2100 --spared 0,47
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

from lightllm.utils.interrupts import interruptible
from lightllm.benchmark.metrics import RequestRecord, percentile
from lightllm.benchmark.simulator.bound_cli import add_overtake_bound_arguments
from lightllm.benchmark.cli_args import OneLineErrorParser, argument_type, comma_items
from lightllm.benchmark.simulator.cell_cli import (
    MAX_LIST_VALUES,
    add_cell_arguments,
    int_range_arg,
    refuse_repeats,
    run_cell_command,
    scenario_label,
)
from lightllm.benchmark.simulator.cost_model import CostProfile
from lightllm.benchmark.simulator.engine import Simulator
from lightllm.benchmark.simulator.frontier import shorts_per_step
from lightllm.benchmark.simulator.runner import server_config
from lightllm.benchmark.simulator.scenarios import SEED_RUNNING_MAX_REQ_SIZE, ScenarioSpec
from lightllm.benchmark.workloads import LONG, SHORT, ScheduledRequest
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.base import PrefillQueueStrategy
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec


class ShortsByDeadline(PrefillQueueStrategy):
    """Serve each short prompt when it falls due, a full step of them at a time.

    A short prompt is *due* ``due_s`` seconds after its arrival.  When the earliest waiting
    short prompt (spared ones excepted) is due, it and the next ones in arrival order, up to
    ``batch_size`` of them, lead the order; otherwise the order is ``default``'s.  A full step of
    them leaves no budget unused (a long prompt's chunk does not fit behind a partly filled
    step).

    Args:
        arrival_s: arrival time of every request, by request id.
        short_ids: ids of the short prompts.
        due_s: seconds after its arrival at which a short prompt is served.
        spared: the earliest ``spared`` short prompts keep their first-come place.
        batch_size: short prompts released together.
    """

    name = "shorts_by_deadline"

    def __init__(
        self,
        arrival_s: Mapping[int, float],
        short_ids: Sequence[int],
        due_s: float,
        spared: int,
        batch_size: int,
    ) -> None:
        super().__init__(OvertakeBoundSpec.off())
        if due_s < 0:
            raise ValueError(f"due_s must be >= 0, got {due_s}")
        if spared < 0:
            raise ValueError(f"spared must be >= 0, got {spared}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        missing = [request_id for request_id in short_ids if request_id not in arrival_s]
        if missing:
            raise ValueError(f"short prompts {missing[:5]} have no arrival time")
        by_arrival = sorted(short_ids, key=lambda request_id: (arrival_s[request_id], request_id))
        self.arrival_s = dict(arrival_s)
        self.served_by_deadline = set(by_arrival[spared:])
        self.due_s = due_s
        self.batch_size = batch_size
        self._clock: Optional[Callable[[], float]] = None

    def bind_clock(self, clock: Callable[[], float]) -> None:
        """Give the order the simulator's virtual clock (seconds); required before the first step."""
        self._clock = clock

    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        """Due short prompts first (a full step of them, in arrival order), then ``default``'s order."""
        if self._clock is None:
            raise RuntimeError("ShortsByDeadline needs bind_clock() before it orders a step")
        candidates = sorted(
            (r for r in prefill_reqs if r.request_id in self.served_by_deadline),
            key=lambda r: (self.arrival_s[r.request_id], r.request_id),
        )
        if not candidates or self.arrival_s[candidates[0].request_id] + self.due_s > self._clock():
            return prefill_reqs
        lead = candidates[: self.batch_size]
        led = {id(r) for r in lead}
        return lead + [r for r in prefill_reqs if id(r) not in led]


@dataclasses.dataclass(frozen=True)
class DeadlinePoint:
    """One order, measured against ``default`` in the same cell (TTFT only).

    Attributes:
        label: ``default``, ``hrrn`` or ``due D ms, spared K``.
        short_ttft_p95_pct, long_ttft_p95_pct: changes against ``default`` in percent.
        short_ttft_p99_ms: the short prompts' TTFT P99.
        slower_than_default: short prompts whose TTFT is longer than under ``default``.
        most_slower_ms: the largest such TTFT increase (0 when none is slower).
    """

    label: str
    short_ttft_p95_pct: float
    long_ttft_p95_pct: float
    short_ttft_p99_ms: float
    slower_than_default: int
    most_slower_ms: float = 0.0


def prefill_node_records(
    profile: CostProfile,
    workload: Sequence[ScheduledRequest],
    strategy: Union[str, PrefillQueueStrategy],
    mode: str,
    budget: int,
    *,
    overtake_bound: OvertakeBoundSpec = OvertakeBoundSpec(),
    running_max_req_size: int = SEED_RUNNING_MAX_REQ_SIZE,
) -> List[RequestRecord]:
    """Run the node that prefills (a normal node, or a 1P1D pair's prefill node); its records."""
    config = server_config(mode, budget, running_max_req_size, overtake_bound=overtake_bound)
    sim = Simulator(profile, strategy, config)
    if isinstance(strategy, ShortsByDeadline):
        strategy.bind_clock(lambda: sim.clock)
    sim.add_workload(workload)
    return sim.run().records


def refuse_sparing_all(workload: Sequence[ScheduledRequest], source: str, spared: Sequence[int]) -> None:
    """Raise ``ValueError`` naming ``--spared`` when a value spares every short prompt of ``workload``.

    Such an order serves no prompt by its deadline, so its rows would equal ``default``.
    ``source`` names the workload in the message (``scenario long_first``).
    """
    shorts = sum(1 for item in workload if item.request_class == SHORT)
    every = [count for count in spared if count >= shorts]
    if every:
        raise ValueError(f"--spared {every[0]} spares all {shorts} short prompts of {source}: none would be served "
                         f"by its deadline, so the rows would equal default; name values below {shorts}")


def deadline_frontier(
    profile: CostProfile,
    scenario: ScenarioSpec,
    mode: str,
    budget: int,
    due_ms: Sequence[float],
    spared: Sequence[int],
    *,
    overtake_bound: OvertakeBoundSpec = OvertakeBoundSpec(),
    seed: int = 0,
) -> List[DeadlinePoint]:
    """``default``, ``hrrn`` (under ``overtake_bound``) and every (due, spared) member, in that order."""
    workload = scenario.build(seed)
    short_ids = [index for index, item in enumerate(workload) if item.request_class == SHORT]
    if not short_ids or not any(item.request_class == LONG for item in workload):
        raise ValueError(f"scenario {scenario.name!r} needs both short and long prompts")
    arrival_s = {index: item.scheduled_time_s for index, item in enumerate(workload)}
    batch_size = shorts_per_step(workload, budget)

    def records_by_id(strategy: Union[str, PrefillQueueStrategy], bound: OvertakeBoundSpec) -> Dict[int, RequestRecord]:
        records = prefill_node_records(profile, workload, strategy, mode, budget, overtake_bound=bound)
        return {record.index: record for record in records}

    base = records_by_id("default", overtake_bound)
    runs = [("default", base), ("hrrn", records_by_id("hrrn", overtake_bound))]
    for due in due_ms:
        for count in spared:
            order = ShortsByDeadline(arrival_s, short_ids, due / 1000.0, count, batch_size)
            runs.append((f"due {due:g} ms, spared {count}", records_by_id(order, OvertakeBoundSpec.off())))
    return [_measure(label, got, base) for label, got in runs]


def _ttft_ms(record: RequestRecord) -> float:
    if record.ttft is None:
        raise RuntimeError(f"request {record.index} did not finish in the simulation")
    return 1000.0 * record.ttft


def _measure(label: str, got: Dict[int, RequestRecord], base: Dict[int, RequestRecord]) -> DeadlinePoint:
    def class_ttft(records: Dict[int, RequestRecord], request_class: str) -> List[float]:
        return [_ttft_ms(r) for r in records.values() if r.request_class == request_class]

    def change(request_class: str) -> float:
        now, before = percentile(class_ttft(got, request_class), 95), percentile(class_ttft(base, request_class), 95)
        return 100.0 * (now - before) / before

    # A microsecond of slack: the same step times summed in another order may differ in the last bit.
    increases = [
        _ttft_ms(record) - _ttft_ms(base[request_id])
        for request_id, record in got.items()
        if record.request_class == SHORT
    ]
    slower = [increase for increase in increases if increase > 1e-3]
    return DeadlinePoint(
        label=label,
        short_ttft_p95_pct=change(SHORT),
        long_ttft_p95_pct=change(LONG),
        short_ttft_p99_ms=percentile(class_ttft(got, SHORT), 99),
        slower_than_default=len(slower),
        most_slower_ms=max(slower, default=0.0),
    )


def deadline_markdown(points: Sequence[DeadlinePoint]) -> str:
    """The sweep as a Markdown table."""
    lines = [
        "| order | short TTFT P95 | long TTFT P95 | short TTFT P99 (ms) | short prompts slower than under default "
        "| the most slower (ms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        lines.append(
            f"| {p.label} | {p.short_ttft_p95_pct:+.1f}% | {p.long_ttft_p95_pct:+.1f}% | {p.short_ttft_p99_ms:.0f} "
            f"| {p.slower_than_default} | {p.most_slower_ms:.0f} |"
        )
    return "\n".join(lines)


def _float_list(text: str) -> List[float]:
    items = comma_items(text)
    try:
        values = [float(part) for part in items]
    except ValueError:
        raise ValueError(f"expected a comma list of numbers, got {text!r}") from None
    if not values or not all(math.isfinite(value) and value >= 0 for value in values):
        raise ValueError(f"expected at least one number >= 0 (finite), got {text!r}")
    refuse_repeats(values)
    return values


def build_parser() -> argparse.ArgumentParser:
    """The deadline sweep's argument parser."""
    parser = OneLineErrorParser(
        prog="python -m lightllm.benchmark.simulator.deadline_frontier",
        description="Serve every short prompt just in time for a TTFT target (clairvoyant): what the long "
        "prompts pay for it, with and without sparing the earliest short prompts.",
    )
    add_cell_arguments(parser, default_mode="1p1d")
    parser.add_argument(
        "--due-ms",
        type=argument_type(_float_list),
        default="2000,2050,2100",
        help="TTFT targets in ms: a comma list of numbers >= 0 (default 2000,2050,2100)",
    )
    parser.add_argument(
        "--spared",
        type=int_range_arg,
        default="0,47",
        help="earliest short prompts left first come: LOW-HIGH/STEP ranges (LOW-HIGH: step 1) or a comma list of integers >= 0, "
        f"at most {MAX_LIST_VALUES} values, each below the scenario's short prompts (default 0,47)",
    )
    add_overtake_bound_arguments(parser)
    return parser


@interruptible("nothing was written")
def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point; bad arguments exit with status 2 and a one-line error."""

    def sweep(args, profile, scenario, mode, budget, bound) -> str:
        refuse_sparing_all(scenario.build(args.seed), scenario_label(scenario, args.seed), args.spared)
        points = deadline_frontier(
            profile, scenario, mode, budget, args.due_ms, args.spared,
            overtake_bound=bound, seed=args.seed,
        )
        return deadline_markdown(points)

    return run_cell_command(build_parser(), argv, sweep)


if __name__ == "__main__":
    sys.exit(main())
