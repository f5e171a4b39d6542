"""Grammar checks run on their own thread: a plain request never waits behind another client's
costly check, and a grammar checked before is not checked again."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager
from lightllm.server.http.openai import grammar_thread
from lightllm.server.http.errors import APIError
from lightllm.server.http.structured.response_format import _no_output_reason, compile_json_schema


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _hold_the_grammar_thread() -> tuple[threading.Event, threading.Event]:
    """Occupy the grammar thread until the returned release event is set (a check that takes long);
    the second event is set once the thread is free again."""
    started, release, freed = threading.Event(), threading.Event(), threading.Event()

    def costly_check() -> None:
        started.set()
        release.wait(60)
        freed.set()

    grammar_thread._WORKERS.submit(costly_check)
    assert started.wait(30)
    return release, freed


def test_plain_requests_and_tokenize_do_not_wait_behind_a_grammar_check(client: TestClient,
                                                                       manager: FakeManager) -> None:
    # Before, grammar checks shared the two tokenizer threads: twelve costly ones held a plain
    # request 13 s.  Here the grammar thread stays busy for the whole test: were any plain request
    # queued behind it, it would not answer until release (after the asserts).
    release, freed = _hold_the_grammar_thread()
    try:
        for path, body in [
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "response_format": None}),
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "response_format": {"type": "text"}}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
            # Tools that force no call compile nothing: neither does the plan wait for the grammar thread.
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "tools": [TOOL], "tool_choice": "none"}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": []}),
            ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
            ("/tokenize", {"model": MODEL, "prompt": "hi"}),
        ]:
            assert client.post(path, json=body).status_code == 200, (path, body)
        # Options without a kind compile nothing: refused at once, not after the queue.
        options_only = {"model": MODEL, "prompt": "hi", "structured_outputs": {"disable_any_whitespace": True}}
        assert client.post("/v1/completions", json=options_only).status_code == 400
        assert not freed.is_set()  # every answer above came while the grammar thread was held
    finally:
        release.set()
    # A constrained request is checked on the grammar thread, once it is free.
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "guided_regex": "[ab]+"}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert manager.calls[-1].params.grammar is not None


def test_a_grammar_is_checked_once_and_then_remembered() -> None:
    schema = {"type": "object", "properties": {"grammar_thread_test": {"type": "integer", "multipleOf": 7}}}
    grammar = compile_json_schema(schema, "guided_json")
    before = _no_output_reason.cache_info()
    assert compile_json_schema(schema, "guided_json") == grammar
    after = _no_output_reason.cache_info()
    # The matcher build (up to a second for a costly schema) is not repeated for the same grammar.
    assert after.hits == before.hits + 1 and after.misses == before.misses


def test_a_client_that_leaves_takes_its_queued_check_off_the_grammar_thread() -> None:
    class GoneClient:
        async def is_disconnected(self) -> bool:
            return True

    ran = threading.Event()
    release, freed = _hold_the_grammar_thread()
    try:
        with pytest.raises(APIError) as refused:
            asyncio.run(grammar_thread.on_grammar_thread(ran.set, GoneClient()))
        assert refused.value.status_code == 499
    finally:
        release.set()
    assert freed.wait(30)
    # The next job runs after the cancelled one would have: it was skipped, not run late.
    asyncio.run(grammar_thread.on_grammar_thread(lambda: None))
    assert not ran.is_set()
