"""The health endpoints and the one place their answers are computed.

* ``GET /health/live`` (liveness): 200 ``{"status": "alive"}`` while the process runs and its event
  loop turns; 503 ``event_loop_stalled`` when the loop has not run for :data:`LOOP_STALL_SECONDS`
  while serving. It is 200 while the model loads and while the server drains, so a liveness probe
  never restarts a server that is starting, busy or stopping on purpose.
* ``GET /health/ready`` (readiness): 200 ``{"status": "ok"}`` when the server takes requests; 503
  while it starts (``server_starting``), drains (``server_shutting_down``), after a child process
  died (``server_failed``), and on a PD master until a prefill and a decode node are alive
  (``pd_not_ready``).
* ``GET /health``: the same answer as ``/health/ready`` (its meaning before the two were split).
* ``/ping`` (vLLM's SageMaker probe, :mod:`lightllm.server.http.service.service_routes`): the same answer as
  ``/health``; it is a probe too (:data:`PROBE_PATHS`), so it needs no key and the front door answers it.

``HEAD`` is accepted on each, and ``POST`` on LightLLM's ``/liveness`` and ``/readiness`` (as LightLLM serves them). The answers come from :func:`health_answer`, used both by the front
door (:mod:`lightllm.server.http.transport.front_door`, which answers a probe on a fresh connection in a thread
of its own, without waiting for the busy event loop) and by the app's routes (a probe sent on a
keep-alive connection after other requests).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional, Tuple

from lightllm.server.http.errors import SERVICE_UNAVAILABLE, error_body

HEALTH_PATH = "/health"
LIVE_PATH = "/health/live"
READY_PATH = "/health/ready"
# LightLLM's own probe paths answer as their counterparts here, so Kubernetes and load-balancer
# configurations written for LightLLM keep working.
PROBE_ALIASES = {"/healthz": HEALTH_PATH, "/liveness": LIVE_PATH, "/readiness": READY_PATH}
HEALTH_PATHS = frozenset({HEALTH_PATH, LIVE_PATH, READY_PATH, *PROBE_ALIASES})
# LightLLM also serves these two on POST, so a probe written for it may use that method.
POST_PROBE_PATHS = frozenset({"/liveness", "/readiness"})
# SageMaker's probe, which vLLM serves (GET and POST): it means /health. Kept out of HEALTH_PATHS,
# whose routes the native endpoints register, because its route replays the app's own /health
# (a PD master's included) rather than computing an answer of its own.
PING_PATH = "/ping"
# Every path answered as a probe: without an API key, and by the front door for GET/HEAD.
PROBE_PATHS = HEALTH_PATHS | {PING_PATH}


def probe_meaning(path: str) -> str:
    """The probe ``path`` stands for: one of ``/health``, ``/health/live``, ``/health/ready``."""
    if path == PING_PATH:
        return HEALTH_PATH
    return PROBE_ALIASES.get(path, path)
# A loop that has not run a callback for this long is wedged, not busy: the slowest /health seen on a
# 2-core machine under 1000 streams was a few seconds.
LOOP_STALL_SECONDS = 30.0
LOOP_TICK_SECONDS = 1.0
STARTING_CODE = "server_starting"
# Every role's start-up answer: a PD master loads a tokenizer, not a model, so the message names neither.
STARTING_MESSAGE = "The server is starting; retry later"
FAILED_CODE = "server_failed"

# None: ready; else (code, message) of the 503.
Readiness = Callable[[], Optional[Tuple[str, str]]]


def manager_readiness(manager: Any) -> Readiness:
    """Readiness of a request manager: its refusal (draining, failed) or ``health()``."""

    def readiness() -> Optional[Tuple[str, str]]:
        refusal_of = getattr(manager, "refusal", None)
        refusal = refusal_of() if callable(refusal_of) else None
        if refusal is not None:
            return getattr(refusal, "code", None) or "unhealthy", str(refusal)
        if not manager.health():
            return "unhealthy", "The server is not healthy"
        return None

    return readiness


def manager_readiness_refusal(manager: Any) -> Readiness:
    """Only the refusal part of :func:`manager_readiness` (draining, failed): thread-safe to read."""

    def refusal() -> Optional[Tuple[str, str]]:
        refused = manager.refusal()
        return None if refused is None else (getattr(refused, "code", None) or "unhealthy", str(refused))

    return refusal


def starting_readiness() -> Optional[Tuple[str, str]]:
    """Readiness before the server serves: not ready, it is starting."""
    return STARTING_CODE, STARTING_MESSAGE


class LoopHeartbeat:
    """When the serving event loop last ran a callback; :meth:`beat` is rescheduled on that loop."""

    def __init__(self) -> None:
        self.last_beat: Optional[float] = None

    def start(self, loop: Any) -> None:
        """Beat now and every :data:`LOOP_TICK_SECONDS` on ``loop``."""

        def beat() -> None:
            self.last_beat = time.monotonic()
            if not loop.is_closed():
                loop.call_later(LOOP_TICK_SECONDS, beat)

        beat()

    def stalled(self) -> Optional[float]:
        """Seconds since the last beat when over :data:`LOOP_STALL_SECONDS`, else None."""
        if self.last_beat is None:
            return None
        age = time.monotonic() - self.last_beat
        return age if age > LOOP_STALL_SECONDS else None


def health_answer(path: str, readiness: Readiness, heartbeat: Optional[LoopHeartbeat] = None
                  ) -> Tuple[int, Dict[str, Any]]:
    """(status, JSON body) of a probe of ``path`` (one of :data:`PROBE_PATHS`)."""
    if probe_meaning(path) == LIVE_PATH:
        stalled = heartbeat.stalled() if heartbeat is not None else None
        if stalled is not None:
            message = f"The server's event loop has not run for {stalled:.0f} seconds"
            return 503, error_body(message, SERVICE_UNAVAILABLE, None, "event_loop_stalled")
        return 200, {"status": "alive"}
    try:
        problem = readiness()
    except Exception:  # noqa: BLE001 - a failing check means not ready, never a crashed probe
        problem = ("unhealthy", "The server's readiness check failed")
    if problem is None:
        return 200, {"status": "ok"}
    code, message = problem
    return 503, error_body(message, SERVICE_UNAVAILABLE, None, code)


class SampledReadiness:
    """A readiness whose slow part is evaluated on the serving loop every ``interval`` seconds.

    For checks that read state the loop mutates (the PD master's node registry expires nodes while
    it is read), which the front door's thread must not read directly. ``immediate`` (thread-safe,
    e.g. the manager's refusal while draining) is checked on every probe.
    """

    def __init__(self, on_loop: Readiness, immediate: Optional[Readiness] = None, interval: float = 0.1) -> None:
        self._on_loop = on_loop
        self._immediate = immediate
        self._interval = interval
        self._sample: Optional[Tuple[str, str]] = starting_readiness()

    def start(self, loop: Any) -> None:
        """Sample now (on ``loop``'s thread) and every ``interval`` seconds."""

        def sample() -> None:
            try:
                self._sample = self._on_loop()
            except Exception:  # noqa: BLE001 - a failing check means not ready
                self._sample = ("unhealthy", "The server's readiness check failed")
            if not loop.is_closed():
                loop.call_later(self._interval, sample)

        sample()

    def __call__(self) -> Optional[Tuple[str, str]]:
        problem = self._immediate() if self._immediate is not None else None
        return problem if problem is not None else self._sample


def stopping_reason(readiness: Optional[Readiness]) -> Tuple[str, str]:
    """(code, message) for a request arriving after the loop stopped taking connections.

    A server stopping because a child died says so (``server_failed``, as its probes and its
    pending requests do), so a client can tell a crash from a planned drain.
    """
    problem = None
    if readiness is not None:
        try:
            problem = readiness()
        except Exception:  # noqa: BLE001 - the refusal must be answered whatever the check does
            problem = None
    if problem is not None and problem[0] == FAILED_CODE:
        return problem
    return "server_shutting_down", "The server is shutting down and takes no new requests"
