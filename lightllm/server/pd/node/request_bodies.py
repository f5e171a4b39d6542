"""A PD node's reading of a request body: a :class:`DecodeBody` or :class:`PrefillBody` as its request.

The bodies themselves are the contract's (:mod:`lightllm.server.pd.protocol.stream_lines`);
turning one into a :class:`~lightllm.server.core.objs.request_spec.RequestSpec` is the node's
part, because a refusal is answered with the HTTP layer's 400 naming the field (the contract
module does not depend on the HTTP layer).
"""

from __future__ import annotations

from typing import Union

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec, RequestSpecError
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.http.errors import invalid_request
from lightllm.server.http.generation.planning import build_sampling_params
from lightllm.server.pd.protocol.stream_lines import DecodeBody, PrefillBody

_SAMPLING_FIELDS = tuple(SamplingParams.__dataclass_fields__)
_PARAM_NAMES = {name: f"params.{name}" for name in _SAMPLING_FIELDS}
# RequestSpecError fields that a body holds under another name.
_BODY_NAMES = {"max_new_tokens": "params.max_new_tokens", "pd_lease_s": "reserve_lease_seconds"}


def request_spec_of(body: Union[DecodeBody, PrefillBody], vocab_size: int, max_req_total_len: int) -> RequestSpec:
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
