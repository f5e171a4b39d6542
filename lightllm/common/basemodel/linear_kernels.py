"""Which kernel computes the model's projections: ``--linear_backend auto|torch|onednn``.

Nearly all of a decoder's FLOPs are its projections (q/k/v, o, gate/up, down, the LM head). On
CPU, ``torch.nn.functional.linear`` runs them through MKL's sgemm on the weights as stored.
oneDNN (bundled with every x86 CPU build of torch as ``torch.ops.mkldnn``) can repack a weight once
into the blocked layout its AVX-512/AVX2 micro-kernels read, and then runs the same product
2-4x faster at decode batch sizes, 2x at prefill sizes (measured on the development VM, fp32,
one and two threads: docs/EN/results.md, "Projections on oneDNN"). vLLM's CPU build does the same.

The packed weight replaces the dense one (the model does not keep both). Results differ from
MKL's in the last bits of fp32 (a different summation order), as two BLAS libraries do.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from lightllm.common.basemodel.linear_backend_fit import onednn_refusal, onednn_setting_problem

LINEAR_BACKENDS: List[str] = ["auto", "torch", "onednn"]

# The batch size oneDNN tunes the packed layout for; measured on the development VM, a layout
# packed for 64 rows ran within 10% of the best layout at 16 to 2048 rows.
PACKING_BATCH_HINT = 64

# oneDNN compiles a kernel set for every distinct row count it is given and keeps it in its
# primitive cache (1024 entries, least recently used out). On the development VM a new row count
# cost 1-35 ms more than a cached one per weight shape (the medium demo model's MLP up
# projection: 27-52 ms against 17-19 ms at ~1000 rows) and kept ~0.6 MiB resident, and a step that
# mixes a prompt chunk with decode rows has a new row count almost every time (docs/EN/results.md,
# "Row counts oneDNN compiles for"). From EXACT_ROWS_BELOW up, rows are therefore padded with zero
# rows to one of ROW_SIZES_PER_OCTAVE sizes per power of two (at most 1/32 more rows from 128 up),
# which bounds the kernels a server ever compiles. Fewer rows stay exact: they are decode batches
# with few distinct counts, and padding them is dear (one row padded to eight cost 50% more on the
# medium model's weights, one thread).
EXACT_ROWS_BELOW = 64
ROW_SIZES_PER_OCTAVE = 32
MIN_ROW_STEP = 4

LinearKernel = Callable[[torch.Tensor], torch.Tensor]


class LinearBackendError(ValueError):
    """The requested linear backend cannot run here (message fits one line)."""


class TorchLinear:
    """``x @ weight.T + bias`` with torch's own kernel (MKL on CPU, cuBLAS on CUDA)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def padded_row_count(rows: int) -> int:
    """The row count a product of ``rows`` rows runs at on oneDNN (see EXACT_ROWS_BELOW)."""
    if rows < EXACT_ROWS_BELOW:
        return rows
    step = max(MIN_ROW_STEP, (1 << (rows.bit_length() - 1)) // ROW_SIZES_PER_OCTAVE)
    return -(-rows // step) * step


class OneDnnLinear:
    """The same product with the weight packed once into oneDNN's blocked layout (CPU).

    Inputs are 2-D ``[rows, in_features]``; their rows are padded with zeros to
    :func:`padded_row_count` and the padding rows' outputs dropped (a row-range view).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_size=PACKING_BATCH_HINT)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 0:  # oneDNN refuses empty batches
            return x.new_empty((0, self.out_features))
        padded_rows = padded_row_count(rows)
        if padded_rows == rows:
            return self.unpadded(x)
        padded = x.new_empty((padded_rows, x.shape[1]))
        padded[:rows].copy_(x)
        padded[rows:].zero_()  # finite rows: their outputs are dropped, but garbage could be slow denormals
        return self.unpadded(padded)[:rows]

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """The product at exactly ``x``'s row count (at least one row): a new count compiles kernels."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def onednn_problem(device: str, dtype: torch.dtype) -> Optional[str]:
    """Why oneDNN projections cannot run for ``device`` and ``dtype`` (one line), or None when they can.

    Beyond the build's flags, a small product is packed, run and compared with torch's, so a
    build whose oneDNN ops are missing or broken is caught at start-up, not at the first request.
    """
    setting = onednn_setting_problem(device, str(dtype).replace("torch.", ""))
    if setting is not None:
        return setting
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bfloat16 support in oneDNN"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator).to(dtype)
    x = torch.randn(5, 32, generator=generator).to(dtype)
    try:
        got = OneDnnLinear(weight, None)(x)
    except (RuntimeError, AttributeError) as exc:
        return f"oneDNN linear failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if not torch.allclose(got.float(), F.linear(x, weight).float(), atol=tolerance, rtol=tolerance):
        return "oneDNN linear disagrees with torch's on a test product"
    return None


def resolve_linear_backend(requested: str, device: str, dtype: torch.dtype) -> str:
    """The concrete backend (``torch`` or ``onednn``) for ``requested`` on ``device`` in ``dtype``.

    ``auto`` takes oneDNN on CPU when it runs for the dtype, torch otherwise (CUDA, half
    precision on CPU, a build without oneDNN). An explicit ``onednn`` that cannot run is refused.
    Called by each model rank as it starts, where torch is loaded anyway (the launcher imports no
    torch); the rank reports a :class:`LinearBackendError` to the launcher, which prints it in
    one line and exits 2.
    """
    if requested not in LINEAR_BACKENDS:
        raise LinearBackendError(f"--linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {requested!r}")
    if requested == "torch":
        return "torch"
    problem = onednn_problem(device, dtype)
    if requested == "onednn" and problem is not None:
        raise LinearBackendError(onednn_refusal(problem))
    return "torch" if problem is not None else "onednn"


def build_linear(backend: str, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> LinearKernel:
    """A projection by ``weight`` (``[out, in]``) and ``bias`` with a resolved ``backend``."""
    if backend == "torch":
        return TorchLinear(weight, bias)
    if backend == "onednn":
        return OneDnnLinear(weight, bias)
    raise LinearBackendError(f"unknown linear backend {backend!r} (resolve it first: torch or onednn)")
