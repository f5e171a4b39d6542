"""Command line of the scheduling simulator.

Examples::

    python -m lightllm.benchmark.simulator --profile h100_qwen_0p8b --scenario seed_all
    python -m lightllm.benchmark.simulator --scenario long_first --budget 1024 --modes normal \\
        --strategies default,hrrn --json out.json --markdown out.md
    python -m lightllm.benchmark.simulator --soak-hours 2 --budget 1024
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from lightllm.benchmark.simulator.bound_cli import add_overtake_bound_arguments, overtake_bound_from_cli
from lightllm.benchmark.simulator.cost_model import available_profiles, load_profile
from lightllm.benchmark.simulator.report import full_report_markdown, results_json, soak_json, soak_markdown
from lightllm.benchmark.simulator.runner import check_choice, run_matrix
from lightllm.benchmark.simulator.scenarios import MODES, SCENARIO_GROUPS, SCENARIOS, SEED_BUDGETS, resolve_scenarios
from lightllm.benchmark.simulator.soak import SoakConfig, run_soaks
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import available_strategy_names


def _csv(text: str) -> List[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _budgets(values: Optional[List[str]]) -> List[int]:
    if not values:
        return list(SEED_BUDGETS)
    budgets: List[int] = []
    for value in values:
        for part in _csv(value):
            try:
                budget = int(part)
            except ValueError:
                raise ValueError(f"budget must be an integer number of tokens, got {part!r}") from None
            if budget < 1:
                raise ValueError(f"budget must be >= 1, got {budget}")
            budgets.append(budget)
    return budgets


def build_parser() -> argparse.ArgumentParser:
    """The simulator's argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m lightllm.benchmark.simulator",
        description="Run the server's real scheduling code in virtual time with a step-cost model.",
    )
    parser.add_argument(
        "--profile",
        default="h100_qwen_0p8b",
        help=f"bundled profile ({', '.join(available_profiles())}) or a profile JSON path",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        help="scenario or group, repeatable or comma-separated: "
        f"{', '.join(list(SCENARIOS) + list(SCENARIO_GROUPS))} (default seed_all)",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(available_strategy_names()),
        help="comma-separated prefill-queue strategies (default: all registered)",
    )
    parser.add_argument(
        "--budget",
        action="append",
        help="prefill budget: batch_max_tokens = chunked_prefill_size; repeatable or comma-separated "
        f"(default {','.join(map(str, SEED_BUDGETS))})",
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated node kinds: {', '.join(MODES)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sustained workloads' arrivals")
    parser.add_argument("--running-max-req-size", type=int, default=256, help="router's running request cap")
    add_overtake_bound_arguments(parser)
    parser.add_argument(
        "--mixed-batches",
        action="store_true",
        help="run a normal node's decode rows inside its prefill forward, as the server does by default "
        "(off here: the H100 profile was fitted to the seed's engine, which runs them as two forwards)",
    )
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON here")
    parser.add_argument("--markdown", dest="markdown_path", help="also write the Markdown report here")
    soak = parser.add_argument_group("soak mode (replaces the scenario tables)")
    soak.add_argument("--soak-hours", type=float, help="simulate this many hours of sustained traffic per strategy")
    soak.add_argument("--soak-load", type=float, default=0.7, help="fraction of estimated capacity (default 0.7)")
    soak.add_argument("--soak-rate", type=float, help="request rate in req/s (overrides --soak-load)")
    soak.add_argument("--soak-long-len", type=int, default=8192, help="long prompt length (default 8192)")
    soak.add_argument("--soak-long-fraction", type=float, default=0.25, help="share of long requests (default 0.25)")
    return parser


def run(args: argparse.Namespace) -> tuple[str, Dict[str, Any]]:
    """Execute the parsed command; return the Markdown report and the JSON document."""
    profile = load_profile(args.profile)
    strategies = _csv(args.strategies)
    if not strategies:
        raise ValueError("strategies must name at least one strategy")
    for strategy in strategies:
        check_choice(strategy, available_strategy_names(), "strategies")
    modes = _csv(args.modes)
    for mode in modes:
        check_choice(mode, MODES, "modes")
    budgets = _budgets(args.budget)
    if args.seed < 0:
        raise ValueError(f"seed must be >= 0, got {args.seed}")
    overtake_bound_from_cli(args)  # refuse bad values before any case runs
    if args.soak_hours is not None:
        cfg = SoakConfig(
            hours=args.soak_hours,
            load=args.soak_load,
            request_rate=args.soak_rate,
            long_len=args.soak_long_len,
            long_fraction=args.soak_long_fraction,
            budget=budgets[0],
            mode=modes[0],
            seed=args.seed,
            running_max_req_size=args.running_max_req_size,
            overtake_bound=overtake_bound_from_cli(args),
            mixed_batches=args.mixed_batches,
        )
        soaks = run_soaks(profile, strategies, cfg)
        return soak_markdown(profile, cfg, soaks), soak_json(profile, cfg, soaks)
    scenarios = resolve_scenarios([name for value in args.scenario or ["seed_all"] for name in _csv(value)])

    def progress(key: Any) -> None:
        print(f"simulating {key.scenario} / {key.mode} / {key.budget} / {key.strategy}", file=sys.stderr)

    results = run_matrix(
        profile,
        scenarios,
        modes,
        budgets,
        strategies,
        args.seed,
        args.running_max_req_size,
        progress,
        overtake_bound=overtake_bound_from_cli(args),
        mixed_batches=args.mixed_batches,
    )
    return full_report_markdown(profile, results, args.seed), results_json(profile, results, args.seed)


def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point; bad arguments exit with status 2 and a one-line error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for path in (args.markdown_path, args.json_path):
        # Checked before the run: a run of every seed cell takes a while to lose at the end.
        if path and not Path(path).resolve().parent.is_dir():
            parser.error(f"the directory of {path!r} does not exist")
    try:
        markdown, document = run(args)
    except ValueError as exc:
        parser.error(str(exc))
    print(markdown)
    if args.markdown_path:
        Path(args.markdown_path).write_text(markdown, encoding="utf-8")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
