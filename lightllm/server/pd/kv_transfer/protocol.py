"""One request's KV on the wire: announcement, verdict, pages, acknowledgement.

Prefill side (rank 0)                           Decode side (rank 1)
  header in the pair's store (announce/<seq>) ->  takes it, checks geometry, request, token count
                                              <-  verdict (int64[2]: code, 0)
  pages of page_size tokens (bytes)           ->  each page checksummed and written into its slots
                                              <-  ack (int64[2]: code, 0) after the checksum matched

The header goes through the store (:mod:`announce`), not the group: the decode side posts no
receive until a transfer is announced, so an idle pair holds no pending collective.  A refused
header ends the request on both sides without a payload, and the group stays usable; so does a
checksum mismatch.  Only a timeout or a dead peer (:class:`ChannelFault`) breaks the group.
Every wait on the group is bounded by ``timeout_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.announce import Announcer
from lightllm.server.pd.kv_transfer.bounded_wait import wait_work
from lightllm.server.pd.kv_transfer.checksum import combine, page_checksum, payload_checksum
from lightllm.server.pd.kv_transfer.header import TransferHeader
from lightllm.server.pd.kv_transfer.messages import TransferResult

PREFILL_RANK, DECODE_RANK = 0, 1
# Tag 1 carried the header before headers moved to the store; it is left unused.
TAG_VERDICT, TAG_PAGE, TAG_ACK = 2, 3, 4

OK = 0
REFUSED_GEOMETRY = 1
REFUSED_UNKNOWN_REQUEST = 2
REFUSED_TOKEN_COUNT = 3
REFUSED_PAGE_SIZE = 4
FAILED_CHECKSUM = 5
FAILED_IMPORT = 6

PIPELINE_BYTES = 8 << 20
MAX_PAGES_IN_FLIGHT = 32

CODE_REASONS = {
    REFUSED_GEOMETRY: "KV geometry (layers, KV heads, head dim, dtype) differs from the decode cache",
    REFUSED_UNKNOWN_REQUEST: "the decode side has no reservation for this request",
    REFUSED_TOKEN_COUNT: "token count differs from the slots the decode side reserved",
    REFUSED_PAGE_SIZE: "page size must be positive",
    FAILED_CHECKSUM: "payload checksum mismatch",
    FAILED_IMPORT: "the decode side could not write the KV into its cache",
}


@dataclass
class Link:
    """This process's end of the two-rank group, counting the receives it posts."""

    device: torch.device  # where the wire tensors live: CPU for gloo, the GPU for NCCL
    polled: bool  # NCCL: poll completion instead of gloo's timed wait
    timeout_s: float
    receives_posted: int = 0
    receives_pending: int = 0  # posted and not waited for

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
        """Send ``tensor`` to rank ``peer`` and wait for it; ``ChannelFault`` naming ``what`` after ``timeout_s``."""
        wait_work(dist.isend(tensor, peer, tag=tag), self.timeout_s, what, self.polled)

    def post_recv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        """Post a receive into ``tensor`` from rank ``peer`` without waiting; finish it with :meth:`wait_recv`."""
        work = dist.irecv(tensor, peer, tag=tag)
        self.receives_posted += 1
        self.receives_pending += 1
        return work

    def wait_recv(self, work: dist.Work, what: str) -> None:
        """Wait for a receive from :meth:`post_recv` (bounded by ``timeout_s``)."""
        try:
            wait_work(work, self.timeout_s, what, self.polled)
        finally:
            self.receives_pending -= 1

    def recv(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
        """Receive into ``tensor`` from rank ``peer``, waiting as :meth:`send` does."""
        self.wait_recv(self.post_recv(tensor, peer, tag), what)

    def code_message(self, code: int) -> torch.Tensor:
        """A ``[code, 0]`` int64 message on the wire device (``code``: OK or a refusal/failure code)."""
        return torch.tensor([code, 0], dtype=torch.int64, device=self.device)


def _wire(page: torch.Tensor) -> torch.Tensor:
    # Bytes on the wire: any KV dtype travels, whatever the backend supports natively.
    return page.reshape(-1).view(torch.uint8)


def send_kv(
    link: Link,
    announcer: Announcer,
    cache: KVCacheMemoryManager,
    request_id: int,
    slots: np.ndarray,
    page_size: int,
    corrupt: bool = False,
    first_token: int = -1,
) -> TransferResult:
    """Prefill side: announce and send ``slots``' KV as ``request_id``; ok once the decode side acknowledged.

    ``corrupt`` (failure injection) announces a wrong checksum, so the decode side's own check
    refuses the payload exactly as it would refuse a damaged one.
    """
    start = time.monotonic()
    data = cache.export_slots(torch.from_numpy(slots)).to(link.device)
    checksum = payload_checksum(data, page_size)
    if corrupt:
        checksum ^= 1
    header = TransferHeader(request_id, int(data.shape[0]), cache.num_layers, cache.kv_heads, cache.head_dim,
                            cache.dtype, page_size, checksum, first_token)
    announcer.announce(header.to_bytes())
    verdict = link.code_message(-1)
    link.recv(verdict, DECODE_RANK, TAG_VERDICT, f"the decode side's verdict on request {request_id}")
    code = int(verdict[0].item())
    if code != OK:
        return _failed(request_id, start, 0, code, "refused by the decode side")
    works = [dist.isend(_wire(data[p : p + page_size]), DECODE_RANK, tag=TAG_PAGE)
             for p in range(0, data.shape[0], page_size)]
    for index, work in enumerate(works):
        wait_work(work, link.timeout_s, f"page {index} of request {request_id} to be sent", link.polled)
    ack = link.code_message(-1)
    link.recv(ack, DECODE_RANK, TAG_ACK, f"the decode side's acknowledgement of request {request_id}")
    code = int(ack[0].item())
    nbytes = header.payload_bytes
    if code != OK:
        reason_suffix = " (injected failure: LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY)" if corrupt else ""
        return _failed(request_id, start, nbytes, code, "rejected by the decode side", reason_suffix)
    return TransferResult(request_id, True, time.monotonic() - start, nbytes)


def receive_kv(
    link: Link,
    cache: KVCacheMemoryManager,
    header: TransferHeader,
    find_slots: Callable[[int], Optional[np.ndarray]],
) -> TransferResult:
    """Decode side: check an announced header, take the pages into the reserved slots, acknowledge.

    ``find_slots(request_id)`` gives the slots reserved for the request (None when unknown).
    """
    start = time.monotonic()
    request_id = header.request_id
    slots = find_slots(request_id)
    geometry = header.incompatibility(cache.num_layers, cache.kv_heads, cache.head_dim, cache.dtype)
    if geometry is not None:
        code, detail = REFUSED_GEOMETRY, geometry
    elif slots is None:
        code, detail = REFUSED_UNKNOWN_REQUEST, ""
    elif len(slots) != header.token_count:
        code, detail = REFUSED_TOKEN_COUNT, f"{header.token_count} tokens sent, {len(slots)} slots reserved"
    elif header.page_size <= 0:
        code, detail = REFUSED_PAGE_SIZE, f"got {header.page_size}"
    else:
        code, detail = OK, ""
    link.send(link.code_message(code), PREFILL_RANK, TAG_VERDICT, f"the verdict on request {request_id} to be sent")
    if code != OK:
        refused = _failed(request_id, start, 0, code, "refused", f": {detail}" if detail else "")
        return replace(refused, unreserved=code == REFUSED_UNKNOWN_REQUEST)
    code = _receive_pages(link, cache, header, torch.from_numpy(slots))
    link.send(link.code_message(code), PREFILL_RANK, TAG_ACK, f"the acknowledgement of request {request_id} to be sent")
    if code != OK:
        return _failed(request_id, start, header.payload_bytes, code, "failed")
    return TransferResult(request_id, True, time.monotonic() - start, header.payload_bytes,
                          first_token=header.first_token)


def _receive_pages(link: Link, cache: KVCacheMemoryManager, header: TransferHeader, slots: torch.Tensor) -> int:
    page, count = header.page_size, header.token_count
    shape = (min(page, count), 2, cache.num_layers, cache.kv_heads, cache.head_dim)
    starts = list(range(0, count, page))
    # Several pages in flight: a page is only sent once its receive is posted, so with few
    # buffers small pages would pay a round trip each.  Memory stays near PIPELINE_BYTES.
    page_bytes = header.payload_bytes // max(count, 1) * shape[0]
    depth = max(2, min(MAX_PAGES_IN_FLIGHT, PIPELINE_BYTES // max(page_bytes, 1), len(starts)))
    buffers = [torch.empty(shape, dtype=cache.dtype, device=link.device) for _ in range(depth)]
    pending = {}

    def post(index: int) -> None:
        begin = starts[index]
        target = buffers[index % depth][: min(page, count - begin)]
        pending[index] = (target, link.post_recv(_wire(target), PREFILL_RANK, TAG_PAGE))

    total, failed_import = 0, False
    for index in range(min(depth - 1, len(starts))):
        post(index)
    for index, begin in enumerate(starts):
        if index + depth - 1 < len(starts):
            post(index + depth - 1)  # into the buffer the previous page freed
        target, work = pending.pop(index)
        link.wait_recv(work, f"page {index} of request {header.request_id}")
        total = combine(total, index, page_checksum(target))
        if not failed_import:
            try:
                cache.import_slots(slots[begin : begin + target.shape[0]], target)
            except (RuntimeError, ValueError, IndexError):
                failed_import = True
    if link.device.type == "cuda":
        # The rank process reads these slots on its own stream once the result is reported.
        torch.cuda.synchronize(link.device)
    if total != header.checksum:
        return FAILED_CHECKSUM
    return FAILED_IMPORT if failed_import else OK


def _failed(request_id: int, start: float, nbytes: int, code: int, verb: str, suffix: str = "") -> TransferResult:
    reason = f"request {request_id} {verb}: {CODE_REASONS.get(code, f'code {code}')}{suffix}"
    return TransferResult(request_id, False, time.monotonic() - start, nbytes, reason)
