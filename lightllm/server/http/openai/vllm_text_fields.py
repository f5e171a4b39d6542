"""vLLM request fields about the prompt and output text, and the vLLM fields that stay refused.

* ``spaces_between_special_tokens`` (vLLM's default true): transformers' slow tokenizers used to
  join special tokens with spaces unless told otherwise; fast tokenizers (the tokenizers library,
  and every tokenizer transformers 5 loads) decode without any such spaces and ignore the flag.
  The detokenizer decodes with the tokenizer's own ``decode``, so only ``true`` (what the fast
  tokenizers do, and what vLLM's fast-tokenizer path does whatever the flag) can be honoured;
  ``false`` would be silently ignored and is refused.
* ``echo`` on chat (vLLM's): the answer's content starts with the last message's content when
  that message has the role of the answer. Answers here always have the role ``assistant``
  (vLLM answers in the last message's role when ``add_generation_prompt`` is false), so echo
  repeats a last assistant message; the one case where vLLM would echo a message of another
  role is refused rather than answered differently.
* vLLM fields this server does not implement are accepted at vLLM's default value only
  (:data:`VLLM_DEFAULT_ONLY_FIELDS`): clients built on vLLM's request models send every field
  that has a default (``model_dump(exclude_none=True)``), and at their defaults these fields ask
  for nothing (``use_beam_search`` false, ``length_penalty`` 1, ``priority`` 0, ``bad_words`` [],
  ``allowed_token_ids`` null, ``include_reasoning`` true, ``return_weight_versions`` false,
  ``routed_experts_prompt_start`` 0, ``return_token_offsets`` false, ``mm_payload`` "tensors").
  Any other value of the field's type asks for what this server does not do and is refused
  saying why; a value of another type (``use_beam_search: 0``, ``include_reasoning: 1``) is a
  type error naming the field, as on every other field, not a "not supported".
  ``allowed_token_ids`` and ``bad_words`` need per-request sampling state in the model rank that
  this server does not have.
"""

from __future__ import annotations

import json
from typing import Any

from lightllm.server.http.errors import invalid_request

# The only role an answer has here (OpenAI's; vLLM's --response-role default).
RESPONSE_ROLE = "assistant"

# vLLM fields taken only at their default: field -> (the default, why another value is refused).
# A default of None: no value is accepted (null, or leaving the field out, is).
VLLM_DEFAULT_ONLY_FIELDS: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is not supported (sample with n or best_of instead)"),
    "length_penalty": (1.0, "length_penalty only weighs beams, and beam search is not supported"),
    "priority": (0, "per-request priority is not supported on the OpenAI endpoints (vLLM needs --scheduling-policy "
                    "priority for it); admission priority exists on the native "
                    "/generate and /generate_stream only: high_priority_request, for trusted clients (an "
                    "--admin_api_key holder, or anyone under --allow_public_priority)"),
    "allowed_token_ids": (None, "restricting sampling to a list of token ids needs per-request sampling state the "
                                "model rank does not keep (logit_bias can favour or ban up to 300 single tokens)"),
    "bad_words": ([], "banning words is not supported: it needs per-request sampling state the model rank does not "
                      "keep (logit_bias can ban up to 300 single tokens)"),
    "include_reasoning": (True, "leaving reasoning out is not supported: this server has no reasoning parser, so "
                                "the answer is never split into reasoning and content and has no reasoning to "
                                "leave out"),
    "return_weight_versions": (False, "weight versions are not reported: this server serves one set of weights "
                                      "and has no weight-version labels"),
    "routed_experts_prompt_start": (0, "it offsets the routed-expert data of a response, which this server does "
                                       "not return"),
    "return_token_offsets": (False, "token offsets are returned by vLLM's render endpoints only (ignored on "
                                    "completions there), which this server does not serve"),
    "mm_payload": ("tensors", "it shapes the multimodal features of vLLM's render endpoints (ignored on "
                              "completions there), which this server does not serve; prompts here are text"),
}


# The JSON type vLLM's request models give each of VLLM_DEFAULT_ONLY_FIELDS (a value of another
# type is a type error, whatever it would mean).
VLLM_DEFAULT_ONLY_TYPES: dict[str, str] = {
    "use_beam_search": "boolean", "length_penalty": "number", "priority": "integer",
    "allowed_token_ids": "list of integers", "bad_words": "list of strings", "include_reasoning": "boolean",
    "return_weight_versions": "boolean", "routed_experts_prompt_start": "integer", "return_token_offsets": "boolean",
    "mm_payload": "string",
}


def _is_integer(value: Any) -> bool:
    # An integral float is an integer, as on every integer field of the API (5.0 is 5); a bool is not.
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float)
                                                                        and value.is_integer())


def _type_error(kind: str, value: Any) -> str | None:
    """The type error of ``value`` for a field of JSON type ``kind`` (None when it has that type),
    worded as pydantic words those of the other fields."""
    if kind == "boolean":
        return None if isinstance(value, bool) else "Input should be a valid boolean"
    if kind == "integer":
        return None if _is_integer(value) else "Input should be a valid integer"
    if kind == "number":
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else \
            "Input should be a valid number"
    if kind == "string":
        return None if isinstance(value, str) else "Input should be a valid string"
    if not isinstance(value, list):
        return "Input should be a valid list"
    item_kind = kind.removeprefix("list of ").removesuffix("s")
    for index, item in enumerate(value):
        problem = _type_error(item_kind, item)
        if problem is not None:
            return f"item {index}: {problem}"
    return None


def check_vllm_default(field: str, value: Any) -> Any:
    """``value`` when it is vLLM's default for ``field`` (or null), else a 400: a type error for a
    value of another type than the field's, else saying why the value is not supported."""
    default, why = VLLM_DEFAULT_ONLY_FIELDS[field]
    problem = None if value is None else _type_error(VLLM_DEFAULT_ONLY_TYPES[field], value)
    if problem is not None:
        raise ValueError(problem)
    # A bool is an int to Python: false is not priority 0, nor 0 use_beam_search false.
    if value is None or (isinstance(value, bool) == isinstance(default, bool) and value == default):
        return list(default) if isinstance(default, list) else default
    if default is None:
        raise ValueError(f"{field} is not supported by this server: {why}; omit it or send null")
    raise ValueError(f"{field}: only {json.dumps(default)}, vLLM's default, is accepted: {why}")


def strict_bool(value: Any) -> Any:
    """``value`` unless it is neither a boolean nor null: for a field typed ``Literal[False]`` or ``Literal[True]``.

    pydantic matches a literal by equality, and ``0 == False`` in Python, so such a field would take
    ``0`` (or ``1``, ``1.0``) for the boolean, where every ``bool`` field refuses it.
    """
    if value is not None and not isinstance(value, bool):
        raise ValueError("Input should be a valid boolean")
    return value


def check_spaces_between_special_tokens(value: Any) -> Any:
    """``value`` unless it is ``false``, which the detokenizer cannot honour (400 naming the field)."""
    if value is False:
        raise ValueError("spaces_between_special_tokens: false is not supported: output is decoded by the model's "
                         "fast tokenizer, which puts no spaces between special tokens and ignores this flag (as "
                         "vLLM's fast-tokenizer detokenizer does); send true or omit it")
    return strict_bool(value)


def check_chat_echo(echo: bool, add_generation_prompt: bool, last_role: str) -> None:
    """Refuse ``echo`` where vLLM would echo a message of another role than the answer's here.

    With ``add_generation_prompt`` false vLLM answers in the last message's role and echoes that
    message whatever its role; this server always answers as the assistant, so a non-assistant
    last message would be echoed by vLLM and not here.
    """
    if echo and not add_generation_prompt and last_role != RESPONSE_ROLE:
        raise invalid_request(f"echo with add_generation_prompt false and a last message from {last_role!r}: vLLM "
                              f"would answer in that role and repeat that message; this server always answers as "
                              f"the assistant, so end with an assistant message (or drop echo)", "echo")


def chat_echo_text(last_role: str, last_text: str) -> str:
    """The text ``echo`` prepends: the last message's text when it is the answer's role, else ``""``."""
    return last_text if last_role == RESPONSE_ROLE else ""
