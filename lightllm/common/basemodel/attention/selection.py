"""Which attention backend a model rank uses: ``--attention_backend auto|torch|triton``."""

from __future__ import annotations

from typing import List

from lightllm.common.basemodel.attention.base import AttentionBackend

ATTENTION_BACKENDS: List[str] = ["auto", "torch", "triton"]


class AttentionBackendError(ValueError):
    """The requested backend cannot run here (message fits one line)."""


def triton_import_error() -> str | None:
    """Why ``import triton`` fails, or None when it works."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_attention_backend(requested: str, device: str) -> str:
    """The concrete backend (``torch`` or ``triton``) for ``requested`` on ``device``.

    ``auto`` takes triton on CUDA when triton imports, torch otherwise.  An explicit ``triton``
    that cannot run is refused: on CPU Triton kernels run only in the interpreter, which is for
    tests, not for serving.
    """
    if requested not in ATTENTION_BACKENDS:
        raise AttentionBackendError(f"--attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}")
    if requested == "torch":
        return "torch"
    problem = triton_import_error()
    if requested == "auto":
        return "triton" if device == "cuda" and problem is None else "torch"
    if problem is not None:
        raise AttentionBackendError(f"--attention_backend triton needs the triton package, which fails to import ({problem})")
    # Imported here: launch_utils imports triton, which is known to import by now.
    from lightllm.common.basemodel.triton_kernel.launch_utils import interpreting

    if device != "cuda" and not interpreting():
        raise AttentionBackendError(
            f"--attention_backend triton needs a CUDA device (the device is {device}); "
            "on CPU use --attention_backend torch (Triton runs on CPU only under TRITON_INTERPRET=1, for tests)"
        )
    return "triton"


def build_attention_backend(name: str) -> AttentionBackend:
    """An instance of the resolved backend ``name`` (``torch`` or ``triton``)."""
    if name == "torch":
        from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention

        return TorchSdpaAttention()
    if name == "triton":
        # Imported only when chosen: the kernels are decorated at import, and whether Triton
        # compiles them or interprets them is fixed then.
        from lightllm.common.basemodel.attention.triton_backend import TritonAttention

        return TritonAttention()
    raise AttentionBackendError(f"unknown resolved attention backend {name!r} (expected torch or triton)")
