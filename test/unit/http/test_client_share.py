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

    from lightllm.server.http.in_flight import AdmissionMiddleware
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

    from lightllm.server.http.absolute_form import AbsoluteFormMiddleware
    from lightllm.server.http.app import create_app
    from lightllm.server.http.cors import JsonErrorCorsMiddleware
    from lightllm.server.http.in_flight import AdmissionMiddleware

    from lightllm.server.http.unread_body import UnreadBodyCloseMiddleware

    order = [entry.cls for entry in create_app(FakeManager()).user_middleware]  # outermost first
    # The unread-body rule only marks answers: it is around everything and delays nothing.
    assert order[:5] == [AbsoluteFormMiddleware, UnreadBodyCloseMiddleware, AdmissionMiddleware, ClientShareMiddleware,
                         JsonErrorCorsMiddleware]


def _body_stack(app, share: ClientShare, book: PreparingRequests):
    from lightllm.server.http.in_flight import AdmissionMiddleware
    from lightllm.server.http.request_guard import RequestGuardMiddleware

    # The order create_app gives them, outermost first.
    guarded = RequestGuardMiddleware(app, max_body_bytes=1 << 20, body_timeout=60)
    return AdmissionMiddleware(ClientShareMiddleware(guarded, share, book), book)


def _request_scope(client: str = "10.0.0.1") -> dict:
    return {"type": "http", "path": "/generate", "method": "POST", "client": (client, 1), "headers": []}


def _receiver(*parts: bytes, pause: asyncio.Event | None = None):
    """A client sending ``parts``, waiting for ``pause`` (when given) before the last one."""
    remaining = list(parts)

    async def receive() -> dict:
        if len(remaining) == 1 and pause is not None:
            await pause.wait()
        if not remaining:
            await asyncio.Event().wait()  # nothing more: a connection that stays open
        chunk = remaining.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(remaining)}

    return receive


def _recorder(into: list):
    async def send(message: dict) -> None:
        into.append(message)

    return send


def test_a_request_whose_body_stalls_lets_its_clients_next_request_have_its_place(monkeypatch) -> None:
    """A stalled upload held its client's place until its body deadline (60 s): the 16 places of one
    address behind a proxy were taken by 16 stalled uploads, and every other request waited 60 s."""
    from lightllm.server.http import request_guard

    monkeypatch.setattr(request_guard, "STEP_ASIDE_SECONDS", 0.05, raising=False)
    bodies: list = []

    async def app(scope, receive, send) -> None:
        bodies.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario() -> None:
        share, book = ClientShare(1), PreparingRequests()
        stack = _body_stack(app, share, book)
        rest, stalled_sent, next_sent = asyncio.Event(), [], []
        stalled = asyncio.ensure_future(stack(_request_scope(), _receiver(b'{"in', b'puts": 1}', pause=rest),
                                              _recorder(stalled_sent)))
        await asyncio.sleep(0.01)
        assert share.active("10.0.0.1") == 1
        following = asyncio.ensure_future(stack(_request_scope(), _receiver(b'{"inputs": 2}'), _recorder(next_sent)))
        await asyncio.wait_for(following, 10)  # served while the first body is still missing its end
        assert not stalled.done() and bodies == [b'{"inputs": 2}']
        assert share.active("10.0.0.1") == 0 and book.count == 1  # the drain still waits for it
        rest.set()
        await asyncio.wait_for(stalled, 30)
        assert bodies == [b'{"inputs": 2}', b'{"inputs": 1}']  # whole, and prepared with a place again
        assert [m.get("status") for m in stalled_sent + next_sent if m["type"] == "http.response.start"] == [200, 200]
        assert share.active("10.0.0.1") == 0 and share.waiting("10.0.0.1") == 0 and book.count == 0

    asyncio.run(scenario())


def test_requests_still_being_prepared_get_the_503_as_soon_as_the_server_stops_serving() -> None:
    """At the drain's deadline a request waiting for its client's place, or for the rest of its body,
    was ended only when the HTTP server cancelled its task, 2 s later, logged at ERROR."""
    import json

    never = asyncio.Event()

    async def app(scope, receive, send) -> None:
        await receive()
        await never.wait()  # being tokenized when the server stops

    async def scenario() -> None:
        share, book = ClientShare(1), PreparingRequests()
        stack = _body_stack(app, share, book)
        sent: dict = {"preparing": [], "waiting": [], "uploading": []}
        tasks = [asyncio.ensure_future(stack(_request_scope(), _receiver(b"{}"), _recorder(sent["preparing"]))),
                 asyncio.ensure_future(stack(_request_scope(), _receiver(b"{}"), _recorder(sent["waiting"]))),
                 asyncio.ensure_future(stack(_request_scope("10.0.0.2"), _receiver(b"{", b"}", pause=never),
                                             _recorder(sent["uploading"])))]
        await asyncio.sleep(0.05)
        assert book.count == 3 and share.waiting("10.0.0.1") == 1
        book.close("The server is shutting down: the drain ended", "server_shutting_down")
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        for messages in sent.values():
            assert messages[0]["status"] == 503
            assert json.loads(messages[1]["body"])["error"]["code"] == "server_shutting_down"
        assert book.count == 0 and share.active("10.0.0.1") == 0 and share.waiting("10.0.0.1") == 0

    asyncio.run(scenario())


def _dripping(parts: list, every_s: float):
    """A client sending one part every ``every_s`` seconds (never pausing long between them)."""
    async def receive() -> dict:
        if not parts:
            await asyncio.Event().wait()
        await asyncio.sleep(every_s)
        chunk = parts.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(parts)}

    return receive


def test_a_dripping_body_steps_aside_too_and_only_as_many_as_the_client_has_places(monkeypatch) -> None:
    """The step aside was timed from the last byte: a client sending a byte every 0.9 s kept its place
    until the body deadline. And every request standing aside buffers its body: their number is capped."""
    from lightllm.server.http import request_guard

    monkeypatch.setattr(request_guard, "STEP_ASIDE_SECONDS", 0.05, raising=False)
    served: list = []

    async def app(scope, receive, send) -> None:
        served.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario() -> None:
        share, book = ClientShare(1), PreparingRequests()
        stack = _body_stack(app, share, book)
        dripped = [b"{"] + [b" "] * 200 + [b"}"]
        drip = asyncio.ensure_future(stack(_request_scope(), _dripping(dripped, 0.01), _recorder([])))
        await asyncio.sleep(0.2)
        assert share.aside("10.0.0.1") == 1 and share.active("10.0.0.1") == 0  # stepped aside while dripping
        never = asyncio.Event()
        stalled = asyncio.ensure_future(stack(_request_scope(), _receiver(b"{", b"}", pause=never), _recorder([])))
        await asyncio.sleep(0.2)
        # One client, one place: a second upload may not stand aside as well, so it keeps the place.
        assert share.aside("10.0.0.1") == 1 and share.active("10.0.0.1") == 1
        following = asyncio.ensure_future(stack(_request_scope(), _receiver(b'{"n": 3}'), _recorder([])))
        await asyncio.sleep(0.1)
        assert not following.done() and share.waiting("10.0.0.1") == 1
        for _ in range(3000):  # until its body is complete: it then queues behind the following request
            if not dripped:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert served == [] and not drip.done() and share.waiting("10.0.0.1") == 2
        never.set()
        await asyncio.wait_for(asyncio.gather(stalled, following, drip), 30)
        assert served == [b"{}", b'{"n": 3}', b"{" + b" " * 200 + b"}"]
        assert share.active("10.0.0.1") == share.aside("10.0.0.1") == share.waiting("10.0.0.1") == book.count == 0

    asyncio.run(scenario())


def test_a_client_gone_while_its_request_waits_to_take_a_place_again_is_not_served(monkeypatch) -> None:
    """With its body read, nothing noticed the disconnect: the endpoint tokenized and answered a
    request whose client had left while it waited for a place."""
    from lightllm.server.http import request_guard

    monkeypatch.setattr(request_guard, "STEP_ASIDE_SECONDS", 0.05, raising=False)
    calls: list = []
    hold = asyncio.Event()

    async def app(scope, receive, send) -> None:
        calls.append((await receive())["body"])
        await hold.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario() -> None:
        share, book = ClientShare(1), PreparingRequests()
        stack = _body_stack(app, share, book)
        rest, left = asyncio.Event(), asyncio.Event()
        parts = [b"{", b"}"]

        async def leaving_client() -> dict:
            if len(parts) == 1:
                await rest.wait()
            if parts:
                chunk = parts.pop(0)
                return {"type": "http.request", "body": chunk, "more_body": bool(parts)}
            await left.wait()
            return {"type": "http.disconnect"}

        leaver = asyncio.ensure_future(stack(_request_scope(), leaving_client, _recorder(sent := [])))
        await asyncio.sleep(0.2)  # stepped aside
        holder = asyncio.ensure_future(stack(_request_scope(), _receiver(b'{"n": 2}'), _recorder([])))
        await asyncio.sleep(0.05)
        rest.set()  # its body is complete; it waits for the holder's place
        await asyncio.sleep(0.05)
        left.set()
        await asyncio.wait_for(leaver, 30)
        assert calls == [b'{"n": 2}'] and sent == []
        hold.set()
        await asyncio.wait_for(holder, 30)
        assert share.active("10.0.0.1") == share.aside("10.0.0.1") == share.waiting("10.0.0.1") == book.count == 0

    asyncio.run(scenario())


def test_closing_the_book_ends_only_requests_that_have_not_begun_their_answer() -> None:
    async def scenario() -> None:
        book = PreparingRequests()
        answering_sent, tokenizing_sent = [], []
        release = asyncio.Event()

        async def app(scope, receive, send) -> None:
            if scope["path"] == "/tokenize":
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await release.wait()
                await send({"type": "http.response.body", "body": b"done"})
            else:
                await release.wait()

        from lightllm.server.http.in_flight import AdmissionMiddleware

        stack = AdmissionMiddleware(app, book)
        answering = asyncio.ensure_future(stack({**_request_scope(), "path": "/tokenize"}, _receiver(b"{}"),
                                                _recorder(answering_sent)))
        tokenizing = asyncio.ensure_future(stack(_request_scope(), _receiver(b"{}"), _recorder(tokenizing_sent)))
        await asyncio.sleep(0.05)
        assert book.close("The server is shutting down: x", "server_shutting_down") == 1
        assert book.close("The server is shutting down: x", "server_shutting_down") == 0  # counted once
        await asyncio.wait_for(tokenizing, 30)
        assert tokenizing_sent[0]["status"] == 503
        # A request arriving after the close (pipelined on a kept-alive connection) gets it at once.
        late_sent: list = []
        await asyncio.wait_for(stack(_request_scope(), _receiver(b"{", b"}", pause=asyncio.Event()),
                                     _recorder(late_sent)), 30)
        assert late_sent[0]["status"] == 503
        release.set()
        await asyncio.wait_for(answering, 30)
        assert [m.get("body") for m in answering_sent][-1] == b"done" and book.count == 0

    asyncio.run(scenario())


def test_a_request_kept_from_standing_aside_tries_again_once_another_no_longer_does(monkeypatch) -> None:
    """Refused a stand-aside once (the client's stand-aside places all taken), a stalled upload kept
    its place until its own body deadline, even after those places freed up."""
    from lightllm.server.http import request_guard

    monkeypatch.setattr(request_guard, "STEP_ASIDE_SECONDS", 0.05, raising=False)
    served: list = []

    async def app(scope, receive, send) -> None:
        served.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario() -> None:
        share, book = ClientShare(1), PreparingRequests()
        stack = _body_stack(app, share, book)
        leaves, sent_byte = asyncio.Event(), []

        async def first_client() -> dict:  # one byte, then gone
            if not sent_byte:
                sent_byte.append(True)
                return {"type": "http.request", "body": b"{", "more_body": True}
            await leaves.wait()
            return {"type": "http.disconnect"}

        first = asyncio.ensure_future(stack(_request_scope(), first_client, _recorder([])))
        await asyncio.sleep(0.2)
        assert share.aside("10.0.0.1") == 1
        second = asyncio.ensure_future(stack(_request_scope(), _receiver(b"{", b"}", pause=asyncio.Event()),
                                             _recorder([])))
        await asyncio.sleep(0.2)
        assert share.active("10.0.0.1") == 1  # it could not stand aside: it keeps the place
        following = asyncio.ensure_future(stack(_request_scope(), _receiver(b'{"n": 3}'), _recorder([])))
        leaves.set()  # the first one ends: the second may stand aside now
        await asyncio.wait_for(asyncio.gather(first, following), 10)
        assert served == [b'{"n": 3}'] and share.aside("10.0.0.1") == 1 and not second.done()
        second.cancel()
        await asyncio.wait({second})
        assert share.active("10.0.0.1") == share.aside("10.0.0.1") == share.waiting("10.0.0.1") == 0

    asyncio.run(scenario())
