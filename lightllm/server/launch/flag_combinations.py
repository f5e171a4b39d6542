"""Flags that would do nothing next to another flag: the combination is refused, never ignored.

Each check below names both flags and why the first is dead, so the user learns which one to
drop. Checks that need the checkpoint (the prefix cache under a length-dependent RoPE, a default
max_new_tokens against the context) are in :mod:`lightllm.server.launch.checkpoint_checks`.
"""

from __future__ import annotations

import argparse
from typing import List

from lightllm.server.argument_error import ArgumentError
from lightllm.server.run_mode import RunMode
from lightllm.server.launch.arg_parser import flags_given

# The strategy that orders by prefix-cache hits: without a prefix cache every request has none,
# so it orders exactly as `default`.
PREFIX_CACHE_STRATEGY = "lpm"


def check_flag_combinations(args: argparse.Namespace) -> None:
    """Raise :class:`ArgumentError` (one line naming both flags) when one flag cancels another."""
    if args.disable_prefill_overtake_bound:
        _refuse_given(args, ["prefill_max_overtake_tokens", "prefill_overtake_fraction"], "set",
                      "the overtaking bound, which --disable_prefill_overtake_bound turns off",
                      "--disable_prefill_overtake_bound")
    if args.prefill_queue_strategy == PREFIX_CACHE_STRATEGY and args.disable_dynamic_prompt_cache:
        raise ArgumentError("--prefill_queue_strategy lpm orders by prefix-cache hits, which "
                            "--disable_dynamic_prompt_cache turns off (lpm would order as default); give one of them")
    if args.disable_mixed_batches and args.disable_chunked_prefill:
        raise ArgumentError("--disable_mixed_batches does nothing with --disable_chunked_prefill (mixed batches need "
                            "chunked prefill, so none are run); give one of them")
    if args.tp == 1 and args.run_mode != RunMode.PD_MASTER:
        # One rank opens no torch.distributed group, so nothing would listen at the rendezvous (a
        # PD master has no ranks at all: the role check names these flags for it).
        given = flags_given(args, ["nccl_host", "nccl_port"])
        if given:
            one = len(given) == 1
            raise ArgumentError(f"{', '.join('--' + name for name in given)} set{'s' if one else ''} the torch.distributed "
                                "rendezvous of tensor-parallel ranks, which one rank (--tp 1) never opens; give "
                                f"{'it' if one else 'them'} with --tp 2 or more, or leave {'it' if one else 'them'} out")
    if args.max_total_token_num is not None:
        # Both only size the KV cache from the memory left; a fixed size leaves them nothing to do.
        _refuse_given(args, ["mem_fraction", "reserved_memory_gb"], "size",
                      "the KV cache from the free memory, which --max_total_token_num fixes instead",
                      "--max_total_token_num")


def _refuse_given(args: argparse.Namespace, names: List[str], verb: str, what: str, other: str) -> None:
    """Refuse the flags of ``names`` that were typed: "--a, --b <verb> <what>; give them or <other>"."""
    given = flags_given(args, names)
    if given:
        one = len(given) == 1
        raise ArgumentError(f"{', '.join('--' + name for name in given)} {verb}{'s' if one else ''} {what}; give "
                            f"{'it' if one else 'them'} or {other}")
