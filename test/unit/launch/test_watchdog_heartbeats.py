"""The heartbeats behind ``--watchdog_timeout``: real shared memory, real processes, the launcher's watcher.

Each watched child stamps its own field of the heartbeat segment once per loop iteration; the
launcher's child watcher reports a live child whose stamp went stale.  Here a real spawned process
beats through the same :class:`HeartbeatStamp` the server's children use and is stopped with
SIGSTOP; a model rank's loop, built from fakes as in the other rank tests, beats once per iteration.
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

DETECTION_BOUND_SECONDS = 20.0  # generous: the check itself runs every 0.2 s


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
        assert layout.open_heartbeat("model_rank5") is None  # not a child of this server
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
            got.set()

        watchdog = Watchdog(1.0, names, block.last_beat)  # the CLI's minimum does not bind the check itself
        watch_children(children, stopping, lambda name, code: died.append((name, code)), watchdog, on_stall)
        stopped_at = time.monotonic()
        os.kill(children[1][1].pid, signal.SIGSTOP)
        assert got.wait(DETECTION_BOUND_SECONDS), "the stopped child was not reported"
        assert time.monotonic() - stopped_at >= 1.0 - 0.25  # not before its timeout (one round of slack)
    finally:
        stopping.set()
        for _, proc in children:
            if proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)  # also ends the stopped one
                proc.join(10)
        block.close()
        block.unlink()
    (stalls, timeout), = reported
    assert timeout == 1.0 and [stall.name for stall in stalls] == ["model_rank0"] and stalls[0].silent_seconds > 1.0
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


def test_a_model_rank_beats_once_per_loop_iteration_while_idle():
    from lightllm.server.model_rank.rank_process import ModelRank

    layout = _layout(("model_rank0",))
    block = layout.open_heartbeats(create=True)
    try:
        clock = _Counter()
        backend = SimpleNamespace(has_work=False, has_outside_work=False, poll=lambda: None)
        inbox = _IdleInbox(iterations=5)
        rank = ModelRank(backend, None, is_leader=True, inbox=inbox, heartbeat=block.stamp(0, clock))
        inbox.rank = rank
        rank.serve_forever()  # five idle iterations, then the stop
        # One beat before each of the five waits, and one before the iteration that stops.
        assert inbox.polls == 5 and block.last_beat(0) == 6.0
    finally:
        block.close()
        block.unlink()
