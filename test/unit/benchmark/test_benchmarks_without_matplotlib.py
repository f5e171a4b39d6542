"""The benchmark tools without matplotlib (a test/plotting extra, not in requirements-cpu.txt).

``compare_strategies --help`` died with ``ModuleNotFoundError: No module named 'matplotlib'``:
the report writer imported it at the top.  matplotlib is now imported only when a plot is
drawn; without it a comparison says so in one line before any server starts and writes its JSON
and Markdown reports without the PNGs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightllm.benchmark import compare_strategies
from lightllm.benchmark.report_writer import plots_unavailable, render_markdown, write_report

REPO = Path(__file__).resolve().parents[3]
# Run before anything else in the child: None in sys.modules makes every `import matplotlib` fail.
BLOCK = "import sys; sys.modules['matplotlib'] = None\n"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=300,
                          cwd=REPO)


def test_compare_strategies_help_runs_without_matplotlib():
    proc = _python("import runpy; sys.argv = ['compare_strategies', '--help']\n"
                   "runpy.run_module('lightllm.benchmark.compare_strategies', run_name='__main__')")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--prefill-args" in proc.stdout


def test_every_benchmark_module_imports_without_matplotlib():
    proc = _python(
        "import importlib, pkgutil, lightllm.benchmark as package\n"
        "for info in pkgutil.walk_packages(package.__path__, 'lightllm.benchmark.'):\n"
        "    importlib.import_module(info.name)\n"
        "print('imported')")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "imported" in proc.stdout, proc.stderr[-3000:]


def _report() -> dict:
    meta = {"model_dir": "/m", "strategies": ["default"], "baseline": "default", "repeats": 1, "warmup": 0,
            "server_args": [], "topology": {"name": "normal"}}
    section = {"workload": {"name": "long_first", "long_count": 1, "long_len": 8, "long_spread_ms": 0.0,
                            "short_count": 1, "short_len": 4, "short_start_ms": 0.0, "short_spread_ms": 0.0,
                            "output_len": 2},
               "medians": {"default": {"output_throughput": 10.0}}, "values": {"default": {"output_throughput": [10.0]}},
               "changes": {}, "failed": {"default": 0}}
    return {"meta": meta, "workloads": {"long_first": section}}


def test_the_report_is_written_without_the_plots_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "matplotlib cannot be imported" in plots_unavailable()
    paths = write_report(_report(), tmp_path, {"long_first": {"default": {"short": [1.0], "long": [2.0]}}})
    assert set(paths) == {"json", "markdown"} and not list(tmp_path.glob("*.png"))
    saved = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert "matplotlib cannot be imported" in saved["meta"]["plots_not_written"]
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert markdown == render_markdown(saved) and "- Plots not written: matplotlib cannot be imported" in markdown


def test_the_comparison_says_so_before_any_server_starts(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    seen: list[str] = []

    def run_comparison(*_args, **_kwargs):
        seen.append(capsys.readouterr().err)  # what was printed before the servers would start
        raise KeyboardInterrupt

    monkeypatch.setattr(compare_strategies, "run_comparison", run_comparison)
    argv = ["--model_dir", str(tmp_path), "--workload", "long_first", "--out-dir", str(tmp_path / "out")]
    assert compare_strategies.main(argv) == 130
    [note] = seen[0].splitlines()
    assert note.startswith("note: the PNG plots will not be written: matplotlib cannot be imported")
    assert "report.json and report.md will be" in note


@pytest.mark.skipif(plots_unavailable() is not None, reason="matplotlib is not installed here")
def test_with_matplotlib_the_plots_are_written_and_nothing_is_said(tmp_path):
    paths = write_report(_report(), tmp_path, {"long_first": {"default": {"short": [1.0], "long": [2.0]}}})
    assert sorted(Path(path).name for path in paths.values() if path.endswith(".png")) == [
        "throughput_long_first.png", "ttft_cdf_long_first.png"]
    assert "plots_not_written" not in json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))["meta"]


def test_a_plot_that_fails_to_import_while_drawing_still_leaves_the_report(tmp_path, monkeypatch):
    # A broken install found only when drawing must not lose the measured run.
    from lightllm.benchmark import report_writer

    def broken(*_args, **_kwargs):
        raise ImportError("numpy.core.multiarray failed to import")

    monkeypatch.setattr(report_writer, "plots_unavailable", lambda: None)
    monkeypatch.setattr(report_writer, "_write_plots", broken)
    paths = write_report(_report(), tmp_path, {"long_first": {"default": {"short": [1.0], "long": [2.0]}}})
    assert set(paths) == {"json", "markdown"}
    saved = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert "matplotlib failed while drawing (numpy.core.multiarray" in saved["meta"]["plots_not_written"]
