"""The overtaking bound's flags on the simulator's command lines (the server's, in dashed form)."""

from __future__ import annotations

import argparse

from lightllm.benchmark.cli_args import non_negative_float, non_negative_int
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec

# The server's spelling (in OvertakeBoundSpec's refusals) -> this command line's flag.
_FLAGS = {
    "prefill_max_overtake_tokens": "--prefill-max-overtake-tokens",
    "prefill_overtake_fraction": "--prefill-overtake-fraction",
}


def add_overtake_bound_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--prefill-max-overtake-tokens``, ``--prefill-overtake-fraction`` and the off switch."""
    default = OvertakeBoundSpec()
    parser.add_argument(
        "--prefill-max-overtake-tokens",
        type=non_negative_int,
        default=default.base_tokens,
        help=f"the server's --prefill_max_overtake_tokens: an integer >= 0 (default {default.base_tokens})",
    )
    parser.add_argument(
        "--prefill-overtake-fraction",
        type=non_negative_float,
        default=default.fraction,
        help=f"the server's --prefill_overtake_fraction: a number >= 0 (default {default.fraction:g})",
    )
    parser.add_argument(
        "--disable-prefill-overtake-bound",
        action="store_true",
        help="the server's --disable_prefill_overtake_bound: strategies overtake without limit",
    )


def overtake_bound_from_cli(args: argparse.Namespace) -> OvertakeBoundSpec:
    """The bound the parsed flags describe; invalid values raise ``ValueError`` naming this command's flag."""
    if args.disable_prefill_overtake_bound:
        return OvertakeBoundSpec.off()
    try:
        return OvertakeBoundSpec(args.prefill_max_overtake_tokens, args.prefill_overtake_fraction)
    except ValueError as exc:
        message = str(exc)
        for server_name, flag in _FLAGS.items():
            message = message.replace(server_name, flag)
        raise ValueError(message) from None
