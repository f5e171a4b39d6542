"""A decode node's server metrics count only its own work of a PD request (docs/EN/metrics.md)."""

from __future__ import annotations

import asyncio

import pytest
from manager_metrics_support import manager_over

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.io_messages import DetokenizedOutput, TokenEvent
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_NONE, PD_KIND_PREFILL
from lightllm.server.httpserver.manager import HttpServerManager
from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.server.httpserver.pending_request import PendingRequest
from lightllm.server.httpserver.request_counting import RequestCounting

DECODE = RequestCounting.DECODE_NODE_OWN_WORK


def _value(metrics: ServerMetrics, name: str, **labels: str) -> float:
    value = metrics.measured.get_sample_value(name, {"strategy": "default", **labels})
    return value or 0.0


def _run_on_decode(metrics: ServerMetrics, tokens: int, reason: str) -> None:
    """One request as a decode node's manager reports it: submit, ``tokens`` tokens (the first is
    the prefill node's, arriving with the KV), finish."""
    metrics.on_submit(100, DECODE)
    for index in range(tokens):
        if index == 0:
            metrics.on_first_token(0.1, 7, DECODE, 100)
        else:
            metrics.on_next_token(0.01)
    metrics.on_finish(reason, tokens, 1.0, prompt_tokens=100, first_token_seconds=0.1 if tokens else None,
                      counting=DECODE)


def test_a_released_reservation_is_not_a_finished_request_and_counts_no_prompt() -> None:
    metrics = ServerMetrics("default", None)
    # max_tokens 1: P's first token ended it, the master closed D's stream before any KV came.
    _run_on_decode(metrics, 0, "abort")
    assert _value(metrics, "lightllm_requests_total", finish_reason="abort") == 0
    assert _value(metrics, "lightllm_prompt_tokens_total") == 0
    assert _value(metrics, "lightllm_generated_tokens_total") == 0


def test_a_decoded_request_counts_its_prompt_and_only_the_tokens_decode_generated() -> None:
    metrics = ServerMetrics("default", None)
    _run_on_decode(metrics, 3, "length")
    assert _value(metrics, "lightllm_requests_total", finish_reason="length") == 1
    assert _value(metrics, "lightllm_prompt_tokens_total") == 100
    assert _value(metrics, "lightllm_prefix_cache_queried_tokens_total") == 0  # D looks nothing up
    # 3 tokens in the answer: P generated the first, D the other 2 (P + D = the master's 3).
    assert _value(metrics, "lightllm_generated_tokens_total") == 2
    assert _value(metrics, "lightllm_cached_prompt_tokens_total") == 0
    assert _value(metrics, "lightllm_request_generation_tokens_sum") == 2
    # Time per output token: the decode steps' own gaps (0.9 s over the answer's 2 gaps).
    assert _value(metrics, "lightllm_request_time_per_output_token_seconds_count") == 1
    assert abs(_value(metrics, "lightllm_request_time_per_output_token_seconds_sum") - 0.45) < 1e-9


def test_outside_a_decode_node_every_call_counts_as_before() -> None:
    metrics = ServerMetrics("default", None)
    metrics.on_submit(100)
    metrics.on_first_token(0.1, 7)
    metrics.on_finish("abort", 1, 1.0, prompt_tokens=100, first_token_seconds=0.1)
    assert _value(metrics, "lightllm_requests_total", finish_reason="abort") == 1
    assert _value(metrics, "lightllm_prompt_tokens_total") == 100
    assert _value(metrics, "lightllm_prefix_cache_queried_tokens_total") == 100
    assert _value(metrics, "lightllm_generated_tokens_total") == 1


def test_a_prompt_that_does_not_read_the_cache_is_no_cache_query() -> None:
    # The cache off, or a prompt_logprobs request: the prompt counts, the hit rate's denominator does not.
    metrics = ServerMetrics("default", None)
    metrics.on_submit(100, reads_cache=False)
    metrics.on_submit(30)
    assert _value(metrics, "lightllm_prompt_tokens_total") == 130
    assert _value(metrics, "lightllm_prefix_cache_queried_tokens_total") == 30


@pytest.mark.parametrize("kind, counting", [(PD_KIND_NONE, RequestCounting.FULL),
                                            (PD_KIND_PREFILL, RequestCounting.FULL),
                                            (PD_KIND_DECODE, DECODE)])
def test_a_request_spec_decides_its_own_counting(kind: int, counting: RequestCounting) -> None:
    spec = RequestSpec.build([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=8), pd_kind=kind,
                             pd_epoch=0 if kind == PD_KIND_NONE else 1)
    assert RequestCounting.of(spec) is counting


def test_a_pending_decode_request_counts_its_prompt_with_the_first_token_it_hands_out() -> None:
    """The manager's request stream passes its counting on: the prompt counts when the client
    takes the prefill node's first token, which itself counts as generated elsewhere."""
    metrics = ServerMetrics("default", None)
    pending = PendingRequest(prompt_tokens=100, counting=DECODE)
    metrics.on_submit(pending.prompt_tokens, pending.counting)
    assert _value(metrics, "lightllm_prompt_tokens_total") == 0
    pending.deliver(DetokenizedOutput(request_id=1, tokens=[TokenEvent(i, "x", -0.1) for i in range(3)],
                                      finish_reason="length", prompt_cache_len=7))

    async def take_all() -> None:
        async for _ in pending.events(None, 0.0, metrics):
            pass

    asyncio.run(take_all())
    metrics.on_finish("length", pending.completion_tokens, 1.0, prompt_tokens=pending.prompt_tokens,
                      first_token_seconds=pending.first_token_seconds, counting=pending.counting)
    assert _value(metrics, "lightllm_prompt_tokens_total") == 100
    assert _value(metrics, "lightllm_cached_prompt_tokens_total") == 0
    assert _value(metrics, "lightllm_generated_tokens_total") == 2
    assert _value(metrics, "lightllm_requests_total", finish_reason="length") == 1


async def _generate(manager: HttpServerManager, kind: int, output: DetokenizedOutput) -> None:
    spec = RequestSpec.build([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=8), pd_kind=kind,
                             pd_epoch=0 if kind == PD_KIND_NONE else 1)
    events = manager.generate(spec, request_id=output.request_id)
    first = asyncio.ensure_future(events.__anext__())
    while output.request_id not in manager._pending:
        await asyncio.sleep(0)
    manager._pending[output.request_id].deliver(output)
    try:
        await first
    except StopAsyncIteration:
        return
    async for _ in events:
        pass


@pytest.mark.parametrize("kind", [PD_KIND_NONE, PD_KIND_DECODE])
def test_the_manager_counts_a_request_as_its_spec_says(kind: int) -> None:
    metrics = ServerMetrics("default", None)
    manager = manager_over(metrics)
    answer = DetokenizedOutput(1, [TokenEvent(i, "x", -0.1) for i in range(3)], "length", prompt_cache_len=2)
    asyncio.run(_generate(manager, kind, answer))
    decode = kind == PD_KIND_DECODE
    assert _value(metrics, "lightllm_requests_total", finish_reason="length") == 1
    assert _value(metrics, "lightllm_prompt_tokens_total") == 3
    assert _value(metrics, "lightllm_generated_tokens_total") == (2 if decode else 3)
    assert _value(metrics, "lightllm_cached_prompt_tokens_total") == (0 if decode else 2)
    # A finish with no token: on a decode node a released reservation, counted nowhere.
    asyncio.run(_generate(manager, kind, DetokenizedOutput(2, [], "abort", prompt_cache_len=0)))
    assert _value(metrics, "lightllm_requests_total", finish_reason="abort") == (0 if decode else 1)
    assert _value(metrics, "lightllm_prompt_tokens_total") == (3 if decode else 6)


def test_a_server_without_ranks_exports_no_scheduling_histograms() -> None:
    # A PD master never sees a request scheduled: vLLM dashboards pointed at it must find no
    # series rather than three histograms that stay empty forever.
    master = ServerMetrics("pd_master", None)
    master.on_submit(10)
    master.on_finish("length", 2, 1.0, prompt_tokens=10, first_token_seconds=0.1, queue_seconds=0.05)
    text = master.render()[0].decode()
    for name in ("request_queue", "request_prefill", "request_inference"):
        assert f"lightllm_{name}_seconds" not in text and f"vllm:{name}_time_seconds" not in text, name
    assert "vllm:e2e_request_latency_seconds_count" in text
