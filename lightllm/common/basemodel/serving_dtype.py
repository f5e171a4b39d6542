"""Dtype names, and the dtype ``--data_type auto`` serves a checkpoint in.

Dtypes are names here (``float32``, ``bfloat16``, ``float16``), so that the processes that only plan
(the launcher, the PD master) read a checkpoint without importing torch; :func:`parse_dtype` turns a
name into a torch dtype where tensors are made.  The auto dtype is config.json's (``dtype``, else
``torch_dtype``), else the weights' own from their safetensors headers, as transformers'
``dtype="auto"`` and vLLM choose; :class:`~.model_config.ModelConfig` records it with where it came
from, a note when it was narrowed (float64 to float32) and the problem when none can be served.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Protocol, Set

from lightllm.common.basemodel.checkpoint_files import CheckpointFilesError, weight_files
from lightllm.common.basemodel.model_config_error import ModelConfigError
from lightllm.common.basemodel.safetensors_header import FLOAT_DTYPE_NAMES, read_safetensors_header

if TYPE_CHECKING:
    import torch

# Spelling (config.json's, the flags') -> canonical name, as torch names it.
_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

# What --data_type accepts (the server's flag, and the tools that size a KV cache as the server does).
DATA_TYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")

# Bytes per element of each canonical dtype (what torch's ``dtype.itemsize`` says).
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

# config.json's dtype keys, in the order transformers reads them (``dtype`` wins over ``torch_dtype``).
DTYPE_KEYS = ("dtype", "torch_dtype")
# Dtypes this server does not run that ``--data_type auto`` serves in the nearest one it does: a
# float64 checkpoint in float32 (vLLM, whose auto narrows float32 too, falls back to its platform's
# first dtype, bfloat16 on GPUs; this server's auto keeps float32 checkpoints in float32, so float64
# goes no further than float32).
_AUTO_FALLBACK_DTYPES = {"float64": "float32", "double": "float32"}


def auto_dtype_on(checkpoint: str, device: str) -> str:
    """The dtype ``--data_type auto`` serves a ``checkpoint``-dtype model in on ``device`` ("cpu", "cuda").

    float16 runs as float32 on CPU, where half-precision matmuls are slow or missing; bfloat16 stays.
    """
    return "float32" if device == "cpu" and checkpoint == "float16" else checkpoint


def dtype_name(dtype: Any) -> str:
    """The canonical name (``float32``, ``bfloat16``, ``float16``) of a dtype name or torch dtype.

    Accepts the spellings of config.json and the flags (``bf16``, ``torch.float16`` ...) and
    torch dtype objects (by their printed name, so torch is never imported here).
    """
    key = str(dtype).replace("torch.", "").lower()
    if key not in _DTYPE_NAMES:
        raise ModelConfigError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[key]


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype given by name or as a torch dtype."""
    return DTYPE_ITEMSIZE[dtype_name(dtype)]


def parse_dtype(name: Optional[str]) -> Optional["torch.dtype"]:
    """Map a dtype name (``float32``, ``bf16``, ``torch.float16`` ...) to a torch dtype.

    For the code that makes tensors: it imports torch, which a launcher must not (see
    docs/EN/architecture.md); everything that only plans uses :func:`dtype_name`.
    """
    if name is None:
        return None
    canonical = dtype_name(name)
    import torch

    return getattr(torch, canonical)


class AutoDtypeRecord(Protocol):
    """Where the auto dtype is recorded (a :class:`~.model_config.ModelConfig`)."""

    auto_dtype: Optional[str]
    dtype_source: str
    dtype_note: Optional[str]
    dtype_problem: Optional[str]


def _set_auto_dtype(cfg: AutoDtypeRecord, value: Any, source: str) -> None:
    """Record ``value`` (a dtype as config.json writes it) as what ``--data_type auto`` serves, or why it cannot."""
    cfg.dtype_source = source
    key = value.replace("torch.", "").lower() if isinstance(value, str) else None
    if key in _DTYPE_NAMES:
        cfg.auto_dtype = _DTYPE_NAMES[key]
    elif key in _AUTO_FALLBACK_DTYPES:
        cfg.auto_dtype = _AUTO_FALLBACK_DTYPES[key]
        cfg.dtype_note = (f"{source} is {value!r}, which this server does not run: --data_type auto serves it in "
                          f"{cfg.auto_dtype} (give --data_type to choose another)")
    else:
        cfg.auto_dtype = None
        cfg.dtype_problem = (f"{source} is {value!r}, a dtype this server cannot serve (it runs float32, bfloat16 "
                             f"and float16): give --data_type float32, bfloat16 or float16")


def take_config_dtype(cfg: AutoDtypeRecord, raw: Dict[str, Any]) -> None:
    """config.json's dtype (``dtype``, else ``torch_dtype``), when it names one (else the default stays)."""
    for key in DTYPE_KEYS:
        value = raw.get(key)
        if value is not None:
            _set_auto_dtype(cfg, value, f"config.json's {key}")
            return


def weight_dtypes(model_dir: str | Path) -> Optional[Set[str]]:
    """The dtypes (safetensors names: ``BF16``, ``F32`` ...) of ``model_dir``'s weight files, from their
    headers alone (no tensor data); None when the files cannot be read (the launcher refuses them by name)."""
    try:
        headers = [read_safetensors_header(path) for path in weight_files(model_dir)]
    except (CheckpointFilesError, OSError):
        return None
    return {entry.dtype for header in headers for entry in header.tensors.values()}


def take_weights_dtype(cfg: AutoDtypeRecord, model_dir: str | Path) -> None:
    """The weights' floating dtype for a config.json that names none (float32 when no weights can be read).

    One floating dtype is taken as it is; several are served in the one that holds them all, as vLLM
    chooses (float16 with bfloat16: float32).  Only when the weights cannot be read (a PD master
    needs none; the launcher refuses unreadable ones by name) does transformers' float32 default apply.
    """
    found = weight_dtypes(model_dir)
    if found is None:
        return  # from_dict's float32 stays
    floats = {FLOAT_DTYPE_NAMES[name] for name in found if name in FLOAT_DTYPE_NAMES}
    source = "the weights' dtype (safetensors headers; config.json names none)"
    if not floats:
        cfg.dtype_source = source
        cfg.auto_dtype = None
        if not found:
            cfg.dtype_problem = "config.json names no dtype and the weight files hold no tensors"
        else:
            cfg.dtype_problem = (f"config.json names no dtype and the weights hold no float32, bfloat16 or float16 "
                                 f"tensor (their dtypes: {', '.join(sorted(found))}): integer or quantized weights "
                                 f"are not supported, whatever --data_type says")
        return
    if len(floats) == 1:
        chosen = next(iter(floats))
    else:
        # The narrowest dtype every one casts to without loss (float16 and bfloat16 hold neither the other).
        chosen = "float64" if "float64" in floats else "float32"
        source = f"the dtype holding all of the weights' ({', '.join(sorted(floats))}; safetensors headers; " \
                 f"config.json names none)"
    _set_auto_dtype(cfg, chosen, source)
