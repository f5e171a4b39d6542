"""The mapping between a RequestSpec and a shared-memory record's fields (``shm_req_codec``).

Plain numpy records, no segment: the codec only maps fields; ownership is the buffer's.
"""

from __future__ import annotations

import numpy as np
import pytest

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_codec import (
    check_record_fits,
    encoded_stop_sequences,
    read_request_spec,
    write_input_fields,
)
from lightllm.server.core.objs.shm_req_layout import PD_KIND_PREFILL, record_dtype

# Fields the codec must leave alone: the buffer's ownership protocol writes the first two, model
# rank 0 the outputs.
NOT_INPUT_FIELDS = {
    "request_id", "top_slot", "output_ids", "output_logprobs", "prompt_token_logprobs", "prompt_token_ranks",
}
# Variable-length arrays: only their used prefix carries the request.
PREFIX_FIELDS = {"prompt_ids": 5, "stop_token_ids": 2, "logit_bias_ids": 2, "logit_bias_values": 2}


def _every_field_set_spec() -> RequestSpec:
    # Floats a float32 field holds exactly.
    params = SamplingParams(
        temperature=0.75, top_p=0.875, top_k=5, min_p=0.125, repetition_penalty=1.25, presence_penalty=0.25,
        frequency_penalty=0.5, seed=42, max_new_tokens=6, min_new_tokens=1, stop_token_ids=[3, 4],
        ignore_eos=True, do_sample=True, logprobs=2, prompt_logprobs=1, stop_sequences=["ab", "\u00e9"],
        skip_special_tokens=False, include_stop_str_in_output=True, input_penalty=True, grammar='{"x": 1}',
        print_eos_token=True, exponential_decay_start=3, exponential_decay_factor=1.5, logit_bias={7: 2.0, 9: -1.5},
    )
    return RequestSpec.build([11, 12, 13, 14, 15], params, high_priority_request=True, infer_high_priority=-2,
                             segment_index=1, generated_before=3, pd_kind=PD_KIND_PREFILL, kv_start=2, pd_epoch=4)


def _written(fill: int, spec: RequestSpec) -> np.void:
    records = np.zeros(1, dtype=record_dtype(16))
    records.view(np.uint8)[:] = fill
    write_input_fields(records[0], spec, encoded_stop_sequences(spec))
    return records[0]


def test_a_spec_with_every_field_set_reads_back_equal():
    spec = _every_field_set_spec()
    assert read_request_spec(_written(0x00, spec)) == spec
    assert read_request_spec(_written(0xA5, spec)) == spec


def test_every_input_field_of_the_layout_is_written_whatever_the_record_held():
    """A field added to the layout but not to the mapping keeps stale bytes: caught here."""
    spec = _every_field_set_spec()
    zeros, noise = _written(0x00, spec), _written(0xA5, spec)
    stale = []
    for name in record_dtype(16).names:
        if name in NOT_INPUT_FIELDS:
            continue
        used = PREFIX_FIELDS.get(name)
        a, b = (zeros[name], noise[name]) if used is None else (zeros[name][:used], noise[name][:used])
        if np.asarray(a).tobytes() != np.asarray(b).tobytes():
            stale.append(name)
    assert stale == []
    # And the fields it must not write still hold what the record held.
    for name in NOT_INPUT_FIELDS:
        assert set(np.asarray(noise[name]).tobytes()) == {0xA5}, name


def test_a_request_wider_than_a_record_is_refused():
    spec = RequestSpec.build([1] * 10, SamplingParams(max_new_tokens=7))
    with pytest.raises(ValueError, match=r"prompt \(10\) \+ max_new_tokens \(7\) exceeds max_req_total_len \(16\)"):
        check_record_fits(spec, 16)
    check_record_fits(spec, 17)
