"""Command line of the scheduling simulator.

Examples::

    python -m lightllm.benchmark.simulator --profile h100_qwen_0p8b --scenario seed_all
    python -m lightllm.benchmark.simulator --scenario long_first --budget 1024 --modes normal \\
        --strategies default,hrrn --json out.json --markdown out.md
    python -m lightllm.benchmark.simulator --soak-hours 2 --budget 1024
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Collection, Dict, List, Optional, Sequence

from lightllm.utils.interrupts import interruptible
from lightllm.benchmark.cli_args import (
    OneLineErrorParser,
    comma_items,
    given_flags,
    output_file,
    refuse_repeated_values,
)
from lightllm.benchmark.output_writing import print_report, refuse_same_output, strict_json, write_outputs_or_exit
from lightllm.benchmark.simulator.bound_cli import add_overtake_bound_arguments, overtake_bound_from_cli
from lightllm.benchmark.simulator.cost_model import DEFAULT_PROFILE, CostProfile, available_profiles, load_profile
from lightllm.benchmark.simulator.report import full_report_markdown, results_json, soak_json, soak_markdown
from lightllm.benchmark.simulator.runner import budget_refusal, check_fits_kv, run_matrix
from lightllm.benchmark.simulator.scenarios import (
    MODES,
    SCENARIO_GROUPS,
    SCENARIOS,
    SEED_BUDGETS,
    ScenarioSpec,
    refuse_unread_seed,
    resolve_scenarios,
)
from lightllm.benchmark.simulator.soak import (
    MAX_SOAK_REQUESTS,
    SoakConfig,
    expected_soak_requests,
    run_soaks,
    soak_size_problem,
    soak_workload,
)
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import available_strategy_names


def _csv(text: str, flag: str) -> List[str]:
    if not text.replace(",", "").strip():
        return []  # the caller says what the flag must name
    try:
        return comma_items(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _names(text: str, flag: str, choices: Sequence[str]) -> List[str]:
    """The comma list ``text`` of ``flag``: at least one, each among ``choices``, none twice."""
    names = _csv(text, flag)
    if not names:
        raise ValueError(f"{flag} must name at least one of {', '.join(choices)}; got {text!r}")
    for name in names:
        if name not in choices:
            raise ValueError(f"{flag} must name some of {', '.join(choices)}; got {name!r}")
    refuse_repeated_values(names, flag)
    return names


def _budgets(value: Optional[str]) -> List[int]:
    """The budgets of ``--budget`` (a comma list; the seed's budgets when not given)."""
    if value is None:
        return list(SEED_BUDGETS)
    budgets: List[int] = []
    for part in _csv(value, "--budget"):
        try:
            budget = int(part)
        except ValueError:
            raise ValueError(f"--budget must be an integer number of tokens, got {part!r}") from None
        if budget < 1:
            raise ValueError(f"--budget must be >= 1, got {budget}")
        budgets.append(budget)
    if not budgets:
        raise ValueError(f"--budget must name at least one budget; got {value!r}")
    refuse_repeated_values(budgets, "--budget")
    return budgets


def _scenarios(value: Optional[str]) -> List[ScenarioSpec]:
    """The scenarios of ``--scenario`` (a comma list of scenarios and groups; seed_all when not given).

    A scenario named twice, also through a group that holds it (``seed_all,long_first``), is
    refused like every repeated value: it would be simulated and printed once only.
    """
    names = _csv("seed_all" if value is None else value, "--scenario")
    known = list(SCENARIOS) + list(SCENARIO_GROUPS)
    if not names:
        raise ValueError(f"--scenario must name at least one of {', '.join(known)}; got {value!r}")
    named_by: Dict[str, str] = {}
    for name in names:
        if name not in known:
            raise ValueError(f"--scenario must name some of {', '.join(known)}; got {name!r}")
        for member in SCENARIO_GROUPS.get(name, (name,)):
            if member in named_by:
                groups = [n for n in dict.fromkeys((named_by[member], name)) if n != member]
                via = f" ({' and '.join(groups)} hold{'s' if len(groups) == 1 else ''} it)" if groups else ""
                raise ValueError(f"--scenario names {member!r} twice{via}; name each once")
            named_by[member] = name
    return resolve_scenarios(names)


def _soak_config(args: argparse.Namespace, profile: CostProfile, budgets: List[int], modes: List[str]) -> SoakConfig:
    """The soak run the ``--soak-*`` flags describe; a bad value raises ValueError naming its flag."""
    defaults = SoakConfig(hours=1.0)
    if not (math.isfinite(args.soak_hours) and args.soak_hours > 0):
        raise ValueError(f"--soak-hours must be a finite number > 0, got {args.soak_hours}")
    if args.soak_load is not None and args.soak_rate is not None:
        raise ValueError("--soak-load and --soak-rate both set the soak stream's rate (--soak-rate overrides "
                         "--soak-load, which would be ignored); give one or the other")
    load = defaults.load if args.soak_load is None else args.soak_load
    if not 0 < load < 1:
        raise ValueError(f"--soak-load must be within (0, 1), got {load}")
    if args.soak_rate is not None and not (math.isfinite(args.soak_rate) and args.soak_rate > 0):
        raise ValueError(f"--soak-rate must be a finite number > 0, got {args.soak_rate}")
    long_len = defaults.long_len if args.soak_long_len is None else args.soak_long_len
    if long_len < 1:
        raise ValueError(f"--soak-long-len must be >= 1, got {long_len}")
    long_fraction = defaults.long_fraction if args.soak_long_fraction is None else args.soak_long_fraction
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"--soak-long-fraction must be within [0, 1], got {long_fraction}")
    if args.scenario is not None:
        raise ValueError("--scenario does not apply with --soak-hours (a soak run replaces the scenario tables)")
    for flag, given, values in (("--modes", args.modes, modes), ("--budget", args.budget, budgets)):
        if given is not None and len(values) > 1:
            raise ValueError(f"{flag} must name one value with --soak-hours (a soak run simulates one), got {values}")
    need = max(long_len, defaults.short_len) + defaults.output_len
    if need > profile.max_total_token_num:
        raise ValueError(
            f"--soak-long-len {long_len}: a request needs {need} KV tokens (prompt + {defaults.output_len} output), "
            f"more than the {profile.max_total_token_num} of --profile {args.profile}"
        )
    cfg = SoakConfig(
        hours=args.soak_hours,
        load=load,
        request_rate=args.soak_rate,
        long_len=long_len,
        long_fraction=long_fraction,
        budget=budgets[0],
        mode=modes[0],
        seed=args.seed,
        running_max_req_size=args.running_max_req_size,
        overtake_bound=overtake_bound_from_cli(args),
        mixed_batches=args.mixed_batches,
    )
    source = ("--soak-rate" if args.soak_rate is not None
              else f"{'--soak-load' if args.soak_load is not None else 'the default load'} {load:g} x the "
              f"capacity estimated from --profile {args.profile}")
    problem = soak_size_problem(profile, cfg, hours_name="--soak-hours", rate_source=source,
                                advice="lower --soak-hours or the rate")
    if problem is not None:
        raise ValueError(problem)
    # Drawn now (cheap next to simulating it) so an empty stream is refused in the flags' words.
    soak_workload(profile, cfg, hours_name="--soak-hours", rate_source=source,
                  advice=f"raise --soak-hours or {'--soak-rate' if args.soak_rate is not None else '--soak-load'}")
    return cfg


def build_parser() -> argparse.ArgumentParser:
    """The simulator's argument parser."""
    parser = OneLineErrorParser(
        prog="python -m lightllm.benchmark.simulator",
        description="Run the server's real scheduling code in virtual time with a step-cost model.",
    )
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"bundled profile ({', '.join(available_profiles())}) or a profile JSON path (default {DEFAULT_PROFILE})",
    )
    parser.add_argument(
        "--scenario",
        help="comma-separated scenarios or groups, each scenario named once: "
        f"{', '.join(list(SCENARIOS) + list(SCENARIO_GROUPS))} (default seed_all)",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(available_strategy_names()),
        help="comma-separated prefill-queue strategies (default: all registered)",
    )
    parser.add_argument(
        "--budget",
        help="comma-separated prefill budgets: batch_max_tokens = chunked_prefill_size "
        f"(default {','.join(map(str, SEED_BUDGETS))})",
    )
    parser.add_argument("--modes", help=f"comma-separated node kinds: {', '.join(MODES)} (default all; normal "
                        "with --soak-hours)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sustained workloads' arrivals (default 0; "
                        "refused when every selected scenario has its arrivals at fixed times)")
    parser.add_argument(
        "--running-max-req-size", type=int, default=256, help="router's running request cap (default 256)"
    )
    add_overtake_bound_arguments(parser)
    parser.add_argument(
        "--mixed-batches",
        action="store_true",
        help="run a normal node's decode rows inside its prefill forward, as the server does by default "
        "(off here: the H100 profile was fitted to the seed's engine, which runs them as two forwards; "
        "refused when every mode run is 1p1d, whose nodes never mix)",
    )
    # Checked while parsing: a run of every seed cell takes a while to lose at the end.
    parser.add_argument("--json", dest="json_path", type=output_file, help="also write the results as JSON here")
    parser.add_argument(
        "--markdown", dest="markdown_path", type=output_file, help="also write the Markdown report here"
    )
    soak = parser.add_argument_group("soak mode (replaces the scenario tables)")
    soak.add_argument("--soak-hours", type=float, help="simulate this many hours of sustained traffic per strategy")
    # The other soak flags default to None so that giving one without --soak-hours is noticed.
    soak.add_argument("--soak-load", type=float, help="fraction of estimated capacity (default 0.7)")
    soak.add_argument("--soak-rate", type=float, help="request rate in req/s, instead of --soak-load (at most "
                      f"{MAX_SOAK_REQUESTS:,} requests per strategy in all: rate x --soak-hours)")
    soak.add_argument("--soak-long-len", type=int, help="long prompt length (default 8192)")
    soak.add_argument("--soak-long-fraction", type=float, help="share of long requests (default 0.25)")
    return parser


_SOAK_ONLY_FLAGS = {"soak_load": "--soak-load", "soak_rate": "--soak-rate", "soak_long_len": "--soak-long-len",
                    "soak_long_fraction": "--soak-long-fraction"}


def run(args: argparse.Namespace, typed: Collection[str] = ()) -> tuple[str, Dict[str, Any]]:
    """Execute the parsed command; return the Markdown report and the JSON document.

    Every flag is checked before anything is simulated; a bad one raises ValueError naming it.
    ``typed``: the dests of the flags the command line wrote (a typed ``--seed`` that no selected
    scenario reads is refused).
    """
    profile = load_profile(args.profile)
    strategies = _names(args.strategies, "--strategies", available_strategy_names())
    modes = _names(",".join(MODES) if args.modes is None else args.modes, "--modes", MODES)
    budgets = _budgets(args.budget)
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.running_max_req_size < 1:
        raise ValueError(f"--running-max-req-size must be >= 1, got {args.running_max_req_size}")
    overtake_bound_from_cli(args)  # refuse bad values before any case runs
    if args.mixed_batches and all(mode == "1p1d" for mode in modes):
        raise ValueError("--mixed-batches changes nothing with --modes 1p1d: a PD pair runs no mixed batch (its "
                         "prefill node never decodes, its decode node never prefills); add normal to --modes or "
                         "drop --mixed-batches")
    for budget in budgets:
        # What the server refuses of --batch_max_tokens (the flag --budget stands for) is no setting to simulate.
        problem = budget_refusal(profile, args.profile, budget, args.running_max_req_size,
                                 mixed_normal_node=args.mixed_batches and "normal" in modes)
        if problem is not None:
            raise ValueError(problem)
    if args.soak_hours is not None:
        cfg = _soak_config(args, profile, budgets, modes)
        expected = expected_soak_requests(profile, cfg)

        def announce(strategy: str) -> None:
            # A soak of hours takes minutes of wall time: say what runs, as the scenario cells do.
            print(f"soaking {strategy}: {cfg.hours:g} simulated hours, about {expected:,.0f} requests", file=sys.stderr)

        soaks = run_soaks(profile, strategies, cfg, on_start=announce)
        return soak_markdown(profile, cfg, soaks), soak_json(profile, cfg, soaks)
    ignored = [flag for name, flag in _SOAK_ONLY_FLAGS.items() if getattr(args, name) is not None]
    if ignored:
        raise ValueError(f"{', '.join(ignored)} only appl{'y' if len(ignored) > 1 else 'ies'} with --soak-hours")
    scenarios = _scenarios(args.scenario)
    if "seed" in typed:
        refuse_unread_seed(scenarios)
    for scenario in scenarios:
        # A request that can never fit the KV cache stalls the simulation after a while; say so now.
        try:
            check_fits_kv(profile, scenario.build(args.seed), f"scenario {scenario.name}")
        except ValueError as exc:
            raise ValueError(f"--profile {args.profile}: {exc}") from None

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


@interruptible("nothing was written")
def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point; bad arguments exit with status 2 and a one-line error.

    The output files are written before the report is printed: a reader that closes stdout
    early (``| head -1``) ends the printing quietly, and a simulation of minutes is not lost.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)  # the output paths are checked here, before the run
    try:
        refuse_same_output([("--json", args.json_path), ("--markdown", args.markdown_path)])
        markdown, document = run(args, given_flags(parser, argv))
        json_text = strict_json(document) if args.json_path else ""
    except ValueError as exc:
        parser.error(str(exc))
    write_outputs_or_exit(parser, [("--markdown", args.markdown_path, markdown), ("--json", args.json_path, json_text)])
    print_report(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
