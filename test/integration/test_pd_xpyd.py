"""xPyD on loopback: two prefill and two decode nodes under one master, with real processes.

Greedy output equals a normal server's and every node gets work; killing one decode node
fails only the streams it held while the other node's streams finish; killing one prefill node
leaves the cluster serving on the other; a node that joins mid-traffic gets work; afterwards
no node holds KV.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import httpx
import pytest

from pd_cluster_support import launch, wait_healthy
from server_process import ServerHandle, start_server
from lightllm.utils.free_ports import free_port

# The registry's drop bound (interval 2 s x (3 missed + 0.5)) with slack for a loaded machine;
# it only keeps a broken build from hanging the suite.
DEAD_NODE_BOUND_S = 2.0 * 3 + 20
NODE_ARGS = ["--max_total_token_num", "8192"]


class XpydCluster:
    """A master and named nodes; ``nodes[name]`` is a running node."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.master_port = free_port()
        self.master = launch(model_dir, log_dir, "master", ["--run_mode", "pd_master"], port=self.master_port)
        self.nodes: Dict[str, ServerHandle] = {}

    def start_node(self, name: str, role: str, wait: bool = True) -> ServerHandle:
        node = launch(self.model_dir, self.log_dir, name, [
            "--run_mode", role, "--pd_master_ip", "127.0.0.1", "--pd_master_port", str(self.master_port),
            "--pd_node_id", name, *NODE_ARGS])
        self.nodes[name] = node
        if wait:
            wait_healthy(node)
        return node

    def listed(self) -> Dict[str, Dict[str, Any]]:
        nodes = httpx.get(f"{self.master.url}/pd/nodes", timeout=10).json()["nodes"]
        return {node["node_id"]: node for node in nodes}

    def wait_listed(self, names: List[str], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not set(names) <= set(self.listed()):
            assert time.monotonic() < deadline, f"the master never listed {names}: {sorted(self.listed())}"
            time.sleep(0.2)

    def wait_idle_as_listed(self, role: str, timeout: float = 120) -> None:
        """Until the master's view of every ``role`` node is idle: no running request and all KV free.

        Placement reads these reports; a node still reporting the last test's KV would look fuller
        than its peers and get none of a burst."""
        def idle(node: Dict[str, Any]) -> bool:
            load = node.get("load") or {}
            return (load.get("running_requests") == 0 and load.get("free_kv_tokens") is not None
                    and load.get("free_kv_tokens") == load.get("kv_capacity_tokens"))

        deadline = time.monotonic() + timeout
        while True:
            nodes = [node for node in self.listed().values() if node.get("role") == role]
            assert nodes, f"the master lists no {role} node: {self.listed()}"
            if all(idle(node) for node in nodes):
                return
            assert time.monotonic() < deadline, f"the master never saw the {role} nodes idle: {nodes}"
            time.sleep(0.2)

    def wait_unlisted(self, name: str) -> None:
        deadline = time.monotonic() + DEAD_NODE_BOUND_S
        while name in self.listed():
            assert time.monotonic() < deadline, f"the master still lists {name}"
            time.sleep(0.2)

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop(signal.SIGTERM, timeout=30)
        self.master.stop(signal.SIGTERM, timeout=30)


def _transfers(node: ServerHandle) -> float:
    try:
        return node.metric("lightllm_pd_kv_transfer_seconds_count")
    except KeyError:  # no transfer yet: the histogram has no series
        return 0.0


def _settled_transfers(node: ServerHandle, more_than: float = 0.0, timeout_s: float = 60.0) -> float:
    """``_transfers(node)`` once it exceeds ``more_than`` (or the timeout passed).

    A prefill node counts a transfer when D's acknowledgement reaches it, which on a loaded
    machine can come after the client already has its answer from D; the wait only bounds that.
    """
    deadline = time.monotonic() + timeout_s
    while _transfers(node) <= more_than and time.monotonic() < deadline:
        time.sleep(0.1)
    return _transfers(node)


def _kv_full(node: ServerHandle) -> bool:
    return node.metric("lightllm_kv_allocatable_tokens") == node.metric("lightllm_kv_total_tokens")


def _body(index: int, max_tokens: int = 8, stream: bool = False) -> Dict[str, Any]:
    return {"model": "tiny", "prompt": f"request number {index} " * (1 + index % 5), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **({"stream": True} if stream else {})}


async def _post_all(url: str, bodies: List[Dict[str, Any]]) -> List[Tuple[int, str]]:
    async with httpx.AsyncClient(timeout=180) as client:
        async def one(body: Dict[str, Any]) -> Tuple[int, str]:
            answer = await client.post(f"{url}/v1/completions", json=body)
            return answer.status_code, answer.text
        return await asyncio.gather(*(one(body) for body in bodies))


def _texts(answers: List[Tuple[int, str]]) -> List[str]:
    texts = []
    for status, text in answers:
        assert status == 200, text
        texts.append(json.loads(text)["choices"][0]["text"])
    return texts


@pytest.fixture(scope="module")
def normal(tiny_llama_dir, tmp_path_factory):
    handle = start_server(tiny_llama_dir, tmp_path_factory.mktemp("xpyd_normal"), NODE_ARGS)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def xpyd(tiny_llama_dir, tmp_path_factory):
    cluster = XpydCluster(tiny_llama_dir, tmp_path_factory.mktemp("xpyd"))
    try:
        for name, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")):
            cluster.start_node(name, role, wait=False)
        for node in cluster.nodes.values():
            wait_healthy(node)
        cluster.wait_listed(["p1", "p2", "d1", "d2"])
        wait_healthy(cluster.master)
        yield cluster
    finally:
        cluster.stop()


def _bodies_for_model(model: str, count: int, **kwargs: Any) -> List[Dict[str, Any]]:
    return [{**_body(i, **kwargs), "model": model} for i in range(count)]


def test_2p2d_greedy_equals_a_normal_server_and_every_node_works(xpyd, normal):
    bodies = _bodies_for_model(normal.model_name, 16)
    expected = _texts(asyncio.run(_post_all(normal.url, bodies)))
    got = _texts(asyncio.run(_post_all(xpyd.master.url, bodies)))
    assert got == expected
    for name, node in xpyd.nodes.items():
        assert _settled_transfers(node) > 0, f"{name} took no request"
        node.wait_idle()
        assert _kv_full(node), name


def test_killing_one_decode_node_fails_only_its_streams(xpyd, normal):
    bodies = _bodies_for_model(normal.model_name, 6, max_tokens=600, stream=True)
    # Both decode nodes equally empty as the master sees them, so the six streams spread over both.
    xpyd.wait_idle_as_listed("decode")

    async def stream_all() -> List[Tuple[int, List[str]]]:
        async with httpx.AsyncClient(timeout=180) as client:
            started = 0
            killed = asyncio.Event()

            async def one(body: Dict[str, Any]) -> Tuple[int, List[str]]:
                nonlocal started
                lines: List[str] = []
                async with client.stream("POST", f"{xpyd.master.url}/v1/completions", json=body) as answer:
                    async for line in answer.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            if len(lines) == 2:
                                started += 1
                                if started == len(bodies):
                                    xpyd.nodes["d2"].proc.send_signal(signal.SIGKILL)
                                    killed.set()
                return answer.status_code, lines
            results = await asyncio.gather(*(one(body) for body in bodies))
            assert killed.is_set()
            return results

    try:
        results = asyncio.run(stream_all())
    finally:
        # Killed or not, d2 leaves the cluster here, so a failure cannot leave a dead node to the next test.
        dead = xpyd.nodes.pop("d2")
    failed = [lines for _, lines in results if any('"error"' in line and line.startswith('data: {"error"') for line in lines)]
    finished = [lines for _, lines in results if lines and lines[-1] == "data: [DONE]" and lines not in failed]
    # Placement spreads six streams over both decode nodes: some end with an error, the others finish.
    assert failed and finished, [lines[-1] for _, lines in results]
    assert len(failed) + len(finished) == len(bodies)
    xpyd.wait_unlisted("d2")
    dead.stop()
    # The cluster still serves, on d1.
    again = _texts(asyncio.run(_post_all(xpyd.master.url, _bodies_for_model(normal.model_name, 4))))
    assert again == _texts(asyncio.run(_post_all(normal.url, _bodies_for_model(normal.model_name, 4))))


def test_killing_one_prefill_node_leaves_the_other_serving(xpyd, normal):
    """P dies with requests in flight: each ends (served by the other P, or a clean error), none hangs."""
    bodies = _bodies_for_model(normal.model_name, 8, max_tokens=16)
    expected = _texts(asyncio.run(_post_all(normal.url, bodies)))

    async def send_and_kill() -> List[Tuple[int, str]]:
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(client.post(f"{xpyd.master.url}/v1/completions", json=body)) for body in bodies]
            await asyncio.sleep(0)  # the requests are on their way
            xpyd.nodes["p2"].proc.send_signal(signal.SIGKILL)
            answers = await asyncio.gather(*tasks)
            return [(answer.status_code, answer.text) for answer in answers]

    answers = asyncio.run(send_and_kill())
    served = 0
    for (status, text), want in zip(answers, expected):
        if status == 200:
            assert json.loads(text)["choices"][0]["text"] == want
            served += 1
        else:
            assert json.loads(text)["error"]["message"], text  # a clean error, never a hang or a traceback
    assert served > 0
    xpyd.wait_unlisted("p2")
    xpyd.nodes.pop("p2").stop()
    after = _bodies_for_model(normal.model_name, 6)
    assert _texts(asyncio.run(_post_all(xpyd.master.url, after))) == _texts(asyncio.run(_post_all(normal.url, after)))


def test_a_node_joining_mid_traffic_gets_work_and_no_kv_is_left(xpyd, normal):
    before = _transfers(xpyd.nodes["p1"])
    joined = xpyd.start_node("p3", "prefill")
    xpyd.wait_listed(["p3"])
    bodies = _bodies_for_model(normal.model_name, 12)
    assert _texts(asyncio.run(_post_all(xpyd.master.url, bodies))) == _texts(asyncio.run(_post_all(normal.url, bodies)))
    assert _settled_transfers(joined) > 0 and _settled_transfers(xpyd.nodes["p1"], before) > before
    for name, node in xpyd.nodes.items():
        node.wait_idle()
        assert _kv_full(node), name
