"""A request aborted after rank 0 scheduled it, before its first token, is in the queue and
inference histograms (docs/EN/metrics.md: only a request never scheduled is left out).

The HTTP process read the scheduling time with the first output only, so a client that left
during a long prefill (2048 tokens already computed) counted in none of them (outside pass).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from manager_metrics_support import manager_over
from shm_test_support import scratch_req_buffer

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.httpserver.metrics import ServerMetrics


def _count(metrics: ServerMetrics, name: str) -> float:
    return metrics.measured.get_sample_value(f"lightllm_request_{name}_seconds_count", {"strategy": "default"}) or 0.0


async def _leave_before_the_first_token(manager, scheduled: bool) -> None:
    spec = RequestSpec.build([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=8))
    events = manager.generate(spec, request_id=11)
    first = asyncio.ensure_future(events.__anext__())
    while 11 not in manager._pending:
        await asyncio.sleep(0)
    if scheduled:
        assert manager.shm.set_scheduled_ns(0, 11, time.monotonic_ns())
    first.cancel()  # the client goes away
    await asyncio.gather(first, return_exceptions=True)
    await events.aclose()


def test_a_request_aborted_during_its_prefill_counts_its_queue_and_inference_time() -> None:
    stats = ShmStats(f"lightllm_test_{uuid.uuid4().hex[:8]}", create=True)
    try:
        with scratch_req_buffer(2, 64) as shm:
            for scheduled in (True, False):
                metrics = ServerMetrics("default", stats)
                asyncio.run(_leave_before_the_first_token(manager_over(metrics, shm), scheduled))
                shm.release(0, 11)
                expected = 1 if scheduled else 0  # one never scheduled is in none of them
                assert (_count(metrics, "queue"), _count(metrics, "inference")) == (expected, expected)
                assert _count(metrics, "prefill") == 0  # no first token: no prefill time
    finally:
        stats.close()
        stats.unlink()
