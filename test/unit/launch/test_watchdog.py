"""The watchdog's staleness check (an injected clock) and its flag, ``--watchdog_timeout``.

Before it existed a child that stopped making progress without dying (SIGSTOP, a stuck kernel or
collective) was never noticed: ``/health`` answered 200 and requests waited forever.  The server
processes themselves are exercised in test_watchdog_heartbeats.py and
test/integration/test_watchdog_server.py.
"""

from __future__ import annotations

import logging
from typing import List

import pytest

from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import parse_server_args
from lightllm.server.launch.args_check import validate_args
from lightllm.server.launch.pd_master import check_master_flags
from lightllm.server.launch.watchdog import (
    DEFAULT_WATCHDOG_TIMEOUT_SECONDS,
    GAP_WARNING_INTERVAL_SECONDS,
    MIN_WATCHDOG_TIMEOUT_SECONDS,
    WATCH_ROUND_SECONDS,
    WATCHER_GAP_SECONDS,
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


def test_a_pause_of_the_launcher_itself_is_not_counted_against_the_children():
    """Ctrl-Z then fg (or a frozen VM) stops every process of the server: the watcher resumes with
    every stamp minutes old, though no child hung."""
    clock = Clock()
    beats = [0.0]
    watchdog = _watchdog(clock, beats)
    watchdog.arm()
    beats[0] = clock.now
    clock.advance(600.0)  # nobody ran, the watcher included: all but the threshold's 1 s is credited
    assert watchdog.stalled() == []
    # A child that does not resume is still caught once the watcher counted it silent for the timeout;
    # the stall gives the real silence and the part not counted.
    assert _advance_checking(clock, watchdog, 18.8) == []
    stalls = _advance_checking(clock, watchdog, 0.4)
    assert [s.name for s in stalls] == ["p0"]
    assert stalls[0].silent_seconds == pytest.approx(600.0 + 19.2)
    assert stalls[0].credited_seconds == pytest.approx(600.0 - WATCHER_GAP_SECONDS)


def test_a_late_watcher_round_below_the_gap_threshold_is_not_credited():
    clock = Clock()
    beats = [clock.now]
    watchdog = _watchdog(clock, beats)
    watchdog.arm()
    assert _advance_checking(clock, watchdog, 19.2) == []
    clock.advance(WATCHER_GAP_SECONDS - 0.1)  # a slow round, not a gap
    assert [s.name for s in watchdog.stalled()] == ["p0"]


def test_repeated_watcher_gaps_do_not_hide_a_hung_child(caplog):
    """Before, any round over 5 s late restarted every count: a launcher held for 6 s once per
    timeout hid a hung child for ever.  Now only the gaps are credited, and they are logged."""
    clock = Clock()
    beats = [0.0, 0.0]  # p0 beats every round it is watched, p1 hangs after its first beat
    watchdog = _watchdog(clock, beats, timeout=20.1)  # not a multiple of the rounds: no float ties
    watchdog.arm()
    beats[:] = [clock.now, clock.now]
    hung_at = clock.now
    caught: List[Stall] = []
    with caplog.at_level(logging.WARNING, logger="lightllm.server.launch.watchdog"):
        for _ in range(20):  # 9 s of rounds, then the watcher is held for 6 s (wall silence 15 s)
            for _ in range(45):
                clock.advance(0.2)
                beats[0] = clock.now
                caught = watchdog.stalled()
                if caught:
                    break
            if caught:
                break
            clock.advance(6.0)
    assert [s.name for s in caught] == ["p1"], "the hung child was never reported"
    # Reported once the watcher counted it silent for the timeout: after two gaps, 5.2 s credited each
    # (the round that ends a gap comes 6.2 s after the previous one; 1 s of it is counted).
    credited = 2 * (6.0 + 0.2 - WATCHER_GAP_SECONDS)
    assert caught[0].credited_seconds == pytest.approx(credited)
    assert caught[0].silent_seconds == pytest.approx(clock.now - hung_at)
    assert clock.now - hung_at == pytest.approx(20.2 + credited)
    lines = [r.getMessage() for r in caplog.records if "child watcher did not run" in r.getMessage()]
    # The first gap's line, then the second's, held back by the interval, flushed as the stall is reported.
    assert [line.split(" (")[0] for line in lines] == [
        "the launcher's child watcher did not run for 5.2 s beyond 1 s between its checks"] * 2, lines


def test_the_credited_gaps_are_summed_into_one_warning_per_interval(caplog):
    clock = Clock()
    beats = [0.0]
    watchdog = _watchdog(clock, beats, timeout=1000.0)
    watchdog.arm()
    with caplog.at_level(logging.WARNING, logger="lightllm.server.launch.watchdog"):
        for gap in (4.0, 3.0, 5.0, 2.5):  # 3, 2, 4 and 1.5 s credited, each gap 5 s of rounds apart
            clock.advance(gap)
            beats[0] = clock.now
            watchdog.stalled()
            _advance_checking(clock, watchdog, 5.0)
        # The last three were held back; they go out once the interval since the first line passed.
        _advance_checking(clock, watchdog, GAP_WARNING_INTERVAL_SECONDS)
    lines = [r.getMessage() for r in caplog.records if "child watcher did not run" in r.getMessage()]
    assert [line.split(": a paused")[0] for line in lines] == [
        "the launcher's child watcher did not run for 3.0 s beyond 1 s between its checks (1 gap, the longest 3.0 s",
        "the launcher's child watcher did not run for 7.5 s beyond 1 s between its checks (3 gaps, the longest 4.0 s"]
    assert lines[0].endswith("not counted toward --watchdog_timeout 1000 (one such line per 30 s at most)")


def test_late_rounds_summing_under_half_a_second_are_credited_but_not_warned_about(caplog):
    # A 2-core VM logged "did not run for 0.0 s beyond 1 s": any late round was a warning.
    clock = Clock()
    beats = [0.0]
    watchdog = _watchdog(clock, beats, timeout=1000.0)
    watchdog.arm()
    with caplog.at_level(logging.WARNING, logger="lightllm.server.launch.watchdog"):
        for late in (1e-6, 0.2, 0.29):
            clock.advance(WATCHER_GAP_SECONDS + late)
            watchdog.stalled()
        assert not [r for r in caplog.records if "child watcher did not run" in r.getMessage()]
        assert watchdog._credited == pytest.approx(1e-6 + 0.2 + 0.29)
        clock.advance(WATCHER_GAP_SECONDS + 0.01)  # the sum reaches watchdog.py GAP_WARNING_MIN_SECONDS
        watchdog.stalled()
    lines = [r.getMessage() for r in caplog.records if "child watcher did not run" in r.getMessage()]
    assert [line.split(" (")[0] for line in lines] == [
        "the launcher's child watcher did not run for 0.5 s beyond 1 s between its checks"], lines
    assert "(4 gaps, the longest 0.3 s" in lines[0]


def test_small_gaps_an_interval_apart_do_not_add_up_to_a_warning(caplog):
    clock = Clock()
    beats = [0.0]
    watchdog = _watchdog(clock, beats, timeout=1000.0)
    watchdog.arm()
    with caplog.at_level(logging.WARNING, logger="lightllm.server.launch.watchdog"):
        for _ in range(4):  # 0.3 s late once per 31 s: 1.2 s in all, never 0.5 s within an interval
            clock.advance(WATCHER_GAP_SECONDS + 0.3)
            watchdog.stalled()
            _advance_checking(clock, watchdog, GAP_WARNING_INTERVAL_SECONDS + 1)
    assert not [r for r in caplog.records if "child watcher did not run" in r.getMessage()]
    assert watchdog._credited == pytest.approx(1.2)


def test_a_watcher_steadily_a_little_late_is_warned_about(caplog):
    # 0.4 s late at every round credits about 29% of the time: no single gap is large, the sum is.
    clock = Clock()
    beats = [0.0]
    watchdog = _watchdog(clock, beats, timeout=1000.0)
    watchdog.arm()
    with caplog.at_level(logging.WARNING, logger="lightllm.server.launch.watchdog"):
        for _ in range(3):
            clock.advance(WATCHER_GAP_SECONDS + 0.4)
            watchdog.stalled()
    lines = [r.getMessage() for r in caplog.records if "child watcher did not run" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("the launcher's child watcher did not run for 0.8 s"), lines


def test_a_gap_a_process_beat_in_is_credited_only_from_its_beat():
    clock = Clock()
    beats = [clock.now]
    watchdog = _watchdog(clock, beats)
    watchdog.arm()
    clock.advance(10.0)
    beats[0] = clock.now - 4.0  # the child beat during the gap, then hung
    assert watchdog.stalled() == []  # 4 s after its beat, all of them credited (the gap's last 9 s are)
    assert _advance_checking(clock, watchdog, 19.8) == []
    stalls = _advance_checking(clock, watchdog, 0.4)
    assert [s.name for s in stalls] == ["p0"]
    assert stalls[0].silent_seconds == pytest.approx(24.2) and stalls[0].credited_seconds == pytest.approx(4.0)


def test_a_beat_early_in_a_gap_is_credited_only_for_the_gap_s_part_after_it():
    """Of a gap, the part beyond the threshold is credited, taken as its end: a beat in the counted
    first second gets the whole credit, one later only the part after it."""
    clock = Clock()
    beats = [clock.now, clock.now]
    watchdog = _watchdog(clock, beats)
    watchdog.arm()
    start = clock.now
    clock.advance(10.0)  # 9 s credited, from start + 1 to start + 10
    beats[:] = [start + 0.5, start + 7.0]
    watchdog.stalled()
    assert watchdog._credited - watchdog._credited_before[0] == pytest.approx(9.0)
    assert watchdog._credited - watchdog._credited_before[1] == pytest.approx(3.0)


@pytest.mark.parametrize("interval", [1.1, 2.0, 0.9])
def test_a_watcher_steadily_late_still_reports_a_hang_within_timeout_times_interval(interval):
    """Before, each check more than 1 s after the previous one had all but one 0.2 s round credited:
    checks 1.01 s apart reported a hang at 300 s after 1516 s, 2 s apart after 3000 s, and 1 s was a
    cliff.  Now only the part beyond 1 s is: detection by about timeout * interval / 1 s."""
    clock = Clock()
    beats = [clock.now]
    timeout = 300.0
    watchdog = _watchdog(clock, beats, timeout=timeout)
    watchdog.arm()
    hung_at = clock.now
    stalls: List[Stall] = []
    while not stalls and clock.now - hung_at < 20 * timeout:
        clock.advance(interval)
        stalls = watchdog.stalled()
    assert [s.name for s in stalls] == ["p0"]
    bound = timeout * max(interval, WATCHER_GAP_SECONDS) / WATCHER_GAP_SECONDS
    assert bound <= clock.now - hung_at <= bound + 2 * interval
    assert stalls[0].silent_seconds == pytest.approx(clock.now - hung_at)
    assert stalls[0].silent_seconds - stalls[0].credited_seconds == pytest.approx(
        timeout, abs=WATCHER_GAP_SECONDS + 1e-6)


def test_a_check_costs_the_same_however_long_a_process_is_silent():
    """The credited time is one running total: nothing grows with the gaps of a silent process."""
    clock = Clock()
    beats = [clock.now, clock.now]
    watchdog = _watchdog(clock, beats, timeout=1e9)
    watchdog.arm()
    for _ in range(1000):
        clock.advance(2.0)
        beats[0] = clock.now
        watchdog.stalled()
    assert not hasattr(watchdog, "_gaps")
    assert watchdog._credited == pytest.approx(1000.0)
    assert watchdog._credited - watchdog._credited_before[1] == pytest.approx(1000.0)
    assert watchdog._credited - watchdog._credited_before[0] == 0.0


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError):
        Watchdog(0.0, ["p0"], lambda slot: 0.0)


def test_the_description_names_each_process_and_its_silence():
    assert describe_stalls([Stall("model_rank1", 301.4)], 300.0) == \
        "model_rank1 made no progress for 301 s (--watchdog_timeout 300)"
    assert describe_stalls([Stall("model_rank1", 17.0), Stall("model_rank0", 16.2)], 15.0) == \
        "model_rank1 (17 s) and model_rank0 (16 s) made no progress (--watchdog_timeout 15)"
    several = describe_stalls([Stall("a", 20), Stall("b", 19), Stall("c", 18)], 15.0)
    assert several.startswith("a (20 s), b (19 s) and c")


def test_the_description_gives_the_real_silence_and_the_part_not_counted():
    assert describe_stalls([Stall("model_rank0", 1516.2, 1216.0)], 300.0) == \
        "model_rank0 made no progress for 1516 s, 1216 s of it not counted: the watcher was held up " \
        "(--watchdog_timeout 300)"
    assert describe_stalls([Stall("a", 40.0, 20.0), Stall("b", 16.0, 0.2)], 15.0) == \
        "a (40 s, 20 s of it not counted: the watcher was held up) and b (16 s) made no progress " \
        "(--watchdog_timeout 15)"


# --- the minimum is above every watched loop's idle silence -------------------------------------


def test_the_minimum_is_well_above_the_longest_idle_silence_of_every_watched_loop():
    from lightllm.server.detokenization.manager import IDLE_WAKE_MS
    from lightllm.server.launch.args_check import MAX_SCHEDULE_TIME_INTERVAL
    from lightllm.server.model_rank.command_channel import KEEPALIVE_SECONDS
    from lightllm.server.model_rank.rank_process import LEADER_IDLE_WAKE_MS

    follower = KEEPALIVE_SECONDS + LEADER_IDLE_WAKE_MS / 1000  # rank 0 checks its keep-alive once per idle wake
    longest = max(follower, LEADER_IDLE_WAKE_MS / 1000, IDLE_WAKE_MS / 1000, MAX_SCHEDULE_TIME_INTERVAL)
    assert MIN_WATCHDOG_TIMEOUT_SECONDS >= 2 * longest
    assert MIN_WATCHDOG_TIMEOUT_SECONDS > 10 * WATCHER_GAP_SECONDS > 10 * WATCH_ROUND_SECONDS
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
