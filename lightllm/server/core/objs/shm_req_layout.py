"""The fixed layouts of shared-memory request records and top-logprob rows (rules in :mod:`.shm_req_buffer`).

Only :class:`~lightllm.server.core.objs.shm_req_buffer.ShmReqBuffer` (with its field mapping,
:mod:`.shm_req_codec`) reads or writes them; this
module holds the layouts it maps, so the field lists are in one place.

A record costs 20 bytes per position up to ``max_req_total_len`` (prompt id, output id, output
logprob, prompt logprob, prompt rank).  The :data:`MAX_TOP_LOGPROBS` alternatives of every
position would cost 160 more, so they live in a second segment with fewer slots
(``--top_logprobs_slots``) that only requests asking for alternatives take
(:func:`wants_top_rows`); a record names its row in ``top_slot``.
"""

from __future__ import annotations

import numpy as np

from lightllm.common.sampling import (
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    STOP_SEQUENCES_BYTES,
    STORED_DTYPES,
    SamplingParams,
)
from lightllm.common.sampling.storage_width import GRAMMAR_BYTES, MAX_LOGIT_BIAS

# ``request_id`` of a free slot.  Request ids are non-negative, so no request can match it.
NO_REQUEST = -1
MAX_REQUEST_ID = int(np.iinfo(np.int64).max)

# ``top_slot`` of a record whose request asked for no top logprobs.
NO_TOP_SLOT = -1

# ``pd_kind`` of a record: how a PD node runs the request (internal, set only by the node's PD
# endpoint through the HTTP manager, never from a public API field).
PD_KIND_NONE = 0  # a normal request
PD_KIND_PREFILL = 1  # prefill node: prefill, then send KV positions [kv_start, prompt_len) to D
PD_KIND_DECODE = 2  # decode node: reserve KV at once (or answer busy), receive the prompt's KV
PD_KINDS = (PD_KIND_NONE, PD_KIND_PREFILL, PD_KIND_DECODE)

# Sampling fields stored under their SamplingParams name, in their stored width, as they are.
COPIED_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "top_k",
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "exponential_decay_factor",
)
# Boolean sampling fields, stored as 0 or 1.
FLAG_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "input_penalty", "print_eos_token")
# Optional integer sampling fields, stored as -1 when unset.
OPTIONAL_FIELDS = ("logprobs", "prompt_logprobs", "exponential_decay_start")


def record_dtype(max_req_total_len: int) -> np.dtype:
    """Layout of one request record for a given per-request token limit."""
    return np.dtype(
        [
            ("request_id", np.int64),  # NO_REQUEST while the slot is free; written last on fill
            ("prompt_len", np.int32),
            ("output_len", np.int32),
            ("prompt_cache_len", np.int32),
            ("finish_status", np.int32),
            ("high_priority_request", np.int32),
            # Internal, never from a public API field: negative = prefill before normal requests.
            ("infer_high_priority", np.int32),
            # Internal: 0 for a request's first segment, k > 0 for its k-th continuation.
            ("segment_index", np.int32),
            # Internal PD fields: one of PD_KINDS, and (prefill node) the first prompt position
            # whose KV is sent (the decode node's own prefix-cache hit).
            ("pd_kind", np.int32),
            ("kv_start", np.int32),
            # Internal PD field: the transfer pair's epoch, which picks the rank's transfer handle.
            ("pd_epoch", np.int32),
            # Internal PD field (decode node): the master's lease for the reservation in seconds
            # (0.0: none sent); the ranks bound it by --pd_reserve_lease_seconds.
            ("pd_lease_s", np.float64),
            # Internal: how many trailing prompt tokens are output of earlier segments (a PD
            # continuation); sampling counts them as generated (seeded step, penalties, decay).
            ("generated_before", np.int32),
            # The request's row in the top-logprob segment, or NO_TOP_SLOT (see wants_top_rows).
            ("top_slot", np.int32),
            # CLOCK_MONOTONIC ns when rank 0 first scheduled the request (0: not yet).
            ("scheduled_ns", np.int64),
            *[(name, STORED_DTYPES[name]) for name in COPIED_FIELDS],
            *[(name, np.int32) for name in FLAG_FIELDS],
            *[(name, STORED_DTYPES[name]) for name in OPTIONAL_FIELDS],
            ("do_sample", np.int32),  # -1 unset, 0 false, 1 true
            ("prompt_logprob_end", np.int32),
            ("has_seed", np.int32),
            ("stop_token_num", np.int32),
            ("seed", STORED_DTYPES["seed"]),
            ("stop_token_ids", STORED_DTYPES["stop_token_ids"], (MAX_STOP_TOKEN_IDS,)),
            ("stop_sequences_json", f"S{STOP_SEQUENCES_BYTES}"),
            ("grammar", f"S{GRAMMAR_BYTES}"),  # empty: no structured output
            # logit_bias: the first logit_bias_num (id, value) pairs are used.
            ("logit_bias_num", np.int32),
            ("logit_bias_ids", STORED_DTYPES["logit_bias_ids"], (MAX_LOGIT_BIAS,)),
            ("logit_bias_values", STORED_DTYPES["logit_bias_values"], (MAX_LOGIT_BIAS,)),
            ("prompt_ids", np.int32, (max_req_total_len,)),
            ("output_ids", np.int32, (max_req_total_len,)),
            ("output_logprobs", np.float32, (max_req_total_len,)),
            ("prompt_token_logprobs", np.float32, (max_req_total_len,)),  # by prompt position
            # Rank of each prompt token in its full distribution (1 = most likely; 0 = not known).
            ("prompt_token_ranks", np.int32, (max_req_total_len,)),
        ],
        align=True,
    )


def top_rows_dtype(max_req_total_len: int) -> np.dtype:
    """Layout of one slot of the top-logprob segment: the alternatives of one request."""
    return np.dtype(
        [
            # The request the row belongs to, NO_REQUEST while free; written (HTTP process) before
            # the record's request_id and cleared before it, so a row is never owned by no record.
            ("request_id", np.int64),
            # Most likely alternatives of the token at each position of prompt + output; unused
            # entries of a written row hold id -1.
            ("ids", np.int32, (max_req_total_len, MAX_TOP_LOGPROBS)),
            ("logprobs", np.float32, (max_req_total_len, MAX_TOP_LOGPROBS)),
        ],
        align=True,
    )


def wants_top_rows(params: SamplingParams) -> bool:
    """Whether a request stores top alternatives, and so takes a top-logprob slot.

    ``logprobs`` > 0 asks for alternatives of each output token, ``prompt_logprobs`` > 0 of each
    prompt token; 0 asks for the chosen token's logprob alone, which the record holds.
    """
    return (params.logprobs or 0) > 0 or (params.prompt_logprobs or 0) > 0
