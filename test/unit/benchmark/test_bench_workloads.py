"""Workload generators of the serving benchmark: counts, lengths, timing pattern, seeding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lightllm.benchmark.workloads import (
    LONG,
    SHORT,
    WorkloadConfig,
    build_workload,
    interleaved,
    long_first,
    sustained,
)


def _times(workload) -> list[float]:
    return [r.scheduled_time_s for r in workload]


def test_long_first_matches_the_reported_burst() -> None:
    workload = long_first(WorkloadConfig())  # 48 long at 0-47 ms, 48 short at 60-107 ms
    assert len(workload) == 96
    longs = [r for r in workload if r.request_class == LONG]
    shorts = [r for r in workload if r.request_class == SHORT]
    assert len(longs) == 48 and len(shorts) == 48
    assert workload[:48] == longs  # every long request is scheduled before any short one
    assert _times(longs) == pytest.approx([i / 1000 for i in range(48)])
    assert _times(shorts) == pytest.approx([(60 + i) / 1000 for i in range(48)])
    assert {r.prompt_len for r in longs} == {16384} and {r.prompt_len for r in shorts} == {128}
    assert {r.output_len for r in workload} == {128}


def test_long_first_single_request_and_overrides() -> None:
    cfg = WorkloadConfig(long_count=1, short_count=3, short_start_ms=10, short_spread_ms=20,
                         long_len=50, short_len=5, output_len=7, long_output_len=2)
    workload = long_first(cfg)
    assert [(r.request_class, r.prompt_len, r.output_len) for r in workload] == [
        (LONG, 50, 2), (SHORT, 5, 7), (SHORT, 5, 7), (SHORT, 5, 7)
    ]
    assert _times(workload) == pytest.approx([0.0, 0.010, 0.020, 0.030])


def test_interleaved_matches_the_reported_pattern() -> None:
    workload = interleaved(WorkloadConfig(name="interleaved"))  # 192 at 500 req/s, 1 long in 4
    assert len(workload) == 192
    assert workload[-1].scheduled_time_s == pytest.approx(0.382)
    assert np.diff(_times(workload)) == pytest.approx(np.full(191, 0.002))
    assert [r.request_class for r in workload[:8]] == [LONG, SHORT, SHORT, SHORT] * 2
    assert sum(r.request_class == LONG for r in workload) == 48


def test_sustained_is_seeded_and_has_the_requested_rate() -> None:
    cfg = WorkloadConfig(name="sustained", request_rate=60.0, duration_s=100.0, long_fraction=0.25, seed=3)
    workload = sustained(cfg)
    assert workload == sustained(cfg)
    assert workload != sustained(dataclasses.replace(cfg, seed=4))
    times = _times(workload)
    assert times == sorted(times)
    assert 0 < times[0] and times[-1] < 100.0
    # 6000 expected arrivals; a Poisson count has std ~77, so 5% is a loose bound.
    assert len(workload) == pytest.approx(6000, rel=0.05)
    long_share = sum(r.request_class == LONG for r in workload) / len(workload)
    assert long_share == pytest.approx(0.25, abs=0.03)


def test_sustained_burstiness_controls_gap_variability() -> None:
    base = WorkloadConfig(name="sustained", request_rate=100.0, duration_s=50.0, seed=1)
    cvs = {}
    for burstiness in (0.25, 1.0, 4.0):
        gaps = np.diff(_times(sustained(dataclasses.replace(base, burstiness=burstiness))))
        cvs[burstiness] = gaps.std() / gaps.mean()
    # Gamma gaps with shape k have coefficient of variation 1/sqrt(k): 2, 1, 0.5.
    assert cvs[0.25] == pytest.approx(2.0, rel=0.15)
    assert cvs[1.0] == pytest.approx(1.0, rel=0.15)
    assert cvs[4.0] == pytest.approx(0.5, rel=0.15)


def test_sustained_with_initial_long_burst() -> None:
    cfg = WorkloadConfig(name="sustained", request_rate=120.0, duration_s=2.0, long_fraction=0.0,
                         initial_long_count=16, long_spread_ms=15, stream_start_ms=100)
    workload = sustained(cfg)
    assert [r.request_class for r in workload[:16]] == [LONG] * 16
    assert _times(workload[:16]) == pytest.approx([i / 1000 for i in range(16)])
    assert all(r.request_class == SHORT and 0.1 < r.scheduled_time_s < 2.1 for r in workload[16:])


def test_build_workload_dispatches_by_name() -> None:
    for name, generator in (("long_first", long_first), ("interleaved", interleaved), ("sustained", sustained)):
        cfg = WorkloadConfig(name=name)
        assert build_workload(cfg) == generator(cfg)
    with pytest.raises(ValueError, match="workload name"):
        build_workload(WorkloadConfig(name="bursty"))


@pytest.mark.parametrize(
    ("generator", "changes", "parameter"),
    [
        (long_first, {"long_count": 0, "short_count": 0}, "long_count"),
        (long_first, {"long_count": -1}, "long_count"),
        (long_first, {"short_spread_ms": -5.0}, "short_spread_ms"),
        (long_first, {"long_len": 0}, "long_len"),
        (long_first, {"short_output_len": 0}, "short_output_len"),
        (interleaved, {"request_rate": 0.0}, "request_rate"),
        (interleaved, {"long_every": 0}, "long_every"),
        (interleaved, {"num_requests": 2.5}, "num_requests"),
        (sustained, {"burstiness": 0.0}, "burstiness"),
        (sustained, {"long_fraction": 1.5}, "long_fraction"),
        (sustained, {"duration_s": float("nan")}, "duration_s"),
        (sustained, {"request_rate": 1e-9, "duration_s": 1.0}, "sustained workload is empty"),
    ],
)
def test_bad_parameters_are_named(generator, changes, parameter) -> None:
    with pytest.raises(ValueError, match=parameter):
        generator(dataclasses.replace(WorkloadConfig(), **changes))


# --- shared_prefix ------------------------------------------------------------------------------


def test_shared_prefix_workload_shape() -> None:
    cfg = WorkloadConfig(
        name="shared_prefix", request_rate=40.0, duration_s=10.0, long_fraction=0.2, long_len=900,
        short_len=32, prefix_tokens=256, prefix_groups=3, chat_turns=4,
    )
    workload = build_workload(cfg)
    assert workload == build_workload(cfg)  # seeded
    assert _times(workload) == sorted(_times(workload))
    assert 300 < len(workload) < 500  # Poisson, mean 400
    cold = [r for r in workload if r.prefix_group < 0]
    few_shot = [r for r in workload if 0 <= r.prefix_group < 3]
    chat = [r for r in workload if r.prefix_group >= 3]
    assert len(cold) + len(few_shot) + len(chat) == len(workload)
    assert all(r.request_class == LONG and r.prompt_len == 900 and r.prefix_len == 0 for r in cold)
    assert 0.12 < len(cold) / len(workload) < 0.28
    # few-shot: a template of prefix_tokens, then short_len unique tokens; every template used
    assert all(r.request_class == SHORT and (r.prompt_len, r.prefix_len) == (288, 256) for r in few_shot)
    assert {r.prefix_group for r in few_shot} == {0, 1, 2}
    # chat: turn k of a chat is its stream's first 256 + 32 k tokens, in arrival order, at most 4 turns
    turns: dict = {}
    for r in chat:
        turns.setdefault(r.prefix_group, []).append(r)
    assert len(turns) > 10
    for group in turns.values():
        assert [r.prompt_len for r in group] == [256 + 32 * k for k in range(len(group))]
        assert all(r.prefix_len == r.prompt_len for r in group)
        assert [r.request_class for r in group] == [LONG] + [SHORT] * (len(group) - 1)
        assert len(group) <= 4
    assert any(len(group) == 4 for group in turns.values())


@pytest.mark.parametrize("knob", ["prefix_groups", "prefix_tokens", "chat_turns"])
def test_shared_prefix_rejects_bad_knobs(knob: str) -> None:
    with pytest.raises(ValueError, match=knob):
        build_workload(WorkloadConfig(name="shared_prefix", **{knob: 0}))
