"""One client's requests being prepared are limited per client address; other clients never wait behind them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from lightllm.server.http.client_share import ClientShare, ClientShareMiddleware
from lightllm.server.http.in_flight import PreparingRequests, generation_started


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
