"""Tool-call parsers and the stream assembler on known model texts: what the non-streaming path reports,
and that a stream cut anywhere adds up to exactly that (calls whole, malformed blocks as content)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lightllm.server.http.openai.tool_calls.callable_tools import CallableTools
from lightllm.server.http.openai.tool_calls.extraction import extract_calls
from lightllm.server.http.openai.tool_calls.json_scan import CallObjectScanner, split_objects
from lightllm.server.http.openai.tool_calls.parsers import ForcedCallParser, HermesParser, Llama3JsonParser
from lightllm.server.http.openai.tool_calls.streaming import NamedCallStream, ToolCallStream

WEATHER = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris }", "days": [1, {"x": 2}]}}'
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def assemble(stream: Any, pieces: list[str]) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """Content, calls and raw call deltas of a stream fed ``pieces``, accumulated as the OpenAI client does."""
    content, calls, deltas = "", {}, []
    for delta in [stream.feed(piece) for piece in pieces] + [stream.finish()]:
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
    assert sorted(calls) == list(range(len(calls))), "call indexes count from 0 without gaps"
    return content, [calls[index] for index in sorted(calls)], deltas


def chunkings(text: str) -> list[list[str]]:
    """The text whole, one character at a time, in pieces of 3 and 7, and cut in two at every position."""
    sized = [[text[i:i + size] for i in range(0, len(text), size)] for size in (1, 3, 7)]
    return [[text]] + sized + [[text[:cut], text[cut:]] for cut in range(1, len(text))]


def assert_stream_agrees(make_stream: Any, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    """Every chunking of ``text`` streams ``content`` (None: nothing) and ``calls`` as (name, arguments)."""
    for pieces in chunkings(text):
        streamed, streamed_calls, _ = assemble(make_stream(), pieces)
        assert (streamed or None) == content, pieces
        assert [(call["name"], call["arguments"]) for call in streamed_calls] == calls, pieces


HERMES_CASES = [
    ("Let me check.\n<tool_call>\n" + WEATHER + "\n</tool_call>", "Let me check.",
     [("get_weather", '{"city": "Pa\\"ris }", "days": [1, {"x": 2}]}')]),
    # White space between calls separates them; it is not content.
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"arguments": {"k": 1}, "name": "b"}'
     '</tool_call>', None, [("a", "{}"), ("b", '{"k": 1}')]),
    # Left open at the end of the output (the model stopped after the object).
    ('<tool_call>\n{"name": "ping", "arguments": {"host": "x"}}\n', None, [("ping", '{"host": "x"}')]),
    ('<tool_call>{"name": "noargs"}</tool_call>', None, [("noargs", "{}")]),
    ("No tools needed: 3 < 4 and <tool is not a tag.", "No tools needed: 3 < 4 and <tool is not a tag.", []),
    # White space right before a call goes, and so does white space after a call that no content follows.
    ("  Hi,\n\n" + PARIS + "\n\nthen done.  ", "  Hi,\n\nthen done.  ", [("get_weather", '{"city": "Paris"}')]),
    ("Hi\n" + PARIS + "\n", "Hi", [("get_weather", '{"city": "Paris"}')]),
]

# What an outside tester sent (the stream used to answer differently from the whole response).
TESTER_CASES = [
    # Arguments that are a string but not a JSON object: not a call.
    ('<tool_call>\n{"name": "get_weather", "arguments": "oops"}\n</tool_call>', "same", []),
    # A valid call and a malformed one: the valid call stays a call, the malformed block is content.
    (PARIS + "\n<tool_call>\nnot json\n</tool_call>", "\n<tool_call>\nnot json\n</tool_call>",
     [("get_weather", '{"city": "Paris"}')]),
    # The end tag inside a JSON string ends the block (as the regex-based parsers read it): not a call.
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call>"}}\n</tool_call>', "same", []),
    # Unterminated when the output ended: content, whatever the finish reason.
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "same", []),
    # Between calls the white space is not content (the message's content is null).
    (PARIS + "\n" + PARIS, None, [("get_weather", '{"city": "Paris"}')] * 2),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES + TESTER_CASES)
def test_hermes_extraction_and_stream_agree(text: str, content: str | None, calls: list) -> None:
    content = text if content == "same" else content
    extraction = extract_calls(HermesParser(), text)
    assert extraction.content == content
    assert [(call.name, call.arguments) for call in extraction.calls] == calls
    assert_stream_agrees(lambda: ToolCallStream(HermesParser()), text, content, calls)


def test_hermes_malformed_blocks_are_content_with_their_tags() -> None:
    text = 'Sure <tool_call>{"name": "a", "arguments": {"x": </tool_call>'
    assert extract_calls(HermesParser(), text).content == text
    # A call object without a name is text after all, tags included.
    streamed, calls, _ = assemble(ToolCallStream(HermesParser()), list('<tool_call>{"answer": 42}</tool_call>'))
    assert calls == [] and streamed == '<tool_call>{"answer": 42}</tool_call>'


def test_stream_holds_a_call_until_its_block_is_complete() -> None:
    stream = ToolCallStream(HermesParser())
    assert stream.feed("Hi <tool_") == {"content": "Hi"}  # the space waits: a call may follow
    assert stream.feed('call>{"name": "get_') == {}
    assert stream.feed('weather", "arguments": {"city": "Rome"}}') == {}
    (entry,) = stream.feed("</tool_call>")["tool_calls"]
    assert entry["index"] == 0 and entry["id"].startswith("call_") and entry["type"] == "function"
    assert entry["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert stream.feed(" ") == {}
    assert stream.feed("Done") == {"content": " Done"}
    assert stream.finish() == {}
    assert stream.calls_announced == 1


def test_parallel_false_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [call.name for call in extract_calls(HermesParser(), text, parallel=False).calls] == ["a"]
    assert_stream_agrees(lambda: ToolCallStream(HermesParser(), parallel=False), text, None, [("a", "{}")])


LLAMA_CASES = [
    ('<|python_tag|>{"name": "search", "parameters": {"q": "llama"}}', None, [("search", '{"q": "llama"}')]),
    ('  {"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", '{"n": 1}'), ("b", "{}")]),
    ("The answer is {42}.", "The answer is {42}.", []),
    ('{"result": 1}', '{"result": 1}', []),
    # One malformed object makes the whole output content, marker included.
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": ', "same", []),
    ('{"name": "a", "parameters": {}} and some words', "same", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json_extraction_and_stream_agree(text: str, content: str | None, calls: list) -> None:
    content = text if content == "same" else content
    extraction = extract_calls(Llama3JsonParser(), text)
    assert extraction.content == content
    assert [(call.name, call.arguments) for call in extraction.calls] == calls
    assert_stream_agrees(lambda: ToolCallStream(Llama3JsonParser()), text, content, calls)


def test_required_array_and_named_stream() -> None:
    text = '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{"y":[2]}}]'
    calls = [("a", '{"x":1}'), ("b", '{"y":[2]}')]
    assert [(call.name, call.arguments) for call in extract_calls(ForcedCallParser(), text).calls] == calls
    assert_stream_agrees(lambda: ToolCallStream(ForcedCallParser()), text, None, calls)
    # Cut off by max_tokens: content, streamed or not.
    cut = text[:30]
    assert extract_calls(ForcedCallParser(), cut).content == cut
    assert_stream_agrees(lambda: ToolCallStream(ForcedCallParser()), cut, cut, [])
    assert_stream_agrees(lambda: NamedCallStream("f"), '{"a":1}', None, [("f", '{"a":1}')])
    assert_stream_agrees(lambda: NamedCallStream("f"), '{"a":', '{"a":', [])


def test_a_required_array_cut_anywhere_is_content() -> None:
    """Cut after a complete object (``[{...},``, ``[{...},{...}``), the array was not finished and a
    client could not tell its calls were cut: content, as vLLM reads it (the whole text as a list)."""
    text = '[{"name":"a","parameters":{"x":1}}, {"name":"b","parameters":{}}]'
    for end in range(1, len(text)):
        cut = text[:end]
        extraction = extract_calls(ForcedCallParser(), cut)
        assert (extraction.content, extraction.calls) == (cut, []), cut
    assert_stream_agrees(lambda: ToolCallStream(ForcedCallParser()), text[:36], text[:36], [])
    assert len(extract_calls(ForcedCallParser(), text + "\n").calls) == 2


def test_scanner_reads_name_and_raw_arguments() -> None:
    scanner = CallObjectScanner()
    result = scanner.feed('{"parameters": {"s": "}{"}, "name": "late"} trailing')
    assert scanner.done and scanner.name == "late" and scanner.arguments == '{"s": "}{"}'
    assert result.consumed == len('{"parameters": {"s": "}{"}, "name": "late"}')
    assert split_objects('[{"a": "}"}, {"b": [1, {}]}] x {"c"') == [(1, 11), (13, 27)]


def test_deeply_nested_call_is_content_not_a_crash() -> None:
    text = '<tool_call>{"name": "a", "arguments": {"x": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"
    extraction = extract_calls(HermesParser(), text)
    assert extraction.calls == [] and extraction.content == text
    json.dumps(extraction.content)  # still a plain string


def test_a_call_of_an_undeclared_function_stays_content() -> None:
    """OpenAI never names a function the request did not declare; such a block is the model's text."""
    declared = CallableTools(frozenset({"get_weather"}))
    text = 'Let me see <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    extraction = extract_calls(HermesParser(), text, accepts=declared.accepts)
    assert extraction.calls == [] and extraction.content == text
    assert_stream_agrees(lambda: ToolCallStream(HermesParser(), accepts=declared.accepts), text, text, [])
    # Declared calls in other blocks are still calls.
    both = PARIS + "\n" + text
    extraction = extract_calls(HermesParser(), both, accepts=declared.accepts)
    assert [call.name for call in extraction.calls] == ["get_weather"] and extraction.content == "\n" + text
    assert_stream_agrees(lambda: ToolCallStream(HermesParser(), accepts=declared.accepts), both, "\n" + text,
                         [("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("arguments", ['{"a": NaN}', '{"a": -Infinity}', '{"a": "\\ud800"}', '{"a": 1e999}',
                                       '"{\\"a\\": NaN}"'])
def test_a_block_whose_arguments_a_client_could_not_send_back_stays_content(arguments: str) -> None:
    # The call went out with finish_reason tool_calls, and the same arguments in the next turn's
    # history were refused with a 400 (not JSON, or a number no double holds).
    for parser, text in ((HermesParser(), f'<tool_call>\n{{"name": "add", "arguments": {arguments}}}\n</tool_call>'),
                         (Llama3JsonParser(), f'{{"name": "add", "parameters": {arguments}}}')):
        extraction = extract_calls(parser, text)
        assert extraction.calls == [] and extraction.content == text
        assert_stream_agrees(lambda: ToolCallStream(parser), text, text, [])
    good = extract_calls(HermesParser(), '<tool_call>\n{"name": "add", "arguments": {"a": 1.5e300}}\n</tool_call>')
    assert [(call.name, call.arguments) for call in good.calls] == [("add", '{"a": 1.5e300}')]


@pytest.mark.parametrize("block", [
    '{"name": "a", "parameters": {"x": 1}}; {"name": "b"}',
    '{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}',
    '[{"name": "a", "parameters": {"x": 1}}, {"name": "b"}]',
])
def test_hermes_reads_the_documented_call_forms(block: str) -> None:
    """api_compatibility.md: either parser reads "parameters" for "arguments" and several objects per block."""
    text = f"<tool_call>{block}</tool_call>"
    assert_stream_agrees(lambda: ToolCallStream(HermesParser()), text, None, [("a", '{"x": 1}'), ("b", "{}")])
