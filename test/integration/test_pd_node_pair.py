"""A real prefill node and a real decode node, driven through their control endpoints (no PD master).

Both process trees run on the tiny model and register with a stand-in membership master; the
test plays the master's part itself: transfer setup per epoch, D reserves first, then P
prefills from D's kv_start and sends the KV with its first token.  Every kind of node event
(reserved, token, busy, segment_end, handed_off, error) is produced by the real plumbing, and
the tokens D streams must equal a normal server's greedy tokens.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Dict, List

import httpx
import pytest
import torch

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.models.registry import load_model

from pd_cluster_support import launch, wait_healthy
from pd_membership_master import MembershipMaster

LEASE_S = 3
SEGMENT_TOKENS = 6


@pytest.fixture(scope="module")
def nodes(tiny_llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd_pair")
    master = MembershipMaster(1.0)
    common = ["--pd_master_ip", "127.0.0.1", "--pd_master_port", str(master.port)]
    prefill = launch(tiny_llama_dir, logs, "prefill", ["--run_mode", "prefill", "--pd_node_id", "p0", *common])
    decode = launch(tiny_llama_dir, logs, "decode", [
        "--run_mode", "decode", "--pd_node_id", "d0", "--max_total_token_num", "512", "--max_req_total_len", "400",
        "--pd_reserve_lease_seconds", str(LEASE_S), "--pd_max_segment_tokens", str(SEGMENT_TOKENS), *common])
    try:
        for node in (prefill, decode):
            wait_healthy(node)
        address = master.wait_node("p0")["kv_transfer_address"]
        yield prefill, decode, address
    finally:
        for handle in (prefill, decode):
            handle.stop()
        master.stop()


def _setup(prefill, decode, address: str, epoch: int) -> None:
    for node in (prefill, decode):
        response = httpx.post(f"{node.url}/pd/node/transfer_setup",
                              json={"epoch": epoch, "peer_node_id": "x", "prefill_transfer_address": address}, timeout=60)
        assert response.status_code == 200 and response.json() == {"epoch": epoch}, response.text


class Stream:
    """One node stream read line by line in a thread (the master reads D while it talks to P)."""

    def __init__(self, url: str, body: Dict[str, Any]):
        self.lines: List[Dict[str, Any]] = []
        self.first = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: Dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=120) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line:
                        self.lines.append(json.loads(line))
                        self.first.set()
        finally:
            self.first.set()
            self.done.set()

    def wait(self, timeout: float = 120) -> List[Dict[str, Any]]:
        assert self.done.wait(timeout), self.lines
        return self.lines


def _body(request_id: int, prompt: List[int], max_new: int, epoch: int, **extra: Any) -> Dict[str, Any]:
    return {"request_id": request_id, "prompt_ids": prompt, "segment_index": 0, "epoch": epoch,
            "params": {"max_new_tokens": max_new, "do_sample": False, "ignore_eos": True}, **extra}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy tokens of the same checkpoint computed in this process (what a normal node gives)."""
    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    return lambda prompt, max_new: BatchGenerator(model, 4096).greedy_generate([prompt], max_new)[0]


def _run(prefill, decode, request_id: int, prompt: List[int], max_new: int, epoch: int):
    d = Stream(f"{decode.url}/pd/node/decode", _body(request_id, prompt, max_new, epoch))
    assert d.first.wait(60)
    reserved = d.lines[0]
    assert reserved["event"] == "reserved", d.lines
    p = httpx.post(f"{prefill.url}/pd/node/prefill", timeout=120, json=_body(
        request_id, prompt, max_new, epoch, kv_start=reserved["kv_start"], infer_high_priority=0))
    assert p.status_code == 200, p.text
    return reserved, [json.loads(line) for line in p.text.splitlines()], d.wait()


def test_a_request_moves_from_prefill_to_decode_with_every_event(nodes, reference) -> None:
    prefill, decode, address = nodes
    _setup(prefill, decode, address, epoch=1)
    prompt = list(range(20, 60))
    expected = reference(prompt, 5)
    reserved, p_lines, d_lines = _run(prefill, decode, 101, prompt, 5, epoch=1)
    assert reserved["kv_start"] == 0
    assert [line["event"] for line in p_lines] == ["token", "handed_off"]
    assert p_lines[0]["token_id"] == expected[0] and p_lines[0]["finish_reason"] is None
    # D: the reservation, the echo of P's first token, then its own tokens, the last one finished.
    assert [line["event"] for line in d_lines] == ["reserved"] + ["token"] * 5
    assert [line["token_id"] for line in d_lines[1:]] == expected
    assert d_lines[-1]["finish_reason"] == "length"

    # The same prompt again: D's prefix cache holds all but the last position, so only that moves.
    reserved, p_lines, d_lines = _run(prefill, decode, 102, prompt, 5, epoch=1)
    assert reserved["kv_start"] == len(prompt) - 1
    assert [line["token_id"] for line in d_lines[1:]] == expected

    # Past --pd_max_segment_tokens the segment ends (the master would continue it).
    longer = reference(prompt[:30], 20)
    _, _, d_lines = _run(prefill, decode, 103, prompt[:30], 20, epoch=1)
    assert [line["event"] for line in d_lines] == ["reserved"] + ["token"] * SEGMENT_TOKENS + ["segment_end"]
    assert d_lines[-1]["reason"] == "segment_limit"
    assert [line["token_id"] for line in d_lines[1:-1]] == longer[:SEGMENT_TOKENS]


def test_busy_lease_expiry_and_wrong_epoch_are_answered(nodes) -> None:
    prefill, decode, address = nodes
    _setup(prefill, decode, address, epoch=2)
    # D promises each reservation its prompt + min(max_new_tokens, segment cap): 250 + 6 here, so a
    # second one of 260 + 6 does not fit its 512 KV tokens and is answered busy at once.
    started = time.monotonic()
    held = Stream(f"{decode.url}/pd/node/decode", _body(202, list(range(5, 255)), 100, epoch=2))
    assert held.first.wait(60) and held.lines[0]["event"] == "reserved"
    busy = httpx.post(f"{decode.url}/pd/node/decode", json=_body(203, list(range(7, 267)), 100, epoch=2), timeout=60)
    assert [json.loads(line)["event"] for line in busy.text.splitlines()] == ["busy"]
    assert time.monotonic() - started < 30
    # Request 202's prompt never comes from P: its lease expires and its KV is freed.
    lines = held.wait(LEASE_S + 60)
    assert lines[-1]["event"] == "error" and "within" in lines[-1]["message"], lines
    assert lines[-1]["transfer_broken"] is False
    again = Stream(f"{decode.url}/pd/node/decode", _body(204, list(range(7, 267)), 100, epoch=2))
    assert again.first.wait(60) and again.lines[0]["event"] == "reserved", again.lines
    # A request of an epoch this node does not hold is refused: the master must set the pair up again.
    stale = httpx.post(f"{prefill.url}/pd/node/prefill", json=_body(205, [5, 6, 7], 3, epoch=77, kv_start=0,
                                                                      infer_high_priority=0), timeout=60)
    line = json.loads(stale.text.splitlines()[0])
    assert line["event"] == "error" and line["transfer_broken"] is True
    assert again.wait(LEASE_S + 60)[-1]["event"] == "error"


def _teardown(node, epoch: int) -> Dict[str, Any]:
    response = httpx.post(f"{node.url}/pd/node/transfer_teardown", json={"epoch": epoch}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_two_epochs_live_side_by_side_and_a_teardown_ends_only_one(nodes, reference) -> None:
    """A node holds one pair per peer: setting up a second leaves the first working, and tearing
    one down leaves the other working (here both pairs join the same two nodes)."""
    prefill, decode, address = nodes
    _setup(prefill, decode, address, epoch=5)
    _setup(prefill, decode, address, epoch=6)
    prompt = list(range(300, 320))
    expected = reference(prompt, 3)
    for request_id, epoch in ((601, 6), (602, 5)):
        _, p_lines, d_lines = _run(prefill, decode, request_id, prompt, 3, epoch=epoch)
        assert [line["event"] for line in p_lines] == ["token", "handed_off"], (epoch, p_lines, d_lines)
        assert [line["token_id"] for line in d_lines[1:]] == expected, epoch
    for node in (prefill, decode):
        assert _teardown(node, 5) == {"epoch": 5, "known": True}
        assert _teardown(node, 5) == {"epoch": 5, "known": False}  # idempotent
    gone = httpx.post(f"{decode.url}/pd/node/decode", json=_body(603, prompt, 3, epoch=5), timeout=60)
    line = json.loads(gone.text.splitlines()[0])
    assert line["event"] == "error" and line["transfer_broken"] is True, line
    _, p_lines, d_lines = _run(prefill, decode, 604, list(range(400, 420)), 3, epoch=6)
    assert [line["event"] for line in p_lines] == ["token", "handed_off"], (p_lines, d_lines)
    assert [line["token_id"] for line in d_lines[1:]] == reference(list(range(400, 420)), 3)


def test_tp2_nodes_move_each_ranks_shard_and_agree_on_results(tiny_llama_dir, tmp_path_factory, reference) -> None:
    """With TP = 2 each rank pair moves its KV-head shard; D admits only once both shards arrived."""
    logs = tmp_path_factory.mktemp("pd_pair_tp2")
    master = MembershipMaster(1.0)
    common = ["--pd_master_ip", "127.0.0.1", "--pd_master_port", str(master.port), "--tp", "2"]
    prefill = launch(tiny_llama_dir, logs, "prefill", ["--run_mode", "prefill", "--pd_node_id", "p2", *common])
    decode = launch(tiny_llama_dir, logs, "decode", ["--run_mode", "decode", "--pd_node_id", "d2", *common])
    try:
        for node in (prefill, decode):
            wait_healthy(node)
        address = master.wait_node("p2")["kv_transfer_address"]
        # P holds both ranks' ports from start-up: rank 1's (an even port, the kind outgoing
        # connections take) cannot be lost before the first setup.
        host, port = address.rsplit(":", 1)
        for rank in range(2):
            with socket.socket() as probe, pytest.raises(OSError):
                probe.bind((host, int(port) + rank))
        _setup(prefill, decode, address, epoch=1)
        for request_id, prompt in enumerate([list(range(20, 60)), list(range(100, 190))]):
            reserved, p_lines, d_lines = _run(prefill, decode, request_id, prompt, 6, epoch=1)
            assert [line["event"] for line in p_lines] == ["token", "handed_off"], (p_lines, d_lines)
            assert [line["token_id"] for line in d_lines[1:]] == reference(prompt, 6)
    finally:
        for handle in (prefill, decode):
            handle.stop()
        master.stop()
