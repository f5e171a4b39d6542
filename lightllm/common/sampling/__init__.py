"""Per-request sampling parameters and the batched, vectorised token sampler."""

from lightllm.common.sampling.logit_processors import (
    apply_exponential_decay,
    apply_logit_bias,
    apply_min_tokens_mask,
    apply_penalties,
    apply_top_k_top_p,
)
from lightllm.common.sampling.sampler import Sampler
from lightllm.common.sampling.sampler_output import SamplerOutput
from lightllm.common.sampling.sampling_batch import SamplingBatch, derive_step_seed
from lightllm.common.sampling.sampling_params import (
    LOGIT_BIAS_LIMIT,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    SamplingParamError,
    SamplingParams,
)
from lightllm.common.sampling.storage_width import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, STOP_SEQUENCES_BYTES, STORED_DTYPES

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "MAX_LOGIT_BIAS",
    "MAX_STOP_SEQUENCES",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOP_LOGPROBS",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParamError",
    "SamplingParams",
    "STOP_SEQUENCES_BYTES",
    "STORED_DTYPES",
    "apply_exponential_decay",
    "apply_logit_bias",
    "apply_min_tokens_mask",
    "apply_penalties",
    "apply_top_k_top_p",
    "derive_step_seed",
]
