"""Checks of what a library caller hands :class:`~lightllm.common.basemodel.batch_generator.BatchGenerator`.

The generator reserves request rows and KV slots as it goes; a bad argument found after that
(a torch error from the embedding, a bound hit in the row table) used to leave them taken and the
generator short of them for good.  So every argument is checked here, in Python and naming the
argument, before anything is reserved.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import chain
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


def _array_items(name: str, value: Any, ndim: int) -> Optional[list]:
    """A numpy array or torch tensor as a Python list (one transfer, not one per element), its
    number of dimensions and integer dtype checked; None for anything else."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None or not hasattr(value, "tolist"):
        return None
    if len(shape) != ndim:
        raise TypeError(f"{name} must have {ndim} dimension{'s' if ndim > 1 else ''}, got shape {tuple(shape)}")
    kind = getattr(dtype, "kind", None)  # numpy: "i"/"u" integers, "b" bool
    # torch dtypes print as torch.int64, torch.uint8 ... (torch.bool and floats do not match).
    integral = kind in ("i", "u") if kind is not None else str(dtype).startswith(("torch.int", "torch.uint"))
    if not integral:
        raise TypeError(f"{name} must hold integers, got dtype {dtype}")
    return value.tolist()


def _items(name: str, value: Any, ndim: int, what: str) -> list:
    """``value``'s items: a list or tuple as given, an array or tensor converted."""
    items = _array_items(name, value, ndim)
    if items is not None:
        return items
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        return list(value)  # a list, tuple, range, deque, array.array ...
    raise TypeError(f"{name} must be {what}, got {type(value).__name__}")


def token_list(name: str, value: Any, vocab_size: int, max_length: int) -> List[int]:
    """``value`` as a non-empty list of token ids in ``[0, vocab_size)``, at most ``max_length`` long."""
    value = _items(name, value, 1, "a list of token ids")
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
    prompts = _items("prompts", prompts, 2, "a list of token-id lists")
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
    items = _array_items("stop_token_ids", stop_token_ids, 1)
    if items is None:
        if not isinstance(stop_token_ids, (list, tuple, set, frozenset)):
            raise TypeError(f"stop_token_ids must be a collection of token ids, got {type(stop_token_ids).__name__}")
        items = list(stop_token_ids)
    ids = set()
    for token in items:
        token_id = integer("stop_token_ids entries", token)
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"stop_token_ids holds {token_id}, outside the vocabulary [0, {vocab_size})")
        ids.add(token_id)
    return frozenset(ids)


def check_new_tokens(chunks: List[List[Any]], vocab_size: int) -> None:
    """Raise unless every id of a forward's chunks is an int in ``[0, vocab_size)``.

    Runs on every forward, inside the benchmarks' timed regions, so plain in-range ints pass in
    one sweep over all chunks with no per-sequence work; anything else gets :func:`token_list`'s
    message naming the sequence.
    """
    ids = list(chain.from_iterable(chunks))
    if ids and set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab_size:
        return
    for index, chunk in enumerate(chunks):
        token_list(f"sequence {index}'s new tokens", chunk, vocab_size, len(chunk))
