"""A request's attention never reads KV slots outside its own context.

A request row's entries past its length still name the slots of the row's earlier occupants,
freed or reused since.  Batched with a longer request, a short one's decode gathered them as
padding; masked attention weighs them 0, but 0 x inf is NaN, so an overflowed value left there by
another request (fp16 activations past 65504) made the short request's output NaN, only when it
was batched with a longer one.  Driven through the real model forward and KV cache.
"""

from __future__ import annotations

import pytest
import torch

from lightllm.common.basemodel.attention.selection import build_attention_backend, cpp_compiler
from lightllm.common.basemodel.attention.torch_compiled import TorchCompiledAttention
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.models.registry import load_model

BACKENDS = ["torch", "torch_compiled"] + (["cpp"] if cpp_compiler() is not None else [])


def _attention(backend: str):
    if backend == "torch_compiled":
        return TorchCompiledAttention(min_fused_context=0, min_fused_requests=1)
    return build_attention_backend(backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_finite_value_in_a_freed_slot_does_not_reach_a_batched_decode(tiny_llama_dir, backend: str) -> None:
    model = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=_attention(backend))
    gen = BatchGenerator(model, kv_cache_size=512, max_request_num=4)
    earlier = gen.start(list(range(5, 45)))
    gen.forward([earlier], [40])
    longer = gen.start(list(range(100, 130)))
    gen.forward([longer], [29])
    row = earlier.row
    gen.release(earlier)  # its row and slots are free; the row's entries still name the slots
    short = gen.start([7, 8, 9, 10, 11])
    assert short.row == row
    gen.forward([short], [4])
    owned = set(torch.cat(short.slots + longer.slots).tolist())
    stale = [s for s in gen.req_manager.req_to_token[row, short.cached_len + 1 : 30].tolist() if s not in owned]
    assert stale
    gen.kv_cache.v_buffer[:, stale] = float("inf")  # what an overflow leaves behind
    logits = gen.forward([short, longer], [1, 1])
    assert torch.isfinite(logits).all()
