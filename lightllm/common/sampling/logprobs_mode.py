"""What a request's logprobs describe (``--logprobs_mode``), with vLLM's names; torch-free, so the
launcher can offer the choices.

``processed_logprobs`` (the default, as LightLLM reports them): the distribution the token was drawn
from, with ``logit_bias``, penalties, masks and temperature applied (before top-k / top-p / min-p).
``raw_logprobs`` (vLLM's default): the model's own distribution, ``log_softmax`` of the logits the
forward returned, whatever the sampling parameters.  Greedy tokens and draws are the same in both.
"""

PROCESSED_LOGPROBS = "processed_logprobs"
RAW_LOGPROBS = "raw_logprobs"
LOGPROBS_MODES = (PROCESSED_LOGPROBS, RAW_LOGPROBS)
