"""Per-request sampling parameters and the batched, vectorised token sampler."""

from lightllm.common.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_min_tokens_mask,
    apply_penalties,
    apply_top_k_top_p,
    derive_step_seed,
)
from lightllm.common.sampling.sampling_params import (
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    SamplingParamError,
    SamplingParams,
)

__all__ = [
    "MAX_STOP_SEQUENCES",
    "MAX_TOP_LOGPROBS",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParamError",
    "SamplingParams",
    "apply_min_tokens_mask",
    "apply_penalties",
    "apply_top_k_top_p",
    "derive_step_seed",
]
