"""Chat logprob ``bytes`` are each token's raw bytes; completions ``text_offset`` are positions in the
returned text, the same streamed and whole.

Run on real tokenizers built here: byte-level BPE (the suite's ``tokenizer``), SentencePiece-style
byte fallback and metaspace.  Output text comes from the real detokenizer (ScriptedTextManager).
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeTokenizer, sse_events
from lightllm.server.http.app import create_app
from lightllm.server.http.openai.text_offsets import TextOffsets
from lightllm.server.http.openai.token_bytes import BYTE_FALLBACK, BYTE_LEVEL, METASPACE, TEXT, TokenBytes
from logprob_text_support import (ScriptedTextManager, byte_fallback_tokenizer, metaspace_tokenizer,
                                  sentencepiece_tokenizer, wordpiece_tokenizer)

# CJK and emoji the small vocabularies lack: they come out as byte tokens, several per character.
OUTPUT = " 語😀 the fox 字🎉ok"


@pytest.fixture(scope="module")
def fallback_tokenizer(tmp_path_factory) -> Any:
    return byte_fallback_tokenizer(tmp_path_factory.mktemp("byte_fallback"))


@pytest.fixture(scope="module")
def meta_tokenizer(tmp_path_factory) -> Any:
    return metaspace_tokenizer(tmp_path_factory.mktemp("metaspace"))


@pytest.fixture(params=["byte_level", "byte_fallback"])
def any_tokenizer(request, tokenizer, fallback_tokenizer) -> Any:
    return tokenizer if request.param == "byte_level" else fallback_tokenizer


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _client(manager: ScriptedTextManager) -> TestClient:
    return TestClient(create_app(manager), raise_server_exceptions=False)


def _chunks(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = sse_events(client.post(path, json={**body, "stream": True}))
    return [event["choices"][0] for event in events[:-1] if event["choices"]]


def test_the_kind_is_read_from_the_tokenizer_backend(tokenizer, fallback_tokenizer, meta_tokenizer):
    assert TokenBytes(tokenizer).kind == BYTE_LEVEL
    assert TokenBytes(fallback_tokenizer).kind == BYTE_FALLBACK
    assert TokenBytes(meta_tokenizer).kind == METASPACE
    assert TokenBytes(FakeTokenizer()).kind == TEXT


def test_joined_token_bytes_are_the_text_for_every_kind(tokenizer, fallback_tokenizer, meta_tokenizer):
    for tok in (tokenizer, fallback_tokenizer, meta_tokenizer):
        table = TokenBytes(tok)
        ids = _ids(tok, OUTPUT)
        joined = b"".join(table.raw(token_id) for token_id in ids)
        # A SentencePiece-style tokenizer marks the first word's start too (" 語" -> "▁▁語"...).
        assert joined.decode("utf-8").strip() == OUTPUT.strip(), tok
        assert OUTPUT.encode("utf-8") in joined
    split = [token_id for token_id in _ids(tokenizer, "語") if TokenBytes(tokenizer).raw(token_id)[0] >= 0x80]
    assert len(split) == 3 and [len(TokenBytes(tokenizer).raw(token_id)) for token_id in split] == [1, 1, 1]


def test_chat_bytes_rebuild_characters_split_over_tokens(any_tokenizer):
    script = _ids(any_tokenizer, OUTPUT)
    table = TokenBytes(any_tokenizer)
    # An alternative that is part of a character (0xC3 starts "é"), not among the chosen tokens.
    byte_token = next(token_id for token_id in range(len(any_tokenizer)) if table.raw(token_id) == b"\xc3")
    assert any_tokenizer.decode([byte_token]) == "\ufffd" and byte_token not in script
    manager = ScriptedTextManager(any_tokenizer, script, alternatives=[byte_token])
    client = _client(manager)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
            "max_tokens": 64}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["message"]["content"]
    assert content.strip() == OUTPUT.strip()
    entries = choice["logprobs"]["content"]
    assert b"".join(bytes(entry["bytes"]) for entry in entries) == content.encode("utf-8")
    for token_id, entry in zip(script, entries):
        # The token text is vLLM's (test_logprob_token_strings.py): the token decoded on its own, but
        # for part of a character "" until the token that completes it, which carries the character.
        alone = any_tokenizer.decode([token_id])
        assert entry["token"] == alone or (alone.endswith("\ufffd") and entry["token"] in ("", *"語😀字🎉"))
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]
        # Nothing sampled before it starts the character the alternative 0xC3 starts: "", its bytes its own.
        assert entry["top_logprobs"][1] == {"token": "", "logprob": -1.0, "bytes": [0xC3]}
    streamed = [entry for chunk in _chunks(client, "/v1/chat/completions", body)
                if chunk["logprobs"] for entry in chunk["logprobs"]["content"]]
    assert streamed == entries


def test_return_tokens_as_token_ids_keeps_the_raw_bytes(tokenizer):
    script = _ids(tokenizer, "語x")
    client = _client(ScriptedTextManager(tokenizer, script))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "return_tokens_as_token_ids": True}
    entries = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in entries] == [f"token_id:{token_id}" for token_id in script]
    assert b"".join(bytes(entry["bytes"]) for entry in entries) == "語x".encode("utf-8")


def _completion(client: TestClient, **fields: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 64, "logprobs": 1, **fields}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    return whole, _chunks(client, "/v1/completions", body)


def _check_stream_matches(whole: dict[str, Any], chunks: list[dict[str, Any]]) -> list[int]:
    """The streamed text and offsets equal the whole response's; the offsets never decrease."""
    offsets = whole["logprobs"]["text_offset"]
    assert "".join(chunk["text"] for chunk in chunks) == whole["text"]
    assert [offset for chunk in chunks if chunk["logprobs"] for offset in chunk["logprobs"]["text_offset"]] == offsets
    assert offsets == sorted(offsets) and offsets[0] >= 0
    return offsets


def test_echo_offsets_skip_bos_and_point_into_the_text(any_tokenizer):
    script = _ids(any_tokenizer, OUTPUT)
    client = _client(ScriptedTextManager(any_tokenizer, script, end_with_eos=True))
    whole, chunks = _completion(client, echo=True)
    offsets = _check_stream_matches(whole, chunks)
    text, tokens = whole["text"], whole["logprobs"]["tokens"]
    assert text.startswith("hello world") and text.endswith("ok")
    prompt_ids = any_tokenizer("hello world")["input_ids"]
    assert tokens[0] == "<s>" and offsets[0] == 0  # BOS is not in the text: where the text begins
    assert offsets[1] == 0  # the first word
    output = offsets[len(prompt_ids):]
    assert output[0] == len("hello world")
    # Each byte token of a character gets the offset of that character; the token after it, the next one.
    for char in "語😀字🎉":
        at = text.index(char)
        assert offsets.count(at) == len(char.encode("utf-8")), char  # one token per byte
        assert at + 1 in offsets
    # EOS is left out of the text: it gets the end of the text.
    assert tokens[-1] == "</s>" and offsets[-1] == len(text)
    # A token whose whole text is ASCII is found at its offset.
    for token, offset in zip(tokens, offsets):
        plain = token.replace("▁", " ")
        if plain.isascii() and plain.strip() and token not in ("<s>", "</s>"):
            assert text[offset:offset + len(plain)].strip() == plain.strip(), (token, offset)


def test_the_reported_demo_offsets(tokenizer):
    """The outside report: ' generic' after the echoed 'hello world' is at 11, not 14 (len('<s>') added)."""
    script = _ids(tokenizer, " the fox")
    client = _client(ScriptedTextManager(tokenizer, script))
    whole, chunks = _completion(client, echo=True, max_tokens=4)
    offsets = _check_stream_matches(whole, chunks)
    prompt_len = len(tokenizer("hello world")["input_ids"])
    assert whole["text"] == "hello world the fox"
    assert offsets[prompt_len:] == [11, 15][:len(script)]


def test_an_invalid_byte_gets_its_replacement_character_and_the_next_token_follows(tokenizer):
    lone = next(token_id for token_id in range(len(tokenizer))
                if tokenizer.convert_ids_to_tokens(token_id) == "Ģ")  # the byte 0x80 in GPT-2's alphabet
    script = _ids(tokenizer, " the") + [lone] + _ids(tokenizer, ".fox")
    client = _client(ScriptedTextManager(tokenizer, script))
    whole, chunks = _completion(client)
    offsets = _check_stream_matches(whole, chunks)
    assert whole["text"] == " the\ufffd.fox"
    at = whole["text"].index("\ufffd")
    assert offsets[len(script) - len(_ids(tokenizer, ".fox")) - 1:][:2] == [at, at + 1]


def test_special_tokens_kept_in_the_text_are_placed_in_it(tokenizer):
    script = _ids(tokenizer, " the fox")
    client = _client(ScriptedTextManager(tokenizer, script))
    prompt = tokenizer("hello world")["input_ids"]
    whole, chunks = _completion(client, prompt=prompt, echo=True, skip_special_tokens=False)
    offsets = _check_stream_matches(whole, chunks)
    assert whole["text"].startswith("<s>hello world")
    assert offsets[:2] == [0, 3]


def test_text_held_for_a_stop_string_is_placed_where_it_is_sent(tokenizer):
    script = _ids(tokenizer, " the quick brown fox jumps")
    client = _client(ScriptedTextManager(tokenizer, script))
    # " brown" is held back (it may start "brown f"); "x" shows it was not a stop string.
    whole, chunks = _completion(client, stop=["brown fx"])
    offsets = _check_stream_matches(whole, chunks)
    assert whole["text"] == " the quick brown fox jumps"
    assert offsets[-3:] == [len(" the quick"), len(" the quick brown"), len(" the quick brown fox")]
    # When it completes, the cut-off tokens keep their places: at and past the end of the text.
    whole, chunks = _completion(client, stop=["brown f"])
    offsets = _check_stream_matches(whole, chunks)
    assert whole["text"] == " the quick "
    assert offsets[-2:] == [len(" the quick"), len(" the quick brown")]


def test_a_metaspace_echo_matches_the_prompt_without_its_first_space(meta_tokenizer):
    table = TokenBytes(meta_tokenizer)
    prompt = meta_tokenizer("hello world")["input_ids"]
    assert table.raw(prompt[0]) == b" hello"  # the token's own bytes keep its word mark
    assert TextOffsets(table).feed("hello world", prompt) == [0, 5]


@pytest.fixture(scope="module")
def wp_tokenizer(tmp_path_factory) -> Any:
    return wordpiece_tokenizer(tmp_path_factory.mktemp("wordpiece"))


def test_wordpiece_pieces_of_an_echoed_prompt_are_at_their_characters(wp_tokenizer):
    """The outside report: ' leading' echoed as [CLS] l ##e ##a ##d ##ing got offsets [0, 0, 2, 2, 2, 2]:
    a piece decoded alone keeps its '##', which is not in the text.  Only the pre-tokenizer dropped
    whitespace here (nothing normalized), so every piece is placed exactly."""
    assert TokenBytes(wp_tokenizer).kind == TEXT
    client = _client(ScriptedTextManager(wp_tokenizer, _ids(wp_tokenizer, "ok")))
    for prompt in (" leading", "  two  spaces ", "jumps overlazy  doggo"):
        ids = wp_tokenizer(prompt)["input_ids"]
        pieces = wp_tokenizer.convert_ids_to_tokens(ids)
        assert pieces[0] == "[CLS]" and any(piece.startswith("##") for piece in pieces), pieces
        whole = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0,
                                                      "logprobs": 0}).json()["choices"][0]
        assert whole["text"] == prompt and whole["logprobs"]["tokens"] == pieces
        offsets = whole["logprobs"]["text_offset"]
        assert offsets[0] == 0
        # Each piece at its own first character (the prompt's whitespace belongs to no token).
        for piece, offset in zip(pieces[1:], offsets[1:]):
            word = piece.removeprefix("##")
            assert prompt[offset:offset + len(word)] == word, (prompt, pieces, offsets)
    ids = wp_tokenizer(" leading")["input_ids"]
    assert TextOffsets(TokenBytes(wp_tokenizer)).feed(" leading", ids, whole=True) == list(range(len(ids)))
    spaced = wp_tokenizer("  two  spaces ")["input_ids"]
    assert TextOffsets(TokenBytes(wp_tokenizer)).feed("  two  spaces ", spaced, whole=True) == [
        0, 2, 3, 4, 7, 8, 9, 10, 11, 12]


def test_wordpiece_generated_pieces_follow_their_word(wp_tokenizer):
    """Generated, a word's first token carries the space the decoder puts before it; the '##' pieces
    after it are at their characters."""
    script = _ids(wp_tokenizer, "ok leading ok")
    whole, chunks = _completion(_client(ScriptedTextManager(wp_tokenizer, script)), max_tokens=len(script))
    offsets = _check_stream_matches(whole, chunks)
    assert whole["text"] == " ok leading ok"
    assert offsets == [0, 3, 5, 6, 7, 8, 9, 10, 11]


def test_a_tokenizer_of_unknown_kind_is_placed_by_the_text_each_token_released():
    """FakeTokenizer decodes ids as "<id>", unlike the text: each token starts where its text did."""
    tracker = TextOffsets(TokenBytes(FakeTokenizer()))
    assert [tracker.feed(text, [token_id]) for text, token_id in [(" w0", 20), ("", 21), (" w2", 22)]] == [
        [0], [3], [3]]


def test_an_echoed_token_prompt_that_ends_inside_a_character_shifts_the_offsets_by_its_text(any_tokenizer):
    """The echoed prompt is decoded apart from the completion: its unfinished character is U+FFFD,
    so the completion's tokens sit where they sit without echo, after the prompt's text."""
    pieces = _ids(any_tokenizer, "語")
    cut = len(pieces) // 2 or 1
    prompt = any_tokenizer("hello")["input_ids"] + pieces[:cut]
    script = pieces[cut:] + _ids(any_tokenizer, "😀 ok")
    client = _client(ScriptedTextManager(any_tokenizer, script))
    alone, alone_chunks = _completion(client, prompt=prompt)
    echoed, echoed_chunks = _completion(client, prompt=prompt, echo=True)
    plain = _check_stream_matches(alone, alone_chunks)
    shifted = _check_stream_matches(echoed, echoed_chunks)
    prompt_text = echoed["text"][:len(echoed["text"]) - len(alone["text"])]
    assert prompt_text.endswith("\ufffd") and echoed["text"] == prompt_text + alone["text"]
    assert shifted[len(prompt):] == [offset + len(prompt_text) for offset in plain]


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory) -> Any:
    return sentencepiece_tokenizer(tmp_path_factory.mktemp("sentencepiece"))


@pytest.fixture(params=["byte_level", "sentencepiece"])
def bos_word_tokenizer(request, tokenizer, sp_tokenizer) -> Any:
    """A tokenizer that adds BOS and keeps "fox" and "jumps" whole words, one of each word-mark kind."""
    return tokenizer if request.param == "byte_level" else sp_tokenizer


def test_a_truncated_echo_shows_the_tokens_used_as_an_uncut_echo_shows_them(bos_word_tokenizer):
    """truncate_prompt_tokens with echo: the prompt is echoed as the tokens that ran (the BOS the
    tokenizer added and the text's last tokens), without BOS's text, as an uncut echo has none:
    "<s> fox jumps" started the text with BOS's text, and its offsets counted it."""
    tok = bos_word_tokenizer
    prompt = "the quick brown fox jumps"
    used = tok(prompt)["input_ids"]
    assert tok.convert_ids_to_tokens(used)[0] == "<s>" and tok.decode(used[-2:]).strip() == "fox jumps"
    script = _ids(tok, " ok")
    client = _client(ScriptedTextManager(tok, script))
    uncut, _ = _completion(client, prompt=prompt, echo=True, max_tokens=len(script))
    output = uncut["text"][len(prompt):]
    whole, chunks = _completion(client, prompt=prompt, echo=True, truncate_prompt_tokens=3, max_tokens=len(script))
    offsets = _check_stream_matches(whole, chunks)
    # The kept tokens' own text: the end of the client's prompt (less a first word mark's space).
    shown = tok.decode(used[-2:])
    assert whole["text"] == shown + output and "<s>" not in whole["text"] and prompt.endswith(shown.lstrip())
    uncut_tokens = uncut["logprobs"]["tokens"]
    assert whole["logprobs"]["tokens"][:3] == [uncut_tokens[0], *uncut_tokens[len(used) - 2:len(used)]]
    # BOS where the text begins, as in the uncut echo; each kept token at its text.
    assert offsets[:3] == [0, 0, shown.index(" jumps")] and offsets[3] == len(shown)
    # A limit the prompt fits in cuts nothing: the client's text, as without truncate_prompt_tokens
    # (it was decoded: "<s> the quick ...").
    roomy, _ = _completion(client, prompt=prompt, echo=True, truncate_prompt_tokens=64, max_tokens=len(script))
    assert roomy == uncut and roomy["text"] == prompt + output


def test_a_truncated_echo_equals_the_echo_of_the_kept_text_sent_whole(sp_tokenizer):
    """Where the kept tokens are what their text tokenizes to (a Metaspace tokenizer: "fox jumps" is
    BOS ▁fox ▁jumps either way), the cut prompt's echo is that text's echo: text, tokens, offsets."""
    client = _client(ScriptedTextManager(sp_tokenizer, _ids(sp_tokenizer, " ok")))
    assert sp_tokenizer("the quick brown fox jumps")["input_ids"][-2:] == sp_tokenizer("fox jumps")["input_ids"][1:]
    cut, _ = _completion(client, prompt="the quick brown fox jumps", echo=True, truncate_prompt_tokens=3)
    sent, _ = _completion(client, prompt="fox jumps", echo=True)
    assert cut == sent
    assert cut["text"] == "fox jumps ok" and cut["logprobs"]["text_offset"] == [0, 0, 3, 9]
