"""From a validated request body to generation jobs: the checks that need the served model.

Shared by the native and the OpenAI endpoints: tokenizing a prompt (400 when it is refused or
empty), building :class:`~lightllm.common.sampling.SamplingParams` with errors under the client's
field names, the vocabulary and context-length checks, and one :class:`ChoiceJob` per choice.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Awaitable, Mapping

from lightllm.common.sampling import SamplingParamError, SamplingParams
from lightllm.common.sampling.sampling_params import MAX_SEED
from lightllm.server.http.errors import INVALID_REQUEST, APIError, invalid_request, manager_error
from lightllm.server.manager_errors import ServerChatTemplateError
from lightllm.server.http.generation.fanout import ChoiceJob

_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


async def encoded(pending: Awaitable[list[int]], param: str, vocab_size: int | None = None,
                  noun: str | None = None) -> list[int]:
    """Await a :class:`~lightllm.server.http.generation.prompt_encoding.PromptEncoder` call for ``param``.

    A prompt the tokenizer refuses (``ValueError``), one with no tokens, and one holding a token
    beyond the model's ``vocab_size`` (a tokenizer with more tokens than the model reads) are 400s
    naming ``param`` (messages name ``noun``, default ``param``: ``prompt 3`` of several).
    """
    noun = noun or param
    try:
        ids = await pending
    except (ValueError, ServerChatTemplateError) as exc:
        raise manager_error(exc, param) from None
    if not ids:
        raise APIError(400, f"{noun} is empty after tokenization", param=param)
    if vocab_size is not None:
        beyond = first_outside_vocabulary(ids, vocab_size)
        if beyond is not None:
            raise invalid_request(f"{noun} holds a token the model cannot read: the tokenizer gave id {beyond}, "
                                  f"beyond the model's vocabulary [0, {vocab_size})", param)
    return ids


def prompt_noun(param: str, index: int, count: int) -> str:
    """How error messages name prompt ``index`` (from 0, as in the JSON list) of ``count``."""
    return f"{param} {index}" if count > 1 else param


def build_sampling_params(
    values: Mapping[str, Any], vocab_size: int, public_names: Mapping[str, str] | None = None
) -> SamplingParams:
    """Build validated SamplingParams, reporting errors under the client's field names.

    ``public_names`` maps SamplingParams field names to the request's own names (for
    example ``max_new_tokens`` -> ``max_tokens``), both in ``param`` and in the message.
    """
    names = dict(public_names or {})
    _check_logit_bias_ids(values.get("logit_bias"), vocab_size, names.get("logit_bias", "logit_bias"))
    try:
        params = SamplingParams(**values)
        params.validate(vocab_size)
    except SamplingParamError as exc:
        message = str(exc)
        first_word = message.split(" ", 1)[0]
        field = first_word if first_word in _SAMPLING_FIELDS else None
        for internal, public in names.items():
            message = re.sub(rf"\b{internal}\b", public, message)
        raise invalid_request(message, names.get(field, field) if field else None) from None
    if params.grammar is not None and params.ignore_eos:
        raise invalid_request("ignore_eos cannot be combined with structured output: the grammar decides where the "
                              "output ends (with an end-of-sequence token)", names.get("ignore_eos", "ignore_eos"))
    return params


def _check_logit_bias_ids(logit_bias: Any, vocab_size: int, param: str) -> None:
    """Refuse a ``logit_bias`` id outside ``[0, vocab_size)`` with one message, whatever the id.

    Checked before SamplingParams is built: built without the vocabulary, it refused -1 as "outside
    the vocabulary >= 0" and 2^31 and above by their 32-bit storage, naming no parameter.  Keys that
    are not integers are left to SamplingParams, which says so.
    """
    if not isinstance(logit_bias, dict):
        return
    ids = [key for key in logit_bias if isinstance(key, int) and not isinstance(key, bool)]
    outside = first_outside_vocabulary(ids, vocab_size)
    if outside is not None:
        raise invalid_request(f"{param} token id {outside} is outside the vocabulary [0, {vocab_size})", param)


def first_outside_vocabulary(token_ids: list[int], vocab_size: int) -> int | None:
    """The first id outside ``[0, vocab_size)``, or None."""
    return next((token_id for token_id in token_ids if not 0 <= token_id < vocab_size), None)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str, noun: str | None = None) -> None:
    """Reject token ids outside ``[0, vocab_size)`` (``noun``: which prompt of several, named first)."""
    token_id = first_outside_vocabulary(token_ids, vocab_size)
    if token_id is not None:
        where = f"{noun}: " if noun and noun != param else ""
        raise invalid_request(f"{where}token id {token_id} is outside the vocabulary [0, {vocab_size})", param)


def check_context_length(
    prompt_len: int, max_new_tokens: int, limit: int, *, prompt_param: str, prompt_noun: str, tokens_param: str
) -> None:
    """Reject a request whose prompt plus completion would exceed ``limit`` tokens."""
    total = prompt_len + max_new_tokens
    if total <= limit:
        return
    message = (
        f"This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
        f"({prompt_len} in the {prompt_noun}, {max_new_tokens} in the completion). "
        f"Please reduce the length of the {prompt_noun} or completion."
    )
    param = prompt_param if prompt_len >= limit else tokens_param
    raise APIError(400, message, INVALID_REQUEST, param, "context_length_exceeded")


def check_generation_count(prompts: int, candidates: int, limit: int | None, candidates_param: str,
                           what: str = "request slots", whose: str = "the server's") -> None:
    """Refuse a request of more generations (``prompts`` x ``candidates``) than one request may run
    (``limit``: half of ``whose`` ``what``, at least 1; None: no limit of the manager's own).  The error names
    the prompt count when one prompt per generation is already too many, else ``candidates_param``."""
    if limit is None or prompts * candidates <= limit:
        return
    param = "prompt" if prompts > limit else candidates_param
    if prompts == 1:  # chat, /generate, or one completion prompt: only the candidates can change
        asked, fix = f"{candidates_param} {candidates}", f"use a smaller {candidates_param}"
    else:
        asked = f"{prompts} prompts x {candidates_param} {candidates}"
        fix = "send fewer prompts per request" + ("" if param == "prompt" else f" or a smaller {candidates_param}")
    raise APIError(400, f"this request asks for {prompts * candidates} generations ({asked}); one request may run "
                   f"at most {limit} (half of {whose} {what}, at least 1), so that it leaves room for other "
                   f"clients: {fix}", INVALID_REQUEST, param)


def check_generation_counts(manager: Any, prompts: int, candidates: int, candidates_param: str,
                            wants_top: bool) -> None:
    """Both caps of one request (every endpoint): its generations hold request slots, and, when it asks
    for top logprobs (``wants_top``), top-logprob rows too (``manager``: a RequestManager)."""
    whose = manager.generation_caps_source
    check_generation_count(prompts, candidates, manager.max_generations_per_request, candidates_param,
                           whose=whose)
    if wants_top:
        check_generation_count(prompts, candidates, manager.max_top_logprob_generations_per_request, candidates_param,
                               "top-logprob rows (--top_logprobs_slots)", whose)


def check_prompt_leaves_room(prompt_len: int, limit: int, *, prompt_param: str, prompt_noun: str) -> None:
    """Refuse a prompt that fills the whole context: no completion length can fit beside it."""
    if prompt_len >= limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, the {prompt_noun} "
                       f"hold{'' if prompt_noun == 'messages' else 's'} {prompt_len} tokens, which leaves no room for "
                       f"a completion. Please reduce the length of the {prompt_noun}.", INVALID_REQUEST,
                       prompt_param, "context_length_exceeded")


def completion_room(
    prompt_len: int, max_new_tokens: int, limit: int, *, prompt_param: str, prompt_noun: str, tokens_param: str,
    min_new_tokens: int = 0,
) -> int:
    """The completion length an OpenAI request gets: ``max_new_tokens``, cut to the room the prompt leaves.

    As in vLLM (0.34), a ``max_tokens`` that does not fit beside the prompt is an upper bound
    cut to ``limit - prompt_len`` (the answer then ends with ``length``); refused are a prompt
    that leaves no room, a ``max_tokens`` above the whole context, and a ``min_tokens`` the room
    cannot hold.  The native ``/generate`` keeps LightLLM's rule (:func:`check_context_length`).
    """
    # A smaller max_tokens cannot help a prompt that fills the context: say so, whatever was asked.
    check_prompt_leaves_room(prompt_len, limit, prompt_param=prompt_param, prompt_noun=prompt_noun)
    if max_new_tokens > limit:
        # Shortening the prompt cannot help here: say what can (the OpenAI wording's prefix kept,
        # which clients match to recognise a context error).
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{max_new_tokens} completion tokens ({tokens_param}), more than the whole context. Please "
                       f"reduce {tokens_param}.", INVALID_REQUEST, tokens_param, "context_length_exceeded")
    check_min_tokens_fit(prompt_len, min_new_tokens, limit, prompt_noun=prompt_noun, min_param="min_tokens")
    return min(max_new_tokens, limit - prompt_len)


def default_length_for(default_max_new: int, min_new_tokens: int, prompt_len: int, limit: int) -> tuple[int, bool]:
    """``(max_new_tokens, beyond_room)`` for a request that gave no maximum.

    The default length is cut to the room the prompt leaves; a minimum above that cut is then
    the room's problem (:func:`check_min_tokens_fit`, after the fields' own checks), not a
    "must be <= max_tokens" about a maximum the client never sent: the minimum stands in for it.
    """
    if min_new_tokens > default_max_new == limit - prompt_len:
        return min_new_tokens, True
    return default_max_new, False


def check_min_tokens_fit(prompt_len: int, min_new_tokens: int, limit: int, *, prompt_noun: str, min_param: str
                         ) -> None:
    """Refuse a minimum completion length the room beside the prompt cannot hold, naming ``min_param``.

    Also where the client sent no maximum: the default length is cut to the room, and "must be
    <= max_tokens (14)" would name a maximum the client never sent.
    """
    room = limit - prompt_len
    # A prompt that fills the context gets its own refusal (check_prompt_leaves_room), whatever the minimum.
    if 0 < room < min_new_tokens:
        raise APIError(400, f"This model's maximum context length is {limit} tokens and the {prompt_noun} holds "
                       f"{prompt_len}, which leaves room for {room} completion tokens, fewer than {min_param} "
                       f"({min_new_tokens}). Please reduce the length of the {prompt_noun} or {min_param}.",
                       INVALID_REQUEST, min_param, "context_length_exceeded")


def choice_jobs(prompt_index: int, prompt_ids: list[int], params: SamplingParams, candidates: int) -> list[ChoiceJob]:
    """The ``candidates`` generations of one prompt, indexed ``prompt_index * candidates + choice``."""
    jobs = []
    for choice in range(candidates):
        # Offsetting the seed keeps a seeded request reproducible while its choices still
        # differ from one another.
        choice_params = params if params.seed is None or choice == 0 else replace(
            params, seed=(params.seed + choice) % (MAX_SEED + 1))
        jobs.append(ChoiceJob(prompt_index * candidates + choice, prompt_index, prompt_ids, choice_params))
    return jobs
