"""Test support for the HTTP-surface tests: a scripted request manager and response helpers.

The app under test is always the real ``create_app``; only the request manager behind it is
this test double, which yields scripted token events.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi.testclient import TestClient

from lightllm.common.basemodel.generation_defaults import GenerationDefaults
from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.manager_errors import ServerBusyError
from lightllm.server.prompt_length_probe import RenderedChatTooLongError, encode_within
from lightllm.server.request_gate import RequestGate

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
    stop_reason: int | str | None = None


def fake_word_ids(text: str, add_special_tokens: bool = True) -> list[int]:
    """The fake tokenizer's ids of ``text``."""
    return [BOS] * add_special_tokens + [10 + sum(map(ord, word)) % 80 for word in text.split()]


class FakeTokenizer:
    """The fake word tokenizer: one token per word, BOS first when special tokens are added (as Llama's)."""

    all_special_ids = [0, BOS, EOS]

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict[str, list[int]]:
        return {"input_ids": fake_word_ids(text, add_special_tokens)}

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{token_id}>" for token_id in ids)


@dataclass
class GenerateCall:
    prompt_ids: list[int]
    params: SamplingParams
    high_priority: bool
    request: Any
    spec: RequestSpec


class FakeServed:
    """The fake manager's served model (``manager.served``): the word tokenizer, small limits, and
    chats rendered as ``role: content`` words; it records the chats it renders (``chat_messages``)
    and the template options of the last one (``template_options``)."""

    def __init__(self) -> None:
        self.model_name = MODEL
        self.served_model_names = [MODEL]
        self.max_req_total_len = 64
        self.vocab_size = 100
        self.eos_token_ids = [EOS]
        self.tokenizer = FakeTokenizer()
        self.generation_defaults = GenerationDefaults()
        self.chat_messages: list[list[dict[str, Any]]] = []

    def encode_prompt(self, text: str, add_special_tokens: bool = True, within: int | None = None) -> list[int]:
        # One token per word; the real prefix probe decides what a limit refuses.
        return encode_within(lambda part: fake_word_ids(part, add_special_tokens), text, within)

    def encode_chat(self, messages: list[dict[str, Any]], within: int | None = None, max_chars: int | None = None,
                    **template_options: Any) -> list[int]:
        self.chat_messages.append(messages)
        self.template_options = template_options
        if any("BREAK_TEMPLATE" in message["content"] for message in messages):
            raise ValueError("chat template failed: unsupported message sequence")
        text = " ".join(f"{m['role']}: {m['content']}" for m in messages)
        if max_chars is not None and len(text) > max_chars:  # the served model's rule on its rendered text
            raise RenderedChatTooLongError(max_chars, len(text))
        return self.encode_prompt(text, within=within)

    def default_max_new_tokens(self, prompt_len: int, fallback: int | None = None) -> int:
        return min(8 if fallback is None else fallback, self.max_req_total_len - prompt_len)

    def structured_output_problem(self) -> str | None:
        # The fake's grammars never reach a matcher; the real check runs in the integration tests.
        return None


class FakeManager:
    """Test double for HttpServerManager: a word tokenizer and scripted generations.

    ``served`` (default a :class:`FakeServed`) is the model it serves.  Each generation yields
    ``min(max_new_tokens, reply_len)`` tokens with text ``" w<i>"`` (token 1 has empty text, like a
    partial UTF-8 character); it finishes with "length" when max_new_tokens cut it short, else "stop".
    """

    def __init__(self, served: FakeServed | None = None) -> None:
        self.served = served if served is not None else FakeServed()
        self.max_generations_per_request: int | None = None
        self.max_top_logprob_generations_per_request: int | None = None
        self.generation_caps_source = "the server's"
        self.reply_len = 3
        self.step_seconds = 0.0  # how long each token takes
        self.cached_tokens = 2
        self.token_logprob = -0.5
        self.failure: str | None = None
        self.healthy = True
        # The real gate: drain() it to refuse requests that arrive from then on, as the manager's.
        self.gate = RequestGate()
        self.calls: list[GenerateCall] = []
        # (n, prompts) of every on_request_params call: the requests whose generations started.
        self.request_params: list[tuple[int, int]] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def health(self) -> bool:
        return self.healthy

    def check_admission(self, request: Any = None) -> None:
        self.gate.check(request)

    def metrics_text(self) -> tuple[bytes, str]:
        return b"lightllm_requests_total 3\n", "text/plain; version=0.0.4; charset=utf-8"

    def on_request_params(self, n: int, prompts: int = 1) -> None:
        self.request_params.append((n, prompts))

    async def generate(self, spec: RequestSpec, *, request: Any = None) -> AsyncIterator[FakeEvent]:
        prompt_ids, params = list(spec.prompt_ids), spec.params
        self.gate.check(request)
        self.calls.append(GenerateCall(prompt_ids, params, spec.priority.high_priority_request, request, spec))
        if self.failure == "busy":
            raise ServerBusyError("no free request slot")
        if self.failure == "reject":
            raise ValueError("request refused by the manager")
        if self.failure == "crash":
            raise RuntimeError("secret internal detail")
        if self.failure == "nothing":
            return  # as the manager ends a generation whose client left before its first event
        count = min(params.max_new_tokens, self.reply_len)
        for i in range(count):
            await asyncio.sleep(self.step_seconds)
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
            if self.failure == "rank_error" and last:
                finish = "error"  # the model rank finished the request with FINISH_ERROR
            if self.failure == "grammar_failed" and last:
                finish = "grammar_failed"  # its grammar could not go on (FINISH_GRAMMAR_FAILED)
            yield FakeEvent(len(self.calls), token_id, "" if i == 1 else f" w{i}", self.token_logprob, finish,
                            len(prompt_ids), self.cached_tokens, i + 1, top)
        if self.failure == "finish_marker":
            yield FakeEvent(len(self.calls), -1, "", 0.0, "stop", len(prompt_ids), self.cached_tokens, count, None)


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
