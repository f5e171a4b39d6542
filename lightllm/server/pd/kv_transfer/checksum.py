"""A cheap, position-sensitive checksum of a KV payload, computed page by page.

Not cryptographic: it catches truncated, reordered or corrupted pages (and injected faults)
at the cost of two vectorised sums over the payload, on whatever device holds it.
"""

from __future__ import annotations

import torch

_MODULUS = (1 << 61) - 1
_WIDTH = 64  # words are summed per column of this width, each column weighted by its index


def page_checksum(page: torch.Tensor) -> int:
    """Checksum of one contiguous page (any dtype).

    The payload is read as int64 words (summing those is several times faster than narrower
    integers on CPU); sums wrap around identically on both sides, which is all a checksum needs.
    """
    raw = page.reshape(-1).view(torch.uint8)
    usable = raw.numel() // 8 * 8
    try:
        words = raw[:usable].view(torch.int64)
    except RuntimeError:  # a page starting off an 8-byte boundary: read it byte by byte
        words, usable = raw.to(torch.int64), raw.numel()
    rows = words.numel() // _WIDTH
    weights = torch.arange(1, _WIDTH + 1, dtype=torch.int64, device=words.device)
    grid = words[: rows * _WIDTH].view(rows, _WIDTH)
    # Column sums catch words moved within a row, row sums (weighted by row) moved rows.
    total = int((grid.sum(0) * weights).sum().item())
    row_weights = torch.arange(rows, dtype=torch.int64, device=words.device) % 65521 + 1
    total += 31 * int((grid.sum(1) * row_weights).sum().item())
    tail = words[rows * _WIDTH :]
    total += int((tail * weights[: tail.numel()]).sum().item())
    rest = raw[usable:]
    total += 7919 * int(rest.to(torch.int64).sum().item())
    return total % _MODULUS


def combine(total: int, page_index: int, page_sum: int) -> int:
    """Fold a page's checksum into the running total, weighted by the page's position."""
    return (total + (page_index + 1) * page_sum) % _MODULUS


def payload_checksum(data: torch.Tensor, page_size: int) -> int:
    """Checksum of a token-major payload sent in pages of ``page_size`` tokens."""
    total = 0
    for index, start in enumerate(range(0, data.shape[0], page_size)):
        total = combine(total, index, page_checksum(data[start : start + page_size]))
    return total
