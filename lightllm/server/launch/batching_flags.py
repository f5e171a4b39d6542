"""The flags of memory and batching: the KV cache's size, the running batch, the step budget, admission
and the prefill queue's order.

A part of the one argument parser (:mod:`lightllm.server.launch.arg_parser`), kept apart as
:mod:`.http_flags` and :mod:`.pd_flags` are, to keep that module readable.
"""

from __future__ import annotations

import argparse

from lightllm.server.launch.flag_roles import (
    ADMISSION,
    EVERY_ROLE,
    MIXED_BATCHES,
    MODEL_ROLES,
    PREFILL_QUEUE,
    PREFILL_STEP,
    add_flag,
)
from lightllm.server.launch.flag_bounds import (
    MAX_RESERVED_MEMORY_GB,
    MAX_ROUTER_MAX_WAIT_TOKENS,
    MAX_ROUTER_TOKEN_RATIO,
    MAX_SCHEDULE_TIME_INTERVAL,
    MIN_SCHEDULE_TIME_INTERVAL,
    as_written,
)
# Imported at the top: the scheduling core needs no torch or triton (test_torch_free_processes
# imports it with torch refused), so `--help` needs nothing optional.
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import (
    DEFAULT_PREFILL_QUEUE_STRATEGY,
    available_strategy_names,
)
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import (
    DEFAULT_PREFILL_MAX_OVERTAKE_TOKENS,
    DEFAULT_PREFILL_OVERTAKE_FRACTION,
    MAX_PREFILL_OVERTAKE_FRACTION,
    MAX_PREFILL_OVERTAKE_TOKENS,
)
from lightllm.server.router.req_queue.base_queue import DEFAULT_ROUTER_MAX_WAIT_TOKENS
from lightllm.utils.one_line_errors import finite_float


def add_batching_flags(parser: argparse.ArgumentParser) -> None:
    """Add the "memory and batching" group to ``parser``."""
    group = parser.add_argument_group("memory and batching")
    add_flag(
        group, "--max_total_token_num", roles=MODEL_ROLES,
        type=int,
        default=None,
        help="KV-cache capacity in tokens; default: --mem_fraction of (available memory - weights - --reserved_memory_gb) "
        "(on CPU split across ranks and capped at 262144); see docs memory.md. Given, it fixes the size: --mem_fraction "
        "and --reserved_memory_gb, which size it from memory, are refused with it.",
    )
    add_flag(
        group, "--mem_fraction", roles=MODEL_ROLES,
        type=finite_float,
        default=0.9,
        help="Share of the memory left after the weights and --reserved_memory_gb that the KV cache takes when sizing it; "
        "refused with --max_total_token_num, which fixes the size.",
    )
    add_flag(
        group, "--reserved_memory_gb", roles=MODEL_ROLES,
        type=finite_float,
        default=None,
        help="GiB of available memory (GPU: per device) kept out of the KV cache for activations, the server's other "
        "processes and the rest of the machine; default: an estimate from the model and batch sizes (see docs memory.md). "
        f"Refused with --max_total_token_num, which fixes the size. At most {as_written(MAX_RESERVED_MEMORY_GB)}.",
    )
    add_flag(group, "--running_max_req_size", roles=MODEL_ROLES, type=int, default=256, help="Most requests in the running batch at once. With mixed batches (a normal server's default) at most --batch_max_tokens: each decoding request takes one token of a step's budget.")
    add_flag(group, "--max_req_total_len", roles=EVERY_ROLE, type=int, default=None, help="Most prompt + generated tokens per request; default: the model's context as vLLM derives max_model_len: max_position_embeddings, times the factor of linear and dynamic RoPE scaling (not llama3's), at most a sliding window. A larger value is served with a warning (vLLM refuses it); beyond a sliding window it is refused.")
    add_flag(
        group, "--top_logprobs_slots", roles=MODEL_ROLES,
        type=int,
        default=None,
        help="Requests asking for top logprobs (logprobs or prompt_logprobs above 0) that may be in flight at once; "
        "each holds a shared-memory row of 160 bytes per token of --max_req_total_len, and one more waits as for a "
        "request slot (--slot_wait_seconds), then gets 503 server_busy. Requests without top logprobs never wait "
        "for these. Default: --running_max_req_size; more than the request slot count, max(64, 4 x --running_max_req_size), "
        "is refused.",
    )
    add_flag(group, "--batch_max_tokens", roles=PREFILL_STEP, type=int, default=None, help="Most prefill tokens in one forward, at most the KV cache's tokens (with mixed batches at most the larger of that and --running_max_req_size, since decode rows take budget tokens); default: max(--chunked_prefill_size, 2048), or with --disable_chunked_prefill max(--max_req_total_len, 2048) so a whole prompt fits; a default above the KV cache's tokens is cut to them, though not below --running_max_req_size with mixed batches nor below a --chunked_prefill_size you give. Refused on a PD decode node (it never prefills).")
    add_flag(group, "--chunked_prefill_size", roles=PREFILL_STEP, type=int, default=1024, help="Most prefill tokens one request computes per step; default 1024, or --batch_max_tokens when that is smaller. Refused on a PD decode node (it never prefills).")
    add_flag(group, "--disable_chunked_prefill", roles=PREFILL_STEP, action="store_true", help="Prefill every prompt in one piece. Refused on a PD decode node (it never prefills).")
    add_flag(
        group, "--disable_mixed_batches", roles=MIXED_BATCHES,
        action="store_true",
        help="Run a step's prefill chunks and decode rows as two forwards. By default (with chunked prefill) they run as "
        "one mixed forward, whose token budget and processed-token count include the decode rows. Refused with "
        "--disable_chunked_prefill, which runs no mixed batches, and on PD nodes (a prefill node never decodes, a decode "
        "node never prefills).",
    )
    add_flag(
        group, "--router_token_ratio", roles=ADMISSION,
        type=finite_float,
        default=1.0,
        help="Admission admits requests while projected KV use (held + expected tokens) stays under this share of capacity; "
        "above 1 it overcommits and pauses requests when the KV cache runs out (a paused request gives its KV back and "
        "computes it again when it resumes, which it does once a finished request freed room: a burst that overflows the "
        "cache at 2 computed about 2-5x its prompt tokens, with or without the prefix cache). "
        f"At most {as_written(MAX_ROUTER_TOKEN_RATIO)}. Not LightLLM's busy threshold of the same "
        "name (whose default 0.0 is refused here). Refused on a PD decode node (its router admits every arrival at once).",
    )
    add_flag(
        group, "--router_max_wait_tokens", roles=ADMISSION,
        type=int,
        default=DEFAULT_ROUTER_MAX_WAIT_TOKENS,
        help="Decode steps the router lets pass between two admission rounds while requests run "
        f"(0 to {MAX_ROUTER_MAX_WAIT_TOKENS}: a new "
        "request waits up to that many steps to join a running batch). Refused on a PD decode node (its router admits every "
        "arrival at once).",
    )
    add_flag(group, "--disable_dynamic_prompt_cache", roles=MODEL_ROLES, action="store_true", help="Turn off the radix prefix cache (refused with --prefill_queue_strategy lpm, which orders by its hits). "
                       "A checkpoint whose RoPE scales with the request's length (dynamic NTK) runs without it anyway.")
    add_flag(group, "--schedule_time_interval", roles=ADMISSION, type=finite_float, default=0.03, help="Seconds between router admission rounds, "
            f"{as_written(MIN_SCHEDULE_TIME_INTERVAL)} to {as_written(MAX_SCHEDULE_TIME_INTERVAL)}: "
            "a request that arrives between two rank "
            "steps may wait up to one round before it is admitted. Refused on a PD decode node (its router admits every "
            "arrival at once).")
    add_flag(
        group, "--prefill_queue_strategy", roles=PREFILL_QUEUE,
        type=str,
        choices=available_strategy_names(),
        default=DEFAULT_PREFILL_QUEUE_STRATEGY,
        help="Order of the prefill queue each step: default (FCFS by inference priority), promote_shortest, hrrn, "
        "lpm (most prefix-cached prompt tokens first; refused when the prefix cache is off: --disable_dynamic_prompt_cache "
        "or a dynamic-NTK checkpoint), shortest_within_slack (shortest first while every "
        "overtaken request stays within a slack of its FCFS wait); all run under the overtaking bound "
        "(--prefill_max_overtake_tokens, --prefill_overtake_fraction).",
    )
    add_flag(
        group, "--prefill_max_overtake_tokens", roles=PREFILL_QUEUE,
        type=int,
        default=DEFAULT_PREFILL_MAX_OVERTAKE_TOKENS,
        help="Overtaking bound of every prefill-queue strategy: a request may be overtaken by at most this many "
        "prefill tokens of work that default's order puts behind it, plus --prefill_overtake_fraction times its FCFS "
        "wait (the prefill work ahead of it when it arrived); then it is served before all such work. The step "
        "that reaches the allowance, and the planner filling a step's budget that the head's next chunk leaves "
        "(which default does too), can add to that: prefill_queue_strategy.md gives the whole formula, and how to "
        "choose the value. "
        f"At most {MAX_PREFILL_OVERTAKE_TOKENS:,} (months of prefill work; for no bound use "
        "--disable_prefill_overtake_bound, with which this flag is refused).",
    )
    add_flag(
        group, "--prefill_overtake_fraction", roles=PREFILL_QUEUE,
        type=finite_float,
        default=DEFAULT_PREFILL_OVERTAKE_FRACTION,
        help="Share of a request's FCFS wait that later work may add to it on top of --prefill_max_overtake_tokens; "
        f"at most {MAX_PREFILL_OVERTAKE_FRACTION:g} (beyond, it limits nothing; for no bound use "
        "--disable_prefill_overtake_bound, with which this flag is refused).",
    )
    add_flag(
        group, "--disable_prefill_overtake_bound", roles=PREFILL_QUEUE,
        action="store_true",
        help="Let prefill-queue strategies overtake without limit (the seed's unbounded behaviour); refused with "
        "--prefill_max_overtake_tokens or --prefill_overtake_fraction, whose bound it turns off.",
    )
    add_flag(
        group,
        "--prefill_max_wait_tokens",
        # Replaced, and refused wherever given (validate_args); declared as the node flag it was.
        roles=MODEL_ROLES,
        type=int,
        default=None,
        help=argparse.SUPPRESS,
    )
