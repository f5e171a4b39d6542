"""The C++ prefill-attention kernel (``cpp_prefill_attention.cpp``, long chunks of the cpp backend).

The kernel alone against the plain definition (masked SDPA per request over its slots) on ragged
batches: fresh prompts and chunks after a cached prefix, lengths on and off the kernel's tile and
block edges, scattered slots and a prefix shared by two requests, every supported head_dim,
group sizes 1-16, float32 and bfloat16 caches, one and two threads; also the eight-float kernel
of a -march=haswell build where the machine's own build has AVX-512.  In the model: a ragged batch
of long chunks after cached prefixes equals the gather + SDPA backend.
"""

from __future__ import annotations

import ctypes
from typing import List

import pytest
import torch
import torch.nn.functional as F

from lightllm.common.basemodel.attention import cpp_kernel_build
from lightllm.common.basemodel.attention.cpp_kernel_build import load_kernel_library
from lightllm.common.basemodel.attention.selection import build_attention_backend, cpp_compiler
from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.models.registry import load_model

from cpp_kernel_build_support import haswell_build
from attention_scenario_support import random_tokens

pytestmark = pytest.mark.skipif(cpp_compiler() is None, reason="no C++ compiler on PATH")


@pytest.fixture(scope="module")
def library() -> ctypes.CDLL:
    return load_kernel_library(cpp_compiler())


def _prefill_kernel(library, q, k, v, slots, new_lens, cached_lens, threads=1) -> torch.Tensor:
    tokens, kv_heads, group, head_dim = q.shape
    new = torch.tensor(new_lens, dtype=torch.int64)
    cached = torch.tensor(cached_lens, dtype=torch.int64)
    starts = torch.cumsum(new, 0) - new
    out = torch.full_like(q, float("nan"))
    code = library.lightllm_prefill_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), 0, slots.shape[1], starts.data_ptr(),
        new.data_ptr(), cached.data_ptr(), len(new_lens), kv_heads, group, head_dim,
        0 if k.dtype == torch.float32 else 1, head_dim ** -0.5, threads, out.data_ptr(),
    )
    assert code == 0
    return out


def _definition(q, k, v, slots, new_lens: List[int], cached_lens: List[int]) -> torch.Tensor:
    """Each new token attends to its request's positions up to its own, read through the slots."""
    out = torch.empty_like(q)
    first = 0
    for row, (new, cached) in enumerate(zip(new_lens, cached_lens)):
        context = slots[row, : cached + new]
        keys = k[context].float().transpose(0, 1)  # [kv_heads, ctx, D]
        values = v[context].float().transpose(0, 1)
        queries = q[first : first + new].flatten(1, 2).transpose(0, 1)  # [q_heads, new, D]
        visible = torch.arange(cached + new)[None, :] <= (cached + torch.arange(new))[:, None]
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, enable_gqa=True)
        out[first : first + new] = o.transpose(0, 1).view_as(out[first : first + new])
        first += new
    return out


SHAPES = [(16, 1), (32, 2), (64, 4), (80, 3), (96, 8), (128, 1), (256, 2), (64, 16), (32, 5)]  # head_dim, group


@pytest.mark.parametrize("head_dim,group", SHAPES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_the_definition(library, head_dim, group, kv_dtype):
    _check_against_the_definition(library, head_dim, group, kv_dtype)


def _check_against_the_definition(library, head_dim, group, kv_dtype):
    gen = torch.Generator().manual_seed(head_dim * 17 + group)
    kv_heads = 2
    # Fresh prompts and chunks after a cached prefix; lengths across the 128-key blocks (one of
    # 300 spans three, one of 5 starts at 260) and the query tiles (64 rows / group), a one-token
    # chunk, and one of 17 after 130 cached.
    new_lens = [130, 1, 64, 17, 33, 300, 5]
    cached_lens = [0, 40, 64, 130, 7, 0, 260]
    context = max(n + c for n, c in zip(new_lens, cached_lens))
    rows = len(new_lens) * context + 50
    k = torch.randn(rows, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v = torch.randn(rows, kv_heads, head_dim, generator=gen).to(kv_dtype)
    slots = torch.randperm(rows, generator=gen)[: len(new_lens) * context].view(-1, context).contiguous()
    slots[3, :100] = slots[0, :100]  # a shared prefix: two requests' rows name the same slots
    q = torch.randn(sum(new_lens), kv_heads, group, head_dim, generator=gen)
    expected = _definition(q, k, v, slots, new_lens, cached_lens)
    got = _prefill_kernel(library, q, k, v, slots, new_lens, cached_lens)
    assert (got - expected).abs().max().item() < 2e-5
    assert torch.equal(_prefill_kernel(library, q, k, v, slots, new_lens, cached_lens, threads=2), got)


@pytest.fixture(scope="module")
def eight_float_library(library) -> ctypes.CDLL:
    """The prefill kernel alone, built for AVX2 + FMA without AVX-512 (-march=haswell), where it runs
    on eight-float vectors in 6-row register blocks; cached like the server's build (2-3 s the
    first time on two cores)."""
    if library.lightllm_prefill_attention_lanes() == 8:
        pytest.skip("this machine's own build runs the eight-float kernel: test_kernel_matches_the_definition checks it")
    narrow = haswell_build("cpp_prefill_attention.cpp", cpp_kernel_build.declare_prefill_attention)
    assert narrow.lightllm_prefill_attention_lanes() == 8
    return narrow


@pytest.mark.parametrize("head_dim,group", SHAPES)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_eight_float_kernel_of_an_avx2_build_matches_the_definition(eight_float_library, head_dim, group,
                                                                        kv_dtype):
    """Without AVX-512 the kernel's register blocks are 6 rows x two eight-float vectors (blocks of
    sixteen-float ones spilled there and ran 19-29x slower than gather + SDPA); on an AVX-512
    machine only a -march=haswell build runs that code."""
    _check_against_the_definition(eight_float_library, head_dim, group, kv_dtype)


def test_kernel_refuses_arguments_it_cannot_serve(library):
    q = torch.zeros(4, 1, 1, 48)
    cache = torch.zeros(8, 1, 48)
    slots = torch.arange(4, dtype=torch.int64)[None]
    one, four, zero = (torch.tensor([n], dtype=torch.int64) for n in (1, 4, 0))

    def call(head_dim, group, new, cached, dtype=0):
        return library.lightllm_prefill_attention(
            q.data_ptr(), cache.data_ptr(), cache.data_ptr(), slots.data_ptr(), 0, 4, zero.data_ptr(), new.data_ptr(),
            cached.data_ptr(), 1, 1, group, head_dim, dtype, 1.0, 1, q.data_ptr(),
        )

    assert call(48, 1, four, zero) == 1  # no head_dim 48 variant
    assert call(32, 0, four, zero) == 2
    assert call(32, 1, four, zero, dtype=7) == 3
    assert call(32, 1, four, one) == 4  # 1 cached + 4 new positions do not fit a slot row of 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ragged_long_chunks_after_cached_prefixes_equal_sdpa(tiny_llama_dir, dtype):
    outputs = []
    for backend in (build_attention_backend("cpp"), TorchSdpaAttention()):
        model = load_model(str(tiny_llama_dir), dtype=dtype, attention=backend)
        gen = BatchGenerator(model, kv_cache_size=1024, max_request_num=4)
        vocab = model.config.vocab_size
        base = random_tokens(vocab, 150, seed=11)
        owner = gen.start(base)
        gen.forward([owner], [90])
        # A continuation of the owner, a request sharing 60 of its tokens at token level (its row
        # points at the owner's slots, as on a radix-cache hit) and a fresh prompt, in one batch.
        sharer = gen.start(base[:60] + random_tokens(vocab, 45, seed=12))
        gen.req_manager.set_slots(sharer.row, 0, gen.req_manager.slots(owner.row, 0, 60))
        sharer.cached_len = 60
        fresh = gen.start(random_tokens(vocab, 70, seed=13))
        logits = gen.forward([owner, sharer, fresh], [60, 45, 70], all_logits=True)
        outputs.append(logits.float())
    # As in attention_scenario_support: bf16 rounds K/V and activations between layers on both
    # sides, so its tolerance is relative to the logit scale.
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    scale = outputs[1].abs().max().item()
    assert (outputs[0] - outputs[1]).abs().max().item() < tolerance * max(scale, 1.0)


def test_prefill_benchmark_times_both_backends_on_the_same_prompts(tiny_llama_dir, tmp_path):
    import json

    from lightllm.benchmark.bench_decode_attention import main

    out = tmp_path / "bench.json"
    argv = ["--model_dir", str(tiny_llama_dir), "--phase", "prefill", "--batches", "2", "--contexts", "40",
            "--steps", "1", "--clock", "cpu", "--backends", "torch,cpp", "--json", str(out)]
    assert main(argv) == 0
    (cell,) = json.loads(out.read_text())["results"]
    assert cell["torch_ms"] > 0 and cell["cpp_ms"] > 0
    # 40-token chunks: the cpp backend's prefill kernel served them and agrees with SDPA.
    assert cell["max_logit_diff"] < 1e-4
