"""Derived sizes of a server: KV capacity, per-request limits, budgets, dtype and threads, and the
model ranks' process-level settings from the environment (idle heap trim, step trace).

Pure arithmetic on the flags, the checkpoint's config and the machine's facts; it imports no torch
(the launcher never does: docs/EN/architecture.md), so dtypes are names here.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from lightllm.common.basemodel.kv_head_split import kv_head_split_problem, kv_heads_per_rank
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.basemodel.serving_dtype import auto_dtype_on, dtype_name
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import flags_given
from lightllm.server.launch.args_check import chunked_prefill_size_for
from lightllm.server.launch.kv_budget import GIB, available_memory_bytes, kv_bytes_per_token, plan_kv_budget
from lightllm.server.run_mode import RunMode
from lightllm.utils.envs_utils import (
    DEFAULT_IDLE_MALLOC_TRIM_SECONDS,
    DEFAULT_WIDE_FORWARD_MS_PER_TOKEN,
    idle_malloc_trim_seconds,
    step_trace_path,
    torch_threads_override,
    wide_forward_ms_per_token_override,
)


CPU_DEFAULT_KV_TOKEN_CAP = 1 << 18

log = logging.getLogger("lightllm.sizing")


@dataclass
class ServerSizing:
    """Numbers every process must agree on, computed once in the launcher."""

    device: str
    dtype_name: str
    max_req_total_len: int
    max_total_token_num: int
    batch_max_tokens: int
    # Largest chunk of one request per step (None: no chunking); a decode node's is its step budget.
    chunked_prefill_size: Optional[int]
    slot_num: int
    torch_threads: int | None
    # Top-logprob rows: --top_logprobs_slots, default --running_max_req_size, at most slot_num.
    top_slot_num: int = 0
    # Threads a forward borrows when its work pays for the front end's core, and the rule's
    # threshold (CPU only; see model_rank/execution/forward_threads.py).
    prefill_torch_threads: int | None = None
    wide_forward_ms_per_token: float = DEFAULT_WIDE_FORWARD_MS_PER_TOKEN
    # Idle seconds before a model rank returns freed heap memory (inf: never); see utils/malloc_tuning.py.
    idle_malloc_trim_seconds: float = DEFAULT_IDLE_MALLOC_TRIM_SECONDS
    # Where rank 0 writes its per-step trace (None: no trace); see model_rank/step_trace.py.
    step_trace_path: Optional[str] = None


def resolve_max_req_total_len(flag_value: Optional[int], config: ModelConfig) -> int:
    """``--max_req_total_len``, by default the model's context (capped by a sliding window).

    The context is vLLM's default ``max_model_len``: ``max_position_embeddings``, times the
    factor of ``linear`` and ``dynamic`` RoPE scaling (:attr:`ModelConfig.rope_context`).  A
    longer flag is served with a warning (vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN
    is set).  A checkpoint with sliding-window layers is served with full attention, which
    computes the same thing only while a sequence fits in the window: a longer limit is refused.
    """
    if flag_value is None:
        return config.context_limit
    window = config.sliding_window
    context = config.rope_context
    if flag_value > context:
        # Positions past the declared context are computed, but the model was neither trained
        # nor scaled for them.
        if context == config.max_position_embeddings:
            log.warning(
                "--max_req_total_len %d exceeds the checkpoint's max_position_embeddings (%d): output past position %d "
                "is outside what the model was trained on", flag_value, context, context,
            )
        else:
            log.warning(
                "--max_req_total_len %d exceeds the checkpoint's context of %d tokens (max_position_embeddings %d x "
                "%s rope factor %g): output past position %d is outside what the model was trained or scaled for",
                flag_value, context, config.max_position_embeddings, config.rope.rope_type, config.rope.factor, context,
            )
    if window is not None and flag_value > window:
        raise ArgumentError(
            f"--max_req_total_len {flag_value} exceeds the checkpoint's sliding window ({window} tokens); this "
            f"server attends to the whole sequence, which matches the model only within the window: give at most {window}"
        )
    return flag_value


def _refuse_kv_beyond_memory(
    kv_tokens: int, per_token: int, tp: int, device: str, cuda_free_bytes: Optional[int]
) -> None:
    """Refuse a ``--max_total_token_num`` whose KV cache cannot fit in memory at all.

    Better a one-line refusal before any process starts than the allocator's error from a rank
    after the model loaded. Only the cache itself is compared: a size that fits but leaves too
    little room is the operator's call.
    """
    if device == "cpu":
        need, have, where = kv_tokens * per_token * tp, available_memory_bytes("cpu"), "this machine has available"
    elif cuda_free_bytes is not None:
        need, have, where = kv_tokens * per_token, cuda_free_bytes, "each device has free"
    else:
        return
    if need > have:
        raise ArgumentError(
            f"--max_total_token_num {kv_tokens} needs {need / GIB:.2f} GiB of KV cache, more than the {have / GIB:.2f} GiB "
            f"{where}; give at most {have // (per_token * (tp if device == 'cpu' else 1))}"
        )


def plan_sizing(
    args: argparse.Namespace, config: ModelConfig, device: str, cuda_free_bytes: Optional[int] = None
) -> ServerSizing:
    """Resolve defaults that depend on the model and the machine; reject impossible settings.

    ``cuda_free_bytes``: the CUDA device's free memory (the device probe's answer), needed on
    CUDA when ``--max_total_token_num`` is not given.  The checks run in this order, so a start
    with several problems names the same one first every time.
    """
    dtype = _serving_dtype(args, config, device)
    _check_tp_split(args, config)
    max_req_total_len = resolve_max_req_total_len(args.max_req_total_len, config)
    step = _step_budget(args, max_req_total_len)
    kv_tokens = _kv_tokens(args, config, device, dtype, step, max_req_total_len, cuda_free_bytes)
    step = _default_budget_within_kv(args, step, kv_tokens)
    threads, prefill_threads, wide_ms = _cpu_threads(args, device)
    slot_num, top_slot_num = _slot_counts(args)
    return ServerSizing(
        device=device,
        dtype_name=dtype,
        max_req_total_len=max_req_total_len,
        max_total_token_num=kv_tokens,
        batch_max_tokens=step.batch_max_tokens,
        chunked_prefill_size=step.chunk,
        slot_num=slot_num,
        top_slot_num=top_slot_num,
        torch_threads=threads,
        prefill_torch_threads=prefill_threads,
        wide_forward_ms_per_token=wide_ms,
        idle_malloc_trim_seconds=idle_malloc_trim_seconds(),
        step_trace_path=step_trace_path(),
    )


def _serving_dtype(args: argparse.Namespace, config: ModelConfig, device: str) -> str:
    """``--data_type``, or the checkpoint's dtype (float32 for a float16 checkpoint on CPU).

    An explicit ``--data_type`` wins over whatever config.json says; ``auto`` takes config.json's
    dtype, else the weights' (:attr:`ModelConfig.dtype`), and refuses (ModelConfigError, one line)
    a checkpoint whose dtype this server cannot serve.
    """
    if args.data_type != "auto":
        return dtype_name(args.data_type)
    checkpoint = config.dtype
    if config.dtype_note is not None:
        log.warning("%s", config.dtype_note)
    log.info("--data_type auto takes %s from %s", checkpoint, config.dtype_source)
    return auto_dtype_on(checkpoint, device)


def _check_tp_split(args: argparse.Namespace, config: ModelConfig) -> None:
    """Refuse a ``--tp`` the heads and the MLP cannot be split by (KV heads may be replicated)."""
    failing = [name for name, fails in (
        ("num_attention_heads", config.num_attention_heads % args.tp != 0),
        ("intermediate_size", config.intermediate_size % args.tp != 0),
        ("num_key_value_heads", kv_head_split_problem(config.num_key_value_heads, args.tp) is not None),
    ) if fails]
    if failing:
        raise ArgumentError(
            f"--tp {args.tp} must divide num_attention_heads ({config.num_attention_heads}) and intermediate_size "
            f"({config.intermediate_size}), and divide or be a multiple of num_key_value_heads "
            f"({config.num_key_value_heads}): each rank holds a share of the KV heads, or a replica of one "
            f"(failing here: {', '.join(failing)})"
        )


@dataclass(frozen=True)
class StepBudget:
    """The tokens one forward may hold, and one request's chunk of them (None: no chunking)."""

    batch_max_tokens: int
    chunk: Optional[int]
    decode_node: bool


def _step_budget(args: argparse.Namespace, max_req_total_len: int) -> StepBudget:
    """``--batch_max_tokens`` and the chunk, with their defaults and the node's kind."""
    chunked = not args.disable_chunked_prefill
    decode_node = args.run_mode == RunMode.DECODE
    if decode_node:
        # A PD decode node never prefills (it receives the KV; the prefill step's flags are refused
        # there): its largest forward is a decode step of --running_max_req_size one-token rows.
        batch_max_tokens = args.running_max_req_size
    elif args.batch_max_tokens is not None:
        batch_max_tokens = args.batch_max_tokens
    elif chunked:
        batch_max_tokens = max(args.chunked_prefill_size, 2048)
    else:
        batch_max_tokens = max(max_req_total_len, 2048)
    # The chunk the server uses (a default one follows a smaller budget down), also for a caller
    # that validated the flags without resolving them.
    chunk = batch_max_tokens if decode_node else chunked_prefill_size_for(args) if chunked else None
    mixed = args.run_mode == RunMode.NORMAL and chunked and not args.disable_mixed_batches
    if mixed and batch_max_tokens < args.running_max_req_size:
        # Every decoding row takes one token of a mixed step's budget: with more rows than the
        # budget a waiting prompt gets no token until decodes finish (vLLM refuses the same).
        raise ArgumentError(
            f"with mixed batches (the default) each decoding request takes one token of a step's --batch_max_tokens, so "
            f"--batch_max_tokens ({batch_max_tokens}) must be >= --running_max_req_size ({args.running_max_req_size}) "
            "or a prompt would wait for decodes to finish; lower --running_max_req_size, raise --batch_max_tokens, "
            "or give --disable_mixed_batches"
        )
    if not chunked and batch_max_tokens < max_req_total_len:
        raise ArgumentError(
            f"with --disable_chunked_prefill every prompt must fit one forward: --batch_max_tokens ({batch_max_tokens}) "
            f"must be >= --max_req_total_len ({max_req_total_len})"
        )
    return StepBudget(batch_max_tokens, chunk, decode_node)


def _default_budget_within_kv(args: argparse.Namespace, step: StepBudget, kv_tokens: int) -> StepBudget:
    """The default ``--batch_max_tokens`` cut to a smaller KV cache (an explicit one above it is refused).

    No step can hold more prompt tokens than the cache, so a larger default would name a budget
    the planner never runs (and the overtaking bound's B with it).  The cut stops at
    ``--running_max_req_size`` with mixed batches (each decoding row takes a token of the budget)
    and at a chunk the user typed; a default chunk follows the budget down.
    """
    if args.batch_max_tokens is not None or step.decode_node or step.batch_max_tokens <= kv_tokens:
        return step
    typed_chunk = step.chunk is not None and bool(flags_given(args, ["chunked_prefill_size"]))
    budget = max(kv_tokens, _mixed_rows(args, step), step.chunk if typed_chunk else 0)
    if budget >= step.batch_max_tokens:
        return step
    chunk = step.chunk if step.chunk is None or typed_chunk else min(step.chunk, budget)
    return StepBudget(budget, chunk, step.decode_node)


def _kv_tokens(args: argparse.Namespace, config: ModelConfig, device: str, dtype: str, step: StepBudget,
               max_req_total_len: int, cuda_free_bytes: Optional[int]) -> int:
    """The KV cache's tokens per rank: ``--max_total_token_num`` or what the memory budget holds."""
    per_token = kv_bytes_per_token(config.num_hidden_layers, kv_heads_per_rank(config.num_key_value_heads, args.tp),
                                   config.head_dim, dtype)
    budget = None
    if args.max_total_token_num is not None:
        kv_tokens = args.max_total_token_num
        _refuse_kv_beyond_memory(kv_tokens, per_token, args.tp, device, cuda_free_bytes)
    else:
        budget = plan_kv_budget(
            device=device, config=config, model_dir=args.model_dir, serving_dtype=dtype, tp=args.tp,
            mem_fraction=args.mem_fraction, reserved_memory_gb=args.reserved_memory_gb,
            batch_max_tokens=step.batch_max_tokens,
            chunk_tokens=step.chunk or max_req_total_len,
            max_req_total_len=max_req_total_len, max_batch_rows=args.running_max_req_size,
            cuda_free_bytes=cuda_free_bytes, decode_node=step.decode_node,
        )
        kv_tokens = budget.kv_bytes // per_token
        if device == "cpu":
            # CPU memory is shared by every rank and the rest of the machine: split it between
            # the ranks and cap it, since a CPU forward never gets through millions of tokens.
            kv_tokens = min(kv_tokens // args.tp, CPU_DEFAULT_KV_TOKEN_CAP)
    if kv_tokens < max_req_total_len:
        if budget is None:
            remedy = "raise --max_total_token_num or lower --max_req_total_len"
        elif budget.activation_share > 0.5:
            # The estimate of a forward's activations ate the memory: name the flags behind it.
            assert budget.activations is not None
            remedy = (
                f"the reserve ({budget.reserve / GIB:.2f} GiB) is mostly the estimated activations of one forward, "
                f"driven by {budget.activations.largest_driver(chunked=step.chunk is not None)}: lower it, or set "
                "--reserved_memory_gb"
            )
        else:
            remedy = "lower --max_req_total_len or --reserved_memory_gb, or give more memory"
        raise ArgumentError(
            f"the KV cache holds {kv_tokens} tokens, fewer than one request may need (--max_req_total_len "
            f"{max_req_total_len}); {remedy}"
        )
    largest = max(kv_tokens, _mixed_rows(args, step))
    if args.batch_max_tokens is not None and not step.decode_node and args.batch_max_tokens > largest:
        # A step's prompt tokens all need KV room: the planner would cut every step to the cache
        # and the flag would promise a budget the server never runs.  A mixed step's decode rows
        # take budget without prompt KV, so up to --running_max_req_size is allowed (as it is the
        # default's floor): "give at most 200" was itself refused for being below 256 rows.
        raise ArgumentError(
            f"--batch_max_tokens ({args.batch_max_tokens}) exceeds the KV cache ({kv_tokens} tokens, "
            f"{'--max_total_token_num' if budget is None else 'sized from memory'}): no step can hold more prompt "
            f"tokens than the cache; give at most {largest}"
        )
    return kv_tokens


def _mixed_rows(args: argparse.Namespace, step: StepBudget) -> int:
    """The rows a mixed step's budget must hold (--running_max_req_size), or 0 without mixed batches."""
    mixed = args.run_mode == RunMode.NORMAL and step.chunk is not None and not args.disable_mixed_batches
    return args.running_max_req_size if mixed else 0


def _cpu_threads(args: argparse.Namespace, device: str) -> Tuple[Optional[int], Optional[int], float]:
    """Torch threads of a rank's decode and of its wide forwards, and the wide-forward threshold."""
    if device != "cpu":
        return None, None, DEFAULT_WIDE_FORWARD_MS_PER_TOKEN
    cores = os.cpu_count() or 1
    # Decode leaves a core to the HTTP, router and detokenization processes, which stream its
    # tokens: a torch thread pool that competes with them stalls at every parallel region.
    # Prefill, compute-bound and nearly silent, borrows it.
    override = torch_threads_override()
    threads = override or max(1, (cores - 1) // args.tp)
    prefill_override = torch_threads_override("LIGHTLLM_PREFILL_TORCH_THREADS")
    prefill_threads = prefill_override or override or max(1, cores // args.tp)
    if prefill_threads < threads:
        # The wide forward borrows threads for work that pays for them; fewer would make every
        # forward that counts as wide (prefill, long decode) slower than a plain one.
        decode_source = "LIGHTLLM_TORCH_THREADS" if override else f"the default for {cores} CPUs and --tp {args.tp}"
        raise ArgumentError(f"LIGHTLLM_PREFILL_TORCH_THREADS={prefill_override} is below the {threads} threads of "
                            f"every forward ({decode_source}): the wide forwards' threads must be at least as many; "
                            "raise it or leave it unset")
    override_ms = wide_forward_ms_per_token_override()
    return threads, prefill_threads, DEFAULT_WIDE_FORWARD_MS_PER_TOKEN if override_ms is None else override_ms


def _slot_counts(args: argparse.Namespace) -> Tuple[int, int]:
    """Request records (waiting, running and streaming out, hence the factor) and top-logprob rows."""
    slot_num = max(64, 4 * args.running_max_req_size)
    top_slots = args.top_logprobs_slots
    if top_slots is not None and top_slots > slot_num:
        raise ArgumentError(
            f"--top_logprobs_slots {top_slots} exceeds the request slot count {slot_num} "
            f"(max(64, 4 x --running_max_req_size)); give at most {slot_num}"
        )
    return slot_num, min(slot_num, top_slots or args.running_max_req_size)
