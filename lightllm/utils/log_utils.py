"""Logging set-up shared by every process of the server."""

from __future__ import annotations

import logging


def init_logging(level: str = "info") -> None:
    """Configure the root logger once per process."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        force=True,
    )
