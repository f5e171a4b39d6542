"""Sweep the overtaking bound's two parameters over the cells that decide its default.

For each ``(base_tokens, fraction)`` pair (and the bound off), every listed cell (scenario, node
kind, budget) is simulated with ``default`` and each strategy; the table gives each strategy's
short TTFT P95, long TTFT P95 and long E2E P95 change versus ``default`` in the same cell.  The
default flags were chosen from this table (docs/EN/results.md, "Choosing the overtaking bound")::

    python -m lightllm.benchmark.simulator.bound_sweep --profile h100_qwen_0p8b
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from lightllm.utils.interrupts import interruptible
from lightllm.benchmark.cli_args import OneLineErrorParser, given_flags, refuse_repeated_values
from lightllm.benchmark.simulator.bound_cli import add_replaced_wait_flag, server_limit_problem
from lightllm.benchmark.simulator.cost_model import DEFAULT_PROFILE, available_profiles, load_profile
from lightllm.benchmark.simulator.runner import CostProfile, budget_refusal, case_metrics, check_fits_kv, simulate_workload
from lightllm.benchmark.simulator.scenarios import MODES, SCENARIOS, refuse_unread_seed
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import available_strategy_names
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec

# (scenario, mode, budget): the seed's headline cells and the starvation case it warned about.
DEFAULT_CELLS: Tuple[Tuple[str, str, int], ...] = (
    ("sustained", "1p1d", 1024),
    ("sustained", "normal", 1024),
    ("long_first", "normal", 1024),
    ("interleaved", "normal", 1024),
    ("long_then_stream", "1p1d", 1024),
    ("long_then_stream", "normal", 1024),
)
# The shipped default (2048 + 0.15) and its neighbours.
DEFAULT_BASES: Tuple[int, ...] = (2048, 16384, 65536)
DEFAULT_FRACTIONS: Tuple[float, ...] = (0.1, 0.15, 0.25)
METRICS = ("short_ttft_p95_ms", "long_ttft_p95_ms", "long_e2e_p95_ms")


def _change(value: Optional[float], base: Optional[float]) -> Optional[float]:
    if value is None or not base:
        return None
    return 100.0 * (value / base - 1.0)


def sweep(
    profile: CostProfile,
    bounds: Sequence[OvertakeBoundSpec],
    cells: Sequence[Tuple[str, str, int]] = DEFAULT_CELLS,
    strategies: Sequence[str] = ("hrrn",),
    seed: int = 0,
) -> List[Dict[str, object]]:
    """One row per (bound, cell, strategy) with the three changes versus ``default`` in percent."""
    rows: List[Dict[str, object]] = []
    for scenario, mode, budget in cells:
        workload = SCENARIOS[scenario].build(seed)
        # default never moves under the bound, so one run per cell is its baseline for every bound.
        base, _ = case_metrics(simulate_workload(profile, workload, "default", mode, budget)[0])
        for bound in bounds:
            for strategy in strategies:
                records, _ = simulate_workload(profile, workload, strategy, mode, budget, overtake_bound=bound)
                got, _ = case_metrics(records)
                row: Dict[str, object] = {
                    "bound": bound.describe(),
                    "scenario": scenario,
                    "mode": mode,
                    "budget": budget,
                    "strategy": strategy,
                }
                for metric in METRICS:
                    row[metric] = _change(got[metric], base[metric])
                rows.append(row)
    return rows


def sweep_markdown(rows: Sequence[Dict[str, object]]) -> str:
    """The sweep as one Markdown table: a row per bound and strategy, a column group per cell."""
    cells: List[Tuple[str, str, int]] = []
    for row in rows:
        cell = (row["scenario"], row["mode"], row["budget"])
        if cell not in cells:
            cells.append(cell)  # type: ignore[arg-type]
    keys: List[Tuple[str, str]] = []
    table: Dict[Tuple[str, str], Dict[Tuple[str, str, int], Dict[str, object]]] = {}
    for row in rows:
        key = (str(row["bound"]), str(row["strategy"]))
        if key not in table:
            keys.append(key)
            table[key] = {}
        table[key][(row["scenario"], row["mode"], row["budget"])] = row  # type: ignore[index]
    head = ["bound", "strategy"] + [f"{s} {m}/{b}: short TTFT P95 / long TTFT P95 / long E2E P95" for s, m, b in cells]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for key in keys:
        parts = list(key)
        for cell in cells:
            row = table[key].get(cell)
            parts.append(" / ".join(_pct(row.get(m)) for m in METRICS) if row else "")
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines)


def _pct(value: object) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"


def _number(kind: type, text: str, flag: str):
    """``kind(text)``, or a ValueError naming ``flag``."""
    try:
        return kind(text.strip())
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of {kind.__name__}s; got {text!r}") from None


def _parse_cells(text: str) -> List[Tuple[str, str, int]]:
    cells = []
    for part in text.split(","):
        fields = part.strip().split("/")
        if len(fields) != 3 or not fields[2].isdigit():
            raise ValueError(f"--cells: a cell is scenario/mode/budget, e.g. sustained/1p1d/1024; got {part!r}")
        scenario, mode, budget = fields
        if scenario not in SCENARIOS:
            raise ValueError(f"--cells: cell scenario must be one of {', '.join(SCENARIOS)}; got {scenario!r}")
        if mode not in MODES:
            raise ValueError(f"--cells: cell mode must be one of {', '.join(MODES)}; got {mode!r}")
        if int(budget) < 1:
            raise ValueError(f"--cells: cell budget must be >= 1; got {part!r}")
        cells.append((scenario, mode, int(budget)))
    refuse_repeated_values(cells, "--cells")
    return cells


def build_parser() -> argparse.ArgumentParser:
    """The bound sweep's argument parser."""
    parser = OneLineErrorParser(
        prog="python -m lightllm.benchmark.simulator.bound_sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"bundled profile ({', '.join(available_profiles())}) or a profile JSON path (default {DEFAULT_PROFILE})",
    )
    parser.add_argument(
        "--bases",
        default=",".join(map(str, DEFAULT_BASES)),
        help="comma list of the bound's base tokens (--prefill_max_overtake_tokens), each an integer >= 0 "
        "up to the server's limit "
        f"(default {','.join(map(str, DEFAULT_BASES))})",
    )
    parser.add_argument(
        "--fractions",
        default=",".join(map(str, DEFAULT_FRACTIONS)),
        help="comma list of the bound's fractions (--prefill_overtake_fraction), each a number >= 0 "
        "up to the server's limit "
        f"(default {','.join(map(str, DEFAULT_FRACTIONS))})",
    )
    parser.add_argument(
        "--cells",
        default=",".join(f"{s}/{m}/{b}" for s, m, b in DEFAULT_CELLS),
        help="comma list of cells to simulate, each scenario/mode/budget (default: the seed's headline cells)",
    )
    parser.add_argument(
        "--strategies", default="hrrn,promote_shortest",
        help="comma list of strategies compared with default (not default itself; default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sustained workloads' arrivals (default 0; "
                        "refused when every cell's scenario has its arrivals at fixed times)")
    add_replaced_wait_flag(parser, "sweep the overtaking bound with --bases and --fractions",
                           "replaced by --bases and --fractions (the overtaking bound) and refused")
    return parser


def _bounds(bases: Sequence[int], fractions: Sequence[float]) -> List[OvertakeBoundSpec]:
    """The bound off, then every (base, fraction) pair; a bad value raises ValueError naming its flag."""
    for base in bases:
        if base < 0:
            raise ValueError(f"--bases takes integers >= 0; got {base}")
        problem = server_limit_problem("prefill_max_overtake_tokens", base)
        if problem is not None:
            raise ValueError(f"--bases: each base {problem}; got {base}")
    for fraction in fractions:
        if not (math.isfinite(fraction) and fraction >= 0):
            raise ValueError(f"--fractions takes finite numbers >= 0; got {fraction}")
        problem = server_limit_problem("prefill_overtake_fraction", fraction)
        if problem is not None:
            raise ValueError(f"--fractions: each fraction {problem}; got {fraction:g}")
    return [OvertakeBoundSpec.off()] + [OvertakeBoundSpec(base, fraction) for base in bases for fraction in fractions]


@interruptible("nothing was written")
def main(argv: Optional[List[str]] = None) -> int:
    """CLI entry point; bad arguments exit with status 2 and a one-line error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        bases = [_number(int, base, "--bases") for base in args.bases.split(",")]
        fractions = [_number(float, fraction, "--fractions") for fraction in args.fractions.split(",")]
        refuse_repeated_values(bases, "--bases")
        refuse_repeated_values(fractions, "--fractions")
        bounds = _bounds(bases, fractions)
        cells = _parse_cells(args.cells)
        profile = load_profile(args.profile)
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        unknown = [s for s in strategies if s not in available_strategy_names()]
        if unknown or not strategies:
            raise ValueError(f"--strategies must name some of {', '.join(available_strategy_names())}; "
                             f"got {args.strategies!r}")
        refuse_repeated_values(strategies, "--strategies")
        if "default" in strategies:
            raise ValueError("--strategies names default, which every row is compared with: its rows would "
                             "compare default with itself; name the other strategies only")
        if args.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {args.seed}")
        if "seed" in given_flags(parser, argv):
            refuse_unread_seed([SCENARIOS[name] for name in dict.fromkeys(cell[0] for cell in cells)])
        for scenario, mode, budget in cells:
            problem = budget_refusal(profile, args.profile, budget,
                                     budget_name=f"the budget of --cells {scenario}/{mode}/{budget}")
            if problem is not None:
                raise ValueError(problem)
        for scenario in sorted({cell[0] for cell in cells}):
            try:
                check_fits_kv(profile, SCENARIOS[scenario].build(args.seed), f"scenario {scenario}")
            except ValueError as exc:
                raise ValueError(f"--profile {args.profile}: {exc}") from None
    except ValueError as exc:
        parser.error(str(exc))
    rows = sweep(profile, bounds, cells, strategies, args.seed)
    print(sweep_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
