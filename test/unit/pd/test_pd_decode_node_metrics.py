"""A decode node's server metrics count only its own work of a PD request (docs/EN/metrics.md)."""

from __future__ import annotations

import contextvars

from lightllm.server.httpserver.metrics import DecodeNodeRequest, ServerMetrics, decode_node_request


def _value(metrics: ServerMetrics, name: str, **labels: str) -> float:
    value = metrics.measured.get_sample_value(name, {"strategy": "default", **labels})
    return value or 0.0


def _run_on_decode(metrics: ServerMetrics, tokens: int, reason: str) -> None:
    """One request as a decode node's manager reports it: submit, ``tokens`` tokens (the first is
    the prefill node's, arriving with the KV), finish."""
    decode_node_request.set(DecodeNodeRequest())
    metrics.on_submit(100)
    for index in range(tokens):
        if index == 0:
            metrics.on_first_token(0.1, 7)
        else:
            metrics.on_next_token(0.01)
    metrics.on_finish(reason, tokens, 1.0, prompt_tokens=100, first_token_seconds=0.1 if tokens else None)


def test_a_released_reservation_is_not_a_finished_request_and_counts_no_prompt() -> None:
    metrics = ServerMetrics("default", None)
    # max_tokens 1: P's first token ended it, the master closed D's stream before any KV came.
    contextvars.copy_context().run(_run_on_decode, metrics, 0, "abort")
    assert _value(metrics, "lightllm_requests_total", finish_reason="abort") == 0
    assert _value(metrics, "lightllm_prompt_tokens_total") == 0
    assert _value(metrics, "lightllm_generated_tokens_total") == 0


def test_a_decoded_request_counts_its_prompt_and_only_the_tokens_decode_generated() -> None:
    metrics = ServerMetrics("default", None)
    contextvars.copy_context().run(_run_on_decode, metrics, 3, "length")
    assert _value(metrics, "lightllm_requests_total", finish_reason="length") == 1
    assert _value(metrics, "lightllm_prompt_tokens_total") == 100
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
    assert _value(metrics, "lightllm_generated_tokens_total") == 1
