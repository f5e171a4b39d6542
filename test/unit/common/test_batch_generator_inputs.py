"""The library's BatchGenerator: arguments checked before anything is reserved, nothing leaked by a
failed call, EOS stopping on request, and the dtype given to load_model checked at load.

The model is a tiny transformers Llama saved to safetensors; transformers' greedy generate is the
reference for the stop behaviour."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.basemodel.model_config import ModelConfigError
from lightllm.common.kv_cache_mem_manager.token_allocator import KVCacheExhaustedError
from lightllm.models.registry import load_model

VOCAB = 97
CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=CONTEXT,
                         eos_token_id=2, bos_token_id=1)
    out = tmp_path_factory.mktemp("tiny") / "llama"
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return load_model(str(model_dir), dtype=torch.float32)


def _free(gen: BatchGenerator) -> tuple[int, int]:
    return gen.kv_cache.available, gen.req_manager.available


@pytest.mark.parametrize(("prompts", "max_new_tokens", "error", "words"), [
    ([[5] * (CONTEXT + 1)], 2, ValueError, f"prompts[0] holds {CONTEXT + 1} tokens, more than max_sequence_length"),
    ([[5] * (CONTEXT - 2)], 5, ValueError, f"with max_new_tokens 5 that is {CONTEXT + 3}, more than"),
    ([[5]] * 5, 2, ValueError, "5 prompts but 4 free request rows (max_request_num 4)"),
    ([1, 2, 3], 2, TypeError, "prompts[0] must be a list of token ids, got int"),
    ("abc", 2, TypeError, "prompts must be a list of token-id lists"),
    ([[]], 2, ValueError, "prompts[0] is empty"),
    ([[1]], 0, ValueError, "max_new_tokens must be at least 1, got 0"),
    ([[1]], -3, ValueError, "max_new_tokens must be at least 1"),
    ([[1]], 2.5, TypeError, "max_new_tokens must be an integer"),
    ([[1, 2.9]], 2, TypeError, "prompts[0][1] must be an integer, got float 2.9"),
    ([[True]], 2, TypeError, "prompts[0][0] must be an integer, got True"),
    ([[1, VOCAB]], 2, ValueError, f"prompts[0][1] is {VOCAB}, outside the vocabulary [0, {VOCAB})"),
    ([[1], [1, -1]], 2, ValueError, f"prompts[1][1] is -1, outside the vocabulary [0, {VOCAB})"),
])
def test_bad_calls_name_the_argument_and_leave_the_generator_whole(model: Any, prompts: Any, max_new_tokens: Any,
                                                                   error: type, words: str) -> None:
    gen = BatchGenerator(model, kv_cache_size=4 * CONTEXT, max_request_num=4)
    before = _free(gen)
    reference = gen.greedy_generate([[1, 7, 9]], 4)
    with pytest.raises(error) as raised:
        gen.greedy_generate(prompts, max_new_tokens)
    assert words in str(raised.value)
    # Nothing reserved stays reserved, and the next call computes what it did before.
    assert _free(gen) == before
    assert gen.greedy_generate([[1, 7, 9]], 4) == reference


def test_edge_calls_that_are_not_errors(model: Any) -> None:
    gen = BatchGenerator(model, kv_cache_size=4 * CONTEXT, max_request_num=2)
    assert gen.greedy_generate([], 3) == []
    # numpy integers are token ids; a prompt may use the whole length.
    out = gen.greedy_generate([np.array([1, 7, 9], dtype=np.int64)], 2)
    assert gen.greedy_generate(np.array([[1, 7, 9]]), 2) == gen.greedy_generate([torch.tensor([1, 7, 9])], 2) == out
    assert out == gen.greedy_generate([[1, 7, 9]], 2)
    (full,) = gen.greedy_generate([[5] * (CONTEXT - 3)], 3)
    assert len(full) == 3 and _free(gen) == (4 * CONTEXT, 2)


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    (dict(max_sequence_length=0), ValueError, "max_sequence_length must be at least 1, got 0"),
    (dict(kv_cache_size=10.5), TypeError, "kv_cache_size must be an integer, got float 10.5"),
    (dict(kv_cache_size="8"), TypeError, "kv_cache_size must be an integer, got str"),
    (dict(max_request_num=0), ValueError, "max_request_num must be at least 1"),
])
def test_construction_refuses_bad_sizes(model: Any, kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=None) as raised:
        BatchGenerator(model, **{"kv_cache_size": 64, **kwargs})
    assert words in str(raised.value)


def test_max_sequence_length_may_pass_the_position_range_but_not_a_sliding_window(tmp_path: Path,
                                                                                 model: Any) -> None:
    # As the server's --max_req_total_len: untrained positions are computed, with a warning (there was
    # none, and the docs said such a length was refused); a window is not honoured.
    with pytest.warns(UserWarning, match=f"max_sequence_length {CONTEXT * 2} exceeds the model's context of "
                                         f"{CONTEXT} tokens: output past position {CONTEXT} is outside"):
        assert BatchGenerator(model, 64, max_sequence_length=CONTEXT * 2).max_sequence_length == CONTEXT * 2
    torch.manual_seed(0)
    config = MistralConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=CONTEXT, sliding_window=16)
    MistralForCausalLM(config).save_pretrained(tmp_path / "windowed")
    windowed = load_model(str(tmp_path / "windowed"), dtype=torch.float32)
    assert BatchGenerator(windowed, 64).max_sequence_length == 16
    with pytest.raises(ValueError, match="max_sequence_length 17 exceeds the model's sliding window of 16 tokens"):
        BatchGenerator(windowed, 64, max_sequence_length=17)


def test_arrays_and_tensors_are_token_ids_when_they_hold_integers(model: Any) -> None:
    gen = BatchGenerator(model, kv_cache_size=4 * CONTEXT, max_request_num=4)
    expected = gen.greedy_generate([[1, 7, 9], [3, 4, 5]], 3)
    assert gen.greedy_generate(np.array([[1, 7, 9], [3, 4, 5]]), 3) == expected
    assert gen.greedy_generate(torch.tensor([[1, 7, 9], [3, 4, 5]]), 3) == expected
    assert gen.greedy_generate([torch.tensor([1, 7, 9]), np.array([3, 4, 5], dtype=np.uint16)], 3) == expected
    for prompts, words in (([torch.tensor([True, False])], "prompts[0] must hold integers, got dtype torch.bool"),
                           ([np.array([1.0, 2.0])], "prompts[0] must hold integers, got dtype float64"),
                           ([torch.tensor(5)], "prompts[0] must have 1 dimension, got shape ()"),
                           (np.array([1, 2]), "prompts must have 2 dimensions, got shape (2,)")):
        with pytest.raises(TypeError) as raised:
            gen.greedy_generate(prompts, 2)
        assert words in str(raised.value)
    with pytest.raises(TypeError, match=r"stop_token_ids must have 1 dimension, got shape \(\)"):
        gen.greedy_generate([[1, 2]], 2, stop_token_ids=np.array(2))
    assert _free(gen) == (4 * CONTEXT, 4)


def test_kv_room_is_checked_before_the_prefill(model: Any) -> None:
    gen = BatchGenerator(model, kv_cache_size=40, max_request_num=4)
    # 20 + 3 - 1 twice: 44 slots at the longest, 40 in the cache.
    with pytest.raises(KVCacheExhaustedError, match="need up to 44 KV slots, but 40 of 40 are free"):
        gen.greedy_generate([[5] * 20, [6] * 20], 3)
    assert _free(gen) == (40, 4)
    # 19 + 2 and 17 + 2: 40 slots, exactly the cache.
    assert [len(out) for out in gen.greedy_generate([[5] * 19, [6] * 17], 3)] == [3, 3]


def test_a_forward_that_fails_gives_its_slots_back(model: Any) -> None:
    gen = BatchGenerator(model, kv_cache_size=64, max_request_num=2)
    seq = gen.start([1, 2, 3])
    gen.forward([seq], [3])
    seq.token_ids.append(VOCAB + 5)  # appended by hand, as decode loops and benchmarks do
    with pytest.raises(ValueError, match=rf"sequence 0's new tokens\[0\] is {VOCAB + 5}, outside the vocabulary"):
        gen.forward([seq], [1])
    assert gen.kv_cache.available == 61 and seq.cached_len == 3 and len(seq.slots) == 1
    seq.token_ids[-1] = 7
    gen.forward([seq], [1])
    gen.release(seq)
    assert _free(gen) == (64, 2)


def test_forward_checks_new_lens_before_reserving(model: Any) -> None:
    gen = BatchGenerator(model, kv_cache_size=64, max_request_num=2)
    seq = gen.start([1, 2, 3])
    for new_lens, words in (([-2], "new_lens[0] must be at least 1"), ([0], "at least 1"),
                            ([4], "new_lens[0] is 4, but sequence 0 has 3 uncached tokens"),
                            ([1, 1], "1 sequences but 2 new_lens")):
        with pytest.raises(ValueError, match=None) as raised:
            gen.forward([seq], new_lens)
        assert words in str(raised.value)
    with pytest.raises(ValueError, match="appears twice"):
        gen.forward([seq, seq], [1, 1])
    assert gen.kv_cache.available == 64
    gen.forward([seq], [3])
    gen.release(seq)
    assert _free(gen) == (64, 2)
    with pytest.raises(ValueError, match=r"token_ids\[0\] is 97, outside the vocabulary"):
        gen.start([VOCAB])
    assert gen.req_manager.available == 2


def test_stop_token_ids_end_a_continuation_as_transformers_does(model_dir: Path, model: Any) -> None:
    gen = BatchGenerator(model, kv_cache_size=4 * CONTEXT)
    prompts = [[1, 7, 9], [1, 40, 41, 42]]
    free_run = gen.greedy_generate(prompts, 12)
    # Stop at a token the first continuation produces part-way through (the tiny model's greedy
    # output rarely reaches its own EOS); the other continuation runs on.
    stop = free_run[0][4]
    stopped = gen.greedy_generate(prompts, 12, stop_token_ids=[stop])
    ref = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, ours in zip(prompts, stopped):
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=stop,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == expected and (stop not in ours or ours.index(stop) == len(ours) - 1)
    assert stopped[0] == free_run[0][: free_run[0].index(stop) + 1]
    assert _free(gen) == (4 * CONTEXT, 64)
    with pytest.raises(ValueError, match=r"stop_token_ids holds 97, outside the vocabulary"):
        gen.greedy_generate(prompts, 3, stop_token_ids=[VOCAB])
    with pytest.raises(TypeError, match="stop_token_ids must be a collection of token ids"):
        gen.greedy_generate(prompts, 3, stop_token_ids=2)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, "bf17", 5])
def test_load_model_refuses_a_dtype_it_does_not_serve(model_dir: Path, dtype: Any) -> None:
    with pytest.raises(ModelConfigError, match=r"unsupported dtype .*expected one of .*bfloat16"):
        load_model(str(model_dir), dtype=dtype)


def test_load_model_reads_dtype_names(model_dir: Path) -> None:
    assert load_model(str(model_dir), dtype="bf16").dtype == torch.bfloat16
    assert load_model(str(model_dir), dtype=torch.float16).dtype == torch.float16
