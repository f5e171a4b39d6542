"""Fixed-layout request records in shared memory: the only code that reads or writes them.

Every process maps the same segment: a numpy structured array with one record per request
slot (layout in :mod:`.shm_req_layout`).  Requests that ask for top logprobs (``logprobs`` > 0 or
``prompt_logprobs`` > 0: :func:`~.shm_req_layout.wants_top_rows`) also hold one row of a second
segment, ``<name>_top``, with fewer slots; its :data:`~lightllm.common.sampling.MAX_TOP_LOGPROBS`
alternatives per position would otherwise make up 160 of every record's 180 bytes per position.
The HTTP process hands out both kinds of slot (``httpserver/slot_pool.py``).  A request goes in
and comes out as one :class:`~.request_spec.RequestSpec` (the field mapping is
:mod:`.shm_req_codec`), which checked its own fields when it was built; the buffer checks only
what its layout needs (the request id, the prompt plus ``max_new_tokens`` within a record's
width, the stop strings within their bytes field, a top row exactly when the request asks for
alternatives).

Only slot indexes and request ids travel over zmq; everything else is read here, through typed
methods.

Every method takes the slot *and* the ``request_id`` its caller expects there, and checks it
against the record first, so a process holding a stale ``(request_id, slot)`` pair (the request
ended and the slot was reused) can never read or write someone else's request:

* readers raise :class:`StaleRecordError` (a clear, per-request error the caller turns into that
  request's failure);
* writers do nothing, log a warning and return False;
* :meth:`ShmReqBuffer.release` of a slot the request does not hold does nothing and returns
  False, so a duplicate release can never put a slot in use back into the free pool.

Who writes which field, and in what order
----------------------------------------
* HTTP process (the only one that allocates and releases slots), :meth:`~ShmReqBuffer.write_request`:
  on a free slot (``request_id == NO_REQUEST``) fills every input field from the request's
  :class:`~.request_spec.RequestSpec` (prompt, sampling fields, ``high_priority_request``, and the
  internal ``infer_high_priority``, ``segment_index``, ``generated_before``, ``pd_kind`` and
  ``kv_start``, which no public API field reaches) and ``top_slot``; for a request with a top
  row it then writes the row's ``request_id``; it writes the record's ``request_id`` last: from
  then on the slot (and its top row) belongs to that request.  Then it sends the slot
  index to the router.  :meth:`~ShmReqBuffer.release` frees the top row and then sets the
  record's ``request_id = NO_REQUEST``, only after the detokenization process reported that
  nobody reads the slot any more, and only if the slot still holds that request.  Aborts
  travel over zmq, never through the record.
* Router, :meth:`~ShmReqBuffer.admission_fields`: reads the input fields it admits by; writes
  nothing here.
* Model rank 0: :meth:`~ShmReqBuffer.read_request` at admission, which rebuilds the
  :class:`~.request_spec.RequestSpec` (so its checks run again on what shared memory holds; rank
  0's ``screen`` adds the model's limits and rejects a damaged record alone), and every rank
  reads the same record; :meth:`~ShmReqBuffer.set_prompt_cache_len` once after the prefix-cache lookup;
  :meth:`~ShmReqBuffer.publish_token` writes ``output_ids[i]``, ``output_logprobs[i]`` and, for
  a request that asked for alternatives (``logprobs`` > 0), position ``prompt_len + i`` of its
  top row first and then bumps ``output_len`` to ``i + 1`` (readers trust ``output_len`` as the
  publish point; unused entries of a top row hold id ``-1``); :meth:`~ShmReqBuffer.publish_tokens`
  does the same for one token of each of many requests without alternatives (every id and
  logprob first, then every ``output_len``).  For a request with
  ``prompt_logprobs`` >= 0, :meth:`~ShmReqBuffer.publish_prompt_logprobs` writes, during
  prefill, ``prompt_token_logprobs[p]`` and (``prompt_logprobs`` > 0) position ``p`` of its top
  row and then raises ``prompt_logprob_end`` past them (all before the first ``output_len``
  bump).  A top row is reached only through its record, after the record's ownership check,
  and its own ``request_id`` is checked too.
  :meth:`~ShmReqBuffer.set_scheduled_ns` writes ``scheduled_ns`` once, the first time
  the request is scheduled, before its first ``output_len`` bump (the HTTP process reads it,
  :meth:`~ShmReqBuffer.scheduled_ns`, when the first output arrives).
  :meth:`~ShmReqBuffer.set_finish_status` writes ``finish_status`` after the last ``output_len``
  bump.
* Detokenization: :meth:`~ShmReqBuffer.decode_options` once per request, then
  :meth:`~ShmReqBuffer.read_output` per update, which reads ``finish_status`` first, then
  ``output_len``, then the ids, logprobs and top alternatives below it (finish first: a set
  status then guarantees the ``output_len`` read after it is final; it reads no further than
  the ``output_len`` the step's message names, and a status read while tokens past that remain
  counts as unset, so a request's last token and its status are read together), and
  :meth:`~ShmReqBuffer.prompt_logprobs` (``prompt_logprob_end`` before the data).  It writes
  nothing here; a stop string ends the request through an abort to the router.

A slot is never released while an owner still reads or writes it (the release follows the
detokenizer's last read, which follows rank 0's last write), so one check before each access
is enough; the check turns a protocol bug or a late message into a clear error instead of a
silent mix-up.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shared_segment import SharedArraySegment
from lightllm.server.core.objs.shm_req_checks import check_request_id
from lightllm.server.core.objs.shm_req_codec import (
    check_record_fits,
    encoded_stop_sequences,
    prompt_ids,
    read_request_spec,
    stop_sequences,
    write_input_fields,
)
from lightllm.server.core.objs.shm_req_layout import NO_REQUEST, NO_TOP_SLOT, record_dtype, top_rows_dtype
from lightllm.server.core.objs.shm_top_rows import (
    claim_top_row,
    read_top,
    release_top_row,
    top_row_for_read,
    top_row_for_write,
    write_top,
)
from lightllm.server.core.objs.shm_req_views import (
    AdmissionFields,
    DecodeOptions,
    OutputSnapshot,
    SlotOccupiedError,
    StaleRecordError,
    TopRow,
)

log = logging.getLogger("lightllm.shm_req_buffer")


class ShmReqBuffer(SharedArraySegment):
    """All request slots of one server, mapped from a named shared-memory segment.

    ``top_slot_num`` rows of top logprobs live in the segment ``<name>_top`` (none when 0: then
    no request may ask for top logprobs).  :meth:`close` and :meth:`unlink` cover both segments.
    """

    def __init__(self, name: str, slot_num: int, max_req_total_len: int, create: bool, top_slot_num: int = 0):
        self.slot_num = slot_num
        self.max_req_total_len = max_req_total_len
        self.top_slot_num = top_slot_num
        self.dtype = record_dtype(max_req_total_len)
        super().__init__(name, self.dtype, slot_num, create)
        self._tops: Optional[SharedArraySegment] = None
        try:
            if top_slot_num > 0:
                self._tops = SharedArraySegment(f"{name}_top", top_rows_dtype(max_req_total_len), top_slot_num, create)
        except BaseException:
            super().close()
            if create:
                super().unlink()
            raise
        if create:
            self.array["request_id"] = NO_REQUEST
            if self._tops is not None:
                self._tops.array["request_id"] = NO_REQUEST

    @staticmethod
    def segment_bytes(slot_num: int, max_req_total_len: int, top_slot_num: int) -> Tuple[int, int]:
        """Bytes of the record segment and of the top-logprob segment such a buffer maps."""
        return (slot_num * record_dtype(max_req_total_len).itemsize,
                top_slot_num * top_rows_dtype(max_req_total_len).itemsize)

    def close(self) -> None:
        """Unmap both segments (does not remove them)."""
        if self._tops is not None:
            self._tops.close()
        super().close()

    def unlink(self) -> None:
        """Remove both segments from the system (the creating process, at shutdown)."""
        if self._tops is not None:
            self._tops.unlink()
        super().unlink()

    # --- ownership checks ------------------------------------------------------------------
    def holder(self, slot: int) -> int:
        """The request id ``slot`` holds, or :data:`NO_REQUEST` when it is free."""
        return int(self.array[slot]["request_id"])

    def _read(self, slot: int, request_id: int) -> np.void:
        rec = self.array[slot]
        found = int(rec["request_id"])
        if found != request_id or request_id == NO_REQUEST:
            raise StaleRecordError(slot, request_id, found)
        return rec

    def _write(self, slot: int, request_id: int, what: str) -> Optional[np.void]:
        rec = self.array[slot]
        found = int(rec["request_id"])
        if found != request_id or request_id == NO_REQUEST:
            log.warning("ignored a stale write of %s to slot %d for request %d (the slot holds %d)",
                        what, slot, request_id, found)
            return None
        return rec

    # --- HTTP side -------------------------------------------------------------------------
    def write_request(self, slot: int, request_id: int, spec: RequestSpec, top_slot: Optional[int] = None) -> None:
        """Claim the free ``slot`` (and ``top_slot``) for ``spec``: every field first, ``request_id`` last.

        ``top_slot``: a free top-logprob row, given exactly when the request asks for top
        logprobs (:func:`~.shm_req_layout.wants_top_rows`).  The spec checked its own fields;
        this checks what the record needs.  Raises ``ValueError`` (nothing written) for an id the
        record cannot hold, a request longer than a record or a missing or unexpected top row,
        and :class:`SlotOccupiedError` when the slot or the top row still holds a request.
        """
        check_request_id(request_id)
        if not isinstance(spec, RequestSpec):
            raise ValueError(f"write_request takes a RequestSpec, got {type(spec).__name__}")
        tops = claim_top_row(self._tops, self.top_slot_num, spec, top_slot)
        check_record_fits(spec, self.max_req_total_len)
        encoded_stops = encoded_stop_sequences(spec)
        rec = self.array[slot]
        if int(rec["request_id"]) != NO_REQUEST:
            raise SlotOccupiedError(f"slot {slot} still holds request {int(rec['request_id'])}")
        if tops is not None and int(tops["request_id"]) != NO_REQUEST:
            raise SlotOccupiedError(f"top-logprob slot {top_slot} still holds request {int(tops['request_id'])}")
        write_input_fields(rec, spec, encoded_stops)
        rec["top_slot"] = NO_TOP_SLOT if tops is None else top_slot
        if tops is not None:
            tops["request_id"] = request_id
        rec["request_id"] = request_id

    def release(self, slot: int, request_id: int) -> bool:
        """Free ``slot`` and its top row if it holds ``request_id`` (HTTP process only, after the
        request's last reader is done); False, and nothing changed, when it does not."""
        rec = self._write(slot, request_id, "the release")
        if rec is None:
            return False
        release_top_row(self._tops, rec, request_id)
        rec["request_id"] = NO_REQUEST
        return True

    # --- router ----------------------------------------------------------------------------
    def admission_fields(self, slot: int, request_id: int) -> AdmissionFields:
        """The fields the router admits ``request_id`` by."""
        rec = self._read(slot, request_id)
        return AdmissionFields(
            prompt_len=int(rec["prompt_len"]),
            max_new_tokens=int(rec["max_new_tokens"]),
            high_priority_request=bool(rec["high_priority_request"]),
            pd_kind=int(rec["pd_kind"]),
        )

    # --- model ranks -----------------------------------------------------------------------
    def read_request(self, slot: int, request_id: int) -> RequestSpec:
        """The request's :class:`RequestSpec`, rebuilt from the record.

        Building the spec and its sampling parameters runs their checks again, so a damaged
        record raises ``ValueError`` here (rank 0's screen turns that into the request's error).
        """
        return read_request_spec(self._read(slot, request_id))

    def set_prompt_cache_len(self, slot: int, request_id: int, prompt_cache_len: int) -> bool:
        """Record how many prompt tokens came from the prefix cache (rank 0, once)."""
        rec = self._write(slot, request_id, "prompt_cache_len")
        if rec is None:
            return False
        rec["prompt_cache_len"] = prompt_cache_len
        return True

    def publish_token(
        self, slot: int, request_id: int, token_id: int, logprob: float, top: Sequence[Tuple[int, float]] | None = None
    ) -> int:
        """Append one output token: data first, then the ``output_len`` publish point.

        ``top`` holds ``(token_id, logprob)`` alternatives, most likely first (at most
        :data:`MAX_TOP_LOGPROBS`); the rest of the row is marked unused with id ``-1``.
        Returns the new ``output_len``, or 0 when the slot no longer holds the request.
        """
        rec = self._write(slot, request_id, "a token")
        if rec is None:
            return 0
        index = int(rec["output_len"])
        rec["output_ids"][index] = token_id
        rec["output_logprobs"][index] = logprob
        if top:
            tops = top_row_for_write(self._tops, rec, request_id)
            if tops is not None:
                write_top(tops, int(rec["prompt_len"]) + index, top)
        rec["output_len"] = index + 1
        return index + 1

    def publish_tokens(
        self, slots: Sequence[int], request_ids: Sequence[int], token_ids: Sequence[int], logprobs: Sequence[float]
    ) -> List[int]:
        """:meth:`publish_token` for one token of each of several requests, without alternatives.

        Same order per request (data first, then ``output_len``): every token's id and logprob
        are written, then every ``output_len``.  Each slot may appear once.  A slot that no
        longer holds its request gets nothing written and a 0 in the returned lengths (with the
        same warning as :meth:`publish_token`).  One indexed write per field instead of a record
        lookup per token: a decode step of 512 requests wrote them in 0.8 ms one by one.
        """
        count = len(slots)
        if not (len(request_ids) == len(token_ids) == len(logprobs) == count):
            raise ValueError(
                f"publish_tokens: {count} slots, {len(request_ids)} request ids, {len(token_ids)} tokens and "
                f"{len(logprobs)} logprobs do not match"
            )
        if count == 0:
            return []
        index = np.asarray(slots, dtype=np.int64)
        if len(np.unique(index)) != count:
            raise ValueError("publish_tokens: a slot appears more than once (publish its tokens one by one)")
        array = self.array
        ids = np.asarray(request_ids, dtype=np.int64)
        owned = (array["request_id"][index] == ids) & (ids != NO_REQUEST)
        if not owned.all():
            for slot, request_id in zip(index[~owned].tolist(), ids[~owned].tolist()):
                self._write(slot, request_id, "a token")  # logs the stale write
            index = index[owned]
        positions = array["output_len"][index].astype(np.int64)
        array["output_ids"][index, positions] = np.asarray(token_ids)[owned]
        array["output_logprobs"][index, positions] = np.asarray(logprobs, dtype=np.float64)[owned]
        array["output_len"][index] = positions + 1
        lengths = np.zeros(count, dtype=np.int64)
        lengths[owned] = positions + 1
        return lengths.tolist()

    def published_output_len(self, slot: int, request_id: int) -> int:
        """Rank 0: the request's ``output_len`` (0 when the slot no longer holds it)."""
        rec = self.array[slot]
        return int(rec["output_len"]) if int(rec["request_id"]) == request_id else 0

    def publish_prompt_logprobs(
        self, slot: int, request_id: int, entries: Sequence[Tuple[Any, ...]]
    ) -> bool:
        """Write ``(position, logprob, top[, rank])`` of prompt tokens, then raise ``prompt_logprob_end``.

        Entries come in increasing position order, continuing where the last call stopped.
        """
        if not entries:
            return True
        rec = self._write(slot, request_id, "prompt logprobs")
        if rec is None:
            return False
        # Entries of a request with prompt_logprobs == 0 carry no alternatives and it has no row.
        tops = top_row_for_write(self._tops, rec, request_id) if any(entry[2] for entry in entries) else None
        for position, logprob, top, *rank in entries:
            rec["prompt_token_logprobs"][position] = logprob
            rec["prompt_token_ranks"][position] = rank[0] if rank else 0
            if tops is not None:
                write_top(tops, position, top)
        rec["prompt_logprob_end"] = max(int(rec["prompt_logprob_end"]), entries[-1][0] + 1)
        return True

    def set_scheduled_ns(self, slot: int, request_id: int, scheduled_ns: int) -> bool:
        """Record when the request was first scheduled (rank 0, once, before its first token)."""
        rec = self._write(slot, request_id, "scheduled_ns")
        if rec is None:
            return False
        rec["scheduled_ns"] = scheduled_ns
        return True

    def scheduled_ns(self, slot: int, request_id: int) -> int:
        """When rank 0 first scheduled the request (CLOCK_MONOTONIC ns; 0 while it has not)."""
        return int(self._read(slot, request_id)["scheduled_ns"])

    def set_finish_status(self, slot: int, request_id: int, status: int) -> bool:
        """Record how the request ended (rank 0, after its last token)."""
        rec = self._write(slot, request_id, "finish_status")
        if rec is None:
            return False
        rec["finish_status"] = status
        return True

    # --- detokenization --------------------------------------------------------------------
    def decode_options(self, slot: int, request_id: int) -> DecodeOptions:
        """Prompt ids, stop strings and text options of the request."""
        rec = self._read(slot, request_id)
        return DecodeOptions(
            prompt_ids=prompt_ids(rec),
            stop_sequences=stop_sequences(rec),
            skip_special_tokens=bool(rec["skip_special_tokens"]),
            include_stop_str_in_output=bool(rec["include_stop_str_in_output"]),
            print_eos_token=bool(rec["print_eos_token"]),
            stop_token_ids=rec["stop_token_ids"][: int(rec["stop_token_num"])].tolist(),
            ignore_eos=bool(rec["ignore_eos"]),
            min_new_tokens=int(rec["min_new_tokens"]),
        )

    def read_output(self, slot: int, request_id: int, start: int, end: Optional[int] = None) -> OutputSnapshot:
        """Output tokens ``start..output_len-1`` as published now (no further than ``end`` when
        given), with the finish status; the status reads 0 while tokens past ``end`` remain,
        since it belongs with the last of them."""
        rec = self._read(slot, request_id)
        status = int(rec["finish_status"])  # before the publish point: see the module docstring
        published = int(rec["output_len"])
        if end is None or end >= published:
            end = published
        else:
            status = 0
        tops = None
        if int(rec["logprobs"]) > 0:
            offset = int(rec["prompt_len"])
            tops = read_top(top_row_for_read(self._tops, rec, request_id), offset + start, offset + end)
        return OutputSnapshot(
            output_len=end,
            token_ids=rec["output_ids"][start:end].tolist(),
            logprobs=rec["output_logprobs"][start:end].tolist(),
            top_logprobs=tops,
            finish_status=status,
            prompt_cache_len=int(rec["prompt_cache_len"]),
        )

    def prompt_logprobs(self, slot: int, request_id: int) -> List[Tuple[int, float, TopRow, Optional[int]]] | None:
        """``(token_id, logprob, top, rank)`` of prompt positions ``1..`` published so far (rank None
        when not known), or None when the request did not ask for prompt logprobs."""
        rec = self._read(slot, request_id)
        count = int(rec["prompt_logprobs"])
        if count < 0:
            return None
        end = int(rec["prompt_logprob_end"])  # the publish point, read before the data
        if end <= 1:
            return []
        ids = rec["prompt_ids"][1:end].tolist()
        values = rec["prompt_token_logprobs"][1:end].tolist()
        tops = read_top(top_row_for_read(self._tops, rec, request_id), 1, end) if count > 0 else [[] for _ in ids]
        ranks = [rank or None for rank in rec["prompt_token_ranks"][1:end].tolist()]
        return list(zip(ids, values, tops, ranks))
