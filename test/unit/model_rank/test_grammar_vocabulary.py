"""The vocabulary the grammar matchers see: an added token that is not special (Qwen2.5's
``<tool_call>``, Qwen3's ``<think>``) is its text, and a special token's text forced by a grammar
is spelled with ordinary tokens, so a grammar that forces either text completes."""

from __future__ import annotations

import shutil

import llguidance
import llguidance.torch as ll_torch
import pytest

from lightllm.common.sampling.grammar_vocabulary import grammar_tokenizer
from lightllm.utils.tokenizer_utils import load_tokenizer, tokenizer_special_ids


@pytest.fixture(scope="module")
def tag_tokenizer(tiny_llama_dir, tmp_path_factory):
    """The tiny checkpoint's tokenizer with two added tag tokens that are not special."""
    model_dir = tmp_path_factory.mktemp("tags") / "ckpt"
    shutil.copytree(tiny_llama_dir, model_dir)
    tokenizer = load_tokenizer(str(model_dir))
    tokenizer.add_tokens(["<tool_call>", "<think>"])  # special=False, as in Qwen's tokenizers
    tokenizer.save_pretrained(str(model_dir))
    return load_tokenizer(str(model_dir))


def _follow(tokenizer, regex: str, prefer: set[int]) -> list[int]:
    """Walk a regex grammar, taking a preferred token whenever the mask allows one (a model that
    likes the added tokens), else the longest allowed token; fail on any matcher error."""
    ll_tokenizer = grammar_tokenizer(tokenizer, [tokenizer.eos_token_id])
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_regex(regex))
    taken: list[int] = []
    for _ in range(64):
        bitmask = ll_torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        ll_torch.fill_next_token_bitmask(matcher, bitmask, 0)
        assert not matcher.is_error(), matcher.get_error()
        allowed = [i for i in range(ll_tokenizer.vocab_size) if (int(bitmask[0, i // 32]) >> (i % 32)) & 1]
        if matcher.is_stopped() or allowed == [tokenizer.eos_token_id]:
            break
        token = max(allowed, key=lambda i: (i in prefer, len(ll_tokenizer.decode_bytes([i]))))
        matcher.consume_token(token)
        assert not matcher.is_error(), matcher.get_error()
        taken.append(token)
    return taken


@pytest.mark.parametrize("regex, text", [
    ("<tool_call>ab", "<tool_call>ab"),
    ("a<think>\n[a-z]{1,3}", None),
    ("<s>x", "<s>x"),
    (r"<\|im_end\|>", "<|im_end|>"),
])
def test_a_grammar_that_forces_a_tag_text_completes(tag_tokenizer, regex, text):
    tags = {tag_tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "<think>")}
    special = tokenizer_special_ids(tag_tokenizer)
    assert not tags & special and {tag_tokenizer.bos_token_id, tag_tokenizer.eos_token_id} <= special
    taken = _follow(tag_tokenizer, regex, prefer=tags | special)
    decoded = tag_tokenizer.decode(taken)
    if text is not None:
        assert decoded == text
    else:
        assert decoded.startswith("a<think>\n")
    # A tag is taken as its one added token; a special token's text never as the special token.
    assert not set(taken) & special
    if "<tool_call>" in regex or "<think>" in regex:
        assert set(taken) & tags
