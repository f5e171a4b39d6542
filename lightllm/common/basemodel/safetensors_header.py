"""One safetensors file's header, read and checked without torch and without reading tensor data.

The layout (the safetensors format): an 8-byte little-endian length N, N bytes of JSON mapping
each tensor name to its ``dtype``, ``shape`` and ``data_offsets`` (begin and end, counted from the
end of the header; an optional ``__metadata__`` entry of strings), then the data.  The Rust reader
the ranks open the files with refuses a file whose length field does not fit the file ("header too
small", "invalid header length"), whose header is not that JSON, whose tensors do not tile the data
without gaps, each with the bytes its dtype and shape need, or whose data is longer or shorter than
the tensors ("incomplete metadata, file not fully covered": what an interrupted download leaves).
:func:`read_safetensors_header` applies the same rules from the first N + 8 bytes and the file's
size, so the launcher refuses such a file before any process starts, in one line naming it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from lightllm.common.basemodel.checkpoint_files import CheckpointFilesError

# The length field's size, and the largest header the Rust reader accepts (a larger length is a
# file of another format, not a header worth reading).
LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000

# Bits per element of the dtypes the Rust reader knows; a dtype not listed here (a newer
# version's) is left for that reader to judge, so its size is not checked.
DTYPE_BITS: Dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}

# The floating dtypes the weight loader reads, each cast to the serving dtype (an FP8 or integer
# weight is refused there), with the names config.json gives them.
FLOAT_DTYPE_NAMES: Dict[str, str] = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}

# An interrupted download or copy leaves such a file.
_REDOWNLOAD = "download or copy the file again"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it (``begin``/``end``: its bytes within the data)."""

    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """The header of one safetensors file whose layout the checks accepted."""

    path: Path
    data_start: int
    tensors: Dict[str, TensorEntry]


def _entry(path: Path, name: str, value: Any) -> TensorEntry:
    """``value`` as a :class:`TensorEntry`, refusing what the Rust reader could not parse."""
    fields = value if isinstance(value, dict) else {}
    dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
    well_formed = (isinstance(dtype, str) and isinstance(shape, list)
                   and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                   and isinstance(offsets, list) and len(offsets) == 2
                   and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets))
    if not well_formed:
        raise CheckpointFilesError(f"{path}: its safetensors header describes tensor {name!r} as {value!r}, "
                                   f"not a dtype, shape and data_offsets")
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _byte_size(entry: TensorEntry) -> Optional[int]:
    """The bytes ``entry``'s dtype and shape need (None for a dtype this module does not know)."""
    bits = DTYPE_BITS.get(entry.dtype)
    if bits is None:
        return None
    elements = 1
    for dim in entry.shape:
        elements *= dim
    return elements * bits // 8 if elements * bits % 8 == 0 else -1


def _check_layout(path: Path, tensors: Dict[str, TensorEntry], data_bytes: int) -> None:
    """Refuse tensors that do not tile the data exactly, as the Rust reader does when it opens the file."""
    end = 0
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != end or entry.end < entry.begin:
            raise CheckpointFilesError(f"{path}: tensor {name!r} has data_offsets [{entry.begin}, {entry.end}] in "
                                       f"its safetensors header, but the previous tensor's data ends at {end}")
        size = _byte_size(entry)
        if size is not None and size != entry.end - entry.begin:
            raise CheckpointFilesError(
                f"{path}: tensor {name!r} is {entry.dtype} of shape {list(entry.shape)} in its safetensors header, "
                f"which does not fit the {entry.end - entry.begin} bytes its data_offsets give it")
        end = entry.end
    if end > data_bytes:
        raise CheckpointFilesError(f"{path} is truncated: its safetensors header places tensor data up to byte "
                                   f"{end}, but the file holds {data_bytes} bytes of data ({end - data_bytes} bytes "
                                   f"missing); {_REDOWNLOAD}")
    if end < data_bytes:
        raise CheckpointFilesError(f"{path} has {data_bytes - end} bytes past the end of its tensors' data "
                                   f"(byte {end} by its safetensors header), which safetensors refuses; {_REDOWNLOAD}")


def read_safetensors_header(path: str | Path) -> SafetensorsHeader:
    """``path``'s header, checked as the ranks' reader checks it; never reads tensor data.

    Raises :class:`~lightllm.common.basemodel.checkpoint_files.CheckpointFilesError` (one line
    naming the file) for a file the ranks could not open (see the module docstring).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(LENGTH_BYTES)
        if len(raw) < LENGTH_BYTES:
            raise CheckpointFilesError(f"{path} is not a safetensors file: {size} bytes, shorter than the "
                                       f"{LENGTH_BYTES}-byte header length; {_REDOWNLOAD}")
        header_bytes = struct.unpack("<Q", raw)[0]
        if header_bytes > MAX_HEADER_BYTES:
            raise CheckpointFilesError(f"{path} is not a readable safetensors file: its first {LENGTH_BYTES} bytes "
                                       f"give a {header_bytes}-byte header, more than the {MAX_HEADER_BYTES} bytes "
                                       f"safetensors reads")
        if LENGTH_BYTES + header_bytes > size:
            raise CheckpointFilesError(f"{path} is not a readable safetensors file: its first {LENGTH_BYTES} bytes "
                                       f"give a {header_bytes}-byte header, but the file is {size} bytes; "
                                       f"{_REDOWNLOAD}")
        text = handle.read(header_bytes)
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointFilesError(f"{path}: its safetensors header is not valid JSON ({exc}); {_REDOWNLOAD}") from None
    except RecursionError:
        # Nested thousands deep (no real header is): the parser gives up rather than read it.
        raise CheckpointFilesError(f"{path}: its safetensors header is not a readable safetensors header (JSON "
                                   f"nested too deep to read); {_REDOWNLOAD}") from None
    if not isinstance(header, dict):
        raise CheckpointFilesError(f"{path}: its safetensors header is a JSON {type(header).__name__}, not an object "
                                   f"of tensors")
    metadata = header.pop("__metadata__", None)  # null is accepted, as by safetensors
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values())):
        raise CheckpointFilesError(f"{path}: its safetensors header's __metadata__ is {metadata!r}, not an object "
                                   f"of strings")
    tensors = {name: _entry(path, name, value) for name, value in header.items()}
    data_start = LENGTH_BYTES + header_bytes
    _check_layout(path, tensors, size - data_start)
    return SafetensorsHeader(path=path, data_start=data_start, tensors=tensors)
