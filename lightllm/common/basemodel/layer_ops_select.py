"""Which layer ops an attention backend gets: the factory over the torch, Triton and C++ ops.

Separate from :mod:`.layer_ops` because the C++ ops subclass the torch ones: a factory in the base
module would import its own subclass.
"""

from __future__ import annotations

from lightllm.common.basemodel.layer_ops import TorchLayerOps, TritonLayerOps
from lightllm.common.basemodel.rotary import RotaryEmbedding


def build_layer_ops(kind: str, rotary: RotaryEmbedding) -> TorchLayerOps:
    """The layer ops an attention backend asks for: ``torch``, ``triton`` or ``cpp``."""
    if kind == "triton":
        return TritonLayerOps(rotary)
    if kind == "cpp":
        # Imported here: only the cpp backend loads the kernel library.
        from lightllm.common.basemodel.cpp_layer_ops import CppLayerOps

        return CppLayerOps(rotary)
    if kind != "torch":
        raise ValueError(f"unknown layer kernels {kind!r}; expected torch, triton or cpp")
    return TorchLayerOps(rotary)
