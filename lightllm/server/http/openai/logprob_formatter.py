"""Per-token logprobs in the OpenAI shapes: completions' ``tokens`` / ``top_logprobs`` /
``text_offset`` and chat's ``content`` entries, with vLLM's token strings (:mod:`.token_strings`).

Used by the choice shapers of :mod:`lightllm.server.http.openai.openai_shapes` (generated tokens,
streamed or not) and for echoed prompts and prompt logprobs.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightllm.server.http.openai.text_offsets import TextOffsets
from lightllm.server.http.openai.token_bytes import TokenBytes
from lightllm.server.http.openai.token_strings import CONTEXT_TOKENS, TokenStrings, sampled_context


def json_logprob(value: float | None) -> float | None:
    """A logprob that JSON can carry: -inf/NaN (a masked token) become OpenAI's -9999.0."""
    if value is None:
        return None
    return value if math.isfinite(value) else -9999.0


@dataclass
class PromptToken:
    """A prompt token shaped like a generation event, for echo with logprobs.

    ``context``: the prompt tokens its string and its alternatives' are mended after (see
    :mod:`~lightllm.server.http.openai.token_strings`); None for the first prompt token, which is
    named by its decode alone, as vLLM names it.
    """

    token_id: int
    logprob: float | None
    top_logprobs: dict[int, float] | None
    context: Optional[tuple[int, ...]]


class TokenLogprobFormatter:
    """Turns per-token logprobs into the completions or chat ``logprobs`` shapes."""

    def __init__(self, token_bytes: TokenBytes, top_count: int, tokens_as_ids: bool = False,
                 token_strings: TokenStrings | None = None) -> None:
        # The server's tables (its routes own them): a token's bytes and string are worked out once.
        self._table = token_bytes
        self._strings = token_strings if token_strings is not None else TokenStrings(token_bytes)
        self._top_count = top_count
        self._tokens_as_ids = tokens_as_ids

    def offset_tracker(self) -> TextOffsets:
        """A fresh :class:`TextOffsets` for one choice's ``text_offset``."""
        return TextOffsets(self._table)

    @staticmethod
    def sampled_context() -> "deque[int]":
        """A fresh record of one choice's last sampled tokens, for the strings of its next ones."""
        return sampled_context()

    def token_text(self, token_id: int, context: Optional[Sequence[int]] = ()) -> str:
        """The string of one token after the sampled tokens ``context`` (vLLM's, see
        :mod:`~lightllm.server.http.openai.token_strings`; None: the token decoded alone), or
        ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``, for tokens whose text alone is
        ambiguous).

        Events with a negative ``token_id`` are finish markers that carry no token; they
        are left out of every logprobs list.
        """
        if self._tokens_as_ids:
            return f"token_id:{token_id}"
        if context is None:
            return self._strings.decoded(token_id)
        return self._strings.at(token_id, context)

    def token_texts(self, token_ids: Sequence[int], context: Optional[Sequence[int]]) -> list[str]:
        """:meth:`token_text` of each of ``token_ids`` after the same ``context`` (a position's
        sampled token and its alternatives: the position's work is done once for them all)."""
        if self._tokens_as_ids:
            return [f"token_id:{token_id}" for token_id in token_ids]
        if context is None:
            return [self._strings.decoded(token_id) for token_id in token_ids]
        return self._strings.at_all(token_ids, context)

    def _context_of(self, event: Any, sampled: "deque[int]") -> Optional[tuple[int, ...]]:
        """The tokens ``event``'s strings are mended after; a generated token joins ``sampled``."""
        if isinstance(event, PromptToken):
            return event.context
        context = tuple(sampled)
        sampled.append(event.token_id)
        return context

    def _top(self, event: Any) -> list[tuple[int, float]]:
        ranked = sorted((event.top_logprobs or {}).items(), key=lambda item: -item[1])
        return [(token_id, json_logprob(value)) for token_id, value in ranked[: self._top_count]]

    def completion(self, events: list[Any], offsets: list[int],
                   sampled: "deque[int] | None" = None) -> dict[str, Any]:
        """Legacy completions logprobs; the sampled token is always among ``top_logprobs``.

        ``events`` are token records (no finish markers); ``offsets`` their ``text_offset``
        (:class:`TextOffsets`); ``sampled`` the choice's earlier sampled tokens (a stream keeps
        one per choice; None: ``events`` are the first).
        """
        sampled = sampled if sampled is not None else sampled_context()
        tokens, top = [], []
        for event in events:
            context = self._context_of(event, sampled)
            if event.logprob is None:  # the first prompt token has nothing to be predicted from
                tokens.append(self.token_text(event.token_id, context))
                top.append(None)
                continue
            ranked = self._top(event)
            texts = self.token_texts([event.token_id, *(token_id for token_id, _ in ranked)], context)
            tokens.append(texts[0])
            # The chosen token first, then the alternatives best first, as vLLM builds the dict (a
            # client may read the first key as the chosen token); tokens of the same text (byte
            # tokens all read U+FFFD) share one key, in the first one's place with the last one's
            # logprob, as vLLM's one pass over them leaves it.  vLLM keys a position by token id
            # first, so the chosen token met again among the alternatives is not written again: a
            # better alternative of the same text keeps its logprob.
            alternatives = {texts[0]: json_logprob(event.logprob)}
            for (token_id, value), text in zip(ranked, texts[1:]):
                if token_id != event.token_id:
                    alternatives[text] = value
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [json_logprob(event.logprob) for event in events],
                "top_logprobs": top, "text_offset": list(offsets)}

    def prompt_tokens(self, prompt_ids: list[int], first_event: Any) -> list["PromptToken"]:
        """The prompt as logprob records for echo (the first token's logprob is None)."""
        computed = getattr(first_event, "prompt_logprobs", None) or []
        records = [PromptToken(prompt_ids[0], None, None, None)]
        for position, token_id in enumerate(prompt_ids[1:]):
            logprob, top = (computed[position][1], computed[position][2]) if position < len(computed) else (None, None)
            records.append(PromptToken(token_id, logprob, top, prompt_context(prompt_ids, position + 1)))
        return records

    def vllm_prompt_logprobs(self, prompt_ids: list[int], first_event: Any, count: int) -> list[Any]:
        """vLLM's ``prompt_logprobs``: None for the first token, then ``{id: {logprob, rank,
        decoded_token}}`` holding the prompt token and the ``count`` most likely alternatives."""
        computed = getattr(first_event, "prompt_logprobs", None) or []
        result: list[Any] = [None]
        strings = self._strings
        for index, (token_id, logprob, top, *rank) in enumerate(computed):
            # Strings as vLLM gives them, whatever return_tokens_as_token_ids says.
            context = prompt_context(prompt_ids, index + 1)
            ranked = sorted(top.items(), key=lambda item: -item[1])[:count]
            # The prompt token first, then the alternatives best first, as vLLM orders the dict.
            # Its rank is its rank in the whole distribution, computed on the model rank (1 + the
            # number of tokens with a strictly greater logprob), as vLLM reports it; where none was
            # published its place among the alternatives gives it.
            texts = strings.at_all([token_id, *(alt_id for alt_id, _ in ranked)], context)
            own = {"logprob": json_logprob(logprob), "rank": rank[0] if rank else None, "decoded_token": texts[0]}
            entry = {str(token_id): own}
            for position, ((alt_id, value), text) in enumerate(zip(ranked, texts[1:])):
                if alt_id == token_id and own["rank"] is None:
                    own["rank"] = position + 1
                entry.setdefault(str(alt_id), {"logprob": json_logprob(value), "rank": position + 1,
                                               "decoded_token": text})
            result.append(entry)
        return result

    def _chat_entry(self, token_id: int, logprob: float, text: str) -> dict[str, Any]:
        # ``bytes`` are the token's own bytes (also with token_id:<id> names), so joining those of
        # consecutive tokens rebuilds a character split over them, as OpenAI documents the field.
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(self._table.raw(token_id))}

    def chat(self, events: list[Any], sampled: "deque[int] | None" = None) -> dict[str, Any]:
        """Chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``; ``sampled`` as
        for :meth:`completion`."""
        sampled = sampled if sampled is not None else sampled_context()
        content = []
        for event in events:
            if event.token_id < 0:
                continue
            context = self._context_of(event, sampled)
            ranked = self._top(event)
            texts = self.token_texts([event.token_id, *(token_id for token_id, _ in ranked)], context)
            entry = self._chat_entry(event.token_id, event.logprob, texts[0])
            entry["top_logprobs"] = [self._chat_entry(token_id, value, text)
                                     for (token_id, value), text in zip(ranked, texts[1:])]
            content.append(entry)
        return {"content": content}


def prompt_context(prompt_ids: Sequence[int], position: int) -> tuple[int, ...]:
    """The prompt tokens the strings at prompt ``position`` (1 on) are mended after: up to 4 before
    it, the first prompt token never among them (vLLM reads them from its prompt logprobs, whose
    first entry is null)."""
    return tuple(prompt_ids[max(1, position - CONTEXT_TOKENS):position])
