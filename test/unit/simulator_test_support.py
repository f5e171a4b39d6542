"""Helpers shared by the simulator tests: a small step-cost profile."""

from __future__ import annotations

from lightllm.benchmark.simulator.cost_model import CostProfile


def make_profile(**overrides: float) -> CostProfile:
    """A cheap test profile (prefill and decode costs of a small model), with ``overrides`` applied."""
    values = dict(
        name="test",
        prefill_fixed_s=0.001,
        prefill_per_token_s=1e-5,
        prefill_attention_s=1e-9,
        decode_fixed_s=0.002,
        decode_per_req_s=1e-5,
        decode_per_kv_token_s=1e-8,
        max_total_token_num=1 << 20,
    )
    values.update(overrides)
    return CostProfile(**values)
