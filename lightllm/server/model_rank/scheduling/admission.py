"""The model backend's admission check: whether this rank can run a request at all.

The HTTP side checks the same things; checking again on the rank means a request that reached
it some other way (or whose shared-memory record was damaged) fails alone, with
``FINISH_ERROR``, instead of failing the batch it would join.
"""

from __future__ import annotations

from typing import Any, Sequence


class RequestRejected(ValueError):
    """A request cannot run on this rank (its parameters or prompt are invalid here)."""


def check_request(
    prompt_ids: Sequence[int],
    params: Any,
    *,
    vocab_size: int,
    max_req_total_len: int,
    grammar_enabled: bool,
) -> None:
    """Raise :class:`RequestRejected` unless a rank with these limits can run the request.

    ``params`` is typed ``Any`` because it comes from a shared-memory record and is checked here
    to really be :class:`SamplingParams`; ``grammar_enabled`` says whether the rank has
    structured output.
    """
    # Imported here: the sampling package pulls in torch, and the scheduling core (this module
    # included) must import without it.
    from lightllm.common.sampling import SamplingParams

    try:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling parameters must be SamplingParams, got {type(params).__name__}")
        params.validate(vocab_size)
    except ValueError as exc:
        raise RequestRejected(f"invalid sampling parameters: {exc}") from None
    if params.grammar is not None and not grammar_enabled:
        raise RequestRejected("structured output is not available on this rank")
    if not prompt_ids:
        raise RequestRejected("the prompt is empty")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise RequestRejected(f"the prompt holds token ids outside [0, {vocab_size})")
    if len(prompt_ids) + params.max_new_tokens > max_req_total_len:
        raise RequestRejected(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds "
            f"max_req_total_len ({max_req_total_len})"
        )
