"""The launcher's exit codes: one module defines them, and the failure-handling pages list exactly them.

Scripts and orchestrators read these codes, so docs/*/failure_handling.md's table is a promise: a
code added, removed or renumbered in ``lightllm/server/launch/exit_codes.py`` must change the table,
and the page must name the module the codes live in (it named a transport module after they left it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List

import pytest

from lightllm.server.launch import exit_codes

ROOT = Path(__file__).resolve().parents[3]
SECTION = {"EN": "## Exit codes", "CN": "## 退出码"}


def _defined() -> Dict[str, int]:
    return {name: value for name, value in vars(exit_codes).items() if name.startswith("EXIT_")}


def _section(lang: str) -> str:
    text = (ROOT / "docs" / lang / "failure_handling.md").read_text()
    start = text.index(SECTION[lang])
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _listed_codes(lang: str) -> List[int]:
    return [int(code) for code in re.findall(r"^\| (\d+) \|", _section(lang), re.MULTILINE)]


def test_each_code_has_one_name() -> None:
    defined = _defined()
    assert len(set(defined.values())) == len(defined), defined


@pytest.mark.parametrize("lang", sorted(SECTION))
def test_the_page_lists_exactly_the_defined_codes(lang: str) -> None:
    assert _listed_codes(lang) == sorted(_defined().values())


@pytest.mark.parametrize("lang", sorted(SECTION))
def test_the_page_names_the_module_that_defines_them(lang: str) -> None:
    named = re.findall(r"`(lightllm/[\w/]+\.py)`\s*[(（]`EXIT_\*`", _section(lang))
    assert named == ["lightllm/server/launch/exit_codes.py"]
    assert (ROOT / named[0]).is_file()
