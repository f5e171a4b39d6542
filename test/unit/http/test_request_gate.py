"""The request gate of both request managers: while draining, requests admitted earlier (still being
tokenized at the stop signal) may start their generations and later ones are refused; after a failure
nothing starts.  The admission middleware counts a request as preparing until its first generation."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, assert_error
from lightllm.server.admission_scope import ADMISSION_KEY, generation_started
from lightllm.server.http.middleware.in_flight import Admission, AdmissionMiddleware, PreparingRequests
from lightllm.server.manager_errors import ServerUnavailableError
from lightllm.server.request_gate import RequestGate


def _request(arrived: float, book: PreparingRequests) -> SimpleNamespace:
    book.count += 1
    return SimpleNamespace(scope={ADMISSION_KEY: Admission(arrived, book)})


def test_draining_spares_requests_admitted_before_it() -> None:
    book = PreparingRequests()
    gate = RequestGate()
    early = _request(time.monotonic(), book)
    gate.check(early)
    gate.drain("shutting down", "server_shutting_down")
    gate.check(early)
    late = _request(time.monotonic() + 1, book)
    for refused in (late, None, SimpleNamespace(scope={})):
        with pytest.raises(ServerUnavailableError, match="shutting down"):
            gate.check(refused)
    gate.close("failed", "server_failed")
    with pytest.raises(ServerUnavailableError, match="shutting down"):
        gate.check(early)  # the first refusal's message stays, as before
    assert not gate.open


def test_a_request_counts_as_preparing_until_its_first_generation_or_its_end() -> None:
    book = PreparingRequests()
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(book.count)
        generation_started(SimpleNamespace(scope=scope))
        generation_started(SimpleNamespace(scope=scope))  # a second choice of the same request
        seen.append(book.count)

    async def run(method: str) -> None:
        await AdmissionMiddleware(app, book)({"type": "http", "method": method}, None, None)

    asyncio.run(run("POST"))
    assert seen == [1, 0] and book.idle
    asyncio.run(run("GET"))
    assert seen[2:] == [0, 0]

    async def failing(scope, receive, send) -> None:
        raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError):
        asyncio.run(AdmissionMiddleware(failing, book)({"type": "http", "method": "POST"}, None, None))
    assert book.idle


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_json": {"type": "integer", "multipleOf": 99991}}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
    ("/generate_stream", {"inputs": "hi"}),
    # Not even read: a malformed body gets the drain's 503, not its 400.
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": -1}}),
    ("/generate_stream", "not JSON at all"),
])
def test_a_generation_request_arriving_during_a_drain_is_refused_before_any_work(
        client: TestClient, manager: FakeManager, path: str, body: dict | str) -> None:
    # Before, the refusal came only when the request reached the manager, after its parse, tokenization
    # and grammar check: seconds in the tokenizer threads' queue behind requests still in flight.
    manager.gate.drain("The server is shutting down and takes no new requests", "server_shutting_down")
    response = client.post(path, content=body) if isinstance(body, str) else client.post(path, json=body)
    error = assert_error(response, 503, None)
    assert error["code"] == "server_shutting_down" and "takes no new requests" in error["message"]
    assert manager.calls == [] and manager.served.chat_messages == []
    # The endpoints that generate nothing keep answering through the drain.
    assert client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}).status_code == 200


def test_the_drain_refusal_does_not_wait_for_the_clients_place() -> None:
    # A client (or a proxy, which every client shares) with its places all taken by requests being
    # prepared: a request it sends after the signal is refused at once, not after a place frees.
    from lightllm.server.http.app import create_app
    from lightllm.server.http.server_options import HttpLimits, HttpServerOptions

    manager = FakeManager()
    app = create_app(manager, HttpServerOptions(limits=HttpLimits(max_preparing_per_client=1)))
    client = TestClient(app, raise_server_exceptions=False)
    share = next(layer.kwargs["share"] for layer in app.user_middleware if "share" in layer.kwargs)
    held = asyncio.run(share.enter("testclient"))  # the client's only place, held by "another request"
    answers: list = []
    try:
        manager.gate.drain("The server is shutting down and takes no new requests", "server_shutting_down")
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        sender = threading.Thread(target=lambda: answers.append(client.post("/v1/completions", json=body)))
        sender.start()
        sender.join(30)  # a hang guard: before, the request waited for the place held here
        assert answers, "the request waited for its client's place"
    finally:
        held()
    error = assert_error(answers[0], 503, None)
    assert error["code"] == "server_shutting_down" and manager.calls == []


def test_the_drain_refusal_comes_after_the_key_check_and_carries_cors_headers() -> None:
    from lightllm.server.http.app import create_app
    from lightllm.server.http.server_options import AuthPolicy, HttpServerOptions

    manager = FakeManager()
    client = TestClient(create_app(manager, HttpServerOptions(auth=AuthPolicy(api_keys=("secret",)))),
                        raise_server_exceptions=False)
    manager.gate.drain("The server is shutting down and takes no new requests", "server_shutting_down")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    # A client without a valid key learns nothing of the server's state: its key is what is wrong.
    assert_error(client.post("/v1/completions", json=body), 401, None, "missing_api_key")
    assert_error(client.post("/v1/completions", json=body, headers={"authorization": "Bearer wrong"}), 401, None,
                 "invalid_api_key")
    answer = client.post("/v1/completions", json=body,
                         headers={"authorization": "Bearer secret", "origin": "https://app.example.com"})
    assert_error(answer, 503, None, "server_shutting_down")
    assert answer.headers.get("access-control-allow-origin") == "*"  # a browser page can read it


def test_a_request_that_arrived_before_the_drain_starts_after_waiting_for_its_place() -> None:
    # In flight when the signal came (waiting for its client's place): it may still start, as
    # failure_handling.md's drain says; the drain's early refusal is for requests arriving after it.
    from lightllm.server.http.app import create_app
    from lightllm.server.http.server_options import HttpLimits, HttpServerOptions

    manager = FakeManager()
    app = create_app(manager, HttpServerOptions(limits=HttpLimits(max_preparing_per_client=1)))
    share = next(layer.kwargs["share"] for layer in app.user_middleware if "share" in layer.kwargs)
    with TestClient(app, raise_server_exceptions=False) as client:
        held = client.portal.call(share.enter, "testclient")
        answers: list = []
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        sender = threading.Thread(target=lambda: answers.append(client.post("/v1/completions", json=body)))
        sender.start()
        for _ in range(3000):  # until the request waits for the place (a hang guard, not a timing)
            if client.portal.call(share.waiting, "testclient"):
                break
            time.sleep(0.01)
        assert client.portal.call(share.waiting, "testclient") == 1
        manager.gate.drain("The server is shutting down and takes no new requests", "server_shutting_down")
        client.portal.call(held)
        sender.join(30)
        assert answers and answers[0].status_code == 200, answers and answers[0].text


@pytest.mark.parametrize("path", ["/ping", "/liveness", "/readiness"])
def test_a_probes_post_is_not_admitted_and_answers_as_its_get_after_the_book_closes(path: str) -> None:
    book = PreparingRequests()
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append((ADMISSION_KEY in scope, book.count))

    async def run(method: str) -> None:
        await AdmissionMiddleware(app, book)({"type": "http", "method": method, "path": path}, None, None)

    asyncio.run(run("POST"))
    book.close("The server stopped serving", "server_shutting_down")
    asyncio.run(run("POST"))  # reaches the probe's route, as a GET does, instead of the closing 503
    asyncio.run(run("GET"))
    assert seen == [(False, 0)] * 3
