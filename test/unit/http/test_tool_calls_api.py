"""Tool calling through the HTTP layer (request checks, template arguments, responses, streams) with a
request manager whose generations are scripted texts, read by the official OpenAI client and
langchain-openai."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api_fakes import MODEL, assert_error, chat, sse_events
from scripted_manager import make_client

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK_TOOL = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
CALL_TEXT = ["Checking", " the weather.", "\n<tool", "_call>\n", '{"name": "get_', 'weather", "arg',
             'uments": {"city": ', '"Paris"}}', "\n</tool_call>"]


def test_auto_call_non_streaming_and_template_arguments() -> None:
    client, manager = make_client(CALL_TEXT)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = chat(client, messages=messages, tools=[WEATHER_TOOL, CLOCK_TOOL])
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["content"] == "Checking the weather."
    # The template gets the tools and the history's arguments as a mapping (transformers' convention).
    assert manager.served.template_options["chat_template_kwargs"]["tools"] == [WEATHER_TOOL, CLOCK_TOOL]
    rendered = manager.served.chat_messages[-1]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert manager.calls[-1].params.grammar is None


def test_a_history_call_assembled_from_a_stream_keeps_its_index() -> None:
    """A call built from streamed deltas carries their "index": accepted and not used (it was a 400;
    vLLM accepts it).  The template gets the same call as without it."""
    client, manager = make_client(["ok"])
    call = {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}
    rendered = []
    for sent in (call, {"index": 0, **call}, {"index": None, **call}, {"index": 1.0, **call}):
        messages = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": None, "tool_calls": [sent]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
        response = chat(client, messages=messages, tools=[CLOCK_TOOL])
        assert response.status_code == 200, response.text
        rendered.append(manager.served.chat_messages[-1])
    assert rendered[0] == rendered[1] == rendered[2] == rendered[3]
    messages[1]["tool_calls"] = [{"index": "0", **call}]
    error = assert_error(chat(client, messages=messages, tools=[CLOCK_TOOL]), 400, "messages.1.tool_calls")
    assert "tool call 0 index must be an integer" in error["message"]


def test_auto_call_streaming_deltas() -> None:
    client, _ = make_client(CALL_TEXT)
    events = sse_events(chat(client, tools=[WEATHER_TOOL], stream=True))
    assert events[-1] == "[DONE]"
    deltas = [event["choices"][0] for event in events[:-1]]
    content = "".join(choice["delta"].get("content") or "" for choice in deltas)
    assert content == "Checking the weather."  # as the non-streamed content: the space before the call goes
    # The call arrives whole, once its block is complete.
    (call,) = [entry for choice in deltas for entry in choice["delta"].get("tool_calls", [])]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert deltas[-1]["finish_reason"] == "tool_calls"


def _streamed_message(events: list[Any]) -> tuple[dict[str, Any], str]:
    """The message an OpenAI client builds from a chat stream's chunks, and the finish reason.

    Content accumulates as the openai SDK's stream state does: the first value (null or a
    string) is taken as it is, later strings are appended, so "" and null stay apart.
    """
    content, calls, finish = None, {}, None
    for event in events[:-1]:
        (choice,) = event["choices"]
        piece = choice["delta"].get("content")
        if piece is not None:
            content = piece if content is None else content + piece
        for entry in choice["delta"].get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"name": None, "arguments": ""})
            call["name"] = entry["function"].get("name") or call["name"]
            call["arguments"] += entry["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return {"content": content, "tool_calls": [calls[index] for index in sorted(calls)]}, finish


PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("finish", ["stop", "length"])
@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": "oops"}\n</tool_call>',
    PARIS + "\n<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call>"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    PARIS + "\n" + PARIS,
    "Sure.\n" + PARIS + "\nDone.",
    PARIS,  # only a call: the content is null, streamed or not
    "",  # nothing at all: the content is "", streamed or not
])
def test_stream_and_whole_response_give_the_same_message(text: str, finish: str) -> None:
    for cut in (1, 2, 5):
        client, _ = make_client([text[i:i + cut] for i in range(0, len(text), cut)] or [""], finish=finish)
        whole = chat(client, tools=[WEATHER_TOOL]).json()["choices"][0]
        expected = {"content": whole["message"]["content"],
                    "tool_calls": [call["function"] for call in whole["message"].get("tool_calls", [])]}
        assert _streamed_message(sse_events(chat(client, tools=[WEATHER_TOOL], stream=True))) == \
            (expected, whole["finish_reason"])
    # A text without a well-formed call is all content and keeps the engine's finish reason.
    if not expected["tool_calls"]:
        assert expected["content"] == text and whole["finish_reason"] == finish
    else:
        assert whole["finish_reason"] == ("tool_calls" if finish == "stop" else "length")


@pytest.mark.parametrize("script, arguments", [
    # Arguments written as a JSON string, as the OpenAI API itself writes them.
    (['<tool_call>{"name": "get_weather", "arguments": "{\\"city\\":', ' \\"Oslo\\"}"}</tool_call>'],
     '{"city": "Oslo"}'),
    # A repeated key: the first one counts, streamed or not.
    (['<tool_call>{"name": "get_weather", "name": "clock", "parameters": {"city": "Rome"}, "arguments": 5}',
      '</tool_call>'], '{"city": "Rome"}'),
])
def test_streamed_arguments_add_up_to_the_non_streaming_ones(script: list[str], arguments: str) -> None:
    client, _ = make_client(script)
    whole = chat(client, tools=[WEATHER_TOOL, CLOCK_TOOL]).json()["choices"][0]["message"]
    (call,) = whole["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": arguments}
    events = sse_events(chat(client, tools=[WEATHER_TOOL, CLOCK_TOOL], stream=True))
    calls = [entry for event in events[:-1] for entry in event["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(entry["function"]["arguments"] for entry in calls) == arguments


def test_no_call_and_tool_choice_none() -> None:
    client, manager = make_client(["Just", " text."])
    plain = chat(client, tools=[WEATHER_TOOL]).json()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "Just text."} and plain["finish_reason"] == "stop"
    # "none" needs no parser; the call text stays content.
    client, manager = make_client(CALL_TEXT, parser=None)
    none = chat(client, tools=[WEATHER_TOOL], tool_choice="none").json()["choices"][0]
    assert none["message"]["content"] == "".join(CALL_TEXT) and "tool_calls" not in none["message"]
    assert manager.served.template_options["chat_template_kwargs"]["tools"] == [WEATHER_TOOL]


def test_required_and_named_use_the_grammar_path() -> None:
    client, manager = make_client(['[{"name":"clock","parameters":{}}]'], parser=None)
    required = chat(client, tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice="required").json()["choices"][0]
    assert required["finish_reason"] == "tool_calls"
    assert [call["function"] for call in required["message"]["tool_calls"]] == [{"name": "clock", "arguments": "{}"}]
    assert manager.calls[-1].params.grammar is not None
    client, manager = make_client(['{"city":', '"Oslo"}'], parser=None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(client, tools=[WEATHER_TOOL], tool_choice=named).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    # The grammar is the function's parameters schema (the JSON schema is embedded in the grammar).
    assert '"city"' in manager.calls[-1].params.grammar


def test_a_forced_call_is_an_object_even_when_the_schema_leaves_the_type_out() -> None:
    """Clients often send a function's parameters without "type"; the grammar must still force an object."""
    from lightllm.server.http.openai.tool_calls.request import parse_tools

    untyped = {"type": "function", "function": {"name": "add", "parameters": {
        "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    (tool,) = parse_tools([untyped])
    assert tool.parameters_schema == {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert tool.parameters == untyped["function"]["parameters"]  # what the chat template sees is unchanged
    client, manager = make_client(['{"a":', ' 1}'], parser=None)
    choice = chat(client, tools=[untyped], tool_choice={"type": "function", "function": {"name": "add"}}).json()
    assert choice["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert '"object"' in manager.calls[-1].params.grammar


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [WEATHER_TOOL]}, "tool_choice", "--tool_call_parser"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice", "--tool_call_parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", "no tools"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "nope"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice", "one of"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "tools is empty"),
        ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice",
         "tools is empty"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0", "function tools"),
        ({"tools": [{"type": "function"}]}, "tools.0", "tools.0 lacks 'function'"),
        # The Responses API's flat layout is named as such.
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools.0",
         "tools.0 lacks 'function'; a function tool is {'type': 'function', 'function': {'name': ..., "
         "'parameters': ...}}: name, parameters belong inside it"),
        # A function's own key written beside "type" (the Responses API's layout) is named, not
        # blamed on the tool's type.
        ({"tools": [{"type": "function", "function": {"name": "f"}, "strict": True}], "tool_choice": "none"},
         "tools.0", "unknown key(s) in tools.0: strict; strict belongs inside tools.0.function"),
        ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 2}], "tool_choice": "none"},
         "tools.0", "unknown key(s) in tools.0: extra"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "letters"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "none"}, "tools.1.function.name", "two functions"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
          "tool_choice": "none"}, "tools.0.function.parameters", "object"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools.0.function.parameters",
         "invalid JSON schema"),
        # The tool whose own schema is unusable is named, not the whole list.
        ({"tools": [WEATHER_TOOL, {"type": "function", "function": {"name": "g", "parameters": {"type": "object",
          "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}], "tool_choice": "required"},
         "tools.1.function.parameters", "invalid JSON schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}], "tool_choice": "none"},
         "tools.0.function", "extra"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "cannot be combined"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "structured_outputs": {"regex": "a+"}}, "tool_choice", "cannot be combined"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages.0.tool_call_id", "only"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
         "messages.0.tool_calls.0.function.arguments", "valid JSON"),
        # OpenAI and vLLM require a history call's id and type; both were accepted when missing.
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages.0.tool_calls", "tool call 0 lacks 'id': it must be {'id': <string>, 'type': 'function'"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages.0.tool_calls", "tool call 0 lacks 'type'"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": None, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages.0.tool_calls", "tool call 0 lacks 'id'"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "custom", "custom": {"name": "f", "input": "x"}}]}]},
         "messages.0.tool_calls", "only function calls are supported"),
        # A key beside name and arguments would be dropped (the template gets those two): named, not just
        # "must be {...}" (vLLM accepts and drops it).
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}", "strict": True}}]}]},
         "messages.0.tool_calls", "tool call 0 function has unknown key(s) 'strict'"),
    ],
)
def test_tool_fields_refused_clearly(fields: dict[str, Any], param: str, words: str) -> None:
    client, manager = make_client(["x"], parser=None)
    error = assert_error(chat(client, **fields), 400, param)
    assert words in error["message"]
    assert manager.calls == []


@pytest.mark.parametrize("choice", [{}, {"tool_choice": None}, {"tool_choice": "none"}, {"tool_choice": "auto"}])
def test_an_empty_tools_list_is_no_tools(choice: dict[str, Any]) -> None:
    """vLLM (and OpenAI) read ``tools: []`` as no tools; langchain's ``bind_tools([])`` sends it. "auto" then
    has nothing to call and needs no parser; "required" and a named function are refused (above)."""
    client, manager = make_client(CALL_TEXT, parser=None)
    response = chat(client, tools=[], **choice)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    # Plain content: the call-shaped text is not read as a call, and no tools reach the template.
    assert "tool_calls" not in message and "<tool_call>" in message["content"]
    assert "tools" not in (manager.served.template_options.get("chat_template_kwargs") or {})
    assert manager.calls[-1].params.grammar is None


def test_langchain_bind_tools_with_no_tools() -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    client, _ = make_client(["Hello"], parser=None)
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url="http://testserver/v1", api_key="unused",
                                      http_client=client, max_retries=0)
    assert llm.bind_tools([]).invoke("hi").content == "Hello"


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("script, choice, parser, count", [
    (CALL_TEXT, "auto", "hermes", 1),  # the call completes on the last token
    ([PARIS, "\n", PARIS], "auto", "hermes", 2),
    (['[{"name":"clock","parameters":{}},', '{"name":"clock","parameters":{}}]'], "required", None, 2),
    (['{"city":', '"Oslo"}'], NAMED_WEATHER, None, 1),  # sent whole at the end
])
def test_the_sdk_stream_helper_reports_every_call_done(script: list[str], choice: Any, parser: str | None,
                                                        count: int) -> None:
    """A call announced by the finishing token comes before the finish reason, in a chunk of its own:
    the openai SDK's helper closes a call only when it saw its index before that chunk."""
    openai = pytest.importorskip("openai")
    client, _ = make_client(script, parser=parser)
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    with sdk.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                     tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice=choice) as stream:
        done = [event.index for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert len(message.tool_calls) == count and done == list(range(count))
    whole = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice=choice)
    assert message.content == whole.choices[0].message.content
    # The last chunk carries only the finish reason.
    events = sse_events(chat(client, tools=[WEATHER_TOOL, CLOCK_TOOL], tool_choice=choice, stream=True))
    assert events[-2]["choices"][0]["delta"] == {} and events[-2]["choices"][0]["finish_reason"] is not None
    assert "tool_calls" in events[-3]["choices"][0]["delta"] and events[-3]["choices"][0]["finish_reason"] is None


def test_official_client_and_langchain_read_tool_calls() -> None:
    openai = pytest.importorskip("openai")
    langchain_openai = pytest.importorskip("langchain_openai")
    client, _ = make_client(CALL_TEXT)
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    done = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])
    assert done.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert json.loads(done.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    with sdk.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                     tools=[WEATHER_TOOL]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url="http://testserver/v1", api_key="unused",
                                      http_client=client, max_retries=0)
    bound = llm.bind_tools([WEATHER_TOOL])
    message = bound.invoke("Weather in Paris?")
    assert message.tool_calls[0]["name"] == "get_weather" and message.tool_calls[0]["args"] == {"city": "Paris"}
    chunks = list(bound.stream("Weather in Paris?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert merged.tool_calls[0]["args"] == {"city": "Paris"}


def test_required_rewrites_references_at_schema_positions_only() -> None:
    """A property named like a data keyword ("default", "enum") holds a schema whose references move
    with the tool; a "default" keyword's value is data and stays; a root "$id" is dropped (llguidance
    resolved the moved pointers against it)."""
    from lightllm.server.http.openai.tool_calls.request import FunctionTool, required_grammar, required_schema

    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    schema = {"$id": "https://example.com/person", "type": "object", "$defs": {"Address": address},
              "properties": {"default": {"$ref": "#/$defs/Address"},
                             "enum": {"type": "array", "items": {"$ref": "#"}, "maxItems": 0},
                             "note": {"type": "object", "default": {"$ref": "#/kept/as/data"}}},
              "required": ["default", "enum"]}
    wrapped = required_schema([FunctionTool("person", schema, {})], True)["$defs"]["tool_0"]
    assert "$id" not in wrapped
    assert wrapped["properties"]["default"] == {"$ref": "#/$defs/tool_0/$defs/Address"}
    assert wrapped["properties"]["enum"]["items"] == {"$ref": "#/$defs/tool_0"}
    assert wrapped["properties"]["note"]["default"] == {"$ref": "#/kept/as/data"}
    assert required_grammar([FunctionTool("person", schema, {})], True)


def test_a_null_description_is_left_out_as_every_null_field_is() -> None:
    client, manager = make_client(["x"], parser=None)
    tool = {"type": "function", "function": {"name": "f", "description": None, "parameters": None, "strict": None}}
    assert chat(client, tools=[tool], tool_choice="none").status_code == 200
    assert_error(chat(client, tools=[{"type": "function", "function": {"name": "f", "description": 3}}],
                      tool_choice="none"), 400, "tools.0.function.description")


def test_skip_special_tokens_asked_for_by_name_is_refused_where_the_parser_needs_them() -> None:
    # It was turned off without a word: the output showed special tokens the client asked to hide.
    client, manager = make_client(CALL_TEXT)
    refused = chat(client, tools=[WEATHER_TOOL], skip_special_tokens=True)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "skip_special_tokens"
    assert "tool_choice auto" in refused.json()["error"]["message"] and manager.calls == []
    assert chat(client, tools=[WEATHER_TOOL]).status_code == 200  # left out: turned off, as vLLM does
    assert chat(client, tools=[WEATHER_TOOL], tool_choice="none", skip_special_tokens=True).status_code == 200


def test_required_moves_references_where_no_keyword_holds_them_and_keeps_anchors() -> None:
    # OpenAPI's components: P refers to Q there; both references move with the tool. An anchor
    # names its place anywhere in the document and stays (it was turned into a pointer to nowhere).
    from lightllm.server.http.openai.tool_calls.request import FunctionTool, required_grammar, required_schema

    openapi = {"type": "object", "properties": {"p": {"$ref": "#/components/schemas/P"}}, "required": ["p"],
               "components": {"schemas": {"P": {"type": "object", "properties": {"q": {"$ref": "#/components/schemas/Q"}},
                                                "required": ["q"]},
                                          "Q": {"type": "integer"}}}}
    anchored = {"type": "object", "$defs": {"A": {"$anchor": "word", "type": "string"}},
                "properties": {"a": {"$ref": "#word"}}, "required": ["a"]}
    wrapped = required_schema([FunctionTool("o", openapi, {}), FunctionTool("w", anchored, {})], True)["$defs"]
    assert wrapped["tool_0"]["components"]["schemas"]["P"]["properties"]["q"] == {
        "$ref": "#/$defs/tool_0/components/schemas/Q"}
    assert wrapped["tool_1"]["properties"]["a"] == {"$ref": "#word"}
    assert required_grammar([FunctionTool("o", openapi, {})], True)
