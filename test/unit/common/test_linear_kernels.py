"""The projection kernels: oneDNN's packed products equal torch's, and the backend choice is validated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightllm.common.basemodel.linear_kernels import (
    LinearBackendError,
    OneDnnLinear,
    build_linear,
    onednn_problem,
    resolve_linear_backend,
)

needs_onednn = pytest.mark.skipif(onednn_problem("cpu", torch.float32) is not None,
                                  reason="oneDNN does not run in this torch build")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_products_equal_torch_at_every_batch_size(rows, with_bias) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 80, generator=gen)
    got = build_linear("onednn", weight, bias)(x)
    assert isinstance(build_linear("onednn", weight, bias), OneDnnLinear)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    # A non-contiguous input (a row selection of a wider tensor) gives the same product.
    wide = torch.randn(rows, 160, generator=gen)[:, ::2]
    torch.testing.assert_close(build_linear("onednn", weight, bias)(wide), F.linear(wide, weight, bias), atol=1e-4, rtol=1e-4)


@needs_onednn
def test_auto_takes_onednn_on_cpu_for_float32_and_torch_where_it_cannot_run() -> None:
    assert resolve_linear_backend("auto", "cpu", torch.float32) == "onednn"
    assert resolve_linear_backend("torch", "cpu", torch.float32) == "torch"
    assert resolve_linear_backend("auto", "cuda", torch.float32) == "torch"
    assert resolve_linear_backend("auto", "cpu", torch.float16) == "torch"


def test_an_explicit_onednn_that_cannot_run_is_refused_in_one_line() -> None:
    with pytest.raises(LinearBackendError, match="--linear_backend onednn cannot run here: oneDNN projections run on CPU only"):
        resolve_linear_backend("onednn", "cuda", torch.float32)
    with pytest.raises(LinearBackendError, match="float32 or bfloat16 weights, not float16"):
        resolve_linear_backend("onednn", "cpu", torch.float16)
    with pytest.raises(LinearBackendError, match="must be one of auto, torch, onednn"):
        resolve_linear_backend("mkl", "cpu", torch.float32)
    with pytest.raises(LinearBackendError, match="unknown linear backend 'auto'"):
        build_linear("auto", torch.zeros(2, 2))


def test_the_benchmark_runs_every_backend_and_compares_their_tokens(tiny_llama_dir, capsys) -> None:
    from lightllm.benchmark.bench_linear_backends import main

    before = torch.get_num_threads()
    try:
        main(["--model_dir", str(tiny_llama_dir), "--threads", "1", "--rows", "2", "--context", "8",
              "--prefill", "16", "--repeats", "1"])
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "torch   threads=1 decode 2 x 8:" in out
    if onednn_problem("cpu", torch.float32) is None:
        assert "onednn  threads=1 decode 2 x 8:" in out
        assert "greedy continuations identical across torch, onednn: True" in out
