"""Fixed-layout request records in shared memory.

Every process maps the same segment: a numpy structured array with one record per request
slot.  Only slot indexes and request ids travel over zmq; everything else is read here.

Who writes which field, and in what order
----------------------------------------
* HTTP process (the only one that allocates and releases slots): fills every input field
  (``request_id``, prompt, sampling fields, ``high_priority_request``), then sets
  ``state = ACTIVE``, then sends the slot index to the router.  It sets ``abort_flag = 1`` when
  the client goes away.  It sets ``state = FREE`` only after it received the final message for
  the request (so no other process still reads the slot).
* Model rank 0: writes ``output_ids[i]`` and ``output_logprobs[i]`` first and then bumps
  ``output_len`` to ``i + 1`` (readers trust ``output_len`` as the publish point); writes
  ``prompt_cache_len`` once after the prefix-cache lookup, ``cur_kv_len`` every step, and
  ``finish_status`` after the last ``output_len`` bump.
* Detokenization: reads ``output_len`` first, then the ids below it.  Writes
  ``stop_string_hit`` when a stop sequence matched (before it asks the router to abort).
* Router: reads input fields and ``output_len``; writes nothing here.
"""

from __future__ import annotations

import json
from typing import List

import numpy as np

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.finish_status import FINISH_NONE
from lightllm.server.core.objs.shared_segment import SharedArraySegment

MAX_STOP_TOKEN_IDS = 16
STOP_SEQUENCES_BYTES = 1024

STATE_FREE = 0
STATE_ACTIVE = 1



def record_dtype(max_req_total_len: int) -> np.dtype:
    """Layout of one request record for a given per-request token limit."""
    return np.dtype(
        [
            ("request_id", np.int64),
            ("state", np.int32),
            ("prompt_len", np.int32),
            ("output_len", np.int32),
            ("cur_kv_len", np.int32),
            ("prompt_cache_len", np.int32),
            ("finish_status", np.int32),
            ("abort_flag", np.int32),
            ("stop_string_hit", np.int32),
            ("high_priority_request", np.int32),
            ("max_new_tokens", np.int32),
            ("min_new_tokens", np.int32),
            ("top_k", np.int32),
            ("ignore_eos", np.int32),
            ("do_sample", np.int32),  # -1 unset, 0 false, 1 true
            ("logprobs", np.int32),  # -1 unset
            ("has_seed", np.int32),
            ("stop_token_num", np.int32),
            ("seed", np.int64),
            ("temperature", np.float32),
            ("top_p", np.float32),
            ("repetition_penalty", np.float32),
            ("presence_penalty", np.float32),
            ("frequency_penalty", np.float32),
            ("stop_token_ids", np.int32, (MAX_STOP_TOKEN_IDS,)),
            ("stop_sequences_json", f"S{STOP_SEQUENCES_BYTES}"),
            ("prompt_ids", np.int32, (max_req_total_len,)),
            ("output_ids", np.int32, (max_req_total_len,)),
            ("output_logprobs", np.float32, (max_req_total_len,)),
        ],
        align=True,
    )


class ShmReqBuffer(SharedArraySegment):
    """All request slots of one server, mapped from a named shared-memory segment."""

    def __init__(self, name: str, slot_num: int, max_req_total_len: int, create: bool):
        self.slot_num = slot_num
        self.max_req_total_len = max_req_total_len
        self.dtype = record_dtype(max_req_total_len)
        super().__init__(name, self.dtype, slot_num, create)
        self.records = self.array
        if create:
            self.records["state"] = STATE_FREE

    # --- HTTP side -------------------------------------------------------------------------
    def write_request(
        self,
        slot: int,
        request_id: int,
        prompt_ids: List[int],
        params: SamplingParams,
        high_priority_request: bool,
    ) -> None:
        """Fill a free slot with a new request and publish it (``state`` last)."""
        rec = self.records[slot]
        if len(prompt_ids) + params.max_new_tokens > self.max_req_total_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds max_req_total_len ({self.max_req_total_len})"
            )
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported")
        rec["request_id"] = request_id
        rec["prompt_len"] = len(prompt_ids)
        rec["prompt_ids"][: len(prompt_ids)] = prompt_ids
        rec["output_len"] = 0
        rec["cur_kv_len"] = 0
        rec["prompt_cache_len"] = 0
        rec["finish_status"] = FINISH_NONE
        rec["abort_flag"] = 0
        rec["stop_string_hit"] = 0
        rec["high_priority_request"] = int(high_priority_request)
        rec["max_new_tokens"] = params.max_new_tokens
        rec["min_new_tokens"] = params.min_new_tokens
        rec["top_k"] = params.top_k
        rec["ignore_eos"] = int(params.ignore_eos)
        rec["do_sample"] = -1 if params.do_sample is None else int(params.do_sample)
        rec["logprobs"] = -1 if params.logprobs is None else params.logprobs
        rec["has_seed"] = int(params.seed is not None)
        rec["seed"] = params.seed or 0
        rec["temperature"] = params.temperature
        rec["top_p"] = params.top_p
        rec["repetition_penalty"] = params.repetition_penalty
        rec["presence_penalty"] = params.presence_penalty
        rec["frequency_penalty"] = params.frequency_penalty
        rec["stop_token_num"] = len(params.stop_token_ids)
        rec["stop_token_ids"][: len(params.stop_token_ids)] = params.stop_token_ids
        encoded = json.dumps(list(params.stop_sequences)).encode()
        if len(encoded) > STOP_SEQUENCES_BYTES:
            raise ValueError(f"stop sequences take {len(encoded)} bytes encoded; at most {STOP_SEQUENCES_BYTES} are supported")
        rec["stop_sequences_json"] = encoded
        rec["state"] = STATE_ACTIVE

    def release(self, slot: int) -> None:
        """Mark a slot free (HTTP process only, after the request's final message)."""
        self.records[slot]["state"] = STATE_FREE

    # --- readers ---------------------------------------------------------------------------
    def prompt_ids(self, slot: int) -> List[int]:
        """Prompt token ids of ``slot``."""
        rec = self.records[slot]
        return rec["prompt_ids"][: int(rec["prompt_len"])].tolist()

    def stop_sequences(self, slot: int) -> List[str]:
        """Stop strings of ``slot`` (applied by the detokenizer)."""
        raw = bytes(self.records[slot]["stop_sequences_json"])
        return json.loads(raw.decode()) if raw else []

    def sampling_params(self, slot: int) -> SamplingParams:
        """Rebuild the request's sampling parameters (validated when the HTTP side wrote them)."""
        rec = self.records[slot]
        do_sample = int(rec["do_sample"])
        logprobs = int(rec["logprobs"])
        return SamplingParams(
            temperature=float(rec["temperature"]),
            top_p=float(rec["top_p"]),
            top_k=int(rec["top_k"]),
            repetition_penalty=float(rec["repetition_penalty"]),
            presence_penalty=float(rec["presence_penalty"]),
            frequency_penalty=float(rec["frequency_penalty"]),
            seed=int(rec["seed"]) if rec["has_seed"] else None,
            max_new_tokens=int(rec["max_new_tokens"]),
            min_new_tokens=int(rec["min_new_tokens"]),
            stop_token_ids=rec["stop_token_ids"][: int(rec["stop_token_num"])].tolist(),
            ignore_eos=bool(rec["ignore_eos"]),
            do_sample=None if do_sample < 0 else bool(do_sample),
            logprobs=None if logprobs < 0 else logprobs,
        )

    # --- model rank 0 ----------------------------------------------------------------------
    def publish_token(self, slot: int, token_id: int, logprob: float) -> None:
        """Append one output token: data first, then the ``output_len`` publish point."""
        rec = self.records[slot]
        index = int(rec["output_len"])
        rec["output_ids"][index] = token_id
        rec["output_logprobs"][index] = logprob
        rec["output_len"] = index + 1

    def close(self) -> None:
        """Unmap the segment."""
        self.records = None
        super().close()
