"""What a LightLLM or vLLM flag this server does not have should be replaced with, or why nothing can.

Users arrive with launch lines written for LightLLM or vLLM.  The parser refuses every flag it does
not have (never guessing from a prefix); for the flags listed here the refusal also names this
server's equivalent, or says why there is none.  A flag is looked up as written and in the other
spelling (vLLM's dashes, LightLLM's underscores), so one entry covers both.
"""

from __future__ import annotations

from typing import Dict, Optional

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
_NO_STATS_LOG = "no periodic statistics are logged; /metrics exports them (Prometheus text format)"
_NO_DATA_PARALLEL = "data parallelism is not built in; start one server per replica"
_NO_MULTIMODAL = "multimodal inputs are not supported"
_NO_SPECULATION = "speculative decoding is not supported"
_NO_GPU_SWITCH = ("this server has no such GPU optimisation to switch (no custom collectives, micro-batch overlap "
                  "or MPS)")
_ONE_MACHINE = ("one server runs on one machine; spread a deployment over machines as prefill and decode nodes "
                "(--run_mode prefill|decode with --pd_master_ip)")
_NO_CONFIG_SERVER = "PD nodes register with the PD master (--pd_master_ip, --pd_master_port); there is no config server"
_NO_METRICS_PUSH = "metrics are not pushed; scrape /metrics (Prometheus text format)"
_ATTENTION_BACKEND = "attention kernels are chosen with --attention_backend"
_STRUCTURED_ALWAYS_ON = ("structured output (response_format, guided_json, regular_constraint, ...) is always on, "
                         "through llguidance; there is nothing to choose")
FOREIGN_FLAG_HINTS: Dict[str, str] = {
    "--tensor-parallel-size": "use --tp",
    "-tp": "use --tp",
    "--pipeline-parallel-size": "pipeline parallelism is not supported; use --tp",
    "-pp": "pipeline parallelism is not supported; use --tp",
    "--data-parallel-size": _NO_DATA_PARALLEL,
    "-dp": _NO_DATA_PARALLEL,
    "--model": "use --model_dir (a local checkpoint directory)",
    "--tokenizer": "the tokenizer is read from --model_dir",
    "--download-dir": _LOCAL_CHECKPOINT,
    "--revision": _LOCAL_CHECKPOINT,
    "--max-model-len": "use --max_req_total_len",
    "--served-model-name": "use --model_name",
    "--dtype": "use --data_type",
    "--kv-cache-dtype": "the KV cache is kept in --data_type",
    "--max-num-seqs": "use --running_max_req_size",
    "--max-num-batched-tokens": "use --batch_max_tokens",
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
    "--no-enable-chunked-prefill": "use --disable_chunked_prefill",
    "--enable-prefix-caching": _PREFIX_CACHE_ON,
    "--use_dynamic_prompt_cache": _PREFIX_CACHE_ON,
    "--no-enable-prefix-caching": "use --disable_dynamic_prompt_cache",
    "--enable-auto-tool-choice": "tool_choice 'auto' works whenever --tool_call_parser is given",
    "--disable-log-requests": _NO_ACCESS_LOG,
    "--disable-log-stats": _NO_STATS_LOG,
    "--uvicorn-log-level": "uvicorn logs warnings only and no access log; --log_level sets the server's log",
    "--enforce-eager": _NO_CUDA_GRAPHS,
    "--router_max_new_token_len": "admission here counts each request's own max_new_tokens; --router_token_ratio is "
                                  "the share of KV capacity admission may promise (see docs/EN/server_args.md)",
    "--mode": "quantization and kernel modes are not supported; the model runs in --data_type",
    "--quant_type": _NO_QUANTIZATION,
    "--quantization": _NO_QUANTIZATION,
    "-q": _NO_QUANTIZATION,
    "--trust-remote-code": _NO_REMOTE_CODE,
    "--enable_multimodal": _NO_MULTIMODAL,
    "--graph_max_batch_size": _NO_CUDA_GRAPHS,
    "--disable_cudagraph": _NO_CUDA_GRAPHS,
    "--ssl-keyfile": "TLS is not served here; put a TLS-terminating proxy in front",
    "--ssl-certfile": "TLS is not served here; put a TLS-terminating proxy in front",
    # LightLLM's own flags that this server does not have.
    "--dp": _NO_DATA_PARALLEL,
    "--nnodes": _ONE_MACHINE,
    "--node_rank": _ONE_MACHINE,
    "--multinode_httpmanager_port": _ONE_MACHINE,
    "--multinode_router_gloo_port": _ONE_MACHINE,
    "--config_server_host": _NO_CONFIG_SERVER,
    "--config_server_port": _NO_CONFIG_SERVER,
    "--use_config_server_to_init_nccl": _NO_CONFIG_SERVER,
    "--zmq_mode": "the server's processes talk over local IPC sockets; there is nothing to choose",
    "--httpserver_workers": "one HTTP process serves every client; tokenization runs on its worker threads",
    "--load_way": "weights are read from the safetensors files in --model_dir",
    "--log_stats_interval": _NO_STATS_LOG,
    "--metric_gateway": _NO_METRICS_PUSH,
    "--job_name": _NO_METRICS_PUSH,
    "--grouping_key": _NO_METRICS_PUSH,
    "--push_interval": _NO_METRICS_PUSH,
    "--enable_monitor_auth": "/metrics asks for the API key whenever --api_key (or LIGHTLLM_API_KEY) is set",
    "--max_req_input_len": "a prompt may use all of --max_req_total_len (prompt plus output) that its max_new_tokens "
                           "leaves",
    "--long_truncation_mode": "a prompt longer than the context is refused with a 400; the OpenAI endpoints take "
                              "truncate_prompt_tokens per request",
    "--return_all_prompt_logprobs": "ask per request with prompt_logprobs (the OpenAI endpoints)",
    "--splitfuse_mode": _CHUNKED_ON,
    "--splitfuse_block_size": "use --chunked_prefill_size",
    "--output_constraint_mode": _STRUCTURED_ALWAYS_ON,
    "--simple_constraint_mode": _STRUCTURED_ALWAYS_ON,
    "--first_token_constraint_mode": "not supported; constrain the output with a grammar (regular_constraint, "
                                     "guided_json) or logit_bias",
    "--token_healing_mode": "token healing is not supported",
    "--diverse_mode": "n and best_of always work; there is no mode to turn on",
    "--beam_mode": "beam search is not supported",
    "--use_reward_model": "reward models are not served",
    "--use_tgi_api": "the native endpoints answer in LightLLM's shape; the OpenAI endpoints are the compatible API "
                     "(there is no TGI response mode)",
    "--sampling_backend": "sampling runs in torch in the model ranks; there is no backend to choose",
    "--enable_fa3": _ATTENTION_BACKEND,
    "--enable_flashinfer_prefill": _ATTENTION_BACKEND,
    "--enable_flashinfer_decode": _ATTENTION_BACKEND,
    "--enable_mps": _NO_GPU_SWITCH,
    "--disable_custom_allreduce": _NO_GPU_SWITCH,
    "--enable_custom_allgather": _NO_GPU_SWITCH,
    "--enable_tpsp_mix_mode": _NO_GPU_SWITCH,
    "--enable_prefill_microbatch_overlap": _NO_GPU_SWITCH,
    "--enable_decode_microbatch_overlap": _NO_GPU_SWITCH,
    "--graph_split_batch_size": _NO_CUDA_GRAPHS,
    "--graph_grow_step_size": _NO_CUDA_GRAPHS,
    "--graph_max_len_in_batch": _NO_CUDA_GRAPHS,
    "--quant_cfg": _NO_QUANTIZATION,
    "--kv_quant_calibration_config_path": _NO_QUANTIZATION,
    "--mtp_mode": _NO_SPECULATION,
    "--mtp_draft_model_dir": _NO_SPECULATION,
    "--mtp_step": _NO_SPECULATION,
    "--speculative-config": _NO_SPECULATION,
    "--enable_multimodal_audio": _NO_MULTIMODAL,
    "--visual_infer_batch_size": _NO_MULTIMODAL,
    "--visual_gpu_ids": _NO_MULTIMODAL,
    "--visual_tp": _NO_MULTIMODAL,
    "--visual_dp": _NO_MULTIMODAL,
    "--visual_nccl_ports": _NO_MULTIMODAL,
    "--vit_quant_type": _NO_MULTIMODAL,
    "--vit_quant_cfg": _NO_MULTIMODAL,
    "--cache_capacity": _NO_MULTIMODAL + " (LightLLM's cache of image embeddings)",
    "--cache_reserved_ratio": _NO_MULTIMODAL + " (LightLLM's cache of image embeddings)",
    "--ep_redundancy_expert_config_path": "mixture-of-experts models are not served",
    "--auto_update_redundancy_expert": "mixture-of-experts models are not served",
}


def foreign_flag_hint(flag: str) -> Optional[str]:
    """What to use instead of ``flag`` (in either spelling), or None for a flag not listed."""
    if not flag.startswith("--"):
        return FOREIGN_FLAG_HINTS.get(flag)
    name = flag[2:]
    for spelling in (flag, "--" + name.replace("-", "_"), "--" + name.replace("_", "-")):
        if spelling in FOREIGN_FLAG_HINTS:
            return FOREIGN_FLAG_HINTS[spelling]
    return None
