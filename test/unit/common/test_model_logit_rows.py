"""The last layer runs its output projection and MLP only on the rows that get logits.

A prefill that asks for each request's last token (or for a few prompt positions through
``logit_index``) must give exactly those rows of a forward that computes every row: the saved
work may not change a number.  Ragged prefill batches after cached prefixes, Llama and Qwen2,
the torch and the cpp layer ops.
"""

from __future__ import annotations

import pytest
import torch

from lightllm.common.basemodel.attention.selection import build_attention_backend, cpp_compiler
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.models.registry import load_model

from attention_scenario_support import random_tokens

BACKENDS = ["torch", "cpp"] if cpp_compiler() is not None else ["torch"]


def _prefill(model, all_logits: bool, logit_index=None) -> torch.Tensor:
    gen = BatchGenerator(model, kv_cache_size=512, max_request_num=4)
    vocab = model.config.vocab_size
    first = gen.start(random_tokens(vocab, 60, seed=1))
    gen.forward([first], [25])  # a cached prefix of 25 tokens
    second = gen.start(random_tokens(vocab, 33, seed=2))
    seqs, new_lens = [first, second], [35, 33]
    chunks = [s.token_ids[s.cached_len : s.cached_len + n] for s, n in zip(seqs, new_lens)]
    slots = gen.kv_cache.alloc(sum(new_lens))
    gen.req_manager.set_slots(first.row, first.cached_len, slots[:35])
    gen.req_manager.set_slots(second.row, second.cached_len, slots[35:])
    batch = ForwardBatch.build(chunks, [s.cached_len for s in seqs], [s.row for s in seqs], slots, model.device, all_logits)
    if logit_index is not None:
        batch.logit_index = logit_index
    return model.forward(batch, gen.kv_cache, gen.req_manager.req_to_token)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_logit_rows_equal_the_rows_of_a_full_forward(request, arch_dir, backend):
    model = load_model(str(request.getfixturevalue(arch_dir)), dtype=torch.float32, attention=build_attention_backend(backend))
    every_row = _prefill(model, all_logits=True)
    assert every_row.shape[0] == 68
    last_rows = _prefill(model, all_logits=False)
    assert torch.allclose(last_rows, every_row[[34, 67]], atol=1e-5, rtol=1e-5)
    chosen = torch.tensor([0, 10, 34, 40, 67])
    assert torch.allclose(_prefill(model, all_logits=False, logit_index=chosen), every_row[chosen], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_as_many_logit_rows_as_tokens_are_still_the_rows_asked_for(tiny_llama_dir, backend):
    """A forward whose ``logit_index`` had exactly one entry per token took it for a decode and
    returned every row in order: a batch of a prompt-logprob chunk (its last position listed twice,
    as a prompt row and as the row it samples from) beside a chunk after a cached prefix (one row
    for several tokens) can have that many, and then a whole chunk's logits were handed to the
    wrong positions (an outside tester's concurrent echo/prompt_logprobs requests with a shared
    prefix: wrong greedy tokens and logprobs off by up to 7.7, no error)."""
    model = load_model(str(tiny_llama_dir), dtype=torch.float32, attention=build_attention_backend(backend))
    every_row = _prefill(model, all_logits=True)
    # The first chunk's 35 rows, its last (34) twice, then the second chunk's 32 rows and its last:
    # 68 entries for 68 tokens, and not 0..67.
    chosen = torch.tensor([*range(35), 34, *range(35, 66), 67])
    assert chosen.shape[0] == every_row.shape[0] and not torch.equal(chosen, torch.arange(68))
    assert torch.allclose(_prefill(model, all_logits=False, logit_index=chosen), every_row[chosen], atol=1e-5, rtol=1e-5)
