"""The header that announces a request's KV, and the compatibility check on it.

The header is a fixed-length int64 array; the prefill side announces each transfer by putting
it, as bytes, in the pair's store (:mod:`announce`), and the decode side posts its receives
only after reading it.  The receiver refuses a header whose geometry (layers, KV heads, head dim, dtype)
differs from its own cache: writing such KV would corrupt the request silently, the classic
cause of garbage output in mismatched PD deployments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

HEADER_MAGIC = 0x4C4C4B56  # "LLKV"
# Version 2 added the first token (sampled by the prefill node) after the checksum.
HEADER_VERSION = 2
HEADER_LEN = 11

# Stable codes: torch does not promise a numbering of its dtypes.
_DTYPE_CODES = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.float8_e4m3fn: 5,
    torch.float8_e5m2: 6,
    torch.int8: 7,
    torch.uint8: 8,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of ``dtype``."""
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"KV dtype {dtype} cannot be transferred")
    return _DTYPE_CODES[dtype]


def dtype_from_code(code: int) -> Optional[torch.dtype]:
    """The dtype of a wire code, or None when unknown."""
    return _CODE_DTYPES.get(code)


@dataclass(frozen=True)
class TransferHeader:
    """What the receiver must know (and check) before any KV byte arrives."""

    request_id: int
    token_count: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    checksum: int
    # The token the prefill node sampled after the prompt; the decode node continues from it
    # (-1: none, for transfers outside a request flow such as the benchmark).
    first_token: int = -1

    def to_tensor(self) -> torch.Tensor:
        """The header as ``HEADER_LEN`` int64 values."""
        return torch.tensor(
            [HEADER_MAGIC, HEADER_VERSION, self.request_id, self.token_count, self.num_layers, self.kv_heads,
             self.head_dim, dtype_code(self.dtype), self.page_size, self.checksum, self.first_token],
            dtype=torch.int64,
        )

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> "TransferHeader":
        """Parse a received header; raises ValueError when it is not one."""
        v = [int(x) for x in values.tolist()]
        if len(v) != HEADER_LEN or v[0] != HEADER_MAGIC:
            raise ValueError("received bytes are not a KV transfer header")
        if v[1] != HEADER_VERSION:
            raise ValueError(f"KV transfer header version {v[1]} is not the supported {HEADER_VERSION}")
        dtype = dtype_from_code(v[7])
        if dtype is None:
            raise ValueError(f"KV transfer header has unknown dtype code {v[7]}")
        return cls(v[2], v[3], v[4], v[5], v[6], dtype, v[8], v[9], v[10])

    def to_bytes(self) -> bytes:
        """The header as ``HEADER_LEN`` little-endian int64 values (what an announcement holds)."""
        return self.to_tensor().numpy().astype("<i8").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "TransferHeader":
        """Parse an announced header; raises ValueError when it is not one."""
        if len(data) != HEADER_LEN * 8:
            raise ValueError(f"received {len(data)} bytes, not a KV transfer header")
        return cls.from_tensor(torch.from_numpy(np.frombuffer(data, dtype="<i8").astype(np.int64)))

    @property
    def payload_bytes(self) -> int:
        """Bytes of KV the header announces."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.token_count * 2 * self.num_layers * self.kv_heads * self.head_dim * element

    def incompatibility(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> Optional[str]:
        """Why KV with this header cannot go into a cache of the given geometry, or None."""
        ours = (num_layers, kv_heads, head_dim, dtype)
        theirs = (self.num_layers, self.kv_heads, self.head_dim, self.dtype)
        if ours == theirs:
            return None
        names = ("num_layers", "kv_heads", "head_dim", "dtype")
        diffs = [f"{n} {t} vs {o}" for n, t, o in zip(names, theirs, ours) if t != o]
        return "prefill KV does not match this decode cache (prefill vs decode): " + ", ".join(diffs)
