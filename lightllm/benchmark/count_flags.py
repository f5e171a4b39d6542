"""An argparse type for counts that must be at least one (threads, streams' tokens, rows).

Beside :func:`~lightllm.benchmark.cli_args.non_negative_int`: a count of zero would measure
nothing (zero-token streams are refused by the server) or hand torch a meaningless thread count.
"""

from __future__ import annotations

import argparse

from lightllm.benchmark.cli_args import non_negative_int


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value
