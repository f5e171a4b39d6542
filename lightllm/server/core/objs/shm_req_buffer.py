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
* Model rank 0: writes ``output_ids[i]``, ``output_logprobs[i]`` and, for a request that asked
  for alternatives (``logprobs`` > 0), the top row of the token's sequence position
  ``prompt_len + i`` first and then bumps ``output_len`` to ``i + 1`` (readers trust
  ``output_len`` as the publish point; unused entries of a top row hold id ``-1``).  For a
  request with ``prompt_logprobs`` >= 0 it writes, during prefill, ``prompt_token_logprobs[p]``
  and the top row of position ``p`` for prompt positions ``p`` and then raises
  ``prompt_logprob_end`` past them (all before the first ``output_len`` bump); writes
  ``prompt_cache_len`` once after the prefix-cache lookup, ``cur_kv_len`` every step, and
  ``finish_status`` after the last ``output_len`` bump.
* Detokenization: reads ``output_len`` (or ``prompt_logprob_end``) first, then the ids,
  logprobs and top alternatives below it.  Writes
  ``stop_string_hit`` when a stop sequence matched (before it asks the router to abort).
* Router: reads input fields and ``output_len``; writes nothing here.
"""

from __future__ import annotations

import json
from typing import List, Sequence, Tuple

import numpy as np

from lightllm.common.sampling.storage_width import GRAMMAR_BYTES
from lightllm.common.sampling import (
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    STOP_SEQUENCES_BYTES,
    STORED_DTYPES,
    SamplingParams,
)
from lightllm.server.core.objs.finish_status import FINISH_NONE
from lightllm.server.core.objs.shared_segment import SharedArraySegment

STATE_FREE = 0
STATE_ACTIVE = 1

# Sampling fields stored under their SamplingParams name, in their stored width, as they are.
_COPIED_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "top_k",
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
# Boolean sampling fields, stored as 0 or 1.
_FLAG_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "input_penalty")
# Optional integer sampling fields, stored as -1 when unset.
_OPTIONAL_FIELDS = ("logprobs", "prompt_logprobs")


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
            *[(name, STORED_DTYPES[name]) for name in _COPIED_FIELDS],
            *[(name, np.int32) for name in _FLAG_FIELDS],
            *[(name, STORED_DTYPES[name]) for name in _OPTIONAL_FIELDS],
            ("do_sample", np.int32),  # -1 unset, 0 false, 1 true
            ("prompt_logprob_end", np.int32),
            ("has_seed", np.int32),
            ("stop_token_num", np.int32),
            ("seed", STORED_DTYPES["seed"]),
            ("stop_token_ids", STORED_DTYPES["stop_token_ids"], (MAX_STOP_TOKEN_IDS,)),
            ("stop_sequences_json", f"S{STOP_SEQUENCES_BYTES}"),
            ("grammar", f"S{GRAMMAR_BYTES}"),  # empty: no structured output
            ("prompt_ids", np.int32, (max_req_total_len,)),
            ("output_ids", np.int32, (max_req_total_len,)),
            ("output_logprobs", np.float32, (max_req_total_len,)),
            ("prompt_token_logprobs", np.float32, (max_req_total_len,)),  # by prompt position
            # Most likely alternatives of the token at each position of prompt + output.
            ("token_top_ids", np.int32, (max_req_total_len, MAX_TOP_LOGPROBS)),
            ("token_top_logprobs", np.float32, (max_req_total_len, MAX_TOP_LOGPROBS)),
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
        for name in _COPIED_FIELDS:
            rec[name] = getattr(params, name)
        for name in _FLAG_FIELDS:
            rec[name] = int(getattr(params, name))
        for name in _OPTIONAL_FIELDS:
            value = getattr(params, name)
            rec[name] = -1 if value is None else value
        rec["do_sample"] = -1 if params.do_sample is None else int(params.do_sample)
        rec["prompt_logprob_end"] = 0
        rec["has_seed"] = int(params.seed is not None)
        rec["seed"] = params.seed or 0
        rec["stop_token_num"] = len(params.stop_token_ids)
        rec["stop_token_ids"][: len(params.stop_token_ids)] = params.stop_token_ids
        encoded = json.dumps(list(params.stop_sequences)).encode()
        if len(encoded) > STOP_SEQUENCES_BYTES:
            raise ValueError(f"stop sequences take {len(encoded)} bytes encoded; at most {STOP_SEQUENCES_BYTES} are supported")
        rec["stop_sequences_json"] = encoded
        rec["grammar"] = (params.grammar or "").encode()
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
        fields = {name: rec[name].item() for name in _COPIED_FIELDS}  # numpy scalar -> int/float
        fields.update({name: bool(rec[name]) for name in _FLAG_FIELDS})
        for name in _OPTIONAL_FIELDS:
            value = int(rec[name])
            fields[name] = None if value < 0 else value
        do_sample = int(rec["do_sample"])
        return SamplingParams(
            **fields,
            do_sample=None if do_sample < 0 else bool(do_sample),
            grammar=bytes(rec["grammar"]).decode() or None,
            seed=int(rec["seed"]) if rec["has_seed"] else None,
            stop_token_ids=rec["stop_token_ids"][: int(rec["stop_token_num"])].tolist(),
        )

    # --- model rank 0 ----------------------------------------------------------------------
    def publish_token(
        self, slot: int, token_id: int, logprob: float, top: Sequence[Tuple[int, float]] | None = None
    ) -> None:
        """Append one output token: data first, then the ``output_len`` publish point.

        ``top`` holds ``(token_id, logprob)`` alternatives, most likely first (at most
        :data:`MAX_TOP_LOGPROBS`); the rest of the row is marked unused with id ``-1``.
        """
        rec = self.records[slot]
        index = int(rec["output_len"])
        rec["output_ids"][index] = token_id
        rec["output_logprobs"][index] = logprob
        if top:
            self._write_top(rec, int(rec["prompt_len"]) + index, top)
        rec["output_len"] = index + 1

    @staticmethod
    def _write_top(rec: np.void, position: int, top: Sequence[Tuple[int, float]]) -> None:
        count = min(len(top), MAX_TOP_LOGPROBS)
        ids = rec["token_top_ids"][position]
        ids[:count] = [pair[0] for pair in top[:count]]
        ids[count:] = -1
        rec["token_top_logprobs"][position][:count] = [pair[1] for pair in top[:count]]

    def publish_prompt_logprobs(
        self, slot: int, entries: Sequence[Tuple[int, float, Sequence[Tuple[int, float]]]]
    ) -> None:
        """Write ``(position, logprob, top)`` of prompt tokens, then raise ``prompt_logprob_end``.

        Entries come in increasing position order, continuing where the last call stopped.
        """
        if not entries:
            return
        rec = self.records[slot]
        for position, logprob, top in entries:
            rec["prompt_token_logprobs"][position] = logprob
            self._write_top(rec, position, top)
        rec["prompt_logprob_end"] = max(int(rec["prompt_logprob_end"]), entries[-1][0] + 1)

    def top_logprobs(self, slot: int, start: int, end: int) -> List[List[Tuple[int, float]]] | None:
        """The published alternatives of output tokens ``start..end-1``, or None when the request
        asked for none."""
        rec = self.records[slot]
        if int(rec["logprobs"]) <= 0:
            return None
        offset = int(rec["prompt_len"])
        return self._read_top(rec, offset + start, offset + end)

    @staticmethod
    def _read_top(rec: np.void, start: int, end: int) -> List[List[Tuple[int, float]]]:
        ids = rec["token_top_ids"][start:end].tolist()
        values = rec["token_top_logprobs"][start:end].tolist()
        return [
            [(token_id, value) for token_id, value in zip(row_ids, row_values) if token_id >= 0]
            for row_ids, row_values in zip(ids, values)
        ]

    def prompt_logprobs(self, slot: int) -> List[Tuple[int, float, List[Tuple[int, float]]]] | None:
        """``(token_id, logprob, top)`` of prompt positions ``1..`` published so far, or None
        when the request did not ask for prompt logprobs."""
        rec = self.records[slot]
        count = int(rec["prompt_logprobs"])
        if count < 0:
            return None
        end = int(rec["prompt_logprob_end"])  # the publish point, read before the data
        if end <= 1:
            return []
        ids = rec["prompt_ids"][1:end].tolist()
        values = rec["prompt_token_logprobs"][1:end].tolist()
        tops = self._read_top(rec, 1, end) if count > 0 else [[] for _ in ids]
        return list(zip(ids, values, tops))

    def close(self) -> None:
        """Unmap the segment."""
        self.records = None
        super().close()
