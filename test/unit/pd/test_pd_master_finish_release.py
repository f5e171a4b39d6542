"""A PD generation frees what the nodes hold for it before its last event leaves the master.

The master handed a generation's last event on first and closed its node streams only once its
caller asked for the next one.  The API's fan-out of ``n`` choices waits for every choice's first
event before it reads on, and stops reading a choice at its finish: a request with ``n`` = 2 whose
first token ended each choice (``max_tokens`` 1, a stop token) kept choice 0's decode reservation
while choice 1 waited, busy, for that very KV, until the busy retry gave up (or, with a long
retry, the client did), and every other request waited behind it.

Against the node stand-ins (pd_node_stand_in.py) over real HTTP.  The decode stand-in holds one
reservation at a time (``max_reservations``), as a decode node whose KV fits one of the prompts.
The manager-level tests read a generation up to its last event and ask nothing more, as the
fan-out does, and check the master's own view (its placements) and the decode stand-in's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import httpx
import pytest

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.request_manager import GenerationEvent
from pd_master_support import REQUEST_TIMEOUT, Cluster, StraddlingStop
from pd_node_stand_in import reference_tokens
from test_pd_master_xpyd import wait_for

BUSY_RETRY_ENV = "LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS"
PROMPT = "hello there, general"


@pytest.fixture(name="one_reservation_cluster")
def one_reservation_cluster_fixture(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A cluster whose decode stand-in holds one reservation at a time.

    The master retries busy answers for 20 s: the second choice's reservation is answered busy
    until the first one's is released, which the fixed master does at once; the old one did not
    until the busy retry gave up (503 server_busy).
    """
    monkeypatch.setenv(BUSY_RETRY_ENV, "20")
    cluster = Cluster(str(tiny_llama_dir))
    cluster.decode.max_reservations = 1
    yield cluster
    cluster.stop()


@pytest.fixture(name="plain_cluster")
def plain_cluster_fixture(tiny_llama_dir: Path) -> Iterator[Cluster]:
    """A cluster with one stand-in of each role and no limits."""
    cluster = Cluster(str(tiny_llama_dir))
    yield cluster
    cluster.stop()


def _first_token(cluster: Cluster, prompt: str = PROMPT) -> int:
    return reference_tokens(cluster.master.manager.served.encode_prompt(prompt), 1)[0]


@pytest.mark.parametrize("ending", ["max_tokens_1", "stop_token_streamed"])
def test_n_choices_whose_first_token_ends_each_get_answered_when_only_one_reservation_fits(
        one_reservation_cluster: Cluster, ending: str) -> None:
    cluster = one_reservation_cluster
    first = _first_token(cluster)
    body: Dict[str, Any] = {"model": cluster.master.manager.served.model_name, "prompt": PROMPT, "n": 2,
                            "temperature": 0}
    if ending == "max_tokens_1":
        body["max_tokens"] = 1
        finish = "length"
    else:
        body.update(max_tokens=20, stop_token_ids=[first], stream=True)
        finish = "stop"
    response = httpx.post(f"{cluster.master.url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 200, response.text
    if body.get("stream"):
        finishes = {choice["index"]: choice["finish_reason"] for event in _stream_events(response)
                    for choice in event["choices"] if choice.get("finish_reason")}
    else:
        finishes = {choice["index"]: choice["finish_reason"] for choice in response.json()["choices"]}
    assert finishes == {0: finish, 1: finish}
    # Both choices reserved on D in turn; nothing moved there: the master closed both reservations.
    reserved = {b["request_id"] for b in cluster.decode.bodies}
    assert len(reserved) == 2
    wait_for(lambda: set(cluster.decode.aborted) == reserved and cluster.decode.open_reservations == 0,
             "both decode reservations closed")


def _stream_events(response: httpx.Response) -> List[Dict[str, Any]]:
    """The JSON events of a finished OpenAI stream (without its ``[DONE]``)."""
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _spec(cluster: Cluster, max_new_tokens: int, **params: Any) -> RequestSpec:
    prompt_ids = cluster.master.manager.served.encode_prompt(PROMPT)
    return RequestSpec(prompt_ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params))


async def _read_to_last_event(cluster: Cluster, spec: RequestSpec) -> Tuple[Any, List[GenerationEvent], int]:
    """Read a generation up to its last event and no further, as the fan-out reads a finished choice.

    Returns the suspended generation (the caller closes it), its events, and the requests the
    master still counts on the decode node at that moment (its placements: what it holds there).
    """
    manager = cluster.master.manager
    generation = manager.generate(spec)
    events: List[GenerationEvent] = []
    while not events or events[-1].finish_reason is None:
        events.append(await generation.__anext__())
    return generation, events, manager.node_details(cluster.decode.node_id)["in_flight_requests"]


def _run_to_last_event(cluster: Cluster, spec: RequestSpec) -> Tuple[Any, List[GenerationEvent], int]:
    return cluster.master.server.call(_read_to_last_event(cluster, spec), timeout=60)


def _close(cluster: Cluster, generation: Any) -> None:
    cluster.master.server.call(generation.aclose(), timeout=30)


def _wait_decode_closed(cluster: Cluster, segment: Tuple[int, int]) -> None:
    """The decode stand-in saw the stream of ``(request_id, segment_index)`` closed by the master."""
    wait_for(lambda: segment in cluster.decode.aborted_segments, f"the decode stream {segment} closed", timeout=20)


@pytest.mark.parametrize("ending", ["max_tokens_1", "stop_token", "continuation_ends_at_once"])
def test_a_first_token_that_ends_the_generation_frees_the_decode_reservation_before_it_is_handed_on(
        plain_cluster: Cluster, ending: str) -> None:
    cluster = plain_cluster
    generation = None
    try:
        if ending == "max_tokens_1":
            spec, finish, segment = _spec(cluster, 1), "length", 0
        elif ending == "stop_token":
            spec, finish, segment = _spec(cluster, 20, stop_token_ids=[_first_token(cluster)]), "stop", 0
        else:
            # Segment 0 is P's first token and 2 tokens of D; segment 1's P produces the last one.
            cluster.decode.segment_limit = 2
            spec, finish, segment = _spec(cluster, 4), "length", 1
        generation, events, decode_in_flight = _run_to_last_event(cluster, spec)
        assert events[-1].finish_reason == finish
        assert len(events) == (1 if ending == "stop_token" else spec.params.max_new_tokens)
        request_id = events[-1].request_id
        # The master let go of D before the last event left it (old code: 1, until the next read).
        assert decode_in_flight == 0
        _wait_decode_closed(cluster, (request_id, segment))
        assert cluster.decode.open_reservations == 0
        assert [b["segment_index"] for b in cluster.prefill.bodies] == list(range(segment + 1))
    finally:
        if generation is not None:
            _close(cluster, generation)


def test_a_stop_string_ends_the_decode_stream_before_the_stopping_event_is_handed_on(plain_cluster: Cluster) -> None:
    cluster = plain_cluster
    generation = None
    try:
        straddling = StraddlingStop(cluster, PROMPT, 40, after_tokens=5)
        # D keeps its stream open after the stopping token (it would generate on): only the
        # master's close ends it.
        cluster.decode.hold_after = straddling.completes_at
        spec = _spec(cluster, 40, stop_sequences=[straddling.stop])
        generation, events, decode_in_flight = _run_to_last_event(cluster, spec)
        assert events[-1].finish_reason == "stop" and len(events) == straddling.completes_at
        assert decode_in_flight == 0
        _wait_decode_closed(cluster, (events[-1].request_id, 0))
    finally:
        cluster.decode.release_hold()
        if generation is not None:
            _close(cluster, generation)


def test_n_choices_that_finish_on_decode_still_get_every_token(one_reservation_cluster: Cluster) -> None:
    """Choices whose KV moved and whose last token comes from D are not cut short by the release
    (the second one reserves once D ended the first)."""
    cluster = one_reservation_cluster
    response = httpx.post(f"{cluster.master.url}/v1/completions", timeout=REQUEST_TIMEOUT, json={
        "model": cluster.master.manager.served.model_name, "prompt": PROMPT, "n": 2, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    expected = cluster.master.manager.served.tokenizer.decode(
        reference_tokens(cluster.master.manager.served.encode_prompt(PROMPT), 4), skip_special_tokens=True)
    assert [(c["text"], c["finish_reason"]) for c in response.json()["choices"]] == [(expected, "length")] * 2
    assert response.json()["usage"]["completion_tokens"] == 8
