"""End to end: compare_strategies --topology 1p1d starts one real PD cluster per strategy.

Each cluster is a PD master, a prefill node running the strategy and a decode node, all on the
tiny demo model over loopback (KV moves over gloo). Each role gets flags only it accepts
(--prefill-args, --decode-args) besides the shared --server-args. Only the structure of the
report, where each flag went and the processes' lifecycle are checked; timing values never
decide the result.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

STRATEGIES = ["default", "hrrn"]
ROLES = ("master", "prefill", "decode")
# The prefill step's and the prefill queue's flags (a decode node refuses them), and a decode-only one.
PREFILL_ARGS = ["--chunked_prefill_size", "32", "--batch_max_tokens", "32", "--prefill_max_overtake_tokens", "64"]
DECODE_ARGS = ["--pd_max_segment_tokens", "64"]
# Every port the run gives its processes comes from here (--ports; each is checked free first).
PORTS = (23200, 23399)


@pytest.fixture(scope="module")
def comparison(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare_1p1d")
    cmd = [
        sys.executable, "-m", "lightllm.benchmark.compare_strategies",
        "--model_dir", str(tiny_llama_dir), "--topology", "1p1d",
        "--workload", "long_first",
        "--long-count", "2", "--long-len", "200", "--short-count", "2", "--short-len", "16", "--output-len", "4",
        "--strategies", ",".join(STRATEGIES), "--repeats", "1", "--warmup", "0", "--settle", "0.1",
        "--server-args", "--max_total_token_num 4096",
        "--prefill-args", " ".join(PREFILL_ARGS), "--decode-args", " ".join(DECODE_ARGS),
        "--master-args", "--pd_heartbeat_interval 1",
        "--start-timeout", "240",
        "--out-dir", str(out), "--seed", "3", "--ports", f"{PORTS[0]}-{PORTS[1]}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    logs = "".join(
        f"\n---- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((out / "logs").glob("*.log"))
    ) if (out / "logs").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    return out, report


def test_report_is_the_normal_one_with_the_1p1d_topology(comparison):
    out, report = comparison
    meta = report["meta"]
    assert meta["topology"]["name"] == "1p1d"
    assert meta["topology"]["master_args"] == ["--pd_heartbeat_interval", "1"]
    assert (meta["topology"]["prefill_args"], meta["topology"]["decode_args"]) == (PREFILL_ARGS, DECODE_ARGS)
    assert meta["server_args"] == ["--max_total_token_num", "4096"]
    assert meta["strategies"] == STRATEGIES
    section = report["workloads"]["long_first"]
    for strategy in STRATEGIES:
        assert section["failed"][strategy] == 0
        (run,) = section["runs"][strategy]
        assert run["summary"]["overall"]["completed"] == 4
        assert len((out / run["records_jsonl"]).read_text().splitlines()) == 4
    assert "| hrrn |" in (out / "report.md").read_text(encoding="utf-8")


def test_each_strategy_ran_on_its_own_prefill_node(comparison):
    out, report = comparison
    for strategy in STRATEGIES:
        server = report["meta"]["servers"][strategy]
        commands = {role: server["processes"][role]["command"] for role in ROLES}
        assert "pd_master" in commands["master"] and "--prefill_queue_strategy" not in commands["master"]
        assert commands["prefill"][commands["prefill"].index("--prefill_queue_strategy") + 1] == strategy
        assert "--prefill_queue_strategy" not in commands["decode"]
        # Each role's own flags reach that role only; the shared ones every node, never the master.
        assert all(flag in commands["prefill"] and flag not in commands["decode"] for flag in PREFILL_ARGS[::2])
        assert all(flag in commands["decode"] and flag not in commands["prefill"] for flag in DECODE_ARGS[::2])
        assert all("--max_total_token_num" in commands[role] for role in ("prefill", "decode"))
        assert not any(flag in commands["master"]
                       for flag in ("--max_total_token_num", *PREFILL_ARGS[::2], *DECODE_ARGS[::2]))
        assert server["base_url"] == server["processes"]["master"]["base_url"]
        for role in ROLES:
            assert (out / "logs" / f"server_{strategy}_{role}.log").stat().st_size > 0
        prefill_log = (out / "logs" / f"server_{strategy}_prefill.log").read_text()
        assert f"prefill_queue_strategy={strategy}" in prefill_log
        assert "overtake_bound=64 + " in prefill_log  # the prefill-only flag took effect on the prefill node


def test_every_port_the_run_gave_its_processes_is_in_the_range(comparison):
    _, report = comparison
    assert report["meta"]["topology"]["ports"] == f"{PORTS[0]}-{PORTS[1]}"
    given = []
    for server in report["meta"]["servers"].values():
        for role, process in server["processes"].items():
            command = process["command"]
            flags = ["--port", "--pd_transfer_port"] if role == "prefill" else ["--port"]
            given += [int(command[command.index(flag) + 1]) for flag in flags]
    assert len(given) == len(set(given)) == 4 * len(STRATEGIES)
    assert all(PORTS[0] <= port <= PORTS[1] for port in given), given


def test_every_process_of_every_cluster_is_stopped(comparison):
    _, report = comparison
    for server in report["meta"]["servers"].values():
        for process in server["processes"].values():
            proc = Path(f"/proc/{process['pid']}")
            assert not proc.exists() or "zombie" in (proc / "status").read_text()


def test_a_flag_one_role_refuses_in_server_args_ends_the_run_saying_where_it_goes(tiny_llama_dir, tmp_path):
    """The outside tester's repro: --server-args reach the decode node too, which refuses the bound."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "lightllm.benchmark.compare_strategies",
        "--model_dir", str(tiny_llama_dir), "--topology", "1p1d", "--workload", "long_first",
        "--long-count", "1", "--short-count", "1", "--long-len", "100", "--short-len", "10", "--output-len", "2",
        "--strategies", "default,hrrn", "--repeats", "1", "--warmup", "0", "--start-timeout", "240",
        "--out-dir", str(out), "--server-args=--prefill_max_overtake_tokens=10",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "_decode.log" in errors[0] and "--prefill_max_overtake_tokens: a decode node never prefills" in errors[0]
    assert "give a flag only one role takes in --prefill-args or --decode-args" in errors[0]
    assert not (out / "report.json").exists()
