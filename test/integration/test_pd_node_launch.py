"""A real ``--run_mode decode`` node against a real membership master (issue 9).

The node (its whole process tree on the tiny model) registers what must match in the cluster,
heartbeats, mounts the control endpoints and refuses public generation; a node whose TP size or
weights differ from the first registered node's is refused, says why in one line and exits non-zero.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lightllm.common.basemodel.checkpoint_fingerprint import checkpoint_fingerprint
from lightllm.common.basemodel.model_config import ModelConfig
from pd_membership_master import MembershipMaster
from server_process import start_server
from lightllm.utils.free_ports import free_port

HEARTBEAT_S = 0.5
EXIT_BOUND_S = 180


@pytest.fixture(scope="module")
def master():
    membership = MembershipMaster(HEARTBEAT_S)
    yield membership
    membership.stop()


@pytest.fixture(scope="module")
def decode_node(master, tiny_llama_dir, tmp_path_factory):
    node = start_server(tiny_llama_dir, tmp_path_factory.mktemp("pd_node_logs"), [
        "--run_mode", "decode", "--pd_master_ip", "127.0.0.1", "--pd_master_port", str(master.port),
        "--max_total_token_num", "4096", "--pd_node_id", "d0",
    ])
    yield node
    node.stop()


def test_node_registers_its_model_shape_and_heartbeats(master, decode_node, tiny_llama_dir) -> None:
    registered = master.wait_node("d0")
    config = ModelConfig.from_dir(tiny_llama_dir)
    port = int(decode_node.url.rsplit(":", 1)[1])
    assert registered["role"] == "decode"
    assert registered["model_name"] == decode_node.model_name
    assert registered["dtype"] == "float32"
    assert (registered["num_layers"], registered["num_kv_heads"], registered["head_dim"], registered["tp_size"]) == (
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 1)
    assert registered["http_address"] == f"127.0.0.1:{port}"
    assert registered["checkpoint_fingerprint"] == checkpoint_fingerprint(tiny_llama_dir)
    assert registered["kv_transfer_address"] == ""  # a decode node hosts no transfer group
    deadline = time.monotonic() + 20
    while master.wait_node("d0")["heartbeats"] < 2:
        assert time.monotonic() < deadline, "the node does not heartbeat"
        time.sleep(HEARTBEAT_S / 2)
    # Its heartbeats carry its state and load: the KV numbers are rank 0's, an idle node's KV all free.
    beat = master.wait_node("d0")
    assert beat["state"] == "serving"
    assert beat["load"] == {"queued_prefill_tokens": 0, "running_requests": 0, "free_kv_tokens": 4096,
                            "kv_capacity_tokens": 4096}, beat


def test_control_endpoints_validate_and_answer(decode_node) -> None:
    body = {"request_id": 11, "prompt_ids": [1, 2, 3], "params": {"max_new_tokens": 4}, "segment_index": 0, "epoch": 1}
    bad = [({**body, "epoch": "1"}, "epoch"), ({**body, "surprise": 1}, "surprise"),
           ({**body, "params": {"max_new_tokens": 4, "beam_width": 2}}, "params.beam_width"),
           ({**body, "prompt_ids": [1, 10**9]}, "prompt_ids")]
    for payload, param in bad:
        response = httpx.post(f"{decode_node.url}/pd/node/decode", json=payload, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    # A valid request for an epoch the node was never set up for: an error line the master acts on.
    response = httpx.post(f"{decode_node.url}/pd/node/decode", json=body, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-ndjson")
    lines = response.text.splitlines()
    assert len(lines) == 1 and '"event":"error"' in lines[0] and '"transfer_broken":true' in lines[0], lines
    response = httpx.post(f"{decode_node.url}/pd/node/prefill", json={**body, "kv_start": 0, "infer_high_priority": 0},
                          timeout=30)
    assert response.status_code == 404 and response.json()["error"]["code"] == "wrong_pd_role"


def test_public_generation_is_refused_but_service_endpoints_work(decode_node) -> None:
    for path, payload in (("/generate", {"inputs": "hello"}),
                          ("/v1/completions", {"model": decode_node.model_name, "prompt": "hello"})):
        response = httpx.post(f"{decode_node.url}{path}", json=payload, timeout=30)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "pd_node_not_public"
    assert httpx.get(f"{decode_node.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{decode_node.url}/v1/models", timeout=30).status_code == 200
    metrics = httpx.get(f"{decode_node.url}/metrics", timeout=30).text
    for name in ("lightllm_pd_kv_transfer_seconds_count", "lightllm_pd_kv_transfer_bytes_count",
                 "lightllm_pd_failed_transfers_total", "lightllm_pd_expired_leases_total",
                 "lightllm_pd_busy_answers_total", "lightllm_pd_segment_ends_total"):
        assert f'{name}{{model_name="{decode_node.model_name}"' in metrics, name


@pytest.mark.parametrize("reference_change, mismatch", [
    ({"tp_size": 2}, "tp_size: 1 != 2"),
    # The same name and shapes with other weights (a re-deployed fine-tune): garbage text otherwise.
    ({"checkpoint_fingerprint": "0" * 16}, "checkpoint_fingerprint: "),
], ids=["tp_size", "weights"])
def test_an_incompatible_node_is_refused_and_exits_non_zero(tiny_llama_dir, tmp_path, reference_change,
                                                              mismatch) -> None:
    # A long heartbeat interval keeps the hand-registered reference alive while the node starts.
    master = MembershipMaster(heartbeat_interval_s=300)
    try:
        config = ModelConfig.from_dir(tiny_llama_dir)
        reference = {
            "node_id": "p0", "role": "prefill", "model_name": Path(tiny_llama_dir).name, "dtype": "float32",
            "num_layers": config.num_hidden_layers, "num_kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "tp_size": 1, "http_address": "127.0.0.1:9",
            "kv_transfer_address": "127.0.0.1:10", "checkpoint_fingerprint": checkpoint_fingerprint(tiny_llama_dir),
            **reference_change,
        }
        assert httpx.post(f"{master.url}/pd/register", json=reference, timeout=10).status_code == 200
        log_path = tmp_path / "refused_node.log"
        cmd = [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(tiny_llama_dir),
               "--port", str(free_port()), "--run_mode", "decode", "--pd_master_port", str(master.port), "--pd_node_id", "d9",
               "--max_total_token_num", "4096"]
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = proc.wait(EXIT_BOUND_S)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        log = log_path.read_text(errors="replace")
        assert code == 1, log
        errors = [line for line in log.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, log
        assert "refused node 'd9'" in errors[0] and mismatch in errors[0], errors[0]
        assert "Traceback" not in log
        assert [node["node_id"] for node in master.nodes()] == ["p0"]
    finally:
        master.stop()


def test_sigterm_drains_the_node_the_master_hears_it_at_once_and_it_leaves(tiny_llama_dir, tmp_path) -> None:
    # The master's interval is far longer than the test: only the drain's own heartbeat can
    # bring "draining", and only the node's deregistration can drop it while the test runs (the
    # master drops by deregistration only a node that reported draining).
    master = MembershipMaster(heartbeat_interval_s=300)
    try:
        node = start_server(tiny_llama_dir, tmp_path, [
            "--run_mode", "prefill", "--pd_master_ip", "127.0.0.1", "--pd_master_port", str(master.port),
            "--max_total_token_num", "4096", "--pd_node_id", "p7", "--graceful_shutdown_seconds", "30"])
        try:
            assert master.wait_node("p7")["state"] == "serving"
        finally:
            code = node.stop(signal.SIGTERM)
        assert code == 0, node.log()[-3000:]
        assert master.dropped == [("p7", "it stopped (it deregistered on its way out)")], node.log()[-3000:]
        assert master.nodes() == []
        assert "draining" in node.log()
    finally:
        master.stop()


def test_losing_the_master_is_noticed(master, decode_node) -> None:
    master.wait_node("d0")
    master.stop()
    deadline = time.monotonic() + HEARTBEAT_S * 3 + 10
    while "PD master lost" not in decode_node.log():
        assert time.monotonic() < deadline, decode_node.log()[-2000:]
        time.sleep(0.2)
    assert decode_node.proc.poll() is None  # the node keeps serving and keeps trying
    assert httpx.get(f"{decode_node.url}/health", timeout=30).status_code == 200
