"""The strategy guide's worked example is what its code prints, in both languages.

The table once showed selections that the planner as the server builds it (repeated chunks
deferred) did not make; the snippet now prints them, and this test runs it against the table.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[3] / "docs"
_IDS = {"A": 101, "B": 102, "C": 103, "D": 104, "E": 105}


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else None]


@pytest.mark.parametrize(("language", "heading"), [("EN", "## Worked example"), ("CN", "## 示例")])
def test_the_worked_example_table_is_what_its_snippet_prints(language: str, heading: str) -> None:
    text = (DOCS / language / "prefill_queue_strategy.md").read_text(encoding="utf-8")
    if heading not in text:
        pytest.fail(f"{language}: no section {heading!r}")
    section = _section(text, heading)
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, f"{language} worked example", "exec"), {})  # noqa: S102 - the doc's own code
    printed = {}
    for line in out.getvalue().splitlines():
        name, rest = line.split(" ", 1)
        printed[name] = rest
    rows = re.findall(r"^\| `(\w+)` \| ([A-E, ]+) \| ([A-E0-9, ]+) \| ([A-E, ]*) \|$", section, re.M)
    assert {row[0] for row in rows} == set(printed), (rows, printed)
    for name, order, chunks, skipped in rows:
        expected_order = [_IDS[letter] for letter in order.split(", ")]
        expected_chunks = [(_IDS[part.split()[0]], int(part.split()[1])) for part in chunks.split(", ")]
        expected_skipped = [_IDS[letter] for letter in skipped.split(", ") if letter]
        assert printed[name] == f"{expected_order} {expected_chunks} {expected_skipped}", name
