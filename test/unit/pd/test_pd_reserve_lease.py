"""A decode reservation's lease: the master's own wait, sent with every reservation, bounded by the node's flag.

A decode node reserves KV before the prefill node is even asked, so the reservation must live
as long as the master is prepared to wait for that KV (its prefill timeout plus the hand-off
margin); a fixed 30 s lease failed requests that were only queued on a busy prefill node.
These tests follow the lease from the master's arithmetic through the node's wire body, the
request spec and its shared-memory record, to the lease a decode rank gives its receive
(``test_pd_rank_lease.py`` runs the rank with real transfer processes).  Masters and nodes
are the real ones over loopback HTTP (stand-ins play the other side: ``pd_master_support``,
``pd_node_api_support``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict

import httpx
import numpy as np
import pytest

from lightllm.common.sampling import SamplingParams
from lightllm.server.argument_error import ArgumentError
from lightllm.server.core.objs.request_spec import PdPlacement, RequestSpec, RequestSpecError
from lightllm.server.core.objs.shm_req_codec import encoded_stop_sequences, read_request_spec, write_input_fields
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_NONE, PD_KIND_PREFILL, record_dtype
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.plan import pd_rank_settings
from lightllm.server.model_rank.rank_config import DEFAULT_RESERVE_LEASE_S, PdRankSettings
from lightllm.server.pd.master.phase_deadlines import PhaseDeadlines

from pd_master_support import REQUEST_TIMEOUT, Cluster, sse_events
from pd_node_api_support import NodeApp, decode_body, node, prefill_body  # noqa: F401 - node is a fixture
from pd_node_stand_in import reference_tokens

PREFILL_S, TRANSFER_S = 40.0, 7.0


def test_the_master_lease_covers_its_prefill_wait_and_the_handoff() -> None:
    deadlines = PhaseDeadlines(prefill_s=PREFILL_S, decode_token_s=120.0, handoff_s=TRANSFER_S)
    assert deadlines.reserve_lease_s == PREFILL_S + TRANSFER_S
    # The defaults: 600 s prefill timeout + 30 s transfer timeout, not the former fixed 30 s.
    assert PhaseDeadlines(prefill_s=600.0, decode_token_s=120.0).reserve_lease_s == 630.0


@pytest.mark.parametrize(
    ("cap", "requested", "lease"),
    [
        (None, 630.0, 630.0),  # no flag: the master's lease, however long
        (5.0, 630.0, 5.0),  # the flag bounds it
        (900.0, 630.0, 630.0),  # a bound above the master's lease changes nothing
        (None, 0.0, DEFAULT_RESERVE_LEASE_S),  # an older master sent none: the former default
        (5.0, 0.0, 5.0),  # ... or the node's own flag
    ],
)
def test_a_decode_rank_holds_the_masters_lease_within_its_flag(cap, requested: float, lease: float) -> None:
    assert PdRankSettings(reserve_lease_s=cap).lease_for(requested) == lease


def test_the_flag_is_an_optional_bound_checked_at_start_up() -> None:
    parser = make_argument_parser()
    decode = ["--model_dir", "m", "--run_mode", "decode"]
    validate_args(parser.parse_args(decode), 0)  # the default (no bound) passes the start-up checks
    assert pd_rank_settings(parser.parse_args(decode)).reserve_lease_s is None
    assert pd_rank_settings(parser.parse_args([*decode, "--pd_reserve_lease_seconds", "5"])).reserve_lease_s == 5.0
    for value in ("0", "-1"):
        with pytest.raises(ArgumentError) as err:
            validate_args(parser.parse_args([*decode, "--pd_reserve_lease_seconds", value]), 0)
        assert str(err.value).startswith("--pd_reserve_lease_seconds must be a positive, finite number of seconds")
    with pytest.raises(SystemExit):  # argparse's own one-line error
        parser.parse_args([*decode, "--pd_reserve_lease_seconds", "inf"])


def _params() -> SamplingParams:
    return SamplingParams(max_new_tokens=4)


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, True, "5"])
def test_a_lease_must_be_a_finite_number_of_seconds(bad: Any) -> None:
    with pytest.raises(RequestSpecError) as err:
        PdPlacement(kind=PD_KIND_DECODE, lease_s=bad)
    assert err.value.field == "pd_lease_s"


@pytest.mark.parametrize("kind", [PD_KIND_NONE, PD_KIND_PREFILL])
def test_only_a_decode_request_carries_a_lease(kind: int) -> None:
    with pytest.raises(RequestSpecError, match="pd_lease_s applies to PD decode requests only"):
        PdPlacement(kind=kind, lease_s=5.0)
    assert PdPlacement(kind=kind).lease_s == 0.0


def test_the_lease_survives_the_shared_memory_record() -> None:
    spec = RequestSpec.build([3, 4, 5], _params(), pd_kind=PD_KIND_DECODE, pd_epoch=2, pd_lease_s=630.5)
    records = np.zeros(1, dtype=record_dtype(16))
    records.view(np.uint8)[:] = 0xA5  # stale bytes: the codec must overwrite the field
    write_input_fields(records[0], spec, encoded_stop_sequences(spec))
    assert float(records[0]["pd_lease_s"]) == 630.5
    back = read_request_spec(records[0])
    assert back == spec and back.pd.lease_s == 630.5
    assert PdPlacement(kind=PD_KIND_DECODE, lease_s=7).lease_s == 7.0  # whole seconds are seconds too


def test_a_decode_body_carries_the_lease_into_the_spec(node: NodeApp) -> None:  # noqa: F811
    node.decode.script = []
    for body, lease in ((decode_body(reserve_lease_seconds=630.0), 630.0), (decode_body(reserve_lease_seconds=7), 7.0),
                        (decode_body(), 0.0)):  # absent: an older master; the node's own lease applies
        httpx.post(f"{node.decode_url}/pd/node/decode", json=body, timeout=10)
        assert node.decode.calls[-1]["lease_s"] == lease
        assert node.decode.calls[-1]["pd_kind"] == PD_KIND_DECODE


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/pd/node/decode", decode_body(reserve_lease_seconds=0)),
        ("/pd/node/decode", decode_body(reserve_lease_seconds=-3.5)),
        ("/pd/node/decode", decode_body(reserve_lease_seconds=True)),
        ("/pd/node/decode", decode_body(reserve_lease_seconds="30")),
        ("/pd/node/prefill", prefill_body(reserve_lease_seconds=30.0)),  # a prefill node reserves nothing
    ],
)
def test_a_bad_lease_is_refused_naming_the_field(node: NodeApp, path: str, body: Dict[str, Any]) -> None:  # noqa: F811
    url = node.prefill_url if path == "/pd/node/prefill" else node.decode_url
    calls = len(node.decode.calls) + len(node.prefill.calls)
    response = httpx.post(f"{url}{path}", json=body, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "reserve_lease_seconds"
    assert len(node.decode.calls) + len(node.prefill.calls) == calls


def test_the_master_sends_its_lease_with_every_reservation(tiny_llama_dir: Path) -> None:
    cluster = Cluster(str(tiny_llama_dir), "--pd_prefill_timeout_seconds", str(PREFILL_S),
                      "--pd_transfer_timeout_seconds", str(TRANSFER_S))
    try:
        cluster.decode.segment_limit = 2  # continuation segments reserve again: each needs the lease
        prompt = "a story in segments"
        expected = reference_tokens(cluster.master.manager.served.encode_prompt(prompt), 7)
        response = httpx.post(f"{cluster.master.url}/generate_stream", timeout=REQUEST_TIMEOUT,
                              json={"inputs": prompt, "parameters": {"max_new_tokens": 7}})
        assert [event["token"]["id"] for event in sse_events(response)] == expected
        reservations = cluster.decode.bodies
        assert [body["segment_index"] for body in reservations] == [0, 1, 2]
        assert [body["reserve_lease_seconds"] for body in reservations] == [PREFILL_S + TRANSFER_S] * 3
        assert all("reserve_lease_seconds" not in body for body in cluster.prefill.bodies)
    finally:
        cluster.stop()
