"""The PD cluster key: the /pd/ endpoints take only it, and nodes and master send it to each other.

The app side runs on the real ``create_app`` (scripted manager behind it) with the real
membership router; the clients are the real node client and master node client against real
uvicorn servers on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Optional

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from api_fakes import FakeManager, assert_error
from pd_membership_support import node
from uvicorn_in_thread import ThreadServer
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.http.errors import install_error_handlers
from lightllm.server.http.app import create_app
from lightllm.server.http.middleware.auth import ApiKeyMiddleware
from lightllm.server.http.server_options import AuthPolicy, HttpServerOptions
from lightllm.server.pd.master.membership_api import membership_router, new_master_id
from lightllm.server.pd.node.registration_client import NodeRegistrationRefused, PdNodeClient
from lightllm.server.pd.master.node_registry import NodeRegistry
from lightllm.server.pd.master.node_streams import NodeCallError, NodeStreams

USER, ADMIN, CLUSTER = "user-key", "admin-key", "cluster-key"


def _app(policy: AuthPolicy) -> FastAPI:
    registry = NodeRegistry(heartbeat_interval_s=5.0, max_missed_heartbeats=3)
    router = membership_router(registry, new_master_id(), has_cluster_key=policy.cluster_key is not None)
    return create_app(FakeManager(), HttpServerOptions(auth=policy), extra_routers=[router])


def _client(app: FastAPI, key: Optional[str]) -> TestClient:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return TestClient(app, headers=headers, raise_server_exceptions=False)


def test_cluster_paths_take_only_the_cluster_key() -> None:
    app = _app(AuthPolicy(api_keys=(USER,), admin_keys=(ADMIN,), cluster_key=CLUSTER))
    beat = {"node_id": "d0"}
    missing = _client(app, None).post("/pd/heartbeat", json=beat)
    assert_error(missing, 401, code="missing_cluster_key")
    assert "--pd_cluster_key" in missing.json()["error"]["message"]
    for key in (USER, ADMIN, "nope"):
        assert_error(_client(app, key).post("/pd/heartbeat", json=beat), 401, code="invalid_cluster_key")
    # The cluster key reaches the endpoint (which does not know the node) ...
    assert_error(_client(app, CLUSTER).post("/pd/heartbeat", json=beat), 404, "node_id", "unknown_node")
    # ... and opens nothing else, while client keys keep working there.
    assert_error(_client(app, CLUSTER).get("/v1/models"), 401, code="invalid_api_key")
    assert _client(app, USER).get("/v1/models").status_code == 200
    assert _client(app, None).get("/health").status_code != 401


def test_without_a_cluster_key_cluster_paths_follow_the_client_key_rule() -> None:
    open_app = _app(AuthPolicy())
    assert _client(open_app, None).get("/pd/nodes").status_code == 200
    keyed = _app(AuthPolicy(api_keys=(USER,)))
    assert_error(_client(keyed, None).get("/pd/nodes"), 401, code="missing_api_key")
    # HEAD as on every read-only path: GET's status and headers without the body, the same key rule.
    head = _client(open_app, None).head("/pd/nodes")
    assert head.status_code == 200 and head.content == b""
    assert _client(keyed, None).head("/pd/nodes").status_code == 401


def _parse(argv: list[str]) -> argparse.Namespace:
    return make_argument_parser().parse_args(["--model_dir", "m", *argv])


def test_the_key_comes_from_the_flag_or_the_environment_on_pd_processes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTLLM_PD_CLUSTER_KEY", "from-env")
    assert AuthPolicy.from_args(_parse(["--run_mode", "decode"])).cluster_key == "from-env"
    assert AuthPolicy.from_args(_parse(["--run_mode", "pd_master", "--pd_cluster_key", "flag"])).cluster_key == "flag"
    assert AuthPolicy.from_args(_parse([])).cluster_key is None  # a normal server has no /pd/ endpoints
    monkeypatch.setenv("LIGHTLLM_PD_CLUSTER_KEY", "")
    assert AuthPolicy.from_args(_parse(["--run_mode", "prefill"])).cluster_key is None


@pytest.mark.parametrize("value", ["  ", " from-env ", "key\n", "in\u00e4ner"])
def test_a_blank_or_padded_environment_key_is_refused_without_showing_it(monkeypatch: pytest.MonkeyPatch,
                                                                          value: str) -> None:
    # Taken as "no key", a blank value would silently leave the cluster's endpoints open.
    monkeypatch.setenv("LIGHTLLM_PD_CLUSTER_KEY", value)
    refusal = "beyond ASCII .*httpx" if value.strip() == value else "must be non-empty and carry no surrounding"
    with pytest.raises(ValueError, match=f"LIGHTLLM_PD_CLUSTER_KEY.*{refusal}") as err:
        AuthPolicy.from_args(_parse(["--run_mode", "decode"]))
    assert value.strip() == "" or value.strip() not in str(err.value)
    # The flag, when given, is the key: the variable is not read.
    assert AuthPolicy.from_args(_parse(["--run_mode", "decode", "--pd_cluster_key", "flag"])).cluster_key == "flag"


@pytest.mark.parametrize("run_mode", ["pd_master", "prefill", "decode"])
def test_client_keys_without_a_cluster_key_are_refused_on_pd_processes(run_mode: str) -> None:
    with pytest.raises(ValueError, match="needs a cluster key.*LIGHTLLM_PD_CLUSTER_KEY"):
        AuthPolicy(api_keys=(USER,)).check_cluster(run_mode)
    AuthPolicy(api_keys=(USER,), cluster_key=CLUSTER).check_cluster(run_mode)
    AuthPolicy().check_cluster(run_mode)
    AuthPolicy(api_keys=(USER,)).check_cluster("normal")


@pytest.mark.parametrize("run_mode", ["pd_master", "prefill", "decode"])
@pytest.mark.parametrize("keys", [{"api_keys": (USER, CLUSTER)}, {"api_keys": (USER,), "admin_keys": (CLUSTER,)},
                                  {"admin_keys": (CLUSTER,)}])
def test_a_cluster_key_that_is_also_a_client_key_is_refused(run_mode: str, keys: dict) -> None:
    # That client key would open /pd/register: its holder could join as a node and be sent prompts.
    with pytest.raises(ValueError, match="cluster key .* is also an API or admin key") as err:
        AuthPolicy(cluster_key=CLUSTER, **keys).check_cluster(run_mode)
    assert CLUSTER not in str(err.value)
    AuthPolicy(cluster_key=CLUSTER + "x", **keys).check_cluster(run_mode)


def test_the_cluster_key_refusal_names_where_the_client_keys_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTLLM_PD_CLUSTER_KEY", raising=False)
    monkeypatch.setenv("LIGHTLLM_API_KEY", USER)
    with pytest.raises(ValueError, match="^LIGHTLLM_API_KEY on a PD master needs a cluster key"):
        AuthPolicy.from_args(_parse(["--run_mode", "pd_master"])).check_cluster("pd_master")
    with pytest.raises(ValueError, match="^--api_key on a PD decode node needs a cluster key"):
        AuthPolicy.from_args(_parse(["--run_mode", "decode", "--api_key", USER])).check_cluster("decode")


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--pd_cluster_key", "k"], "for PD clusters"),
     (["--run_mode", "decode", "--pd_cluster_key", " k"], "surrounding whitespace"),
     (["--run_mode", "pd_master", "--pd_cluster_key", ""], "non-empty"),
     (["--run_mode", "prefill", "--pd_cluster_key", "cl\u00fcster"], "character 3 of the key is a character beyond ASCII")],
)
def test_bad_cluster_key_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ArgumentError, match=message):
        validate_args(_parse(argv), cuda_device_count=0)


def _master(cluster_key: Optional[str]) -> ThreadServer:
    registry = NodeRegistry(heartbeat_interval_s=0.2, max_missed_heartbeats=3)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(membership_router(registry, new_master_id(), has_cluster_key=cluster_key is not None))
    # Client keys only with a cluster key: a PD process with client keys alone is refused at start-up.
    policy = AuthPolicy(api_keys=(USER,), cluster_key=cluster_key) if cluster_key else AuthPolicy()
    app.add_middleware(ApiKeyMiddleware, policy=policy)
    return ThreadServer(app)


async def _register(master: ThreadServer, cluster_key: Optional[str]) -> PdNodeClient:
    client = PdNodeClient(master.url, node("d0", "decode"), heartbeat_interval_s=0.2,
                          cluster_key=cluster_key)
    client.start()
    try:
        await client.wait_registered(10)
    finally:
        await client.stop()
    return client


@pytest.mark.parametrize(
    ("master_key", "node_key", "refusal"),
    [(CLUSTER, None, "send the cluster key"), (CLUSTER, "wrong", "Invalid PD cluster key"),
     (None, CLUSTER, "has no cluster key but this node has one")],
)
def test_node_registration_is_refused_unless_both_sides_hold_the_same_key(master_key, node_key, refusal) -> None:
    master = _master(master_key)
    try:
        with pytest.raises(NodeRegistrationRefused, match=refusal):
            asyncio.run(_register(master, node_key))
    finally:
        master.stop()


def test_node_with_the_cluster_key_registers_and_heartbeats() -> None:
    master = _master(CLUSTER)
    try:
        async def run() -> PdNodeClient:
            client = PdNodeClient(master.url, node("d0", "decode"), heartbeat_interval_s=0.2,
                                  cluster_key=CLUSTER)
            client.start()
            try:
                await client.wait_registered(10)
                deadline = time.monotonic() + 10
                while client.heartbeats < 2:
                    assert time.monotonic() < deadline, "no heartbeats"
                    await asyncio.sleep(0.05)
            finally:
                await client.stop()
            return client

        client = asyncio.run(run())
        assert client.registered and client.refusal is None
    finally:
        master.stop()


def test_the_master_sends_the_cluster_key_to_nodes() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/pd/node/transfer_setup")
    async def setup(request: Request) -> dict:
        return {"epoch": (await request.json())["epoch"]}

    app.add_middleware(ApiKeyMiddleware, policy=AuthPolicy(cluster_key=CLUSTER))
    served = ThreadServer(app)
    target = node("d0", "decode", http_address=f"127.0.0.1:{served.port}")

    async def call(key: Optional[str]) -> dict:
        streams = NodeStreams(cluster_key=key)
        try:
            return await streams.post_json(target, "/pd/node/transfer_setup", {"epoch": 3}, timeout_s=10)
        finally:
            await streams.aclose()

    try:
        assert asyncio.run(call(CLUSTER)) == {"epoch": 3}
        with pytest.raises(NodeCallError) as refused:
            asyncio.run(call(None))
        assert refused.value.status == 401 and refused.value.code == "missing_cluster_key"
    finally:
        served.stop()
