"""The overtaking bound's own mechanics, request by request: allowances (exact for the fraction as
written), arrival numbers given as the step engine takes requests in, charging only later work,
pulling protected requests forward, and the settings it refuses.  The property tests that the
bound holds over whole arrival streams are in test_prefill_overtake_bound.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightllm.benchmark.simulator.sim_types import SimServerConfig
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import (
    OvertakeBound,
    OvertakeBoundSpec,
    default_key,
)


def _req(rid: int, prompt: int, prio: int = 0) -> InferReq:
    return InferReq(request_id=rid, prompt_ids=[0] * prompt, infer_high_priority=prio)


def test_protected_requests_are_pulled_forward_only_past_later_work() -> None:
    bound = OvertakeBound(OvertakeBoundSpec(100, 0.0))
    elder, protected, later_a, later_b = _req(1, 500), _req(2, 400), _req(3, 10), _req(4, 20)
    bound.bind([elder, protected, later_a, later_b])
    protected.overtake.protected = True
    # The strategy put the later short ones first and the elder ahead of the protected one.
    order = bound.apply([later_a, elder, later_b, protected])
    assert order == [protected, later_a, elder, later_b]
    # A protected request already ahead of everything later stays where the strategy put it.
    assert bound.apply([elder, protected, later_a, later_b]) == [elder, protected, later_a, later_b]


def test_a_protected_normal_request_never_overtakes_high_priority_work() -> None:
    # PD continuation segments (negative infer_high_priority) are ahead of normal requests in
    # default's order, so protection does not move a normal request past them.
    bound = OvertakeBound(OvertakeBoundSpec(0, 0.0))
    normal = _req(1, 800)
    continuation = _req(2, 30, prio=-1)
    bound.bind([normal, continuation])
    assert normal.overtake.protected  # allowance 0
    assert bound.apply([continuation, normal]) == [continuation, normal]
    # Its FCFS wait counts the continuation's work, which default serves first.
    newcomer = _req(3, 50)
    bound.bind([normal, continuation, newcomer])
    assert newcomer.overtake.ahead_tokens == 800 + 30


def test_charge_counts_only_later_work_in_steps_that_skipped_the_request() -> None:
    bound = OvertakeBound(OvertakeBoundSpec(150, 0.0))
    first, second, third = _req(1, 1000), _req(2, 100), _req(3, 100)
    bound.bind([first, second, third])
    bound.charge([(second, 100), (third, 60)], [first])
    assert first.overtake.overtaken_tokens == 160 and first.overtake.protected
    bound.charge([(first, 100), (third, 40)], [second])
    assert second.overtake.overtaken_tokens == 40  # the elder's chunk does not count
    assert third.overtake.overtaken_tokens == 0  # never skipped


def test_a_request_first_ordered_after_later_arrivals_keeps_its_arrival_place() -> None:
    """Requests are numbered as the backend takes them in, so one that first waits for prefill after
    later arrivals (a decode from the start, its prefix hit leaving one token, sent back to prefill
    by a pause) keeps its place in default's order, whoever else left the list meanwhile."""
    bound = OvertakeBound(OvertakeBoundSpec(150, 0.0))
    first, early, middle, resumed, later = _req(1, 300), _req(2, 50), _req(3, 60), _req(4, 200), _req(5, 100)
    for req in (first, early, middle, resumed, later):
        bound.number(req)  # the step engine's join
    bound.bind([first, early, middle, later])  # `resumed` is decoding
    bound.bind([first, later])  # `early` and `middle` prefilled and are decoding too
    bound.bind([first, resumed, later])  # `resumed` was paused back to prefill
    bound.bind([first, middle, resumed, later])  # and so was `middle`
    keys = [default_key(req) for req in (first, early, middle, resumed, later)]
    assert keys == sorted(keys) and len(set(keys)) == 5
    assert resumed.overtake.ahead_tokens == 300
    bound.charge([(resumed, 100), (later, 100)], [middle])
    assert middle.overtake.overtaken_tokens == 200  # both arrived after it
    bound.charge([(later, 60)], [resumed])
    assert resumed.overtake.overtaken_tokens == 60
    bound.charge([(later, 100)], [resumed])
    assert resumed.overtake.protected
    assert bound.apply([later, resumed]) == [resumed, later]


def test_the_step_engine_numbers_requests_as_it_takes_them_in() -> None:
    strategy = build_prefill_queue_strategy("hrrn", OvertakeBoundSpec(150, 0.0))
    reqs = [_req(i, 10) for i in range(3)]
    for req in reversed(reqs):
        strategy.admit(req)
    assert [req.overtake.seq for req in reqs] == [2, 1, 0]
    assert all(req.overtake.allowance is None for req in reqs)  # until they wait for prefill
    strategy.order(reqs, 0)
    assert [req.overtake.seq for req in reqs] == [2, 1, 0] and reqs[0].overtake.allowance == 150


def test_default_is_unchanged_by_the_bound() -> None:
    strategy = build_prefill_queue_strategy("default", OvertakeBoundSpec(0, 0.0))
    reqs = [_req(i, 10 * (5 - i), prio=-1 if i == 3 else 0) for i in range(5)]
    first = strategy.order(reqs, 0)
    for req in reqs:
        req.overtake.protected = True
    assert strategy.order(reqs, 0) == first


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"base_tokens": -1}, "prefill_max_overtake_tokens"),
        ({"base_tokens": 1.5}, "prefill_max_overtake_tokens"),
        ({"fraction": -0.1}, "prefill_overtake_fraction"),
        ({"fraction": float("nan")}, "prefill_overtake_fraction"),
        ({"fraction": float("inf")}, "prefill_overtake_fraction"),
        ({"fraction": "0.1"}, "prefill_overtake_fraction"),
    ],
)
def test_bad_bound_settings_are_rejected(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        OvertakeBoundSpec(**kwargs)
    with pytest.raises(ValueError, match=message):
        SimServerConfig(overtake_bound=OvertakeBoundSpec(**kwargs))


@given(
    base=st.integers(0, 10**6),
    hundredths=st.integers(0, 1000),
    ahead=st.integers(0, 10**15),
)
def test_allowance_floors_the_fraction_as_written(base: int, hundredths: int, ahead: int) -> None:
    """floor(fraction x ahead) of the decimal the operator wrote, not of its binary neighbour."""
    fraction = float(f"{hundredths // 100}.{hundredths % 100:02d}")
    assert OvertakeBoundSpec(base, fraction).allowance(ahead) == base + (hundredths * ahead) // 100


def test_allowance_is_exact_where_binary_floating_point_is_not() -> None:
    assert int(0.29 * 100) == 28  # the float product falls one token short
    assert OvertakeBoundSpec(0, 0.29).allowance(100) == 29
    assert OvertakeBoundSpec(0, 0.1).allowance(10**17) == 10**16
