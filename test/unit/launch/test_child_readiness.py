"""The launcher's wait for its children: every child watched at once, the dead one named first.

Real spawned processes stand in for the children (no model): one that reports ready, one that
never reports (as rank 0 blocked in the rendezvous for a peer that died), one that is killed
before it reports (as a TP rank killed during start-up).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any, Callable, List

import pytest

from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.child_readiness import StartingChild, StartupError, wait_for_children_ready

# Far beyond any wait here: reaching it means the launcher missed the event the test makes.
TIMEOUT_S = 120.0


def report_ready(conn: Any) -> None:
    conn.send(("ready", None))
    time.sleep(3600)  # serves on, as a ready child does


def never_report(conn: Any) -> None:
    time.sleep(3600)


def die_killed(conn: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_killed_later(conn: Any) -> None:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)


def report_peer_error(conn: Any) -> None:
    conn.send(("error", "model_rank0: RuntimeError: Connection closed by peer"))
    time.sleep(3600)


def report_error_then_exit_later(conn: Any) -> None:
    time.sleep(1.0)
    conn.send(("error", "model_rank1: RuntimeError: Connection closed by peer"))
    os._exit(1)


def die_killed_much_later(conn: Any) -> None:
    time.sleep(4.0)
    os.kill(os.getpid(), signal.SIGKILL)


def report_refusal(conn: Any) -> None:
    conn.send(("refused", "--linear_backend onednn: not available here"))


def _start(targets: List[Callable[[Any], None]]) -> List[StartingChild]:
    ctx = mp.get_context("spawn")
    children = []
    for index, target in enumerate(targets):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        process = ctx.Process(target=target, args=(child_conn,), daemon=True)
        process.start()
        child_conn.close()
        children.append(StartingChild(f"{target.__name__}{index}", process, parent_conn))
    return children


def _stop(children: List[StartingChild]) -> None:
    for child in children:
        if child.process.is_alive():
            child.process.kill()
        child.process.join(10)


def test_every_child_ready_returns() -> None:
    children = _start([report_ready, report_ready])
    try:
        wait_for_children_ready(children, TIMEOUT_S)
    finally:
        _stop(children)


def test_a_child_killed_while_an_earlier_one_is_waited_for_ends_the_wait() -> None:
    # The launcher waited on rank 0's pipe alone (for up to 900 s) while rank 1 was already dead.
    children = _start([report_ready, never_report, die_killed])
    try:
        with pytest.raises(StartupError) as err:
            wait_for_children_ready(children, TIMEOUT_S)
        assert str(err.value) == "die_killed2 exited during start-up (killed by SIGKILL, exit code -9)"
    finally:
        _stop(children)


def test_an_error_caused_by_a_dead_peer_names_the_dead_one_first() -> None:
    # Rank 0's collective fails because rank 1 died: its error alone blamed the healthy rank.
    children = _start([report_peer_error, die_killed_later])
    try:
        with pytest.raises(StartupError) as err:
            wait_for_children_ready(children, TIMEOUT_S, grace_s=TIMEOUT_S)
        assert str(err.value) == ("die_killed_later1 exited during start-up (killed by SIGKILL, exit code -9); then model_rank0: "
                                  "RuntimeError: Connection closed by peer")
    finally:
        _stop(children)


def test_a_peer_that_reported_its_own_error_is_not_named_when_another_dies_later() -> None:
    # The peer's message was read when it exited; a later look read only its pipe's end and took it
    # for a child that died without a word, naming it instead of the one killed.
    children = _start([report_peer_error, report_error_then_exit_later, die_killed_much_later])
    try:
        with pytest.raises(StartupError) as err:
            wait_for_children_ready(children, TIMEOUT_S, grace_s=TIMEOUT_S)
        assert str(err.value) == ("die_killed_much_later2 exited during start-up (killed by SIGKILL, exit code -9); then model_rank0: "
                                  "RuntimeError: Connection closed by peer")
    finally:
        _stop(children)


def test_an_error_with_every_peer_alive_is_reported_as_it_is() -> None:
    children = _start([report_peer_error, never_report])
    try:
        with pytest.raises(StartupError) as err:
            wait_for_children_ready(children, TIMEOUT_S, grace_s=0.2)
        assert str(err.value) == "model_rank0: RuntimeError: Connection closed by peer"
    finally:
        _stop(children)


def test_a_refusal_is_an_argument_error_and_a_silent_child_times_out() -> None:
    children = _start([report_refusal])
    try:
        with pytest.raises(ArgumentError, match="--linear_backend onednn"):
            wait_for_children_ready(children, TIMEOUT_S)
    finally:
        _stop(children)
    children = _start([never_report])
    try:
        with pytest.raises(StartupError, match=r"^never_report0 did not report ready within 1s$"):
            wait_for_children_ready(children, 1.0)
    finally:
        _stop(children)


def report_ready_then_exit(conn: Any) -> None:
    conn.send(("ready", None))
    os._exit(1)


def report_own_error_then_exit(conn: Any) -> None:
    conn.send(("error", "model_rank1: RuntimeError: Connection closed by peer"))
    os._exit(1)


def report_cause_then_exit(conn: Any) -> None:
    conn.send(("error", "model_rank0: ValueError: shard model-00002 is truncated"))
    time.sleep(0.3)
    os._exit(1)


def test_a_child_that_died_after_it_reported_ready_ends_the_wait_under_its_name() -> None:
    children = _start([report_ready_then_exit, never_report])
    try:
        with pytest.raises(StartupError) as err:
            wait_for_children_ready(children, TIMEOUT_S)
        assert str(err.value) == "report_ready_then_exit0 exited during start-up (exit code 1)"
    finally:
        _stop(children)


def test_the_first_error_is_the_cause_when_the_dying_peer_reported_its_own() -> None:
    # Rank 0 reports the real cause and exits; rank 1's collective fails next and it reports that
    # too: rank 1 is not the one to blame.
    children = _start([report_cause_then_exit, report_own_error_then_exit])
    try:
        with pytest.raises(StartupError) as err:
            wait_for_children_ready(children, TIMEOUT_S, grace_s=2.0)
        assert "shard model-00002 is truncated" in str(err.value) or "Connection closed by peer" in str(err.value)
        assert "exited during start-up" not in str(err.value)
    finally:
        _stop(children)
