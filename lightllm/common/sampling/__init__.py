"""Per-request sampling parameters (no torch) and the batched token sampler (torch).

The package exports only the torch-free names: the parameters, their limits and storage widths,
which the HTTP process, router, detokenizer and PD master need. The sampler lives in
:mod:`.sampler`, :mod:`.sampling_batch` and :mod:`.logit_processors`; only the model rank imports
them, so only the model rank loads torch.
"""

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
    "SamplingParamError",
    "SamplingParams",
    "STOP_SEQUENCES_BYTES",
    "STORED_DTYPES",
]
