"""The simulated server admits through the server's own code: the run mode's router queue, its
``--router_max_wait_tokens`` cadence, and a decode node's ``reserve_prefilled`` with its busy answer."""

from __future__ import annotations

import pytest

from simulator_test_support import make_profile
from lightllm.benchmark.simulator.engine import Simulator
from lightllm.benchmark.simulator.sim_types import SimArrival, SimServerConfig
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.pd.master.busy_retry import BusyRetryPolicy
from lightllm.server.router.req_queue.base_queue import DEFAULT_ROUTER_MAX_WAIT_TOKENS
from lightllm.server.router.req_queue.decode_arrival_queue import DecodeArrivalQueue
from lightllm.server.router.req_queue.normal_queue import NormalReqQueue


def _arrive(sim: Simulator, request_id: int, at: float, prompt: int = 32, output: int = 40) -> None:
    sim.add_arrival(SimArrival(request_id, at, prompt, output, "short"))


def test_each_run_mode_gets_the_servers_router_queue_and_request_rows() -> None:
    for run_mode, queue in (("normal", NormalReqQueue), ("prefill", NormalReqQueue), ("decode", DecodeArrivalQueue)):
        sim = Simulator(make_profile(), "default", SimServerConfig(run_mode=run_mode, running_max_req_size=7))
        assert type(sim.router) is queue
        assert sim.kv.max_requests() == 7  # the server's request rows are --running_max_req_size


def test_the_admission_cadence_defaults_to_the_servers_flag() -> None:
    default = make_argument_parser().get_default("router_max_wait_tokens")
    assert SimServerConfig().router_max_wait_tokens == DEFAULT_ROUTER_MAX_WAIT_TOKENS == default
    with pytest.raises(ValueError, match="router_max_wait_tokens must be >= 0"):
        SimServerConfig(router_max_wait_tokens=-1)


@pytest.mark.parametrize("wait", [1, 4])
def test_a_normal_node_admits_on_the_router_cadence(wait: int) -> None:
    cfg = SimServerConfig(batch_max_tokens=64, chunked_prefill_size=64, router_max_wait_tokens=wait)
    sim = Simulator(make_profile(), "default", cfg)
    _arrive(sim, 0, 0.0, output=60)
    sim.step()  # request 0 is admitted at once (nothing ran) and prefills
    _arrive(sim, 1, sim.clock)
    joined_after = None
    for step in range(1, 10):
        sim.step()
        if joined_after is None and 1 in sim.backend.requests:
            joined_after = step
    # Request 1 reaches the router after request 0's first step, while request 0 runs, and joins
    # once ``wait`` backend steps ran since the round that admitted request 0.
    assert joined_after == wait
    assert sim.backend_steps == sim.steps  # every step ran a forward


def test_a_decode_node_refuses_beyond_its_rows_and_the_master_retries_with_its_backoff() -> None:
    cfg = SimServerConfig(run_mode="decode", running_max_req_size=2)
    sim = Simulator(make_profile(), "default", cfg)
    for request_id in range(3):
        _arrive(sim, request_id, 0.0, output=30)
    sim.step()
    # The decode router answers every arrival at once; rank 0 reserves two rows and answers the third busy.
    assert len(sim.router) == 0 and sorted(sim.backend.requests) == [0, 1]
    assert sim.busy_answers == 1 and list(sim.router.running) == [0, 1]
    policy = sim.busy_policy
    assert sim._future == [(pytest.approx(policy.initial_backoff_s), 2)]
    result = sim.run()
    assert all(r.success and r.output_tokens == 30 for r in result.records)
    third = result.records[2]
    # Reserved only once a row was free, after whole backoffs of the master's policy.
    assert third.first_token_time >= min(r.end_time for r in result.records[:2])
    assert sim.busy_answers > 1


def test_a_decode_node_busy_past_the_masters_retry_time_ends_the_request_server_busy() -> None:
    sim = Simulator(make_profile(), "default", SimServerConfig(run_mode="decode", running_max_req_size=1))
    sim.busy_policy = BusyRetryPolicy(timeout_s=0)  # LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS=0
    _arrive(sim, 0, 0.0)
    _arrive(sim, 1, 0.0)
    result = sim.run()
    assert result.records[0].success and not result.records[1].success
    assert result.records[1].error == "server_busy" and result.records[1].output_tokens == 0


def test_token_count_view_reports_its_rows() -> None:
    assert TokenCountKvView(100).max_requests() == 100
    assert TokenCountKvView(100, 3).max_requests() == 3
    with pytest.raises(ValueError, match="max_requests"):
        TokenCountKvView(100, 0)
