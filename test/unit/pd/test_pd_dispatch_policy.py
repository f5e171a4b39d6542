"""PD master dispatch policy: busy-node retry, continuation segments and placement (node choice)."""

from __future__ import annotations

import asyncio
from typing import List

import pytest

from pd_membership_support import FakeClock, node
from lightllm.common.sampling import SamplingParams
from lightllm.server.pd.master.busy_retry import BusyRetryPolicy, NodeBusy
from lightllm.server.pd.master.continuation import (
    CONTINUATION_INFER_PRIORITY,
    SegmentEnd,
    first_segment,
    inference_priority,
    next_segment,
)
from lightllm.server.pd.master.node_registry import NodeRegistry
from lightllm.server.pd.master.node_streams import NodeCallError, NodeStreams
from lightllm.server.pd.master.node_selector import (
    AFFINITY_PREFIX_TOKENS,
    AFFINITY_QUEUE_MARGIN_TOKENS,
    NodeSelector,
    prefix_key,
    rendezvous_choice,
)
from lightllm.server.pd.protocol.membership import NodeLoad
from lightllm.server.manager_errors import ServerBusyError, ServerUnavailableError
from lightllm.utils.envs_utils import ENV_VARS, pd_node_busy_retry_timeout_seconds
from lightllm.utils.free_ports import free_port

ENV = "LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS"


class FakeDecodeNode:
    """Answers busy until ``free_after`` seconds of the fake clock have passed, then reserves."""

    def __init__(self, clock: FakeClock, free_after: float) -> None:
        self.clock = clock
        self.free_at = clock() + free_after
        self.calls: List[float] = []

    async def reserve(self) -> str:
        self.calls.append(self.clock())
        if self.clock() < self.free_at:
            raise NodeBusy("decode", "cannot reserve KV for 300 tokens")
        return "reserved"


def _fake_sleep(clock: FakeClock, slept: List[float]):
    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)

    return sleep


# ---------------------------------------------------------------- busy retry


def test_busy_retry_env_variable_is_documented_and_defaults_to_a_minute(monkeypatch) -> None:
    """By default a busy cluster makes a burst wait for KV, as a normal server queues it; 0 stays available."""
    assert ENV in ENV_VARS and "default 60, 0: no retry" in ENV_VARS[ENV]
    monkeypatch.delenv(ENV, raising=False)
    assert pd_node_busy_retry_timeout_seconds() == 60.0
    monkeypatch.setenv(ENV, "")
    assert pd_node_busy_retry_timeout_seconds() == 60.0
    monkeypatch.setenv(ENV, "0")
    assert pd_node_busy_retry_timeout_seconds() == 0.0
    monkeypatch.setenv(ENV, "2.5")
    assert pd_node_busy_retry_timeout_seconds() == 2.5
    for bad in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            pd_node_busy_retry_timeout_seconds()


def test_default_policy_turns_a_busy_answer_into_an_immediate_busy_error() -> None:
    clock, slept = FakeClock(), []
    decode = FakeDecodeNode(clock, free_after=0.1)
    policy = BusyRetryPolicy(clock=clock, sleep=_fake_sleep(clock, slept))
    with pytest.raises(ServerBusyError) as err:
        asyncio.run(policy.run(decode.reserve))
    assert str(err.value) == "The decode node is busy: cannot reserve KV for 300 tokens; retry later"
    assert len(decode.calls) == 1 and slept == []


def test_positive_timeout_retries_with_backoff_until_capacity_frees() -> None:
    clock, slept, retried = FakeClock(), [], []
    decode = FakeDecodeNode(clock, free_after=0.5)
    policy = BusyRetryPolicy(timeout_s=5.0, initial_backoff_s=0.05, max_backoff_s=0.2, clock=clock,
                             sleep=_fake_sleep(clock, slept), on_retry=retried.append)
    assert asyncio.run(policy.run(decode.reserve)) == "reserved"
    assert slept == pytest.approx([0.05, 0.1, 0.2, 0.2])  # doubling, capped at max_backoff_s
    assert len(decode.calls) == 5 and retried == ["decode"] * 4
    assert decode.calls[-1] >= decode.free_at


def test_positive_timeout_gives_up_at_the_deadline_naming_the_role() -> None:
    clock, slept = FakeClock(), []
    prefill = FakeDecodeNode(clock, free_after=100.0)

    async def busy_prefill() -> str:
        try:
            return await prefill.reserve()
        except NodeBusy as busy:
            raise NodeBusy("prefill", str(busy)) from None

    policy = BusyRetryPolicy(timeout_s=1.0, initial_backoff_s=0.1, max_backoff_s=0.4, clock=clock,
                             sleep=_fake_sleep(clock, slept))
    with pytest.raises(ServerBusyError, match=r"The prefill node is still busy after \d+ retries over 1 s"):
        asyncio.run(policy.run(busy_prefill))
    assert sum(slept) == pytest.approx(1.0)  # never sleeps past the deadline
    assert prefill.calls[-1] == pytest.approx(clock.now)


def test_non_busy_errors_are_not_retried() -> None:
    calls = []

    async def failing() -> None:
        calls.append(1)
        raise ServerUnavailableError("no decode node", "pd_not_ready")

    with pytest.raises(ServerUnavailableError):
        asyncio.run(BusyRetryPolicy(timeout_s=10.0).run(failing))
    assert calls == [1]


def test_policy_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        BusyRetryPolicy(timeout_s=-1)
    with pytest.raises(ValueError, match="backoff"):
        BusyRetryPolicy(initial_backoff_s=2.0, max_backoff_s=1.0)


# ---------------------------------------------------------------- continuation segments


def test_first_segment_is_never_promoted() -> None:
    params = SamplingParams(max_new_tokens=10, temperature=0)
    prompt = [5, 6, 7, 8]
    for _ in range(3):  # the same prompt again (a prefix-cache hit on P) changes nothing
        seg = first_segment(42, prompt, params)
        assert (seg.segment_index, seg.infer_high_priority, seg.generated_before) == (0, 0, 0)
        assert seg.prompt_ids == prompt and seg.params is params
    assert inference_priority(0) == 0
    assert inference_priority(1) == inference_priority(7) == CONTINUATION_INFER_PRIORITY < 0
    with pytest.raises(ValueError):
        inference_priority(-1)


def test_continuation_carries_prompt_plus_generated_and_reduced_budgets() -> None:
    params = SamplingParams(max_new_tokens=10, min_new_tokens=4, temperature=0.7, seed=3, prompt_logprobs=2,
                            stop_token_ids=[9])
    prompt = [5, 6, 7]
    seg0 = first_segment(42, prompt, params)
    seg1 = next_segment(42, prompt, params, [11, 12, 13], seg0, SegmentEnd.KV_PRESSURE)
    assert seg1 is not None
    assert seg1.segment_index == 1 and seg1.infer_high_priority < 0
    assert seg1.prompt_ids == [5, 6, 7, 11, 12, 13]
    assert (seg1.original_prompt_len, seg1.generated_before) == (3, 3)
    assert (seg1.params.max_new_tokens, seg1.params.min_new_tokens, seg1.params.prompt_logprobs) == (7, 1, None)
    assert (seg1.params.temperature, seg1.params.seed, seg1.params.stop_token_ids) == (0.7, 3, [9])
    assert params.max_new_tokens == 10  # the client's parameters are not modified
    seg2 = next_segment(42, prompt, params, [11, 12, 13, 14, 15, 16, 17, 18], seg1, SegmentEnd.SEGMENT_LIMIT)
    assert seg2 is not None and seg2.segment_index == 2 and seg2.infer_high_priority < 0
    assert seg2.params.max_new_tokens == 2 and seg2.params.min_new_tokens == 0
    assert seg2.prompt_ids == prompt + [11, 12, 13, 14, 15, 16, 17, 18]


def test_continuation_ends_when_the_budget_is_spent_and_refuses_bad_calls() -> None:
    params = SamplingParams(max_new_tokens=3)
    seg0 = first_segment(1, [4], params)
    assert next_segment(1, [4], params, [7, 8, 9], seg0, SegmentEnd.SEGMENT_LIMIT) is None
    with pytest.raises(ValueError, match="finished"):
        next_segment(1, [4], params, [7], seg0, SegmentEnd.FINISHED)
    with pytest.raises(ValueError, match="without a new token"):
        next_segment(1, [4], params, [], seg0, SegmentEnd.KV_PRESSURE)
    with pytest.raises(ValueError, match="segment of request 1 given for request 2"):
        next_segment(2, [4], params, [7], seg0, SegmentEnd.KV_PRESSURE)
    with pytest.raises(ValueError, match="at least one token"):
        first_segment(1, [], params)


# ---------------------------------------------------------------- node choice


def test_selector_prefers_least_loaded_then_round_robin() -> None:
    registry = NodeRegistry(clock=FakeClock())
    for i in range(3):
        registry.register(node(f"d{i}", "decode", port=9000 + 10 * i))
    registry.register(node("p0", "prefill", port=9500))
    selector = NodeSelector(registry)
    picks = []
    for _ in range(3):
        chosen = selector.pick("decode")
        selector.acquire(chosen)
        picks.append(chosen.node_id)
    assert picks == ["d0", "d1", "d2"]
    selector.release(registry.get("d1"))
    assert selector.pick("decode").node_id == "d1"  # the only node with a free slot
    assert selector.pick("decode", exclude={"d1"}).node_id in {"d0", "d2"}
    assert selector.pick("prefill").node_id == "p0"
    selector.forget(registry.get("d0"))
    assert selector.in_flight("d0") == 0


def test_selector_without_alive_node_raises_not_ready() -> None:
    registry = NodeRegistry(clock=FakeClock())
    registry.register(node("d0", "decode"))
    selector = NodeSelector(registry)
    # A cluster that is not ready gets /health's answer (the same words for the same state).
    with pytest.raises(ServerUnavailableError, match="^The PD cluster is not ready: no prefill node registered$") as err:
        selector.pick("prefill")
    assert err.value.code == "pd_not_ready"
    with pytest.raises(ServerUnavailableError, match="no decode node other than d0 is alive"):
        selector.pick("decode", exclude={"d0"})


def _cluster(prefills: int, decodes: int) -> NodeRegistry:
    registry = NodeRegistry(clock=FakeClock())
    for i in range(prefills):
        registry.register(node(f"p{i}", "prefill", port=9000 + 10 * i))
    for i in range(decodes):
        registry.register(node(f"d{i}", "decode", port=9500 + 10 * i))
    return registry


def _report(registry: NodeRegistry, node_id: str, **load: int) -> None:
    assert registry.heartbeat(node_id, NodeLoad(**load))


def test_prefill_goes_to_the_fewest_queued_tokens_counting_placements_since_the_report() -> None:
    registry = _cluster(2, 1)
    selector = NodeSelector(registry, affinity_prefix_tokens=0)  # load only
    _report(registry, "p0", queued_prefill_tokens=1000)
    _report(registry, "p1", queued_prefill_tokens=0)
    prompt = list(range(600))
    placed = [selector.place("prefill", prompt, 0) for _ in range(3)]
    # p1: 0 -> 600 -> 1200 queued (its report plus what was sent since); then p0 (1000) is lighter.
    assert [placement.node_id for placement in placed] == ["p1", "p1", "p0"]
    assert selector.estimate("p1").queued_prefill_tokens == 1200
    placed[0].release()  # handed off: it no longer waits in p1's queue
    assert selector.estimate("p1").queued_prefill_tokens == 600
    # A newer report includes what was sent before it: those placements count no more...
    _report(registry, "p1", queued_prefill_tokens=50)
    assert selector.estimate("p1").queued_prefill_tokens == 50
    placed[1].release()  # ...and releasing one later does not subtract it twice
    assert selector.estimate("p1").queued_prefill_tokens == 50
    assert selector.in_flight("p1") == 0 and selector.in_flight("p0") == 1
    assert selector.place("prefill", prompt, 0).node_id == "p1"


def test_prefix_affinity_keeps_a_shared_prefix_on_one_prefill_node_within_the_margin() -> None:
    registry = _cluster(2, 1)
    selector = NodeSelector(registry)
    shared = [7] * AFFINITY_PREFIX_TOKENS
    chosen = set()
    for tail in range(6):  # different questions after one long system prompt
        placement = selector.place("prefill", shared + [tail, tail + 1], 0)
        chosen.add(placement.node_id)
        placement.release()
    assert len(chosen) == 1
    preferred = chosen.pop()
    other = "p1" if preferred == "p0" else "p0"
    # Up to the margin more queued tokens than the least loaded node: still the preferred one.
    _report(registry, preferred, queued_prefill_tokens=AFFINITY_QUEUE_MARGIN_TOKENS)
    _report(registry, other, queued_prefill_tokens=0)
    placement = selector.place("prefill", shared + [99], 0)
    assert placement.node_id == preferred
    placement.release()
    # One token past the margin: the least loaded node takes it.
    _report(registry, preferred, queued_prefill_tokens=AFFINITY_QUEUE_MARGIN_TOKENS + 1)
    assert selector.place("prefill", shared + [99], 0).node_id == other
    # Prompts shorter than the affinity prefix are only balanced: equal loads alternate.
    _report(registry, preferred, queued_prefill_tokens=0)
    selector = NodeSelector(registry)
    short = [5] * (AFFINITY_PREFIX_TOKENS - 1)
    picks = []
    for _ in range(4):
        placement = selector.place("prefill", short, 0)
        picks.append(placement.node_id)
        placement.release()
    assert picks == ["p0", "p1", "p0", "p1"]


def test_rendezvous_hashing_moves_only_prefixes_to_a_joining_node() -> None:
    two = [node("p0", "prefill"), node("p1", "prefill", port=9010)]
    three = two + [node("p2", "prefill", port=9020)]
    moved = 0
    for seed in range(200):
        key = prefix_key([seed] * AFFINITY_PREFIX_TOKENS)
        assert key is not None
        before, after = rendezvous_choice(key, two), rendezvous_choice(key, three)
        if before != after:
            assert after.node_id == "p2"  # never from p0 to p1 or back
            moved += 1
    assert 0 < moved < 200
    assert prefix_key([1] * (AFFINITY_PREFIX_TOKENS - 1)) is None


def test_decode_goes_to_the_most_free_kv_then_fewest_running_and_unreported_counts_empty() -> None:
    registry = _cluster(1, 2)
    selector = NodeSelector(registry)
    _report(registry, "d0", free_kv_tokens=1000, kv_capacity_tokens=10000, running_requests=0)
    _report(registry, "d1", free_kv_tokens=5000, kv_capacity_tokens=10000, running_requests=9)
    # d1: 5000 -> 2000 -> -1000 free after the master's placements; then d0 (1000).
    assert [selector.place("decode", [1], 3000).node_id for _ in range(3)] == ["d1", "d1", "d0"]
    # Equal free KV: the fewer running requests wins.
    _report(registry, "d0", free_kv_tokens=4000, kv_capacity_tokens=10000, running_requests=3)
    _report(registry, "d1", free_kv_tokens=4000, kv_capacity_tokens=10000, running_requests=2)
    assert selector.pick("decode").node_id == "d1"
    # A node that has not reported yet counts as empty: the capacity its peers report.
    registry.register(node("d2", "decode", port=9600))
    assert selector.estimate("d2").free_kv_tokens == 10000
    first = selector.place("decode", [1], 7000)
    assert first.node_id == "d2"
    assert selector.pick("decode").node_id == "d1"  # d2 now has 3000 free, d1 4000
    # A continuation avoids the decode node that ran out of KV while another can take it.
    assert selector.pick("decode", avoid={"d1"}).node_id == "d0"
    assert selector.pick("decode", avoid={"d0", "d1", "d2"}).node_id == "d1"


def test_draining_nodes_get_nothing_new_and_readiness_says_so() -> None:
    registry = _cluster(2, 1)
    selector = NodeSelector(registry)
    assert registry.heartbeat("p0", node_state="draining")
    assert {selector.pick("prefill").node_id for _ in range(4)} == {"p1"}
    assert registry.ready
    assert registry.heartbeat("p1", node_state="draining")
    refusal = r"^The PD cluster is not ready: every prefill node is draining \(p0, p1\)$"
    with pytest.raises(ServerUnavailableError, match=refusal) as err:
        selector.pick("prefill")
    assert err.value.code == "pd_not_ready"
    assert registry.missing() == ["every prefill node is draining (p0, p1)"]
    assert registry.heartbeat("p1", node_state="serving")
    assert registry.ready and selector.pick("prefill").node_id == "p1"


def test_a_node_whose_port_refused_the_master_gets_nothing_new_until_it_heartbeats() -> None:
    """A killed node is known at the first refused connection, not only when it misses its heartbeats."""
    registry = _cluster(1, 2)
    selector = NodeSelector(registry)
    d0 = registry.get("d0")
    registry.mark_refused(d0, "could not be reached: ConnectError")
    assert {selector.pick("decode").node_id for _ in range(4)} == {"d1"}
    assert registry.ready and registry.snapshot()[0]["refused_age_s"] == 0.0
    # The node's own last report still says serving; the master's view is the serving field (and the gauge).
    assert registry.snapshot()[0]["state"] == "serving" and registry.snapshot()[0]["serving"] is False
    registry.mark_refused(registry.get("d1"), "could not be reached: ConnectError")
    assert not registry.ready
    assert registry.missing() == ["no decode node takes new requests (d0 refused a connection, d1 refused a connection)"]
    with pytest.raises(ServerUnavailableError, match=r"\(d0 refused a connection, d1 refused a connection\)") as err:
        selector.pick("decode")
    assert err.value.code == "pd_not_ready"
    # Nothing was dropped: the calls that fail report their own requests' errors.
    assert [info.node_id for info in registry.alive("decode")] == ["d0", "d1"]
    # A node that heartbeats is listening again.
    assert registry.heartbeat("d1")
    assert registry.ready and selector.pick("decode").node_id == "d1"
    assert [entry["refused_age_s"] for entry in registry.snapshot()] == [0.0, None, None]
    assert [entry["serving"] for entry in registry.snapshot()] == [False, True, True]
    # A node the registry no longer knows is left alone.
    registry.unregister("d0", "test")
    registry.mark_refused(d0, "a late call")
    assert registry.state("d0") is None


def test_the_node_client_reports_a_refused_connection_before_the_caller_sees_it() -> None:
    refused: List[str] = []
    target = node("d9", "decode", port=free_port())  # nothing listens there

    async def run() -> None:
        nodes = NodeStreams(connect_timeout_s=5, on_refused=lambda info, why: refused.append(f"{info.node_id}: {why}"))
        try:
            with pytest.raises(NodeCallError) as err:
                await nodes.post_json(target, "/pd/x", {}, timeout_s=5)
            assert err.value.unreachable and len(refused) == 1
            sunk: List[object] = []
            done = asyncio.Event()

            def sink(payload: object) -> None:
                sunk.append(payload)
                done.set()

            nodes.stream(target, "/pd/y", {}, sink)
            await asyncio.wait_for(done.wait(), 10)
            assert isinstance(sunk[0], NodeCallError) and len(refused) == 2
        finally:
            await nodes.aclose()

    asyncio.run(run())
    assert refused[0].startswith("d9: ") and "could not be reached on /pd/x" in refused[0]
