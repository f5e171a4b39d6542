"""bench_decode_attention times each backend as a server started with it runs: its attention and
the layer ops it chooses.  It swapped only ``model.attention``, so every backend ran on the layer
ops of the first one in ``--backends`` and the step time was neither backend's (outside pass)."""

from __future__ import annotations

import pytest
import torch

from lightllm.benchmark import bench_decode_attention
from lightllm.common.basemodel.attention.selection import build_attention_backend, cpp_compiler
from lightllm.models.registry import load_model


@pytest.mark.skipif(cpp_compiler() is None, reason="the cpp backend builds its kernel with a C++ compiler")
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_each_backend_steps_with_its_own_layer_ops(tiny_llama_dir, phase) -> None:
    backends = {name: build_attention_backend(name, strict=True) for name in ("torch", "cpp")}
    model = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=backends["torch"])
    own = (model.attention, model.layer_ops)
    seen = set()
    for name, backend in backends.items():
        def prepare(*args, name=name, original=backend.prepare, **kwargs):
            seen.add((name, type(model.layer_ops).__name__))
            return original(*args, **kwargs)

        backend.prepare = prepare
    measure = bench_decode_attention.measure_cell if phase == "decode" else bench_decode_attention.measure_prefill_cell
    cell = measure(model, backends, batch=2, context=20, steps=1, seed=0)
    assert seen == {("torch", "TorchLayerOps"), ("cpp", "CppLayerOps")}
    assert cell["torch_ms"] > 0 and cell["cpp_ms"] > 0 and cell["max_logit_diff"] < 1e-4
    assert (model.attention, model.layer_ops) == own  # the model is left as it was loaded
