"""The forms of a completion prompt: text, token ids, or a list of either.

Shared by ``/v1/completions`` (``prompt``) and the native endpoints (``inputs``, one prompt), so
both take the same token ids and name a bad one the same way.
"""

from __future__ import annotations

import json
from typing import Any

from lightllm.server.http.validation.base_models import integral
from lightllm.server.http.validation.body import json_type_name

MAX_PROMPTS = 64
TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


def integral_token_ids(value: Any) -> Any:
    """A prompt with integral floats in its token-id lists made ints, as every integer field takes them.

    Shared with the native ``inputs`` (:mod:`lightllm.server.http.native_models`), so both endpoints
    take the same token ids.
    """
    if not isinstance(value, list):
        return value
    return [[integral(item) for item in entry] if isinstance(entry, list) else integral(entry) for entry in value]


def is_token_id(value: Any) -> bool:
    """Whether ``value`` has a token id's type (an int, not a bool); the vocabulary is checked with the model."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_list(value: Any) -> bool:
    """Whether ``value`` is a list of token ids (an empty one included: callers name that refusal)."""
    return isinstance(value, list) and all(is_token_id(item) for item in value)


def shown_json_value(value: Any) -> str:
    """A refused JSON value for an error message: a scalar as written, a container or text by its type."""
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)
    return {"string": "a string", "array": "an array", "object": "an object"}.get(json_type_name(value), "null")


def _first_bad_token_id(value: list[Any]) -> str | None:
    """Where a token-id prompt (a list of ids, or of such lists) holds something else, e.g.
    ``"item 1 is true"``; None when ``value`` is not shaped as one."""
    if all(not isinstance(item, (list, str)) for item in value):
        index = next(index for index, item in enumerate(value) if not is_token_id(item))
        return f"item {index} is {shown_json_value(value[index])}"
    if all(isinstance(item, list) for item in value):
        for outer, ids in enumerate(value):
            bad = next((index for index, item in enumerate(ids) if not is_token_id(item)), None)
            if bad is not None:
                return f"prompt {outer} item {bad} is {shown_json_value(ids[bad])}"
    return None


def normalize_completion_prompt(value: Any) -> list[str | list[int]]:
    """Turn every accepted ``prompt`` form into a non-empty list of non-empty prompts."""
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif is_token_list(value) and value:
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(is_token_list(item) for item in value):
        prompts = list(value)
    elif isinstance(value, list) and not value:
        raise ValueError("prompt must not be empty")
    else:
        # A long id list is hard to search by eye: say which item is not an id, as /generate does.
        where = _first_bad_token_id(value) if isinstance(value, list) else None
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of such lists"
                         + (f"; {where}" if where else ""))
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"prompt holds at most {MAX_PROMPTS} prompts, got {len(prompts)}")
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("prompt must not be empty")
    return prompts
