"""Whether the sequences a kernel benchmark builds fit the checkpoint's context, checked before it loads.

The runtime computes past the positions a model was trained on without a word, so a kernel
benchmark (``bench_decode_attention``, ``bench_linear_backends``) run that far would time a
sequence no server serves.  Unlike :func:`~lightllm.benchmark.cli_args.sequence_too_long`, the
tokens the benchmark appends itself are named as such, not as a flag.
"""

from __future__ import annotations

from typing import Optional

from lightllm.benchmark.context_limit import ContextLimit
from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError


def context_refusal(model_dir: str, flag: str, tokens: int, appended: int = 0, appender: str = "") -> Optional[str]:
    """Why ``tokens`` (given by ``flag``) plus the ``appended`` tokens ``appender`` adds do not fit (None when they do)."""
    try:
        config = ModelConfig.from_dir(model_dir)
    except ModelConfigError as exc:
        return f"--model_dir {model_dir!r} holds no usable config.json: {exc}"
    limit = ContextLimit.of_checkpoint(config, model_dir)
    total = tokens + appended
    if total <= limit.tokens:
        return None
    extra = f" plus the {appended} token{'s' if appended != 1 else ''} {appender}" if appended else ""
    return f"{flag} {tokens}{extra} is {total} tokens, more than {limit.name} of {limit.tokens} ({limit.source})"
