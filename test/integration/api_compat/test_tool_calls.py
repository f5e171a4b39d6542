"""Tool calling against a real server (tiny random-weight Llama, ``--tool_call_parser hermes``).

A random model never writes a call by itself, so ``tool_choice: "required"`` and a named function
are the end-to-end proof: structured output forces a call, and the OpenAI client and
langchain-openai get parsed ``tool_calls`` whose arguments validate against the tool's schema.
``auto`` and ``none`` check the plumbing (no ``tool_calls`` when the text holds no call), and with
``guided_regex`` forcing the model to write a given text, that a stream answers exactly as the whole
response does; the parsing of known call texts is covered by test/unit/http/test_tool_call_parsing.py,
test/unit/http/test_tool_call_stream_property.py and test/unit/http/test_tool_calls_api.py.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from server_process import start_server

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
ZONE_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
               "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": ZONE_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": ZONE_PARAMS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(tiny_llama_dir, tmp_path_factory):
    """A server that reads hermes tool calls."""
    handle = start_server(tiny_llama_dir, tmp_path_factory.mktemp("logs"),
                          ["--max_total_token_num", "16384", "--tool_call_parser", "hermes"])
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def tool_client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0)


def check_calls(calls, count=None) -> None:
    assert calls and (count is None or len(calls) == count)
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_force_valid_calls(tool_client, tool_server):
    for seed in (1, 2, 3):
        done = tool_client.chat.completions.create(model=tool_server.model_name, messages=MESSAGES, tools=TOOLS,
                                                   tool_choice="required", parallel_tool_calls=False, seed=seed,
                                                   temperature=1.0, max_tokens=64)
        assert done.choices[0].finish_reason == "tool_calls"
        check_calls(done.choices[0].message.tool_calls, 1)
        named = tool_client.chat.completions.create(
            model=tool_server.model_name, messages=MESSAGES, tools=TOOLS, seed=seed, temperature=1.0, max_tokens=64,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert named.choices[0].finish_reason == "stop" and named.choices[0].message.content is None
        check_calls(named.choices[0].message.tool_calls, 1)
        assert named.choices[0].message.tool_calls[0].function.name == "get_time"


# What pydantic (and the openai SDK's pydantic_function_tool) emits for nested models, a tool that
# refers to its own root, and a tool without parameters (OpenAI: no arguments).
ADDRESS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
PERSON_PARAMS = {"type": "object", "$defs": {"Address": ADDRESS},
                 "properties": {"home": {"$ref": "#/$defs/Address"},
                                "visited": {"type": "array", "items": {"$ref": "#/$defs/Address"}, "maxItems": 2}},
                 "required": ["home", "visited"], "additionalProperties": False}
NODE_PARAMS = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "child": {"$ref": "#"}},
               "required": ["v"], "additionalProperties": False}
REFERRING_TOOLS = [{"type": "function", "function": {"name": "person", "parameters": PERSON_PARAMS}},
                   {"type": "function", "function": {"name": "node", "parameters": NODE_PARAMS}},
                   {"type": "function", "function": {"name": "ping"}}]
REFERRING_SCHEMAS = {"person": PERSON_PARAMS, "node": NODE_PARAMS,
                     "ping": {"type": "object", "properties": {}, "additionalProperties": False}}


def test_required_resolves_each_tools_own_references(tool_client, tool_server):
    """tool_choice "required" wrapped every tool's schema in its own array: "#/$defs/Address" was refused
    (a pointer of the wrapper) and "#" silently meant the array of calls."""
    seen = set()
    for seed in range(6):
        for parallel in (True, False):
            done = tool_client.chat.completions.create(
                model=tool_server.model_name, messages=MESSAGES, tools=REFERRING_TOOLS, tool_choice="required",
                parallel_tool_calls=parallel, seed=seed, temperature=1.0, max_tokens=200)
            if done.choices[0].finish_reason != "tool_calls":
                continue  # a random model may run out of tokens in a deep recursive call
            for call in done.choices[0].message.tool_calls:
                seen.add(call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), REFERRING_SCHEMAS[call.function.name])
    assert seen, "no call completed within max_tokens"
    # Named, a tool without parameters takes no arguments too (it was any object there).
    for seed in (1, 2):
        named = tool_client.chat.completions.create(
            model=tool_server.model_name, messages=MESSAGES, tools=REFERRING_TOOLS, seed=seed, temperature=1.0,
            max_tokens=16, tool_choice={"type": "function", "function": {"name": "ping"}})
        assert named.choices[0].message.tool_calls[0].function.arguments == "{}"


def test_required_and_named_stream_tool_call_deltas(tool_client, tool_server):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        chunks = list(tool_client.chat.completions.create(
            model=tool_server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice=choice, stream=True, seed=4,
            parallel_tool_calls=False, temperature=1.0, max_tokens=64))
        deltas = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or [])]
        assert deltas[0].id.startswith("call_") and deltas[0].function.name
        assert all(delta.id is None and delta.function.name is None for delta in deltas[1:])
        arguments = "".join(delta.function.arguments or "" for delta in deltas)
        jsonschema.validate(json.loads(arguments), SCHEMAS[deltas[0].function.name])
        assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        with tool_client.chat.completions.stream(model=tool_server.model_name, messages=MESSAGES, tools=TOOLS,
                                                 tool_choice=choice, seed=4, parallel_tool_calls=False,
                                                 temperature=1.0, max_tokens=64) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].message.tool_calls[0].function.arguments == arguments


def test_auto_and_none_without_a_call_in_the_text(tool_client, tool_server, tiny_server):
    for tool_choice in ("auto", "none"):
        done = tool_client.chat.completions.create(model=tool_server.model_name, messages=MESSAGES, tools=TOOLS,
                                                   tool_choice=tool_choice, max_tokens=12, temperature=0)
        message = done.choices[0].message
        assert message.tool_calls is None and "<tool_call>" not in message.content
        assert done.choices[0].finish_reason in ("stop", "length")
    # A conversation with a call and its result renders through the checkpoint's template.
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"}]
    answer = tool_client.chat.completions.create(model=tool_server.model_name, messages=history, tools=TOOLS,
                                                 max_tokens=4)
    assert answer.usage.prompt_tokens > 0
    # Without --tool_call_parser "auto" is refused with the flag's name; "required" still works.
    refused = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60, json={
        "model": tiny_server.model_name, "messages": MESSAGES, "tools": TOOLS})
    assert refused.status_code == 400 and "--tool_call_parser" in refused.json()["error"]["message"]
    forced = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60, json={
        "model": tiny_server.model_name, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
        "parallel_tool_calls": False, "max_tokens": 64}).json()
    assert forced["choices"][0]["message"]["tool_calls"][0]["function"]["name"] in SCHEMAS


def test_langchain_bind_tools_forced_call(tool_server):
    import langchain_openai  # a test requirement; imported here to keep the module's start-up light
    llm = langchain_openai.ChatOpenAI(model=tool_server.model_name, base_url=f"{tool_server.url}/v1",
                                      api_key="unused", temperature=1.0, max_tokens=64, seed=5)
    message = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Rome?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER_PARAMS)
    anything = llm.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False).invoke("What time is it?")
    assert anything.tool_calls and anything.tool_calls[0]["name"] in SCHEMAS


UTC_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
# (text the model is forced to write, max_tokens, expected content, expected calls, expected finish reason)
FORCED_OUTPUTS = [
    ('<tool_call>\n{"name": "get_weather", "arguments": "oops"}\n</tool_call>', 400, "same", [], "stop"),
    (UTC_CALL + "\n<tool_call>\nnot json\n</tool_call>", 400, "\n<tool_call>\nnot json\n</tool_call>",
     [("get_time", '{"zone": "UTC"}')], "tool_calls"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call>"}}\n</tool_call>', 400, "same", [],
     "stop"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', 400, "same", [], "stop"),
    (UTC_CALL + "\n" + UTC_CALL.replace("UTC", "CET"), 400, None,
     [("get_time", '{"zone": "UTC"}'), ("get_time", '{"zone": "CET"}')], "tool_calls"),
    # Cut by max_tokens inside the call: content, finish reason length.
    (UTC_CALL, 3, "cut", [], "length"),
]


def _stream_message(url: str, body: dict) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """Content, calls and finish reason an OpenAI client assembles from the stream of ``body``."""
    content, calls, finish = "", {}, None
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[len("data: "):])["choices"]
            content += choice["delta"].get("content") or ""
            for entry in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(entry["index"], ["", ""])
                call[0] = entry["function"].get("name") or call[0]
                call[1] += entry["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content or None, [tuple(calls[index]) for index in sorted(calls)], finish


@pytest.mark.parametrize(("output", "max_tokens", "content", "calls", "finish"), FORCED_OUTPUTS)
def test_forced_outputs_stream_exactly_as_they_answer_whole(tool_server, output, max_tokens, content, calls, finish):
    url = f"{tool_server.url}/v1/chat/completions"
    body = {"model": tool_server.model_name, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
            "guided_regex": re.escape(output), "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url, json=body, timeout=120)
    assert response.status_code == 200, response.text
    whole = response.json()["choices"][0]
    message = whole["message"]
    expected_content = output if content == "same" else content
    if content == "cut":
        expected_content = message["content"]
        assert output.startswith(expected_content) and expected_content != output
    assert message["content"] == expected_content
    assert [(call["function"]["name"], call["function"]["arguments"]) for call in message.get("tool_calls") or []] \
        == calls
    assert whole["finish_reason"] == finish
    assert _stream_message(url, body) == (message["content"] or None, calls, finish)
