"""Refusing a prompt that cannot fit the context from a prefix of it, before tokenizing all of it.

The HTTP layer's character pre-check (:mod:`lightllm.server.http.generation.prompt_encoding`) is a proof that
holds for every prompt, so it must allow the longest characters any token can stand for (hundreds
per token); ordinary text has three to five.  A prompt of a million characters passes it and
would then keep a tokenizer thread busy for seconds (and every other client's tokenization queued
behind it) only to be refused for its length.  :func:`encode_within` tokenizes growing prefixes of
a long text first, starting at :data:`PROBE_CHARS_PER_TOKEN` characters per token of the limit,
and refuses as soon as one prefix alone needs more than the limit; a text that fits is tokenized
whole as before (a prompt shorter than the first probe pays nothing).

Why a prefix's count bounds the whole text's: tokenizers work left to right, and appending text
changes only the tokens of the prefix's last word or two (a pre-tokenizer splits text into words
that tokenize independently; without one, merges still reach back only a few tokens).
:data:`BOUNDARY_TOKENS` of slack cover that, so a prefix over ``limit + BOUNDARY_TOKENS`` tokens
proves the text is over ``limit``.
"""

from __future__ import annotations

from typing import Callable, List, Optional

PROBE_CHARS_PER_TOKEN = 8
BOUNDARY_TOKENS = 64
PROBE_GROWTH = 2


class PromptOverContextError(ValueError):
    """A prompt needs more tokens than ``limit``: a ``prefix_chars`` prefix alone has ``prefix_tokens``."""

    def __init__(self, limit: int, prefix_chars: int, prefix_tokens: int) -> None:
        self.limit = limit
        self.prefix_chars = prefix_chars
        self.prefix_tokens = prefix_tokens
        super().__init__(
            f"This model's maximum context length is {limit} tokens, and the prompt needs more: its first "
            f"{prefix_chars} characters alone are {prefix_tokens} tokens. Please reduce the length of the prompt."
        )


class RenderedChatTooLongError(ValueError):
    """A chat as its template renders it has more than ``limit`` characters (``chars``): refused before tokenizing."""

    def __init__(self, limit: int, chars: int) -> None:
        self.limit = limit
        self.chars = chars
        super().__init__(f"the chat as its template renders it has {chars} characters, more than {limit}")


def encode_within(tokenize: Callable[[str], List[int]], text: str, limit: Optional[int]) -> List[int]:
    """``tokenize(text)``, refused with :class:`PromptOverContextError` once a prefix proves it exceeds ``limit``.

    ``limit`` None tokenizes the whole text whatever its length (a request that truncates its
    prompt keeps the end of an over-long one).  The prefixes double, so the probes cost less than
    twice the characters of the prefix that proves a refusal; a text that fits yet runs longer
    than ``limit * PROBE_CHARS_PER_TOKEN`` characters (rare: ordinary text has three to five per
    token) pays less than two extra tokenizations of itself.
    """
    if limit is not None:
        probe = max(1, limit * PROBE_CHARS_PER_TOKEN)
        while probe < len(text):
            tokens = len(tokenize(text[:probe]))
            if tokens > limit + BOUNDARY_TOKENS:
                raise PromptOverContextError(limit, probe, tokens)
            probe *= PROBE_GROWTH
    return tokenize(text)
