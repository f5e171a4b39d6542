"""The flags that name one simulated cell (profile, scenario, node kind, budget, seed), shared by
the simulator's yardstick command lines, the integer lists they take, and their common entry point."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Collection, List, Optional, Tuple

from lightllm.benchmark.cli_args import argument_type, comma_items, given_flags
from lightllm.benchmark.simulator.bound_cli import overtake_bound_from_cli
from lightllm.benchmark.simulator.cost_model import DEFAULT_PROFILE, CostProfile, available_profiles, load_profile
from lightllm.benchmark.simulator.runner import budget_refusal, check_fits_kv
from lightllm.benchmark.simulator.scenarios import MODES, SCENARIOS, ScenarioSpec, refuse_unread_seed
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec


def add_cell_arguments(parser: argparse.ArgumentParser, default_mode: str) -> None:
    """Add ``--profile``, ``--scenario``, ``--mode``, ``--budget`` and ``--seed``."""
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"bundled profile ({', '.join(available_profiles())}) or a profile JSON path (default {DEFAULT_PROFILE})",
    )
    parser.add_argument(
        "--scenario", default="long_then_stream", help=f"one of {', '.join(SCENARIOS)} (default long_then_stream)"
    )
    parser.add_argument("--mode", default=default_mode, help=f"node kind: {', '.join(MODES)} (default {default_mode})")
    parser.add_argument(
        "--budget", type=int, default=1024, help="prefill budget: batch_max_tokens = chunked_prefill_size (default 1024)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sustained workloads' arrivals (refused with "
                        "a scenario whose arrivals are at fixed times; default %(default)s)")


def cell_from_cli(args: argparse.Namespace, typed: Collection[str] = ()) -> Tuple[CostProfile, ScenarioSpec, str, int]:
    """The profile, scenario, mode and budget the parsed flags name; a bad one raises ``ValueError``.

    ``typed``: the dests of the flags the command line wrote; a typed ``--seed`` that the scenario
    does not read is refused (it would change nothing).
    """
    if args.scenario not in SCENARIOS:
        raise ValueError(f"--scenario must be one of {', '.join(SCENARIOS)}; got {args.scenario!r}")
    if args.mode not in MODES:
        raise ValueError(f"--mode must be one of {', '.join(MODES)}; got {args.mode!r}")
    if args.budget < 1:
        raise ValueError(f"--budget must be >= 1, got {args.budget}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    scenario = SCENARIOS[args.scenario]
    if "seed" in typed:
        refuse_unread_seed([scenario])
    profile = load_profile(args.profile)
    problem = budget_refusal(profile, args.profile, args.budget)
    if problem is not None:
        raise ValueError(problem)
    try:
        check_fits_kv(profile, scenario.build(args.seed), f"scenario {scenario.name}")
    except ValueError as exc:
        raise ValueError(f"--profile {args.profile}: {exc}") from None
    return profile, scenario, args.mode, args.budget


def scenario_label(scenario: ScenarioSpec, seed: int) -> str:
    """How a refusal names the workload a sweep built: ``scenario long_first``, with the seed
    (``scenario sustained (seed 3)``) where the scenario's arrivals are drawn from it."""
    return f"scenario {scenario.name}" + (f" (seed {seed})" if scenario.reads_seed else "")


# Most values one list flag may name (ranges expanded): in a sweep each value is at least one
# simulation of the whole cell, so more is a typo (``1-1000000000/1``) rather than a sweep; it is
# refused before the range is expanded, which would otherwise take all memory.
MAX_LIST_VALUES = 1000


class _BadStep(Exception):
    """A range's STEP below 1 (told apart from a value that is no integer)."""


def int_range(text: str) -> List[int]:
    """``"40-140/10"`` -> 40, 50, ..., 140; ``"40-45"`` (no ``/STEP``: step 1) -> 40, ..., 45;
    ``"0,16384"`` -> 0, 16384 (every value >= 0).

    A STEP below 1 is refused naming the step.  At most :data:`MAX_LIST_VALUES` values in all; a range that holds no value (``140-40``) is
    refused rather than dropped.
    """
    spans: List[range] = []
    count = 0
    for part in comma_items(text):
        try:
            if "-" in part:
                span, slash, step_text = part.partition("/")
                low, _, high = span.partition("-")
                step = int(step_text) if slash else 1
                if step < 1:
                    raise _BadStep(step)
                values = range(int(low), int(high) + 1, step)
            else:
                values = range(int(part), int(part) + 1)
        except _BadStep as bad:
            raise ValueError(f"the range {part!r} has STEP {bad.args[0]}; LOW-HIGH/STEP needs STEP >= 1") from None
        except ValueError:
            raise ValueError(f"expected integers, LOW-HIGH/STEP ranges (LOW-HIGH: step 1) or a comma list, "
                             f"got {part!r}") from None
        if not values:
            raise ValueError(f"the range {part!r} holds no value (LOW-HIGH/STEP needs LOW <= HIGH and STEP >= 1)")
        spans.append(values)
        # len() of a range costs nothing: the count is checked before anything is expanded.
        count += len(values)
        if count > MAX_LIST_VALUES:
            raise ValueError(f"names at least {count:,} values, more than the {MAX_LIST_VALUES} a list may name; "
                             "narrow the range or raise its step")
    values = [value for span in spans for value in span]
    if min(values) < 0:
        raise ValueError(f"expected at least one integer >= 0, got {text!r}")
    refuse_repeats(values)
    return values


def refuse_repeats(values: List[float]) -> None:
    """A value named twice would be simulated and printed twice (overlapping ranges too): refuse it."""
    seen = set()
    for value in values:
        if value in seen:
            raise ValueError(f"names {value:g} twice; name each once")
        seen.add(value)


# ``int_range`` as an argparse type: argparse names the flag in front of its message.
int_range_arg = argument_type(int_range)


def run_cell_command(
    parser: argparse.ArgumentParser,
    argv: Optional[List[str]],
    sweep: Callable[[argparse.Namespace, CostProfile, ScenarioSpec, str, int, OvertakeBoundSpec], str],
) -> int:
    """Parse ``argv``, resolve the cell and the bound, print what ``sweep`` returns (Markdown).

    A bad flag or value exits with status 2 and a one-line error naming it (``ValueError`` from
    the cell, the bound or ``sweep`` itself), and so does a flag given twice.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        profile, scenario, mode, budget = cell_from_cli(args, given_flags(parser, argv))
        text = sweep(args, profile, scenario, mode, budget, overtake_bound_from_cli(args))
    except ValueError as exc:
        parser.error(str(exc))
    print(text)
    return 0
