"""Server flags for unit tests, parsed by the real parser so every flag has the parser's default.

The server code reads ``args.name`` for every flag the parser defines; a hand-built partial
``argparse.Namespace`` would lack some of them, and a default copied into a test could drift from
the parser's.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightllm.server.launch.arg_parser import make_argument_parser


def server_args(model_dir: str = "/m", **overrides: Any) -> argparse.Namespace:
    """The parsed flags of ``--model_dir MODEL_DIR`` with ``overrides`` set on them.

    An override must name a flag the parser defines (``KeyError`` otherwise), so a misspelt name
    cannot add an attribute the server never reads. The namespace carries no ``given_flags``: a
    flag counts as given when its value differs from the parser's default (``flags_given``).
    """
    args = make_argument_parser().parse_args(["--model_dir", str(model_dir)])
    unknown = sorted(name for name in overrides if not hasattr(args, name))
    if unknown:
        raise KeyError(f"not server flags: {', '.join(unknown)}")
    for name, value in overrides.items():
        setattr(args, name, value)
    return args
