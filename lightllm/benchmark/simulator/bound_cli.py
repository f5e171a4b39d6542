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
    # Defaults are filled in by overtake_bound_from_cli: None tells a typed value from none.
    parser.add_argument(
        "--prefill-max-overtake-tokens",
        type=non_negative_int,
        default=None,
        help=f"the server's --prefill_max_overtake_tokens: an integer >= 0 (default {default.base_tokens})",
    )
    parser.add_argument(
        "--prefill-overtake-fraction",
        type=non_negative_float,
        default=None,
        help=f"the server's --prefill_overtake_fraction: a number >= 0 (default {default.fraction:g})",
    )
    parser.add_argument(
        "--disable-prefill-overtake-bound",
        action="store_true",
        help="the server's --disable_prefill_overtake_bound: strategies overtake without limit",
    )


def overtake_bound_from_cli(args: argparse.Namespace) -> OvertakeBoundSpec:
    """The bound the parsed flags describe; invalid values raise ``ValueError`` naming this command's flag.

    A bound value with the off switch is refused, as the server refuses it: it would be ignored.
    """
    base, fraction = args.prefill_max_overtake_tokens, args.prefill_overtake_fraction
    if args.disable_prefill_overtake_bound:
        given = [flag for value, flag in ((base, _FLAGS["prefill_max_overtake_tokens"]),
                                          (fraction, _FLAGS["prefill_overtake_fraction"])) if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} set{'s' if len(given) == 1 else ''} the overtaking bound, "
                             "which --disable-prefill-overtake-bound turns off; give one or the other")
        return OvertakeBoundSpec.off()
    default = OvertakeBoundSpec()
    try:
        return OvertakeBoundSpec(default.base_tokens if base is None else base,
                                 default.fraction if fraction is None else fraction)
    except ValueError as exc:
        message = str(exc)
        for server_name, flag in _FLAGS.items():
            message = message.replace(server_name, flag)
        raise ValueError(message) from None
