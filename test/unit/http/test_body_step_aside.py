"""A request's body arriving slowly: it stands aside from its client's share while the rest arrives,
and requests still being prepared end with the 503 as soon as the server stops serving.

Driven through the middlewares create_app stacks (admission, client share, request guard) with
scripted ASGI clients; no socket.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, List

import pytest

from lightllm.server.http.middleware.client_share import ClientShare, ClientShareMiddleware
from lightllm.server.http.middleware.in_flight import PreparingRequests


@pytest.fixture
def quick_step_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies step aside after 0.05 s instead of a second (raising=False: fails, not errors, on old code)."""
    monkeypatch.setattr("lightllm.server.http.middleware.request_guard.STEP_ASIDE_SECONDS", 0.05, raising=False)


def _recording_app(into: List[bytes]) -> Callable[..., Any]:
    """An endpoint that records the body it receives and answers 200."""
    async def app(scope, receive, send) -> None:
        into.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def _body_stack(app, share: ClientShare, book: PreparingRequests):
    from lightllm.server.http.middleware.in_flight import AdmissionMiddleware
    from lightllm.server.http.middleware.request_guard import RequestGuardMiddleware

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


def test_a_request_whose_body_stalls_lets_its_clients_next_request_have_its_place(quick_step_aside: None) -> None:
    """A stalled upload held its client's place until its body deadline (60 s): the 16 places of one
    address behind a proxy were taken by 16 stalled uploads, and every other request waited 60 s."""
    bodies: list = []
    app = _recording_app(bodies)

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


def test_a_dripping_body_steps_aside_too_and_only_as_many_as_the_client_has_places(quick_step_aside: None) -> None:
    """The step aside was timed from the last byte: a client sending a byte every 0.9 s kept its place
    until the body deadline. And every request standing aside buffers its body: their number is capped."""
    served: list = []
    app = _recording_app(served)

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


def test_a_client_gone_while_its_request_waits_to_take_a_place_again_is_not_served(quick_step_aside: None) -> None:
    """With its body read, nothing noticed the disconnect: the endpoint tokenized and answered a
    request whose client had left while it waited for a place."""
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

        from lightllm.server.http.middleware.in_flight import AdmissionMiddleware

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


def test_a_request_kept_from_standing_aside_tries_again_once_another_no_longer_does(quick_step_aside: None) -> None:
    """Refused a stand-aside once (the client's stand-aside places all taken), a stalled upload kept
    its place until its own body deadline, even after those places freed up."""
    served: list = []
    app = _recording_app(served)

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
