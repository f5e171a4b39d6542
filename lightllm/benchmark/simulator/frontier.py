"""How much of ``hrrn``'s short-TTFT cut any order can keep in one simulated cell.

``shortest_within_slack`` is held to a rule (docs/EN/results.md): in every seed cell, keep at
least 80% of ``hrrn``'s short TTFT P95 cut while the long prompts' TTFT P95 and E2E P95 and the
output throughput stay within 5% of ``default``.  Where it misses, the useful question is
whether *any* order could meet the rule there.  This module measures the best a clairvoyant
family of orders reaches: :class:`EarliestShortsFirst` knows the workload and serves exactly the
``count`` earliest short prompts ahead of everything else, a full prefill step of them at a
time, from ``start_tokens`` processed prefill tokens on, and keeps ``default``'s order
otherwise.  It runs under the same overtaking bound as every strategy (the base class applies it),
so the sweep shows what the bound leaves to gain.

Why this family is the one to beat: the short TTFT P95 falls only when requests leave the
slowest 5% of short prompts, and the slowest are the earliest (they wait behind the most long
work).  Serving a short prompt early costs the long prompts its prefill and its decode rows
whichever prompt it is, so the earliest ones buy the most for the same cost; whole steps of
them leave no budget unused (a long prompt's chunk does not fit behind a partly filled step).

    python -m lightllm.benchmark.simulator.frontier --scenario long_then_stream --mode normal \\
        --budget 1024 --counts 40-140/10 --starts 0,16384,32768
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Dict, List, Optional, Sequence, Set, Union

from lightllm.utils.interrupts import interruptible
from lightllm.benchmark.simulator.bound_cli import add_overtake_bound_arguments
from lightllm.benchmark.cli_args import OneLineErrorParser
from lightllm.benchmark.simulator.cell_cli import (
    MAX_LIST_VALUES,
    add_cell_arguments,
    int_range_arg,
    run_cell_command,
    scenario_label,
)
from lightllm.benchmark.simulator.cost_model import CostProfile
from lightllm.benchmark.simulator.runner import case_metrics, simulate_workload
from lightllm.benchmark.simulator.scenarios import SEED_RUNNING_MAX_REQ_SIZE, ScenarioSpec
from lightllm.benchmark.workloads import SHORT, ScheduledRequest
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.base import PrefillQueueStrategy
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec

# The rule's limits (docs/EN/results.md, "A strategy that should never lose to default").
LOSS_LIMIT_PCT = 5.0
KEPT_CUT_SHARE_PCT = 80.0


class EarliestShortsFirst(PrefillQueueStrategy):
    """Serve the listed requests first, ``batch_size`` at a time, from ``start_tokens`` on.

    Not a server strategy (it is told which requests to favour, so it is not registered): a
    yardstick for what an order could reach.  A listed request is *released* once
    ``start_tokens`` prefill tokens were processed and either ``batch_size`` listed requests
    wait or every listed request not yet released waits; released requests lead, in the
    listed order, and everything else keeps its arrival order.

    Args:
        promote_ids: request ids to serve early, in the order to serve them.
        batch_size: listed requests released together (a full prefill step of them).
        start_tokens: processed prefill tokens before which nothing is released.
        overtake_bound: the overtaking bound, as for every strategy.
    """

    name = "earliest_shorts_first"

    def __init__(
        self,
        promote_ids: Sequence[int],
        batch_size: int,
        start_tokens: int = 0,
        overtake_bound: OvertakeBoundSpec = OvertakeBoundSpec(),
    ) -> None:
        super().__init__(overtake_bound)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if start_tokens < 0:
            raise ValueError(f"start_tokens must be >= 0, got {start_tokens}")
        self.rank: Dict[int, int] = {request_id: rank for rank, request_id in enumerate(promote_ids)}
        self.batch_size = batch_size
        self.start_tokens = start_tokens
        self.released: Set[int] = set()

    def order_prefill(self, prefill_reqs: List[InferReq], processed_prefill_tokens: int) -> List[InferReq]:
        """Released listed requests first (listed order), then the rest in arrival order."""
        if processed_prefill_tokens < self.start_tokens:
            return prefill_reqs
        listed = sorted((r for r in prefill_reqs if r.request_id in self.rank), key=lambda r: self.rank[r.request_id])
        fresh = [r for r in listed if r.request_id not in self.released]
        unreleased = len(self.rank) - len(self.released)
        if len(fresh) >= self.batch_size or (fresh and len(fresh) == unreleased):
            self.released.update(r.request_id for r in fresh[: self.batch_size])
        lead = [r for r in listed if r.request_id in self.released]
        led = {id(r) for r in lead}
        return lead + [r for r in prefill_reqs if id(r) not in led]


@dataclasses.dataclass(frozen=True)
class FrontierPoint:
    """One member of the family, measured against ``default`` and ``hrrn`` in the same cell.

    Attributes:
        start_tokens, count: the member (see :class:`EarliestShortsFirst`).
        short_cut_ms: ``default``'s short TTFT P95 minus this order's (positive: better).
        cut_share_pct: that cut as a share of ``hrrn``'s (None when ``hrrn`` cuts nothing).
        long_ttft_pct, long_e2e_pct, output_pct: changes against ``default`` in percent.
        short_ttft_pct: the short TTFT P95's change against ``default`` in percent.
    """

    start_tokens: int
    count: int
    short_cut_ms: float
    cut_share_pct: Optional[float]
    long_ttft_pct: float
    long_e2e_pct: float
    output_pct: float
    short_ttft_pct: float = 0.0

    @property
    def within_loss_limit(self) -> bool:
        """True when no latency metric nor the throughput loses more than the rule allows."""
        return (
            self.short_ttft_pct <= LOSS_LIMIT_PCT
            and self.long_ttft_pct <= LOSS_LIMIT_PCT
            and self.long_e2e_pct <= LOSS_LIMIT_PCT
            and self.output_pct >= -LOSS_LIMIT_PCT
        )

    @property
    def meets_rule(self) -> bool:
        """Within the loss limit, and keeping the rule's share of ``hrrn``'s cut (if any)."""
        kept = self.cut_share_pct is None or self.cut_share_pct >= KEPT_CUT_SHARE_PCT
        return self.within_loss_limit and kept


def shorts_per_step(workload: Sequence[ScheduledRequest], budget: int) -> int:
    """How many of the workload's short prompts fill one prefill step of ``budget`` tokens (at least 1)."""
    lengths = [item.prompt_len for item in workload if item.request_class == SHORT]
    if not lengths:
        raise ValueError("the workload has no short prompts")
    return max(1, budget // max(lengths))


def earliest_short_ids(workload: Sequence[ScheduledRequest], count: int) -> List[int]:
    """Ids (workload positions, as the simulator assigns them) of the ``count`` earliest short prompts."""
    shorts = sorted(
        (item.scheduled_time_s, index) for index, item in enumerate(workload) if item.request_class == SHORT
    )
    return [index for _, index in shorts[:count]]


def refuse_idle_members(
    workload: Sequence[ScheduledRequest], source: str, counts: Sequence[int], starts: Sequence[int]
) -> None:
    """Raise ``ValueError`` naming ``--counts`` or ``--starts`` when a member would measure nothing new.

    A count above the workload's short prompts serves the same prompts as a count of all of them
    (an identical row); a start at or beyond its prefill tokens releases nothing, since nothing
    waits once they are all processed (a row equal to ``default``).  ``source`` names the
    workload in the message (``scenario long_first``).
    """
    shorts = sum(1 for item in workload if item.request_class == SHORT)
    above = [count for count in counts if count > shorts]
    if above:
        raise ValueError(f"--counts {above[0]} is above the {shorts} short prompts of {source}: it would serve "
                         f"the same prompts as count {shorts}; name counts up to {shorts}")
    prefill_tokens = sum(item.prompt_len for item in workload)
    beyond = [start for start in starts if start >= prefill_tokens]
    if beyond:
        raise ValueError(f"--starts {beyond[0]} is at or beyond the {prefill_tokens} prefill tokens of {source}: "
                         "nothing waits once they are all processed, so the order would equal default; name "
                         f"starts below {prefill_tokens}")


def frontier(
    profile: CostProfile,
    scenario: ScenarioSpec,
    mode: str,
    budget: int,
    counts: Sequence[int],
    starts: Sequence[int],
    *,
    overtake_bound: OvertakeBoundSpec = OvertakeBoundSpec(),
    seed: int = 0,
    running_max_req_size: int = SEED_RUNNING_MAX_REQ_SIZE,
) -> List[FrontierPoint]:
    """Simulate every (start, count) member of the family in one cell; return them in that order."""
    workload = scenario.build(seed)
    if not any(item.request_class == SHORT for item in workload):
        raise ValueError(f"scenario {scenario.name!r} has no short prompts")
    batch_size = shorts_per_step(workload, budget)

    def measure(strategy: Union[str, PrefillQueueStrategy]) -> Dict[str, Optional[float]]:
        records, _ = simulate_workload(
            profile, workload, strategy, mode, budget, running_max_req_size, overtake_bound=overtake_bound
        )
        return case_metrics(records)[0]

    base = measure("default")
    hrrn_cut = base["short_ttft_p95_ms"] - measure("hrrn")["short_ttft_p95_ms"]
    # A cut under 1% is within the simulator's step granularity: the rule counts it as none.
    hrrn_has_cut = hrrn_cut >= 0.01 * base["short_ttft_p95_ms"]
    points: List[FrontierPoint] = []
    for start in starts:
        for count in counts:
            order = EarliestShortsFirst(earliest_short_ids(workload, count), batch_size, start, overtake_bound)
            got = measure(order)
            cut = base["short_ttft_p95_ms"] - got["short_ttft_p95_ms"]
            points.append(
                FrontierPoint(
                    start_tokens=start,
                    count=count,
                    short_cut_ms=cut,
                    cut_share_pct=100.0 * cut / hrrn_cut if hrrn_has_cut else None,
                    long_ttft_pct=_change_pct(got, base, "long_ttft_p95_ms"),
                    long_e2e_pct=_change_pct(got, base, "long_e2e_p95_ms"),
                    output_pct=_change_pct(got, base, "output_tok_s"),
                    short_ttft_pct=_change_pct(got, base, "short_ttft_p95_ms"),
                )
            )
    return points


def best_within_loss_limit(points: Sequence[FrontierPoint]) -> Optional[FrontierPoint]:
    """The member with the largest short-TTFT cut among those within the loss limit."""
    allowed = [point for point in points if point.within_loss_limit]
    return max(allowed, key=lambda point: (point.short_cut_ms, -point.count)) if allowed else None


def frontier_markdown(points: Sequence[FrontierPoint]) -> str:
    """The sweep as a Markdown table, then the best member within the loss limit."""
    lines = [
        "| start (tokens) | count | short TTFT P95 cut (ms) | share of hrrn's cut | long TTFT P95 | long E2E P95 "
        "| output tok/s | meets the rule |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        share = "—" if p.cut_share_pct is None else f"{p.cut_share_pct:.0f}%"
        lines.append(
            f"| {p.start_tokens} | {p.count} | {p.short_cut_ms:.0f} | {share} | {p.long_ttft_pct:+.1f}% "
            f"| {p.long_e2e_pct:+.1f}% | {p.output_pct:+.1f}% | {'yes' if p.meets_rule else 'no'} |"
        )
    best = best_within_loss_limit(points)
    if best is None:
        lines.append("\nNo member stays within the loss limit.")
    else:
        share = "—" if best.cut_share_pct is None else f"{best.cut_share_pct:.0f}% of hrrn's"
        lines.append(
            f"\nLargest cut within the {LOSS_LIMIT_PCT:g}% loss limit: {best.short_cut_ms:.0f} ms ({share}), "
            f"start {best.start_tokens}, count {best.count}."
        )
    return "\n".join(lines)


def _change_pct(got: Dict[str, Optional[float]], base: Dict[str, Optional[float]], key: str) -> float:
    return 100.0 * (got[key] - base[key]) / base[key]


def build_parser() -> argparse.ArgumentParser:
    """The frontier sweep's argument parser."""
    parser = OneLineErrorParser(
        prog="python -m lightllm.benchmark.simulator.frontier",
        description="Sweep a clairvoyant family of orders (the earliest short prompts first) in one simulated "
        "cell: how much of hrrn's short-TTFT cut can any order keep within the 5% loss limit?",
    )
    add_cell_arguments(parser, default_mode="normal")
    parser.add_argument(
        "--counts",
        type=int_range_arg,
        default="40-140/10",
        help="short prompts served early: LOW-HIGH/STEP ranges (LOW-HIGH: step 1) or a comma list of integers >= 0, "
        f"at most {MAX_LIST_VALUES} values, none above the scenario's short prompts (default 40-140/10)",
    )
    parser.add_argument(
        "--starts",
        type=int_range_arg,
        default="0,16384,32768",
        help="processed prefill tokens before the first is served: LOW-HIGH/STEP ranges (LOW-HIGH: step 1) or a comma list of "
        f"integers >= 0, at most {MAX_LIST_VALUES} values, each below the scenario's prefill tokens "
        "(default 0,16384,32768)",
    )
    add_overtake_bound_arguments(parser)
    return parser


@interruptible("nothing was written")
def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point; bad arguments exit with status 2 and a one-line error."""

    def sweep(args, profile, scenario, mode, budget, bound) -> str:
        refuse_idle_members(scenario.build(args.seed), scenario_label(scenario, args.seed), args.counts, args.starts)
        points = frontier(
            profile, scenario, mode, budget, args.counts, args.starts,
            overtake_bound=bound, seed=args.seed,
        )
        return frontier_markdown(points)

    return run_cell_command(build_parser(), argv, sweep)


if __name__ == "__main__":
    sys.exit(main())
