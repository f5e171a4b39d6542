"""The heartbeats behind ``--watchdog_timeout``: real shared memory, real processes, the launcher's watcher.

Each watched child stamps its own field of the heartbeat segment before and right after each
blocking wait of its main loop; the launcher's child watcher reports a live child whose stamp went
stale.  Here a real spawned process beats through the same :class:`HeartbeatStamp` the server's
children use and is stopped with SIGSTOP; the loops of a model rank, the router and the
detokenizer, built from fakes, beat around their waits, so the work after a wait counts from its end.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any, List, Tuple

import pytest

from lightllm.server.core.objs.shm_heartbeats import NEVER_BEAT, beat_of
from lightllm.server.launch.child_watch import watch_children
from lightllm.server.launch.plan import child_process_names
from lightllm.server.launch.watchdog import Stall, Watchdog
from lightllm.server.server_layout import ServerLayout

# Far above the 20 ms between the healthy child's beats, even on a loaded shared machine (with 1 s a
# healthy child descheduled for a second was reported).
TIMEOUT_SECONDS = 4.0
DETECTION_BOUND_SECONDS = TIMEOUT_SECONDS + 20.0  # generous: the check itself runs every 0.2 s


def _layout(watched: Tuple[str, ...]) -> ServerLayout:
    tag = f"lightllm_test_beat_{uuid.uuid4().hex[:8]}"
    return ServerLayout(f"{tag}_req", f"{tag}_stats", 4, 64, 64, "ipc://r", "ipc://m", "ipc://d", "ipc://h",
                        heartbeat_processes=watched, shm_heartbeat_name=f"{tag}_beat" if watched else "")


def _beat_forever(layout: ServerLayout, name: str) -> None:
    """A child's main loop reduced to its beat (a spawned process, as the server's children are)."""
    beat = beat_of(layout.open_heartbeat(name))
    while True:
        beat()
        time.sleep(0.02)


def _wait_until_stopped(pid: int, bound_seconds: float = 10.0) -> None:
    """Until the kernel shows ``pid`` stopped (a SIGSTOP takes effect when the process next runs)."""
    deadline = time.monotonic() + bound_seconds
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_the_launcher_plans_one_field_per_child_and_none_with_the_watchdog_off():
    assert child_process_names(2) == ("detokenization", "router", "model_rank0", "model_rank1")
    watched = _layout(child_process_names(2))
    assert watched.shm_segment_bytes()["heartbeats"] == 4 * 8
    off = _layout(())
    assert off.open_heartbeats(create=True) is None and off.open_heartbeat("router") is None
    assert "heartbeats" not in off.shm_segment_bytes()
    with pytest.raises(ValueError):
        ServerLayout("a_req", "a_stats", 4, 64, 64, "r", "m", "d", "h", heartbeat_processes=("router",))


def test_a_child_s_beats_land_in_its_own_field_only():
    layout = _layout(child_process_names(1))
    block = layout.open_heartbeats(create=True)
    try:
        assert block.snapshot() == [NEVER_BEAT] * 3
        stamp = layout.open_heartbeat("router")  # a second mapping, as in the router process
        before = time.monotonic()
        stamp.beat()
        assert block.snapshot()[0] == NEVER_BEAT and block.snapshot()[2] == NEVER_BEAT
        assert before <= block.last_beat(1) <= time.monotonic()
        # Not a child of this server: refused at once (it would never beat and be taken for hung).
        with pytest.raises(ValueError, match=r"^no heartbeat field for process 'model_rank5': the layout watches "
                                             r"detokenization, router, model_rank0$"):
            layout.open_heartbeat("model_rank5")
    finally:
        block.close()
        block.unlink()
    assert block.last_beat(1) == NEVER_BEAT  # the launcher's watcher may read while the server stops


def test_the_watcher_reports_a_stopped_child_by_name_and_not_the_one_that_still_beats():
    names = ("router", "model_rank0")
    layout = _layout(names)
    block = layout.open_heartbeats(create=True)
    ctx = mp.get_context("spawn")
    children: List[Tuple[str, Any]] = [(name, ctx.Process(target=_beat_forever, args=(layout, name), daemon=True))
                                       for name in names]
    stopping = threading.Event()
    reported: List[Tuple[List[Stall], float]] = []
    reported_at: List[float] = []
    died: List[Any] = []
    got = threading.Event()
    try:
        for _, proc in children:
            proc.start()
        deadline = time.monotonic() + 60  # spawning imports the package
        while min(block.snapshot()) == NEVER_BEAT and time.monotonic() < deadline:
            time.sleep(0.05)
        assert min(block.snapshot()) != NEVER_BEAT

        def on_stall(stalls: List[Stall], timeout: float) -> None:
            reported.append((stalls, timeout))
            reported_at.append(time.monotonic())
            got.set()

        watchdog = Watchdog(TIMEOUT_SECONDS, names, block.last_beat)  # the CLI's minimum does not bind the check
        watch_children(children, stopping, lambda name, code: died.append((name, code)), watchdog, on_stall)
        stopped = children[1][1].pid
        os.kill(stopped, signal.SIGSTOP)
        _wait_until_stopped(stopped)
        last_beat = block.last_beat(1)  # final: the child beats no more
        assert got.wait(DETECTION_BOUND_SECONDS), "the stopped child was not reported"
        # Not before its timeout, counted from its last beat (the clock is the machine's, as in the server).
        assert reported_at[0] - last_beat >= TIMEOUT_SECONDS
    finally:
        stopping.set()
        for _, proc in children:
            if proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)  # also ends the stopped one
                proc.join(10)
        block.close()
        block.unlink()
    (stalls, timeout), = reported
    assert timeout == TIMEOUT_SECONDS and [stall.name for stall in stalls] == ["model_rank0"]
    assert stalls[0].silent_seconds > TIMEOUT_SECONDS
    assert died == []


class _IdleInbox:
    """Rank 0's inbox with nothing in it; after ``iterations`` polls it asks the rank to stop."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self.polls = 0
        self.rank: Any = None

    def poll(self, timeout_ms: int) -> bool:
        self.polls += 1
        if self.polls == self.iterations:
            self.rank.stop()
        return False


class _Counter:
    """A clock that counts its readings: the field's value is the number of beats so far."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> float:
        self.count += 1
        return float(self.count)


def test_a_model_rank_beats_before_and_after_each_wait_while_idle():
    from lightllm.server.model_rank.rank_process import ModelRank

    layout = _layout(("model_rank0",))
    block = layout.open_heartbeats(create=True)
    try:
        clock = _Counter()
        backend = SimpleNamespace(has_work=False, has_outside_work=False, poll=lambda: None,
                                  grammars_compiled=lambda: ([], []))
        inbox = _IdleInbox(iterations=5)
        rank = ModelRank(backend, None, is_leader=True, inbox=inbox, heartbeat=block.stamp(0, clock))
        inbox.rank = rank
        rank.serve_forever()  # five idle iterations, then the stop
        # One beat before and one after each of the five waits, and both for the iteration that stops.
        assert inbox.polls == 5 and block.last_beat(0) == 12.0
    finally:
        block.close()
        block.unlink()


# --- a step's silence counts from the end of the wait before it ----------------------------------
# Before, each loop beat only before its blocking wait: the stamp dated from the wait's start, so a
# TP follower's step had up to the 5 s keep-alive period less than --watchdog_timeout.


class _TestClock:
    """A monotonic clock the fakes below move: waits and steps take its time, not the test's."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _LoopEnd(Exception):
    """Raised by a fake to leave a ``serve_forever`` that has no stop of its own."""


def _recorder(clock: _TestClock, beats: List[float]):
    return lambda: beats.append(clock.now)


def test_a_tp_follower_s_step_counts_from_the_end_of_its_wait_for_rank_0():
    from lightllm.server.model_rank.command_channel import MessageKind, TpMessage
    from lightllm.server.model_rank.rank_process import ModelRank

    clock, beats, seen = _TestClock(), [], []

    class SlowChannel:
        """Rank 0 sends a step after one keep-alive period of silence, then the shutdown."""

        messages = [TpMessage(MessageKind.STEP, []), TpMessage(MessageKind.SHUTDOWN)]

        def receive(self) -> TpMessage:
            clock.advance(5.0)
            return self.messages.pop(0)

        def wait_for_ranks(self) -> None:
            raise AssertionError("no request is admitted here, so no step waits for the ranks")

    def step():
        seen.append(clock.now - beats[-1])  # this rank's silence as the step begins
        clock.advance(2.0)
        return SimpleNamespace(did_work=True)

    backend = SimpleNamespace(has_work=True, has_outside_work=False, poll=lambda: None, step=step)
    heartbeat = SimpleNamespace(beat=_recorder(clock, beats))
    ModelRank(backend, None, is_leader=False, channel=SlowChannel(), heartbeat=heartbeat).serve_forever()
    assert seen == [0.0]


def test_the_router_s_round_counts_from_the_end_of_its_poll(monkeypatch):
    from lightllm.server.router import manager as router_manager

    clock, beats, seen = _TestClock(), [], []

    class SlowPoller:
        def register(self, socket: Any, flags: int) -> None:
            pass

        def poll(self, timeout_ms: int) -> list:
            clock.advance(timeout_ms / 1000)  # nothing came for the whole interval
            return []

    def admit() -> None:
        seen.append(clock.now - beats[-1])
        if len(seen) == 2:
            raise _LoopEnd

    monkeypatch.setattr(router_manager.zmq, "Poller", SlowPoller)
    router = object.__new__(router_manager.RouterManager)
    router.config = SimpleNamespace(schedule_time_interval=1.0)
    router.inbox, router.beat, router.admit = object(), _recorder(clock, beats), admit
    router.stats = SimpleNamespace(set=lambda name, value: None)
    router.queue = type("Queue", (list,), {"running": []})()
    with pytest.raises(_LoopEnd):
        router.serve_forever()
    assert seen == [0.0, 0.0]


def test_the_detokenizer_s_message_counts_from_the_end_of_its_wait():
    from lightllm.server.detokenization.manager import DetokenizationManager

    clock, beats, seen = _TestClock(), [], []

    class SlowInbox:
        def poll(self, timeout_ms: int) -> bool:
            clock.advance(0.9)  # the message came just before the idle wake
            return True

        def recv_pyobj(self) -> str:
            return "message"

    def handle(message: Any) -> None:
        seen.append(clock.now - beats[-1])
        raise _LoopEnd

    detokenizer = object.__new__(DetokenizationManager)
    detokenizer.inbox, detokenizer.beat, detokenizer.handle = SlowInbox(), _recorder(clock, beats), handle
    with pytest.raises(_LoopEnd):
        detokenizer.serve_forever()
    assert seen == [0.0]



def test_the_shutdown_waits_for_the_watcher_s_read_before_unmapping_the_heartbeats():
    """The watcher may be reading a heartbeat while the launcher shuts down: with numpy 1 the view it
    held made ``SharedMemory.close`` raise ``BufferError`` (the segments stayed in /dev/shm), with
    numpy 2 the read went to unmapped memory.  The shutdown joins the watcher before it unmaps."""
    from lightllm.server.launch.server_processes import ServerProcesses

    layout = _layout(child_process_names(1))
    block = layout.open_heartbeats(create=True)
    layout.open_heartbeat("router").beat()
    stamped = block.last_beat(1)
    procs = ServerProcesses(shm_heartbeats=block, heartbeat_processes=child_process_names(1))
    read: List[float] = []

    def watcher() -> None:  # a round that began its read just as the shutdown started
        procs.stopping.wait()
        time.sleep(0.3)
        read.append(block.last_beat(1))

    procs.watcher = threading.Thread(target=watcher, daemon=True)
    procs.watcher.start()
    procs.shutdown()
    assert read == [stamped] and stamped != NEVER_BEAT
    assert not os.path.exists(f"/dev/shm/{layout.shm_heartbeat_name}")
    assert block.last_beat(1) == NEVER_BEAT  # unmapped: the read keeps no view and sees nothing


def test_a_segment_still_in_use_is_unlinked_all_the_same(monkeypatch):
    from lightllm.server.launch.server_processes import ServerProcesses

    layout = _layout(child_process_names(1))
    block = layout.open_heartbeats(create=True)

    def close() -> None:
        raise BufferError("cannot close exported pointers exist")

    monkeypatch.setattr(block, "close", close)
    ServerProcesses(shm_heartbeats=block, heartbeat_processes=child_process_names(1)).shutdown()
    assert not os.path.exists(f"/dev/shm/{layout.shm_heartbeat_name}")
