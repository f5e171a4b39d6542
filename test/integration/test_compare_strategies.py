"""End to end: the strategy-comparison CLI starts real servers, measures, and writes its report.

Only the structure of what it writes is checked; timing values never decide the result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightllm.benchmark.comparison_metrics import COMPARISON_METRICS

STRATEGIES = ["default", "promote_shortest", "hrrn"]
REPEATS = 2


@pytest.fixture(scope="module")
def comparison(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    cmd = [
        sys.executable, "-m", "lightllm.benchmark.compare_strategies",
        "--model_dir", str(tiny_llama_dir),
        "--workload", "long_first",
        "--long-count", "3", "--long-len", "300", "--short-count", "3", "--short-len", "16", "--output-len", "4",
        "--strategies", ",".join(STRATEGIES),
        "--repeats", str(REPEATS), "--warmup", "1", "--settle", "0.1",
        "--server-args", "--chunked_prefill_size 32 --batch_max_tokens 32 --running_max_req_size 32 --max_total_token_num 8192",
        "--out-dir", str(out), "--seed", "5",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    return out, report, proc.stdout


def test_report_files_exist(comparison):
    out, report, _ = comparison
    for name in ("report.json", "report.md", "ttft_cdf_long_first.png", "throughput_long_first.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "ttft_cdf_long_first.png").read_bytes()[:4] == b"\x89PNG"
    assert set(report["files"].values()) >= {"report.json", "report.md", "ttft_cdf_long_first.png"}
    for strategy in STRATEGIES:
        assert f"prefill_queue_strategy={strategy}" in (out / "logs" / f"server_{strategy}.log").read_text()


def test_meta_records_how_the_run_was_made(comparison):
    _, report, _ = comparison
    meta = report["meta"]
    assert meta["strategies"] == STRATEGIES and meta["baseline"] == "default"
    assert meta["repeats"] == REPEATS and meta["warmup"] == 1 and meta["seed"] == 5
    assert meta["server_args"] == [
        "--chunked_prefill_size", "32", "--batch_max_tokens", "32", "--running_max_req_size", "32", "--max_total_token_num", "8192"
    ]
    assert meta["kv_tokens_added_by_runner"] is False
    assert "compare_strategies" in meta["command"] and "--server-args" in meta["command"]
    assert meta["machine"]["cpu_count"] == os.cpu_count() and meta["machine"]["torch"]
    assert "commit" in meta["git"]
    # Every server got the same flags apart from the strategy.
    commands = {s: meta["servers"][s]["command"] for s in STRATEGIES}
    stripped = [
        [arg for i, arg in enumerate(cmd) if arg != s and cmd[i - 1] != "--port"] for s, cmd in commands.items()
    ]
    assert stripped[0] == stripped[1] == stripped[2]


def test_workload_section_structure(comparison):
    out, report, _ = comparison
    section = report["workloads"]["long_first"]
    assert section["workload"]["long_count"] == 3 and section["workload"]["short_len"] == 16
    assert section["repeat_seeds"] == [5, 6]
    assert section["visit_orders"] == [STRATEGIES, STRATEGIES[1:] + STRATEGIES[:1]]
    assert set(section["warmup"]) == set(STRATEGIES)
    keys = {m.key for m in COMPARISON_METRICS}
    for strategy in STRATEGIES:
        assert set(section["values"][strategy]) == keys
        assert all(len(v) == REPEATS for v in section["values"][strategy].values())
        assert set(section["medians"][strategy]) == keys
        assert section["failed"][strategy] == 0
        runs = section["runs"][strategy]
        assert [r["repeat"] for r in runs] == list(range(REPEATS))
        for run in runs:
            records = (out / run["records_jsonl"]).read_text().splitlines()
            assert len(records) == 6
            summary = json.loads((out / run["summary_json"]).read_text())
            assert set(summary["classes"]) == {"short", "long"}
            assert summary["overall"]["completed"] == 6
    assert set(section["changes"]) == {"promote_shortest", "hrrn"}
    for per_metric in section["changes"].values():
        assert set(per_metric) == keys
        for change in per_metric.values():
            assert change["pairs"] == REPEATS
            assert change["ci_low_percent"] <= change["percent"] <= change["ci_high_percent"]


def test_same_prompts_within_a_repeat_and_fresh_prompts_across_repeats(comparison):
    _, report, _ = comparison
    runs = report["workloads"]["long_first"]["runs"]
    for r in range(REPEATS):
        assert len({runs[s][r]["prompt_namespace"] for s in STRATEGIES}) == 1
        assert len({runs[s][r]["seed"] for s in STRATEGIES}) == 1
    assert len({runs["default"][r]["prompt_namespace"] for r in range(REPEATS)}) == REPEATS


def test_markdown_tables_are_printed_and_written(comparison):
    out, _, stdout = comparison
    text = (out / "report.md").read_text(encoding="utf-8")
    header = (
        "| Strategy | Short TTFT median / P95 (ms) | Long TTFT P95 (ms) | Output tokens/s | Throughput vs default |"
    )
    assert header in text
    assert "Change vs default [95% CI]" in text
    for strategy in STRATEGIES:
        assert f"| {strategy} |" in text
    assert text.strip() in stdout


def test_servers_are_stopped(comparison):
    _, report, _ = comparison
    for server in report["meta"]["servers"].values():
        proc = Path(f"/proc/{server['pid']}")
        # The runner has exited, so a stopped server is gone (or at most a zombie awaiting reaping).
        assert not proc.exists() or "zombie" in (proc / "status").read_text()
