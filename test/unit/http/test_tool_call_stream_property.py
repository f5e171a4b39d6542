"""Property: for every output text and every way of cutting it into pieces, a tool-call stream adds up to
the non-streaming message (content, calls by index with name and arguments, whether anything was called).

Texts are built from fragments that stress the formats (valid calls, malformed blocks, end tags inside
JSON strings, unterminated calls, white space around calls, tag prefixes in content) and cut short at
random points, as ``max_tokens`` or a stop would; every parser is checked, the ``--tool_call_parser``
ones and the forms ``tool_choice`` "required" and a named function use.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import pytest

from lightllm.server.http.openai.tool_calls.extraction import Extraction, extract_calls, read_named_call
from lightllm.server.http.openai.tool_calls.parsers import (TOOL_CALL_PARSERS, ForcedCallParser, HermesParser,
                                                            Llama3JsonParser, ToolCallParser)
from lightllm.server.http.openai.tool_calls.streaming import NamedCallStream, ToolCallStream

VALID_OBJECTS = [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "f", "arguments": {"s": "} { ] [", "n": [1, {"x": null}]}}',
    '{"arguments": {"k": 1}, "name": "b"}',
    '{"name": "g", "arguments": "{\\"city\\": \\"Oslo\\"}"}',
    '{"name": "h", "parameters": {"q": "a\\"b"}}',
    '{"name": "noargs"}',
    '{"name": "dup", "name": "other", "arguments": {"a": 1}, "arguments": 5}',
]
INVALID_OBJECTS = [
    "not json",
    '{"name": "get_weather", "arguments": "oops"}',
    '{"name": 1, "arguments": {}}',
    '{"arguments": {"a": 1}}',
    '{"name": "a", "arguments": [1, 2]}',
    '{"name": "a", "arguments": {}} trailing words',
    '{"name": "a", "arguments": {"city": "</tool_call>"}}',
    '{"name": "a", "arguments": {"x": ',
    "",
]
CONTENT = ["Hi", " there", "\n", "  ", "a < b", "<tool", "<tool_cal", "</tool_call>", "{", "}", "ok.", "\t\n "]
SPACE = ["", "", "\n", " ", "\n\n"]


def hermes_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 5)):
        kind = rng.random()
        if kind < 0.35:
            parts.append(rng.choice(CONTENT))
        else:
            body = rng.choice(VALID_OBJECTS if kind < 0.75 else INVALID_OBJECTS)
            if rng.random() < 0.15:
                body += rng.choice(SPACE) + rng.choice(VALID_OBJECTS)  # two objects in one block
            parts.append(f"<tool_call>{rng.choice(SPACE)}{body}{rng.choice(SPACE)}</tool_call>")
        parts.append(rng.choice(SPACE))
    return "".join(parts)


def llama3_text(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return "".join(rng.choice(CONTENT) for _ in range(rng.randint(0, 4)))
    head = rng.choice(["", "  ", "\n", "<|python_tag|>", " <|python_tag|>", "<|python"])
    objects = [rng.choice(VALID_OBJECTS if rng.random() < 0.8 else INVALID_OBJECTS) for _ in range(rng.randint(1, 3))]
    return head + rng.choice(["; ", ";", "\n", " x "]).join(objects) + rng.choice(SPACE)


def required_text(rng: random.Random) -> str:
    objects = [rng.choice(VALID_OBJECTS[:3] + ['{"name":"a","parameters":{}}'] + INVALID_OBJECTS[:2])
               for _ in range(rng.randint(1, 3))]
    return "[" + ",".join(objects) + "]"


def named_text(rng: random.Random) -> str:
    return rng.choice(['{"city": "Paris", "days": [1, 2]}', '{"s": "}{"}', "[1]", "not json", ' {"a": {}} ', ""])


def cut_short(rng: random.Random, text: str) -> str:
    """The text, or (as max_tokens or a stop would leave it) a prefix of it."""
    return text if rng.random() < 0.6 or not text else text[: rng.randint(0, len(text))]


def chunkings(rng: random.Random, text: str) -> list[list[str]]:
    """Whole, a character at a time, cut in two at every position, and a few random cuts into three."""
    ways = [[text], list(text)] + [[text[:cut], text[cut:]] for cut in range(1, len(text))]
    for _ in range(3):
        first, second = sorted(rng.randint(0, len(text)) for _ in range(2))
        ways.append([text[:first], text[first:second], text[second:]])
    return ways


def streamed(stream: Any, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], bool]:
    """What an OpenAI client accumulates: content (None when empty), calls by index, whether any was called."""
    content, calls = "", {}
    for delta in [stream.feed(piece) for piece in pieces] + [stream.finish()]:
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            call = calls.setdefault(entry["index"], ["", ""])
            if "id" in entry:
                call[0] = entry["function"]["name"]
            call[1] += entry["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [tuple(calls[index]) for index in sorted(calls)], stream.calls_announced > 0


def message(extraction: Extraction) -> tuple[str | None, list[tuple[str, str]], bool]:
    """The non-streaming message in the same terms (its content is the whole text when nothing was called)."""
    return extraction.content or None, [(call.name, call.arguments) for call in extraction.calls], bool(extraction.calls)


def check(rng: random.Random, make_stream: Callable[[], Any], whole: Callable[[str], Extraction], text: str) -> None:
    expected = message(whole(text))
    if not expected[2]:
        assert expected[0] == (text or None), "without calls the text is all content"
    for pieces in chunkings(rng, text):
        assert streamed(make_stream(), pieces) == expected, (text, pieces)


def parser_cases() -> list[tuple[str, Callable[[], ToolCallParser], Callable[[random.Random], str]]]:
    texts = {HermesParser.name: hermes_text, Llama3JsonParser.name: llama3_text}
    assert set(texts) == set(TOOL_CALL_PARSERS), "every --tool_call_parser needs its texts here"
    return [(name, factory, texts[name]) for name, factory in TOOL_CALL_PARSERS.items()] + [
        ("required", ForcedCallParser, required_text)]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(("name", "factory", "make_text"), parser_cases(), ids=[case[0] for case in parser_cases()])
def test_stream_adds_up_to_the_message_for_every_chunking(name: str, factory: Callable[[], ToolCallParser],
                                                          make_text: Callable[[random.Random], str],
                                                          parallel: bool) -> None:
    rng = random.Random(f"{name}-{parallel}")
    for _ in range(150):
        text = cut_short(rng, make_text(rng))
        check(rng, lambda: ToolCallStream(factory(), parallel), lambda whole: extract_calls(factory(), whole, parallel),
              text)


def test_named_stream_adds_up_to_the_message_for_every_chunking() -> None:
    rng = random.Random("named")
    for _ in range(60):
        text = cut_short(rng, named_text(rng))
        check(rng, lambda: NamedCallStream("f"), lambda whole: read_named_call("f", whole), text)
