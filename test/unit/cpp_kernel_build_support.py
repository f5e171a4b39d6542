"""Builds of one C++ kernel source for another instruction set than this machine's, for tests.

The server builds its kernels with ``-march=native``, so a test machine with AVX-512 never runs
the code an AVX2-only machine gets; a ``-march=haswell`` build of the same source (AVX2 + FMA, no
AVX-512) runs it here.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, Set

import pytest

from lightllm.common.basemodel.attention import cpp_kernel_build
from lightllm.common.basemodel.attention.cpp_kernel_build import KernelBuildError
from lightllm.common.basemodel.attention.selection import cpp_compiler


def cpu_flags() -> Set[str]:
    """This CPU's feature flags (/proc/cpuinfo); empty where there is no such file."""
    if not os.path.exists("/proc/cpuinfo"):
        return set()
    with open("/proc/cpuinfo") as info:
        return {flag for line in info if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def haswell_build(source_name: str, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL:
    """The kernel source ``source_name`` alone, built for -march=haswell and loaded, its entry points
    declared by ``declare``; cached like the server's build.  Skips the test where the CPU lacks
    AVX2 or FMA or the compiler cannot build for that target."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("needs an x86 CPU with AVX2 and FMA to run a -march=haswell build")
    source = next(path for path in cpp_kernel_build.SOURCES if path.name == source_name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpp_kernel_build, "SOURCES", (source,))
        patch.setattr(cpp_kernel_build, "FLAGS", ["-march=haswell" if flag == "-march=native" else flag
                                                  for flag in cpp_kernel_build.FLAGS])
        try:
            path = cpp_kernel_build.build_kernel(cpp_compiler())
        except KernelBuildError as exc:
            pytest.skip(f"the compiler cannot build for -march=haswell: {exc}")
    library = ctypes.CDLL(str(path))
    declare(library)
    return library
