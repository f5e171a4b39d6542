"""One client's requests being prepared are limited per client address; other clients never wait behind them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from lightllm.server.http.middleware.client_share import ClientShare, ClientShareMiddleware
from lightllm.server.admission_scope import generation_started
from lightllm.server.http.middleware.in_flight import PreparingRequests


def test_places_are_per_client_and_handed_over_in_arrival_order() -> None:
    async def scenario() -> None:
        share = ClientShare(2)
        first, second = await share.enter("a"), await share.enter("a")
        third = asyncio.ensure_future(share.enter("a"))
        fourth = asyncio.ensure_future(share.enter("a"))
        await asyncio.sleep(0)
        assert not third.done() and share.waiting("a") == 2
        other = await share.enter("b")  # another client is not behind client a
        first()
        release_third = await third
        assert not fourth.done() and share.active("a") == 2
        first()  # a release is idempotent: it hands over no second place
        await asyncio.sleep(0)
        assert not fourth.done()
        second()
        release_fourth = await fourth
        for release in (release_third, release_fourth, other):
            release()
        assert share.active("a") == share.active("b") == 0

    asyncio.run(scenario())


def test_a_waiter_that_gives_up_leaves_the_line() -> None:
    async def scenario() -> None:
        share = ClientShare(1)
        holder = await share.enter("a")
        quitter = asyncio.ensure_future(share.enter("a"))
        nextone = asyncio.ensure_future(share.enter("a"))
        await asyncio.sleep(0)
        quitter.cancel()
        await asyncio.sleep(0)
        assert share.waiting("a") == 1
        holder()
        (await nextone)()
        assert share.active("a") == 0 and share.waiting("a") == 0
        with pytest.raises(ValueError):
            ClientShare(0)

    asyncio.run(scenario())


def _app(limit: int, release: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.get("/hold")
    async def hold() -> dict:
        await release.wait()
        return {"held": True}

    @app.get("/quick")
    async def quick() -> dict:
        return {"ok": True}

    @app.get("/generate")
    async def generate(request: Request) -> dict:
        generation_started(request)  # reached the engine: no longer holds its client's place
        await release.wait()
        return {"generated": True}

    for path in ("/health", "/metrics", "/pd/node/decode"):
        app.add_api_route(path, quick, methods=["GET"])
    app.add_middleware(ClientShareMiddleware, share=ClientShare(limit), book=PreparingRequests())
    return app


def test_the_middleware_holds_a_clients_extra_requests_but_not_the_others() -> None:
    async def scenario() -> None:
        release = asyncio.Event()
        app = _app(2, release)
        flooder = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("10.0.0.1", 1000)),
                                    base_url="http://x")
        other = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("10.0.0.2", 1000)),
                                  base_url="http://x")
        async with flooder, other:
            held = [asyncio.ensure_future(flooder.get("/hold")) for _ in range(2)]
            await asyncio.sleep(0.05)
            queued = asyncio.ensure_future(flooder.get("/quick"))
            await asyncio.sleep(0.05)
            assert not queued.done()  # the flooder's third request waits for one of its places
            assert (await other.get("/quick")).json() == {"ok": True}
            # Probes, metrics and the PD cluster's paths never wait.
            for path in ("/health", "/metrics", "/pd/node/decode"):
                assert (await flooder.get(path)).status_code == 200
            release.set()
            assert [(await response).status_code for response in held] == [200, 200]
            assert (await queued).json() == {"ok": True}

    asyncio.run(scenario())


def test_a_request_that_reached_the_engine_gives_its_place_back() -> None:
    async def scenario() -> None:
        release = asyncio.Event()
        app = _app(1, release)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("10.0.0.1", 1000)),
                                   base_url="http://x")
        async with client:
            generating = asyncio.ensure_future(client.get("/generate"))
            await asyncio.sleep(0.05)
            # The stream still runs, but the next request of the same client is prepared at once.
            assert (await asyncio.wait_for(client.get("/quick"), 30)).json() == {"ok": True}
            release.set()
            assert (await generating).json() == {"generated": True}

    asyncio.run(scenario())


def test_a_waiter_cancelled_while_a_place_is_released_in_the_same_turn_is_just_cancelled() -> None:
    """At shutdown the server cancels every request: a holder's release ran before the cancelled
    waiter resumed, dropped its turn, and the waiter then raised ValueError (a plain-text 500)."""
    async def scenario() -> None:
        share = ClientShare(1)
        holder = await share.enter("a")
        waiter = asyncio.ensure_future(share.enter("a"))
        await asyncio.sleep(0)
        waiter.cancel()
        holder()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert share.active("a") == 0 and share.waiting("a") == 0
        (await share.enter("a"))()  # the client is served again

    asyncio.run(scenario())


def test_requests_waiting_for_their_clients_share_when_a_drain_begins_are_served_and_counted() -> None:
    """The share sat outside the admission: a request still waiting for its place when SIGTERM came
    was admitted after it, refused as new (503), and the drain did not wait for it."""
    from starlette.requests import Request

    from lightllm.server.http.middleware.in_flight import AdmissionMiddleware
    from lightllm.server.request_gate import RequestGate

    book, gate, go, results = PreparingRequests(), RequestGate(), asyncio.Event(), []

    async def app(scope, receive, send) -> None:
        await go.wait()  # being read and tokenized
        try:
            gate.check(Request(scope))
            results.append("started")
        except Exception as exc:  # noqa: BLE001 - what the request would answer is what the test reads
            results.append(f"refused: {exc}")

    # The order create_app gives them: the admission outermost, the share inside it.
    stack = AdmissionMiddleware(ClientShareMiddleware(app, ClientShare(1), book), book)
    scope = {"type": "http", "path": "/generate", "method": "POST", "client": ("10.0.0.1", 1), "headers": []}

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        pass

    async def scenario() -> None:
        first = asyncio.ensure_future(stack(dict(scope), receive, send))
        second = asyncio.ensure_future(stack(dict(scope), receive, send))  # waits for the client's one place
        await asyncio.sleep(0.01)
        gate.drain("The server is shutting down", "server_shutting_down")
        assert book.count == 2  # the drain waits for both
        go.set()
        await asyncio.gather(first, second)
        assert results == ["started", "started"] and book.count == 0

    asyncio.run(scenario())


def test_the_app_admits_a_request_before_it_waits_for_its_clients_share() -> None:
    from api_fakes import FakeManager

    from lightllm.server.http.middleware.absolute_form import AbsoluteFormMiddleware
    from lightllm.server.http.app import create_app
    from lightllm.server.http.middleware.cors import JsonErrorCorsMiddleware
    from lightllm.server.http.middleware.in_flight import AdmissionMiddleware

    from lightllm.server.http.middleware.unread_body import UnreadBodyCloseMiddleware

    order = [entry.cls for entry in create_app(FakeManager()).user_middleware]  # outermost first
    # The unread-body rule only marks answers: it is around everything and delays nothing.
    assert order[:5] == [AbsoluteFormMiddleware, UnreadBodyCloseMiddleware, AdmissionMiddleware, ClientShareMiddleware,
                         JsonErrorCorsMiddleware]
