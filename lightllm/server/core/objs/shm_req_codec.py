"""How a :class:`~.request_spec.RequestSpec` maps onto a shared-memory request record, both ways.

:class:`~.shm_req_buffer.ShmReqBuffer` owns the records and the rules for who writes which field
when; this module is only the field mapping it applies once it has checked a record's owner:
:func:`encoded_stop_sequences` and :func:`check_record_fits` say whether a spec fits a record,
:func:`write_input_fields` fills every input field of a claimed record (not ``request_id`` or
``top_slot``: their order is the buffer's protocol), :func:`read_request_spec` rebuilds the spec,
whose own checks then run again on what shared memory holds.
"""

from __future__ import annotations

import json
from typing import List

import numpy as np

from lightllm.common.sampling import STOP_SEQUENCES_BYTES, SamplingParams
from lightllm.server.core.objs.finish_status import FINISH_NONE
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import COPIED_FIELDS, FLAG_FIELDS, OPTIONAL_FIELDS


def encoded_stop_sequences(spec: RequestSpec) -> bytes:
    """The stop strings as the record stores them; ``ValueError`` when they exceed their field.

    A fixed-width bytes field would truncate a longer value silently.
    """
    encoded = json.dumps(list(spec.params.stop_sequences)).encode()
    if len(encoded) > STOP_SEQUENCES_BYTES:
        raise ValueError(
            f"stop sequences take {len(encoded)} bytes encoded; at most {STOP_SEQUENCES_BYTES} are supported"
        )
    return encoded


def check_record_fits(spec: RequestSpec, max_req_total_len: int) -> None:
    """``ValueError`` when the prompt plus ``max_new_tokens`` is wider than a record."""
    prompt_len, max_new_tokens = len(spec.prompt_ids), spec.params.max_new_tokens
    if prompt_len + max_new_tokens > max_req_total_len:
        raise ValueError(
            f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds max_req_total_len ({max_req_total_len})"
        )


def write_input_fields(rec: np.void, spec: RequestSpec, encoded_stops: bytes) -> None:
    """Fill every input field of ``rec`` from ``spec`` and reset its output fields.

    Numbers and counts fit their fields: :class:`SamplingParams` checked them against the same
    storage widths (``storage_width.py``) when it was built.
    """
    params, prompt_ids = spec.params, spec.prompt_ids
    rec["prompt_len"] = len(prompt_ids)
    rec["prompt_ids"][: len(prompt_ids)] = prompt_ids
    rec["output_len"] = 0
    rec["prompt_cache_len"] = 0
    rec["finish_status"] = FINISH_NONE
    rec["high_priority_request"] = int(spec.priority.high_priority_request)
    rec["infer_high_priority"] = spec.priority.infer_high_priority
    rec["segment_index"] = spec.segment.segment_index
    rec["generated_before"] = spec.segment.generated_before
    rec["pd_kind"] = spec.pd.kind
    rec["kv_start"] = spec.pd.kv_start
    rec["pd_epoch"] = spec.pd.epoch
    rec["pd_lease_s"] = spec.pd.lease_s
    rec["scheduled_ns"] = 0
    for name in COPIED_FIELDS:
        rec[name] = getattr(params, name)
    for name in FLAG_FIELDS:
        rec[name] = int(getattr(params, name))
    for name in OPTIONAL_FIELDS:
        value = getattr(params, name)
        rec[name] = -1 if value is None else value
    rec["do_sample"] = -1 if params.do_sample is None else int(params.do_sample)
    rec["prompt_logprob_end"] = 0
    rec["has_seed"] = int(params.seed is not None)
    rec["seed"] = params.seed or 0
    rec["stop_token_num"] = len(params.stop_token_ids)
    rec["stop_token_ids"][: len(params.stop_token_ids)] = params.stop_token_ids
    rec["stop_sequences_json"] = encoded_stops
    rec["grammar"] = (params.grammar or "").encode()
    rec["logit_bias_num"] = len(params.logit_bias)
    rec["logit_bias_ids"][: len(params.logit_bias)] = list(params.logit_bias)
    rec["logit_bias_values"][: len(params.logit_bias)] = list(params.logit_bias.values())


def read_request_spec(rec: np.void) -> RequestSpec:
    """The :class:`RequestSpec` ``rec`` holds; ``ValueError`` from the spec's checks for a damaged record."""
    fields = {name: rec[name].item() for name in COPIED_FIELDS}  # numpy scalar -> int/float
    fields.update({name: bool(rec[name]) for name in FLAG_FIELDS})
    for name in OPTIONAL_FIELDS:
        value = int(rec[name])
        fields[name] = None if value < 0 else value
    do_sample = int(rec["do_sample"])
    bias_num = int(rec["logit_bias_num"])
    params = SamplingParams(
        **fields,
        do_sample=None if do_sample < 0 else bool(do_sample),
        grammar=bytes(rec["grammar"]).decode() or None,
        seed=int(rec["seed"]) if rec["has_seed"] else None,
        stop_token_ids=rec["stop_token_ids"][: int(rec["stop_token_num"])].tolist(),
        stop_sequences=stop_sequences(rec),
        logit_bias=dict(zip(rec["logit_bias_ids"][:bias_num].tolist(), rec["logit_bias_values"][:bias_num].tolist())),
    )
    return RequestSpec.build(
        prompt_ids(rec),
        params,
        high_priority_request=bool(rec["high_priority_request"]),
        infer_high_priority=int(rec["infer_high_priority"]),
        segment_index=int(rec["segment_index"]),
        generated_before=int(rec["generated_before"]),
        pd_kind=int(rec["pd_kind"]),
        kv_start=int(rec["kv_start"]),
        pd_epoch=int(rec["pd_epoch"]),
        pd_lease_s=float(rec["pd_lease_s"]),
    )


def prompt_ids(rec: np.void) -> List[int]:
    """The prompt token ids ``rec`` holds."""
    return rec["prompt_ids"][: int(rec["prompt_len"])].tolist()


def stop_sequences(rec: np.void) -> List[str]:
    """The stop strings ``rec`` holds."""
    raw = bytes(rec["stop_sequences_json"])
    return json.loads(raw.decode()) if raw else []
