"""The server's command-line parser class: one-line usage errors that name what to use instead.

Users arrive from LightLLM and vLLM with their launch lines; a flag this server does not have is
refused (never guessed from a prefix), and where it has an equivalent the refusal names it.
Every float flag is parsed by :func:`~lightllm.utils.one_line_errors.finite_float`.
"""

from __future__ import annotations

import re
from typing import Collection, Dict, List

from lightllm.utils.one_line_errors import OneLineErrorParser as BaseOneLineErrorParser

# Flag -> what to use instead (or why there is nothing to use): LightLLM's and vLLM's flags whose
# name or meaning differs here. A dashed vLLM spelling of a flag this parser has under the
# underscore name (--api-key) needs no entry: :func:`unknown_flag_hints` names it by itself.
_PREFIX_CACHE_ON = "the prefix cache is on by default (--disable_dynamic_prompt_cache turns it off)"
_CHUNKED_ON = ("chunked prefill is on by default (--chunked_prefill_size sets the chunk, "
               "--disable_chunked_prefill turns it off)")
_NO_REMOTE_CODE = "only built-in architectures are served (Llama, Mistral, Qwen2, Qwen3); no checkpoint code runs"
_NO_CUDA_GRAPHS = "CUDA graphs are not used"
_NO_QUANTIZATION = "quantization is not supported; the model runs in --data_type"
_LOCAL_CHECKPOINT = "checkpoints are read from a local directory (--model_dir); nothing is downloaded"
_NO_ACCESS_LOG = "no per-request access log is written; --log_level sets the server's log"
FOREIGN_FLAG_HINTS: Dict[str, str] = {
    "--tensor-parallel-size": "use --tp",
    "--tensor_parallel_size": "use --tp",
    "-tp": "use --tp",
    "--pipeline-parallel-size": "pipeline parallelism is not supported; use --tp",
    "-pp": "pipeline parallelism is not supported; use --tp",
    "--data-parallel-size": "data parallelism is not built in; start one server per replica",
    "-dp": "data parallelism is not built in; start one server per replica",
    "--model": "use --model_dir (a local checkpoint directory)",
    "--tokenizer": "the tokenizer is read from --model_dir",
    "--download-dir": _LOCAL_CHECKPOINT,
    "--revision": _LOCAL_CHECKPOINT,
    "--max-model-len": "use --max_req_total_len",
    "--max_model_len": "use --max_req_total_len",
    "--served-model-name": "use --model_name",
    "--served_model_name": "use --model_name",
    "--dtype": "use --data_type",
    "--kv-cache-dtype": "the KV cache is kept in --data_type",
    "--max-num-seqs": "use --running_max_req_size",
    "--max_num_seqs": "use --running_max_req_size",
    "--max-num-batched-tokens": "use --batch_max_tokens",
    "--max_num_batched_tokens": "use --batch_max_tokens",
    # vLLM's share counts the whole GPU, weights included; --mem_fraction is a share of what the
    # weights and --reserved_memory_gb leave, so the same number sizes a larger cache here.
    "--gpu-memory-utilization": "use --mem_fraction (a share of the memory left after the weights and "
                                "--reserved_memory_gb, not of the whole GPU)",
    "--block-size": "the KV cache is allocated per token; there is no block size",
    "--swap-space": "KV is never swapped to CPU memory; a request paused for room computes its KV again",
    "--cpu-offload-gb": "weights are never offloaded to CPU memory",
    "--tokenizer-mode": "use --tokenizer_mode",
    "--seed": "use --sampling_seed",
    "--enable-chunked-prefill": _CHUNKED_ON,
    "--enable_chunked_prefill": _CHUNKED_ON,
    "--no-enable-chunked-prefill": "use --disable_chunked_prefill",
    "--enable-prefix-caching": _PREFIX_CACHE_ON,
    "--enable_prefix_caching": _PREFIX_CACHE_ON,
    "--use_dynamic_prompt_cache": _PREFIX_CACHE_ON,
    "--no-enable-prefix-caching": "use --disable_dynamic_prompt_cache",
    "--enable-auto-tool-choice": "tool_choice 'auto' works whenever --tool_call_parser is given",
    "--disable-log-requests": _NO_ACCESS_LOG,
    "--disable-log-stats": _NO_ACCESS_LOG,
    "--uvicorn-log-level": "uvicorn logs warnings only and no access log; --log_level sets the server's log",
    "--enforce-eager": _NO_CUDA_GRAPHS,
    "--router_max_new_token_len": "admission here counts each request's own max_new_tokens; --router_token_ratio is "
                                  "the share of KV capacity admission may promise (see docs/EN/server_args.md)",
    "--mode": "quantization and kernel modes are not supported; the model runs in --data_type",
    "--quant_type": _NO_QUANTIZATION,
    "--quantization": _NO_QUANTIZATION,
    "-q": _NO_QUANTIZATION,
    "--trust_remote_code": _NO_REMOTE_CODE,
    "--trust-remote-code": _NO_REMOTE_CODE,
    "--enable_multimodal": "multimodal inputs are not supported",
    "--graph_max_batch_size": _NO_CUDA_GRAPHS,
    "--disable_cudagraph": _NO_CUDA_GRAPHS,
    "--ssl-keyfile": "TLS is not served here; put a TLS-terminating proxy in front",
    "--ssl-certfile": "TLS is not served here; put a TLS-terminating proxy in front",
}

_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")


def unknown_flag_hints(message: str, known_flags: Collection[str] = ()) -> List[str]:
    """``flag: hint`` for every unknown flag in argparse's ``unrecognized arguments`` message.

    ``known_flags``: the parser's own option strings. An unknown ``--foo-bar`` (vLLM spells its
    flags with dashes) whose ``--foo_bar`` is among them is named as that flag.
    """
    match = _UNRECOGNIZED.search(message)
    if match is None:
        return []
    hints = []
    for word in match.group(1).split():
        flag = word.split("=", 1)[0]
        if flag in FOREIGN_FLAG_HINTS:
            hints.append(f"{flag}: {FOREIGN_FLAG_HINTS[flag]}")
        elif flag.startswith("--") and "-" in flag[2:]:
            underscored = "--" + flag[2:].replace("-", "_")
            if underscored in known_flags:
                hints.append(f"{flag}: use {underscored}")
    return hints


class OneLineErrorParser(BaseOneLineErrorParser):
    """The project's one-line parser (:mod:`lightllm.utils.one_line_errors`) that also names this
    server's equivalent of an unknown flag that LightLLM or vLLM has."""

    def hints(self, message: str) -> List[str]:
        """``flag: what to use instead`` for each unknown LightLLM or vLLM flag in ``message``."""
        return unknown_flag_hints(message, self._option_string_actions.keys())
