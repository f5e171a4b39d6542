"""The wire format of a PD node's control endpoints: request bodies in, NDJSON lines out.

Both sides use this module only: the master builds its segment bodies (decode and prefill) as
these models and reads every
line through :func:`read_line`, the node parses the same models and writes its lines with
:func:`event_line`, so a field or an event kind renamed on one side fails the tests of both.

Bodies (see docs/EN/pd_deployment.md and the node endpoints in
:mod:`lightllm.server.pd.node.api`) are parsed strictly: every field has its exact JSON type (no
``"1"`` for ``1``, no ``true`` for ``1``), unknown fields are refused by name, and ``params``
holds :class:`~lightllm.common.sampling.SamplingParams` fields under their own names.  The
master sends a body as :func:`body_fields` of the model it built (:meth:`DecodeBody.prefill_body`
gives the prefill node the same segment).  On the node a request body becomes one
:class:`~lightllm.server.core.objs.request_spec.RequestSpec`
(:func:`lightllm.server.pd.node.request_bodies.request_spec_of`), whose own checks are the
request's rules (ranges, a first segment's ``generated_before`` and priority, ``kv_start``
within the prompt); a refusal is a 400 naming the field.

Every stream line is one JSON object with an ``"event"`` key (a kind of
:mod:`~lightllm.server.pd.protocol.node_events`); :func:`event_line` writes one from a
:class:`~lightllm.server.pd.protocol.node_events.PdNodeEvent`, :func:`read_line` reads one as
a :class:`NodeLine` and :func:`token_from_line` reads a ``token`` line back into a
:class:`~lightllm.server.request_manager.GenerationEvent` (the PD master's side).  Logprobs
travel as Python's JSON writes floats, ``-Infinity`` included, so a masked token's logprob
reaches the master unchanged; ``top_logprobs`` is a list of ``[token_id, logprob]`` pairs (JSON
object keys would turn the ids into strings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lightllm.server.core.objs.shm_req_checks import check_request_id
from lightllm.server.pd.protocol.host_port import parse_host_port
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
from lightllm.server.request_manager import GenerationEvent

NDJSON_MEDIA_TYPE = "application/x-ndjson"


class _StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TransferSetupBody(_StrictBody):
    """``POST /pd/node/transfer_setup``: (re)build this node's KV transfer handles for ``epoch``.

    ``prefill_transfer_address`` is the prefill node's registered ``kv_transfer_address``, a
    ``host:port`` of :mod:`~lightllm.server.pd.protocol.host_port` (an IPv6 host in brackets).
    """

    epoch: int = Field(ge=0)
    peer_node_id: str = Field(min_length=1, max_length=128)
    prefill_transfer_address: str

    @field_validator("prefill_transfer_address")
    @classmethod
    def _address(cls, value: str) -> str:
        parse_host_port(value)  # a HostPortError is a ValueError: pydantic reports it under the field
        return value


class _NodeRequestBody(_StrictBody):
    # Ranges and cross-field rules are RequestSpec's (request_spec_of); only types are checked here.
    request_id: int
    prompt_ids: List[int]
    params: Dict[str, Any]
    segment_index: int
    epoch: int = Field(ge=0)
    # Trailing prompt tokens that earlier segments generated (a continuation's output so far).
    generated_before: int = 0
    # The client's admission priority (the master honours it only from trusted clients).
    high_priority_request: bool = False

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, value: int) -> int:
        check_request_id(value)
        return value


class DecodeBody(_NodeRequestBody):
    """``POST /pd/node/decode``: reserve KV for a request, receive its prompt KV, decode it.

    ``reserve_lease_seconds``: how long the master waits for this segment's KV (its prefill
    timeout plus the hand-off margin); the node holds the reservation that long, at most its
    ``--pd_reserve_lease_seconds``.  Absent (an older master): the node's own lease.
    """

    reserve_lease_seconds: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)

    def prefill_body(self, *, kv_start: int, infer_high_priority: int) -> "PrefillBody":
        """The prefill node's body of the same segment: this request's fields, the KV from ``kv_start``."""
        shared = {name: getattr(self, name) for name in _NodeRequestBody.model_fields}
        return PrefillBody(**shared, kv_start=kv_start, infer_high_priority=infer_high_priority)


class PrefillBody(_NodeRequestBody):
    """``POST /pd/node/prefill``: prefill a request, send its KV from ``kv_start`` to the decode node."""

    infer_high_priority: int
    kv_start: int


def body_fields(body: _StrictBody) -> Dict[str, Any]:
    """The JSON object the master sends for ``body``: every field of the model, as validated.

    A shallow copy (``dict(model)``), not ``model_dump``: a long prompt's ids are not copied once
    more, and the values stay what JSON writes as before (``model_dump(mode="json")`` would turn a
    sampling parameter's ``inf`` into ``null``).
    """
    return dict(body)


def _token_fields(token: GenerationEvent, with_prompt_logprobs: bool) -> Dict[str, Any]:
    top = token.top_logprobs
    fields: Dict[str, Any] = {
        "event": TOKEN,
        "token_id": token.token_id,
        "text": token.text,
        "logprob": token.logprob,
        "top_logprobs": None if top is None else [[int(token_id), value] for token_id, value in top.items()],
        "finish_reason": token.finish_reason,
        "cached_tokens": token.cached_tokens,
    }
    if with_prompt_logprobs:
        fields["prompt_logprobs"] = token.prompt_logprobs
    return fields


def event_fields(event: PdNodeEvent, *, with_prompt_logprobs: bool = False) -> Dict[str, Any]:
    """The JSON object of one stream line (``with_prompt_logprobs``: a prefill node's token line)."""
    kind = event.kind
    if kind == RESERVED:
        return {"event": RESERVED, "kv_start": event.kv_start}
    if kind == TOKEN:
        if event.token is None:
            raise ValueError("a token event without a token")
        return _token_fields(event.token, with_prompt_logprobs)
    if kind == BUSY:
        return {"event": BUSY, "message": event.message}
    if kind == SEGMENT_END:
        return {"event": SEGMENT_END, "reason": event.reason}
    if kind == HANDED_OFF:
        return {"event": HANDED_OFF}
    if kind == ERROR:
        return error_fields(event.message, event.transfer_broken, event.error_kind)
    raise ValueError(f"unknown PD node event kind {kind!r}")


def error_fields(message: str, transfer_broken: bool = False, error_kind: str = "") -> Dict[str, Any]:
    """An ``error`` line's object (``error_kind``: see ``PdNodeEvent``; empty when unknown)."""
    fields: Dict[str, Any] = {"event": ERROR, "message": message, "transfer_broken": bool(transfer_broken)}
    if error_kind:
        fields["error_kind"] = error_kind
    return fields


def ndjson(fields: Dict[str, Any]) -> bytes:
    """One NDJSON line (the object on one line, then ``\\n``)."""
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


def event_line(event: PdNodeEvent, *, with_prompt_logprobs: bool = False) -> bytes:
    """The NDJSON line of ``event``."""
    return ndjson(event_fields(event, with_prompt_logprobs=with_prompt_logprobs))


@dataclass(frozen=True)
class NodeLine:
    """One stream line as the master reads it (:func:`read_line`): its kind and its fields.

    The accessors read the keys :func:`event_fields` writes and keep the values as sent where
    the master looks at them as sent (a node that breaks the contract is reported with
    ``fields`` as it came, see ``test_pd_wire_contract``).

    Attributes:
        kind: the line's event kind (one of :data:`~.node_events.NODE_EVENT_KINDS`), or ``""``
            when its ``"event"`` names none of them (or is missing).
        fields: the JSON object as the node sent it (what the master forwards and reports).
    """

    kind: str
    fields: Dict[str, Any]

    @property
    def kv_start(self) -> Optional[int]:
        """A ``reserved`` line's ``kv_start``; None unless it is an integer (a JSON ``true`` is not)."""
        value = self.fields.get("kv_start")
        return None if isinstance(value, bool) or not isinstance(value, int) else value

    @property
    def token_id(self) -> Any:
        """A ``token`` line's ``token_id`` as sent (an int from a node keeping the contract)."""
        return self.fields.get("token_id")

    @property
    def is_token(self) -> bool:
        """Whether this is a ``token`` line with an integer ``token_id`` (one the master forwards)."""
        return self.kind == TOKEN and isinstance(self.token_id, int)

    @property
    def finish_reason(self) -> Any:
        """A ``token`` line's ``finish_reason`` as sent (empty or None: the request goes on)."""
        return self.fields.get("finish_reason")

    @property
    def reason(self) -> Any:
        """A ``segment_end`` line's ``reason`` as sent (a :class:`~.outcomes.SegmentEndReason` value)."""
        return self.fields.get("reason")

    @property
    def message(self) -> str:
        """A ``busy`` or ``error`` line's message; ``""`` when it has none."""
        return str(self.fields.get("message") or "")

    @property
    def transfer_broken(self) -> bool:
        """Whether an ``error`` line says the pair's KV transfer broke (the master sets it up again)."""
        return bool(self.fields.get("transfer_broken"))

    @property
    def error_kind(self) -> Any:
        """An ``error`` line's ``error_kind`` as sent (one of :data:`~.node_events.ERROR_KINDS`; None: unknown)."""
        return self.fields.get("error_kind")

    def without_token(self) -> Dict[str, Any]:
        """The line's fields as a finish with no new token (``token_id`` -1, no text).

        The decode node's echo of the prefill node's token can carry the finish: the token itself
        already reached the client, its finish has not.
        """
        return {**self.fields, "token_id": -1, "text": ""}


def read_line(fields: Dict[str, Any]) -> NodeLine:
    """One NDJSON line's object (as decoded) read as a :class:`NodeLine`."""
    kind = fields.get("event")
    # A str check first: an unhashable "event" value is a line of no known kind, not a TypeError.
    return NodeLine(kind if isinstance(kind, str) and kind in NODE_EVENT_KINDS else "", fields)


def token_from_line(
    fields: Dict[str, Any], request_id: int, prompt_tokens: int, completion_tokens: int
) -> GenerationEvent:
    """A ``token`` line read back as a :class:`GenerationEvent` (counts supplied by the reader)."""
    top = fields.get("top_logprobs")
    prompt_logprobs: Optional[List[Any]] = fields.get("prompt_logprobs")
    return GenerationEvent(
        request_id=request_id,
        token_id=int(fields["token_id"]),
        text=str(fields["text"]),
        logprob=float(fields["logprob"]),
        finish_reason=fields.get("finish_reason"),
        prompt_tokens=prompt_tokens,
        cached_tokens=int(fields.get("cached_tokens", 0)),
        completion_tokens=completion_tokens,
        top_logprobs=None if top is None else {int(token_id): float(value) for token_id, value in top},
        prompt_logprobs=None if prompt_logprobs is None else [
            (int(token_id), float(logprob), {int(k): float(v) for k, v in alternatives.items()},
             int(rank[0]) if rank and rank[0] is not None else None)
            for token_id, logprob, alternatives, *rank in prompt_logprobs
        ],
    )
