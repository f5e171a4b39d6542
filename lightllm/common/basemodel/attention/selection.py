"""Which attention backend a model rank uses: ``--attention_backend auto|torch|torch_compiled|cpp|triton``."""

from __future__ import annotations

import logging
import os
import shutil
from typing import TYPE_CHECKING, List

from lightllm.common.basemodel.attention.backend_error import AttentionBackendError
from lightllm.utils.triton_interpret import triton_interpret_requested

if TYPE_CHECKING:
    from lightllm.common.basemodel.attention.base import AttentionBackend

log = logging.getLogger("lightllm.attention")

ATTENTION_BACKENDS: List[str] = ["auto", "torch", "torch_compiled", "cpp", "triton"]


def triton_import_error() -> str | None:
    """Why ``import triton`` fails, or None when it works."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install raises more than ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


_CXX_CANDIDATES = ("g++", "c++", "clang++")


def attention_device_problem(requested: str, device: str) -> str | None:
    """Why backend ``requested`` cannot run on ``device`` at all (one line), or None.

    Needs nothing but the two names (and ``TRITON_INTERPRET``, read by the rule the rank's kernels use:
    :mod:`lightllm.utils.triton_interpret`), so the launcher refuses such a start before any child process exists; what
    needs triton or a compiler is the rank's to check.
    """
    if requested in ("cpp", "torch_compiled") and device != "cpu":
        return f"--attention_backend {requested} runs on CPU only (the device is {device}); on CUDA use triton or torch"
    if requested == "triton" and device != "cuda" and not triton_interpret_requested():
        return (f"--attention_backend triton needs a CUDA device (the device is {device}); "
                "on CPU use --attention_backend torch (Triton runs on CPU only under TRITON_INTERPRET=1, for tests)")
    return None


def cpp_compiler() -> str | None:
    """Path of the C++ compiler inductor would use on CPU, or None when there is none."""
    for name in ([os.environ["CXX"]] if os.environ.get("CXX") else []) + list(_CXX_CANDIDATES):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpp_kernel_build_error(compiler: str) -> str | None:
    """Why the C++ attention kernel cannot be built with ``compiler`` (one line), or None once it is built."""
    # Imported here: only CPU starts that may use the kernel need the build module.
    from lightllm.common.basemodel.attention.cpp_kernel_build import KernelBuildError, build_kernel

    try:
        build_kernel(compiler)
    except (KernelBuildError, OSError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def resolve_attention_backend(requested: str, device: str) -> str:
    """The concrete backend (``torch``, ``torch_compiled``, ``cpp`` or ``triton``) for ``requested`` on ``device``.

    Called by each model rank as it starts (the launcher imports no torch); the rank reports an
    :class:`AttentionBackendError` to the launcher, which prints it in one line and exits 2.

    ``torch_compiled`` and ``cpp`` are CPU only and need a C++ compiler (torch.compile builds
    the first one's kernel, the system compiler the second's).

    ``auto`` takes triton on CUDA when triton imports, cpp on CPU when a C++ compiler is on PATH
    (its decode measured 1.2-3.1x the torch path's, bench_decode_attention), torch otherwise.
    An explicit choice that cannot run is refused: on CPU Triton kernels run only in the
    interpreter, which is for tests, not for serving.
    """
    if requested not in ATTENTION_BACKENDS:
        raise AttentionBackendError(f"--attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}")
    if requested == "torch":
        return "torch"
    if requested == "cpp":
        if device != "cpu":
            raise AttentionBackendError(attention_device_problem(requested, device))
        compiler = cpp_compiler()
        if compiler is None:
            raise AttentionBackendError(
                "--attention_backend cpp builds its kernel with a C++ compiler (none of "
                f"{', '.join(_CXX_CANDIDATES)} or $CXX is on PATH); install one or use --attention_backend torch"
            )
        problem = _cpp_kernel_build_error(compiler)
        if problem is not None:
            raise AttentionBackendError(f"--attention_backend cpp: {problem}; fix it or use --attention_backend torch")
        return "cpp"
    if requested == "torch_compiled":
        if device != "cpu":
            raise AttentionBackendError(attention_device_problem(requested, device))
        if cpp_compiler() is None:
            raise AttentionBackendError(
                "--attention_backend torch_compiled needs a C++ compiler for torch.compile (none of "
                f"{', '.join(_CXX_CANDIDATES)} or $CXX is on PATH); install one or use --attention_backend torch"
            )
        return "torch_compiled"
    if requested == "auto":
        if device == "cuda":
            return "triton" if triton_import_error() is None else "torch"
        compiler = cpp_compiler() if device == "cpu" else None
        if compiler is None:
            # A slim image without a compiler loses the fast CPU kernel: say so, as a failed build does.
            log.warning("attention backend auto: no C++ compiler for the cpp kernel (none of %s or $CXX is on "
                        "PATH); using torch", ", ".join(_CXX_CANDIDATES))
            return "torch"
        problem = _cpp_kernel_build_error(compiler)
        if problem is not None:
            log.warning("attention backend auto: the cpp kernel cannot be built (%s); using torch", problem)
            return "torch"
        return "cpp"
    problem = triton_import_error()
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


def build_attention_backend(name: str, strict: bool = False) -> AttentionBackend:
    """An instance of the resolved backend ``name`` (``torch``, ``torch_compiled``, ``cpp`` or ``triton``).

    ``strict``: the backend was asked for by name (not ``auto``), so a model it cannot run is
    refused (:class:`AttentionBackendError`) rather than served on a fallback path.
    """
    if name == "torch":
        from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention

        return TorchSdpaAttention()
    if name == "torch_compiled":
        from lightllm.common.basemodel.attention.torch_compiled import TorchCompiledAttention

        return TorchCompiledAttention()
    if name == "cpp":
        from lightllm.common.basemodel.attention.cpp_attention import CppSlotAttention

        compiler = cpp_compiler()
        if compiler is None:
            raise AttentionBackendError("attention backend cpp needs a C++ compiler on PATH (or $CXX)")
        return CppSlotAttention(compiler, strict=strict)
    if name == "triton":
        # Imported only when chosen: the kernels are decorated at import, and whether Triton
        # compiles them or interprets them is fixed then.
        from lightllm.common.basemodel.attention.triton_backend import TritonAttention

        return TritonAttention()
    raise AttentionBackendError(f"unknown resolved attention backend {name!r} (expected torch, torch_compiled or triton)")
