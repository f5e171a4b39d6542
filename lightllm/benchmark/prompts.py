"""Prompts with an exact token length under the served model's tokenizer.

The server tokenizes a text prompt itself (adding the tokenizer's special tokens such as
BOS), so a prompt of "N tokens" must be text whose server-side encoding has exactly N
ids. Text built from random token ids does not always round-trip (neighbouring pieces
may merge), so :class:`PromptBuilder` decodes, re-encodes and adjusts until the length
is exact, giving up with :class:`PromptLengthError` after a bounded number of rounds.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np


class PromptLengthError(ValueError):
    """Raised when no prompt with the requested token length can be built."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A benchmark prompt: its text and the ids the server will see for that text."""

    text: str
    token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        """Token count of the prompt as the server encodes it, special tokens included."""
        return len(self.token_ids)


def _rng(*parts: object) -> np.random.Generator:
    """A generator seeded from a stable hash of ``parts`` (``hash()`` is salted per process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def _is_plain_text(text: str) -> bool:
    """Non-blank text without replacement or control characters (servers may strip those)."""
    return bool(text.strip()) and "\ufffd" not in text and all(c.isprintable() or c in " \n\t" for c in text)


def _round_trip_safe_ids(tokenizer: Any) -> np.ndarray:
    """Ids that decode to non-empty, valid text and re-encode to themselves alone.

    Special and added tokens are excluded because their text would be parsed back as
    control tokens, byte fragments because they decode to replacement characters, and
    control characters because servers and JSON tooling may normalise them away.
    """
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    ids = [i for i in range(len(tokenizer)) if i not in excluded]
    texts = tokenizer.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
    plausible = [(i, t) for i, t in zip(ids, texts) if _is_plain_text(t)]
    if not plausible:
        return np.array([], dtype=np.int64)
    encoded = tokenizer([t for _, t in plausible], add_special_tokens=False)["input_ids"]
    safe = [i for (i, _), enc in zip(plausible, encoded) if list(enc) == [i]]
    return np.array(safe, dtype=np.int64)


class PromptBuilder:
    """Builds seeded random prompts of exact token lengths for one tokenizer.

    Building the builder scans the vocabulary once (for ids that round-trip through
    decode/encode); reuse it across runs. Prompts are pure functions of
    ``(seed, namespace, index, length, shared_prefix_len)``: different indexes get
    independent random content so prefix caches do not share work between requests,
    and ``namespace`` separates prompt families built with the same seed (e.g. warm-up
    rounds versus the measured round). A shared prefix of ``shared_prefix_len`` tokens,
    identical for every prompt with the same seed and namespace, can be requested on purpose;
    prompts of another namespace or seed get another prefix, so a warm-up round (or an earlier
    repeat) never fills the prefix cache with the measured prompts' prefix.

    Args:
        tokenizer: a ``transformers`` tokenizer (``AutoTokenizer.from_pretrained``).
        max_attempts: decode/re-encode rounds before giving up on a prompt.
    """

    def __init__(self, tokenizer: Any, max_attempts: int = 64) -> None:
        if max_attempts <= 0:
            raise ValueError(f"max_attempts must be > 0, got {max_attempts}")
        self._tokenizer = tokenizer
        self._max_attempts = max_attempts
        self._candidates = _round_trip_safe_ids(tokenizer)
        if self._candidates.size == 0:
            raise PromptLengthError("tokenizer has no ordinary token that round-trips through decode/encode")
        self._num_special = int(tokenizer.num_special_tokens_to_add(pair=False))

    @property
    def num_special_tokens(self) -> int:
        """Special tokens the tokenizer adds around a single text (e.g. 1 for BOS)."""
        return self._num_special

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` alone, without the special tokens (BOS) a prompt would get."""
        return len(self._encode(text, add_special_tokens=False))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    def _shared_prefix(self, seed: int, namespace: str, length: int) -> list[int]:
        # Seeded without the index, so every prompt of one pass gets the same prefix, but with the
        # namespace: a warm-up pass built with the measured pass's seed must not cache its prefix.
        return [int(i) for i in _rng(seed, namespace, "shared-prefix").choice(self._candidates, length)]

    def _group_stream(self, seed: int, namespace: str, group: int, length: int) -> list[int]:
        # Drawn in fixed blocks so the stream for a shorter length is a prefix of a longer one
        # (a chat's turns extend each other); the namespace keeps warm-up groups apart.
        rng = _rng(seed, namespace, "prefix-group", group)
        block = 64
        ids: list[int] = []
        while len(ids) < length:
            ids.extend(int(i) for i in rng.choice(self._candidates, block))
        return ids[:length]

    def build(
        self,
        index: int,
        length: int,
        *,
        seed: int = 0,
        namespace: str = "measure",
        shared_prefix_len: int = 0,
        prefix_group: int = -1,
        prefix_len: int = 0,
    ) -> Prompt:
        """Return prompt ``index`` whose encoding (with special tokens) has ``length`` ids.

        ``prefix_group`` >= 0 takes the first ``prefix_len`` content tokens (at most all of
        them) from that group's stream (see :class:`~lightllm.benchmark.workloads.ScheduledRequest`);
        it cannot be combined with ``shared_prefix_len``.

        Raises:
            ValueError: ``length`` leaves no room for content, ``shared_prefix_len``
                is negative or does not leave at least one unique token, or the group
                arguments are invalid.
            PromptLengthError: no exact-length text was found within ``max_attempts``.
        """
        if prefix_group >= 0:
            if shared_prefix_len:
                raise ValueError("shared_prefix_len and prefix_group cannot be combined")
            if prefix_len < 0:
                raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
        if length <= self._num_special:
            raise ValueError(
                f"length must exceed the {self._num_special} special token(s) the tokenizer adds, got {length}"
            )
        if shared_prefix_len < 0:
            raise ValueError(f"shared_prefix_len must be >= 0, got {shared_prefix_len}")
        if shared_prefix_len and shared_prefix_len >= length - self._num_special:
            raise ValueError(
                f"shared_prefix_len ({shared_prefix_len}) must be smaller than the prompt content "
                f"({length} tokens minus {self._num_special} special)"
            )
        rng = _rng(seed, namespace, index)
        content_len = length - self._num_special
        prefix = self._shared_prefix(seed, namespace, shared_prefix_len) if shared_prefix_len else []
        if prefix_group >= 0 and prefix_len:
            prefix = self._group_stream(seed, namespace, prefix_group, min(prefix_len, content_len))
        content = prefix + [int(i) for i in rng.choice(self._candidates, content_len - len(prefix))]
        for _ in range(self._max_attempts):
            text = self._decode(content)
            full = self._encode(text, add_special_tokens=True)
            missing = length - len(full)
            if missing == 0:
                return Prompt(text=text, token_ids=full)
            # Continue from the canonical encoding of the current text: it round-trips,
            # so only the edited tail can still change on the next pass.
            content = self._encode(text, add_special_tokens=False)
            if missing > 0:
                content += [int(i) for i in rng.choice(self._candidates, missing)]
            else:
                keep = max(len(content) + missing, min(len(prefix), content_len - 1) + 1)
                content = content[:keep]
        raise PromptLengthError(
            f"could not build a prompt of exactly {length} tokens for index {index} "
            f"after {self._max_attempts} decode/re-encode rounds"
        )
