"""Docs stay in step with the code: generated argument reference, same structure in CN and EN."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightllm.server.launch.args_doc import doc_path, render

ROOT = Path(__file__).resolve().parents[3]


def test_server_args_reference_is_generated_from_the_parser():
    for lang in ("EN", "CN"):
        assert doc_path(ROOT, lang).read_text() == render(lang), (
            f"docs/{lang}/server_args.md is stale: run python -m lightllm.server.launch.args_doc"
        )


def test_the_reference_shows_help_text_as_help_prints_it():
    # argparse's "%%" is one "%" on the screen: a reader copying fe80::1%%eth0 got a wrong zone.
    for lang in ("EN", "CN"):
        text = render(lang)
        assert "%%" not in text and "fe80::1%eth0" in text


def test_args_doc_help_and_check_write_nothing():
    """``--help`` and ``--check`` only read: running the tool to learn its usage must not rewrite the docs."""
    before = {lang: doc_path(ROOT, lang).stat().st_mtime_ns for lang in ("EN", "CN")}
    for args in (["--help"], ["--check"]):
        done = subprocess.run([sys.executable, "-m", "lightllm.server.launch.args_doc", *args],
                              capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr
    assert "--check" in subprocess.run([sys.executable, "-m", "lightllm.server.launch.args_doc", "--help"],
                                       capture_output=True, text=True, cwd=ROOT).stdout
    assert {lang: doc_path(ROOT, lang).stat().st_mtime_ns for lang in ("EN", "CN")} == before


def test_reference_lists_every_strategy():
    text = render("EN")
    assert "`--prefill_queue_strategy`" in text
    for name in ("default", "promote_shortest", "hrrn"):
        assert name in text


def test_cn_and_en_have_the_same_pages_and_heading_structure():
    en = sorted(p.name for p in (ROOT / "docs" / "EN").glob("*.md"))
    cn = sorted(p.name for p in (ROOT / "docs" / "CN").glob("*.md"))
    assert en == cn
    for name in en:
        levels = []
        for lang in ("EN", "CN"):
            text = (ROOT / "docs" / lang / name).read_text()
            text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
            levels.append([len(m.group(1)) for m in re.finditer(r"^(#+) ", text, re.MULTILINE)])
        assert levels[0] == levels[1], f"{name}: heading levels differ between EN and CN"


def test_every_page_is_in_the_table_of_contents():
    for lang in ("EN", "CN"):
        index = (ROOT / "docs" / lang / "index.md").read_text()
        listed = set(re.findall(r"^([a-z_]+)$", index.split("```{toctree}", 1)[1], re.MULTILINE))
        pages = {p.stem for p in (ROOT / "docs" / lang).glob("*.md")} - {"index"}
        assert pages == listed, f"docs/{lang}/index.md toctree differs from the pages: {sorted(pages ^ listed)}"


@pytest.mark.skipif(importlib.util.find_spec("sphinx") is None, reason="sphinx not installed (requirements-test.txt)")
@pytest.mark.parametrize("lang", ["EN", "CN"])
def test_docs_build_without_warnings(lang: str, tmp_path: Path):
    # html, not a cheaper builder: it resolves every cross-page `page.md#heading` link, which is
    # what breaks when a heading is renamed.
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
           str(ROOT / "docs" / lang), str(tmp_path / "html")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"sphinx-build -W failed for docs/{lang}:\n{proc.stderr}{proc.stdout}"


@pytest.mark.parametrize("module", ["bench_serving", "compare_strategies"])
@pytest.mark.parametrize("language", ["EN", "CN"])
def test_every_flag_of_the_benchmark_tools_is_documented(module, language):
    # Several flags were named only by --help; benchmark.md is where users look for them.
    parser = importlib.import_module(f"lightllm.benchmark.{module}").build_parser()
    text = (ROOT / "docs" / language / "benchmark.md").read_text(encoding="utf-8")
    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    missing = [flag for flag in flags if flag != "--help" and not re.search(re.escape(flag) + r"(?![\w-])", text)]
    assert missing == [], f"docs/{language}/benchmark.md does not name {module}'s {missing}"
