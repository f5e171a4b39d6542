"""The wire format of a PD node's control endpoints: request bodies in, NDJSON lines out.

Bodies (see docs/EN/pd_deployment.md and the node endpoints in :mod:`lightllm.server.pd.node.api`) are parsed
strictly: every field has its exact JSON type (no ``"1"`` for ``1``, no ``true`` for ``1``),
unknown fields are refused by name, and ``params`` holds
:class:`~lightllm.common.sampling.SamplingParams` fields under their own names.  A request body
becomes one :class:`~lightllm.server.core.objs.request_spec.RequestSpec`
(:func:`request_spec_of`), whose own checks are the request's rules (ranges, a first segment's
``generated_before`` and priority, ``kv_start`` within the prompt); a refusal is a 400 naming
the field.

Every stream line is one JSON object with an ``"event"`` key; :func:`event_line` writes one
from a :class:`~lightllm.server.pd.protocol.node_events.PdNodeEvent` and
:func:`token_from_line` reads a ``token`` line back into a
:class:`~lightllm.server.request_manager.GenerationEvent` (the PD master's side).  Logprobs
travel as Python's JSON writes floats, ``-Infinity`` included, so a masked token's logprob
reaches the master unchanged; ``top_logprobs`` is a list of ``[token_id, logprob]`` pairs (JSON
object keys would turn the ids into strings).
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lightllm.common.sampling import SamplingParams
from lightllm.server.http.errors import invalid_request
from lightllm.server.http.planning import build_sampling_params
from lightllm.server.core.objs.request_spec import RequestSpec, RequestSpecError
from lightllm.server.core.objs.shm_req_checks import check_request_id
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.pd.protocol.node_events import PdNodeEvent
from lightllm.server.request_manager import GenerationEvent

NDJSON_MEDIA_TYPE = "application/x-ndjson"

_ADDRESS = re.compile(r"^(?P<host>[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})$")
_SAMPLING_FIELDS = tuple(SamplingParams.__dataclass_fields__)
_PARAM_NAMES = {name: f"params.{name}" for name in _SAMPLING_FIELDS}
# RequestSpecError fields that a body holds under another name.
_BODY_NAMES = {"max_new_tokens": "params.max_new_tokens", "pd_lease_s": "reserve_lease_seconds"}


class _StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TransferSetupBody(_StrictBody):
    """``POST /pd/node/transfer_setup``: (re)build this node's KV transfer handles for ``epoch``."""

    epoch: int = Field(ge=0)
    peer_node_id: str = Field(min_length=1, max_length=128)
    prefill_transfer_address: str

    @field_validator("prefill_transfer_address")
    @classmethod
    def _address(cls, value: str) -> str:
        match = _ADDRESS.fullmatch(value)
        if match is None or not 1 <= int(match.group("port")) <= 65535:
            raise ValueError(f"must be 'host:port' with a port in [1, 65535], got {value!r}")
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


class PrefillBody(_NodeRequestBody):
    """``POST /pd/node/prefill``: prefill a request, send its KV from ``kv_start`` to the decode node."""

    infer_high_priority: int
    kv_start: int


def request_spec_of(body: _NodeRequestBody, vocab_size: int, max_req_total_len: int) -> RequestSpec:
    """The body as a :class:`RequestSpec` of the node's PD kind (a :class:`PrefillBody` is a
    prefill request); a 400 naming the bad field when the params, the prompt, the context length
    or one of the spec's rules refuse it."""
    unknown = sorted(str(key) for key in body.params if key not in _PARAM_NAMES)
    if unknown:
        raise invalid_request(f"Unknown sampling parameter(s) {', '.join(map(repr, unknown))} in params",
                              f"params.{unknown[0]}")
    params = build_sampling_params(body.params, vocab_size, _PARAM_NAMES)
    prefill = isinstance(body, PrefillBody)
    try:
        spec = RequestSpec.build(
            body.prompt_ids, params,
            high_priority_request=body.high_priority_request,
            infer_high_priority=body.infer_high_priority if prefill else 0,
            segment_index=body.segment_index,
            generated_before=body.generated_before,
            pd_kind=PD_KIND_PREFILL if prefill else PD_KIND_DECODE,
            kv_start=body.kv_start if prefill else 0,
            pd_lease_s=(body.reserve_lease_seconds or 0.0) if isinstance(body, DecodeBody) else 0.0,
        )
        # Here, not only in the manager: a refusal must be a 400 before the stream starts.
        spec.check_fits(vocab_size, max_req_total_len)
    except RequestSpecError as exc:
        raise invalid_request(str(exc), _BODY_NAMES.get(exc.field, exc.field)) from None
    return spec


def _token_fields(token: GenerationEvent, with_prompt_logprobs: bool) -> Dict[str, Any]:
    top = token.top_logprobs
    fields: Dict[str, Any] = {
        "event": "token",
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
    if kind == "reserved":
        return {"event": "reserved", "kv_start": event.kv_start}
    if kind == "token":
        if event.token is None:
            raise ValueError("a token event without a token")
        return _token_fields(event.token, with_prompt_logprobs)
    if kind == "busy":
        return {"event": "busy", "message": event.message}
    if kind == "segment_end":
        return {"event": "segment_end", "reason": event.reason}
    if kind == "handed_off":
        return {"event": "handed_off"}
    if kind == "error":
        return error_fields(event.message, event.transfer_broken, event.error_kind)
    raise ValueError(f"unknown PD node event kind {kind!r}")


def error_fields(message: str, transfer_broken: bool = False, error_kind: str = "") -> Dict[str, Any]:
    """An ``error`` line's object (``error_kind``: see ``PdNodeEvent``; empty when unknown)."""
    fields: Dict[str, Any] = {"event": "error", "message": message, "transfer_broken": bool(transfer_broken)}
    if error_kind:
        fields["error_kind"] = error_kind
    return fields


def ndjson(fields: Dict[str, Any]) -> bytes:
    """One NDJSON line (the object on one line, then ``\\n``)."""
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


def event_line(event: PdNodeEvent, *, with_prompt_logprobs: bool = False) -> bytes:
    """The NDJSON line of ``event``."""
    return ndjson(event_fields(event, with_prompt_logprobs=with_prompt_logprobs))


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
