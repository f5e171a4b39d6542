"""The watchdog's staleness check (an injected clock) and its flag, ``--watchdog_timeout``.

Before it existed a child that stopped making progress without dying (SIGSTOP, a stuck kernel or
collective) was never noticed: ``/health`` answered 200 and requests waited forever.  The server
processes themselves are exercised in test_watchdog_heartbeats.py and
test/integration/test_watchdog_server.py.
"""

from __future__ import annotations

from typing import List

import pytest

from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import parse_server_args
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.pd_master import check_master_flags
from lightllm.server.launch.watchdog import (
    DEFAULT_WATCHDOG_TIMEOUT_SECONDS,
    MIN_WATCHDOG_TIMEOUT_SECONDS,
    WATCHER_PAUSE_SECONDS,
    Stall,
    Watchdog,
    describe_stalls,
)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _watchdog(clock: Clock, beats: List[float], timeout: float = 20.0) -> Watchdog:
    names = [f"p{i}" for i in range(len(beats))]
    return Watchdog(timeout, names, lambda slot: beats[slot], clock=clock)


def _advance_checking(clock: Clock, watchdog: Watchdog, seconds: float, step: float = 0.2) -> List[Stall]:
    """Move the clock by ``seconds`` in the watcher's rounds, returning the last check's stalls."""
    stalls: List[Stall] = []
    for _ in range(round(seconds / step)):
        clock.advance(step)
        stalls = watchdog.stalled()
    return stalls


# --- the check ----------------------------------------------------------------------------------


def test_a_process_silent_for_longer_than_the_timeout_is_stalled_and_one_that_beats_is_not():
    clock = Clock()
    beats = [0.0, 0.0]
    watchdog = _watchdog(clock, beats)
    watchdog.arm()
    for _ in range(150):  # 30 s: p0 beats every round, p1 never after its first beat
        clock.advance(0.2)
        beats[0] = clock.now
        if beats[1] == 0.0:
            beats[1] = clock.now
        stalls = watchdog.stalled()
        silent = clock.now - beats[1]
        assert [s.name for s in stalls] == (["p1"] if silent > 20.0 else []), (silent, stalls)
    assert stalls[0].silent_seconds == pytest.approx(clock.now - beats[1])


def test_nothing_is_stalled_before_the_watchdog_is_armed():
    clock = Clock()
    watchdog = _watchdog(clock, [1.0, 2.0])
    clock.advance(10_000)
    assert watchdog.stalled() == []


def test_a_process_that_never_beat_counts_from_the_arming_not_from_zero():
    """The time a child took to reach its loop (the model load) is not held against it."""
    clock = Clock()
    beats = [0.0]
    watchdog = _watchdog(clock, beats)
    watchdog.arm()
    assert _advance_checking(clock, watchdog, 19.8) == []
    stalls = _advance_checking(clock, watchdog, 0.4)
    assert [s.name for s in stalls] == ["p0"] and stalls[0].silent_seconds == pytest.approx(20.2)


def test_a_beat_before_the_arming_counts_from_the_arming():
    clock = Clock()
    beats = [clock.now - 500]  # the rank beat, then waited for the others to load
    watchdog = _watchdog(clock, beats)
    watchdog.arm()
    assert watchdog.stalled() == []
    assert _advance_checking(clock, watchdog, 19.8) == []


def test_several_stalled_processes_come_longest_silence_first():
    clock = Clock()
    beats = [0.0, 0.0, 0.0]
    watchdog = _watchdog(clock, beats)
    watchdog.arm()
    beats[:] = [clock.now, clock.now + 1.0, clock.now]
    clock.advance(1.0)
    stalls = _advance_checking(clock, watchdog, 22.0)
    assert [s.name for s in stalls] == ["p0", "p2", "p1"]
    assert stalls[0].silent_seconds > stalls[2].silent_seconds


def test_a_pause_of_the_launcher_itself_restarts_the_count_instead_of_blaming_the_children():
    """Ctrl-Z then fg (or a frozen VM) stops every process of the server: the watcher resumes with
    every stamp minutes old, though no child hung."""
    clock = Clock()
    beats = [0.0]
    watchdog = _watchdog(clock, beats)
    watchdog.arm()
    beats[0] = clock.now
    clock.advance(600.0)  # nobody ran, the watcher included
    assert watchdog.stalled() == []
    # A child that does not resume is still caught, one timeout later.
    assert _advance_checking(clock, watchdog, 19.8) == []
    assert [s.name for s in _advance_checking(clock, watchdog, 0.4)] == ["p0"]


def test_a_late_watcher_round_below_the_pause_threshold_does_not_restart_the_count():
    clock = Clock()
    beats = [clock.now]
    watchdog = _watchdog(clock, beats)
    watchdog.arm()
    assert _advance_checking(clock, watchdog, 16.0) == []
    clock.advance(WATCHER_PAUSE_SECONDS - 0.5)  # a slow round, not a pause
    assert [s.name for s in watchdog.stalled()] == ["p0"]


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError):
        Watchdog(0.0, ["p0"], lambda slot: 0.0)


def test_the_description_names_each_process_and_its_silence():
    assert describe_stalls([Stall("model_rank1", 301.4)], 300.0) == \
        "model_rank1 made no progress for 301 s (--watchdog_timeout 300)"
    assert describe_stalls([Stall("model_rank1", 17.0), Stall("model_rank0", 16.2)], 15.0) == \
        "model_rank1 (17 s) and model_rank0 (16 s) made no progress (--watchdog_timeout 15)"
    assert describe_stalls([Stall("a", 20), Stall("b", 19), Stall("c", 18)], 15.0).startswith("a (20 s), b (19 s) and c")


# --- the minimum is above every watched loop's idle silence -------------------------------------


def test_the_minimum_is_well_above_the_longest_idle_silence_of_every_watched_loop():
    from lightllm.server.detokenization.manager import IDLE_WAKE_MS
    from lightllm.server.launch.args_check import MAX_SCHEDULE_TIME_INTERVAL
    from lightllm.server.model_rank.command_channel import KEEPALIVE_SECONDS
    from lightllm.server.model_rank.rank_process import LEADER_IDLE_WAKE_MS

    follower = KEEPALIVE_SECONDS + LEADER_IDLE_WAKE_MS / 1000  # rank 0 checks its keep-alive once per idle wake
    longest = max(follower, LEADER_IDLE_WAKE_MS / 1000, IDLE_WAKE_MS / 1000, MAX_SCHEDULE_TIME_INTERVAL)
    assert MIN_WATCHDOG_TIMEOUT_SECONDS >= 2 * longest
    assert MIN_WATCHDOG_TIMEOUT_SECONDS > WATCHER_PAUSE_SECONDS
    assert DEFAULT_WATCHDOG_TIMEOUT_SECONDS >= 10 * MIN_WATCHDOG_TIMEOUT_SECONDS


# --- the flag -------------------------------------------------------------------------------------


def _args(*argv: str):
    return parse_server_args(["--model_dir", "/m", *argv])


def test_the_default_is_sglang_s_300_seconds():
    args = _args()
    assert args.watchdog_timeout == DEFAULT_WATCHDOG_TIMEOUT_SECONDS == 300.0
    validate_args(args)


@pytest.mark.parametrize("value", ["0", "15", "300", "86400"])
def test_off_and_values_from_the_minimum_are_accepted(value):
    args = _args("--watchdog_timeout", value)
    validate_args(args)
    assert args.watchdog_timeout == float(value)


@pytest.mark.parametrize("value", ["-1", "-0.5", "1", "5", "14.9"])
def test_negative_and_too_small_values_are_refused_in_one_line(value):
    with pytest.raises(ArgumentError) as exc:
        validate_args(_args("--watchdog_timeout", value))
    message = str(exc.value)
    assert message.startswith("--watchdog_timeout must be 0 (off) or at least 15 seconds") and "\n" not in message


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "abc"])
def test_non_numbers_and_non_finite_values_are_usage_errors_of_one_line(value, capsys):
    with pytest.raises(SystemExit) as exc:
        _args("--watchdog_timeout", value)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--watchdog_timeout" in lines[0], lines


def test_the_pd_nodes_take_it_and_the_master_which_runs_no_model_refuses_it():
    for role in ("prefill", "decode"):
        validate_args(_args("--run_mode", role, "--watchdog_timeout", "60"))
    args = _args("--run_mode", "pd_master", "--watchdog_timeout", "60")
    validate_args(args)
    with pytest.raises(ValueError, match=r"^--watchdog_timeout configures model nodes and does nothing on "
                                         r"--run_mode pd_master; give it to"):
        check_master_flags(args)
    check_master_flags(_args("--run_mode", "pd_master"))  # the default is not a given flag
