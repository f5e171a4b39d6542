"""HTTP surface tests: request validation, error bodies and response shapes.

The app under test is the real ``create_app``; only the request manager behind it is a
test double that yields scripted token events, so the tests exercise exactly the HTTP
layer's parsing, validation, fan-out and response shaping.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import pytest
from fastapi.testclient import TestClient

from lightllm.common.sampling import SamplingParams
from lightllm.server.api_http import create_app

MODEL = "tiny-test-model"
BOS = 1
EOS = 2


@dataclass
class FakeEvent:
    request_id: int
    token_id: int
    text: str
    logprob: float
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    top_logprobs: dict[int, float] | None


class ServerBusyError(Exception):
    """Same class name as the real manager's busy error."""


class FakeTokenizer:
    all_special_ids = [0, BOS, EOS]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{token_id}>" for token_id in ids)


@dataclass
class GenerateCall:
    prompt_ids: list[int]
    params: SamplingParams
    high_priority: bool
    request: Any


class FakeManager:
    """Test double for HttpServerManager: a word tokenizer and scripted generations.

    Each generation yields ``min(max_new_tokens, reply_len)`` tokens with text ``" w<i>"``
    (token 1 has empty text, like a partial UTF-8 character); it finishes with "length"
    when max_new_tokens cut it short, else "stop".
    """

    def __init__(self) -> None:
        self.model_name = MODEL
        self.max_req_total_len = 64
        self.vocab_size = 100
        self.eos_token_ids = [EOS]
        self.tokenizer = FakeTokenizer()
        self.reply_len = 3
        self.cached_tokens = 2
        self.token_logprob = -0.5
        self.failure: str | None = None
        self.healthy = True
        self.calls: list[GenerateCall] = []
        self.chat_messages: list[list[dict[str, Any]]] = []

    def encode_prompt(self, text: str) -> list[int]:
        return [BOS] + [10 + sum(map(ord, word)) % 80 for word in text.split()]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        self.chat_messages.append(messages)
        if any("BREAK_TEMPLATE" in message["content"] for message in messages):
            raise ValueError("chat template failed: unsupported message sequence")
        return self.encode_prompt(" ".join(f"{m['role']}: {m['content']}" for m in messages))

    def health(self) -> bool:
        return self.healthy

    def metrics_text(self) -> tuple[bytes, str]:
        return b"lightllm_requests_total 3\n", "text/plain; version=0.0.4; charset=utf-8"

    def default_max_new_tokens(self, prompt_len: int) -> int:
        return min(8, self.max_req_total_len - prompt_len)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, high_priority: bool = False,
                       request: Any = None) -> AsyncIterator[FakeEvent]:
        self.calls.append(GenerateCall(list(prompt_ids), params, high_priority, request))
        if self.failure == "busy":
            raise ServerBusyError("no free request slot")
        if self.failure == "reject":
            raise ValueError("request refused by the manager")
        if self.failure == "crash":
            raise RuntimeError("secret internal detail")
        count = min(params.max_new_tokens, self.reply_len)
        for i in range(count):
            await asyncio.sleep(0)
            if self.failure == "mid_stream" and i == 1:
                raise RuntimeError("lost the detokenizer")
            last = i == count - 1
            finish = None if not last else ("length" if params.max_new_tokens <= self.reply_len else "stop")
            token_id = 20 + i
            top = None
            if params.logprobs:
                top = {token_id + k: -0.5 - k for k in range(params.logprobs)}
            if self.failure == "vanish" and last:
                return
            if self.failure == "finish_marker" and last:
                finish = None
            yield FakeEvent(len(self.calls), token_id, "" if i == 1 else f" w{i}", self.token_logprob, finish,
                            len(prompt_ids), self.cached_tokens, i + 1, top)
        if self.failure == "finish_marker":
            yield FakeEvent(len(self.calls), -1, "", 0.0, "stop", len(prompt_ids), self.cached_tokens, count, None)


@pytest.fixture()
def manager() -> FakeManager:
    return FakeManager()


@pytest.fixture()
def client(manager: FakeManager) -> TestClient:
    return TestClient(create_app(manager), raise_server_exceptions=False)


def sse_events(response: Any) -> list[Any]:
    """Decoded ``data:`` payloads of an SSE body; ``[DONE]`` stays a string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response: Any, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code
    return error


def completion(client: TestClient, **fields: Any) -> Any:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", **fields})


def chat(client: TestClient, **fields: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return client.post("/v1/chat/completions", json=body)


# ---------------------------------------------------------------- service endpoints


def test_models_lists_the_served_model(client: TestClient) -> None:
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    assert data["data"] == [{"id": MODEL, "object": "model", "created": 0, "owned_by": "lightllm",
                             "max_model_len": 64}]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(client.get("/v1/models/other"), 404, "model", "model_not_found")


def test_health_and_metrics(client: TestClient, manager: FakeManager) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.head("/health").status_code == 200
    manager.healthy = False
    assert_error(client.get("/health"), 503)
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.text == "lightllm_requests_total 3\n"
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")


def test_unknown_route_and_method_are_json_errors(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404, code="not_found")
    assert_error(client.get("/v1/completions"), 405, code="method_not_allowed")


# ---------------------------------------------------------------- /v1/completions


def test_completion_response_shape(client: TestClient, manager: FakeManager) -> None:
    response = completion(client, max_tokens=5, stop=["END"], temperature=0.5, seed=7)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["id"].startswith("cmpl-")
    assert data["object"] == "text_completion"
    assert data["model"] == MODEL
    assert isinstance(data["created"], int)
    assert data["choices"] == [{"index": 0, "text": " w0 w2", "logprobs": None, "finish_reason": "stop"}]
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    params = manager.calls[0].params
    assert params.stop_sequences == ["END"]
    assert params.max_new_tokens == 5 and params.temperature == 0.5 and params.seed == 7
    assert manager.calls[0].prompt_ids == manager.encode_prompt("hello there")
    assert manager.calls[0].high_priority is False


def test_completion_default_max_tokens_and_length_finish(client: TestClient, manager: FakeManager) -> None:
    manager.reply_len = 20
    data = completion(client).json()
    assert manager.calls[0].params.max_new_tokens == 8
    assert data["choices"][0]["finish_reason"] == "length"


def test_completion_multiple_prompts_times_n(client: TestClient, manager: FakeManager) -> None:
    data = completion(client, prompt=["one", "two words"], n=2, seed=5).json()
    assert [choice["index"] for choice in data["choices"]] == [0, 1, 2, 3]
    prompts_by_call = sorted((len(call.prompt_ids), call.params.seed) for call in manager.calls)
    assert prompts_by_call == [(2, 5), (2, 6), (3, 5), (3, 6)]
    assert data["usage"]["prompt_tokens"] == 2 + 3
    assert data["usage"]["completion_tokens"] == 4 * 3


def test_completion_token_id_prompts(client: TestClient, manager: FakeManager) -> None:
    assert completion(client, prompt=[5, 6, 7]).status_code == 200
    assert manager.calls[-1].prompt_ids == [5, 6, 7]
    data = completion(client, prompt=[[5], [6, 7]]).json()
    assert len(data["choices"]) == 2
    assert_error(completion(client, prompt=[5, 100]), 400, "prompt")
    assert_error(completion(client, prompt=[[5], [-1]]), 400, "prompt")


def test_completion_stream_chunks(client: TestClient) -> None:
    response = completion(client, stream=True, max_tokens=3, stream_options={"include_usage": True})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3 and usage_chunk["usage"]["total_tokens"] == 6
    # Token 1 has empty text and is not sent; the last token's chunk carries finish_reason.
    assert [chunk["choices"][0]["text"] for chunk in chunks] == [" w0", " w2"]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, "length"]
    assert all(chunk["usage"] is None and chunk["object"] == "text_completion" for chunk in chunks)
    assert len({chunk["id"] for chunk in events[:-1]}) == 1


def test_completion_stream_without_usage_and_with_n(client: TestClient) -> None:
    events = sse_events(completion(client, stream=True, n=2))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" not in chunk for chunk in chunks)
    for index in (0, 1):
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert "".join(choice["text"] for choice in mine) == " w0 w2"
        assert mine[-1]["finish_reason"] == "stop" and all(c["finish_reason"] is None for c in mine[:-1])


def test_completion_logprobs_shape(client: TestClient, manager: FakeManager) -> None:
    data = completion(client, logprobs=2).json()
    assert manager.calls[0].params.logprobs == 2
    logprobs = data["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<20>", "<21>", "<22>"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert logprobs["text_offset"] == [0, 3, 3]
    assert logprobs["top_logprobs"][0] == {"<20>": -0.5, "<21>": -1.5}


def test_non_finite_logprobs_stay_valid_json(client: TestClient, manager: FakeManager) -> None:
    manager.token_logprob = float("-inf")
    response = completion(client, logprobs=0)
    assert response.status_code == 200
    assert response.json()["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0] * 3
    events = sse_events(client.post("/generate_stream", json={"inputs": "hi"}))
    assert [event["token"]["logprob"] for event in events] == [-9999.0] * 3


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"echo": True}, "echo"),
        ({"suffix": "tail"}, "suffix"),
        ({"logprobs": 6}, "logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["ok", 5]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"model": None}, "model"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"infer_high_priority": -1}, "infer_high_priority"),
    ],
)
def test_completion_invalid_fields(client: TestClient, manager: FakeManager, fields: dict[str, Any],
                                   param: str) -> None:
    assert_error(completion(client, **fields), 400, param)
    assert manager.calls == []


def test_missing_model_and_unknown_model(client: TestClient) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": "x"}), 400, "model")
    assert_error(completion(client, model="gpt-4"), 404, "model", "model_not_found")
    assert_error(chat(client, model="gpt-4"), 404, "model", "model_not_found")


def test_malformed_and_non_object_json(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream"):
        error = assert_error(client.post(path, content=b'{"model": ', headers=headers), 400)
        assert "JSON" in error["message"]
        assert_error(client.post(path, content=b"[1, 2]", headers=headers), 400)
        assert_error(client.post(path, content=b"\xff\xfe", headers=headers), 400)


def test_context_length_errors(client: TestClient, manager: FakeManager) -> None:
    long_prompt = " ".join(["word"] * 70)
    error = assert_error(completion(client, prompt=long_prompt, max_tokens=4), 400, "prompt",
                         "context_length_exceeded")
    assert error["message"].startswith("This model's maximum context length is 64 tokens. However, you "
                                       "requested 75 tokens (71 in the prompt, 4 in the completion)")
    error = assert_error(completion(client, prompt="a b", max_tokens=62), 400, "max_tokens")
    assert "64" in error["message"]
    assert completion(client, prompt="a b", max_tokens=61).status_code == 200
    assert_error(chat(client, max_tokens=62), 400, "max_tokens", "context_length_exceeded")
    assert_error(client.post("/generate", json={"inputs": long_prompt}), 400, "inputs")


# ---------------------------------------------------------------- manager failures


@pytest.mark.parametrize("stream", [False, True])
def test_manager_errors_map_to_status(client: TestClient, manager: FakeManager, stream: bool) -> None:
    manager.failure = "busy"
    assert_error(completion(client, stream=stream), 503, code="server_busy")
    manager.failure = "reject"
    assert "refused" in assert_error(chat(client, stream=stream), 400)["message"]
    manager.failure = "crash"
    response = client.post("/generate_stream" if stream else "/generate", json={"inputs": "hi"})
    error = assert_error(response, 500, code="internal_error")
    assert "secret" not in response.text and "Traceback" not in response.text
    assert error["type"] == "server_error"


def test_failure_after_stream_started_is_reported_in_stream(client: TestClient, manager: FakeManager) -> None:
    manager.failure = "mid_stream"
    events = sse_events(completion(client, stream=True))
    assert events[0]["choices"][0]["text"] == " w0"
    assert events[-2]["error"]["type"] == "server_error" and "lost" not in json.dumps(events)
    assert events[-1] == "[DONE]"
    assert completion(client).status_code == 500


def test_finish_event_without_token(client: TestClient, manager: FakeManager) -> None:
    manager.failure = "finish_marker"
    data = completion(client, logprobs=1).json()
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["choices"][0]["logprobs"]["tokens"] == ["<20>", "<21>", "<22>"]
    chunks = sse_events(chat(client, stream=True, logprobs=True))[:-1]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {"content": ""}, "logprobs": {"content": []},
                                        "finish_reason": "stop"}
    native = client.post("/generate", json={"inputs": "hi", "parameters": {"return_details": True}}).json()
    assert [token["id"] for token in native["details"]["tokens"]] == [20, 21, 22]
    assert native["count_output_tokens"] == 3 and native["finish_reason"] == "stop"


def test_generation_cut_off_without_finish_is_reported_as_abort(client: TestClient, manager: FakeManager) -> None:
    manager.failure = "vanish"
    assert completion(client).json()["choices"][0]["finish_reason"] == "abort"
    assert client.post("/generate", json={"inputs": "hi"}).json()["finish_reason"] == "abort"


# ---------------------------------------------------------------- /v1/chat/completions


def test_chat_response_shape(client: TestClient, manager: FakeManager) -> None:
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None}, {"role": "user", "content": "go"}]
    data = chat(client, messages=messages, max_completion_tokens=6, max_tokens=2).json()
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert data["choices"] == [{"index": 0, "message": {"role": "assistant", "content": " w0 w2"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert data["usage"]["completion_tokens"] == 3
    assert manager.chat_messages[0] == [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "a\nb"},
                                        {"role": "assistant", "content": ""}, {"role": "user", "content": "go"}]
    assert manager.calls[0].params.max_new_tokens == 6


def test_chat_stream_chunks(client: TestClient) -> None:
    events = sse_events(chat(client, stream=True, n=2, max_tokens=3, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None for chunk in chunks)
    for index in (0, 1):
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [choice["delta"] for choice in mine[1:]] == [{"content": " w0"}, {"content": " w2"}]
        assert [choice["finish_reason"] for choice in mine] == [None, None, "length"]


def test_chat_logprobs_shape(client: TestClient, manager: FakeManager) -> None:
    data = chat(client, logprobs=True, top_logprobs=2).json()
    assert manager.calls[0].params.logprobs == 2
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert content[0] == {"token": "<20>", "logprob": -0.5, "bytes": list(b"<20>"),
                          "top_logprobs": [{"token": "<20>", "logprob": -0.5, "bytes": list(b"<20>")},
                                           {"token": "<21>", "logprob": -1.5, "bytes": list(b"<21>")}]}
    assert chat(client).json()["choices"][0]["logprobs"] is None
    assert manager.calls[-1].params.logprobs is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}, "messages.1.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "a", "weight": 1}]}, "messages.0.weight"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}, "messages.0.tool_calls"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "BREAK_TEMPLATE"}]}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_chat_invalid_fields(client: TestClient, manager: FakeManager, fields: dict[str, Any], param: str) -> None:
    error = assert_error(chat(client, **fields), 400, param)
    if param == "messages.1.role":
        assert "wizard" in error["message"] and "messages.1.role" in error["message"]
    assert manager.calls == []


# ---------------------------------------------------------------- native endpoints


def test_native_generate_shape(client: TestClient, manager: FakeManager) -> None:
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 5, "stop_sequences": "END", "do_sample": False,
                                              "return_details": True, "logprobs": 1}}
    data = client.post("/generate", json=body).json()
    assert data["generated_text"] == [" w0 w2"]
    assert data["count_output_tokens"] == 3 and data["finish_reason"] == "stop"
    assert data["prompt_tokens"] == 2 and data["prompt_cache_len"] == 2
    details = data["details"]
    assert details["count_output_tokens"] == 3 and details["finish_reason"] == "stop"
    assert details["tokens"][0] == {"id": 20, "text": " w0", "logprob": -0.5, "special": False,
                                    "top_logprobs": {"20": -0.5}}
    params = manager.calls[0].params
    assert params.stop_sequences == ["END"] and params.do_sample is False and params.max_new_tokens == 5
    assert "details" not in client.post("/generate", json={"inputs": "hello"}).json()


def test_native_stream_shape(client: TestClient) -> None:
    events = sse_events(client.post("/generate_stream", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}))
    assert "[DONE]" not in events and len(events) == 3
    assert events[0] == {"token": {"id": 20, "text": " w0", "logprob": -0.5, "special": False,
                                   "count_output_tokens": 1, "prompt_tokens": 2},
                         "generated_text": None, "finished": False, "finish_reason": None, "details": None}
    last = events[-1]
    assert last["finished"] is True and last["finish_reason"] == "length"
    assert last["generated_text"] == " w0 w2" and last["token"]["count_output_tokens"] == 3


def test_high_priority_request_reaches_manager(client: TestClient, manager: FakeManager) -> None:
    client.post("/generate", json={"inputs": "hi", "high_priority_request": True})
    client.post("/generate_stream", json={"inputs": "hi"})
    assert [call.high_priority for call in manager.calls] == [True, False]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"inputs": "hi", "parameters": {"infer_high_priority": -1}}, "parameters.infer_high_priority"),
        ({"inputs": "hi", "infer_high_priority": -1}, "infer_high_priority"),
        ({"inputs": "hi", "parameters": {"best_of": 2}}, "parameters.best_of"),
        ({"inputs": "hi", "high_priority_request": "yes"}, "high_priority_request"),
        ({"inputs": ""}, "inputs"),
        ({"inputs": 5}, "inputs"),
        ({"parameters": {}}, "inputs"),
        ({"inputs": "hi", "parameters": {"top_p": 2.0}}, "parameters.top_p"),
        ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
        ({"inputs": "hi", "parameters": {"temperature": -1}}, "parameters.temperature"),
        ({"inputs": "hi", "parameters": {"stop_token_ids": [100]}}, "parameters.stop_token_ids"),
        ({"inputs": "hi", "multimodal_params": {"images": [{"type": "url"}]}}, "multimodal_params"),
    ],
)
@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_native_invalid_requests(client: TestClient, manager: FakeManager, body: dict[str, Any], param: str,
                                 path: str) -> None:
    error = assert_error(client.post(path, json=body), 400, param)
    assert param.split(".")[-1] in error["message"]
    assert manager.calls == []


def test_native_accepts_absent_multimodal_params(client: TestClient) -> None:
    for extra in ({}, {"multimodal_params": None}, {"multimodal_params": {"images": []}}):
        assert client.post("/generate", json={"inputs": "hi", **extra}).status_code == 200


# ---------------------------------------------------------------- official client


def test_official_openai_client_parses_responses(client: TestClient) -> None:
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    assert [model.id for model in sdk.models.list()] == [MODEL]
    completion_result = sdk.completions.create(model=MODEL, prompt="hello", max_tokens=5, n=2)
    assert [choice.text for choice in completion_result.choices] == [" w0 w2", " w0 w2"]
    assert completion_result.usage.total_tokens == 2 + 6
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == " w0 w2"
    assert chunks[-1].usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert caught.value.body["param"] == "temperature"
