"""Tests of the scheduling simulator (virtual time; nothing here depends on wall-clock timing)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import List, Sequence

import numpy as np
import pytest

from simulator_test_support import make_profile
from lightllm.server.model_rank.scheduling.request_classifier import (
    NO_DECODE_CLASSIFIER,
    NORMAL_CLASSIFIER,
    STRICT_PREFILL_CLASSIFIER,
)
from lightllm.benchmark.metrics import RequestRecord
from lightllm.benchmark.simulator.__main__ import main as cli_main
from lightllm.benchmark.simulator.cost_model import available_profiles, load_profile
from lightllm.benchmark.simulator.engine import Simulator
from lightllm.benchmark.simulator.runner import case_metrics, simulate_1p1d, simulate_case, simulate_single_node
from lightllm.benchmark.simulator.scenarios import SCENARIOS, ScenarioSpec, resolve_scenarios
from lightllm.benchmark.simulator.sim_types import SimArrival, SimServerConfig
from lightllm.benchmark.simulator.soak import SoakConfig, estimate_capacity_rate, run_soak
from lightllm.benchmark.workloads import LONG, SHORT, ScheduledRequest, WorkloadConfig, build_workload
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import (
    HrrnStrategy,
    available_strategy_names,
    build_prefill_queue_strategy,
)

STRATEGIES = available_strategy_names()


def small_long_first() -> List:
    cfg = WorkloadConfig(
        name="long_first", long_len=2048, short_len=64, output_len=8, long_count=8, short_count=8,
        long_spread_ms=7.0, short_start_ms=10.0, short_spread_ms=7.0,
    )
    return build_workload(cfg)


def run(workload: Sequence, strategy: str, budget: int = 256, **config: object) -> List[RequestRecord]:
    cfg = SimServerConfig(batch_max_tokens=budget, chunked_prefill_size=budget, **config)
    records, _ = simulate_single_node(make_profile(), workload, strategy, cfg)
    return records


def ttfts(records: Sequence[RequestRecord], request_class: str) -> List[float]:
    return [r.ttft for r in records if r.request_class == request_class]


# --- cost model ----------------------------------------------------------------------------------
def test_prefill_and_decode_cost_arithmetic() -> None:
    p = make_profile()
    # fixed + a * (100 + 50) + b * (100 * 100 + 50 * 250)
    assert p.prefill_seconds([(100, 100), (50, 250)]) == pytest.approx(0.001 + 1e-5 * 150 + 1e-9 * 22500)
    assert p.prefill_seconds([]) == 0.0
    # fixed + c * 3 + d * (10 + 20 + 30)
    assert p.decode_seconds(3, 60) == pytest.approx(0.002 + 3e-5 + 6e-7)
    assert p.decode_seconds(0, 0) == 0.0
    assert p.prefill_tokens_per_second(100, 100) == pytest.approx(100 / p.prefill_seconds([(100, 100)]))


def test_cost_model_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="prefill_per_token_s"):
        make_profile(prefill_per_token_s=-1.0)
    with pytest.raises(ValueError, match="max_total_token_num"):
        make_profile(max_total_token_num=0)
    with pytest.raises(ValueError, match="context_end"):
        make_profile().prefill_seconds([(10, 5)])
    with pytest.raises(ValueError, match="kv_token_sum"):
        make_profile().decode_seconds(4, 3)
    with pytest.raises(ValueError, match="profile"):
        load_profile("no_such_profile")


def test_profile_json_round_trip_and_bundled_profiles(tmp_path: Path) -> None:
    p = make_profile()
    path = p.save(tmp_path / "p.json")
    assert load_profile(path) == p
    assert {"cpu_demo_small", "h100_qwen_0p8b"} <= set(available_profiles())
    h100 = load_profile("h100_qwen_0p8b")
    assert "derivation" in h100.provenance and h100.provenance["derivation"]["estimate"] is True
    cpu = load_profile("cpu_demo_small")
    assert "residuals" in cpu.provenance["fit"] and cpu.provenance["fit"]["command"]


def test_fit_recovers_known_coefficients() -> None:
    fit = pytest.importorskip("lightllm.benchmark.simulator.fit_cost_profile")
    true = make_profile()
    samples = []
    for chunk in (64, 256, 1024):
        for end in range(chunk, 4097, chunk):
            samples.append(("prefill", (chunk, chunk * end), true.prefill_seconds([(chunk, end)])))
    for batch in (1, 4, 16):
        for context in (128, 1024, 2048):
            samples.append(("decode", (batch, batch * context), true.decode_seconds(batch, batch * context)))
    got = fit.fit_profile(samples, 4096, {})
    np.testing.assert_allclose(list(got.coefficients().values()), list(true.coefficients().values()), rtol=1e-6)
    assert got.provenance["fit"]["residuals"]["prefill"]["max_abs_relative_error"] < 1e-9


# --- the engine drives the real scheduling code --------------------------------------------------
def test_same_inputs_give_identical_records() -> None:
    spec = ScenarioSpec("mini", "mini", WorkloadConfig(name="sustained", long_len=1024, short_len=32,
                                                      output_len=6, request_rate=200.0, duration_s=0.5))
    for strategy in STRATEGIES:
        a = [r.to_dict() for r in run(spec.build(seed=3), strategy)]
        b = [r.to_dict() for r in run(spec.build(seed=3), strategy)]
        assert a == b
    assert spec.build(seed=3) != spec.build(seed=4)


def test_default_serves_prefill_in_arrival_order() -> None:
    # A 64-token budget lets exactly one 64-token chunk run per step, so prefill is sequential.
    lengths = [256, 64, 192, 64, 128, 64]
    workload = [ScheduledRequest(i * 0.0001, SHORT, n, 4) for i, n in enumerate(lengths)]
    records = run(workload, "default", budget=64)
    order = [r.index for r in sorted(records, key=lambda r: r.first_token_time)]
    assert order == list(range(len(lengths)))
    assert len({r.first_token_time for r in records}) == len(records)
    # The same workload under promote_shortest is not FCFS, so the check above can fail.
    shortest_first = run(workload, "promote_shortest", budget=64)
    assert [r.index for r in sorted(shortest_first, key=lambda r: r.first_token_time)] != order


def _busy_simulator(strategy, steps: int = 6) -> Simulator:
    sim = Simulator(make_profile(), strategy, SimServerConfig(batch_max_tokens=96, chunked_prefill_size=96))
    lengths = [300, 40, 500, 40, 90, 200, 10, 120]
    for i, n in enumerate(lengths):
        sim.add_arrival(SimArrival(i, 0.0 if i < 4 else 0.004 * i, n, 40, LONG if n > 100 else SHORT))
    for _ in range(steps):
        sim.step()
    return sim


@pytest.mark.parametrize("name", STRATEGIES)
def test_simulator_orders_exactly_like_the_real_strategy(name: str) -> None:
    sim = _busy_simulator(name, steps=1)
    while sim.unadmitted_count():  # until every request has arrived and been admitted
        sim.step()
    live = sim.live_requests()
    assert len(live) >= 6
    kinds = {(r.pending_token_num == 1, r.cur_kv_len > 0) for r in live}
    assert len(kinds) > 1, "the state should mix decode, partially and not yet prefilled requests"
    assert len({r.arrival_processed_prefill_tokens for r in live}) > 1
    twins = copy.deepcopy(live)
    counter = sim.counter.value
    assert counter > 0
    trace = sim.step()
    # The step's order is its classify phase (decode requests set aside in admission order) and
    # then the strategy's order of the prefill ones.
    decode, prefill = NORMAL_CLASSIFIER.split(twins)
    assert decode, "the state should hold decode requests"
    expected = decode + build_prefill_queue_strategy(name).order(prefill, counter)
    assert [r.request_id for r in trace.ordered] == [r.request_id for r in expected]


def test_simulator_calls_the_strategy_object_it_is_given() -> None:
    seen = []

    class RecordingHrrn(HrrnStrategy):
        def order(self, prefill_reqs, processed_prefill_tokens):  # type: ignore[override]
            decodes = [r.request_id for r in prefill_reqs if NORMAL_CLASSIFIER.is_decode(r)]
            seen.append((processed_prefill_tokens, sim.counter.value, decodes))
            return super().order(prefill_reqs, processed_prefill_tokens)

    sim = Simulator(make_profile(), RecordingHrrn(), SimServerConfig(batch_max_tokens=64, chunked_prefill_size=64))
    for i, n in enumerate([200, 30, 120]):
        sim.add_arrival(SimArrival(i, 0.0, n, 3, SHORT))
    sim.run()
    assert len(seen) == sim.steps
    assert all(passed == current for passed, current, _ in seen)
    assert all(decodes == [] for _, _, decodes in seen)  # the classify phase kept them back
    assert seen[-1][0] > 0


def test_hrrn_and_promote_shortest_cut_short_ttft_on_a_long_first_burst() -> None:
    workload = small_long_first()
    default = np.median(ttfts(run(workload, "default"), SHORT))
    for strategy in ("hrrn", "promote_shortest"):
        records = run(workload, strategy)
        assert np.median(ttfts(records, SHORT)) < default / 4
        assert all(r.success and r.output_tokens == 8 for r in records)


def test_every_request_finishes_with_exact_output_and_kv_returns() -> None:
    sim = Simulator(make_profile(max_total_token_num=3000), "hrrn",
                    SimServerConfig(batch_max_tokens=256, chunked_prefill_size=256))
    sim.add_workload(small_long_first()[:10])
    result = sim.run()
    assert all(r.success and r.output_tokens == r.requested_output_tokens for r in result.records)
    assert all(len(r.token_times) == r.output_tokens for r in result.records)
    assert sim.kv.used == 0 and not sim.has_work()
    # 3000 KV tokens hold one 2048-token prompt at a time: admission queued the rest.
    firsts = sorted(r.first_token_time for r in result.records if r.request_class == LONG)
    assert len(set(firsts)) == len(firsts)


def test_mixed_batches_run_decode_rows_inside_the_prefill_forward(tmp_path: Path) -> None:
    config = SimServerConfig(batch_max_tokens=256, chunked_prefill_size=256, mixed_batches=True)
    sim = Simulator(make_profile(max_total_token_num=30000), "hrrn", config)
    calls = {"prefill": 0, "decode": 0, "mixed": 0}
    prefill, decode = sim.executor.prefill, sim.executor.decode

    def counting_prefill(chunks):
        calls["prefill"] += 1
        calls["mixed"] += any(c.start >= c.req.input_len for c in chunks)  # a decode row rides along
        return prefill(chunks)

    def counting_decode(reqs):
        calls["decode"] += 1
        return decode(reqs)

    sim.executor.prefill, sim.executor.decode = counting_prefill, counting_decode
    sim.add_workload(small_long_first()[:10])
    result = sim.run()
    assert all(r.success and r.output_tokens == r.requested_output_tokens for r in result.records)
    assert sim.kv.used == 0 and calls["mixed"] > 0 and calls["decode"] > 0  # decode alone once prompts are done
    # The same run without mixed batches never puts a decode row in a prefill forward.
    plain = Simulator(make_profile(max_total_token_num=30000), "hrrn",
                      SimServerConfig(batch_max_tokens=256, chunked_prefill_size=256))
    plain_prefill = plain.executor.prefill
    seen = []
    plain.executor.prefill = lambda chunks: seen.append(any(c.start >= c.req.input_len for c in chunks)) or plain_prefill(chunks)
    plain.add_workload(small_long_first()[:10])
    plain.run()
    assert seen and not any(seen)
    # The CLI flag reaches the node: the same case, mixed or not, runs a different number of steps.
    steps = []
    for extra in ([], ["--mixed-batches"]):
        out = tmp_path / f"run{len(extra)}.json"
        assert cli_main(["--scenario", "long_first", "--modes", "normal", "--budget", "1024", "--strategies", "hrrn",
                         "--json", str(out)] + extra) == 0
        steps.append([r["steps"] for r in json.loads(out.read_text())["results"]])
    assert steps[0] != steps[1]


def test_kv_starved_decode_requests_pause_and_resume() -> None:
    # An over-committing router (ratio 2) admits more than the KV pool holds, so decode runs dry.
    sim = Simulator(make_profile(max_total_token_num=64), "default",
                    SimServerConfig(batch_max_tokens=32, chunked_prefill_size=32, router_token_ratio=2.0))
    for i in range(5):
        sim.add_arrival(SimArrival(i, 0.0, 16, 8, SHORT))
    result = sim.run()
    assert result.paused_count > 0
    assert all(r.success and r.output_tokens == 8 for r in result.records)
    assert sim.kv.used == 0


def test_prefill_node_hands_over_after_the_first_token() -> None:
    workload = small_long_first()
    cfg = SimServerConfig(batch_max_tokens=256, chunked_prefill_size=256, run_mode="prefill")
    prefill_only, _ = simulate_single_node(make_profile(), workload, "hrrn", cfg)
    assert all(r.output_tokens == 1 and r.end_time == r.first_token_time for r in prefill_only)
    merged, _ = simulate_1p1d(make_profile(), workload, "hrrn", 256)
    for p, m in zip(prefill_only, merged):
        assert m.first_token_time == p.first_token_time
        assert m.output_tokens == m.requested_output_tokens == len(m.token_times)
        assert m.token_times == sorted(m.token_times) and m.end_time > m.first_token_time


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown prefill_queue_strategy"):
        Simulator(make_profile(), "fastest")
    with pytest.raises(ValueError, match="running_max_req_size"):
        SimServerConfig(running_max_req_size=0)
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        Simulator(make_profile(), "default", SimServerConfig(batch_max_tokens=64, chunked_prefill_size=128))
    with pytest.raises(ValueError, match="scenario"):
        resolve_scenarios(["nope"])
    with pytest.raises(ValueError, match="mode"):
        simulate_case(make_profile(), SCENARIOS["long_first"], "pd", 1024, "default")
    sim = Simulator(make_profile(), "default")
    sim.add_arrival(SimArrival(0, 0.0, 8, 2, SHORT))
    with pytest.raises(ValueError, match="request_id"):
        sim.add_arrival(SimArrival(0, 0.0, 8, 2, SHORT))
    with pytest.raises(ValueError, match="prompt_ids holds 3 tokens but prompt_len is 8"):
        sim.add_arrival(SimArrival(1, 0.0, 8, 2, SHORT, prompt_ids=(5, 6, 7)))


def test_arrivals_with_their_own_prompts_reach_the_backend_with_them() -> None:
    sim = Simulator(make_profile(), "default")
    sim.add_arrival(SimArrival(0, 0.0, 4, 2, SHORT, prompt_ids=(11, 12, 13, 14)))
    sim.add_arrival(SimArrival(1, 0.0, 3, 2, SHORT))
    sim.step()
    prompts = {req.request_id: req.prompt_ids for req in sim.backend.requests.values()}
    assert prompts[0] == [11, 12, 13, 14]
    assert len(prompts[1]) == 3 and len(set(prompts[1])) == 1  # one id repeated: a token count needs no more


# --- soak and command line -----------------------------------------------------------------------
def test_soak_of_simulated_minutes_reports_finite_waits() -> None:
    cfg = SoakConfig(hours=3 / 60, long_len=2048, long_fraction=0.2, output_len=16, budget=256)
    profile = make_profile()
    assert estimate_capacity_rate(profile, cfg) > 0
    result = run_soak(profile, "hrrn", cfg)
    assert result.simulated_s >= 3 * 60 * 0.99
    assert result.requests > 100
    assert np.isfinite(result.max_wait_s) and result.max_wait_s >= result.p99_wait_s >= result.p50_wait_s > 0
    with pytest.raises(ValueError, match="hours"):
        SoakConfig(hours=0)


def test_case_metrics_use_the_benchmark_metrics() -> None:
    records = run(small_long_first(), "hrrn")
    metrics, summary = case_metrics(records)
    assert metrics["short_ttft_p95_ms"] == summary["classes"][SHORT]["ttft_ms"]["p95"]
    assert metrics["output_tok_s"] == pytest.approx(16 * 8 / summary["duration_s"])


def test_cli_prints_seed_tables_and_writes_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    code = cli_main(["--scenario", "long_first", "--budget", "1024", "--modes", "normal",
                     "--json", str(out_json), "--markdown", str(out_md)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Published in the seed report" in printed and "promote_shortest" in printed
    document = json.loads(out_json.read_text())
    assert {r["strategy"] for r in document["results"]} == set(STRATEGIES)
    assert out_md.read_text() == printed.rstrip("\n") + "\n"
    with pytest.raises(SystemExit) as exc:
        cli_main(["--strategies", "bogus"])
    assert exc.value.code == 2


def test_partly_prefilled_holders_that_fill_the_cache_are_paused_as_on_the_server() -> None:
    # Over-committed admission lets several long prompts each take chunks until the cache is full
    # and no chunk fits: the server pauses the newest holder (its old simulator copy stalled).
    sim = Simulator(make_profile(max_total_token_num=100), "default",
                    SimServerConfig(batch_max_tokens=64, chunked_prefill_size=16, router_token_ratio=4.0))
    for i in range(4):
        sim.add_arrival(SimArrival(i, 0.0, 60, 4, LONG))
    result = sim.run(max_steps=500)
    assert result.paused_count > 0
    assert all(r.success and r.output_tokens == 4 for r in result.records)
    assert sim.kv.used == 0 and not sim.has_work()
