"""PD master membership: node registrations, compatibility refusals, heartbeat expiry, readiness."""

from __future__ import annotations

import pytest

from pd_membership_support import FakeClock, node
from lightllm.server.pd.protocol.node_info import NodeInfo, NodeInfoError
from lightllm.server.pd.master.node_registry import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_MAX_MISSED_HEARTBEATS,
    NodeRegistry,
    RegistrationRefused,
)
from lightllm.server.manager_errors import ServerUnavailableError
from lightllm.server.pd.protocol.membership import MembershipBodyError, NodeLoad, parse_state


def test_node_info_round_trips_and_refuses_bad_fields_by_name() -> None:
    info = node("p0", "prefill")
    assert NodeInfo.from_dict(info.to_dict()) == info
    cases = [
        ({"role": "router"}, "role"),
        ({"dtype": "int8"}, "dtype"),
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": True}, "head_dim"),
        ({"tp_size": 3}, "tp_size"),  # 2 KV heads cannot be split over 3 ranks
        ({"node_id": "bad id"}, "node_id"),
        ({"model_name": " "}, "model_name"),
        ({"http_address": "127.0.0.1"}, "http_address"),
        ({"kv_transfer_address": "127.0.0.1:70000"}, "kv_transfer_address"),
        ({"kv_transfer_address": ""}, "kv_transfer_address"),  # a prefill node's transfer groups meet there
        ({"checkpoint_fingerprint": "XYZ"}, "checkpoint_fingerprint"),
        ({"checkpoint_fingerprint": 12}, "checkpoint_fingerprint"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
        ({"request_slots": 0}, "request_slots"),
        ({"top_logprob_slots": 0}, "top_logprob_slots"),
        ({"top_logprob_slots": "8"}, "top_logprob_slots"),
    ]
    for override, param in cases:
        with pytest.raises(NodeInfoError) as err:
            NodeInfo.from_dict({**info.to_dict(), **override})
        assert err.value.param == param, override
        assert param in str(err.value)
    # A decode node hosts no transfer group: an address there would name a port nothing listens on.
    decode = node("d0", "decode")
    assert decode.kv_transfer_address == "" and NodeInfo.from_dict(decode.to_dict()) == decode
    with pytest.raises(NodeInfoError, match="kv_transfer_address must be empty for a decode node"):
        NodeInfo.from_dict({**decode.to_dict(), "kv_transfer_address": "127.0.0.1:10"})
    with pytest.raises(NodeInfoError, match="unknown registration field.*: colour"):
        NodeInfo.from_dict({**info.to_dict(), "colour": "red"})
    body = info.to_dict()
    del body["tp_size"]
    with pytest.raises(NodeInfoError, match="missing registration field.*tp_size"):
        NodeInfo.from_dict(body)
    # The weights digest is optional (a registering process that does not know it sends none).
    body = info.to_dict()
    del body["checkpoint_fingerprint"]
    assert NodeInfo.from_dict(body).checkpoint_fingerprint == ""


def test_other_weights_under_the_same_name_are_refused_when_both_nodes_report_a_digest() -> None:
    registry = NodeRegistry(clock=FakeClock())
    registry.register(node("p0", "prefill", checkpoint_fingerprint="0123456789abcdef"))
    with pytest.raises(RegistrationRefused) as err:
        registry.register(node("d0", "decode", port=9100, checkpoint_fingerprint="fedcba9876543210"))
    assert err.value.reasons == ["checkpoint_fingerprint: 'fedcba9876543210' != '0123456789abcdef' "
                                 "(other weights under the same model name)"]
    assert "their weights" in str(err.value)
    registry.register(node("d1", "decode", port=9101))  # no digest: nothing to compare
    registry.register(node("d2", "decode", port=9102, checkpoint_fingerprint="0123456789abcdef"))
    assert sorted(info.node_id for info in registry.alive()) == ["d1", "d2", "p0"]


def test_incompatible_node_is_refused_naming_every_mismatched_field() -> None:
    registry = NodeRegistry(clock=FakeClock())
    registry.register(node("p0", "prefill"))
    with pytest.raises(RegistrationRefused) as err:
        registry.register(node("d0", "decode", port=9100, tp_size=2, dtype="bfloat16", model_name="other"))
    assert err.value.code == "incompatible_node"
    assert err.value.reasons == ["model_name: 'other' != 'tiny'", "dtype: 'bfloat16' != 'float32'", "tp_size: 2 != 1"]
    message = str(err.value)
    assert "node 'd0' (decode at 127.0.0.1:9100)" in message and "reference: node 'p0'" in message
    for reason in err.value.reasons:
        assert reason in message
    for field, value in [("num_layers", 4), ("num_kv_heads", 4), ("head_dim", 32), ("logprobs_mode", "raw_logprobs")]:
        with pytest.raises(RegistrationRefused, match=f"{field}: {value!r} !="):
            registry.register(node("d0", "decode", port=9100, **{field: value}))
    # A registration without the field (an older node) reports what the default reports (what
    # an older node's processed_logprobs meant: vLLM's value of that name is another one now).
    body = node("d0", "decode", port=9100).to_dict()
    del body["logprobs_mode"]
    assert NodeInfo.from_dict(body).logprobs_mode == "scaled_logprobs"
    assert [info.node_id for info in registry.alive()] == ["p0"]
    registry.register(node("d0", "decode", port=9100))
    assert registry.ready


def test_first_node_sets_the_reference_only_while_no_node_is_alive() -> None:
    clock = FakeClock()
    registry = NodeRegistry(heartbeat_interval_s=1.0, max_missed_heartbeats=2, clock=clock)
    registry.register(node("p0", "prefill", tp_size=2))
    with pytest.raises(RegistrationRefused, match="tp_size: 1 != 2"):
        registry.register(node("d0", "decode", port=9100))
    clock.advance(2.5)  # p0 silent past 2 x 1 s: dropped, so the reference goes with it
    assert registry.alive() == []
    registry.register(node("d0", "decode", port=9100))
    with pytest.raises(RegistrationRefused, match="tp_size: 2 != 1"):
        registry.register(node("p0", "prefill", tp_size=2))


def test_node_id_in_use_by_another_live_node_is_refused_and_a_restart_replaces_it() -> None:
    dropped = []
    registry = NodeRegistry(clock=FakeClock(), on_drop=lambda info, reason: dropped.append((info.node_id, reason)))
    registry.register(node("n0", "prefill"))
    with pytest.raises(RegistrationRefused) as err:
        registry.register(node("n0", "decode", port=9200))
    assert err.value.code == "node_id_in_use" and "already used by the live node 'n0'" in str(err.value)
    registry.register(node("n0", "prefill"))  # same node, restarted: its old requests are gone
    assert dropped == [("n0", "it registered again (the node restarted)")]
    assert [info.node_id for info in registry.alive("prefill")] == ["n0"]


def test_silent_node_expires_after_the_documented_missed_heartbeats() -> None:
    assert (DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_MAX_MISSED_HEARTBEATS) == (2.0, 3)
    clock = FakeClock()
    dropped = []
    registry = NodeRegistry(clock=clock, on_drop=lambda info, reason: dropped.append((info.node_id, reason)))
    assert registry.expiry_s == 6.0
    registry.register(node("p0", "prefill"))
    registry.register(node("d0", "decode", port=9100))
    for _ in range(3):  # d0 keeps beating, p0 goes silent (5.7 s: within the bound)
        clock.advance(1.9)
        assert registry.heartbeat("d0")
    assert dropped == [] and len(registry.alive()) == 2
    clock.advance(1.9)  # p0 silent for 7.6 s > 3 x 2 s
    assert registry.heartbeat("d0")
    assert [node_id for node_id, _ in dropped] == ["p0"]
    assert "missed 3 heartbeats (none for" in dropped[0][1] and "interval 2 s" in dropped[0][1]
    assert registry.heartbeat("p0") is False
    assert [info.node_id for info in registry.alive()] == ["d0"]


def test_expiry_happens_exactly_past_the_bound() -> None:
    clock = FakeClock()
    registry = NodeRegistry(heartbeat_interval_s=0.5, max_missed_heartbeats=4, clock=clock)
    registry.register(node("d0", "decode"))
    clock.advance(2.0)  # exactly 4 intervals: still alive
    assert registry.expire() == []
    clock.advance(0.001)
    assert [info.node_id for info in registry.expire()] == ["d0"]


def test_readiness_names_what_is_missing() -> None:
    clock = FakeClock()
    registry = NodeRegistry(clock=clock)
    assert registry.missing() == ["no prefill node registered", "no decode node registered"]
    with pytest.raises(ServerUnavailableError) as err:
        registry.require_ready()
    assert err.value.code == "pd_not_ready"
    registry.register(node("p0", "prefill"))
    assert not registry.ready and registry.missing() == ["no decode node registered"]
    registry.register(node("d0", "decode", port=9100))
    assert registry.ready and registry.missing() == []
    registry.require_ready()
    clock.advance(3.0)
    registry.heartbeat("p0")
    clock.advance(3.5)  # d0 now silent for 6.5 s
    assert registry.missing() == ["no decode node registered"]
    with pytest.raises(ServerUnavailableError, match="not ready: no decode node registered"):
        registry.require_ready()


def test_drop_listener_errors_do_not_keep_a_dead_node() -> None:
    registry = NodeRegistry(clock=FakeClock())
    seen = []

    def broken(info, reason):
        raise RuntimeError("listener bug")

    registry.add_drop_listener(broken)
    registry.add_drop_listener(lambda info, reason: seen.append(info.node_id))
    registry.register(node("p0", "prefill"))
    assert registry.unregister("p0", "operator removed it")
    assert seen == ["p0"] and registry.alive() == []
    assert registry.unregister("p0", "again") is False


def test_only_a_draining_node_leaves_by_deregistering() -> None:
    registry = NodeRegistry(clock=FakeClock())
    seen = []
    registry.add_drop_listener(lambda info, reason: seen.append((info.node_id, reason)))
    registry.register(node("d0", "decode"))
    assert "is serving, not draining" in registry.leave("d0")
    assert seen == [] and [info.node_id for info in registry.alive()] == ["d0"]
    registry.heartbeat("d0", node_state="draining")
    assert registry.leave("d0") is None
    assert seen == [("d0", "it stopped (it deregistered on its way out)")] and registry.alive() == []
    assert registry.leave("d0") == "node 'd0' is not registered with this master"
    # A node restarted under the same id replaces its draining incarnation as serving: the old
    # process's deregistration, arriving after, leaves the new one in place.
    registry.register(node("d1", "decode"), node_state="draining")
    registry.register(node("d1", "decode"))
    assert registry.leave("d1") is not None and [info.node_id for info in registry.alive()] == ["d1"]


def test_registry_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        NodeRegistry(heartbeat_interval_s=0)
    with pytest.raises(ValueError, match="max_missed_heartbeats"):
        NodeRegistry(max_missed_heartbeats=0)
    with pytest.raises(ValueError, match="role must be one of"):
        NodeRegistry().alive("router")


def test_heartbeats_store_the_last_load_and_state_and_old_heartbeats_keep_them() -> None:
    clock = FakeClock()
    registry = NodeRegistry(clock=clock)
    registry.register(node("d0", "decode"))
    state = registry.state("d0")
    assert state is not None and state.load is None and state.state == "serving" and state.load_version == 0
    load = NodeLoad(queued_prefill_tokens=0, running_requests=4, free_kv_tokens=900, kv_capacity_tokens=1000)
    clock.advance(1.0)
    assert registry.heartbeat("d0", load, "draining")
    assert (state.load, state.state, state.load_version) == (load, "draining", 1)
    clock.advance(0.5)
    assert registry.heartbeat("d0")  # an older node's heartbeat: nothing reported, nothing lost
    assert (state.load, state.state, state.load_version) == (load, "draining", 1)
    entry, = registry.snapshot()
    assert entry["state"] == "draining" and entry["load_age_s"] == 0.5
    assert entry["load"] == {"queued_prefill_tokens": 0, "running_requests": 4, "free_kv_tokens": 900,
                             "kv_capacity_tokens": 1000}
    assert registry.serving("decode") == []
    # A restarted node starts over: no load, serving.
    registry.register(node("d0", "decode"), NodeLoad(free_kv_tokens=1000), "serving")
    state = registry.state("d0")
    assert state.load == NodeLoad(free_kv_tokens=1000) and state.serving and state.load_version == 1


def test_load_and_state_bodies_are_checked_by_field() -> None:
    assert NodeLoad.from_body({"free_kv_tokens": 5, "queued_prefill_tokens": None}) == NodeLoad(free_kv_tokens=5)
    # A newer node's extra load field is ignored rather than costing it its heartbeats.
    assert NodeLoad.from_body({"running_requests": 1, "gpu_temperature": 70}) == NodeLoad(running_requests=1)
    for bad, param in [(3, "load"), ({"free_kv_tokens": -1}, "load.free_kv_tokens"),
                       ({"running_requests": True}, "load.running_requests"),
                       ({"kv_capacity_tokens": "9"}, "load.kv_capacity_tokens")]:
        with pytest.raises(MembershipBodyError) as err:
            NodeLoad.from_body(bad)
        assert err.value.param == param
    assert parse_state("draining") == "draining"
    with pytest.raises(MembershipBodyError, match="state must be one of serving, draining, got 'asleep'"):
        parse_state("asleep")


def test_a_drop_listener_may_query_the_registry_while_several_nodes_expire() -> None:
    clock = FakeClock()
    registry = NodeRegistry(clock=clock)
    dropped = []

    def listener(info, reason):  # a listener that looks up its peers expires the rest early
        dropped.append(info.node_id)
        registry.get("d0")

    registry.add_drop_listener(listener)
    registry.register(node("p0", "prefill"))
    registry.register(node("d0", "decode", port=9100))
    clock.advance(7.0)
    assert [info.node_id for info in registry.expire()] == ["p0", "d0"]
    assert dropped == ["p0", "d0"] and registry.alive() == []


def _swept(registry: NodeRegistry, clock: FakeClock, seconds: float, period: float = 1.0) -> None:
    """``seconds`` pass on a running master: its sweeper checks every ``period``."""
    for _ in range(round(seconds / period)):
        clock.advance(period)
        registry.expire()


def test_a_stall_of_the_master_itself_does_not_count_against_the_nodes(caplog) -> None:
    # The master's loop did not run for 8 s (blocked, or starved of CPU): the nodes' heartbeats
    # of that time wait unread in its sockets, and they were dropped on resume with their requests.
    clock = FakeClock()
    dropped = []
    registry = NodeRegistry(heartbeat_interval_s=2.0, max_missed_heartbeats=3, clock=clock,
                            on_drop=lambda info, reason: dropped.append(info.node_id))
    registry.register(node("p0", "prefill"))
    registry.watch_for_stalls(1.0)
    _swept(registry, clock, 1.0)  # p0's last heartbeat is 1 s old
    clock.advance(8.0)  # no check ran: the master stalled for 7 s beyond its 1 s period
    with caplog.at_level("WARNING", logger="lightllm.server.pd.master.stall_watch"):
        assert registry.expire() == []
    assert "its event loop did not run for 7.0 s beyond its 1 s expiry sweep" in caplog.text
    assert registry.stall_watch.stalled_s == pytest.approx(7.0)
    assert registry.heartbeat("p0")  # the heartbeat that waited during the stall
    # A node that really stops is still dropped after interval x count of a running master.
    _swept(registry, clock, 6.0)
    assert dropped == []
    _swept(registry, clock, 1.0)
    assert dropped == ["p0"]


def test_late_sweeps_within_the_jitter_and_a_master_without_a_sweeper_count_every_second() -> None:
    clock = FakeClock()
    registry = NodeRegistry(heartbeat_interval_s=2.0, max_missed_heartbeats=3, clock=clock)
    registry.register(node("p0", "prefill"))
    registry.watch_for_stalls(1.0)
    for _ in range(5):
        clock.advance(1.4)  # each sweep 0.4 s late: scheduling jitter, not a stall
        registry.expire()
    assert registry.stall_watch.stalled_s == 0.0
    assert [info.node_id for info in registry.alive()] == []  # 7 s silent: dropped
    unwatched = NodeRegistry(heartbeat_interval_s=2.0, max_missed_heartbeats=3, clock=clock)
    unwatched.register(node("d0", "decode", port=9100))
    clock.advance(6.5)
    assert unwatched.alive() == []
    with pytest.raises(ValueError, match="period_s must be > 0, got 0"):
        unwatched.watch_for_stalls(0)


def test_a_node_counts_the_master_lost_two_intervals_after_the_master_would_drop_it() -> None:
    from lightllm.server.pd.protocol.membership import master_silence_bound_s

    assert master_silence_bound_s(2.0, 3) == 10.0


def test_the_expiry_sweeper_starts_the_stall_watch_at_its_period() -> None:
    import asyncio

    from lightllm.server.pd.master.expiry_sweeper import ExpirySweeper

    registry = NodeRegistry(heartbeat_interval_s=2.0, clock=FakeClock())
    sweeper = ExpirySweeper(registry)

    async def run() -> None:
        sweeper.start()
        await sweeper.stop()

    asyncio.run(run())
    assert registry.stall_watch is not None and registry.stall_watch.period_s == 1.0


def test_stall_warnings_come_at_most_every_30_s_and_sum_up_the_ones_between(caplog) -> None:
    from lightllm.server.pd.master.stall_watch import MasterStallWatch

    clock = FakeClock()
    watch = MasterStallWatch(1.0, clock)
    with caplog.at_level("WARNING", logger="lightllm.server.pd.master.stall_watch"):
        for _ in range(4):  # a machine short of CPU: a 2 s stall every 3 s
            clock.advance(3.0)
            assert watch.stall_before(clock()) == pytest.approx(2.0)
        clock.advance(30.0)
        watch.stall_before(clock())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "did not run for 2.0 s" in lines[0]
    assert "did not run for 29.0 s beyond its 1 s expiry sweep (blocked, or the process got no CPU) (4 stalls, " \
           "35.0 s in all, since the last such line)" in lines[1]
    assert watch.stalled_s == pytest.approx(37.0)


def test_stall_warnings_held_back_are_logged_once_their_interval_passed(caplog) -> None:
    # Stalls that stopped (the machine recovered) were never logged: the summary waited for a next stall.
    from lightllm.server.pd.master.stall_watch import MasterStallWatch

    clock = FakeClock()
    watch = MasterStallWatch(1.0, clock)
    with caplog.at_level("WARNING", logger="lightllm.server.pd.master.stall_watch"):
        for _ in range(4):
            clock.advance(3.0)
            watch.stall_before(clock())
        for _ in range(30):  # a running master again: a check every second
            clock.advance(1.0)
            watch.stall_before(clock())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "stalled 3 more time(s), 6.0 s in all, since the last such line" in lines[1]


def test_the_registration_log_names_a_transfer_address_for_a_prefill_node_only(caplog) -> None:
    """Every decode node was logged with "kv transfer at )": it has no transfer address."""
    registry = NodeRegistry(clock=FakeClock())
    with caplog.at_level("INFO", logger="lightllm.server.pd.master.node_registry"):
        registry.register(node("p0", "prefill"))
        registry.register(node("d0", "decode", port=9100))
    lines = [record.getMessage() for record in caplog.records if "registered" in record.getMessage()]
    assert len(lines) == 2
    assert "kv transfer at " in lines[0] and "kv transfer at )" not in lines[0]
    assert "kv transfer" not in lines[1] and lines[1].endswith("tp 1)"), lines[1]
