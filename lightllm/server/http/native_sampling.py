"""A native body's ``parameters`` as checked SamplingParams: the one path by which ``/generate``,
``/generate_stream`` and ``/tokens`` check them, so the three refuse the same parameters alike."""

from __future__ import annotations

from typing import Any

from lightllm.common.sampling.sampling_params import SamplingParams
from lightllm.server.http.generation.planning import build_sampling_params
from lightllm.server.http.native_models import NativeParameters
from lightllm.server.http.openai.grammar_thread import on_grammar_thread
from lightllm.server.http.structured.structured_params import NATIVE_CONSTRAINTS, usable_grammar

# LightLLM's default for a /generate request without max_new_tokens.
NATIVE_DEFAULT_MAX_NEW_TOKENS = 16

# SamplingParams' field -> the request's name for it, in refusals.
NATIVE_NAMES = {name: f"parameters.{name}" for name in (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
    "max_new_tokens", "min_new_tokens", "stop_token_ids", "ignore_eos", "do_sample", "logprobs", "stop_sequences")}


async def native_sampling_params(manager: Any, parameters: NativeParameters, max_new_tokens: int,
                                 request: Any = None) -> SamplingParams:
    """``parameters`` over the checkpoint's defaults, with ``max_new_tokens`` resolved by the caller, checked
    (a 400 naming ``parameters.<field>``); ``manager``: a RequestManager, ``request``: the client's connection.

    A constraint's grammar is compiled and checked against the model on the grammar thread (it can
    take seconds); without one everything runs here.
    """
    def compiled_fields() -> dict:
        fields = parameters.sampling_fields(manager.served.generation_defaults)
        asked = [name for name in NATIVE_CONSTRAINTS if getattr(parameters, name) is not None]
        if asked:
            usable_grammar(manager, fields["grammar"], f"parameters.{asked[0]}")
        return fields

    constrained = any(getattr(parameters, name) is not None for name in NATIVE_CONSTRAINTS)
    fields = await on_grammar_thread(compiled_fields, request) if constrained else compiled_fields()
    return build_sampling_params({**fields, "max_new_tokens": max_new_tokens}, manager.served.vocab_size, NATIVE_NAMES)
