"""Benchmark client: prompts of exact token lengths for the served tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from lightllm.benchmark.serving_run import prepare_requests
from lightllm.benchmark.prompts import PromptBuilder, PromptLengthError
from lightllm.benchmark.workloads import WorkloadConfig, long_first


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize("length", [2, 3, 17, 128, 1000])
def test_prompts_have_exact_server_side_length(builder, tokenizer, length) -> None:
    for index in range(4):
        prompt = builder.build(index, length, seed=11)
        assert tokenizer(prompt.text)["input_ids"] == prompt.token_ids
        assert prompt.num_tokens == length
        assert prompt.token_ids[0] == tokenizer.bos_token_id


def test_prompts_are_seeded_and_unique_per_request(builder) -> None:
    assert builder.build(3, 64, seed=1) == builder.build(3, 64, seed=1)
    heads = {tuple(builder.build(i, 64, seed=1).token_ids[1:5]) for i in range(30)}
    assert len(heads) == 30  # distinct beginnings: prefix caches cannot share them
    assert builder.build(3, 64, seed=2) != builder.build(3, 64, seed=1)
    assert builder.build(3, 64, seed=1, namespace="warmup-0") != builder.build(3, 64, seed=1)


def test_shared_prefix_is_common_to_all_prompts(builder) -> None:
    prompts = [builder.build(i, 100, seed=5, shared_prefix_len=40) for i in range(6)]
    assert all(p.num_tokens == 100 for p in prompts)
    # Merges can only touch the token at the seam; everything before it is shared.
    assert len({tuple(p.token_ids[:40]) for p in prompts}) == 1
    assert len({tuple(p.token_ids[42:]) for p in prompts}) == 6


def test_prompt_length_errors(builder) -> None:
    with pytest.raises(ValueError, match="length"):
        builder.build(0, 1)  # only room for BOS
    with pytest.raises(ValueError, match="shared_prefix_len"):
        builder.build(0, 10, shared_prefix_len=9)
    with pytest.raises(ValueError, match="shared_prefix_len"):
        builder.build(0, 10, shared_prefix_len=-1)


class ParityTokenizer:
    """Encodes one id per character but pads every encoding to an even length.

    Stands in for a tokenizer under which some lengths are unreachable.
    """

    all_special_ids = [0]
    added_tokens_decoder: dict[int, Any] = {}

    def __len__(self) -> int:
        return 27

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return 1

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = [ord(c) - 96 for c in text]
        if add_special_tokens:
            ids = [0] + ids + ([0] if len(ids) % 2 == 0 else [])
        return ids

    def __call__(self, text, add_special_tokens: bool = True) -> dict[str, Any]:
        if isinstance(text, list):
            return {"input_ids": [self._ids(t, add_special_tokens) for t in text]}
        return {"input_ids": self._ids(text, add_special_tokens)}

    def decode(self, ids: list[int], clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(chr(i + 96) for i in ids if i)

    def batch_decode(self, batch: list[list[int]], clean_up_tokenization_spaces: bool = False) -> list[str]:
        return [self.decode(ids) for ids in batch]


def test_unreachable_length_gives_up_with_clear_error() -> None:
    parity = PromptBuilder(ParityTokenizer(), max_attempts=5)
    assert parity.build(0, 6).num_tokens == 6
    with pytest.raises(PromptLengthError, match="exactly 7 tokens"):
        parity.build(0, 7)


def test_tiny_llama_tokenizer_if_available(request) -> None:
    try:
        model_dir = request.getfixturevalue("tiny_llama_dir")
    except pytest.FixtureLookupError:
        pytest.skip("no tiny_llama_dir fixture in this checkout")
    tok = AutoTokenizer.from_pretrained(model_dir)
    llama_builder = PromptBuilder(tok)
    for length in (5, 64, 300):
        assert len(tok(llama_builder.build(1, length).text)["input_ids"]) == length


def test_prepare_requests_text_and_ids(builder) -> None:
    schedule = long_first(WorkloadConfig(long_count=1, short_count=2, long_len=30, short_len=6, output_len=3))
    texts = prepare_requests(schedule, builder, prompt_format="text", seed=9)
    ids = prepare_requests(schedule, builder, prompt_format="ids", seed=9)
    assert [r.prompt_tokens for r in texts] == [30, 6, 6]
    assert [len(r.prompt) for r in ids] == [30, 6, 6]
    assert ids[1].prompt == builder.build(1, 6, seed=9).token_ids
    assert [r.scheduled_time for r in texts] == [s.scheduled_time_s for s in schedule]
    with pytest.raises(ValueError, match="prompt_format"):
        prepare_requests(schedule, builder, prompt_format="bytes")




def test_prefix_groups_share_their_stream_and_chat_turns_extend(builder) -> None:
    from lightllm.benchmark.serving_run import prepare_requests
    from lightllm.benchmark.workloads import WorkloadConfig, build_workload

    cfg = WorkloadConfig(name="shared_prefix", request_rate=20.0, duration_s=6.0, long_len=120, short_len=16,
                         prefix_tokens=48, prefix_groups=2, chat_turns=3)
    schedule = build_workload(cfg)
    requests = prepare_requests(schedule, builder, prompt_format="ids", seed=3)
    by_group: dict = {}
    for item, req in zip(schedule, requests):
        assert req.prompt_tokens == item.prompt_len
        by_group.setdefault(item.prefix_group, []).append((item, req.prompt))
    for group, members in by_group.items():
        if group < 0:
            continue
        for (item_a, ids_a), (item_b, ids_b) in zip(members, members[1:]):
            shared = min(item_a.prefix_len, item_b.prefix_len)  # content tokens; 1 BOS in front
            common = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
            assert common >= shared - 2  # the last token or two may merge differently at the edge
    # Different namespaces (warm-up rounds) do not share the measured round's streams.
    warm = prepare_requests(schedule, builder, prompt_format="ids", seed=3, namespace="warmup-0")
    grouped = [i for i, item in enumerate(schedule) if item.prefix_group >= 0]
    assert all(warm[i].prompt[1:9] != requests[i].prompt[1:9] for i in grouped[:5])


def test_a_shared_prefix_is_shared_within_a_pass_only(builder) -> None:
    # compare_strategies builds its warm-up with the first repeat's seed and a namespace of its own
    # ("<workload>-warmup-<k>"), and each repeat with seed + r ("<workload>-repeat-<r>"); bench_serving
    # its warm-ups as "warmup-<k>" and the measured pass as "measure".  Before, the shared prefix
    # ignored the namespace, so a warm-up filled the cache with repeat 0's prefix.
    schedule = long_first(WorkloadConfig(long_count=2, short_count=4, long_len=60, short_len=24))

    def pass_of(namespace: str, seed: int) -> list[list[int]]:
        requests = prepare_requests(schedule, builder, prompt_format="ids", seed=seed, namespace=namespace,
                                    shared_prefix_len=12)
        return [r.prompt for r in requests]

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    passes = [pass_of("long_first-warmup-0", 7), pass_of("long_first-repeat-0", 7), pass_of("long_first-repeat-1", 8),
              pass_of("warmup-0", 7), pass_of("measure", 7)]
    bos = builder.num_special_tokens
    for i, first in enumerate(passes):
        # Within one pass the prefix is shared (merges can only touch the token at the seam).
        assert min(common(a, b) for a in first for b in first) >= bos + 11
        for second in passes[i + 1:]:
            assert max(common(a, b) for a in first for b in second) == bos
