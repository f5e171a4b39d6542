"""Ending a serving server within bounds: after a child process died, or on a stop signal.

The HTTP request manager lives on uvicorn's event loop in the main process; the child watcher
is a thread and signals arrive between bytecodes of the main thread, so both hand their work to
the loop with ``call_soon_threadsafe``.

- A dead child: every pending request fails at once with a 503 error (an error event for streams
  already under way), new requests get 503, and uvicorn stops; the exit code is 1.
- A hung child (no progress for ``--watchdog_timeout`` seconds, :mod:`lightllm.server.launch.watchdog`):
  the same as a dead one; the launcher's shutdown then kills it (SIGKILL ends a stopped process too).
  It may come during a drain: the drain then ends at once, with exit code 1.
- A dead front door (its thread raised; :mod:`lightllm.server.http.transport.front_door`): the same, since
  no connection can be accepted any more; it closed the listening sockets itself.
- SIGTERM, SIGINT or SIGHUP: new requests get 503 at once, requests in flight may finish for up to
  ``--graceful_shutdown_seconds``, the rest then fail with a 503 error; the exit code is 0.  A
  drain hold (:meth:`Supervisor.add_drain_hold`; a PD node's: continuation segments may still
  come) keeps an idle server waiting too, within the same period.
  A second signal fails what is left at once.

Either way uvicorn then waits at most :data:`CONNECTION_GRACE_SECONDS` for connections to
send their last bytes, so a client that stopped reading cannot hold the shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

import uvicorn

from lightllm.server.launch.exit_codes import EXIT_FAILED, EXIT_STOPPED
from lightllm.server.launch.watchdog import Stall, describe_stalls
from lightllm.utils.async_polling import wait_until
from lightllm.utils.gc_tuning import freeze_startup_objects
from lightllm.utils.process_utils import describe_exit_code

if TYPE_CHECKING:
    from lightllm.server.http.transport.front_door import FrontDoor
    from lightllm.server.http.middleware.in_flight import PreparingRequests
    from lightllm.server.http.service.health import Readiness

log = logging.getLogger("lightllm.supervisor")

CONNECTION_GRACE_SECONDS = 1.0
SHUTTING_DOWN = "server_shutting_down"
SERVER_FAILED = "server_failed"


class Supervisor:
    """Decides how and when serving ends; ``exit_code`` is the launcher's exit status."""

    def __init__(self, manager: Any, graceful_shutdown_seconds: float,
                 preparing: Optional["PreparingRequests"] = None):
        self.manager = manager
        self.graceful_shutdown_seconds = graceful_shutdown_seconds
        # The app's requests not yet handed to the manager (parsed, tokenized): a drain waits for them too.
        self.preparing = preparing
        self.server: Optional[uvicorn.Server] = None
        self.exit_code = EXIT_STOPPED
        self._lock = threading.Lock()
        self._failed = False
        self._signals = 0
        self._drain: Optional[asyncio.Task] = None
        self._stopped_now = False
        self._stop_listeners: List[Callable[[], None]] = []
        self._drain_holds: List[Callable[[], bool]] = []
        self._hold_failed = False

    def add_drain_hold(self, hold: Callable[[], bool]) -> None:
        """A drain ends only once the manager is idle and ``hold()`` is False (within the graceful period).

        ``hold`` is called on the event loop, often (it must be cheap); a request that starts while
        it holds is waited for as well.
        """
        self._drain_holds.append(hold)

    def _held(self) -> bool:
        for hold in self._drain_holds:
            try:
                if hold():
                    return True
            except Exception:  # noqa: BLE001 - a broken hold must not keep the server from stopping
                if not self._hold_failed:  # polled: one traceback, not one per poll
                    self._hold_failed = True
                    log.exception("drain hold failed; it holds nothing")
        return False

    def add_stop_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` on the event loop at the first stop signal, before new requests are refused."""
        self._stop_listeners.append(listener)

    def _notify_stop(self) -> None:
        for listener in self._stop_listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener's bug must not keep the server from stopping
                log.exception("stop listener failed")

    def _call_on_loop(self, callback: Any, *args: Any) -> None:
        loop: Optional[asyncio.AbstractEventLoop] = self.manager.loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(callback, *args)
                return
            except RuntimeError:  # the loop is closed
                pass
        # Not serving yet (or any more): no request can be pending, just stop.
        self._exit_server()

    def _exit_server(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    # --- a child process died (called from the watcher thread) ---------------------------------
    def child_died(self, name: str, exitcode: Optional[int]) -> None:
        """Fail every request and stop serving with exit code 1."""
        if not self._mark_failed():
            return
        how = describe_exit_code(exitcode)
        log.error("child process %s exited unexpectedly (%s); failing every request and shutting down", name, how)
        self._call_on_loop(self._fail_everything, f"its {name} process exited unexpectedly ({how})",
                           f"{name} exited", False)

    # --- children made no progress (called from the watcher thread) -----------------------------
    def children_stalled(self, stalls: Sequence[Stall], timeout_seconds: float) -> None:
        """As :meth:`child_died`, for live children that made no progress for ``timeout_seconds`` (the watchdog)."""
        if not self._mark_failed():
            return
        what = describe_stalls(stalls, timeout_seconds)
        log.error("child process%s %s; failing every request and shutting down", "es" if len(stalls) > 1 else "", what)
        # Nothing is sent to the children: the hung one would never read it.
        self._call_on_loop(self._fail_everything, f"its child process{'es' if len(stalls) > 1 else ''} {what}",
                           f"{', '.join(stall.name for stall in stalls)} made no progress", False)

    # --- the front door's thread died (called from that thread) ----------------------------------
    def front_door_died(self, cause: str) -> None:
        """As :meth:`child_died`: nothing accepts connections any more, so the server must end (exit 1).

        The front door already logged its one error line naming ``cause`` and closed its sockets.
        The children are alive, so requests already handed to the loop are aborted in them.
        """
        if not self._mark_failed():
            return
        self._call_on_loop(self._fail_everything, f"its HTTP front door failed ({cause})", "the front door failed", True)

    def _mark_failed(self) -> bool:
        """True for the first failure only: the first one decides the message and the exit code."""
        with self._lock:
            if self._failed:
                return False
            self._failed = True
        self.exit_code = EXIT_FAILED
        return True

    def _fail_everything(self, what: str, after: str, backend_alive: bool) -> None:
        message = f"The server failed: {what}; the request was not completed, retry it on another server"
        failed = self.preparing.close(message, SERVER_FAILED) if self.preparing is not None else 0
        failed += self.manager.fail_pending(message, SERVER_FAILED, backend_alive=backend_alive)
        log.error("failed %d pending request(s) after %s", failed, after)
        self._exit_server()

    # --- a stop signal (called in the main thread by the signal handler) -------------------------
    def stop_signal(self, signum: int) -> None:
        """First signal: drain, bounded by the graceful period; a second one: stop at once."""
        self._signals += 1
        if self._signals == 1 and self._stop_listeners:
            self._call_on_loop(self._notify_stop)
        if self._signals == 1 and self.graceful_shutdown_seconds > 0:
            log.info(
                "received %s: taking no new requests, letting requests in flight finish for at most %gs",
                signal.Signals(signum).name, self.graceful_shutdown_seconds,
            )
            self._call_on_loop(self._start_drain)
        else:
            log.info("received %s: ending the requests in flight now", signal.Signals(signum).name)
            self._call_on_loop(self._stop_now, "the server was stopped")

    def _start_drain(self) -> None:
        self.manager.refuse_new_requests("The server is shutting down and takes no new requests", SHUTTING_DOWN)
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        seconds = self.graceful_shutdown_seconds
        if await self._wait_until_idle(seconds):
            # After a second signal the wait ends because _stop_now ended the requests, after a
            # dead or hung child because the failure did: either already logged what it ended and
            # started the exit.
            if not self._stopped_now and not self._failed:
                log.info("every request finished; shutting down")
                self._exit_server()
        else:
            self._stop_now(f"the request did not finish within the graceful shutdown period ({seconds:g}s)")

    async def _wait_until_idle(self, seconds: float) -> bool:
        # A request being prepared becomes a generation (counted by the manager) before it stops
        # counting as prepared, so no request slips between the two waits.
        deadline = time.monotonic() + seconds
        if self.preparing is not None and not await wait_until(lambda: self.preparing.idle, seconds):
            return False
        while True:
            if not await self.manager.wait_until_idle(max(0.0, deadline - time.monotonic())):
                return False
            if not self._held():
                return True
            # Held while idle: wait for the hold to end, then for what started meanwhile.
            if not await wait_until(lambda: not self._held(), max(0.0, deadline - time.monotonic())):
                return False

    def _stop_now(self, reason: str) -> None:
        self._stopped_now = True
        message = f"The server is shutting down: {reason}"
        # Requests still being prepared (a body arriving, waiting for their client's place,
        # tokenizing) get the same 503 at once, from the admission middleware.
        preparing = self.preparing.close(message, SHUTTING_DOWN) if self.preparing is not None else 0
        # The manager counts generations: a request with n choices (or best_of) runs that many.
        running = self.manager.fail_pending(message, SHUTTING_DOWN, backend_alive=True)
        if preparing or running:
            log.warning("ended with an error at shutdown: %d generation(s) running (a request runs one per "
                        "choice) and %d request(s) still being prepared", running, preparing)
        self._exit_server()


class SupervisedServer(uvicorn.Server):
    """A uvicorn server whose stop signals go to a :class:`Supervisor` and whose shutdown is bounded.

    With a ``front_door`` (the launchers), uvicorn listens on nothing itself: the front door owns
    the listening sockets and hands connections to this server's loop from :meth:`startup` until
    :meth:`shutdown`; ``readiness`` then answers its readiness probes.
    """

    def __init__(self, config: uvicorn.Config, supervisor: Supervisor, front_door: Optional["FrontDoor"] = None,
                 readiness: Optional["Readiness"] = None):
        current = config.timeout_graceful_shutdown
        if current is None or current > CONNECTION_GRACE_SECONDS:
            config.timeout_graceful_shutdown = CONNECTION_GRACE_SECONDS
        super().__init__(config)
        self.supervisor = supervisor
        self.front_door = front_door
        if front_door is not None:
            from lightllm.server.http.service.health import manager_readiness

            readiness = readiness or manager_readiness(supervisor.manager)
            # From here on a dead front door fails the server as a dead child does (called at
            # once if it died while the model loaded, replacing the launcher's start-up handler).
            front_door.set_death_handler(supervisor.front_door_died)
        self.readiness = readiness
        supervisor.server = self

    async def startup(self, sockets: Optional[list] = None) -> None:
        """uvicorn's start-up; with a front door, no listener of its own and hand-over from the front door."""
        if self.front_door is None:
            await super().startup(sockets)
            return
        await super().startup(sockets=[])
        if not self.started:
            return
        freeze_startup_objects()
        loop = asyncio.get_running_loop()
        config, state, app_state = self.config, self.server_state, self.lifespan.state

        def make_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=state, app_state=app_state,  # type: ignore[call-arg]
                                              _loop=loop)

        from lightllm.server.http.service.health import SampledReadiness

        assert self.readiness is not None
        if isinstance(self.readiness, SampledReadiness):
            self.readiness.start(loop)
        self.front_door.serve(loop, make_protocol, self.readiness)

    async def shutdown(self, sockets: Optional[list] = None) -> None:
        """uvicorn's shutdown; the front door answers new connections 503 from now on."""
        if self.front_door is not None:
            self.front_door.stop_serving()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        """Replaces uvicorn's immediate stop with the supervisor's drain."""
        self.supervisor.stop_signal(sig)


class StopOutsideServing:
    """SIGINT/SIGTERM handling outside uvicorn's ``run``, shared by every launcher.

    Before uvicorn starts, and when it replays the signal that stopped it once it returns, a
    signal lands here instead of killing the process, so the launcher's cleanup still runs.
    Installed on construction; set :attr:`server` once the server exists.
    """

    def __init__(self) -> None:
        self.server: Optional[uvicorn.Server] = None
        self.requested = False
        self.signum: Optional[int] = None  # the first signal that landed here
        # Whether that signal came before the server served: decided when it lands, since uvicorn
        # may still mark the server started after it (it then serves nothing and stops).
        self.before_serving = False
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        # uvicorn takes over SIGINT and SIGTERM while it serves, not SIGHUP (a closed terminal,
        # whose default action kills the process with no drain and leaves shared memory behind):
        # it goes to the serving server's handler here, which drains as SIGTERM does.
        signal.signal(signal.SIGHUP, self._on_hangup)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        self.requested = True
        if self.signum is None:
            self.signum = signum
            self.before_serving = self.server is None or not self.server.started
        if self.server is not None:
            self.server.should_exit = True

    def _on_hangup(self, signum: int, frame: Optional[FrameType]) -> None:
        server = self.server
        if server is not None and server.started and not server.should_exit:
            server.handle_exit(signum, frame)
        else:
            self._on_signal(signum, frame)

    def exit_code(self, supervisor: Supervisor) -> int:
        """The launcher's exit status: the supervisor's, or 1 when the server never started serving
        (on its own, or because a signal came first: the start-up was interrupted, as before the
        children were ready; :meth:`startup_interruption` says so)."""
        code = supervisor.exit_code
        never_served = self.before_serving or (self.server is not None and not self.server.started)
        return EXIT_FAILED if never_served and code == EXIT_STOPPED else code

    def startup_interruption(self) -> Optional[str]:
        """The line for a signal that came before the server served (None: it served, or no signal)."""
        if self.signum is None or not self.before_serving:
            return None
        return f"interrupted by signal {self.signum} during start-up"


def run_uvicorn(server: Any) -> None:
    """``server.run()``; uvicorn's own exit on a failed start (``sys.exit(3)``) is logged, not passed on.

    The launcher's exit code then says the server never started (``EXIT_FAILED`` in
    :mod:`lightllm.server.launch.exit_codes`), and exit code 3 keeps its one meaning: a port that
    could not be bound.
    """
    try:
        server.run()
    except SystemExit as exc:
        log.error("the HTTP server failed to start (uvicorn exited with %s)", exc.code)
