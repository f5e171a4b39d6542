"""Checks of what a library caller hands :class:`~lightllm.common.basemodel.batch_generator.BatchGenerator`.

The generator reserves request rows and KV slots as it goes; a bad argument found after that
(a torch error from the embedding, a bound hit in the row table) used to leave them taken and the
generator short of them for good.  So every argument is checked here, in Python and naming the
argument, before anything is reserved.
"""

from __future__ import annotations

import operator
from typing import Any, List, Optional


def integer(name: str, value: Any) -> int:
    """``value`` as an int (a bool or a float is refused, not truncated; numpy integers are ints)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def count(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int of at least ``minimum``."""
    number = integer(name, value)
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {number}")
    return number


def _is_ordered_collection(value: Any) -> bool:
    """A list, tuple, numpy array or 1-D tensor: sized, iterable, ordered, and not text."""
    if isinstance(value, (str, bytes, dict, set, frozenset)):
        return False
    return hasattr(value, "__len__") and hasattr(value, "__iter__")


def token_list(name: str, value: Any, vocab_size: int, max_length: int) -> List[int]:
    """``value`` as a non-empty list of token ids in ``[0, vocab_size)``, at most ``max_length`` long."""
    if not _is_ordered_collection(value):
        raise TypeError(f"{name} must be a list of token ids, got {type(value).__name__}")
    if len(value) == 0:
        raise ValueError(f"{name} is empty: a sequence needs at least one token")
    if len(value) > max_length:
        raise ValueError(f"{name} holds {len(value)} tokens, more than max_sequence_length {max_length}")
    ids: List[int] = []
    for index, token in enumerate(value):
        token_id = integer(f"{name}[{index}]", token)
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"{name}[{index}] is {token_id}, outside the vocabulary [0, {vocab_size})")
        ids.append(token_id)
    return ids


def prompt_lists(prompts: Any, vocab_size: int, max_length: int, max_new_tokens: int) -> List[List[int]]:
    """Every prompt checked, with room for ``max_new_tokens`` after it within ``max_length``."""
    if not _is_ordered_collection(prompts):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    checked: List[List[int]] = []
    for index, prompt in enumerate(prompts):
        ids = token_list(f"prompts[{index}]", prompt, vocab_size, max_length)
        if len(ids) + max_new_tokens > max_length:
            raise ValueError(f"prompts[{index}] holds {len(ids)} tokens; with max_new_tokens {max_new_tokens} that "
                             f"is {len(ids) + max_new_tokens}, more than max_sequence_length {max_length}")
        checked.append(ids)
    return checked


def stop_set(stop_token_ids: Optional[Any], vocab_size: int) -> frozenset[int]:
    """``stop_token_ids`` as a set of ids in the vocabulary (None: no stop, every prompt runs to the end)."""
    if stop_token_ids is None:
        return frozenset()
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
        raise TypeError(f"stop_token_ids must be a collection of token ids, got {type(stop_token_ids).__name__}")
    ids = set()
    for token in stop_token_ids:
        token_id = integer("stop_token_ids entries", token)
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"stop_token_ids holds {token_id}, outside the vocabulary [0, {vocab_size})")
        ids.add(token_id)
    return frozenset(ids)
