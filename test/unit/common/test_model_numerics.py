"""Our runtime against Hugging Face transformers on the demo checkpoints (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.models.registry import load_model

ARCH_FIXTURES = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_mistral_dir"]


def _prompts(vocab: int, lengths, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(params=ARCH_FIXTURES)
def model_dir(request):
    return request.getfixturevalue(request.param)


# Every projection kernel the server can pick on CPU (auto takes onednn where oneDNN runs).
@pytest.fixture(params=["torch", "onednn"])
def models(model_dir, request):
    ours = load_model(str(model_dir), dtype=torch.float32, linear_backend=request.param)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return ours, ref


def test_batched_ragged_prefill_logits_match_transformers(models):
    ours, ref = models
    prompts = _prompts(ours.config.vocab_size, [5, 17, 33, 61, 9])
    gen = BatchGenerator(ours, kv_cache_size=1024, max_request_num=8)
    seqs = [gen.start(p) for p in prompts]
    logits = gen.forward(seqs, [len(p) for p in prompts], all_logits=True)
    offset = 0
    for prompt in prompts:
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        got = logits[offset : offset + len(prompt)]
        assert (got - expected).abs().max().item() < 1e-4
        offset += len(prompt)
    for seq in seqs:
        gen.release(seq)
    assert gen.kv_cache.available == 1024


def test_chunked_prefill_matches_single_prefill(models):
    ours, _ = models
    prompt = _prompts(ours.config.vocab_size, [150], seed=1)[0]
    gen = BatchGenerator(ours, kv_cache_size=1024, max_request_num=4)
    whole = gen.start(prompt)
    one_shot = gen.forward([whole], [len(prompt)])
    chunked = gen.start(prompt)
    gen.forward([chunked], [7])
    gen.forward([chunked], [64])
    last = gen.forward([chunked], [len(prompt) - 71])
    assert (last - one_shot).abs().max().item() < 1e-5
    # A chunk continuation batched together with a fresh prompt gives the same answer too.
    other = gen.start(prompt[:40])
    mixed = gen.start(prompt)
    gen.forward([mixed], [100])
    both = gen.forward([other, mixed], [40, len(prompt) - 100])
    assert (both[1] - one_shot[0]).abs().max().item() < 1e-5
    for seq in (whole, chunked, other, mixed):
        gen.release(seq)


def test_greedy_decoding_matches_transformers_generate(models):
    ours, ref = models
    prompts = _prompts(ours.config.vocab_size, [6, 23, 40, 11], seed=2)
    gen = BatchGenerator(ours, kv_cache_size=2048, max_request_num=8)
    outputs = gen.greedy_generate(prompts, max_new_tokens=32)
    # No EOS stop on either side: compare the full 32 tokens.
    config = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    for prompt, ours_tokens in zip(prompts, outputs):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
        assert ours_tokens == expected
    assert gen.kv_cache.available == 2048


def test_bf16_runs_and_stays_close(tiny_llama_dir):
    fp32 = load_model(str(tiny_llama_dir), dtype=torch.float32)
    bf16 = load_model(str(tiny_llama_dir), dtype=torch.bfloat16)
    prompt = _prompts(fp32.config.vocab_size, [20], seed=3)
    gen32, gen16 = BatchGenerator(fp32, 256), BatchGenerator(bf16, 256)
    l32 = gen32.forward([gen32.start(prompt[0])], [20])
    l16 = gen16.forward([gen16.start(prompt[0])], [20])
    assert l16.dtype == torch.float32
    assert (l16 - l32).abs().max().item() < 0.1 * l32.abs().max().item() + 0.05


def test_large_mixed_length_decode_batch_matches_single_requests(tiny_llama_dir):
    # More requests than one decode attention chunk, with different context lengths.
    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    prompts = _prompts(model.config.vocab_size, [3 + 7 * i for i in range(37)], seed=4)
    batched = BatchGenerator(model, 8192, max_request_num=64).greedy_generate(prompts, 6)
    single = BatchGenerator(model, 1024, max_request_num=2)
    assert batched == [single.greedy_generate([p], 6)[0] for p in prompts]
