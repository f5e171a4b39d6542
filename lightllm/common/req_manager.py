"""Mapping of request rows to the KV-cache token slots that hold their tokens."""

from __future__ import annotations

from typing import List, Sequence

import torch


class RequestRowsExhaustedError(RuntimeError):
    """All request rows are taken."""


class ReqManager:
    """A table ``req_to_token[row, position] -> slot`` plus a free list of rows.

    Position ``p`` of a request's token sequence (prompt then output) is stored at slot
    ``req_to_token[row, p]``.  Attention reads a request's context through its row.
    """

    def __init__(self, max_request_num: int, max_sequence_length: int, device: torch.device | str = "cpu"):
        self.max_request_num = max_request_num
        self.max_sequence_length = max_sequence_length
        self.req_to_token = torch.zeros(max_request_num, max_sequence_length, dtype=torch.int64, device=device)
        self._free_rows: List[int] = list(range(max_request_num - 1, -1, -1))
        self._used = [False] * max_request_num

    @property
    def available(self) -> int:
        """Free request rows."""
        return len(self._free_rows)

    def alloc_row(self) -> int:
        """Take a free row."""
        if not self._free_rows:
            raise RequestRowsExhaustedError(f"all {self.max_request_num} request rows are in use")
        row = self._free_rows.pop()
        self._used[row] = True
        return row

    def free_row(self, row: int) -> None:
        """Give a row back (its slots must be freed separately by the owner)."""
        if not 0 <= row < self.max_request_num or not self._used[row]:
            raise ValueError(f"request row {row} is not allocated")
        self._used[row] = False
        self._free_rows.append(row)

    def set_slots(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record that positions ``[start, start + len(slots))`` of ``row`` live at ``slots``."""
        end = start + slots.numel()
        if end > self.max_sequence_length:
            raise ValueError(f"sequence length {end} exceeds max_sequence_length {self.max_sequence_length}")
        self.req_to_token[row, start:end] = slots

    def set_next_slots(self, rows: Sequence[int], positions: Sequence[int], slots: torch.Tensor) -> None:
        """Record one new token per request (``req_to_token[rows[i], positions[i]] = slots[i]``) in one write.

        A decode step used to do one small slice write per request; this is a single indexed
        copy whatever the batch size.  Bounds are checked on the host-side lists, not the tensors.
        """
        if len(rows) != len(positions) or len(rows) != slots.numel():
            raise ValueError(f"{len(rows)} rows, {len(positions)} positions and {slots.numel()} slots do not match")
        if positions and max(positions) >= self.max_sequence_length:
            raise ValueError(f"sequence length {max(positions) + 1} exceeds max_sequence_length {self.max_sequence_length}")
        device = self.req_to_token.device
        index = (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(positions, dtype=torch.int64, device=device))
        self.req_to_token.index_put_(index, slots.to(device))

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions ``[start, end)`` of ``row``."""
        return self.req_to_token[row, start:end]
