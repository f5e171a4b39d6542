"""Every sampling number is validated in the width it is stored in, and survives the round trip.

The HTTP process writes requests into 32-bit shared-memory fields and the model rank reads them
back; these tests write accepted values into a real :class:`ShmReqBuffer` and check that the
rank's read is again a valid :class:`SamplingParams`, and that values which would change
meaning in storage are refused naming the field.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightllm.common.sampling import STORED_DTYPES, SamplingParamError, SamplingParams
from lightllm.common.sampling.storage_width import check_stored_float, check_stored_int
from lightllm.server.core.objs.shm_req_layout import record_dtype, wants_top_rows
from lightllm.server.core.objs.request_spec import RequestSpec

from shm_test_support import scratch_req_buffer

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
INT32_MAX = 2**31 - 1

# Values a float field accepts by range but that would become inf or 0 in a float32.
FLOAT_FIELDS_OVERFLOW = {
    "temperature": [1e39, 1e300, FLOAT32_MAX * 1.0000001],
    "repetition_penalty": [1e39, 1e300],
}
FLOAT_FIELDS_UNDERFLOW = {
    "temperature": [1e-300, 1e-39, 1e-45],
    "top_p": [1e-300, 1e-39],
    "repetition_penalty": [1e-300, 1e-40],
    "presence_penalty": [1e-300, -1e-300],
    "frequency_penalty": [1e-300, -1e-41],
}


@pytest.fixture()
def shm():
    with scratch_req_buffer(2, 64, top_slot_num=1) as buffer:
        yield buffer


def test_record_layout_takes_its_widths_from_the_sampling_module():
    layout = record_dtype(8)
    for name, dtype in STORED_DTYPES.items():
        assert layout[name].base == np.dtype(dtype), name


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in FLOAT_FIELDS_OVERFLOW.items() for v in vs])
def test_float_that_overflows_float32_is_refused(name, value):
    with pytest.raises(SamplingParamError, match=rf"^{name} must be at most 3\.40282\d+e\+38 in magnitude"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, vs in FLOAT_FIELDS_UNDERFLOW.items() for v in vs])
def test_nonzero_float_that_underflows_float32_is_refused(name, value):
    with pytest.raises(SamplingParamError, match=rf"^{name} must be at least 1\.17549\d+e-38 in magnitude when not 0"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", ["top_k", "max_new_tokens"])
def test_int32_fields_refuse_values_past_int32(name):
    SamplingParams(**{name: INT32_MAX})
    for value in (INT32_MAX + 1, 2**40, 2**100):
        with pytest.raises(SamplingParamError, match=rf"^{name} must be at most 2147483647 \(it is stored as a 32-bit"):
            SamplingParams(**{name: value})


def test_min_new_tokens_and_logprobs_are_bounded_inside_int32():
    # Their own ranges (<= max_new_tokens, <= 20) keep them far inside the stored width.
    SamplingParams(min_new_tokens=INT32_MAX, max_new_tokens=INT32_MAX)
    with pytest.raises(SamplingParamError, match=r"^min_new_tokens must be <= max_new_tokens"):
        SamplingParams(min_new_tokens=2**40, max_new_tokens=INT32_MAX)
    with pytest.raises(SamplingParamError, match=r"^logprobs must be in \[0, 20\]"):
        SamplingParams(logprobs=2**40)


def test_stop_token_ids_are_checked_per_item_and_in_count():
    with pytest.raises(SamplingParamError, match=r"^stop_token_ids must be at most 2147483647"):
        SamplingParams(stop_token_ids=[5, 2**31])
    with pytest.raises(SamplingParamError, match=r"^stop_token_ids must hold at most 16 entries, got 17"):
        SamplingParams(stop_token_ids=list(range(17)))


def test_seed_fits_int64_and_stop_sequences_fit_their_field():
    SamplingParams(seed=2**63 - 1)
    with pytest.raises(SamplingParamError, match=r"^seed must be in \[0, 2\*\*63 - 1\]"):
        SamplingParams(seed=2**64)
    SamplingParams(stop_sequences=["x" * 1000])
    with pytest.raises(SamplingParamError, match=r"^stop_sequences must take at most 1024 bytes JSON-encoded"):
        SamplingParams(stop_sequences=["é" * 200, "y" * 100])  # each é is 6 bytes once JSON-escaped


def test_extremes_that_are_accepted_read_back_valid(shm):
    accepted = [
        {"temperature": FLOAT32_MAX, "top_p": FLOAT32_TINY, "repetition_penalty": FLOAT32_TINY},
        {"temperature": FLOAT32_TINY, "repetition_penalty": FLOAT32_MAX, "presence_penalty": -FLOAT32_TINY,
         "frequency_penalty": 2.0},
        {"top_p": 0.999999999999, "top_k": INT32_MAX, "seed": 2**63 - 1, "max_new_tokens": 3,
         "stop_token_ids": [INT32_MAX] * 16, "logprobs": 20},
        {"temperature": 0.0, "presence_penalty": -2.0, "frequency_penalty": 0.0, "min_new_tokens": 3,
         "max_new_tokens": 3},
        {"print_eos_token": True, "exponential_decay_start": INT32_MAX, "exponential_decay_factor": 10.0},
        {"exponential_decay_start": 0, "exponential_decay_factor": 1.0000001},
    ]
    for fields in accepted:
        params = SamplingParams(**fields)
        spec = RequestSpec([1, 2], params)
        shm.write_request(0, 7, spec, top_slot=0 if wants_top_rows(params) else None)
        read = shm.read_request(0, 7).params  # constructing validates again, as the rank does
        assert shm.release(0, 7)
        for name, value in fields.items():
            stored = getattr(read, name)
            if isinstance(value, float):
                assert math.isfinite(stored) and (stored == 0) == (value == 0), (name, value, stored)
                assert stored == pytest.approx(value, rel=1e-6)
            else:
                assert stored == value


def test_checkers_reject_non_finite_and_name_the_field():
    for value in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="^speed must be at most"):
            check_stored_float("speed", value)
    with pytest.raises(ValueError, match="^count must be at least -2147483648"):
        check_stored_int("count", -(2**31) - 1)
    check_stored_float("speed", 0.0)
    check_stored_float("speed", -0.0)
    check_stored_int("count", -(2**31))
