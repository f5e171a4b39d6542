"""Cost of the scheduling phases of one step at scale, per prefill-queue strategy.

Two layouts are measured.  The *server layout* (:mod:`.schedule_cost_server`): N requests wait in
the router's queue and ``--running_max_req_size`` requests run in the rank's engine, which orders
only those; it times the router's admission and the engine's whole step minus the forward.  The
*engine-only layout* (this module) hands all N waiting requests to the engine at once, as if
``--running_max_req_size`` were raised to N:

A step of the :class:`~lightllm.server.model_rank.scheduling.step_engine.StepEngine`
spends its non-forward time in three phases whose cost grows with the queue: *order* (the
engine's classify phase, which splits decode from prefill requests, and the strategy's
``order`` of the prefill ones), *select* (the :class:`StepPlanner` walking the ordered queue
under the token budget) and
*submit* (the accounting done when the prefill batch is submitted: the processed-prefill-token
counter and the strategy's overtaking-bound charge, as ``StepEngine.run_prefill`` does).  This
module builds N waiting prefill requests and M running decode requests as real ``InferReq``
objects and times the phases with the server's own objects, for every registered strategy:

    python -m lightllm.benchmark.simulator.schedule_cost [--layout both] [--sizes 100 1000 10000]
        [--running 1000] [--kv-view radix count] [--json out.json]

No forward runs after the submit, so the queue itself stays the same from step to step: that is
the steady state of a long backlog.  A few untimed warm-up steps come first, so lazily bound
metadata (HRRN's cost, the slack strategy's deadlines and step clock, the overtaking bound's
allowances) is bound before timing, as it is after a request's first step in a server; the first
step, which binds it (and, for ``shortest_within_slack``, runs before any step budget is known),
is reported on its own.  Timings are medians over repeats; they are for reading, never for
deciding a test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from lightllm.utils.interrupts import interruptible
from lightllm.benchmark.cli_args import OneLineErrorParser, given_flags, output_file
from lightllm.benchmark.output_writing import print_report, strict_json, write_outputs_or_exit
from lightllm.benchmark.simulator.bound_cli import add_replaced_wait_flag
from lightllm.benchmark.simulator.schedule_cost_server import (
    DEFAULT_RUNNING,
    KV_VIEWS,
    ServerCostRow,
    run_server,
    server_markdown_table,
)

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import (
    available_strategy_names,
    build_prefill_queue_strategy,
)
from lightllm.server.model_rank.scheduling.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.model_rank.scheduling.request_classifier import NORMAL_CLASSIFIER
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner, submit_prefill
from lightllm.server.model_rank.scheduling.request_state import ReqState
from lightllm.utils.gc_tuning import freeze_startup_objects

DEFAULT_SIZES = (100, 1000, 10000)
# Ten times the largest default.  The engine-only layout holds about 35 KB per waiting request
# (its prompt ids, with its share of the N/10 running ones), so the bound is nearly 4 GB and a
# step of HRRN takes a few tenths of a second; without a bound a typo (--sizes 10000000) filled
# the memory before printing anything.
MAX_SIZE = 100_000
# The server layout sizes its KV view for a full batch of the largest requests (some 3,100
# tokens each) and runs --server-warmup steps of the whole batch before timing.
MAX_RUNNING = 10_000
# Flags each layout alone reads: given with the other layout they would be ignored.
SERVER_ONLY_FLAGS = ("running", "kv_view", "server_repeats", "server_warmup")
ENGINE_ONLY_FLAGS = ("repeats", "warmup")
MIN_PROMPT, MAX_PROMPT = 128, 8192
BATCH_MAX_TOKENS = 1024
CHUNKED_PREFILL_SIZE = 1024
# Every request fits: the benchmark measures scheduling, not KV pressure.
KV_FREE_TOKENS = 1 << 40
# Counter tokens between two consecutive arrivals, so HRRN's waits differ from request to request.
ARRIVAL_SPACING = 256


@dataclass
class CostRow:
    """Median milliseconds per step of one strategy at one queue size."""

    strategy: str
    waiting: int
    running: int
    order_ms: float
    select_ms: float
    submit_ms: float
    total_ms: float
    first_ms: float
    repeats: int


def build_queue(waiting: int, running: int, seed: int = 0) -> Tuple[List[InferReq], ProcessedPrefillTokenCounter]:
    """Return ``running`` decode requests then ``waiting`` prefill requests (admission order).

    Prompts are uniform in [128, 8192] tokens.  A quarter of the waiting requests had a
    prefix-cache hit (so ``lpm`` has something to sort by), arrivals are spread over the
    processed-prefill-token clock, and the counter stands after the last arrival.
    """
    rng = random.Random(seed)
    counter = ProcessedPrefillTokenCounter()
    reqs: List[InferReq] = []
    for i in range(running):
        prompt = rng.randint(MIN_PROMPT, MAX_PROMPT)
        req = InferReq(
            request_id=i,
            prompt_ids=[0] * prompt,
            max_new_tokens=1 << 20,
            arrival_processed_prefill_tokens=counter.snapshot(),
            output_ids=[0] * rng.randint(1, 64),
        )
        # A decode request: prompt and all but the newest output token are in the KV cache.
        req.cur_kv_len = req.kv_slot_len = req.total_len - 1
        req.move_to(ReqState.PREFILLING)
        req.move_to(ReqState.DECODING)
        reqs.append(req)
        counter.advance(prompt)
    for i in range(waiting):
        prompt = rng.randint(MIN_PROMPT, MAX_PROMPT)
        cached = rng.randrange(0, prompt // 2, 64) if rng.random() < 0.25 else 0
        req = InferReq(
            request_id=running + i,
            prompt_ids=[0] * prompt,
            max_new_tokens=128,
            arrival_processed_prefill_tokens=counter.snapshot(),
            cur_kv_len=cached,
            kv_slot_len=cached,
            prompt_cache_len=cached,
        )
        reqs.append(req)
        counter.advance(ARRIVAL_SPACING)
    return reqs, counter


def measure(
    strategy_name: str,
    waiting: int,
    running: Optional[int] = None,
    *,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> CostRow:
    """Time order, select and submit of ``repeats`` steps of ``strategy_name`` over a fresh queue."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats} and {warmup}")
    running = waiting // 10 if running is None else running
    reqs, counter = build_queue(waiting, running, seed)
    strategy = build_prefill_queue_strategy(strategy_name)
    planner = StepPlanner(batch_max_tokens=BATCH_MAX_TOKENS, chunked_prefill_size=CHUNKED_PREFILL_SIZE)
    order_s: List[float] = []
    select_s: List[float] = []
    submit_s: List[float] = []
    total_s: List[float] = []
    first_s = 0.0
    for index in range(warmup + repeats):
        started = time.perf_counter()
        # Classify and order are timed together: before the classify phase existed the strategy
        # did both, and the order_ms column keeps meaning the same work.
        decode_reqs, prefill_reqs = NORMAL_CLASSIFIER.split(reqs)
        ordered_prefill = strategy.order(prefill_reqs, counter.value)
        ordered_at = time.perf_counter()
        plan = planner.plan(decode_reqs, ordered_prefill, KV_FREE_TOKENS)
        selected_at = time.perf_counter()
        # What StepEngine.run_prefill accounts when it submits the batch; no forward follows.
        if plan.has_prefill:
            submit_prefill(plan, counter)
            strategy.charge([(chunk.req, chunk.token_num) for chunk in plan.prefill_chunks], plan.skipped)
        done = time.perf_counter()
        if index == 0:
            first_s = done - started
        if index >= warmup:
            order_s.append(ordered_at - started)
            select_s.append(selected_at - ordered_at)
            submit_s.append(done - selected_at)
            total_s.append(done - started)
    return CostRow(
        strategy=strategy_name,
        waiting=waiting,
        running=running,
        order_ms=statistics.median(order_s) * 1e3,
        select_ms=statistics.median(select_s) * 1e3,
        submit_ms=statistics.median(submit_s) * 1e3,
        total_ms=statistics.median(total_s) * 1e3,
        first_ms=first_s * 1e3,
        repeats=repeats,
    )


def run(
    sizes: Sequence[int] = DEFAULT_SIZES,
    strategies: Optional[Sequence[str]] = None,
    *,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> List[CostRow]:
    """Measure every strategy (all registered ones by default) at every queue size."""
    names = list(strategies) if strategies else available_strategy_names()
    return [measure(name, size, repeats=repeats, warmup=warmup, seed=seed) for name in names for size in sizes]


def markdown_table(rows: Sequence[CostRow]) -> str:
    """One line per strategy and size: each phase and the whole step (median), then the first step, in ms."""
    lines = [
        "| strategy | waiting | running | order (ms) | select (ms) | submit (ms) | step (ms) | first step (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row.strategy} | {row.waiting} | {row.running} | {row.order_ms:.2f} | "
            f"{row.select_ms:.2f} | {row.submit_ms:.2f} | {row.total_ms:.2f} | {row.first_ms:.2f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line's argument parser."""
    parser = OneLineErrorParser(
        prog="python -m lightllm.benchmark.simulator.schedule_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--layout", choices=("both", "server", "engine"), default="both",
        help="server: waiting requests in the router, running ones in the engine; engine: every waiting "
        "request inside the engine; both (default)",
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES),
        help=f"waiting requests, one cell per size, each from 1 to {MAX_SIZE} "
        f"(default {' '.join(map(str, DEFAULT_SIZES))})",
    )
    parser.add_argument(
        "--running",
        type=int,
        nargs="+",
        default=list(DEFAULT_RUNNING),
        help=f"server layout: running requests (= --running_max_req_size), one cell per count, each at most "
        f"{MAX_RUNNING} (default {' '.join(map(str, DEFAULT_RUNNING))})",
    )
    parser.add_argument(
        "--kv-view",
        nargs="+",
        choices=KV_VIEWS,
        default=["radix"],
        help="server layout: the rank's own KV view with the radix prefix cache (radix, default: what a "
        "server runs), or the simulator's token count (count); both can be given",
    )
    parser.add_argument(
        "--strategies", nargs="+", choices=available_strategy_names(),
        help="prefill-queue strategies to measure (default: all registered)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="engine-only: timed steps per cell (median; default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="engine-only: untimed steps first (default %(default)s)")
    parser.add_argument("--server-repeats", type=int, default=30, help="server layout: timed steps per cell (default %(default)s)")
    parser.add_argument(
        "--server-warmup", type=int, default=1500, help="server layout: steps run before timing (to a steady state; default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated requests (default 0)")
    # Checked while parsing: the measurement takes about a minute to lose at the end.
    parser.add_argument("--json", dest="json_path", type=output_file, help="also write the rows to this file (JSON)")
    add_replaced_wait_flag(parser, "this command's cells run under the default overtaking bound, which it does not vary",
                           "the former waiting bound, refused (the cells run under the default overtaking bound)")
    return parser


def _ignored_flags(layout: str, given: Dict[str, str]) -> List[str]:
    """The typed flags (``given``: dest -> flag) that ``layout`` would not read."""
    unread = {"engine": SERVER_ONLY_FLAGS, "server": ENGINE_ONLY_FLAGS}.get(layout, ())
    return [flag for dest, flag in given.items() if dest in unread]


@interruptible("nothing was written")
def main(argv: Optional[Sequence[str]] = None) -> List[Union[ServerCostRow, CostRow]]:
    """Command line: print the tables (server layout first), optionally write the rows as JSON.

    Returns the server-layout rows, then the engine-only ones; in the JSON file every row
    carries its ``layout`` (``server`` or ``engine``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, values in (("--sizes", args.sizes), ("--running", args.running), ("--kv-view", args.kv_view),
                         ("--strategies", args.strategies or [])):
        # A value named twice would be measured and printed twice (or, for --kv-view, silently once).
        repeated = [value for index, value in enumerate(values) if value in values[:index]]
        if repeated:
            parser.error(f"{flag} names {repeated[0]} twice; name each once")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    # A cell with no waiting request has no queue to order, select from or submit: a row of zeros.
    if any(size < 1 or size > MAX_SIZE for size in args.sizes):
        parser.error(f"--sizes must be within [1, {MAX_SIZE}], got {' '.join(map(str, args.sizes))}")
    if any(size < 1 or size > MAX_RUNNING for size in args.running):
        parser.error(f"--running must be within [1, {MAX_RUNNING}], got {' '.join(map(str, args.running))}")
    for flag in _ignored_flags(args.layout, given_flags(parser, argv)):
        parser.error(f"{flag} applies to the {'server' if args.layout == 'engine' else 'engine-only'} layout, "
                     f"which --layout {args.layout} does not run")
    for flag, value, least in (("--server-repeats", args.server_repeats, 1), ("--server-warmup", args.server_warmup, 0),
                               ("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0)):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    # As every server process does once it has started (``gc_tuning``): the objects that exist by
    # now leave the collector's full scans, so a step's max is not one scan of every module.
    freeze_startup_objects()
    rows: List[Union[ServerCostRow, CostRow]] = []
    saved: List[Dict[str, Any]] = []
    report: List[str] = []  # printed once the JSON file is written
    if args.layout in ("both", "server"):
        server_rows = [
            row
            for kv_view in args.kv_view
            for row in run_server(
                args.sizes,
                args.running,
                args.strategies,
                warmup_steps=args.server_warmup,
                repeats=args.server_repeats,
                seed=args.seed,
                kv_view=kv_view,
            )
        ]
        report.append(
            "Server layout: waiting requests in the router, running ones in the engine (median / max per step, "
            "after the untimed intake of the requests that raise the router to N)"
        )
        report.append(server_markdown_table(server_rows))
        rows.extend(server_rows)
        saved.extend({"layout": "server", **asdict(row)} for row in server_rows)
    if args.layout in ("both", "engine"):
        engine_rows = run(args.sizes, args.strategies, repeats=args.repeats, warmup=args.warmup, seed=args.seed)
        if args.layout == "both":
            report.append("")
        report.append("Engine-only layout: every waiting request inside the engine (median per step)")
        report.append(markdown_table(engine_rows))
        rows.extend(engine_rows)
        saved.extend({"layout": "engine", **asdict(row)} for row in engine_rows)
    # The JSON file first, then the tables: a reader that closes stdout early (``| head``) must
    # not cost the file, and a file that cannot be written is one line naming --json.
    if args.json_path:
        try:
            json_text = strict_json(saved)
        except ValueError as exc:
            parser.error(f"--json: {exc}")
        write_outputs_or_exit(parser, [("--json", args.json_path, json_text)])
    print_report("\n".join(report))
    return rows


if __name__ == "__main__":
    status = main()
    sys.exit(status if isinstance(status, int) else 0)
