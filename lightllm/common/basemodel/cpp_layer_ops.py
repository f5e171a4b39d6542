"""The fused C++ layer ops (``cpp_layer_ops.cpp``) behind the torch layer-ops interface.

Used when the attention backend is ``cpp``: the residual add + RMSNorm, rotary embedding of q
and k, and SwiGLU each run as one pass over their rows instead of several torch ops with their
temporaries.  Anything the kernels do not take (other dtypes or devices, overlapping or
non-contiguous rows, tensors that need autograd) runs on :class:`TorchLayerOps` instead, so a
call is never silently wrong.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from lightllm.common.basemodel.layer_ops import TorchLayerOps
from lightllm.common.basemodel.rotary import RotaryEmbedding

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

# Below this many elements a call runs on one thread: starting the OpenMP team costs more than
# the pass over the data (a decode step's rows are a few hundred kilobytes).
MIN_ELEMENTS_PER_EXTRA_THREAD = 1 << 16


def _declare_entry_points(library: ctypes.CDLL) -> None:
    # ctypes converts Python ints and floats by these declarations; without them a float would
    # be passed as a double and 64-bit ints could be truncated.
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.lightllm_add_rms_norm.restype = i32
    library.lightllm_add_rms_norm.argtypes = [
        pointer, pointer, pointer, pointer, i64, i64, i64, i64, i64, ctypes.c_float, i32, i32,
    ]
    library.lightllm_rotary_embedding.restype = i32
    library.lightllm_rotary_embedding.argtypes = [
        pointer, pointer, pointer, i64, i64, i64, i64, i64, i64, i64, i32, i32,
    ]
    library.lightllm_silu_and_mul.restype = i32
    library.lightllm_silu_and_mul.argtypes = [pointer, pointer, i64, i64, i64, i64, i32, i32]


def _threads(elements: int) -> int:
    return max(1, min(torch.get_num_threads(), elements // MIN_ELEMENTS_PER_EXTRA_THREAD))


def _kernel_takes(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """Whether every tensor is a CPU tensor of ``dtype`` (a supported one) that autograd does not track."""
    if dtype not in _DTYPE_CODES:
        return False
    tracking = torch.is_grad_enabled()
    for tensor in tensors:
        if not tensor.is_cpu or tensor.dtype != dtype or (tracking and tensor.requires_grad):
            return False
    return True


def _check(code: int, name: str) -> None:
    if code != 0:
        # The wrapper checks every argument first, so this is a bug, not a user error.
        raise RuntimeError(f"C++ layer op {name} refused its arguments (code {code})")


class CppLayerOps(TorchLayerOps):
    """Residual add + RMSNorm, rotary embedding and SwiGLU through the C++ kernels (CPU, fp32/bf16).

    Results equal the torch path's within float32 rounding; in bfloat16 they round where the torch
    path rounds (see ``cpp_layer_ops.cpp``).  Each call uses up to ``torch.get_num_threads()``
    threads over rows.
    """

    def __init__(self, rotary: RotaryEmbedding, library: Optional[ctypes.CDLL] = None) -> None:
        """Use ``library`` (the built kernel library), or load it: the cpp backend has built it already."""
        super().__init__(rotary)
        if library is None:
            # Imported here so that importing this module never builds anything.
            from lightllm.common.basemodel.attention.cpp_kernel_build import load_kernel_library
            from lightllm.common.basemodel.attention.selection import cpp_compiler

            compiler = cpp_compiler()
            if compiler is None:
                raise RuntimeError("the C++ layer ops need a C++ compiler (g++, c++, clang++ or $CXX)")
            library = load_kernel_library(compiler)
        _declare_entry_points(library)
        self._library = library

    def add_rms_norm(
        self, residual: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += delta`` in place (when given), then ``weight * RMSNorm(residual)`` as a new tensor.

        ``residual`` and ``delta`` are ``[T, hidden]`` with contiguous rows, ``weight`` ``[hidden]``.
        """
        if not self._norm_takes(residual, delta, weight):
            return super().add_rms_norm(residual, delta, weight, eps)
        rows, hidden = residual.shape
        out = torch.empty(rows, hidden, dtype=residual.dtype)
        if rows == 0:
            return out
        code = self._library.lightllm_add_rms_norm(
            residual.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
            rows, hidden, residual.stride(0), 0 if delta is None else delta.stride(0), hidden, eps,
            _DTYPE_CODES[residual.dtype], _threads(rows * hidden),
        )
        _check(code, "add_rms_norm")
        return out

    @staticmethod
    def _norm_takes(residual: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor) -> bool:
        if residual.dim() != 2:
            return False
        rows, hidden = residual.shape
        row_stride, element_stride = residual.stride()
        # The row stride must keep rows apart, or writing the sum back would change other rows.
        if element_stride != 1 or hidden == 0 or (rows > 1 and row_stride < hidden):
            return False
        if weight.shape != (hidden,) or weight.stride(0) != 1:
            return False
        if delta is None:
            return _kernel_takes(residual.dtype, residual, weight)
        if delta.shape != residual.shape or delta.stride(1) != 1:
            return False
        if not _kernel_takes(residual.dtype, residual, weight, delta):
            return False
        # The kernel reads delta while it writes residual: their memory must not overlap.
        size = residual.element_size()
        residual_start, delta_start = residual.data_ptr(), delta.data_ptr()
        residual_end = residual_start + ((rows - 1) * row_stride + hidden) * size
        delta_end = delta_start + ((rows - 1) * delta.stride(0) + hidden) * size
        return rows == 0 or residual_end <= delta_start or delta_end <= residual_start

    def apply_rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` ``[T, heads, head_dim]`` in place and returns it (a new tensor on the torch fallback).

        ``cos``/``sin`` are the ``[T, rot_dim]`` float32 rows of :meth:`RotaryEmbedding.cos_sin`;
        only the first ``rot_dim`` dims of each head rotate (partial rotary).
        """
        if not self._rotary_takes(x, cos, sin):
            return super().apply_rotary(x, cos, sin)
        tokens, heads, _ = x.shape
        if tokens == 0 or heads == 0:
            return x
        rot_dim = cos.shape[1]
        code = self._library.lightllm_rotary_embedding(
            x.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, rot_dim, x.stride(0), x.stride(1),
            cos.stride(0), sin.stride(0), _DTYPE_CODES[x.dtype], _threads(tokens * heads * rot_dim),
        )
        _check(code, "apply_rotary")
        return x

    def _rotary_takes(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        if x.dim() != 3 or cos.dim() != 2 or not _kernel_takes(x.dtype, x):
            return False
        tokens, heads, head_dim = x.shape
        rot_dim = self.rotary.rot_dim
        for table in (cos, sin):
            if table.dtype != torch.float32 or not table.is_cpu or table.stride(1) != 1:
                return False
            if table.shape != (tokens, rot_dim):
                return False
        if rot_dim <= 0 or rot_dim % 2 or rot_dim > head_dim or x.stride(2) != 1:
            return False
        # In place is only right when every (token, head) has its own memory (no broadcast views).
        token_stride, head_stride, _ = x.stride()
        heads_apart = heads == 1 or head_stride >= head_dim
        tokens_apart = tokens == 1 or token_stride >= (heads - 1) * head_stride + head_dim
        return heads_apart and tokens_apart

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up`` = ``[gate | up]``, written over the gate half, returned as a view."""
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not _kernel_takes(gate_up.dtype, gate_up):
            return super().silu_and_mul(gate_up)
        rows, double_width = gate_up.shape
        width = double_width // 2
        if gate_up.stride(1) != 1 or (rows > 1 and gate_up.stride(0) < double_width):
            return super().silu_and_mul(gate_up)
        act = gate_up[:, :width]
        if rows == 0 or width == 0:
            return act
        code = self._library.lightllm_silu_and_mul(
            gate_up.data_ptr(), act.data_ptr(), rows, width, gate_up.stride(0), gate_up.stride(0),
            _DTYPE_CODES[gate_up.dtype], _threads(rows * width),
        )
        _check(code, "silu_and_mul")
        return act

