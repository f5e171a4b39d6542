"""/metrics under vLLM's names and types, and the Grafana dashboard against the real exposition."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Dict, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightllm.server.core.objs.io_messages import DetokenizedOutput, TokenEvent
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.httpserver.pending_request import PendingRequest
from lightllm.server.httpserver.metrics import VLLM_NAMES, ServerMetrics, token_buckets
from lightllm.utils.check_dashboard import dashboard_problems, main

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "dashboards" / "lightllm_grafana.json"


@pytest.fixture
def stats() -> Iterator[ShmStats]:
    block = ShmStats(f"lightllm_test_{uuid.uuid4().hex[:8]}", create=True)
    yield block
    block.close()
    block.unlink()


def _families(metrics: ServerMetrics) -> Dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render()[0].decode())}


def _value(family, sample_name: str, **labels: str) -> float:
    values = [s.value for s in family.samples if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(values) == 1, (sample_name, labels, family.samples)
    return values[0]


def test_vllm_series_carry_the_measured_values_under_vllm_names_and_types(stats: ShmStats) -> None:
    stats.set("kv_total_tokens", 1000)
    stats.set("kv_allocatable_tokens", 600)
    stats.set("running_requests", 3)
    stats.set("waiting_requests", 2)
    stats.set("preemptions", 4)
    stats.set("step_forward_us", 2_500_000)
    metrics = ServerMetrics("hrrn", stats, "tiny-model", max_len=512)
    # Two requests: 5 prompt tokens -> 3 tokens (stop), 7 prompt tokens -> 1 token (length).
    metrics.on_submit(5)
    metrics.on_first_token(0.2, cached_tokens=4)
    metrics.on_next_token(0.03)
    metrics.on_next_token(0.05)
    metrics.on_finish("stop", 3, 0.4, prompt_tokens=5, first_token_seconds=0.2, queue_seconds=0.05)
    metrics.on_submit(7)
    metrics.on_first_token(0.1, cached_tokens=0)
    metrics.on_finish("length", 1, 0.1, prompt_tokens=7, first_token_seconds=0.1, queue_seconds=0.02)
    # A request aborted before it was ever scheduled has no queue, prefill or inference time.
    metrics.on_submit(3)
    metrics.on_finish("abort", 0, 0.3, prompt_tokens=3, first_token_seconds=None, queue_seconds=None)

    families = _families(metrics)
    types = {name: f.type for name, f in families.items()}
    assert types["vllm:num_requests_running"] == types["vllm:num_requests_waiting"] == "gauge"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions"):
        assert types[name] == "counter", name
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_decode_time_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_inference_time_seconds",
    ):
        assert types[name] == "histogram", name
    # Every series names the served model; vLLM's copies have no strategy label.
    for family in families.values():
        for sample in family.samples:
            assert sample.labels.get("model_name") == "tiny-model", sample
            assert ("strategy" in sample.labels) == family.name.startswith("lightllm_"), sample

    assert _value(families["vllm:num_requests_running"], "vllm:num_requests_running") == 3
    assert _value(families["vllm:num_requests_waiting"], "vllm:num_requests_waiting") == 2
    assert _value(families["vllm:kv_cache_usage_perc"], "vllm:kv_cache_usage_perc") == pytest.approx(0.4)
    assert _value(families["vllm:num_preemptions"], "vllm:num_preemptions_total") == 4
    assert _value(families["vllm:prompt_tokens"], "vllm:prompt_tokens_total") == 15
    assert _value(families["vllm:generation_tokens"], "vllm:generation_tokens_total") == 4
    assert _value(families["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") == 4
    success = families["vllm:request_success"]
    assert _value(success, "vllm:request_success_total", finished_reason="stop") == 1
    assert _value(success, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(success, "vllm:request_success_total", finished_reason="abort") == 1
    ttft = families["vllm:time_to_first_token_seconds"]
    assert _value(ttft, "vllm:time_to_first_token_seconds_count") == 2
    assert _value(ttft, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.3)
    assert _value(ttft, "vllm:time_to_first_token_seconds_bucket", le="0.1") == 1
    itl = families["vllm:inter_token_latency_seconds"]
    assert _value(itl, "vllm:inter_token_latency_seconds_count") == 2
    assert _value(itl, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.08)
    prompt_lengths = families["vllm:request_prompt_tokens"]
    assert _value(prompt_lengths, "vllm:request_prompt_tokens_sum") == 15
    assert _value(prompt_lengths, "vllm:request_prompt_tokens_bucket", le="5.0") == 2  # 5 and 3
    assert _value(families["vllm:request_generation_tokens"], "vllm:request_generation_tokens_sum") == 4
    # Decode time is first token to end; per-token time over the gaps after the first token, 0 for
    # the one-token answer (as vLLM records it: it was left out, so the _count differed from vLLM's).
    assert _value(families["vllm:request_decode_time_seconds"], "vllm:request_decode_time_seconds_sum") == pytest.approx(0.2)
    tpot = families["vllm:request_time_per_output_token_seconds"]
    assert _value(tpot, "vllm:request_time_per_output_token_seconds_count") == 2
    assert _value(tpot, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.1)
    assert _value(tpot, "vllm:request_time_per_output_token_seconds_bucket", le="0.01") == 1
    # Queue time ends when the request is first scheduled; prefill and inference start there.
    queue = families["vllm:request_queue_time_seconds"]
    assert _value(queue, "vllm:request_queue_time_seconds_count") == 2
    assert _value(queue, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.07)
    assert _value(families["vllm:request_prefill_time_seconds"], "vllm:request_prefill_time_seconds_sum") == pytest.approx(0.15 + 0.08)
    inference = families["vllm:request_inference_time_seconds"]
    assert _value(inference, "vllm:request_inference_time_seconds_count") == 2
    assert _value(inference, "vllm:request_inference_time_seconds_sum") == pytest.approx(0.35 + 0.08)
    # Cumulative backend values are counters in base units, not gauges.
    assert types["lightllm_step_seconds"] == "counter"
    assert _value(families["lightllm_step_seconds"], "lightllm_step_seconds_total", phase="forward") == pytest.approx(2.5)
    assert "lightllm_step_forward_us" not in families and "lightllm_backend_steps" in families
    assert types["lightllm_backend_steps"] == "counter"


def test_every_vllm_alias_is_exported(stats: ShmStats) -> None:
    metrics = ServerMetrics("default", stats, "m")
    metrics.on_submit(2)
    metrics.on_first_token(0.1, 0)
    metrics.on_finish("stop", 1, 0.1, prompt_tokens=2, first_token_seconds=0.1)
    families = _families(metrics)
    for ours, theirs in VLLM_NAMES.items():
        assert ours in families, ours
        for name in theirs:
            assert name in families, name
            assert families[name].type == families[ours].type


def test_token_buckets_follow_1_2_5_up_to_the_context_length() -> None:
    assert token_buckets(600) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_buckets(1) == (1,)


def test_dashboard_queries_only_series_the_server_exports(stats: ShmStats) -> None:
    """A server that has served nothing yet already answers every dashboard query."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard_problems(dashboard, ServerMetrics("hrrn", stats, "m").render()[0].decode()) == []


def test_dashboard_check_reports_unknown_metrics_and_labels(stats: ShmStats, tmp_path: Path) -> None:
    exposition = ServerMetrics("hrrn", stats, "m").render()[0].decode()
    broken = {
        "panels": [
            {"targets": [{"expr": 'rate(vllm:no_such_metric_total{model_name="m"}[1m])'}]},
            {"panels": [{"targets": [{"expr": 'sum by (zone) (vllm:num_requests_running{model_name="m"})'}]}]},
        ],
        "templating": {"list": [{"type": "query", "query": "label_values(vllm:num_requests_waiting, instance_id)"}]},
    }
    problems = dashboard_problems(broken, exposition)
    assert len(problems) == 3
    assert "vllm:no_such_metric_total is not exported" in problems[0]
    assert "grouping label 'zone'" in problems[1]
    assert "no label 'instance_id'" in problems[2]
    saved = tmp_path / "metrics.txt"
    saved.write_text(exposition)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    assert main([str(path), str(saved)]) == 1
    assert main([str(DASHBOARD), str(saved)]) == 0


def test_exposition_matches_prometheus_client_and_escapes_the_model_name(stats: ShmStats) -> None:
    from prometheus_client import generate_latest

    stats.set("kv_total_tokens", 64)
    stats.set("running_requests", 1)
    metrics = ServerMetrics("promote_shortest", stats, 'odd "name"\\x', max_len=64)
    metrics.on_submit(9)
    metrics.on_first_token(0.03, cached_tokens=2)
    metrics.on_next_token(0.01)
    metrics.on_finish("abort", 2, 0.05, prompt_tokens=9, first_token_seconds=0.03)
    ours = {}
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        for s in family.samples:
            if s.name.startswith("lightllm_"):
                assert s.labels.pop("model_name") == 'odd "name"\\x'
                ours[(s.name, tuple(sorted(s.labels.items())))] = s.value
    reference = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.measured).decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }
    assert ours == reference


def test_vllm_series_carry_the_engine_label_and_the_requested_length(stats: ShmStats) -> None:
    metrics = ServerMetrics("default", stats, "served-id", max_len=1000)
    metrics.on_finish("stop", 3, 0.5, prompt_tokens=4, first_token_seconds=0.1, max_new_tokens=40)
    metrics.on_finish("length", 8, 0.5, prompt_tokens=4, first_token_seconds=0.1, max_new_tokens=8)
    families = _families(metrics)
    for name in ("vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens"):
        family = families[name]
        assert _value(family, f"{name}_count", model_name="served-id", engine="0") == 2
        assert _value(family, f"{name}_sum", model_name="served-id", engine="0") == 48
    # vLLM's copies carry engine="0"; the lightllm_* series keep strategy and no engine label.
    for family in families.values():
        for sample in family.samples:
            assert ("engine" in sample.labels) == family.name.startswith("vllm:"), sample
            assert sample.labels["model_name"] == "served-id"
    assert _value(families["lightllm_request_max_new_tokens"], "lightllm_request_max_new_tokens_count",
                  strategy="default") == 2


def test_every_documented_finished_reason_is_exported_from_the_start(stats: ShmStats) -> None:
    reasons = {sample.labels["finished_reason"] for sample in _families(ServerMetrics("default", stats, "m"))[
        "vllm:request_success"].samples}
    doc = (DASHBOARD.parents[1] / "EN" / "metrics.md").read_text()
    # vLLM 0.32's five (FINISH_REASON_STRINGS, repetition included) and ours.
    assert reasons == {"stop", "length", "abort", "error", "repetition", "grammar_failed", "handed_off", "busy",
                       "segment_kv_pressure", "segment_limit", "transfer_failed"}
    for reason in reasons:
        assert f"`{reason}`" in doc, reason


def test_tokens_a_leaving_client_never_took_still_count_as_generated(stats: ShmStats) -> None:
    """The tokens counter and the per-request histogram count the same tokens, also when a client
    leaves with tokens still queued for it (they were generated all the same)."""
    metrics = ServerMetrics("hrrn", stats, "m", max_len=512)
    pending = PendingRequest(prompt_tokens=4)
    pending.deliver(DetokenizedOutput(request_id=1, tokens=[TokenEvent(i, "x", -0.1) for i in range(5)], finish_reason=None,
                                      prompt_cache_len=0))

    async def take_two() -> None:
        events = pending.events(None, 0.0, metrics)
        for _ in range(2):
            await events.__anext__()
        await events.aclose()  # the client went away

    asyncio.run(take_two())
    metrics.on_finish("abort", pending.completion_tokens, 0.5, prompt_tokens=4, first_token_seconds=0.1,
                      uncounted_tokens=pending.completion_tokens - pending.taken_tokens)
    families = _families(metrics)
    counted = _value(families["lightllm_generated_tokens"], "lightllm_generated_tokens_total")
    observed = _value(families["lightllm_request_generation_tokens"], "lightllm_request_generation_tokens_sum")
    assert counted == observed == 5


def test_paused_requests_count_as_waiting_not_running(stats: ShmStats) -> None:
    """A request paused for KV memory holds none: vLLM counts a preempted request as waiting."""
    stats.set("running_requests", 17)
    stats.set("waiting_requests", 2)
    stats.set("paused_requests", 16)
    families = _families(ServerMetrics("hrrn", stats, "tiny-model", max_len=512))
    for running, waiting in (("vllm:num_requests_running", "vllm:num_requests_waiting"),
                             ("lightllm_running_requests", "lightllm_waiting_requests")):
        assert _value(families[running], running) == 1
        assert _value(families[waiting], waiting) == 18
    assert _value(families["lightllm_paused_requests"], "lightllm_paused_requests") == 16
    stats.set("paused_requests", 20)  # read at another moment than the router's count: clamped
    families = _families(ServerMetrics("hrrn", stats, "tiny-model", max_len=512))
    assert _value(families["vllm:num_requests_running"], "vllm:num_requests_running") == 0
    assert _value(families["vllm:num_requests_waiting"], "vllm:num_requests_waiting") == 19


def test_requests_held_for_their_grammar_count_as_waiting_not_running(stats: ShmStats) -> None:
    """A constrained request held on the rank until its grammar compiled has not started: vLLM counts
    it as waiting (WAITING_FOR_FSM), as it counts a paused one."""
    stats.set("running_requests", 10)
    stats.set("waiting_requests", 1)
    stats.set("paused_requests", 3)
    stats.set("grammar_held_requests", 4)
    families = _families(ServerMetrics("hrrn", stats, "tiny-model", max_len=512))
    for running, waiting in (("vllm:num_requests_running", "vllm:num_requests_waiting"),
                             ("lightllm_running_requests", "lightllm_waiting_requests")):
        assert _value(families[running], running) == 3
        assert _value(families[waiting], waiting) == 8
    assert _value(families["lightllm_grammar_held_requests"], "lightllm_grammar_held_requests") == 4
    stats.set("grammar_held_requests", 9)  # read at another moment than the router's count: clamped
    families = _families(ServerMetrics("hrrn", stats, "tiny-model", max_len=512))
    assert _value(families["vllm:num_requests_running"], "vllm:num_requests_running") == 0
    assert _value(families["vllm:num_requests_waiting"], "vllm:num_requests_waiting") == 11
