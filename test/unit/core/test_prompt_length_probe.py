"""Refusing a prompt over the context from a prefix (``prompt_length_probe``), with a real BPE tokenizer."""

from __future__ import annotations

import logging
import random

from hypothesis import given, settings
from hypothesis import strategies as st

import pytest
from transformers import AutoTokenizer

from lightllm.server.prompt_length_probe import (
    BOUNDARY_TOKENS,
    PROBE_CHARS_PER_TOKEN,
    PromptOverContextError,
    encode_within,
)
from lightllm.server.http.generation.special_tokens import special_token_frame
from lightllm.server.served_model import encode_chat_messages, encode_text


class _Counting:
    """A tokenize function that records how many characters it was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.chars: list[int] = []

    def __call__(self, text: str) -> list[int]:
        self.chars.append(len(text))
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _words(count: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocabulary = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "你好", "世界", "ünïcödé", "42"]
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def test_a_text_far_over_the_limit_is_refused_after_reading_a_prefix(tokenizer) -> None:
    tokenize = _Counting(tokenizer)
    text = _words(200_000)  # about a million characters
    with pytest.raises(PromptOverContextError) as refused:
        encode_within(tokenize, text, 256)
    assert tokenize.chars == [256 * PROBE_CHARS_PER_TOKEN]  # one probe: no whole-text tokenization
    assert refused.value.prefix_tokens > 256 + BOUNDARY_TOKENS and refused.value.limit == 256
    assert "maximum context length is 256 tokens" in str(refused.value)


def test_texts_that_fit_or_have_no_limit_are_tokenized_whole(tokenizer) -> None:
    plain = _Counting(tokenizer)
    short = _words(50)
    assert encode_within(plain, short, 256) == plain(short)
    assert plain.chars == [len(short), len(short)]  # shorter than the first probe: no probe
    text = _words(5_000)
    assert encode_within(plain, text, None) == plain(text)
    # Long in characters yet within the limit in tokens (a word per token, 100 characters each):
    # probed, then tokenized whole.
    seen: list[int] = []

    def by_word(part: str) -> list[int]:
        seen.append(len(part))
        return [len(word) for word in part.split()]

    wide = " ".join(["y" * 99] * 40)  # 40 tokens, 3999 characters
    assert encode_within(by_word, wide, 41) == [99] * 40
    assert seen[-1] == len(wide) and seen[:-1] == [41 * PROBE_CHARS_PER_TOKEN * 2**k for k in range(len(seen) - 1)]
    assert sum(seen[:-1]) < 2 * len(wide)  # the probes cost less than two more tokenizations


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(["the", " ", "quick", "fox", "你好", "ü", "x" * 37, "\n", ";", "  ", "42", "é"]),
                    min_size=0, max_size=400),
    limit=st.integers(1, 40),
)
def test_a_refusal_is_never_wrong(tokenizer, pieces, limit) -> None:
    """Whatever the text: refused only when the whole text needs more than ``limit`` tokens."""
    text = "".join(pieces)
    tokenize = _Counting(tokenizer)
    whole = tokenize(text)
    try:
        ids = encode_within(tokenize, text, limit)
    except PromptOverContextError as refused:
        assert len(whole) > limit, (refused.prefix_chars, refused.prefix_tokens, len(whole))
    else:
        assert ids == whole


def test_served_model_encoders_probe_the_text_and_the_rendered_chat(tokenizer) -> None:
    with pytest.raises(PromptOverContextError):
        encode_text(tokenizer, _words(100_000), within=128)
    assert encode_text(tokenizer, "the fox", within=128) == encode_text(tokenizer, "the fox")
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}\n{% endfor %}"
    try:
        # Empty messages have no text to count; their template's text is probed.
        with pytest.raises(PromptOverContextError):
            encode_chat_messages(tokenizer, [{"role": "user", "content": ""}] * 20_000, within=128)
        assert encode_chat_messages(tokenizer, [{"role": "user", "content": ""}] * 2, within=128)
    finally:
        tokenizer.chat_template = None


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_prompt_longer_than_the_tokenizers_own_maximum_logs_no_transformers_warning(tokenizer_dir) -> None:
    # The server checks the context itself (and refuses in its own words); transformers' "Token
    # indices sequence length is longer than the specified maximum" line would only mislead.
    short_limit = AutoTokenizer.from_pretrained(tokenizer_dir, model_max_length=8)
    records = _Records()
    source = logging.getLogger("transformers.tokenization_utils_base")
    source.addHandler(records)
    try:
        ids = encode_text(short_limit, _words(50))
        assert len(ids) > 8
        assert special_token_frame(short_limit).apply(encode_text(short_limit, _words(50), False)) == ids
    finally:
        source.removeHandler(records)
    assert not [message for message in records.messages if "sequence length" in message], records.messages
