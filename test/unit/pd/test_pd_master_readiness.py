"""When a PD master serves at all: readiness, node admission, its own flags and draining.

The master is the real one (flags -> build_master -> create_app -> uvicorn); the prefill and
decode stand-ins (pd_node_stand_in.py) speak the node contract's NDJSON and register with the
real PdNodeClient.  These tests check what the master answers before both roles
registered, to a node of another model, to node-only flags and while it drains.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from pd_master_support import Cluster, cluster_fixture, generate  # noqa: F401 - cluster_fixture is the "cluster" fixture
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.pd_master import check_master_flags


def test_not_ready_until_both_roles_registered(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), register=False)
    try:
        url = cluster.master.url
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "pd_not_ready"
        cluster.prefill.register()
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["error"]["message"].endswith("no decode node registered")
        response = generate(cluster, "hello", 3)
        assert response.status_code == 503
        assert response.json()["error"] == {
            "message": "The PD cluster is not ready: no decode node registered",
            "type": "service_unavailable_error", "param": None, "code": "pd_not_ready"}
        cluster.decode.register()
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        assert generate(cluster, "hello", 3).status_code == 200
    finally:
        cluster.stop()


def test_node_of_another_model_is_refused(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), register=False)
    try:
        body = {**cluster.decode.info().to_dict(), "model_name": "another-model"}
        response = httpx.post(f"{cluster.master.url}/pd/register", json=body)
        assert response.status_code == 409
        error = response.json()["error"]
        assert error["code"] == "incompatible_node"
        assert re.search(r"model_name: 'another-model' is not served by this master", error["message"])
    finally:
        cluster.stop()


def test_node_that_stops_at_other_eos_ids_is_refused(tiny_llama_dir: Path) -> None:
    """The nodes decide where generation stops and the master what text it shows for it."""
    cluster = Cluster(str(tiny_llama_dir), register=False)
    try:
        master_eos = sorted(set(cluster.master.manager.served.eos_token_ids))
        body = {**cluster.decode.info().to_dict(), "eos_token_ids": [5]}
        response = httpx.post(f"{cluster.master.url}/pd/register", json=body)
        assert response.status_code == 409 and response.json()["error"]["code"] == "incompatible_node"
        assert f"eos_token_ids: the node stops at [5], this master at {master_eos}" in response.json()["error"]["message"]
        same = {**cluster.decode.info().to_dict(), "eos_token_ids": list(reversed(master_eos))}
        assert httpx.post(f"{cluster.master.url}/pd/register", json=same).status_code == 200
        bad = {**cluster.decode.info().to_dict(), "eos_token_ids": ["2"]}
        assert httpx.post(f"{cluster.master.url}/pd/register", json=bad).json()["error"]["param"] == "eos_token_ids"
    finally:
        cluster.stop()


def test_node_that_takes_shorter_requests_than_the_master_admits_is_refused(tiny_llama_dir: Path) -> None:
    """The master may place any request it admits on any node: a node with a smaller
    --max_req_total_len would refuse valid requests with a 400, whichever node they drew."""
    cluster = Cluster(str(tiny_llama_dir), register=False)
    try:
        limit = cluster.master.manager.served.max_req_total_len
        body = {**cluster.decode.info().to_dict(), "max_req_total_len": limit - 1}
        response = httpx.post(f"{cluster.master.url}/pd/register", json=body)
        assert response.status_code == 409 and response.json()["error"]["code"] == "incompatible_node"
        assert (f"max_req_total_len: the node takes at most {limit - 1} tokens per request, this master admits up "
                f"to {limit}") in response.json()["error"]["message"]
        for admitted in (limit, limit + 1, None):  # as long or longer; a node that does not say
            same = {**cluster.decode.info().to_dict(), "max_req_total_len": admitted}
            assert httpx.post(f"{cluster.master.url}/pd/register", json=same).status_code == 200
        bad = {**cluster.decode.info().to_dict(), "max_req_total_len": 0}
        assert httpx.post(f"{cluster.master.url}/pd/register", json=bad).json()["error"]["param"] == "max_req_total_len"
    finally:
        cluster.stop()


def test_node_flags_on_the_master_are_refused() -> None:
    parser = make_argument_parser()
    check_master_flags(parser.parse_args(["--run_mode", "pd_master", "--model_dir", "m", "--port", "9",
                                          "--pd_decode_token_timeout_seconds", "5"]))
    with pytest.raises(ValueError) as err:
        check_master_flags(parser.parse_args(["--run_mode", "pd_master", "--model_dir", "m", "--tp", "2",
                                              "--pd_max_segment_tokens", "8"]))
    assert str(err.value).startswith("--pd_max_segment_tokens, --tp configure model nodes")
    # Each flag goes to the role that takes it: a decode node refuses what only a prefill node reads.
    assert ("give --tp to the prefill and decode nodes; --pd_max_segment_tokens to the decode nodes"
            in str(err.value))


def test_a_draining_master_is_unhealthy_and_refuses(cluster: Cluster) -> None:
    assert httpx.get(f"{cluster.master.url}/health").status_code == 200
    cluster.master.manager.refuse_new_requests("The server is shutting down", "server_shutting_down")
    health = httpx.get(f"{cluster.master.url}/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"
    response = generate(cluster, "hello", 2)
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_shutting_down"
    assert cluster.decode.bodies == []
