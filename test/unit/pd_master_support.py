"""A PD master under test, and a cluster of node stand-ins around it.

The master is the real thing (:func:`~lightllm.server.launch.pd_master.build_master`
from parsed flags, ``create_app``, uvicorn on loopback); the prefill and decode nodes are the
stand-ins of ``pd_node_stand_in.py``.  The ``cluster`` fixture (a :class:`Cluster` of any number
of prefill and decode stand-ins) and the request/metrics helpers at the end are what the
``test_pd_master_*`` modules share.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import pytest

from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import HttpServerOptions
from lightllm.server.launch.pd_master import build_master, check_master_flags
from lightllm.server.pd.master.membership_api import membership_router, new_master_id, readiness_router

from pd_node_stand_in import HEARTBEAT_S, REQUEST_TIMEOUT, Handoff, NodeStandIn, reference_tokens
from uvicorn_in_thread import ThreadServer

MISSED = 3


class MasterUnderTest:
    """The real PD master app (from parsed flags) served by uvicorn on loopback."""

    def __init__(self, model_dir: str, *flags: str) -> None:
        parser = make_argument_parser()
        # The test's fast heartbeats unless ``flags`` sets them (a flag typed twice is refused).
        defaults = [item for flag, value in (("--pd_heartbeat_interval", HEARTBEAT_S),
                                              ("--pd_max_missed_heartbeats", MISSED))
                    if flag not in flags for item in (flag, str(value))]
        args = parser.parse_args(["--run_mode", "pd_master", "--model_dir", str(model_dir), *defaults, *flags])
        validate_args(args, 0)
        check_master_flags(args)
        self.manager, self.registry = build_master(args)
        routers = [readiness_router(self.registry, refusal=self.manager.refusal),
                   membership_router(self.registry, new_master_id(), node_details=self.manager.node_details,
                                     continuations=self.manager.continuations_pending)]
        self.server = ThreadServer(create_app(self.manager, HttpServerOptions.from_args(args), extra_routers=routers))

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


class Cluster:
    """A master under test with ``prefills`` prefill and ``decodes`` decode stand-ins.

    ``prefill`` / ``decode`` are the first of each role (node ids ``prefill-standin`` and
    ``decode-standin``); more are ``p1``, ``p2``, ... and ``d1``, ``d2``, ...  :meth:`add` starts
    (and registers) one more mid-test.
    """

    def __init__(self, model_dir: str, *flags: str, register: bool = True, prefills: int = 1,
                 decodes: int = 1) -> None:
        self.master = MasterUnderTest(model_dir, *flags)
        self.handoff = Handoff()
        self.prefills: List[NodeStandIn] = []
        self.decodes: List[NodeStandIn] = []
        for _ in range(prefills):
            self.add("prefill", register=False)
        for _ in range(decodes):
            self.add("decode", register=False)
        self.prefill, self.decode = self.prefills[0], self.decodes[0]
        if register:
            for node in self.prefills + self.decodes:
                node.register()

    def add(self, role: str, register: bool = True) -> NodeStandIn:
        """Start one more stand-in of ``role`` (registered unless ``register`` is False)."""
        nodes = self.prefills if role == "prefill" else self.decodes
        node_id = f"{role}-standin" if not nodes else f"{role[0]}{len(nodes)}"
        node = NodeStandIn(role, self.master.url, self.handoff, self.master.manager.served.model_name, node_id=node_id)
        nodes.append(node)
        if register:
            node.register()
        return node

    def by_id(self, node_id: str) -> NodeStandIn:
        """The stand-in registered as ``node_id``."""
        return next(node for node in self.prefills + self.decodes if node.node_id == node_id)

    def stop(self) -> None:
        for part in (*self.prefills, *self.decodes, self.master):
            part.stop()


def master_manager(model_dir: Path) -> Any:
    """The manager of a PD master over ``model_dir`` with default flags, built as the launcher builds
    it; no node joins, so it answers what needs none (refusals, tokenization)."""
    args = make_argument_parser().parse_args(["--run_mode", "pd_master", "--model_dir", str(model_dir)])
    validate_args(args, 0)
    check_master_flags(args)
    manager, _registry = build_master(args)
    return manager


@pytest.fixture(name="cluster")
def cluster_fixture(tiny_llama_dir: Path) -> Iterator[Cluster]:
    """A registered :class:`Cluster` of the tiny model, stopped after the test.

    Test modules import it (``from pd_master_support import cluster_fixture``) and take
    ``cluster`` as an argument.
    """
    cluster = Cluster(str(tiny_llama_dir))
    yield cluster
    cluster.stop()


def generate(cluster: Cluster, prompt: str, max_new_tokens: int, **extra: Any) -> httpx.Response:
    """POST a non-streaming ``/generate`` with details to the cluster's master."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "return_details": True, **extra}}
    return httpx.post(f"{cluster.master.url}/generate", json=body, timeout=REQUEST_TIMEOUT)


def sse_events(response: httpx.Response) -> List[Dict[str, Any]]:
    """The JSON payloads of a finished server-sent-events response, in order."""
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the Prometheus sample ``name`` with (at least) ``labels`` in ``text``."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


class StraddlingStop:
    """A 4-character stop string whose halves come from the stand-ins' tokens on either side of a
    token boundary: ``tokens`` the greedy tokens, ``full`` their text, ``boundary`` the boundary's
    character offset, ``completes_at`` how many tokens it takes to complete the stop string."""

    def __init__(self, cluster: "Cluster", prompt: str, max_tokens: int, after_tokens: int) -> None:
        tokenizer = cluster.master.manager.served.tokenizer
        self.tokens = reference_tokens(cluster.master.manager.served.encode_prompt(prompt), max_tokens)
        pieces = [tokenizer.decode([token], skip_special_tokens=True) for token in self.tokens]
        self.full = "".join(pieces)
        self.boundary = len("".join(pieces[:after_tokens]))
        self.stop = self.full[self.boundary - 2: self.boundary + 2]
        assert len(self.stop) == 4 and self.full.find(self.stop) == self.boundary - 2, (self.full, self.stop)
        self.completes_at = next(n for n in range(1, len(pieces) + 1)
                                 if len("".join(pieces[:n])) >= self.boundary + 2)

    def text(self, include: bool) -> str:
        """The answer's text with or without the stop string (``include_stop_str_in_output``)."""
        return self.full[: self.boundary + (2 if include else -2)]
