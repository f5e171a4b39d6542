"""The projection kernels: oneDNN's packed products equal torch's, and the backend choice is validated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightllm.common.basemodel.linear_kernels import (
    EXACT_ROWS_BELOW,
    LinearBackendError,
    OneDnnLinear,
    build_linear,
    onednn_problem,
    padded_row_count,
    resolve_linear_backend,
)

needs_onednn = pytest.mark.skipif(onednn_problem("cpu", torch.float32) is not None,
                                  reason="oneDNN does not run in this torch build")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 65, 300, 1030])
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


def test_row_counts_are_padded_to_a_bounded_set_of_sizes_with_little_waste() -> None:
    sizes = {padded_row_count(rows) for rows in range(1, 4097)}
    # A mixed step's row count changes nearly every step; oneDNN compiles (and caches, 1024
    # primitives at most) kernels per distinct count, so every count up to 4096 maps to few sizes.
    assert len(sizes) <= 64 + 6 * 32
    for rows in range(1, 8193):
        padded = padded_row_count(rows)
        assert padded >= rows
        if rows < EXACT_ROWS_BELOW:
            assert padded == rows  # decode batches: padding them costs more than it saves
        elif rows >= 128:
            assert padded - rows <= rows / 32
        assert padded_row_count(padded) == padded  # a padded size is its own size
    assert [padded_row_count(rows) for rows in (63, 64, 65, 1024, 1025, 1056, 2048, 2049)] == \
        [63, 64, 68, 1024, 1056, 1056, 2048, 2112]


@needs_onednn
def test_a_padded_product_returns_only_the_real_rows_as_a_contiguous_view() -> None:
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(48, 40, generator=gen), torch.randn(1030, 40, generator=gen)
    got = build_linear("onednn", weight)(x)
    assert got.shape == (1030, 48) and got.is_contiguous()
    # The first rows do not depend on whether the rest of the batch was padded.
    torch.testing.assert_close(got[:1024], build_linear("onednn", weight)(x[:1024]), atol=1e-5, rtol=1e-5)


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


@needs_onednn
def test_the_row_count_benchmark_reports_every_projection(tiny_llama_dir, capsys) -> None:
    from lightllm.benchmark.bench_linear_row_counts import main

    before = torch.get_num_threads()
    try:
        main(["--model_dir", str(tiny_llama_dir), "--rows", "70-72", "--threads", "1"])
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    for name in ("qkv", "o", "gate_up", "down"):
        assert f"{name} " in out
    assert out.count("padded to 1 size(s)") == 4  # 70-72 rows all run at 72


def test_the_row_count_benchmark_refuses_bad_rows_in_one_line(tiny_llama_dir, capsys) -> None:
    from lightllm.benchmark.bench_linear_row_counts import main

    for rows, why in (("x-3", "--rows: expected integers"), ("0-4", "--rows must name distinct row counts >= 1"),
                      ("5,5", "--rows: names 5 twice")):
        with pytest.raises(SystemExit) as exit_info:
            main(["--model_dir", str(tiny_llama_dir), "--rows", rows])
        assert exit_info.value.code == 2
        assert why in capsys.readouterr().err
