"""PD settings are checked once, at start-up: a bad variable or flag is exit 2 with one line.

The process tests start the real ``python -m lightllm.server.api_server`` and check that it
exits with :data:`EXIT_INVALID_CONFIG` before it binds its port or reads the model; the others
check the same rules in-process (which variables each role reads, which flags each role takes,
and that the master's request path uses the value read at start-up).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.pd_master import build_master
from lightllm.server.launch.exit_codes import EXIT_INVALID_CONFIG
from lightllm.server.launch.environment_check import check_environment_values
from lightllm.utils.free_ports import free_port

BUSY_ENV = "LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS"
FAILURE_ENV = "LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY"
KEY_ENV = "LIGHTLLM_PD_CLUSTER_KEY"
PD_ENVS = (BUSY_ENV, FAILURE_ENV, KEY_ENV)
# Lines a launcher logs once it serves or plans the model: none may appear before a refusal.
STARTED_MARKERS = ("starting: model=", "PD master serving", "serving on", "Uvicorn running")


def _launch(args: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    clean = {key: value for key, value in os.environ.items() if key not in PD_ENVS}
    return subprocess.run([sys.executable, "-m", "lightllm.server.api_server", *args], capture_output=True,
                          text=True, timeout=300, env={**clean, **env})


def _output_lines(proc: subprocess.CompletedProcess) -> List[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("run_mode", "env", "expected"),
    [
        ("pd_master", {BUSY_ENV: "-1"}, f"error: {BUSY_ENV} must be a number of seconds from 0 (no retry) to 1e6, "
         "got '-1'"),
        ("pd_master", {BUSY_ENV: "abc"}, f"error: {BUSY_ENV} must be a number of seconds from 0 (no retry) to 1e6, "
         "got 'abc'"),
        ("pd_master", {BUSY_ENV: "1e9"}, f"error: {BUSY_ENV} must be a number of seconds from 0 (no retry) to 1e6, "
         "got '1e9'"),
        ("prefill", {FAILURE_ENV: "2"}, f"error: {FAILURE_ENV} must be a number in [0, 1], got '2'"),
        ("decode", {KEY_ENV: " "}, f"error: {KEY_ENV} must be non-empty and carry no surrounding whitespace "
                                    "(got 1 characters; value not shown)"),
    ],
)
def test_a_bad_pd_variable_stops_the_process_with_exit_2_and_one_line(
    tiny_llama_dir: Path, run_mode: str, env: Dict[str, str], expected: str
) -> None:
    port = free_port()
    proc = _launch(["--run_mode", run_mode, "--model_dir", str(tiny_llama_dir), "--port", str(port)], env)
    lines = _output_lines(proc)
    assert proc.returncode == EXIT_INVALID_CONFIG == 2, lines
    assert [line for line in lines if line.startswith("error:")] == [expected], lines
    assert not any(marker in line for line in lines for marker in STARTED_MARKERS), lines


# ---------------------------------------------------------------- which role reads what


@pytest.mark.parametrize(
    ("run_mode", "name", "value"),
    [("pd_master", BUSY_ENV, "-1"), ("pd_master", BUSY_ENV, "inf"), ("prefill", FAILURE_ENV, "-0.1"),
     ("prefill", FAILURE_ENV, "x")],
)
def test_check_environment_values_refuses_what_the_role_reads(monkeypatch: pytest.MonkeyPatch, run_mode: str, name: str,
                                                  value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name} must be"):
        check_environment_values(run_mode)


def test_check_environment_values_accepts_good_values_and_ignores_roles_that_do_not_read_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(BUSY_ENV, "2.5")
    monkeypatch.setenv(FAILURE_ENV, "0.5")
    for run_mode in ("pd_master", "prefill", "decode", "normal"):
        check_environment_values(run_mode)
    monkeypatch.setenv(BUSY_ENV, "-1")  # read by the master only
    check_environment_values("decode")
    monkeypatch.setenv(FAILURE_ENV, "7")  # read by the prefill node's KV transfer only
    check_environment_values("normal")
    check_environment_values("decode")


def _master_args(tiny_llama_dir: Path) -> argparse.Namespace:
    args = make_argument_parser().parse_args(["--run_mode", "pd_master", "--model_dir", str(tiny_llama_dir)])
    validate_args(args, 0)
    return args


def test_the_master_reads_the_busy_retry_once_and_passes_it_down(tiny_llama_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BUSY_ENV, "3.5")
    manager, _ = build_master(_master_args(tiny_llama_dir))
    assert manager.deadlines.busy_retry_s == 3.5
    monkeypatch.setenv(BUSY_ENV, "abc")
    with pytest.raises(ValueError, match=f"^{BUSY_ENV} must be"):
        build_master(_master_args(tiny_llama_dir))
    # The request path builds its retry policy from the value read at start-up.
    assert manager.deadlines.busy_retry_s == 3.5
    server = Path(__file__).parents[3] / "lightllm/server"
    readers = [str(path.relative_to(server)) for path in sorted(server.rglob("*.py"))
               if "pd_node_busy_retry_timeout_seconds" in path.read_text()]
    # Both read it at start-up (the check of every variable, then the master's build): never a request.
    assert readers == ["launch/environment_check.py", "launch/pd_master.py"]


# ---------------------------------------------------------------- PD flags per role


def _validate(argv: List[str]) -> None:
    validate_args(make_argument_parser().parse_args(["--model_dir", "m", *argv]), 0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pd_max_segment_tokens", "8"], "--pd_max_segment_tokens configures PD clusters and does nothing on "
                                           "--run_mode normal"),
        (["--pd_master_port", "9", "--pd_kv_page_size", "64"], "--pd_master_port, --pd_kv_page_size configure PD"),
        (["--run_mode", "prefill", "--pd_reserve_lease_seconds", "5"],
         "--pd_reserve_lease_seconds: read by decode nodes only"),
        (["--run_mode", "decode", "--pd_prefill_timeout_seconds", "5"],
         "--pd_prefill_timeout_seconds: read by the PD master only (--run_mode pd_master), not by a decode node"),
        (["--run_mode", "prefill", "--pd_max_missed_heartbeats", "5"], "--pd_max_missed_heartbeats: read by the PD"),
        (["--run_mode", "prefill", "--tool_call_parser", "hermes"],
         "--tool_call_parser configures the public API, which the PD master serves; give it to the master"),
        (["--run_mode", "decode", "--chat_template", "{{ messages }}", "--generation_config", "none"],
         "--generation_config, --chat_template configure the public API"),
        # The flags of one refusal are listed in the parser's order (as --help and server_args.md list them).
        (["--run_mode", "decode", "--trust_request_chat_template", "--max_new_tokens_default", "8"],
         "--max_new_tokens_default, --trust_request_chat_template configure the public API"),
        # A decode node's router admits every arrival at once: the admission flags did nothing there.
        (["--run_mode", "decode", "--router_token_ratio", "5", "--router_max_wait_tokens", "9"],
         "--router_token_ratio, --router_max_wait_tokens: a decode node's router admits every arrival at once"),
        (["--run_mode", "decode", "--schedule_time_interval", "0.5"], "--schedule_time_interval: a decode node's router"),
        (["--run_mode", "decode", "--disable_mixed_batches"],
         "--disable_mixed_batches: a decode node never prefills a prompt (it receives the KV), so it runs no mixed "
         "batches; give it to a normal server"),
        # Each flag is sent where it is read, in the singular for one.
        (["--pd_max_segment_tokens", "8"], "--pd_max_segment_tokens configures PD clusters and does nothing on "
                                           "--run_mode normal; give it to decode nodes (--run_mode decode)"),
        (["--pd_master_port", "9", "--pd_kv_page_size", "64"],
         "--pd_master_port, --pd_kv_page_size configure PD clusters and do nothing on --run_mode normal; give "
         "--pd_master_port to prefill nodes and decode nodes (--run_mode prefill or decode), --pd_kv_page_size to "
         "prefill nodes (--run_mode prefill)"),
        (["--run_mode", "prefill", "--pd_kv_page_size", str(2**31)], "--pd_kv_page_size must be at most 2147483647"),
        (["--host", ""], "--host '' is empty: give an address or host name to listen on"),
        (["--run_mode", "pd_master", "--host", " "], "--host ' ' is empty"),
        (["--pd_transfer_port", "9000"], "--pd_transfer_port configures PD clusters and does nothing on --run_mode "
                                         "normal; give it to prefill nodes (--run_mode prefill)"),
        # Every kind of flag a decode node does not read is named at once.
        (["--run_mode", "decode", "--chunked_prefill_size", "8", "--disable_mixed_batches", "--router_token_ratio", "2"],
         "--chunked_prefill_size: a decode node never prefills a prompt (it receives the KV; its forwards are decode "
         "steps of at most --running_max_req_size rows), so there is no prefill step to shape; give it to the prefill "
         "node; --disable_mixed_batches: a decode node never prefills a prompt (it receives the KV), so it runs no "
         "mixed batches; give it to a normal server; --router_token_ratio: a decode node's router"),
        (["--run_mode", "decode", "--pd_node_id", ""], "--pd_node_id must be 1-128 characters"),
        (["--run_mode", "decode", "--pd_node_id", "d 0"], "--pd_node_id must be 1-128 characters"),
    ],
)
def test_pd_flags_given_to_a_role_that_does_not_read_them_are_refused(argv: List[str], message: str) -> None:
    with pytest.raises(ArgumentError) as err:
        _validate(argv)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_pd_flags_each_role_reads_are_accepted() -> None:
    _validate(["--run_mode", "decode", "--pd_node_id", "d-0", "--pd_reserve_lease_seconds", "5",
               "--pd_max_segment_tokens", "8", "--pd_heartbeat_interval", "1"])
    # --pd_kv_page_size is the prefill side's (a decode node follows each transfer's header).
    _validate(["--run_mode", "prefill", "--pd_node_id", "p.0", "--pd_transfer_port", "29500",
               "--pd_transfer_timeout_seconds", "5", "--pd_kv_page_size", "64", "--router_token_ratio", "2",
               "--router_max_wait_tokens", "9", "--schedule_time_interval", "0.5"])
    _validate(["--run_mode", "pd_master", "--pd_max_missed_heartbeats", "5", "--pd_prefill_timeout_seconds", "5"])


def test_prefix_affinity_flag_reaches_the_placement_and_is_checked(tiny_llama_dir: Path) -> None:
    args = _master_args(tiny_llama_dir)
    manager, _ = build_master(args)
    assert manager.selector.affinity_prefix_tokens == 256
    args.pd_prefix_affinity_tokens = 0
    manager, _ = build_master(args)
    assert manager.selector.affinity_prefix_tokens == 0  # load only
    parser = make_argument_parser()
    with pytest.raises(ArgumentError, match="--pd_prefix_affinity_tokens must be >= 0"):
        validate_args(parser.parse_args(["--run_mode", "pd_master", "--model_dir", str(tiny_llama_dir),
                                         "--pd_prefix_affinity_tokens", "-1"]))
    with pytest.raises(ArgumentError, match="--pd_prefix_affinity_tokens: read by the PD master only"):
        validate_args(parser.parse_args(["--run_mode", "prefill", "--model_dir", str(tiny_llama_dir),
                                         "--pd_prefix_affinity_tokens", "64"]))
