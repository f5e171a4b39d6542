"""Prefill-wait observability: the rank-side tracker and its /metrics form."""

from __future__ import annotations

import uuid

from prometheus_client.parser import text_string_to_metric_families

from lightllm.server.core.objs.prefill_wait_histogram import LONGEST_TOKENS_FIELD, PREFILL_WAIT_FIELDS
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.prefill_wait_tracker import PrefillWaitTracker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _req(rid: int, arrival: int) -> InferReq:
    return InferReq(request_id=rid, prompt_ids=[0] * 10, arrival_processed_prefill_tokens=arrival)


def test_tracker_records_completed_waits_and_the_longest_current_one() -> None:
    clock = FakeClock()
    tracker = PrefillWaitTracker(clock=clock)
    a, b, c = _req(1, 0), _req(2, 100), _req(3, 5000)
    for req in (a, b):
        tracker.on_arrival(req)
    clock.now += 2.0
    tracker.on_arrival(c)
    clock.now += 0.5
    a.output_ids.append(7)  # a got its first token this step
    done = tracker.on_step([a], [], [a, b, c], processed_prefill_tokens=3000)
    assert done == [(3000, 2.5)]
    assert tracker.longest_tokens == 2900 and tracker.longest_us == 2_500_000  # b still waits
    # a's later tokens are not prefill waits; b is aborted (released without a token).
    a.output_ids.append(8)
    done = tracker.on_step([a], [b], [a, c], processed_prefill_tokens=6000)
    assert done == []
    assert tracker.longest_tokens == 1000 and tracker.longest_us == 500_000
    fields = tracker.fields()
    assert set(fields) == set(PREFILL_WAIT_FIELDS)
    assert fields["prefill_wait_hist_tokens_le_1024"] == 0
    # 3000 tokens: above the 2048 bucket (next to the default allowance of 2048), within 4096.
    assert fields["prefill_wait_hist_tokens_le_2048"] == 0
    assert fields["prefill_wait_hist_tokens_le_4096"] == 1
    assert fields["prefill_wait_hist_tokens_le_inf"] == 1 == tracker.completed_count
    assert fields["prefill_wait_hist_tokens_sum"] == 3000
    assert fields["prefill_wait_hist_us_le_2500000"] == 1 and fields["prefill_wait_hist_us_le_1000000"] == 0


def test_metrics_expose_wait_histograms_and_longest_wait_per_strategy() -> None:
    stats = ShmStats(f"lightllm_test_{uuid.uuid4().hex[:8]}", create=True)
    try:
        clock = FakeClock()
        tracker = PrefillWaitTracker(clock=clock)
        reqs = [_req(i, 0) for i in range(3)]
        for req in reqs:
            tracker.on_arrival(req)
        clock.now += 0.2
        reqs[0].output_ids.append(1)
        reqs[1].output_ids.append(1)
        tracker.on_step(reqs[:2], [], reqs, processed_prefill_tokens=2000)
        for name, value in tracker.fields().items():
            stats.set(name, value)
        body, _ = ServerMetrics("hrrn", stats).render()
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        hist = families["lightllm_prefill_wait_tokens"]
        samples = {(s.name, s.labels.get("le")): s.value for s in hist.samples}
        # le spelled as prometheus_client spells every other histogram's bounds (it read "1024").
        assert samples[("lightllm_prefill_wait_tokens_bucket", "1024.0")] == 0
        assert samples[("lightllm_prefill_wait_tokens_bucket", "4096.0")] == 2
        assert samples[("lightllm_prefill_wait_tokens_count", None)] == 2
        assert samples[("lightllm_prefill_wait_tokens_sum", None)] == 4000
        assert all(s.labels["strategy"] == "hrrn" for s in hist.samples)
        seconds = {(s.name, s.labels.get("le")): s.value for s in families["lightllm_prefill_wait_seconds"].samples}
        assert seconds[("lightllm_prefill_wait_seconds_bucket", "0.25")] == 2
        assert seconds[("lightllm_prefill_wait_seconds_bucket", "0.1")] == 0
        assert seconds[("lightllm_prefill_wait_seconds_bucket", "1.0")] == 2
        assert families["lightllm_prefill_wait_longest_tokens"].samples[0].value == 2000
        assert abs(families["lightllm_prefill_wait_longest_seconds"].samples[0].value - 0.2) < 1e-6
        # The raw bucket fields are not repeated as gauges.
        assert not any(name.startswith("lightllm_prefill_wait_hist") for name in families)
        assert stats.get(LONGEST_TOKENS_FIELD) == 2000
    finally:
        stats.close()
        stats.unlink()
