"""Tool-call parsers and the stream assembler on known model texts: the streamed deltas add up to
what the non-streaming path reports, and tag text never reaches content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lightllm.server.http.tool_calls.extraction import extract_calls
from lightllm.server.http.tool_calls.json_scan import CallObjectScanner, split_objects
from lightllm.server.http.tool_calls.parsers import ForcedCallParser, HermesParser, Llama3JsonParser
from lightllm.server.http.tool_calls.streaming import NamedCallStream, ToolCallStream

WEATHER = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris }", "days": [1, {"x": 2}]}}'


def assemble(stream: Any, pieces: list[str]) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """Content, calls and raw call deltas of a stream fed ``pieces``, accumulated as the OpenAI client does."""
    content, calls, deltas = "", {}, []
    for position, piece in enumerate(pieces):
        delta = stream.feed(piece)
        if position == len(pieces) - 1:
            tail = stream.finish()
            delta = {"content": delta.get("content", "") + tail.get("content", ""),
                     "tool_calls": delta.get("tool_calls", []) + tail.get("tool_calls", [])}
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            deltas.append(entry)
            call = calls.setdefault(entry["index"], {"name": None, "arguments": ""})
            if "id" in entry:
                assert call["name"] is None, "a call is announced once"
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                call["name"] = entry["function"]["name"]
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            call["arguments"] += entry["function"]["arguments"]
    return content, [calls[index] for index in sorted(calls)], deltas


def chunkings(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and in pieces of 3 and 7 characters."""
    return [[text], list(text)] + [[text[i:i + size] for i in range(0, len(text), size)] for size in (3, 7)]


HERMES_CASES = [
    ("Let me check.\n<tool_call>\n" + WEATHER + "\n</tool_call>", "Let me check.",
     [("get_weather", {"city": 'Pa"ris }', "days": [1, {"x": 2}]})]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"arguments": {"k": 1}, "name": "b"}'
     '</tool_call>', None, [("a", {}), ("b", {"k": 1})]),
    # Left open at the end of the output (the model stopped after the object).
    ('<tool_call>\n{"name": "ping", "arguments": {"host": "x"}}\n', None, [("ping", {"host": "x"})]),
    ('<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", {})]),
    ("No tools needed: 3 < 4 and <tool is not a tag.", "No tools needed: 3 < 4 and <tool is not a tag.", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_extraction_and_stream_agree(text: str, content: str | None, calls: list) -> None:
    extraction = extract_calls(HermesParser(), text)
    assert extraction.content == content
    assert [(call.name, json.loads(call.arguments)) for call in extraction.calls] == calls
    for pieces in chunkings(text):
        streamed, streamed_calls, _ = assemble(ToolCallStream(HermesParser()), pieces)
        assert "<tool" not in streamed.replace("<tool is", "") and "</tool_call>" not in streamed
        assert (streamed.strip() or None) == content
        assert [(call["name"], call["arguments"]) for call in streamed_calls] == \
            [(call.name, call.arguments) for call in extraction.calls]


def test_hermes_malformed_call_is_content_when_not_streaming() -> None:
    text = 'Sure <tool_call>{"name": "a", "arguments": {"x": </tool_call>'
    extraction = extract_calls(HermesParser(), text)
    assert extraction.content == text and extraction.calls == []
    # A call object without a name is text after all, in a stream too.
    streamed, calls, _ = assemble(ToolCallStream(HermesParser()), list('<tool_call>{"answer": 42}</tool_call>'))
    assert calls == [] and streamed == '{"answer": 42}'


def test_stream_announces_a_call_once_its_name_is_complete() -> None:
    stream = ToolCallStream(HermesParser())
    assert stream.feed("Hi <tool_") == {"content": "Hi "}
    assert stream.feed('call>{"name": "get_') == {}
    first = stream.feed('weather", "arguments": {"ci')
    (entry,) = first["tool_calls"]
    assert entry["index"] == 0 and entry["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert stream.feed('ty": "Rome"}}') == {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]}
    assert stream.feed("</tool_call>") == {}
    assert stream.finish() == {}
    assert stream.calls_announced == 1


def test_parallel_false_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [call.name for call in extract_calls(HermesParser(), text, parallel=False).calls] == ["a"]
    _, calls, _ = assemble(ToolCallStream(HermesParser(), parallel=False), list(text))
    assert [call["name"] for call in calls] == ["a"]


LLAMA_CASES = [
    ('<|python_tag|>{"name": "search", "parameters": {"q": "llama"}}', None, [("search", {"q": "llama"})]),
    ('  {"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}', None, [("a", {"n": 1}), ("b", {})]),
    ("The answer is {42}.", "The answer is {42}.", []),
    ('{"result": 1}', '{"result": 1}', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json_extraction_and_stream_agree(text: str, content: str | None, calls: list) -> None:
    extraction = extract_calls(Llama3JsonParser(), text)
    assert extraction.content == content
    assert [(call.name, json.loads(call.arguments)) for call in extraction.calls] == calls
    for pieces in chunkings(text):
        streamed, streamed_calls, _ = assemble(ToolCallStream(Llama3JsonParser()), pieces)
        assert "python_tag" not in streamed
        assert (streamed.strip() or None) == (content.strip() if content else None)
        assert [call["name"] for call in streamed_calls] == [name for name, _ in calls]
        assert [json.loads(call["arguments"]) for call in streamed_calls] == [arguments for _, arguments in calls]


def test_required_array_and_named_stream() -> None:
    text = '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{"y":[2]}}]'
    extraction = extract_calls(ForcedCallParser(), text)
    assert [(call.name, call.arguments) for call in extraction.calls] == [("a", '{"x":1}'), ("b", '{"y":[2]}')]
    for pieces in chunkings(text):
        content, calls, _ = assemble(ToolCallStream(ForcedCallParser()), pieces)
        assert content == "" and calls == [{"name": "a", "arguments": '{"x":1}'}, {"name": "b", "arguments": '{"y":[2]}'}]
    content, calls, deltas = assemble(NamedCallStream("f"), ['{"a"', ":1", "}"])
    assert content == "" and calls == [{"name": "f", "arguments": '{"a":1}'}] and len(deltas) == 3


def test_scanner_reads_name_and_raw_arguments() -> None:
    scanner = CallObjectScanner()
    result = scanner.feed('{"parameters": {"s": "}{"}, "name": "late"} trailing')
    assert scanner.done and scanner.name == "late" and scanner.arguments == '{"s": "}{"}'
    assert result.consumed == len('{"parameters": {"s": "}{"}, "name": "late"}')
    assert split_objects('[{"a": "}"}, {"b": [1, {}]}] x {"c"') == [(1, 11), (13, 27)]
