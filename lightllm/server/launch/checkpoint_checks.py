"""Flags checked against the checkpoint: what only reading its config shows to be dead or impossible.

Run after the checkpoint is read and the context length resolved (the launcher's planning, the
PD master's served model), before any process starts; every refusal is one line naming the flags.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Optional

from lightllm.common.basemodel.attention.cpp_kernel_support import cpp_kernel_problem
from lightllm.common.basemodel.linear_backend_fit import onednn_refusal, onednn_setting_problem
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.flag_combinations import PREFIX_CACHE_STRATEGY

if TYPE_CHECKING:
    from lightllm.server.request_defaults import RequestDefaults


def check_args_against_checkpoint(args: argparse.Namespace, model_config: ModelConfig, max_req_total_len: int) -> None:
    """Raise :class:`ArgumentError` for flags the checkpoint makes useless or impossible.

    ``max_req_total_len``: the resolved context limit (``--max_req_total_len`` or the checkpoint's).
    """
    # A length-dependent RoPE (dynamic NTK) turns the prefix cache off (plan.prefix_cache_enabled),
    # so lpm would find no hits and order exactly as default.
    if args.prefill_queue_strategy == PREFIX_CACHE_STRATEGY and model_config.rope.length_dependent:
        raise ArgumentError("--prefill_queue_strategy lpm orders by prefix-cache hits, but this checkpoint's RoPE "
                            "scales with each request's length (dynamic NTK), so the prefix cache is off and lpm "
                            "would order as default; give another strategy")
    default_new = args.max_new_tokens_default
    if default_new is not None and default_new >= max_req_total_len:
        # Every prompt has at least one token, so a request without max_tokens would always be cut
        # to what its prompt leaves, never get this many.
        raise ArgumentError(f"--max_new_tokens_default {default_new} leaves no room for a prompt within the "
                            f"{max_req_total_len}-token context (--max_req_total_len, prompt + generated tokens; "
                            f"default: the checkpoint's); give at most {max_req_total_len - 1}")


def generation_default_beyond_context(request_defaults: "RequestDefaults", max_new_tokens_default: Optional[int],
                                      max_req_total_len: int) -> Optional[str]:
    """A warning line when the generation config's ``max_new_tokens`` cannot fit the context, or None.

    Not refused, as ``--max_new_tokens_default`` is: a checkpoint's own file often names its full
    trained length while ``--max_req_total_len`` serves less, and the default is cut to the room a
    prompt leaves either way; the operator hears that it is.
    """
    generation = request_defaults.generation
    if max_new_tokens_default is not None or generation.max_new_tokens is None:
        return None
    if generation.max_new_tokens < max_req_total_len:
        return None
    return (f"{generation.source}: max_new_tokens {generation.max_new_tokens} does not fit the "
            f"{max_req_total_len}-token context (--max_req_total_len); a request without max_tokens gets what its "
            f"prompt leaves (pass --max_new_tokens_default to choose another default)")


def check_attention_backend_fits(args: argparse.Namespace, model_config: ModelConfig, dtype_name: str) -> None:
    """Refuse ``--attention_backend cpp`` named for a model its kernel has no variant for.

    Before any process starts, not after every rank loaded its weights; ``auto`` runs such a model
    on torch's path instead, so only the named backend is refused (the rank checks again against
    the built library).
    """
    if args.attention_backend != "cpp":
        return
    problem = cpp_kernel_problem(model_config.num_attention_heads, model_config.num_key_value_heads,
                                 model_config.head_dim, args.tp, dtype_name)
    if problem is not None:
        raise ArgumentError(problem)


def check_linear_backend_fits(args: argparse.Namespace, device: str, dtype_name: str) -> None:
    """Refuse ``--linear_backend onednn`` on a device or dtype oneDNN projections never take.

    Before any process starts; the rank checks again what needs torch (the build's oneDNN).
    ``auto`` takes torch's projections there instead, so only the named backend is refused.
    """
    if args.linear_backend != "onednn":
        return
    problem = onednn_setting_problem(device, dtype_name)
    if problem is not None:
        raise ArgumentError(onednn_refusal(problem))
