"""Wide forwards pause while narrow ones run faster per unit of estimated work (another program holds
the borrowed core), and resume when a trial finds wide at least as fast again.

Driven by an injected clock and given forward times: no timing measured in the test decides anything.
"""

from __future__ import annotations

import logging

import torch

from lightllm.server.model_rank.execution.forward_threads import ForwardThreads
from lightllm.server.model_rank.execution.wide_forward_backoff import WideForwardBackoff


class Machine:
    """A clock, and how long a forward of 10 ms of estimated work takes wide and narrow right now."""

    def __init__(self) -> None:
        self.now = 100.0
        self.wide_s = 0.006  # quiet: two threads halve most of the work
        self.narrow_s = 0.010


def _forwards(backoff: WideForwardBackoff, machine: Machine, seconds: float) -> list[bool]:
    """Forwards the rule wants wide, one after another for ``seconds``; which ran wide."""
    ran = []
    end = machine.now + seconds
    while machine.now < end:
        wide = backoff.runs_wide()
        wall = machine.wide_s if wide else machine.narrow_s
        machine.now += wall
        backoff.record("decode", wide, wall, 0.010)
        ran.append(wide)
    return ran


def _backoff(machine: Machine) -> WideForwardBackoff:
    return WideForwardBackoff(clock=lambda: machine.now)


def test_on_a_quiet_machine_only_the_trials_run_narrow() -> None:
    machine = Machine()
    ran = _forwards(_backoff(machine), machine, 10.0)
    # Two narrow trial forwards every 2 s.
    assert ran.count(False) == 2 * 4
    assert ran[:100] == [True] * 100


def test_a_busy_core_pauses_wide_forwards_and_a_quiet_one_brings_them_back() -> None:
    machine = Machine()
    backoff = _backoff(machine)
    _forwards(backoff, machine, 3.0)
    machine.wide_s = 0.060  # another program on the borrowed core: wide is ten times slower
    busy = _forwards(backoff, machine, 20.0)
    # Within one trial interval the rank runs narrow, and stays narrow but for short wide trials.
    assert busy[-100:] == [False] * 100
    # Up to one trial interval wide before the first trial finds it out (about 17 forwards of 60 ms),
    # then two wide forwards per trial after pauses of 1, 2, 4 and 8 s.
    assert sum(busy) <= 17 + 2 * 4 + 1
    machine.wide_s = 0.006  # the other program ends
    quiet = _forwards(backoff, machine, 40.0)
    assert quiet[-100:] == [True] * 100


def test_pauses_double_while_wide_stays_slower_up_to_the_longest() -> None:
    machine = Machine()
    backoff = _backoff(machine)
    _forwards(backoff, machine, 2.5)
    machine.wide_s = 0.060
    starts = []
    ran = _forwards(backoff, machine, 200.0)
    time_at = 102.5
    previous = True
    for wide in ran:
        if wide and not previous:
            starts.append(round(time_at, 1))
        previous = wide
        time_at += machine.wide_s if wide else machine.narrow_s
    gaps = [round(b - a) for a, b in zip(starts, starts[1:])]
    assert gaps[:5] == [2, 4, 8, 16, 30] and set(gaps[5:]) <= {30}


def test_wide_that_waits_for_the_front_end_but_still_wins_keeps_running_wide() -> None:
    machine = Machine()
    machine.wide_s, machine.narrow_s = 0.0095, 0.010  # barely faster wide: still wide
    ran = _forwards(_backoff(machine), machine, 10.0)
    assert ran.count(False) == 2 * 4


def test_the_forward_threads_run_narrow_while_paused() -> None:
    machine = Machine()
    backoff = _backoff(machine)
    backoff._state, backoff._paused_until = "paused", machine.now + 5  # as after a lost trial
    threads = ForwardThreads(narrow=1, wide=2, backoff=backoff)
    previous = torch.get_num_threads()
    try:
        threads.apply()
        # Without a rule a forward has no estimate: the backoff cannot weigh it, so it runs wide.
        with threads.prefill_forward(4096, 0, 0):
            assert torch.get_num_threads() == 2
        for _ in range(2):  # the first forward of a size is not counted
            with threads._wide(0.01, "decode"):
                assert torch.get_num_threads() == 1
        assert list(backoff._rates) == [(False, "decode", -7)]
    finally:
        torch.set_num_threads(previous)


def test_forwards_of_other_sizes_are_not_compared() -> None:
    # Quiet machine, short and long forwards in turn: a short one's fixed costs make its seconds
    # per estimated second many times a long one's, wide or narrow; comparing across sizes paused
    # wide forwards here (the review's 23 false pauses).
    machine = Machine()
    backoff = _backoff(machine)
    paused = 0
    for index in range(4000):
        long = index % 4 == 3
        estimate = 0.9 if long else 0.0012
        wide = backoff.runs_wide()
        if not wide and backoff._state == "paused":
            paused += 1
        wall = (0.6 if wide else 0.95) if long else (0.006 if wide else 0.007)
        machine.now += wall
        backoff.record("prefill", wide, wall, estimate)
    assert paused == 0


def test_trials_of_long_forwards_wait_longer_so_they_cost_at_most_two_percent() -> None:
    machine = Machine()
    machine.wide_s, machine.narrow_s = 0.120, 0.200  # prefill chunks
    ran = _forwards(_backoff(machine), machine, 100.0)
    narrow_time = ran.count(False) * machine.narrow_s
    assert 0 < narrow_time <= 0.02 * 100.0 + 2 * machine.narrow_s


def test_the_log_never_ends_on_a_pause_that_is_over(caplog) -> None:
    machine = Machine()
    backoff = _backoff(machine)
    with caplog.at_level(logging.INFO, logger="lightllm.model_rank"):
        _forwards(backoff, machine, 3.0)
        machine.wide_s = 0.060
        _forwards(backoff, machine, 5.0)
        machine.wide_s = 0.006
        _forwards(backoff, machine, 30.0)
    lines = [record.getMessage() for record in caplog.records if record.levelno == logging.INFO]
    assert [line.split(":")[0] for line in lines] == ["wide forwards paused", "wide forwards resumed"]
