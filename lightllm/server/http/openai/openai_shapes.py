"""Shapes of OpenAI responses: usage, choice objects, ``best_of`` selection (the per-token logprob
lists are :mod:`.logprob_formatter`'s).

Pure functions of the generation events the request manager yields, so the endpoints in
:mod:`lightllm.server.http.openai.openai_routes` stay a thin layer of parsing, planning and streaming.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import Any

from lightllm.server.http.generation.fanout import ChoiceJob
from lightllm.server.http.openai.logprob_formatter import TokenLogprobFormatter
from lightllm.server.http.openai.text_offsets import TextOffsets


def final_finish_reason(events: list[Any]) -> str:
    """The finish reason of a collected choice; a generation cut off without one was aborted."""
    return events[-1].finish_reason or "abort"


def final_stop_reason(events: list[Any]) -> int | str | None:
    """vLLM's ``stop_reason`` of a collected choice: the stop string or stop token id that ended it."""
    return events[-1].stop_reason if events else None


class UsageTracker:
    """Token counts of a request: each prompt counted once, every choice's completion."""

    def __init__(self, jobs: list[ChoiceJob], count_completion: bool = True,
                 prompt_cached: dict[int, int] | None = None) -> None:
        """``prompt_cached``: each prompt's cached tokens for the totals, by prompt index, when
        they are not the smallest of the jobs listed (:func:`smallest_cached_tokens` over every
        generation ``best_of`` ran, of which only the kept ones are listed)."""
        # False when the generated tokens are dropped (echo with max_tokens 0).
        self._count_completion = count_completion
        owners: dict[int, int] = {}
        for job in jobs:
            owners.setdefault(job.prompt_index, job.index)
        # The first choice of each prompt reports that prompt's token count in the totals.
        self._prompt_owner = set(owners.values())
        self._owner_prompt = {index: prompt_index for prompt_index, index in owners.items()}
        self._choice_prompt = {job.index: job.prompt_index for job in jobs}
        self._prompt_cached = prompt_cached
        # Each choice's own prompt counts (tokens, cached), known before any chunk: the jobs were
        # primed, which prefilled their prompts (chunks streamed with continuous usage report them
        # at once, the role chunk that precedes every token included).
        self._prompt: dict[int, tuple[int, int]] = {job.index: (len(job.prompt_ids), job.cached_tokens)
                                                    for job in jobs}
        self._completion: dict[int, int] = {}

    def update(self, index: int, event: Any) -> None:
        """Record the counts carried by ``event`` of choice ``index``."""
        self._completion[index] = event.completion_tokens if self._count_completion else 0
        self._prompt[index] = (event.prompt_tokens, event.cached_tokens)

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI ``usage`` object of the whole request.

        Each prompt's cached tokens are the smallest hit among its choices (see
        :func:`smallest_cached_tokens` for why not the first choice's)."""
        cached = self._prompt_cached
        if cached is None:
            cached = {}
            for index, (_, hit) in self._prompt.items():
                prompt_index = self._choice_prompt[index]
                cached[prompt_index] = min(hit, cached.get(prompt_index, hit))
        owned = [tokens for index, (tokens, _) in self._prompt.items() if index in self._prompt_owner]
        return _usage(sum(owned), sum(self._completion.values()),
                      sum(cached[self._owner_prompt[index]] for index in self._prompt_owner))

    def choice_dict(self, index: int) -> dict[str, Any]:
        """The ``usage`` of choice ``index`` alone: its prompt and its completion so far.

        What vLLM's ``continuous_usage_stats`` chunks carry, each in its choice's chunk; the
        cached tokens are this choice's own hit (which may include what a sibling computed).
        """
        tokens, cached = self._prompt[index]
        return _usage(tokens, self._completion.get(index, 0), cached)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def smallest_cached_tokens(collected: dict[int, list[Any]], jobs: list[ChoiceJob]) -> dict[int, int]:
    """Each prompt's cached tokens as a request reports them: the smallest hit among the prompt's
    generations (``n``, ``best_of``), by prompt index.

    Each generation is a request of its own to the server, and one that reaches the prefix cache
    after a sibling computed the prompt adopts that prefix: a never-seen prompt would report a
    hit by timing (or, for ``best_of``, by which generation is kept).  The smallest hit leaves the
    siblings' work out.  On a normal server it is, in practice, generation 0's: they are submitted
    in order, so generation 0 joins the rank first (its prefix lookup precedes any sibling's
    work) and the prefill-queue strategies keep equal prompts in arrival order (it computes the
    prompt, the others adopt it).  Through a PD master each generation is prefilled on its own,
    after its decode node's reservation, and any of them may reach the prefill node first, so
    generation 0's hit could include a sibling's work; the smallest gives both the same answer.
    The minimum is per prompt: different prompts of one batched request are separate prompts (as
    in vLLM, where each is its own request), so one may report a hit on another's computation.
    """
    cached: dict[int, int] = {}
    for job in jobs:
        events = collected.get(job.index) or []
        hit = events[-1].cached_tokens if events else job.cached_tokens
        cached[job.prompt_index] = min(hit, cached.get(job.prompt_index, hit))
    return cached


def best_choices(collected: dict[int, list[Any]], jobs: list[ChoiceJob],
                 n: int) -> tuple[dict[int, list[Any]], list[ChoiceJob]]:
    """Keep the ``n`` generations of each prompt with the highest cumulative logprob (``best_of``).

    The kept ones are renumbered ``prompt_index * n + rank``, most likely first, as vLLM orders them.
    """

    def score(events: list[Any]) -> float:
        total = sum(event.logprob for event in events if event.token_id >= 0)
        return total if math.isfinite(total) else -math.inf

    by_prompt: dict[int, list[ChoiceJob]] = {}
    for job in jobs:
        by_prompt.setdefault(job.prompt_index, []).append(job)
    kept: dict[int, list[Any]] = {}
    kept_jobs: list[ChoiceJob] = []
    for prompt_index, candidates in sorted(by_prompt.items()):
        ranked = sorted(candidates, key=lambda job: -score(collected[job.index]))[:n]
        for rank, job in enumerate(ranked):
            index = prompt_index * n + rank
            kept[index] = collected[job.index]
            kept_jobs.append(replace(job, index=index))
    return kept, kept_jobs


class CompletionShaper:
    """Choice objects of ``/v1/completions`` (``text_completion``) responses and chunks."""

    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, formatter: TokenLogprobFormatter, with_logprobs: bool, *,
                 echo: list[tuple[str, list[int]]] | None = None, n: int = 1, drop_output: bool = False,
                 prompt_logprobs: int | None = None, prompts: list[list[int]] | None = None,
                 every_token: bool = False) -> None:
        """``echo`` holds ``(prompt text, prompt ids)`` per prompt when the prompt is echoed;
        ``drop_output`` leaves the generated tokens out (echo with ``max_tokens`` 0); ``every_token``
        streams a chunk for every output token, text or not (``return_token_ids``)."""
        self._formatter = formatter
        self._with_logprobs = with_logprobs
        self._echo = echo
        self._n = n
        self._drop_output = drop_output
        self._prompt_logprobs = prompt_logprobs
        self._prompts = prompts or []
        self._every_token = every_token
        # Per choice while streaming: its text_offset tracker (present once its first chunk was made)
        # and its last sampled tokens (for the strings of the next ones).
        self._trackers: dict[int, TextOffsets] = {}
        self._sampled: dict[int, deque[int]] = {}
        self.counts_completion = not drop_output

    def opening_choices(self, indices: list[int]) -> list[dict[str, Any]]:
        """Completion streams start directly with text."""
        return []

    def _pieces(self, index: int, events: list[Any], with_prompt: bool) -> list[tuple[str, list[Any], bool]]:
        """``(text, token records, whole)`` in the order the choice's text is sent: the echoed prompt
        (``with_prompt``, when echoing; ``whole``: decoded on its own), then each output token with
        the text it released.

        A streamed and a whole response are both built from these pieces, so their texts and
        ``text_offset`` lists agree.
        """
        pieces: list[tuple[str, list[Any], bool]] = []
        if with_prompt and self._echo is not None and events:
            prompt_text, prompt_ids = self._echo[index // self._n]
            pieces.append((prompt_text, self._formatter.prompt_tokens(prompt_ids, events[0]), True))
        if not self._drop_output:
            pieces += [(event.text, [event], False) for event in events if event.token_id >= 0]
        return pieces

    def _logprobs(self, tracker: TextOffsets, pieces: list[tuple[str, list[Any], bool]],
                  sampled: "deque[int] | None" = None) -> dict[str, Any] | None:
        """The ``logprobs`` of ``pieces`` (None when not asked for), their offsets from ``tracker``,
        their strings after the sampled tokens ``sampled`` (None: the choice's first)."""
        if not self._with_logprobs:
            return None
        records = [record for _, group, _ in pieces for record in group]
        offsets = [offset for text, group, whole in pieces
                   for offset in tracker.feed(text, [record.token_id for record in group], whole)]
        return self._formatter.completion(records, offsets, sampled)

    def stream_choices(self, index: int, event: Any) -> list[dict[str, Any]]:
        """The chunk choices for one token (one chunk each); none for a token that adds nothing to send."""
        first = index not in self._trackers
        tracker = self._trackers.setdefault(index, self._formatter.offset_tracker())
        sampled = self._sampled.setdefault(index, self._formatter.sampled_context())
        pieces = self._pieces(index, [event], with_prompt=first)
        text = "".join(piece_text for piece_text, _, _ in pieces)
        has_tokens = any(group for _, group, _ in pieces)
        if not text and event.finish_reason is None and not ((self._with_logprobs or self._every_token)
                                                                and has_tokens):
            return []
        return [{"index": index, "text": text, "logprobs": self._logprobs(tracker, pieces, sampled),
                 "finish_reason": event.finish_reason, "stop_reason": event.stop_reason}]

    def final_choice(self, index: int, events: list[Any]) -> dict[str, Any]:
        """The whole choice of a non-streaming response."""
        pieces = self._pieces(index, events, with_prompt=True)
        text = "".join(piece_text for piece_text, _, _ in pieces)
        logprobs = self._logprobs(self._formatter.offset_tracker(), pieces)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": final_finish_reason(events),
                  "stop_reason": final_stop_reason(events)}
        if self._prompt_logprobs is not None and events:
            choice["prompt_logprobs"] = self._formatter.vllm_prompt_logprobs(
                self._prompts[index // self._n], events[0], self._prompt_logprobs)
        return choice

    def response_extras(self, collected: dict[int, list[Any]]) -> dict[str, Any]:
        """Top-level response fields besides the choices (none for completions)."""
        return {}

    def chunk_fields(self, choice: dict[str, Any]) -> dict[str, Any]:
        """Top-level fields of the stream chunk carrying ``choice``, besides its header (none here)."""
        return {}


class ChatShaper:
    """Choice objects of ``/v1/chat/completions`` responses and ``chat.completion.chunk`` chunks."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    counts_completion = True

    def __init__(self, formatter: TokenLogprobFormatter, with_logprobs: bool, *,
                 prompt_logprobs: int | None = None, prompt_ids: list[int] | None = None,
                 echo: str | None = None, every_token: bool = False) -> None:
        """``echo`` is the text vLLM's chat ``echo`` puts before every choice's content (None: no echo);
        ``every_token`` streams a chunk for every output token, text or not (``return_token_ids``)."""
        self._formatter = formatter
        self._with_logprobs = with_logprobs
        self._prompt_logprobs = prompt_logprobs
        self._prompt_ids = prompt_ids or []
        self._echo = echo
        self._every_token = every_token
        # Per choice while streaming: its last sampled tokens (for the strings of the next ones).
        self._sampled: dict[int, deque[int]] = {}

    def stream_logprobs(self, index: int, event: Any) -> dict[str, Any]:
        """The chat ``logprobs`` of one streamed token of choice ``index``."""
        sampled = self._sampled.setdefault(index, self._formatter.sampled_context())
        return self._formatter.chat([event], sampled)

    def response_extras(self, collected: dict[int, list[Any]]) -> dict[str, Any]:
        """vLLM puts chat's ``prompt_logprobs`` at the top level of the response."""
        if self._prompt_logprobs is None or not collected.get(0):
            return {}
        return {"prompt_logprobs": self._formatter.vllm_prompt_logprobs(
            self._prompt_ids, collected[0][0], self._prompt_logprobs)}

    def chunk_fields(self, choice: dict[str, Any]) -> dict[str, Any]:
        """Top-level fields of the stream chunk carrying ``choice``, besides its header (none here)."""
        return {}

    def opening_choices(self, indices: list[int]) -> list[dict[str, Any]]:
        """The chunks before any token: every choice's role, then (echo) every choice's echoed text.

        As vLLM streams them: the echo is a content delta of its own, sent only when not empty.
        """
        openings = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for index in indices]
        if self._echo:
            openings += [{"index": index, "delta": {"content": self._echo}, "logprobs": None, "finish_reason": None}
                         for index in indices]
        return openings

    def stream_choices(self, index: int, event: Any) -> list[dict[str, Any]]:
        """The chunk choices for one token (one chunk each); none for a token that adds nothing to send."""
        if not event.text and event.finish_reason is None and not self._with_logprobs \
                and not (self._every_token and event.token_id >= 0):
            return []
        logprobs = self.stream_logprobs(index, event) if self._with_logprobs else None
        return [{"index": index, "delta": {"content": event.text}, "logprobs": logprobs,
                 "finish_reason": event.finish_reason, "stop_reason": event.stop_reason}]

    def generated_choice(self, index: int, events: list[Any]) -> dict[str, Any]:
        """The choice as generated, before ``echo`` (subclasses read tool calls from it)."""
        return {"index": index, "message": {"role": "assistant", "content": "".join(event.text for event in events)},
                "logprobs": self._formatter.chat(events) if self._with_logprobs else None,
                "finish_reason": final_finish_reason(events), "stop_reason": final_stop_reason(events)}

    def final_choice(self, index: int, events: list[Any]) -> dict[str, Any]:
        """The whole choice of a non-streaming response."""
        choice = self.generated_choice(index, events)
        if self._echo is not None:
            # vLLM's rule: with echo the content is the echoed text plus the content (a null content,
            # such as beside tool calls, counts as empty), so it is always a string.
            choice["message"]["content"] = self._echo + (choice["message"]["content"] or "")
        return choice
