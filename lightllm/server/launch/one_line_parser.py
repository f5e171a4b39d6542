"""The server's command-line parser class: one-line usage errors that name what to use instead.

Users arrive from LightLLM and vLLM with their launch lines; a flag this server does not have is
refused (never guessed from a prefix), and where it has an equivalent the refusal names it.
Every float flag is parsed by :func:`~lightllm.utils.one_line_errors.finite_float`.
"""

from __future__ import annotations

import re
from typing import Dict, List

from lightllm.utils.one_line_errors import OneLineErrorParser as BaseOneLineErrorParser

# Flag -> what to use instead (or why there is nothing to use).
FOREIGN_FLAG_HINTS: Dict[str, str] = {
    "--tensor-parallel-size": "use --tp",
    "--tensor_parallel_size": "use --tp",
    "-tp": "use --tp",
    "--max-model-len": "use --max_req_total_len",
    "--max_model_len": "use --max_req_total_len",
    "--served-model-name": "use --model_name",
    "--served_model_name": "use --model_name",
    "--dtype": "use --data_type",
    "--max-num-seqs": "use --running_max_req_size",
    "--max_num_seqs": "use --running_max_req_size",
    "--max-num-batched-tokens": "use --batch_max_tokens",
    "--max_num_batched_tokens": "use --batch_max_tokens",
    "--gpu-memory-utilization": "use --mem_fraction",
    "--tokenizer-mode": "use --tokenizer_mode",
    "--enable-prefix-caching": "the prefix cache is on by default (--disable_dynamic_prompt_cache turns it off)",
    "--use_dynamic_prompt_cache": "the prefix cache is on by default (--disable_dynamic_prompt_cache turns it off)",
    "--router_max_new_token_len": "admission here counts each request's own max_new_tokens; --router_token_ratio is "
                                  "the share of KV capacity admission may promise (see docs/EN/server_args.md)",
    "--mode": "quantization and kernel modes are not supported; the model runs in --data_type",
    "--quant_type": "quantization is not supported; the model runs in --data_type",
    "--trust_remote_code": "only built-in architectures are served (Llama, Mistral, Qwen2, Qwen3); no checkpoint code runs",
    "--trust-remote-code": "only built-in architectures are served (Llama, Mistral, Qwen2, Qwen3); no checkpoint code runs",
    "--enable_multimodal": "multimodal inputs are not supported",
    "--graph_max_batch_size": "CUDA graphs are not used",
    "--disable_cudagraph": "CUDA graphs are not used",
}

_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")


def unknown_flag_hints(message: str) -> List[str]:
    """``flag: hint`` for every unknown flag in argparse's ``unrecognized arguments`` message."""
    match = _UNRECOGNIZED.search(message)
    if match is None:
        return []
    hints = []
    for word in match.group(1).split():
        flag = word.split("=", 1)[0]
        if flag in FOREIGN_FLAG_HINTS:
            hints.append(f"{flag}: {FOREIGN_FLAG_HINTS[flag]}")
    return hints


class OneLineErrorParser(BaseOneLineErrorParser):
    """The project's one-line parser (:mod:`lightllm.utils.one_line_errors`) that also names this
    server's equivalent of an unknown flag that LightLLM or vLLM has."""

    def hints(self, message: str) -> List[str]:
        """``flag: what to use instead`` for each unknown LightLLM or vLLM flag in ``message``."""
        return unknown_flag_hints(message)
