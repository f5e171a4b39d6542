"""The order of the logprob dicts, as vLLM builds them: the chosen (or prompt) token first, then
the alternatives best first.  JSON objects keep their order, and a client may read the first key
of a ``top_logprobs`` or ``prompt_logprobs`` entry as the token itself."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from lightllm.server.http.openai.logprob_formatter import TokenLogprobFormatter
from lightllm.server.http.openai.token_bytes import TokenBytes
from lightllm.utils.tokenizer_utils import load_tokenizer


def _formatter(tiny_llama_dir: Path, top: int) -> TokenLogprobFormatter:
    return TokenLogprobFormatter(TokenBytes(load_tokenizer(str(tiny_llama_dir))), top)


def test_completion_top_logprobs_put_the_chosen_token_first(tiny_llama_dir: Path) -> None:
    formatter = _formatter(tiny_llama_dir, 2)
    outside = SimpleNamespace(token_id=30, logprob=-3.0, top_logprobs={40: -0.5, 41: -1.0, 42: -2.0})
    inside = SimpleNamespace(token_id=41, logprob=-1.0, top_logprobs={40: -0.5, 41: -1.0, 42: -2.0})
    top = formatter.completion([outside, inside], [0, 1])["top_logprobs"]
    text = formatter.token_text
    assert list(top[0].items()) == [(text(30), -3.0), (text(40), -0.5), (text(41), -1.0)]
    assert list(top[1].items()) == [(text(41), -1.0), (text(40), -0.5)]


def test_prompt_logprobs_put_the_prompt_token_first(tiny_llama_dir: Path) -> None:
    formatter = _formatter(tiny_llama_dir, 2)
    first = SimpleNamespace(prompt_logprobs=[(30, -3.0, {40: -0.5, 41: -1.0}, 7),
                                             (41, -1.0, {40: -0.5, 41: -1.0}, 2),
                                             (42, -2.0, {40: -0.5, 42: -2.0}, None)])
    entries = formatter.vllm_prompt_logprobs([1, 30, 41, 42], first, 2)
    assert entries[0] is None
    assert [(key, value["rank"]) for key, value in entries[1].items()] == [("30", 7), ("40", 1), ("41", 2)]
    assert [(key, value["rank"]) for key, value in entries[2].items()] == [("41", 2), ("40", 1)]
    # No rank published: its place among the alternatives.
    assert [(key, value["rank"]) for key, value in entries[3].items()] == [("42", 2), ("40", 1)]


def test_tokens_of_the_same_text_share_a_key_as_in_vllm(tiny_llama_dir: Path) -> None:
    """vLLM builds the dict in one pass over chosen-then-alternatives: a text met again keeps its
    first place and takes the later logprob."""
    formatter = _formatter(tiny_llama_dir, 3)
    text = formatter.token_text
    same = [token_id for token_id in range(1, 400) if text(token_id, None) == "\ufffd"][:3]
    assert len(same) == 3, "the tiny tokenizer has single-byte tokens that read U+FFFD"
    other = next(token_id for token_id in range(1, 400) if text(token_id, None) not in ("\ufffd", ""))
    event = SimpleNamespace(token_id=same[1], logprob=-3.0, top_logprobs={same[0]: -0.5, other: -1.0, same[2]: -2.0})
    top = formatter.completion([event], [0])["top_logprobs"][0]
    # Parts of characters that nothing sampled before completes all read "" (vLLM's strings).
    assert list(top.items()) == [("", -2.0), (text(other), -1.0)]

