"""Every Triton kernel against its torch reference (CPU: under TRITON_INTERPRET=1, see conftest).

Shapes are small because the interpreter runs each program in Python; they are chosen to hit the
boundaries: a context of one token, lengths that are not multiples of the block size, a length
that is one, GQA ratios 1/4/8, head dims 64 and 128, float32/float16/bfloat16.  The large-shape
variants at the end need a GPU and are skipped without one.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

from lightllm.common.basemodel.model_config import RopeConfig
from lightllm.common.basemodel.rotary import RotaryEmbedding
from lightllm.common.basemodel.triton_kernel import (
    context_attention as ctx_mod,
    decode_attention as dec_mod,
    kv_copy,
    rms_norm,
    rotary_embedding,
)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="large shapes run only on a GPU")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (head_dim, q_heads, kv_heads): GQA ratios 1, 4 and 8 over both common head dims.
HEAD_SHAPES = [(64, 2, 2), (64, 8, 2), (128, 8, 1)]


def _tolerance(dtype: torch.dtype) -> dict:
    # The interpreter rounds float32 -> bfloat16 by truncation, so bfloat16 may differ by one ulp.
    return {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}.get(
        dtype, dict(atol=2e-2, rtol=2e-2)
    )


def _scattered_cache(
    lengths: List[int], kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, seed: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A KV cache with each request's tokens at random, non-contiguous slots, and rows out of order."""
    gen = torch.Generator().manual_seed(seed)
    slots_total = sum(lengths) + 13  # spare slots hold garbage that must never be read
    k_cache = (torch.randn(slots_total, kv_heads, head_dim, generator=gen) * 2).to(dtype).to(device)
    v_cache = torch.randn(slots_total, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    perm = torch.randperm(slots_total, generator=gen)
    rows = torch.randperm(len(lengths) + 2, generator=gen)[: len(lengths)]
    req_to_token = torch.full((len(lengths) + 2, max(lengths) + 5), slots_total - 1, dtype=torch.int64)
    first = 0
    for row, length in zip(rows.tolist(), lengths):
        req_to_token[row, :length] = perm[first : first + length]
        first += length
    return k_cache, v_cache, req_to_token.to(device), rows.to(device)


def _strided_q(tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Queries viewed out of a wider fused-projection output, as the model hands them over."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, heads * head_dim + 24, generator=gen).to(dtype).to(device)
    return fused[:, : heads * head_dim].view(tokens, heads, head_dim)


def test_kernels_use_the_interpreter_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (
        dec_mod._decode_attention_kernel,
        ctx_mod._context_attention_kernel,
        kv_copy._copy_slot_rows_kernel,
        rms_norm._add_rms_norm_kernel,
        rotary_embedding._rotary_kernel,
    ):
        assert isinstance(kernel, InterpretedFunction), "a kernel module was imported before TRITON_INTERPRET was set"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEAD_SHAPES)
def test_decode_attention_matches_reference(device, dtype, head_dim, q_heads, kv_heads):
    lengths = [1, 37, 32, 70]  # block_n=32: one token, ragged, exactly one block, several blocks
    k_cache, v_cache, req_to_token, rows = _scattered_cache(lengths, kv_heads, head_dim, dtype, device, seed=head_dim + q_heads)
    q = _strided_q(len(lengths), q_heads, head_dim, dtype, device, seed=1)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    got = dec_mod.decode_attention(q, k_cache, v_cache, req_to_token, rows, seq_lens, block_n=32)
    expected = dec_mod.decode_attention_reference(q, k_cache, v_cache, req_to_token, rows, seq_lens)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected.float(), **_tolerance(dtype))


def _ragged_prefill(
    chunks: List[Tuple[int, int]], q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
):
    """Inputs of one ragged prefill: ``chunks`` are (cached length, new length) per request."""
    lengths = [start + new for start, new in chunks]
    k_cache, v_cache, req_to_token, rows = _scattered_cache(lengths, kv_heads, head_dim, dtype, device, seed=7 + head_dim)
    new_lens = [new for _, new in chunks]
    q_starts = [sum(new_lens[:i]) for i in range(len(chunks))]
    q = _strided_q(sum(new_lens), q_heads, head_dim, dtype, device, seed=2)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return q, k_cache, v_cache, req_to_token, rows, ints([s for s, _ in chunks]), ints(new_lens), ints(q_starts), max(new_lens)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", HEAD_SHAPES)
def test_context_attention_matches_reference(device, dtype, head_dim, q_heads, kv_heads):
    # Fresh prompts of 1 and 37 tokens, a prefix hit (20 cached + 17 new), one new token after a
    # cached prefix, and a chunk continuation whose cache ends exactly on a block boundary.
    chunks = [(0, 1), (0, 37), (20, 17), (45, 1), (32, 19)]
    inputs = _ragged_prefill(chunks, q_heads, kv_heads, head_dim, dtype, device)
    q, k_cache, v_cache, r2t, rows, starts, news, q_starts, max_new = inputs
    got = ctx_mod.context_attention(q, k_cache, v_cache, r2t, rows, starts, news, q_starts, max_new, block_m=32, block_n=32)
    expected = ctx_mod.context_attention_reference(q, k_cache, v_cache, r2t, rows, starts, news, q_starts)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), expected.float(), **_tolerance(dtype))


def test_context_attention_without_cache_is_plain_causal_attention(device):
    # Independent check of the reference itself: one fresh prompt equals SDPA with is_causal.
    q, k_cache, v_cache, r2t, rows, starts, news, q_starts, max_new = _ragged_prefill([(0, 23)], 4, 2, 64, torch.float32, device)
    got = ctx_mod.context_attention(q, k_cache, v_cache, r2t, rows, starts, news, q_starts, max_new, block_m=32, block_n=32)
    slots = r2t[int(rows[0]), :23]
    k = k_cache[slots].repeat_interleave(2, dim=1).transpose(0, 1)
    v = v_cache[slots].repeat_interleave(2, dim=1).transpose(0, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True).transpose(0, 1)
    torch.testing.assert_close(got, sdpa, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (3, 40)])
def test_kv_pack_and_unpack_match_reference(device, dtype, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(3)
    layers, size = 3, 40
    source = (torch.randn(layers, size, kv_heads, head_dim, generator=gen) * 50).to(dtype).to(device)
    slots = torch.tensor([5, 0, 39, 17, 18, 2, 33], device=device)
    # block=64 splits each token row (128 or 120 values) into pieces, the last one partial.
    packed = kv_copy.pack_kv_slots(source, slots, block=64)
    assert torch.equal(packed, kv_copy.pack_kv_slots_reference(source, slots))
    target_slots = torch.tensor([1, 30, 2, 3, 12, 38, 20], device=device)
    target = torch.zeros_like(source)
    expected = torch.zeros_like(source)
    kv_copy.unpack_kv_slots(packed, target, target_slots, block=64)
    kv_copy.unpack_kv_slots_reference(packed, expected, target_slots)
    assert torch.equal(target, expected)  # reserved slots filled, every other slot untouched
    assert torch.equal(target[:, target_slots], source[:, slots])


def test_kv_unpack_refuses_mismatched_shapes(device):
    buffer = torch.zeros(2, 8, 2, 16, device=device)
    with pytest.raises(ValueError, match="does not fit"):
        kv_copy.unpack_kv_slots(torch.zeros(2, 3, 2, 8, device=device), buffer, torch.arange(3, device=device))
    with pytest.raises(ValueError, match="3 tokens but 2 slots"):
        kv_copy.unpack_kv_slots(torch.zeros(2, 3, 2, 16, device=device), buffer, torch.arange(2, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_reference(device, dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=gen).to(dtype).to(device)
    residual = (torch.randn(5, hidden, generator=gen) * 3).to(dtype).to(device)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    res_kernel = residual.clone() if with_residual else None
    res_ref = residual.clone() if with_residual else None
    got = rms_norm.add_rms_norm(x, res_kernel, weight, 1e-6)
    expected = rms_norm.add_rms_norm_reference(x, res_ref, weight, 1e-6)
    tol = _tolerance(dtype)
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    if with_residual:
        torch.testing.assert_close(res_kernel.float(), (residual.float() + x.float()), **tol)
    # The reference agrees with torch's own RMSNorm.
    base = (residual.float() + x.float()) if with_residual else x.float()
    torch.testing.assert_close(
        expected.float(), torch.nn.functional.rms_norm(base, (hidden,), weight.float(), 1e-6), **tol
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,partial", [(64, 1.0), (128, 1.0), (64, 0.5)])
def test_rotary_in_place_matches_model_rotary(device, dtype, head_dim, partial):
    rope = RopeConfig(theta=10000.0, partial_rotary_factor=partial)
    rotary = RotaryEmbedding(rope, head_dim, 256, device)
    positions = torch.tensor([0, 1, 7, 100, 255], device=device)
    cos, sin = rotary.cos_sin(positions, 255)
    x = _strided_q(5, 3, head_dim, dtype, device, seed=4)  # 3 heads: not a power of two
    before = x.clone()
    expected_model = rotary.apply(before, cos, sin)
    expected_ref = rotary_embedding.apply_rotary_reference(before, cos, sin)
    out = rotary_embedding.apply_rotary_(x, cos, sin)
    assert out.data_ptr() == x.data_ptr()  # in place, through the strided view
    tol = _tolerance(dtype)
    torch.testing.assert_close(x.float(), expected_ref.float(), **tol)
    torch.testing.assert_close(x.float(), expected_model.float(), **tol)
    torch.testing.assert_close(x[..., int(head_dim * partial) :], before[..., int(head_dim * partial) :], atol=0, rtol=0)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_attention_large_shapes_gpu(device, dtype):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4097, (64,), generator=gen).tolist()
    k_cache, v_cache, r2t, rows = _scattered_cache(lengths, 8, 128, dtype, device, seed=5)
    q = _strided_q(64, 64, 128, dtype, device, seed=6)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    got = dec_mod.decode_attention(q, k_cache, v_cache, r2t, rows, seq_lens)
    expected = dec_mod.decode_attention_reference(q, k_cache, v_cache, r2t, rows, seq_lens)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_context_attention_large_shapes_gpu(device, dtype):
    chunks = [(0, 2048), (1000, 777), (4000, 1), (513, 1500)]
    q, k_cache, v_cache, r2t, rows, starts, news, q_starts, max_new = _ragged_prefill(chunks, 32, 8, 128, dtype, device)
    got = ctx_mod.context_attention(q, k_cache, v_cache, r2t, rows, starts, news, q_starts, max_new)
    expected = ctx_mod.context_attention_reference(q, k_cache, v_cache, r2t, rows, starts, news, q_starts)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
