"""Structured outputs (json_schema, json_object) through the OpenAI client and langchain-openai.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "size": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}


def test_structured_output_json_schema_validates(client, tiny_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    for seed in (1, 2, 3):
        done = client.chat.completions.create(model=tiny_server.model_name, max_tokens=64, temperature=1.0, seed=seed,
                                              messages=[{"role": "user", "content": "Describe it"}],
                                              response_format=fmt)
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), ANSWER_SCHEMA)
    bad = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60, json={
        "model": tiny_server.model_name, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 5}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.json_schema.schema"


def test_structured_output_is_batched_with_free_requests(client, tiny_server):
    messages = [{"role": "user", "content": "Say something"}]
    kwargs = dict(model=tiny_server.model_name, messages=messages, max_tokens=12, temperature=0)
    alone = client.chat.completions.create(extra_body={"ignore_eos": True}, **kwargs).choices[0].message.content
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}

    async def both():
        aclient = openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
        free, constrained, obj = await asyncio.gather(
            aclient.chat.completions.create(extra_body={"ignore_eos": True}, **kwargs),
            aclient.chat.completions.create(response_format=fmt, **{**kwargs, "max_tokens": 64}),
            aclient.chat.completions.create(response_format={"type": "json_object"}, **{**kwargs, "max_tokens": 64}))
        await aclient.close()
        return free, constrained, obj

    free, constrained, obj = asyncio.run(both())
    assert free.choices[0].message.content == alone
    assert json.loads(constrained.choices[0].message.content).keys() == ANSWER_SCHEMA["properties"].keys()
    text = obj.choices[0].message.content
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_langchain_openai_streaming_and_structured_output(tiny_server):
    import langchain_openai  # a test requirement; imported here to keep the module's start-up light
    llm = langchain_openai.ChatOpenAI(model=tiny_server.model_name, base_url=f"{tiny_server.url}/v1", api_key="unused",
                                      temperature=0, max_tokens=6, stream_usage=True)
    pieces = list(llm.stream("Say hi"))
    text = "".join(piece.content for piece in pieces)
    assert text == llm.invoke("Say hi").content
    assert any(piece.usage_metadata for piece in pieces)
    schema = {"title": "Answer", "type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    structured = langchain_openai.ChatOpenAI(model=tiny_server.model_name, base_url=f"{tiny_server.url}/v1",
                                             api_key="unused", temperature=0, max_tokens=32)
    answer = structured.with_structured_output(schema, method="json_schema", strict=True).invoke("Is it ok?")
    assert isinstance(answer, dict) and isinstance(answer["ok"], bool)


def test_native_generate_takes_lightllms_constraint_parameters(tiny_server):
    """LightLLM's /generate parameters regular_constraint, guided_json and guided_grammar constrain the
    output as the OpenAI endpoints' fields do, streamed and not; one at most, never with ignore_eos."""
    url = tiny_server.url
    regex = httpx.post(f"{url}/generate", timeout=60, json={
        "inputs": "Spell it", "parameters": {"max_new_tokens": 40, "do_sample": True, "seed": 3,
                                             "regular_constraint": "(ab){2,4}c"}}).json()
    # LightLLM's shape: generated_text is a list (one entry per choice).
    assert regex["finish_reason"] == "stop" and re.fullmatch("(ab){2,4}c", regex["generated_text"][0])
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for guided_json in (schema, json.dumps(schema)):
        answer = httpx.post(f"{url}/generate", timeout=60, json={
            "inputs": "JSON", "parameters": {"max_new_tokens": 32, "guided_json": guided_json}}).json()
        jsonschema.validate(json.loads(answer["generated_text"][0]), schema)
    lines = httpx.post(f"{url}/generate_stream", timeout=60, json={
        "inputs": "Pick", "parameters": {"max_new_tokens": 16, "guided_grammar": 'start: "yes" | "no"'}}).text
    events = [json.loads(line[len("data:"):]) for line in lines.splitlines() if line.startswith("data:")]
    assert "".join(event["token"]["text"] for event in events) in ("yes", "no")
    for parameters, param in (({"regular_constraint": "a+", "guided_json": schema}, "parameters.guided_json"),
                              ({"regular_constraint": "(", "max_new_tokens": 4}, "parameters.regular_constraint"),
                              ({"regular_constraint": "a+", "ignore_eos": True}, "parameters.ignore_eos")):
        refused = httpx.post(f"{url}/generate", timeout=60, json={"inputs": "x", "parameters": parameters})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


def test_a_schema_with_no_finite_output_is_the_clients_400_and_the_server_serves_on(tiny_server):
    """An array of arrays that must each hold one more has no finite instance: the output nests until
    the parser's per-token limit ends it.  That was a 500 generation_failed (a server fault, which
    clients retry); it is the request's own schema, so a 400 grammar_failed, as a stream's error event too."""
    endless = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
    body = {"model": tiny_server.model_name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1000,
            "response_format": {"type": "json_schema", "json_schema": {"name": "nest", "schema": endless}}}
    answer = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=120, json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "grammar_failed" and error["type"] == "invalid_request_error"
    with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", timeout=120,
                      json={**body, "stream": True}) as stream:
        if stream.status_code == 400:
            # The tiny model may reach the limit before the first event is read: the stream then
            # gets the same answer before it starts, as for any failure before the first token.
            stream.read()
            assert stream.json()["error"]["code"] == "grammar_failed"
        else:
            assert stream.status_code == 200
            events = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "grammar_failed"
            content = "".join(json.loads(event)["choices"][0]["delta"].get("content") or ""
                              for event in events[:-2] if json.loads(event).get("choices"))
            assert content.startswith("[[[")
    fine = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60, json={
        **body, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}})
    assert fine.status_code == 200, fine.text
    assert fine.json()["choices"][0]["finish_reason"] == "stop"


def _running_requests(metrics: str) -> float:
    """The router's count of requests admitted to the model rank, from a /metrics page."""
    found = re.search(r"^lightllm_running_requests(?:\{[^}]*\})? (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_plain_request_is_not_held_up_by_a_grammar_compiling_on_the_rank(tiny_server):
    """``multipleOf: 99991`` takes about a second to compile.  The rank compiled it in its step, once
    per choice, and every other request waited for the step: a plain request sent while the choices
    were on the rank ended after their tokens.  Now the compile runs on a thread, once, and only the
    constrained request waits for it.  Decided by the order of events, not by durations: the plain
    request is sent once the router has admitted both choices to the rank, and must end first."""
    costly = {"model": tiny_server.model_name, "prompt": "x", "guided_json": {"type": "integer", "multipleOf": 99991},
              "n": 2, "max_tokens": 1, "temperature": 1, "seed": 1}
    plain = {"model": tiny_server.model_name, "prompt": "hello", "max_tokens": 2, "ignore_eos": True,
             "temperature": 0}

    async def race() -> tuple:
        ended = []
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=300) as client:
            async def send(name: str, body: dict) -> httpx.Response:
                answer = await client.post("/v1/completions", json=body)
                ended.append(name)
                return answer

            constrained = asyncio.create_task(send("constrained", costly))
            while not constrained.done() and _running_requests((await client.get("/metrics")).text) < 2:
                await asyncio.sleep(0.01)
            free = await send("plain", plain)
            return ended, free, await constrained

    ended, free, constrained = asyncio.run(race())
    assert free.status_code == 200 and constrained.status_code == 200, (free.text, constrained.text)
    assert ended == ["plain", "constrained"]
    assert [choice["text"].isdigit() for choice in constrained.json()["choices"]] == [True, True]
