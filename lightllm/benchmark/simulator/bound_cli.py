"""The overtaking bound's flags on the simulator's command lines (the server's, in dashed form).

They take exactly the values the server takes: :data:`SERVER_LIMITS` holds the server's upper
limits (``MAX_PREFILL_OVERTAKE_TOKENS`` and ``MAX_PREFILL_OVERTAKE_FRACTION``, defined beside the
bound in the scheduling core, where the server's parser reads them too), so a value the server
refuses is refused here too, in one line, rather than simulated until the allowance overflows.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional, Union

from lightllm.benchmark.cli_args import non_negative_float, non_negative_int
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import (
    MAX_PREFILL_OVERTAKE_FRACTION,
    MAX_PREFILL_OVERTAKE_TOKENS,
    OvertakeBoundSpec,
)

# The server's spelling (in OvertakeBoundSpec's refusals) -> this command line's flag.
_FLAGS = {
    "prefill_max_overtake_tokens": "--prefill-max-overtake-tokens",
    "prefill_overtake_fraction": "--prefill-overtake-fraction",
}
# The server's upper limit of each bound flag, by the server's spelling.
SERVER_LIMITS: Dict[str, Union[int, float]] = {
    "prefill_max_overtake_tokens": MAX_PREFILL_OVERTAKE_TOKENS,
    "prefill_overtake_fraction": MAX_PREFILL_OVERTAKE_FRACTION,
}


def _limit_text(limit: Union[int, float]) -> str:
    # As the server writes it: 1,000,000,000,000 tokens, a fraction of 1000.
    return f"{limit:,}" if isinstance(limit, int) else f"{limit:g}"


def server_limit_problem(server_name: str, value: Union[int, float]) -> Optional[str]:
    """Why ``value`` of the server flag ``server_name`` (``prefill_overtake_fraction``) is past the
    server's upper limit, as ``"must be at most 1000, the server's limit"`` (None when it is not)."""
    limit = SERVER_LIMITS[server_name]
    if value > limit:
        return f"must be at most {_limit_text(limit)}, the server's limit of --{server_name}"
    return None


# The former waiting bound's flag: refused naming what replaced it on the command at hand, as the
# server refuses its own.
REPLACED_WAIT_FLAG_PREFIX = "--prefill-max-wait-tokens was replaced by the overtaking bound: "
BOUND_FLAGS_REPLACEMENT = ("use --prefill-max-overtake-tokens and --prefill-overtake-fraction "
                           "(or --disable-prefill-overtake-bound)")


class _RefuseReplacedWaitFlag(argparse.Action):
    """Refuses the flag in any form with ``REPLACED_WAIT_FLAG_PREFIX`` + the command's ``replacement``."""

    def __init__(self, *args: Any, replacement: str = BOUND_FLAGS_REPLACEMENT, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replacement = replacement

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: Optional[str] = None) -> None:
        parser.error(REPLACED_WAIT_FLAG_PREFIX + self.replacement)


def add_replaced_wait_flag(parser: argparse.ArgumentParser, replacement: str = BOUND_FLAGS_REPLACEMENT,
                           help_text: str = "replaced by the two flags below and refused (the former waiting bound)"
                           ) -> None:
    """Add the former ``--prefill-max-wait-tokens``, refused in any form naming ``replacement``: what this
    command offers instead (its own flags; the bound flags by default)."""
    parser.add_argument("--prefill-max-wait-tokens", nargs="?", action=_RefuseReplacedWaitFlag, metavar="N",
                        replacement=replacement, help=help_text)


def add_overtake_bound_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--prefill-max-overtake-tokens``, ``--prefill-overtake-fraction`` and the off switch
    (and the replaced ``--prefill-max-wait-tokens``, refused naming them)."""
    add_replaced_wait_flag(parser)
    default = OvertakeBoundSpec()
    # Defaults are filled in by overtake_bound_from_cli: None tells a typed value from none.
    parser.add_argument(
        "--prefill-max-overtake-tokens",
        type=non_negative_int,
        default=None,
        help=f"the server's --prefill_max_overtake_tokens: an integer from 0 to "
        f"{_limit_text(SERVER_LIMITS['prefill_max_overtake_tokens'])} (default {default.base_tokens})",
    )
    parser.add_argument(
        "--prefill-overtake-fraction",
        type=non_negative_float,
        default=None,
        help=f"the server's --prefill_overtake_fraction: a number from 0 to "
        f"{_limit_text(SERVER_LIMITS['prefill_overtake_fraction'])} (default {default.fraction:g})",
    )
    parser.add_argument(
        "--disable-prefill-overtake-bound",
        action="store_true",
        help="the server's --disable_prefill_overtake_bound: strategies overtake without limit",
    )


def overtake_bound_from_cli(args: argparse.Namespace) -> OvertakeBoundSpec:
    """The bound the parsed flags describe; invalid values raise ``ValueError`` naming this command's flag.

    A bound value with the off switch is refused, as the server refuses it: it would be ignored.
    So is a value past the server's limit (:func:`server_limit_problem`).
    """
    base, fraction = args.prefill_max_overtake_tokens, args.prefill_overtake_fraction
    if args.disable_prefill_overtake_bound:
        given = [flag for value, flag in ((base, _FLAGS["prefill_max_overtake_tokens"]),
                                          (fraction, _FLAGS["prefill_overtake_fraction"])) if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} set{'s' if len(given) == 1 else ''} the overtaking bound, "
                             "which --disable-prefill-overtake-bound turns off; give one or the other")
        return OvertakeBoundSpec.off()
    for server_name, value in (("prefill_max_overtake_tokens", base), ("prefill_overtake_fraction", fraction)):
        problem = None if value is None else server_limit_problem(server_name, value)
        if problem is not None:
            raise ValueError(f"{_FLAGS[server_name]} {problem} (for no bound use --disable-prefill-overtake-bound), "
                             f"got {value!r}")
    default = OvertakeBoundSpec()
    try:
        return OvertakeBoundSpec(default.base_tokens if base is None else base,
                                 default.fraction if fraction is None else fraction)
    except ValueError as exc:
        message = str(exc)
        for server_name, flag in _FLAGS.items():
            message = message.replace(server_name, flag)
        raise ValueError(message) from None
