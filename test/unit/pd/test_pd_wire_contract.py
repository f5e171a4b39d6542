"""The master and the nodes speak one wire contract (``pd/protocol/stream_lines.py``).

The master's request bodies are the node's models with every field decided by the master, and
they pass the node's own parsing; every line the node writes reads back, through the master's
one parser, as the event it was written from.  A field or an event kind changed on one side only
fails here, not at run time on the other node.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Set

import pytest

from lightllm.common.sampling import SamplingParams
from lightllm.server.http.validation.body import parse_body
from lightllm.server.pd.master import segment_flow
from lightllm.server.pd.master.continuation import SegmentEnd, first_segment, next_segment
from lightllm.server.pd.master.request_run import RequestRun
from lightllm.server.pd.master.segment_flow import decode_body
from lightllm.server.pd.node.request_bodies import request_spec_of
from lightllm.server.pd.protocol.node_events import (
    BUSY,
    ERROR,
    HANDED_OFF,
    NODE_EVENT_KINDS,
    RESERVED,
    SEGMENT_END,
    TOKEN,
    PdNodeEvent,
)
from lightllm.server.pd.protocol.stream_lines import (
    DecodeBody,
    PrefillBody,
    body_fields,
    event_line,
    read_line,
    token_from_line,
)
from lightllm.server.request_manager import GenerationEvent

VOCAB, MAX_LEN = 1000, 4096


def _undecided(body: Any) -> Set[str]:
    """The body's fields the master left to the model's default (it must decide each one)."""
    return set(type(body).model_fields) - body.model_fields_set


def _on_the_wire(body: Any) -> bytes:
    # What the master's HTTP client sends (httpx writes ``json=`` with json.dumps).
    return json.dumps(body_fields(body)).encode()


def _segments():
    params = SamplingParams(max_new_tokens=8, temperature=0.5, top_k=4, seed=3)
    first = first_segment(11, [5, 6, 7], params)
    following = next_segment(11, [5, 6, 7], params, [9, 10], first, SegmentEnd.KV_PRESSURE)
    return first, following


@pytest.mark.parametrize("high_priority", [False, True])
def test_master_bodies_pass_the_node_models_with_every_field_set(high_priority: bool) -> None:
    for segment in _segments():
        run = RequestRun(segment.request_id, high_priority=high_priority)
        reserve = decode_body(run, segment, 3, 35.0)
        prefill = reserve.prefill_body(kv_start=1, infer_high_priority=segment.infer_high_priority)
        for body, model in ((reserve, DecodeBody), (prefill, PrefillBody)):
            assert _undecided(body) == set()
            sent = body_fields(body)
            assert set(sent) == set(model.model_fields)
            # The node parses the master's bytes into the same body and accepts it as a request.
            parsed = parse_body(_on_the_wire(body), model)
            assert body_fields(parsed) == sent
            spec = request_spec_of(parsed, VOCAB, MAX_LEN)
            assert (spec.segment.segment_index, spec.segment.generated_before) == (
                segment.segment_index, segment.generated_before)
        assert reserve.high_priority_request is (high_priority or segment.segment_index > 0)
        shared = {name: value for name, value in body_fields(reserve).items() if name != "reserve_lease_seconds"}
        assert body_fields(prefill) == {**shared, "kv_start": 1, "infer_high_priority": segment.infer_high_priority}


def test_a_field_on_one_side_only_fails_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    first, _ = _segments()
    run = RequestRun(first.request_id)

    class WiderDecodeBody(DecodeBody):
        """The node's model with a field the master does not know."""

        node_only: int = 0

    monkeypatch.setattr(segment_flow, "DecodeBody", WiderDecodeBody)
    assert _undecided(decode_body(run, first, 0, 1.0)) == {"node_only"}
    monkeypatch.undo()

    # A field only the master sends is refused by the model it builds, and by the node's parser.
    sent = {**body_fields(decode_body(run, first, 0, 1.0)), "master_only": 1}
    with pytest.raises(ValueError, match="master_only"):
        DecodeBody(**sent)
    with pytest.raises(Exception, match="master_only"):
        parse_body(json.dumps(sent).encode(), DecodeBody)


def _token(finish_reason: Any = None) -> GenerationEvent:
    return GenerationEvent(request_id=11, token_id=42, text="hi", logprob=-math.inf, finish_reason=finish_reason,
                           prompt_tokens=3, cached_tokens=2, completion_tokens=1, top_logprobs={42: -0.5})


EVENTS: Dict[str, PdNodeEvent] = {
    RESERVED: PdNodeEvent(RESERVED, kv_start=2),
    TOKEN: PdNodeEvent(TOKEN, token=_token("stop")),
    BUSY: PdNodeEvent(BUSY, message="no KV"),
    SEGMENT_END: PdNodeEvent(SEGMENT_END, reason="kv_pressure"),
    HANDED_OFF: PdNodeEvent(HANDED_OFF),
    ERROR: PdNodeEvent(ERROR, message="broke", transfer_broken=True, error_kind="transfer_broken"),
}


def test_every_event_kind_reads_back_as_written() -> None:
    assert set(EVENTS) == NODE_EVENT_KINDS  # a new kind needs a line here
    for kind, event in EVENTS.items():
        line = read_line(json.loads(event_line(event)))
        assert line.kind == kind
        assert (line.message, line.transfer_broken, line.reason) == (event.message, event.transfer_broken,
                                                                     event.reason or None)
        assert line.error_kind == (event.error_kind or None)
        assert line.kv_start == (event.kv_start if kind == RESERVED else None)
        assert line.is_token is (kind == TOKEN)
    token = read_line(json.loads(event_line(EVENTS[TOKEN])))
    assert (token.token_id, token.finish_reason) == (42, "stop")
    assert token_from_line(token.fields, 11, 3, 1) == _token("stop")
    finish = read_line(token.without_token())
    assert (finish.kind, finish.token_id, finish.fields["text"], finish.finish_reason) == (TOKEN, -1, "", "stop")


@pytest.mark.parametrize("fields", [{}, {"event": "tokens"}, {"event": ["token"]}, {"event": None}])
def test_a_line_of_no_known_kind_reads_as_none(fields: Dict[str, Any]) -> None:
    line = read_line(fields)
    assert (line.kind, line.fields, line.is_token) == ("", fields, False)


def test_malformed_values_read_as_the_master_checks_them() -> None:
    assert read_line({"event": RESERVED, "kv_start": True}).kv_start is None
    assert read_line({"event": RESERVED, "kv_start": "2"}).kv_start is None
    assert read_line({"event": TOKEN, "token_id": "1"}).is_token is False
    assert read_line({"event": BUSY, "message": 0}).message == ""
    assert read_line({"event": ERROR, "message": 5}).message == "5"
