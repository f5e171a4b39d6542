"""A request queued on a healthy but stalled prefill node keeps its decode reservation (real processes).

The decode node reserves a request's KV before the prefill node is asked, and used to free it
after a fixed 30 s lease: a request queued longer than that on a backed-up prefill node failed
with ``pd_transfer_failed`` although the master's prefill timeout had not passed.  Now the master
sends its own wait (``--pd_prefill_timeout_seconds`` plus ``--pd_transfer_timeout_seconds``) as
the lease, and a decode node's ``--pd_reserve_lease_seconds`` only bounds it.

One master (prefill timeout 60 s), one prefill node and two decode nodes over loopback, the
tiny model on CPU.  The prefill node stays healthy (its HTTP process heartbeats) while its model
rank is stopped (SIGSTOP), which holds every prompt in its queue:

1. with d0 (no lease flag) a request stays queued longer than the former 30 s lease and then
   gets its whole answer;
2. with d1 (``--pd_reserve_lease_seconds 2``) the reservation of a request whose KV never comes
   is freed at d1's lease, and the client gets 503 ``pd_transfer_failed`` naming it.

The results are the outcomes; the waits only create the situation (and bound a hang).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import httpx
import pytest

from pd_cluster_support import launch, wait_healthy
from server_process import ServerHandle
from lightllm.utils.free_ports import free_port

PREFILL_TIMEOUT_S = 60
MASTER_LEASE_S = PREFILL_TIMEOUT_S + 30  # plus the default --pd_transfer_timeout_seconds
FORMER_LEASE_S = 30.0  # the former fixed default of --pd_reserve_lease_seconds
NODE_LEASE_S = 2
NODE_ARGS = ["--max_total_token_num", "4096"]
BOUND_S = 60.0  # a hang guard for each wait, never the result


def _wait(predicate: Callable[[], bool], what: str, timeout: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s"
        time.sleep(0.2)


def _model_rank(main_pid: int) -> int:
    """The pid of the model rank below a node's main process (its /proc/<pid>/comm is model_rank0)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            name = (entry / "comm").read_text().strip()
        except (OSError, IndexError):
            continue
        if parent == main_pid and name == "model_rank0":
            return int(entry.name)
    raise AssertionError(f"no model_rank0 below pid {main_pid}")


class Lease1P2D:
    """The master and its nodes, each started with its own node id."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.port = free_port()
        self.master = launch(model_dir, log_dir, "master", [
            "--run_mode", "pd_master", "--pd_prefill_timeout_seconds", str(PREFILL_TIMEOUT_S)], port=self.port)
        self.nodes: Dict[str, ServerHandle] = {}
        self.stopped: List[int] = []  # pids stopped with SIGSTOP, resumed at the end whatever happens

    def start(self, name: str, role: str, extra: List[str]) -> ServerHandle:
        self.nodes[name] = launch(self.model_dir, self.log_dir, name, [
            "--run_mode", role, "--pd_master_ip", "127.0.0.1", "--pd_master_port", str(self.port),
            "--pd_node_id", name, *NODE_ARGS, *extra])
        return self.nodes[name]

    def listed(self) -> Dict[str, Dict[str, Any]]:
        try:
            return {n["node_id"]: n for n in httpx.get(f"{self.master.url}/pd/nodes", timeout=10).json()["nodes"]}
        except httpx.HTTPError:
            return {}

    def complete(self, prompt: str, max_tokens: int = 6) -> httpx.Response:
        body = {"model": self.master.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        return httpx.post(f"{self.master.url}/v1/completions", json=body, timeout=PREFILL_TIMEOUT_S + 60)

    def pause(self, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self.stopped.append(pid)

    def resume(self, pid: int) -> None:
        os.kill(pid, signal.SIGCONT)
        self.stopped.remove(pid)

    def stop(self) -> None:
        for pid in list(self.stopped):
            self.resume(pid)
        for handle in [*self.nodes.values(), self.master]:
            handle.stop(signal.SIGTERM, timeout=30)


@pytest.fixture
def cluster(tiny_llama_dir: Path, tmp_path: Path):
    made = Lease1P2D(tiny_llama_dir, tmp_path)
    yield made
    made.stop()


def _in_background(call: Callable[[], httpx.Response]) -> Callable[[], httpx.Response]:
    """Run ``call`` in a thread; the returned function waits for its response."""
    out: Dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault("response", call()), daemon=True)
    thread.start()

    def result() -> httpx.Response:
        thread.join(PREFILL_TIMEOUT_S + 90)
        assert "response" in out, "the request never ended"
        return out["response"]
    return result


def _kv_free(node: ServerHandle) -> bool:
    return node.metric("lightllm_running_requests") == 0 and node.metric("lightllm_kv_promised_tokens") == 0


def test_a_request_queued_past_the_former_lease_succeeds_and_a_node_lease_still_frees_kv(cluster: Lease1P2D) -> None:
    p0 = cluster.start("p0", "prefill", [])
    d0 = cluster.start("d0", "decode", [])
    for handle in (p0, d0, cluster.master):
        wait_healthy(handle)
    assert cluster.complete("warm up the pair").status_code == 200  # request 1: the pair is set up
    rank = _model_rank(p0.proc.pid)

    # 1. P's rank stalls: request 2 is reserved on d0, then waits in P's queue past the former lease.
    cluster.pause(rank)
    queued = _in_background(lambda: cluster.complete("a prompt that has to wait in the prefill queue"))
    _wait(lambda: "request 2 reserved" in d0.log(), "d0 reserving request 2")
    reserved_at = time.monotonic()
    d1 = cluster.start("d1", "decode", ["--pd_reserve_lease_seconds", str(NODE_LEASE_S)])  # starts meanwhile
    time.sleep(max(0.0, reserved_at + FORMER_LEASE_S + 3 - time.monotonic()))
    cluster.resume(rank)
    answer = queued()
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 6
    assert d0.metric("lightllm_pd_expired_leases_total") == 0 and "lease_expired" not in d0.log()
    assert "request 2 reserved: segment_index=0" in d0.log() and f"lease={MASTER_LEASE_S}s" in d0.log()

    # 2. d1 bounds its leases at 2 s: with P stalled again, its reservation is freed and the request fails.
    wait_healthy(d1)
    _wait(lambda: "d1" in cluster.listed(), "the master listing d1")
    d0.proc.send_signal(signal.SIGTERM)  # d0 drains: new requests go to d1
    _wait(lambda: cluster.listed().get("d0", {}).get("state", "draining") == "draining", "d0 draining")
    assert cluster.complete("warm up the second pair").status_code == 200  # the pair (p0, d1) is set up
    cluster.pause(rank)
    failed = _in_background(lambda: cluster.complete("a prompt whose KV never comes"))()
    assert failed.status_code == 503, failed.text
    error = failed.json()["error"]
    assert error["code"] == "pd_transfer_failed", error
    assert f"no KV arrived from the prefill side within {NODE_LEASE_S} s" in error["message"], error
    assert "lease_expired" in d1.log() and d1.metric("lightllm_pd_expired_leases_total") == 1
    _wait(lambda: _kv_free(d1), "d1 freeing the expired reservation")
    cluster.resume(rank)
    assert cluster.complete("the cluster still serves").status_code == 200
