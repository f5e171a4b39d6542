"""Structured outputs (json_schema, json_object) through the OpenAI client and langchain-openai.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
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


def _metric(page: str, name: str) -> float:
    """One series of a /metrics page (0 when the server does not export it)."""
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", page, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


# Divisors near the HTTP process's multipleOf limit (100000) take the compiler about a second. Each
# test run takes its own, never a value another request to the server used: a grammar compiled
# before is cached on the rank, and its requests are not held at all.
_DIVISORS = itertools.count(random.SystemRandom().randrange(90_001, 99_000) | 1)


def test_a_constrained_request_waits_for_its_grammar_off_the_step_while_the_rank_runs_on(tiny_server):
    """The rank compiled a grammar inside its step (once per choice), so every other request waited
    for it: a plain request sent during an n=16 request of multipleOf 99991 took 20 s.  Now the
    compile runs on the rank's compile thread and only its own request is held meanwhile.

    What decides is the server's own report, not which request ends first (that is a race between
    the compile and the plain request's steps): while /metrics shows both choices held for their
    grammar (and counts them as waiting, as vLLM counts WAITING_FOR_FSM), the rank's step counter
    goes on rising, which a step busy compiling cannot do.  A fresh grammar compiles for about a
    second, the length of the window polled every 20 ms.  A plain request sent then, and the
    constrained one, are answered as usual."""
    divisor = next(_DIVISORS)
    costly = {"model": tiny_server.model_name, "prompt": "x", "guided_json": {"type": "integer", "multipleOf": divisor},
              "n": 2, "max_tokens": 1, "temperature": 1, "seed": 1}
    plain = {"model": tiny_server.model_name, "prompt": "hello", "max_tokens": 2, "ignore_eos": True,
             "temperature": 0}

    async def watch() -> tuple:
        held_pages = []
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=300) as client:
            constrained = asyncio.create_task(client.post("/v1/completions", json=costly))
            while not constrained.done():
                page = (await client.get("/metrics")).text
                if _metric(page, "lightllm_grammar_held_requests") == 2:
                    held_pages.append(page)
                    steps = [_metric(held, "lightllm_backend_steps_total") for held in held_pages]
                    if steps[-1] > steps[0]:
                        break
                await asyncio.sleep(0.02)
            free = await client.post("/v1/completions", json=plain)
            return held_pages, free, await constrained

    held_pages, free, constrained = asyncio.run(watch())
    steps = [_metric(page, "lightllm_backend_steps_total") for page in held_pages]
    assert len(steps) >= 2 and steps[-1] > steps[0], f"no step ran while both choices were held: {steps}"
    for page in held_pages:
        assert _metric(page, "vllm:num_requests_waiting") >= 2
    assert free.status_code == 200 and constrained.status_code == 200, (free.text, constrained.text)
    assert free.json()["usage"]["completion_tokens"] == 2
    # One token of an integer: digits, or the minus sign of a negative one.
    assert [bool(re.fullmatch(r"-|-?[0-9]+", choice["text"])) for choice in constrained.json()["choices"]] == [True] * 2
