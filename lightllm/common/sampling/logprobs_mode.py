"""What a request's logprobs describe (``--logprobs_mode``); torch-free, so the launcher can offer the choices.

``scaled_logprobs`` (the default, as LightLLM reports them): the distribution after ``logit_bias``,
penalties, masks and temperature, before min-p / top-k / top-p filtering.
``processed_logprobs`` (vLLM's value of that name): the distribution the token was drawn from, after
every processor, the min-p / top-k / top-p filters included and renormalised, so a filtered token
is ``-inf``; a greedy row's is its distribution after bias, penalties and masks (vLLM reports
greedy rows so).
``raw_logprobs`` (vLLM's default): the model's own distribution, ``log_softmax`` of the logits the
forward returned, whatever the sampling parameters.  Greedy tokens and draws are the same in all three.
"""

SCALED_LOGPROBS = "scaled_logprobs"
PROCESSED_LOGPROBS = "processed_logprobs"
RAW_LOGPROBS = "raw_logprobs"
LOGPROBS_MODES = (SCALED_LOGPROBS, PROCESSED_LOGPROBS, RAW_LOGPROBS)
DEFAULT_LOGPROBS_MODE = SCALED_LOGPROBS
