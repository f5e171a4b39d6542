"""Markdown tables, the one format every benchmark and simulator report writes."""

from __future__ import annotations

from typing import List, Sequence


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    """Lines of a Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines
