"""Building and loading the C++ CPU kernels (``SOURCES``: attention and the fused layer ops) on first use.

The kernels are compiled into one shared library with the system C++ compiler for the CPU it
runs on (``-march=native``), the way torch inductor builds its own CPU kernels, and loaded with
ctypes: plain C entry points, no torch headers, so a build needs nothing but the compiler (15-35
s on a 2-core VM, once per machine; the slot kernel's head_dim x group variants dominate).  The
shared object is cached under ``$XDG_CACHE_HOME/lightllm/kernels`` (``~/.cache`` by default) by a
hash of the sources, the compiler's version, the flags and the CPU's model and feature flags, so
a cache shared between different machines never hands one of them code for another's CPU.
Concurrent builds (TP ranks starting together) write to private temporary names and rename.
Every source change makes a new library, so each use refreshes its file's time and a build
removes the libraries (and abandoned partial builds) unused for ``STALE_KERNEL_SECONDS``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("lightllm.cpp_kernel")

# Every source goes into one library, so one build (and one cache entry) serves all of them.
SOURCES = (
    Path(__file__).with_name("cpp_slot_attention.cpp"),
    Path(__file__).with_name("cpp_prefill_attention.cpp"),
    Path(__file__).parent.parent / "cpp_layer_ops.cpp",
)
# Included by the sources: part of the cache key, not compiled on their own.
HEADERS = (Path(__file__).with_name("cpp_kernel_vector.h"),)

# Reassociation lets the compiler sum a dot product as a tree instead of lane by lane; the
# infinities the kernel uses stay valid (no -ffinite-math-only, unlike -ffast-math).
FLAGS = [
    "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fopenmp",
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
]

# A cached library nobody has used for this long is removed when a new one is built.
STALE_KERNEL_SECONDS = 30 * 24 * 3600

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled or loaded (the message fits one line)."""


def _cpu_identity() -> str:
    # The model name and feature flags decide which instructions -march=native may use.
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted)))


def _compiler_version(compiler: str) -> str:
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"cannot run the C++ compiler {compiler}: {exc}") from exc
    return result.stdout


def cache_dir() -> Path:
    """Where built kernels are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightllm" / "kernels"


def kernel_path(compiler: str) -> Path:
    """The cached shared object for these sources, compiler, flag set and CPU."""
    digest = hashlib.sha256()
    sources = [source.read_bytes() for source in (*SOURCES, *HEADERS)]
    for part in (*sources, _compiler_version(compiler).encode(), " ".join(FLAGS).encode(),
                 _cpu_identity().encode(), platform.machine().encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / f"cpu_kernels_{digest.hexdigest()[:20]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=target.stem + ".", suffix=".partial.so", dir=target.parent)
    os.close(handle)
    try:
        command = [compiler, *FLAGS, *(str(source) for source in SOURCES), "-o", partial]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            first = (result.stderr.strip().splitlines() or ["no output"])[0]
            names = ", ".join(source.name for source in SOURCES)
            raise KernelBuildError(f"{compiler} failed to build {names} (exit {result.returncode}): {first}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def build_kernel(compiler: str) -> Path:
    """The cached kernel's path, built with ``compiler`` first if this machine has none yet.

    Each model rank calls this while it resolves its attention backend, before it loads the
    model, so a failing build is a one-line start-up error (or, for ``--attention_backend auto``,
    a fallback) rather than a failure at the first request.
    """
    target = kernel_path(compiler)
    if target.exists():
        _mark_used(target)
    else:
        # The first start on a machine compiles for a while in silence otherwise: say why it waits.
        log.info("building the C++ CPU kernels with %s (first start on this machine only, cached in %s; "
                 "15-35 s on two cores)", compiler, target.parent)
        started = time.monotonic()
        _build(compiler, target)
        log.info("C++ CPU kernels built in %.1f s", time.monotonic() - started)
        prune_stale_kernels(target.parent, keep=target)
    return target


def _mark_used(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # a read-only shared cache: the library is still usable, just never pruned
        pass


def prune_stale_kernels(directory: Path, keep: Path, max_age_seconds: float = STALE_KERNEL_SECONDS) -> list[Path]:
    """Remove this cache's libraries and partial builds unused for ``max_age_seconds`` (never
    ``keep``); returns what was removed.  A process that already loaded one keeps its mapping."""
    removed = []
    now = time.time()
    for path in directory.glob("cpu_kernels_*.so"):
        try:
            if path != keep and now - path.stat().st_mtime > max_age_seconds:
                path.unlink()
                removed.append(path)
        except OSError:  # removed by a concurrent build, or not ours to remove
            continue
    return removed


def declare_slot_attention(library: ctypes.CDLL) -> None:
    """Argument types of ``cpp_slot_attention.cpp``'s entry points (also for a library of that source alone)."""
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.lightllm_slot_attention.restype = ctypes.c_int
    library.lightllm_slot_attention.argtypes = [
        pointer, pointer, pointer, pointer, i64, pointer, i64, i64, i64, i64, i64, i64,
        ctypes.c_int, ctypes.c_float, ctypes.c_int, pointer,
    ]
    library.lightllm_slot_attention_supports.restype = ctypes.c_int
    library.lightllm_slot_attention_supports.argtypes = [i64, i64]
    library.lightllm_slot_attention_lanes.restype = ctypes.c_int
    library.lightllm_slot_attention_lanes.argtypes = []


def declare_prefill_attention(library: ctypes.CDLL) -> None:
    """Argument types of ``cpp_prefill_attention.cpp``'s entry points (also for a library of that source alone)."""
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.lightllm_prefill_attention_lanes.restype = ctypes.c_int
    library.lightllm_prefill_attention_lanes.argtypes = []
    library.lightllm_prefill_attention.restype = ctypes.c_int
    library.lightllm_prefill_attention.argtypes = [
        pointer, pointer, pointer, pointer, i64, i64, pointer, pointer, pointer, i64, i64, i64, i64,
        ctypes.c_int, ctypes.c_float, ctypes.c_int, pointer,
    ]


def load_kernel_library(compiler: str) -> ctypes.CDLL:
    """The kernel library, built with ``compiler`` if this machine has no cached build yet."""
    global _library
    with _lock:
        if _library is not None:
            return _library
        target = build_kernel(compiler)
        try:
            library = ctypes.CDLL(str(target))
        except OSError as exc:
            raise KernelBuildError(f"cannot load the built kernel {target}: {exc}") from exc
        declare_slot_attention(library)
        declare_prefill_attention(library)
        _library = library
        return library
