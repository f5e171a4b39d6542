"""The cost profile the overtaking-bound property tests run the simulator under (plain and mixed batches)."""

from __future__ import annotations

from lightllm.benchmark.simulator.cost_model import CostProfile

# Cheap, fixed step costs: the tests count tokens on the processed-prefill clock, not seconds, so
# any profile works; this one keeps every run fast.
BOUND_TEST_PROFILE = CostProfile(
    name="bound-test",
    prefill_fixed_s=0.001,
    prefill_per_token_s=1e-5,
    prefill_attention_s=0.0,
    decode_fixed_s=0.0005,
    decode_per_req_s=1e-6,
    decode_per_kv_token_s=0.0,
    max_total_token_num=1 << 22,
)
