"""Hostile inputs against a real server: 400s naming the field, never a 5xx, never a dead server.

One module-scoped server (the ``tiny_server`` fixture) takes the known crash triggers and then
a bounded hypothesis run of extreme numbers, odd unicode and deep nesting at every POST
endpoint; afterwards it must still be healthy and serve a normal request.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

POST_PATHS = ("/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions")
ERROR_KEYS = {"message", "type", "param", "code"}
SMALL_LIMIT = 3  # completion tokens per fuzzed request: keeps the run CI-sized


def _post_raw(url: str, path: str, raw: bytes, timeout: float = 60) -> httpx.Response:
    """POST ``raw`` and read the whole answer (streams included)."""
    with httpx.Client(timeout=timeout) as client:
        response = client.post(url + path, content=raw, headers={"content-type": "application/json"})
        response.read()
        return response


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    # ensure_ascii keeps lone surrogates as \\ud800 escapes; allow_nan writes NaN / Infinity.
    return _post_raw(url, path, json.dumps(body, ensure_ascii=True, allow_nan=True).encode())


def _assert_client_error_or_success(response: httpx.Response, context: Any) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500], context)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"], context
    elif response.headers["content-type"].startswith("text/event-stream"):
        # A stream that started with 200 must not hide a server error in an in-band event.
        events = [line[len("data: "):] for line in response.text.split("\n") if line.startswith("data: ")]
        assert events, context
        assert not any(event != "[DONE]" and "error" in json.loads(event) for event in events), (response.text, context)
    else:
        assert "error" not in response.json(), context


def _assert_serving(server) -> None:
    assert server.proc.poll() is None, server.log()[-3000:]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    body = {"model": server.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


def _base(path: str, model: str) -> dict[str, Any]:
    if path in ("/generate", "/generate_stream"):
        return {"inputs": "Hello", "parameters": {"max_new_tokens": SMALL_LIMIT}}
    if path == "/v1/completions":
        return {"model": model, "prompt": "Hello", "max_tokens": SMALL_LIMIT}
    return {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": SMALL_LIMIT}


# ---------------------------------------------------------------- the known crash triggers


def _known_triggers(model: str) -> list[tuple[str, dict[str, Any], str]]:
    completion = {"model": model, "prompt": "Hello", "max_tokens": SMALL_LIMIT}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": SMALL_LIMIT}
    native = {"inputs": "Hello"}
    return [
        ("/v1/completions", {**completion, "repetition_penalty": 1e39}, "repetition_penalty"),
        ("/v1/completions", {**completion, "top_p": 1e-300}, "top_p"),
        ("/v1/completions", {**completion, "top_k": 2**40}, "top_k"),
        ("/v1/completions", {**completion, "stop_token_ids": [2**31]}, "stop_token_ids"),
        ("/v1/chat/completions", {**chat, "top_k": 2**31}, "top_k"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 2**31, "max_tokens": None}, "max_completion_tokens"),
        ("/generate", {**native, "parameters": {"temperature": 1e39}}, "parameters.temperature"),
        ("/generate", {**native, "parameters": {"temperature": 1e300}}, "parameters.temperature"),
        ("/generate", {**native, "parameters": {"repetition_penalty": 1e300}}, "parameters.repetition_penalty"),
        ("/generate", {**native, "parameters": {"repetition_penalty": 1e-300}}, "parameters.repetition_penalty"),
        ("/generate", {**native, "parameters": {"top_k": 2**31}}, "parameters.top_k"),
        ("/generate_stream", {**native, "parameters": {"top_p": 1e-300}}, "parameters.top_p"),
        ("/generate_stream", {**native, "parameters": {"seed": 2**64}}, "parameters.seed"),
    ]


def _surrogate_triggers(model: str) -> list[tuple[str, str, str | None]]:
    chat = '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % model
    return [
        ("/v1/completions", '{"model": "%s", "prompt": "x\\ud800"}' % model, "prompt"),
        ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', "model"),
        ("/v1/chat/completions", chat, "messages.0.content"),
        ("/generate", '{"inputs": "\\udfff"}', "inputs"),
    ]


def test_known_triggers_get_400s_naming_the_field_and_the_server_keeps_serving(tiny_server):
    for path, body, param in _known_triggers(tiny_server.model_name):
        response = _post(tiny_server.url, path, body)
        assert response.status_code == 400, (path, body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and param in error["message"], (path, error)
    for path, raw, param in _surrogate_triggers(tiny_server.model_name):
        response = _post_raw(tiny_server.url, path, raw.encode())
        assert response.status_code == 400, (path, raw, response.text)
        assert response.json()["error"]["param"] == param
    for path in POST_PATHS:
        for depth in (40, 1000, 50_000):
            raw = ('{"inputs": ' + "[" * depth + "]" * depth + "}").encode()
            response = _post_raw(tiny_server.url, path, raw)
            assert response.status_code == 400 and "nested" in response.json()["error"]["message"], response.text
    _assert_serving(tiny_server)
    # Nothing reached the model rank: the HTTP side refused all of it.
    assert "rejecting request" not in tiny_server.log()


# ---------------------------------------------------------------- property test

EXTREME_FLOATS = st.one_of(
    st.sampled_from([1e39, -1e39, 1e300, -1e300, 1e-300, -1e-300, 1e-39, 1e-45, 3.4028235e38, 3.4e38, 1.17e-38,
                     -0.0, 0.0, 1.0, 2.0, 2.0000001, float("inf"), float("-inf"), float("nan")]),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
)
EXTREME_INTS = st.one_of(
    st.integers(min_value=-3, max_value=SMALL_LIMIT),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**40, 2**63 - 1, 2**63, 2**64, -(2**31) - 1, -(2**63) - 1, 10**40]),
)
NUMBER_LIKE = st.one_of(
    EXTREME_FLOATS, EXTREME_INTS,
    st.sampled_from(["NaN", "inf", "-Infinity", "1e400", "0x10", "", True, False, None, [], {}, [2**40]]),
)
ODD_TEXT = st.one_of(
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u202e\u05e9\u05dc\u05d5\u05dd", "😀\u200d👩", "e\u0301",
                     "\ufeff", "\U0010ffff", "a" * 300]),
    st.text(alphabet=st.characters(codec=None, categories=None), max_size=12),
)

NUMERIC_FIELDS = {
    "/v1/completions": ["n", "max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
                        "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "stop_token_ids"],
    "/v1/chat/completions": ["n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                             "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                             "top_logprobs", "stop_token_ids"],
    "native": ["temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
               "max_new_tokens", "min_new_tokens", "logprobs", "stop_token_ids"],
}
TEXT_FIELDS = {
    "/v1/completions": ["prompt", "model", "stop", "user"],
    "/v1/chat/completions": ["content", "model", "stop", "user", "role"],
    "native": ["inputs", "stop_sequences"],
}


def _fields_of(path: str) -> str:
    return "native" if path in ("/generate", "/generate_stream") else path


def _set(body: dict[str, Any], path: str, name: str, value: Any) -> None:
    if _fields_of(path) == "native" and name != "inputs":
        body["parameters"][name] = value
    elif name in ("content", "role"):
        body["messages"][0][name] = value
    else:
        body[name] = value


DEEP = "__deeply_nested__"


def _encode(body: dict[str, Any], depth: int, inner: Any) -> bytes:
    """The body as JSON with every DEEP placeholder replaced by ``inner`` nested ``depth`` lists deep.

    Built as text: neither json.dumps nor hypothesis' printer should recurse that deep.
    """
    text = json.dumps(body, ensure_ascii=True, allow_nan=True)
    deep = "[" * depth + json.dumps(inner, ensure_ascii=True, allow_nan=True) + "]" * depth
    return text.replace(json.dumps(DEEP), deep).encode()


@st.composite
def hostile_requests(draw: st.DrawFn) -> tuple[str, dict[str, Any], int, Any]:
    path = draw(st.sampled_from(POST_PATHS))
    body = _base(path, "MODEL")
    kind = draw(st.sampled_from(["numbers", "numbers", "text", "nesting"]))
    depth, inner = 0, None
    if kind == "nesting":
        depth, inner = draw(st.integers(min_value=2, max_value=3000)), draw(NUMBER_LIKE)
    names = NUMERIC_FIELDS[_fields_of(path)] if kind != "text" else TEXT_FIELDS[_fields_of(path)]
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
        if kind == "numbers":
            value = draw(st.lists(EXTREME_INTS, max_size=3)) if name == "stop_token_ids" else draw(NUMBER_LIKE)
        elif kind == "text":
            value = draw(st.one_of(ODD_TEXT, st.lists(ODD_TEXT, min_size=1, max_size=3)))
        else:
            value = DEEP
        _set(body, path, name, value)
    if draw(st.booleans()) and path.startswith("/v1/"):
        body["stream"] = True
    return path, body, depth, inner


def test_property_hostile_inputs_get_2xx_or_4xx_and_the_server_survives(tiny_server):
    @settings(max_examples=220, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(hostile_requests())
    def check(case: tuple[str, dict[str, Any], int, Any]) -> None:
        path, body, depth, inner = case
        if body.get("model") == "MODEL":
            body["model"] = tiny_server.model_name
        response = _post_raw(tiny_server.url, path, _encode(body, depth, inner))
        _assert_client_error_or_success(response, case)

    check()
    _assert_serving(tiny_server)
