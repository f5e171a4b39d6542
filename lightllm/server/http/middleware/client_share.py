"""A per-client limit on requests being prepared at once, so one client's flood cannot take the event loop.

The connection caps bound how many connections a client holds, not how much work it sends down
them: a client that pipelined cheap requests (``GET /v1/models``, or anything answered 401) on a
thousand keep-alive connections, never reading the answers, had a thousand requests in the HTTP
process's event loop at every moment, and another client's 8-token ``/generate`` took 3 to 10 s
instead of 0.035 s. Every loop iteration served one request of each connection.

:class:`ClientShareMiddleware` lets at most ``limit`` requests of one client address (the TCP
peer) be *prepared* at once: read, checked, tokenized, answered when they never reach the engine.
A request stops counting once it reaches the engine
(:func:`~lightllm.server.admission_scope.generation_started` releases its place, so a
client's streams do not count however long they run) or when it ends.
Further requests of that client wait their turn in arrival order; none is refused, and the
others' requests never wait behind them. A request whose body is still arriving a second after
the server began to read it steps aside (:class:`ClientPlace`, used by the request guard): its
place goes to the client's next request while the rest arrives, and it queues again once the body
is in, so up to ``limit`` stalled or slow uploads of a client do not hold its places until their
body deadline. At most ``limit`` requests of a client stand aside at once (each buffers its body
as it arrives); beyond them a slow upload keeps its place, as every upload did before. With two tokenizer threads, sixteen places per client
already keep tokenization busy, so a proxy (every client behind it has its address) loses
nothing to the default.

Not gated: health probes, ``/metrics`` (an operator's scraper must not queue behind a flood from
its own host) and the PD cluster's ``/pd/`` paths, whose long streams from the one master address
never reach this node's engine through the public handlers.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Deque, Dict, Optional

from lightllm.server.http.middleware.auth import CLUSTER_PATH_PREFIX
from lightllm.server.http.service.health import PROBE_PATHS
from lightllm.server.admission_scope import CLIENT_SHARE_KEY
from lightllm.server.http.middleware.in_flight import PreparingRequests, closing_response, refused_on_arrival
from lightllm.server.http.log_throttle import IntervalGate

Scope = Dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

METRICS_PATH = "/metrics"

log = logging.getLogger(__name__)


@dataclass
class _ClientPlaces:
    """One client address's requests being prepared and the ones waiting for a place."""

    active: int = 0
    waiting: Deque[asyncio.Future] = field(default_factory=collections.deque)
    # Requests that gave their place up while their body arrives (ClientPlace.step_aside).
    aside: int = 0


class ClientShare:
    """At most ``limit`` requests per client address at once; the rest wait in arrival order."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._clients: Dict[str, _ClientPlaces] = {}
        self._told = IntervalGate()

    def active(self, client: str) -> int:
        """Requests of ``client`` holding a place now."""
        places = self._clients.get(client)
        return places.active if places is not None else 0

    def waiting(self, client: str) -> int:
        """Requests of ``client`` waiting for a place."""
        places = self._clients.get(client)
        return len(places.waiting) if places is not None else 0

    async def enter(self, client: str) -> Callable[[], None]:
        """Wait for a place of ``client``; returns its release (idempotent)."""
        places = self._clients.setdefault(client, _ClientPlaces())
        if places.active < self.limit and not places.waiting:
            places.active += 1
            return self._release_of(client)
        self._tell(client)
        turn = asyncio.get_running_loop().create_future()
        places.waiting.append(turn)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self._release_of(client)()  # the place was handed over as the wait was cancelled
            else:
                # A release in the same loop turn may have dropped the cancelled turn already.
                if turn in places.waiting:
                    places.waiting.remove(turn)
                if self._clients.get(client) is places:
                    self._forget_if_idle(client)
            raise
        return self._release_of(client)

    def _release_of(self, client: str) -> Callable[[], None]:
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            places = self._clients[client]
            while places.waiting:
                turn = places.waiting.popleft()
                if not turn.done():
                    turn.set_result(None)  # the place passes to the next request, active unchanged
                    return
            places.active -= 1
            self._forget_if_idle(client)

        return release

    def aside(self, client: str) -> int:
        """Requests of ``client`` standing aside while their bodies arrive."""
        places = self._clients.get(client)
        return places.aside if places is not None else 0

    def stand_aside(self, client: str) -> bool:
        """Count one more request of ``client`` standing aside; False when ``limit`` of them already do.

        The cap bounds what one address may have buffered: the bodies of ``limit`` requests with
        places plus ``limit`` standing aside, as the places alone bounded it before.
        """
        places = self._clients.get(client)
        if places is None or places.aside >= self.limit:
            return False
        places.aside += 1
        return True

    def back_from_aside(self, client: str) -> None:
        """One request of ``client`` no longer stands aside (it has a place again, or it ended)."""
        places = self._clients.get(client)
        if places is not None:
            places.aside -= 1
            self._forget_if_idle(client)

    def _forget_if_idle(self, client: str) -> None:
        places = self._clients.get(client)
        if places is not None and places.active == 0 and not places.waiting and places.aside == 0:
            del self._clients[client]

    def _tell(self, client: str) -> None:
        held = self._told.passes(time.monotonic())
        if held is not None:
            more = f" ({held} more such wait(s) since the last line)" if held else ""
            log.warning("client %s has %d requests being prepared; its next ones wait their turn "
                        "(--http_max_preparing_per_client)%s", client, self.limit, more)


class ClientPlace:
    """One request's place among its client's requests being prepared.

    :meth:`release` gives it up (idempotent; once the request reaches the engine, or ends). While
    its body arrives a request may :meth:`step_aside`: its place goes to the client's next request,
    and :meth:`retake` later waits for one again, behind the requests already waiting.
    """

    def __init__(self, share: ClientShare, client: str, release: Callable[[], None]) -> None:
        self._share = share
        self._client = client
        self._release: Optional[Callable[[], None]] = release
        self._aside = False

    @property
    def held(self) -> bool:
        """True while the request holds a place."""
        return self._release is not None

    def release(self) -> None:
        """Give the place to the client's next request, and stop standing aside (nothing when neither)."""
        self._give_place()
        self._back()

    def step_aside(self) -> bool:
        """Give the place up while the body arrives; False (the place is kept) when as many of the
        client's requests as it has places stand aside already."""
        if self._release is None or not self._share.stand_aside(self._client):
            return False
        self._aside = True
        self._give_place()
        return True

    async def retake(self) -> None:
        """Wait for a place after :meth:`step_aside` (at once when one is held)."""
        if self._release is not None:
            return
        try:
            self._release = await self._share.enter(self._client)
        finally:
            self._back()

    def _give_place(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def _back(self) -> None:
        if self._aside:
            self._aside = False
            self._share.back_from_aside(self._client)


def _gated(scope: Scope) -> bool:
    path = scope.get("path", "")
    return not (path in PROBE_PATHS or path == METRICS_PATH or path.startswith(CLUSTER_PATH_PREFIX))


class ClientShareMiddleware:
    """Runs each HTTP request of a client address inside one of its :class:`ClientShare` places.

    ``book``: the server's :class:`PreparingRequests`; a request still waiting for its place when
    the server stops serving gets the stop's 503 instead of the HTTP server's plain-text 500.
    ``manager``: a generation request it refuses on arrival (draining) goes on without a place, to
    get that 503 from ``DrainRefusalMiddleware`` at once rather than after its client's other requests.
    """

    def __init__(self, app: ASGIApp, share: ClientShare, book: Optional[PreparingRequests] = None,
                 manager: Any = None) -> None:
        self.app = app
        self.share = share
        self.book = book
        self.manager = manager

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not _gated(scope) or refused_on_arrival(self.manager, scope) is not None:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        address = str(client[0]) if client else "unknown"
        try:
            release = await self.share.enter(address)
        except asyncio.CancelledError:
            if self.book is None or self.book.closing is None:
                raise
            await closing_response(self.book.closing)(scope, receive, send)
            return
        place = scope[CLIENT_SHARE_KEY] = ClientPlace(self.share, address, release)
        try:
            await self.app(scope, receive, send)
        finally:
            place.release()
