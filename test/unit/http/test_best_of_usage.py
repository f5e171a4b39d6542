"""A request with several generations of one prompt (``n``, ``best_of``) reports the prompt's
cache hit as the smallest among its generations: each generation is a request of its own, and
one that reaches the prefix cache after a sibling computed the prompt adopts that prefix.

On a normal server the first generation is the one that computes (:class:`AdoptingManager`);
through a PD master any generation may reach the prefill node first, the first one included
(:class:`FirstAdoptsManager`).  Either way a never-seen prompt reports no hit."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeEvent, FakeManager, GenerateCall
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.http.app import create_app


class AdoptingManager(FakeManager):
    """The first generation of a prompt finds nothing cached; later ones adopt its 64-token prefix
    and, here, are more likely (so best_of keeps a later one)."""

    def cached(self, call: int) -> int:
        """The hit generation ``call`` (from 1, in submission order) reports."""
        return 0 if call == 1 else 64

    async def generate(self, spec: RequestSpec, *, request: Any = None) -> AsyncIterator[FakeEvent]:
        self.calls.append(GenerateCall(list(spec.prompt_ids), spec.params, False, request, spec))
        call = len(self.calls)
        cached = self.cached(call)
        logprob = -3.0 if call == 1 else -0.1 * call
        for i in range(2):
            yield FakeEvent(call, 20 + i, f" w{i}", logprob, "length" if i == 1 else None, 80, cached, i + 1, None)


class FirstAdoptsManager(AdoptingManager):
    """The PD order: the second generation reached the prefill node first and computed the prompt;
    the first and third adopted its prefix."""

    def cached(self, call: int) -> int:
        return 0 if call == 2 else 64


MANAGERS = [AdoptingManager, FirstAdoptsManager]


def _client(manager: type = AdoptingManager) -> TestClient:
    return TestClient(create_app(manager()), raise_server_exceptions=False)


@pytest.mark.parametrize("manager", MANAGERS)
def test_completions_best_of_reports_the_smallest_cache_hit(manager) -> None:
    for n in (1, 2):
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "n": n, "best_of": 3, "temperature": 0.8}
        usage = _client(manager).post("/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens"] == 80 and usage["prompt_tokens_details"]["cached_tokens"] == 0, (n, usage)
        assert usage["completion_tokens"] == 2 * n


@pytest.mark.parametrize("manager", MANAGERS)
def test_chat_best_of_reports_the_smallest_cache_hit(manager) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "n": 1,
            "best_of": 3, "temperature": 0.8}
    response = _client(manager).post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("manager", MANAGERS)
def test_generate_best_of_reports_the_smallest_cache_hit(manager) -> None:
    for n in (1, 2):
        body = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "n": n, "best_of": 3, "do_sample": True}}
        answer = _client(manager).post("/generate", json=body).json()
        assert answer["prompt_cache_len"] == 0, (n, answer)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "best_of": 3, "do_sample": True,
                                              "return_details": True}}
    answer = _client(manager).post("/generate", json=body).json()
    assert answer["prompt_cache_len"] == answer["details"]["prompt_cache_len"] == 0, answer


@pytest.mark.parametrize("manager", MANAGERS)
def test_n_choices_report_the_smallest_cache_hit(manager) -> None:
    """``n`` > 1 without ``best_of``: the usage (final, streamed or not) and ``/generate``'s
    ``prompt_cache_len`` report no hit; each choice's continuous usage keeps its own.  A fresh
    manager per request: the hits go by the order of its generations."""
    for path, extra in (("/v1/completions", {"prompt": "hello"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]})):
        body = {"model": MODEL, "max_tokens": 2, "n": 3, "temperature": 0.8, **extra}
        usage = _client(manager).post(path, json=body).json()["usage"]
        assert usage["prompt_tokens"] == 80 and usage["prompt_tokens_details"]["cached_tokens"] == 0, (path, usage)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        chunks = [json.loads(line[6:]) for line in _client(manager).post(path, json=stream).text.splitlines()
                  if line.startswith("data: {")]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        own = {chunk["choices"][0]["index"]: chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
               for chunk in chunks[:-1]}
        assert sorted(own.values()) == [0, 64, 64], own
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "n": 3, "do_sample": True}}
    answer = _client(manager).post("/generate", json=body).json()
    assert answer["prompt_cache_len"] == 0 and len(answer["generated_text"]) == 3, answer
