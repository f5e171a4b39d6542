"""Logprob token strings (completions ``tokens`` and ``top_logprobs`` keys, chat ``token``, prompt
logprobs' ``decoded_token``) are vLLM 0.32's: the leading spaces a single-token decode strips are put
back for a Metaspace pre-tokenizer, and a token ending in U+FFFD is mended after the sampled tokens
before it (``""`` for the tokens that only start a character, the whole character for the one that
completes it).

Run on real tokenizers built here (logprob_text_support): a Llama-style one whose word marks come
from a Metaspace pre-tokenizer, with ``<0xNN>`` byte tokens; one that marks words in its normalizer;
the suite's byte-level BPE.  Output text comes from the real detokenizer (ScriptedTextManager).
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, sse_events
from lightllm.server.http.app import create_app
from lightllm.server.http.openai.token_bytes import TokenBytes
from lightllm.server.http.openai.token_strings import TokenStrings, leading_space_marker
from logprob_text_support import ScriptedTextManager, byte_fallback_tokenizer, sentencepiece_tokenizer


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory) -> Any:
    return sentencepiece_tokenizer(tmp_path_factory.mktemp("sentencepiece"))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _byte(tokenizer: Any, value: int) -> int:
    return tokenizer.convert_tokens_to_ids(f"<0x{value:02X}>")


def _client(manager: ScriptedTextManager) -> TestClient:
    return TestClient(create_app(manager), raise_server_exceptions=False)


def _completion(client: TestClient, **fields: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 64, "logprobs": 1, **fields}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    events = sse_events(client.post("/v1/completions", json={**body, "stream": True}))
    chunks = [event["choices"][0] for event in events[:-1] if event["choices"]]
    streamed = {key: [item for chunk in chunks if chunk["logprobs"] for item in chunk["logprobs"][key]]
                for key in ("tokens", "text_offset", "top_logprobs")}
    assert {key: whole["logprobs"][key] for key in streamed} == streamed  # streamed and whole agree
    return whole, chunks


def _chat(client: TestClient, **fields: Any) -> list[dict[str, Any]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "max_tokens": 64,
            **fields}
    entries = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed = [entry for event in events[:-1] if event["choices"] and event["choices"][0]["logprobs"]
                for entry in event["choices"][0]["logprobs"]["content"]]
    assert streamed == entries
    return entries


def test_the_word_mark_is_read_from_a_metaspace_pre_tokenizer_only(sp_tokenizer, tmp_path, tokenizer):
    assert leading_space_marker(sp_tokenizer) == "\u2581"
    # vLLM reads the pre-tokenizer only: marks made by the normalizer (an old Llama 2 tokenizer.json
    # loaded as a plain fast tokenizer) keep the stripped text, as byte-level BPE needs nothing.
    assert leading_space_marker(byte_fallback_tokenizer(tmp_path)) is None
    assert leading_space_marker(tokenizer) is None


def test_completion_tokens_keep_their_word_marks_and_join_to_the_text(sp_tokenizer):
    """The outside report: ' hello hello' came back as tokens ['hello', 'hello']."""
    hello = _ids(sp_tokenizer, "hello")
    assert sp_tokenizer.decode(hello) == "hello"  # decoded alone, the mark's space is stripped
    mark = sp_tokenizer.convert_tokens_to_ids("\u2581")
    script = hello * 3
    client = _client(ScriptedTextManager(sp_tokenizer, script, alternatives=[mark]))
    whole, _ = _completion(client, logprobs=2)
    assert whole["text"] == " hello hello hello"
    assert whole["logprobs"]["tokens"] == [" hello"] * 3
    assert "".join(whole["logprobs"]["tokens"]) == whole["text"]
    assert whole["logprobs"]["text_offset"] == [0, 6, 12]  # each token's own first character: its space
    assert list(whole["logprobs"]["top_logprobs"][0]) == [" hello", " "]  # the bare mark is a space
    # return_tokens_as_token_ids still names them by id.
    as_ids, _ = _completion(client, return_tokens_as_token_ids=True)
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{token_id}" for token_id in script]


def test_chat_tokens_keep_their_word_marks_and_bytes_stay_the_tokens_own(sp_tokenizer):
    mark = sp_tokenizer.convert_tokens_to_ids("\u2581")
    script = [mark] + _ids(sp_tokenizer, "hello ok")
    entries = _chat(_client(ScriptedTextManager(sp_tokenizer, script)), top_logprobs=1)
    assert [entry["token"] for entry in entries] == [" ", " hello", " ok"]
    assert entries[0]["bytes"] == [32] and entries[0]["top_logprobs"][0]["token"] == " "
    assert bytes(entries[1]["bytes"]) == b" hello"


def test_a_character_split_over_byte_tokens_is_carried_by_the_token_that_completes_it(sp_tokenizer):
    """The outside report: '한국' as six byte tokens came back as six U+FFFD."""
    chars = [_byte(sp_tokenizer, value) for value in "語".encode("utf-8")]
    assert all(sp_tokenizer.decode([token_id]) == "\ufffd" for token_id in chars)
    script = _ids(sp_tokenizer, "ok") + chars + chars + _ids(sp_tokenizer, "ok") + chars[:1]
    client = _client(ScriptedTextManager(sp_tokenizer, script))
    whole, _ = _completion(client)
    text, tokens = whole["text"], whole["logprobs"]["tokens"]
    assert text == " ok語語 ok\ufffd"
    # A byte that nothing completes (the last one) is "" too.
    assert tokens == [" ok", "", "", "語", "", "", "語", " ok", ""]
    # The tokens holding a character's bytes are all at that character.
    assert whole["logprobs"]["text_offset"] == [0, 3, 3, 3, 4, 4, 4, 5, 8]
    entries = _chat(client)
    assert [entry["token"] for entry in entries] == tokens
    # Chat bytes stay each token's own bytes: joined, they are the text (vLLM's, from these strings, are not).
    assert [entry["bytes"] for entry in entries[1:4]] == [[0xE8], [0xAA], [0x9E]]
    assert b"".join(bytes(entry["bytes"]) for entry in entries).decode("utf-8", "replace") == text


def test_each_alternative_is_mended_after_the_sampled_tokens(sp_tokenizer):
    """The last byte of 語 as an alternative completes the character after the sampled E8 AA (though
    " ok" was sampled there), and is "" where the sampled tokens do not start it."""
    chars = [_byte(sp_tokenizer, value) for value in "語".encode("utf-8")]
    script = _ids(sp_tokenizer, "ok") + chars[:2] + _ids(sp_tokenizer, "ok")
    client = _client(ScriptedTextManager(sp_tokenizer, script, alternatives=[chars[2]]))
    whole, _ = _completion(client, logprobs=2)
    assert whole["logprobs"]["tokens"] == [" ok", "", "", " ok"]
    assert [list(top) for top in whole["logprobs"]["top_logprobs"]] == [[" ok", ""], [""], [""], [" ok", "語"]]
    entries = _chat(_client(ScriptedTextManager(sp_tokenizer, script, alternatives=[chars[2]])), top_logprobs=2)
    assert [[alt["token"] for alt in entry["top_logprobs"]] for entry in entries] == [
        [" ok", ""], ["", ""], ["", ""], [" ok", "語"]]
    assert entries[3]["top_logprobs"][1]["bytes"] == [0x9E]


def test_byte_level_tokens_of_a_split_character_are_mended_too(tokenizer):
    pieces = _ids(tokenizer, "語")
    assert len(pieces) == 3 and all(tokenizer.decode([token_id]) == "\ufffd" for token_id in pieces)
    script = _ids(tokenizer, " the") + pieces + _ids(tokenizer, " fox")
    whole, _ = _completion(_client(ScriptedTextManager(tokenizer, script)))
    assert whole["text"] == " the語 fox"
    assert whole["logprobs"]["tokens"] == [" the", "", "", "語", " fox"]


def test_prompt_logprobs_and_echo_name_prompt_tokens_after_the_prompt(sp_tokenizer):
    """vLLM mends a prompt token after the prompt tokens before it (its first token never among
    them); echo names the first prompt token by its decode alone, the others as prompt logprobs."""
    script = _ids(sp_tokenizer, "ok")
    client = _client(ScriptedTextManager(sp_tokenizer, script))
    prompt = sp_tokenizer("hello 語 world")["input_ids"]
    assert sp_tokenizer.convert_ids_to_tokens(prompt) == ["<s>", "\u2581hello", "\u2581", "<0xE8>", "<0xAA>",
                                                          "<0x9E>", "\u2581world"]
    body = {"model": MODEL, "prompt": "hello 語 world", "max_tokens": 1, "prompt_logprobs": 0}
    prompt_logprobs = client.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None
    assert [entry[str(token_id)]["decoded_token"] for token_id, entry in zip(prompt[1:], prompt_logprobs[1:])] == [
        " hello", " ", "", "", "語", " world"]
    whole, _ = _completion(client, prompt="hello 語 world", echo=True, max_tokens=1)
    assert whole["text"] == "hello 語 world ok"
    assert whole["logprobs"]["tokens"] == ["<s>", " hello", " ", "", "", "語", " world", " ok"]
    # Offsets stay positions in the text: the echoed prompt has no space before "hello".
    assert whole["logprobs"]["text_offset"] == [0, 0, 5, 6, 6, 6, 7, 13]
    # Without BOS the first prompt token is decoded alone, as vLLM names it.
    bare, _ = _completion(client, prompt=prompt[1:], echo=True, max_tokens=1)
    assert bare["logprobs"]["tokens"][:2] == ["hello", " "]


def test_echo_with_logprobs_puts_the_prompt_logprobs_on_every_choice(sp_tokenizer):
    """vLLM 0.32 computes the prompt's logprobs for echo with logprobs (its prompt_logprobs is logprobs
    unless given) and puts them on every choice as prompt_logprobs; the choices here had none."""
    manager = ScriptedTextManager(sp_tokenizer, _ids(sp_tokenizer, "ok"))
    client = _client(manager)
    base = {"model": MODEL, "prompt": "hello world", "max_tokens": 1}

    def choices(**fields: Any) -> list[dict[str, Any]]:
        response = client.post("/v1/completions", json={**base, **fields})
        assert response.status_code == 200, response.text
        return response.json()["choices"]

    asked = choices(prompt_logprobs=1)[0]["prompt_logprobs"]
    assert asked[0] is None and len(asked) == len(sp_tokenizer("hello world")["input_ids"])
    # The same shape as asked for by prompt_logprobs, on each choice, also with the prompt alone.
    assert [choice["prompt_logprobs"] for choice in choices(echo=True, logprobs=1, n=2)] == [asked, asked]
    assert manager.calls[-1].params.prompt_logprobs == 1
    assert choices(echo=True, logprobs=1, max_tokens=0)[0]["prompt_logprobs"] == asked
    # logprobs 0 computes the prompt tokens' own logprobs: an empty list of alternatives each.
    assert choices(echo=True, logprobs=0)[0]["prompt_logprobs"] == asked
    # An explicit prompt_logprobs sets how many, for the echo too (vLLM: it wins over logprobs; the
    # larger of the two was computed here).
    assert choices(echo=True, logprobs=3, prompt_logprobs=1)[0]["prompt_logprobs"] == asked
    assert manager.calls[-1].params.prompt_logprobs == 1
    choices(echo=True, logprobs=1, prompt_logprobs=2)
    assert manager.calls[-1].params.prompt_logprobs == 2
    # Echo without logprobs, or logprobs without echo, computes no prompt logprobs.
    for fields in ({"echo": True}, {"logprobs": 1}):
        assert "prompt_logprobs" not in choices(**fields)[0]
        assert manager.calls[-1].params.prompt_logprobs is None
    # Streamed, chunks carry no prompt_logprobs (vLLM's stream choices have no such field); the
    # echoed prompt's logprobs come with the text as before.
    events = sse_events(client.post("/v1/completions", json={**base, "echo": True, "logprobs": 1, "stream": True}))
    chunks = [event["choices"][0] for event in events[:-1] if event["choices"]]
    assert all("prompt_logprobs" not in chunk for chunk in chunks)
    assert chunks[0]["logprobs"]["tokens"][:3] == ["<s>", " hello", " world"]



class _CountingTokenizer:
    """A tokenizer that counts its decode calls (the strings are computed on the event loop)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def decode(self, ids: Any, **options: Any) -> str:
        self.calls += 1
        return self.inner.decode(ids, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

def test_strings_are_worked_out_once_per_id_and_mended_only_for_split_characters(sp_tokenizer):
    """Computed on the event loop per token: a token is decoded once, mending costs decodes only for
    tokens ending in U+FFFD, and a mended string is kept for the same earlier tokens."""

    counting = _CountingTokenizer(sp_tokenizer)
    strings = TokenStrings(TokenBytes(counting))
    words = _ids(sp_tokenizer, "hello world ok")
    for _ in range(50):
        assert [strings.at(token_id, words) for token_id in words] == [" hello", " world", " ok"]
    assert counting.calls == len(words)
    chars = [_byte(sp_tokenizer, value) for value in "語".encode("utf-8")]
    counting.calls = 0
    for _ in range(50):
        assert strings.at(chars[2], words[:1] + chars[:2]) == "語"
    first = counting.calls
    assert 0 < first <= 6  # once: its own decode, those of the tokens before it, the joined decodes
    assert strings.at(chars[2], words[:1] + chars[:2]) == "語" and counting.calls == first
    # A byte that starts a character is "" after anything: its own decode only, whatever is before it.
    counting.calls = 0
    assert [strings.at(chars[0], before) for before in (words, chars, words[1:] + chars[:1])] == ["", "", ""]
    assert counting.calls == 0  # its decode was kept above


def test_the_chosen_token_among_the_alternatives_is_keyed_once_as_by_vllm(sp_tokenizer):
    """vLLM keys a position by token id (the chosen token first), then by string: the chosen byte met
    again among the alternatives is not written again, so a better alternative of the same string
    ("" for a byte that starts a character) keeps its logprob ([{'': -1.0}], not -2.0)."""
    from types import SimpleNamespace

    from lightllm.server.http.openai.logprob_formatter import TokenLogprobFormatter

    e5, e8 = _byte(sp_tokenizer, 0xE5), _byte(sp_tokenizer, 0xE8)
    formatter = TokenLogprobFormatter(TokenBytes(sp_tokenizer), 2)
    event = SimpleNamespace(token_id=e8, logprob=-2.0, top_logprobs={e5: -1.0, e8: -2.0})
    assert formatter.completion([event], [0])["top_logprobs"] == [{"": -1.0}]
    # The same for an echoed prompt token (its alternatives mended after the prompt before it).
    first = SimpleNamespace(prompt_logprobs=[(e8, -2.0, {e5: -1.0, e8: -2.0}, 2)])
    records = formatter.prompt_tokens([1, e8], first)
    assert formatter.completion(records, [0, 0])["top_logprobs"] == [None, {"": -1.0}]
    # Chat keeps a list: both alternatives, best first.
    assert [(alt["token"], alt["logprob"]) for alt in formatter.chat([event])["content"][0]["top_logprobs"]] == [
        ("", -1.0), ("", -2.0)]


def _exact_string(tokenizer: Any, token_id: int, context: list[int]) -> str:
    """vLLM 0.32's string of a token after the sampled tokens ``context``, every decode made (the
    reference the skipped decodes must agree with)."""
    text = tokenizer.decode([token_id])
    if not text.endswith("\ufffd"):
        return text
    for count in range(1, min(len(context), 4) + 1):
        before = context[-count:]
        joined = tokenizer.decode(before + [token_id])
        if joined.endswith("\ufffd"):
            continue
        whole = count
        while whole > 0 and tokenizer.decode([before[whole - 1]]).endswith("\ufffd"):
            whole -= 1
        prefix = tokenizer.decode(before[:whole]) if whole else ""
        common = 0
        while common < min(len(prefix), len(joined)) and prefix[common] == joined[common]:
            common += 1
        return joined[common:]  # past the common start (all of the prefix when joined starts with it)
    return ""


def test_a_cjk_run_with_byte_alternatives_costs_one_decode_per_completing_token(sp_tokenizer):
    """A CJK answer as byte tokens with 19 continuation-byte alternatives per token: each decode the
    bytes show would end in U+FFFD is left out, so besides each id's own decode a character costs one
    decode for its last byte and one per alternative there (every decode of the loop, up to 4 per
    token and alternative plus the decodes of the tokens before, made it about 20 times as many)."""
    from types import SimpleNamespace

    from lightllm.server.http.openai.logprob_formatter import TokenLogprobFormatter

    text = "語言模型很好用"
    script = [_byte(sp_tokenizer, value) for value in text.encode("utf-8")]
    alternatives = [_byte(sp_tokenizer, value) for value in range(0x80, 0x80 + 19)]
    ranked = {alt: -1.0 - rank for rank, alt in enumerate(alternatives)}
    events = [SimpleNamespace(token_id=token_id, logprob=-0.5, top_logprobs={**ranked, token_id: -0.5})
              for token_id in script]
    counting = _CountingTokenizer(sp_tokenizer)
    formatter = TokenLogprobFormatter(TokenBytes(counting), 20)
    result = formatter.completion(events, [0] * len(events))
    assert "".join(result["tokens"]) == text
    chat = formatter.chat(events)["content"]
    for position, event in enumerate(events):
        context = script[max(0, position - 4):position]
        ranked = sorted(event.top_logprobs.items(), key=lambda item: -item[1])
        expected = [_exact_string(sp_tokenizer, token_id, context) for token_id, _ in ranked]
        assert [entry["token"] for entry in chat[position]["top_logprobs"]] == expected
        assert result["tokens"][position] == _exact_string(sp_tokenizer, event.token_id, context)
    own = len(set(script) | set(alternatives))  # each id decoded on its own once
    assert counting.calls <= own + len(text) * (1 + len(alternatives))
    # Every string is kept: the same answer again costs no decode.
    calls = counting.calls
    formatter.completion(events, [0] * len(events))
    assert counting.calls == calls


def test_the_per_context_work_is_bounded_where_nothing_is_decoded(sp_tokenizer, monkeypatch):
    # A continuation byte after ASCII text is "" without a decode, so no mended string is kept;
    # the per-context bytes were kept anyway and grew with every new context (an outside review).
    from lightllm.server.http.openai import token_strings

    monkeypatch.setattr(token_strings, "_CORRECTED_CACHE", 8)
    strings = TokenStrings(TokenBytes(sp_tokenizer))
    words = _ids(sp_tokenizer, "hello world ok fine good")[1:]
    continuation = _byte(sp_tokenizer, 0x80)
    for first in words:
        for second in words:
            strings.at_all([words[0], continuation], [first, second, first, second])
    assert len(strings._contexts) <= 8 and len(strings._corrected) == 0
