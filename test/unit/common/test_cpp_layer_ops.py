"""The fused C++ layer ops (``cpp_layer_ops``) against the torch path they replace.

The kernels alone (residual add + RMSNorm, rotary embedding incl. partial rotary and strided q/k
views, silu(gate) * up incl. extreme inputs) in float32 and bfloat16 with one and two threads,
their fallbacks, and the model on the cpp backend: every layer op in the kernel, logits against
the same model on torch layer ops and (bf16) against transformers, for Llama and Qwen2 (q/k/v
bias).  The fp32 comparison with transformers of the cpp backend, which now includes these ops,
is test_attention_cpp_kernel's ``test_backend_matches_transformers``.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from lightllm.common.basemodel import cpp_layer_ops
from lightllm.common.basemodel.attention.selection import build_attention_backend, cpp_compiler
from lightllm.common.basemodel.cpp_layer_ops import CppLayerOps
from lightllm.common.basemodel.model_config import RopeConfig
from lightllm.common.basemodel.rotary import RotaryEmbedding
from lightllm.common.basemodel.layer_ops import TorchLayerOps
from lightllm.models.registry import load_model

from attention_scenario_support import run_scenario

pytestmark = pytest.mark.skipif(cpp_compiler() is None, reason="no C++ compiler on PATH")

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def _rotary(head_dim: int, partial: float = 1.0) -> RotaryEmbedding:
    return RotaryEmbedding(RopeConfig(partial_rotary_factor=partial), head_dim, 512, torch.device("cpu"))


def _ops(head_dim: int = 32, partial: float = 1.0):
    rotary = _rotary(head_dim, partial)
    return CppLayerOps(rotary), TorchLayerOps(rotary)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request, monkeypatch) -> Iterator[int]:
    # Two threads even on small test shapes: the per-thread minimum is lowered for the test.
    before = torch.get_num_threads()
    monkeypatch.setattr(cpp_layer_ops, "MIN_ELEMENTS_PER_EXTRA_THREAD", 1)
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: within 1e-5 relative; bf16: the torch path's rounding (a rare last-bit flip at most)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * max(expected.abs().max().item(), 1.0))
        return
    g, e = got.float(), expected.float()
    ulp = e.abs() * 2.0 ** -7 + 1e-30
    assert bool(((g - e).abs() <= ulp).all()), f"bf16 differs by more than one ulp: {(g - e).abs().max().item()}"
    assert (g == e).float().mean().item() > 0.99


def _on_one_thread(call):
    """``call()`` run with one torch thread: a multi-threaded kernel must give the same bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return call()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,hidden", [(1, 256), (37, 200), (64, 33), (5, 1024)])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no_delta"])
def test_add_rms_norm_matches_the_torch_path(dtype, rows, hidden, with_delta, threads):
    ops, reference = _ops()
    gen = torch.Generator().manual_seed(rows * hidden)
    original = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=gen).to(dtype) if with_delta else None
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    expected_residual = original.clone()
    expected = reference.add_rms_norm(expected_residual, delta, weight, 1e-6)
    residual = original.clone()
    got = ops.add_rms_norm(residual, delta, weight, 1e-6)
    # The sum is rounded to the stream's dtype exactly as torch's add rounds it.
    assert torch.equal(residual, expected_residual)
    _assert_close(got, expected)
    if threads > 1:
        single = original.clone()
        assert torch.equal(_on_one_thread(lambda: ops.add_rms_norm(single, delta, weight, 1e-6)), got)
        assert torch.equal(single, residual)


def test_add_rms_norm_with_strided_rows_and_eps():
    ops, reference = _ops()
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 300, generator=gen)
    residual, delta = wide[:, :128], wide[:, 150:278]  # row stride 300, disjoint columns
    weight = torch.randn(128, generator=gen)
    expected_residual = residual.clone()
    expected = reference.add_rms_norm(expected_residual, delta.clone(), weight, 0.5)
    got = ops.add_rms_norm(residual, delta, weight, 0.5)
    assert torch.equal(residual, expected_residual)
    _assert_close(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim,partial", [(32, 1.0), (64, 1.0), (128, 1.0), (64, 0.5), (128, 0.25), (32, 0.75)])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_matches_the_torch_path_in_place(dtype, head_dim, partial, tokens, threads):
    ops, reference = _ops(head_dim, partial)
    gen = torch.Generator().manual_seed(head_dim + tokens)
    q_heads, kv_heads = 5, 3
    # q and k as the model passes them: views into one [T, (q + 2 kv) * D] projection output.
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    cos, sin = ops.rotary.cos_sin(positions, 499)
    untouched = qkv.clone()
    if threads > 1:
        single = qkv[:, : q_heads * head_dim].clone().view(tokens, q_heads, head_dim)
        single = _on_one_thread(lambda: ops.apply_rotary(single, cos, sin))
    for first, heads in ((0, q_heads), (q_heads, kv_heads)):
        x = qkv[:, first * head_dim : (first + heads) * head_dim].view(tokens, heads, head_dim)
        expected = reference.apply_rotary(x.clone(), cos, sin)
        got = ops.apply_rotary(x, cos, sin)
        assert got.data_ptr() == x.data_ptr()  # rotated in place
        _assert_close(got, expected)
        rot_dim = ops.rotary.rot_dim
        # Dims past rot_dim (partial rotary) keep their bits.
        assert torch.equal(got[..., rot_dim:], expected[..., rot_dim:])
    # V (after q and k) is never written.
    v_start = (q_heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], untouched[:, v_start:])
    if threads > 1:
        assert torch.equal(single, qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,width", [(1, 768), (37, 100), (16, 7)])
def test_silu_and_mul_matches_the_torch_path(dtype, rows, width, threads):
    ops, reference = _ops()
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
    expected = reference.silu_and_mul(gate_up.clone())
    single = gate_up.clone()
    got = ops.silu_and_mul(gate_up)
    assert got.data_ptr() == gate_up.data_ptr() and got.shape == (rows, width)  # over the gate half
    _assert_close(got, expected)
    if threads > 1:
        assert torch.equal(_on_one_thread(lambda: ops.silu_and_mul(single)), got)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_handles_extreme_inputs_like_torch(dtype):
    ops, reference = _ops()
    extremes = [-1e30, -1e4, -100.0, -88.5, -87.5, -20.0, -1e-3, -0.0, 0.0, 1e-3, 20.0, 88.5, 100.0, 1e4, 1e30]
    gate = torch.tensor(extremes + [float("inf"), float("-inf"), float("nan")])
    up = torch.linspace(0.5, 2.0, gate.numel())
    gate_up = torch.cat([gate, up])[None].to(dtype)
    expected = reference.silu_and_mul(gate_up.clone())
    got = ops.silu_and_mul(gate_up)
    finite = torch.isfinite(gate.to(dtype))
    assert not torch.isnan(got[0, finite]).any()
    torch.testing.assert_close(got, expected, rtol=1e-5 if dtype == torch.float32 else 2.0 ** -7, atol=1e-30,
                               equal_nan=True)


def test_silu_is_accurate_to_float_precision():
    # Against float64, over the range where silu is neither ~x nor ~0: a few float32 ulps at most.
    ops, _ = _ops()
    gate = torch.linspace(-40.0, 40.0, 200_001)
    got = ops.silu_and_mul(torch.cat([gate, torch.ones_like(gate)])[None])
    exact = torch.nn.functional.silu(gate.double())
    relative = ((got[0].double() - exact).abs() / exact.abs().clamp_min(1e-30)).max().item()
    assert relative < 1e-6, f"silu relative error {relative}"


def test_unsupported_inputs_run_on_the_torch_path():
    ops, reference = _ops()
    gen = torch.Generator().manual_seed(5)
    # float16 is not a kernel dtype.
    residual = torch.randn(4, 64, generator=gen).half()
    delta, weight = torch.randn(4, 64, generator=gen).half(), torch.randn(64, generator=gen).half()
    expected_residual = residual.clone()
    expected = reference.add_rms_norm(expected_residual, delta, weight, 1e-6)
    assert torch.equal(ops.add_rms_norm(residual, delta, weight, 1e-6), expected)
    assert torch.equal(residual, expected_residual)
    # delta aliasing the residual: the kernel would read values it has already overwritten.
    residual = torch.randn(4, 64, generator=gen)
    expected_residual = residual.clone()
    expected = reference.add_rms_norm(expected_residual, expected_residual, torch.ones(64), 1e-6)
    assert torch.equal(ops.add_rms_norm(residual, residual, torch.ones(64), 1e-6), expected)
    # A weight of another dtype than the activations.
    residual = torch.randn(4, 64, generator=gen)
    expected = reference.add_rms_norm(residual.clone(), None, torch.ones(64, dtype=torch.float64), 1e-6)
    assert torch.equal(ops.add_rms_norm(residual, None, torch.ones(64, dtype=torch.float64), 1e-6), expected)
    # A broadcast view cannot be rotated in place: the torch path returns a new tensor.
    cos, sin = ops.rotary.cos_sin(torch.arange(3), 2)
    shared = torch.randn(1, 1, 32, generator=gen).expand(3, 2, 32)
    got = ops.apply_rotary(shared, cos, sin)
    assert got.data_ptr() != shared.data_ptr() and torch.equal(got, reference.apply_rotary(shared, cos, sin))
    # Non-contiguous elements in the last dim.
    gate_up = torch.randn(8, 6, generator=gen)[:, ::2].clone().t()
    assert gate_up.stride(1) != 1
    expected = reference.silu_and_mul(gate_up.clone())
    assert torch.equal(ops.silu_and_mul(gate_up), expected)


def test_empty_batches():
    ops, _ = _ops()
    residual = torch.empty(0, 64)
    assert ops.add_rms_norm(residual, torch.empty(0, 64), torch.ones(64), 1e-6).shape == (0, 64)
    cos, sin = ops.rotary.cos_sin(torch.empty(0, dtype=torch.int64), 0)
    assert ops.apply_rotary(torch.empty(0, 2, 32), cos, sin).shape == (0, 2, 32)
    assert ops.silu_and_mul(torch.empty(0, 10)).shape == (0, 5)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def model_dir(request) -> str:
    return str(request.getfixturevalue(request.param))


def _logits_rows(model) -> list:
    rows, _ = run_scenario(model)
    return [logits for _, _, logits in rows]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_model_on_the_cpp_backend_runs_every_layer_op_in_the_kernels(model_dir, dtype, monkeypatch):
    backend = build_attention_backend("cpp")
    fused = load_model(model_dir, dtype=dtype, attention=backend)
    assert isinstance(fused.layer_ops, CppLayerOps)
    plain = load_model(model_dir, dtype=dtype, attention=build_attention_backend("cpp"))
    plain.layer_ops = TorchLayerOps(plain.rotary)
    expected = _logits_rows(plain)

    def no_fallback(*args, **kwargs):
        raise AssertionError("a layer op fell back to torch")

    # The kernels call the torch path only for inputs they do not take: none of the model's.
    for name in ("add_rms_norm", "apply_rotary", "silu_and_mul"):
        monkeypatch.setattr(TorchLayerOps, name, no_fallback)
    got = _logits_rows(fused)
    assert len(got) == len(expected) > 300
    scale = max(e.abs().max().item() for e in expected)
    worst = max((g - e).abs().max().item() for g, e in zip(got, expected))
    # Same attention on both sides: fp32 differs by summation order only; bf16 rounds at the
    # same places, so only rare last-bit flips carried through the layers remain.
    tolerance = 1e-5 if dtype == torch.float32 else 0.02
    assert worst < tolerance * max(scale, 1.0), f"largest logit difference {worst} (logit scale {scale})"


def test_model_on_the_cpp_backend_matches_transformers_bf16(model_dir):
    from transformers import AutoModelForCausalLM

    model = load_model(model_dir, dtype=torch.bfloat16, attention=build_attention_backend("cpp"))
    rows, final_tokens = run_scenario(model)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = {row: reference(torch.tensor([t])).logits[0].float() for row, t in final_tokens.items()}
    scale = max(e.abs().max().item() for e in expected.values())
    worst = max((logits - expected[seq][pos]).abs().max().item() for seq, pos, logits in rows)
    # bf16 on both sides, with different attention kernels: the tolerance of assert_matches_reference.
    assert worst < 0.05 * max(scale, 1.0), f"largest logit difference from transformers {worst} (scale {scale})"
