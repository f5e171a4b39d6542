"""The overtaking bound's flags on the simulator's command lines (the server's, in dashed form)."""

from __future__ import annotations

import argparse

from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec


def add_overtake_bound_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--prefill-max-overtake-tokens``, ``--prefill-overtake-fraction`` and the off switch."""
    default = OvertakeBoundSpec()
    parser.add_argument(
        "--prefill-max-overtake-tokens",
        type=int,
        default=default.base_tokens,
        help=f"the server's --prefill_max_overtake_tokens (default {default.base_tokens})",
    )
    parser.add_argument(
        "--prefill-overtake-fraction",
        type=float,
        default=default.fraction,
        help=f"the server's --prefill_overtake_fraction (default {default.fraction:g})",
    )
    parser.add_argument(
        "--disable-prefill-overtake-bound",
        action="store_true",
        help="the server's --disable_prefill_overtake_bound: strategies overtake without limit",
    )


def overtake_bound_from_cli(args: argparse.Namespace) -> OvertakeBoundSpec:
    """The bound the parsed flags describe; invalid values raise ``ValueError`` naming the flag."""
    if args.disable_prefill_overtake_bound:
        return OvertakeBoundSpec.off()
    return OvertakeBoundSpec(args.prefill_max_overtake_tokens, args.prefill_overtake_fraction)
