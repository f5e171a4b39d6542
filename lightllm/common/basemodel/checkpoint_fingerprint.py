"""A short digest of a checkpoint's weights, read without torch.

Two PD nodes exchange KV only when they run the same weights: a decode node continuing a prefill
node's KV with another fine-tune of the same architecture gives wrong text, not an error, and
the model name and shapes the nodes already compare cannot tell the two apart.  Hashing every
byte would read the whole checkpoint at start-up, so the digest covers, for every tensor in name
order, its name, dtype and shape and a few bytes at its start, middle and end: any retraining or
fine-tune changes those, and a copy re-sharded into other files or renamed keeps the digest.
Config files are left out: copies of one checkpoint differ in fields that change nothing (the
writer's version), and the nodes compare the architecture fields separately.  Torch-free (the
launcher computes it): plain reads of the safetensors headers and bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import BinaryIO, Dict, List, Tuple

from lightllm.common.basemodel.safetensors_header import TensorEntry
from lightllm.common.basemodel.weight_headers import read_weight_headers

# Bytes read at each of the three places of a tensor.
SAMPLE_BYTES = 64
# The hex digits kept (64 bits: accidental equality of different weights is out of reach).
FINGERPRINT_HEX_DIGITS = 16


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """Hex digest of the weights in ``model_dir``'s weight files (read as :func:`read_weight_headers`
    reads them, which refuses a damaged file naming it; see the module docstring)."""
    tensors: List[Tuple[str, Path, int, TensorEntry]] = [
        (name, header.path, header.data_start, entry)
        for header in read_weight_headers(model_dir).values() for name, entry in header.tensors.items()
    ]
    digest = hashlib.sha256()
    handles: Dict[Path, BinaryIO] = {}
    try:
        for name, path, data_start, entry in sorted(tensors, key=lambda item: item[0]):
            digest.update(json.dumps([name, entry.dtype, list(entry.shape)]).encode())
            start, size = entry.begin, entry.end - entry.begin
            handle = handles.get(path) or handles.setdefault(path, open(path, "rb"))
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                handle.seek(data_start + start + offset)
                digest.update(handle.read(min(SAMPLE_BYTES, size - offset)))
    finally:
        for handle in handles.values():
            handle.close()
    return digest.hexdigest()[:FINGERPRINT_HEX_DIGITS]
