"""``best_of`` keeps the most likely generations, but the request reports its prompt's cache hit
as its first generation saw it: a later generation may adopt the prefix the first one computed."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeEvent, FakeManager, GenerateCall
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.http.app import create_app


class AdoptingManager(FakeManager):
    """The first generation of a prompt finds nothing cached; later ones adopt its 64-token prefix
    and, here, are more likely (so best_of keeps a later one)."""

    async def generate(self, spec: RequestSpec, *, request: Any = None) -> AsyncIterator[FakeEvent]:
        self.calls.append(GenerateCall(list(spec.prompt_ids), spec.params, False, request, spec))
        call = len(self.calls)
        cached = 0 if call == 1 else 64
        logprob = -3.0 if call == 1 else -0.1 * call
        for i in range(2):
            yield FakeEvent(call, 20 + i, f" w{i}", logprob, "length" if i == 1 else None, 80, cached, i + 1, None)


def _client() -> TestClient:
    return TestClient(create_app(AdoptingManager()), raise_server_exceptions=False)


def test_completions_best_of_reports_the_first_generations_cache_hit() -> None:
    for n in (1, 2):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "n": n, "best_of": 3, "temperature": 0.8}
        usage = _client().post("/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens"] == 80 and usage["prompt_tokens_details"]["cached_tokens"] == 0, (n, usage)
        assert usage["completion_tokens"] == 2 * n


def test_chat_best_of_reports_the_first_generations_cache_hit() -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "n": 1,
            "best_of": 3, "temperature": 0.8}
    response = _client().post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_generate_best_of_reports_the_first_generations_cache_hit() -> None:
    for n in (1, 2):
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "n": n, "best_of": 3, "do_sample": True}}
        answer = _client().post("/generate", json=body).json()
        assert answer["prompt_cache_len"] == 0, (n, answer)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "best_of": 3, "do_sample": True,
                                              "return_details": True}}
    answer = _client().post("/generate", json=body).json()
    assert answer["prompt_cache_len"] == answer["details"]["prompt_cache_len"] == 0, answer
