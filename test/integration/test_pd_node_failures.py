"""Nodes and masters that die or hang, with real processes: failover, prompt release, no orphans.

* A prefill node killed while it holds prompts not yet prefilled: the master places them again
  on the other prefill node and every client gets its full answer (the decode node lets the new
  placement replace the old reservation under the same request id), the decode node keeps
  serving meanwhile, and the killed node's child processes (router, ranks, KV transfer
  processes) exit on their own.
* A decode node that hung (SIGSTOP) past the heartbeat bound and resumed: the master dropped
  it and failed its requests; on resume it frees what they held at once (it tears down every
  transfer pair of the membership the master forgot), not at the end of their leases.
* A dead master: the nodes end every request it sent them, those queued for their KV transfer
  included, and free their KV at once.

Bounds are generous (a loaded 2-core machine); the failures they catch took minutes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

import httpx
import pytest

from pd_cluster_support import launch, wait_healthy
from server_process import ServerHandle
from lightllm.utils.free_ports import free_port

NODE_ARGS = ["--max_total_token_num", "16384"]
# How long the surviving side may take to serve or free everything after a failure.
BOUND_S = 45.0


class Cluster:
    """A master and named nodes (own process groups, so a test can stop a whole node)."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.master_port = free_port()
        self.master = launch(model_dir, log_dir, "master", ["--run_mode", "pd_master"], port=self.master_port,
                             own_process_group=True)
        self.nodes: Dict[str, ServerHandle] = {}

    def start(self, names: Dict[str, Tuple[str, List[str]]]) -> "Cluster":
        for name, (role, extra) in names.items():
            self.nodes[name] = launch(self.model_dir, self.log_dir, name, [
                "--run_mode", role, "--pd_master_ip", "127.0.0.1", "--pd_master_port", str(self.master_port),
                "--pd_node_id", name, *NODE_ARGS, *extra], own_process_group=True)
        for node in self.nodes.values():
            wait_healthy(node)
        deadline = time.monotonic() + 120
        while not set(names) <= set(self.listed()):
            assert time.monotonic() < deadline, f"the master never listed {sorted(names)}"
            time.sleep(0.2)
        wait_healthy(self.master)
        return self

    def listed(self) -> Dict[str, Dict[str, Any]]:
        try:
            nodes = httpx.get(f"{self.master.url}/pd/nodes", timeout=10).json()["nodes"]
        except httpx.HTTPError:
            return {}
        return {node["node_id"]: node for node in nodes}

    def stop(self) -> None:
        for handle in [*self.nodes.values(), self.master]:
            if handle.proc.poll() is None:
                try:
                    os.killpg(handle.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                handle.stop(signal.SIGTERM, timeout=30)
            try:
                os.killpg(handle.proc.pid, signal.SIGKILL)  # whatever a killed main process left
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture
def cluster(tiny_llama_dir, tmp_path):
    made = Cluster(tiny_llama_dir, tmp_path)
    yield made
    made.stop()


def _bodies(count: int, words: int, max_tokens: int, model: str) -> List[Dict[str, Any]]:
    return [{"model": model, "prompt": f"request {index} says " + "hello there " * (words + 13 * index),
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for index in range(count)]


async def _post_all(url: str, bodies: List[Dict[str, Any]]) -> List[Tuple[int, Dict[str, Any]]]:
    async with httpx.AsyncClient(timeout=180) as client:
        async def one(body: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
            answer = await client.post(f"{url}/v1/completions", json=body)
            return answer.status_code, answer.json()
        return list(await asyncio.gather(*(one(body) for body in bodies)))


def _texts(answers: List[Tuple[int, Dict[str, Any]]]) -> List[str]:
    for status, body in answers:
        assert status == 200, body
    return [body["choices"][0]["text"] for _, body in answers]


def _descendants(pid: int) -> Set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _kv_released(node: ServerHandle) -> bool:
    try:
        return (node.metric("lightllm_running_requests") == 0 and node.metric("lightllm_kv_promised_tokens") == 0
                and node.metric("lightllm_kv_allocatable_tokens") == node.metric("lightllm_kv_total_tokens"))
    except httpx.HTTPError:
        return False


def _wait(predicate, what: str, timeout: float = BOUND_S) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"{what} not within {timeout:g} s"
        time.sleep(0.2)
    return time.monotonic() - started


def test_a_prefill_node_killed_while_prefilling_fails_over_and_leaves_no_process(cluster: Cluster) -> None:
    cluster.start({"p0": ("prefill", []), "p1": ("prefill", []), "d0": ("decode", [])})
    bodies = _bodies(8, 60, 12, cluster.nodes["d0"].model_name)
    expected = _texts(asyncio.run(_post_all(cluster.master.url, bodies)))  # both pairs are set up now
    p0 = cluster.nodes["p0"].proc.pid
    children = _descendants(p0)
    assert len(children) >= 4  # detokenizer, router, rank, its KV transfer process

    async def burst_and_kill() -> List[Tuple[int, Dict[str, Any]]]:
        # p0 takes requests but cannot answer them: the master places some there, D reserves
        # their KV, and they wait for a first token that will never come.
        os.kill(p0, signal.SIGSTOP)
        requests = asyncio.ensure_future(_post_all(cluster.master.url, bodies))
        deadline = time.monotonic() + 5  # well inside the heartbeat bound (7 s): p0 is still listed
        while cluster.listed()["p0"]["in_flight_requests"] < 2:
            assert time.monotonic() < deadline, "the master placed nothing on p0"
            await asyncio.sleep(0.05)
        os.kill(p0, signal.SIGKILL)  # the node's main process; its children are left to notice
        return await requests

    started = time.monotonic()
    answers = asyncio.run(burst_and_kill())
    assert _texts(answers) == expected  # every client got its whole answer, none an error
    assert time.monotonic() - started < BOUND_S  # and D did not freeze behind the dead pair
    assert "prefill node p0 unusable" in cluster.master.log()  # the failover path ran
    _wait(lambda: not any(_alive(pid) for pid in children), "the killed node's child processes exiting")
    _wait(lambda: _kv_released(cluster.nodes["d0"]), "d0 freeing every reservation")


def test_a_decode_node_that_hung_frees_what_it_held_as_soon_as_it_resumes(cluster: Cluster) -> None:
    # Leases far beyond the bound: only the node's own reaction can free the KV in time.
    cluster.start({"p0": ("prefill", []), "d0": ("decode", ["--pd_reserve_lease_seconds", "600"])})
    d0, p0 = cluster.nodes["d0"], cluster.nodes["p0"]
    bodies = _bodies(6, 40, 150, d0.model_name)
    _texts(asyncio.run(_post_all(cluster.master.url, bodies[:1])))  # the pair is set up

    async def burst_and_hang() -> List[Tuple[int, Dict[str, Any]]]:
        # P holds the prompts until D has reserved them, so D hangs with reservations pending.
        os.killpg(p0.proc.pid, signal.SIGSTOP)
        requests = asyncio.ensure_future(_post_all(cluster.master.url, bodies))
        deadline = time.monotonic() + 5  # inside the heartbeat bound: P must not be dropped
        while cluster.listed()["d0"]["in_flight_requests"] < 3:
            assert time.monotonic() < deadline, f"the master placed too little on d0: {cluster.listed()}"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # D's reservations are made
        os.killpg(d0.proc.pid, signal.SIGSTOP)
        os.killpg(p0.proc.pid, signal.SIGCONT)
        return await requests

    answers = asyncio.run(burst_and_hang())
    # D was dropped (pd_node_lost): every request failed, with an error the client can read.
    assert all(status == 503 and body["error"]["message"] for status, body in answers), answers
    os.killpg(d0.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    _wait(lambda: "d0" in cluster.listed(), "d0 registering again")
    _wait(lambda: _kv_released(d0), "d0 freeing the reservations of the requests the master failed")
    assert time.monotonic() - resumed < BOUND_S
    assert "no longer knows this node" in d0.log() and "tore down" in d0.log()
    _texts(asyncio.run(_post_all(cluster.master.url, bodies[:2])))  # and it serves again


def test_a_dead_master_leaves_no_request_or_kv_on_the_nodes(cluster: Cluster) -> None:
    cluster.start({"p0": ("prefill", []), "d0": ("decode", [])})
    bodies = _bodies(16, 60, 64, cluster.nodes["d0"].model_name)

    async def burst_and_kill() -> None:
        requests = asyncio.ensure_future(_post_all(cluster.master.url, bodies))
        deadline = time.monotonic() + 30
        while cluster.listed().get("d0", {}).get("in_flight_requests", 0) < 4:
            assert time.monotonic() < deadline, "the burst never reached the nodes"
            await asyncio.sleep(0.05)
        os.killpg(cluster.master.proc.pid, signal.SIGKILL)
        await asyncio.gather(requests, return_exceptions=True)  # the clients lose their connections

    asyncio.run(burst_and_kill())
    # Well before the nodes would give the master up (6 s) and far before the leases (30 s).
    for name in ("p0", "d0"):
        _wait(lambda: _kv_released(cluster.nodes[name]), f"{name} ending the dead master's requests", timeout=15)
