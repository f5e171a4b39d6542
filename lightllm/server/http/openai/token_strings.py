"""The token strings of logprobs (``tokens``, ``top_logprobs`` keys, chat ``token``, prompt logprobs'
``decoded_token``), built as vLLM 0.32 builds them.

A token's string starts as the token decoded on its own, ``tokenizer.decode([id])``, and is then
mended in two steps:

* **Leading spaces.** For a tokenizer whose pre-tokenizer is ``Metaspace`` (SentencePiece style:
  Llama, Mistral, T5; also inside a ``Sequence``), the decoder strips the space of a word mark at the
  start of a text, so ``▁hello`` alone decodes to ``hello`` and ``▁`` to nothing.  The spaces are put
  back from the vocabulary piece's leading marks (``▁hello`` -> `` hello``, ``▁`` -> `` ``), as many
  as the piece has and the decoded text lacks.  Only the pre-tokenizer is read, as vLLM reads it: a
  tokenizer that marks words in its normalizer (an old Llama 2 ``tokenizer.json`` loaded as a plain
  ``PreTrainedTokenizerFast``) keeps the stripped text.  Worked out once per token id.
* **Split characters.** A token whose string ends in U+FFFD holds part of a character the tokenizer
  split over several tokens (byte fallback, byte-level BPE).  It is decoded after up to 4 of the
  tokens before it (the *sampled* ones: the chosen tokens of the earlier positions, never the
  alternatives; the prompt's own tokens for prompt logprobs, its first token not included); the
  first such decode that does not end in U+FFFD gives the string: its text past the earlier tokens
  that decode whole (those that themselves end in U+FFFD gave ``""`` and their bytes go with this
  one).  So the tokens that only start a character are ``""`` and the token that completes it
  carries the whole character; where nothing completes it (no earlier token, invalid bytes) it is
  ``""``.  Each alternative at a position is mended against the same earlier sampled tokens.
  Only tokens whose decode ends in U+FFFD pay for these decodes.  Each decode of a run of ids is
  kept (by the ids: a decode is a function of them), so the alternatives at a position and later
  positions with the same tokens before them share it.  For a tokenizer read as bytes (byte-level
  BPE, byte fallback) the decodes whose bytes end inside a character are not made: such a decode
  ends in U+FFFD (the bytes show it), so the loop goes on as it would after making it; a token
  that ends inside a character it starts is ``""`` without any decode, and so are continuation
  bytes that no earlier sampled token can complete (:func:`ends_unfinished`; whether they can
  depends on the earlier bytes and on how many continuation bytes the token holds, not on which,
  so it is worked out once per position for all the alternatives).  A character split over byte
  tokens thus costs one decode where its last byte is mended, and one more for each alternative
  there that would complete it (kept by the ids: the same bytes before it again cost nothing).
  The decodes that are made are those of the loop above, so the strings are the same.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Optional, Sequence

from lightllm.server.http.openai.token_bytes import BYTE_FALLBACK, BYTE_LEVEL

# How many earlier tokens a split character is looked for in (4 bytes at most make a character).
CONTEXT_TOKENS = 4
REPLACEMENT = "\ufffd"
# Mended strings kept (by earlier tokens and token id) before the cache is emptied.
_CORRECTED_CACHE = 65_536


def sampled_context() -> "deque[int]":
    """A choice's earlier sampled token ids, as many as mending a token looks at (oldest first)."""
    return deque(maxlen=CONTEXT_TOKENS)


def leading_space_marker(tokenizer: Any) -> Optional[str]:
    """The word mark whose leading spaces a single-token decode strips: the ``replacement`` of a
    ``Metaspace`` pre-tokenizer (alone or in a ``Sequence``), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre_tokenizer = getattr(backend, "pre_tokenizer", None) if backend is not None else None
    if pre_tokenizer is None:
        return None
    try:
        description = json.loads(pre_tokenizer.__getstate__())
    except Exception:  # noqa: BLE001 - an unreadable pre-tokenizer has no known mark
        return None
    parts = [description]
    if description.get("type") == "Sequence":
        parts = description.get("pretokenizers") or []
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "Metaspace":
            return part.get("replacement", "\u2581")
    return None


def starts_a_character(raw: bytes) -> bool:
    """Whether ``raw`` ends with the first bytes of a character and not all of them (or with bytes
    no character starts with): whatever comes before it, a text that ends with it ends in U+FFFD."""
    for back in range(1, min(len(raw), 4) + 1):
        byte = raw[-back]
        if 0x80 <= byte < 0xC0:
            continue  # a continuation byte: look for the byte that started its character
        if byte < 0x80:
            return False
        need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4 if byte < 0xF8 else 5
        return back < need
    return False  # only continuation bytes: a character started before it may end here


def ends_unfinished(data: bytes) -> bool:
    """Whether no character can end at the end of ``data``, the whole of a text's bytes: its last
    bytes are a character's first bytes without the rest, continuation bytes that no byte before
    them starts, or more of them than the byte that starts them takes.  Decoded, such bytes end in
    U+FFFD (as one, or one per byte: it ends in U+FFFD either way).  False where a character may
    end there (whether those bytes really are one is left to the decode)."""
    for back in range(1, min(len(data), 4) + 1):
        byte = data[-back]
        if 0x80 <= byte < 0xC0:
            continue
        if byte < 0x80:
            return back > 1  # ASCII followed by continuation bytes
        need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4 if byte < 0xF8 else 5
        return back != need
    return bool(data)  # continuation bytes only: nothing in the text started them, or 4 of them


# byte_class of a token that ends inside a character it starts.
_STARTS = -1


def byte_class(raw: bytes) -> int:
    """``_STARTS`` if ``raw`` ends inside a character it starts (:func:`starts_a_character`), its
    length if it is 1 to 3 continuation bytes only, else 0.  A decode ending with a token of 1 to 3
    continuation bytes ends inside a character or not according to the bytes before it alone, not
    to which continuation bytes they are."""
    if starts_a_character(raw):
        return _STARTS
    if 0 < len(raw) < 4 and all(0x80 <= byte < 0xC0 for byte in raw):
        return len(raw)
    return 0


def restore_leading_spaces(piece: str, text: str, marker: str) -> str:
    """``text`` with the spaces of ``piece``'s leading ``marker``s that the decode stripped put back."""
    marks = 0
    for char in piece:
        if char != marker:
            break
        marks += 1
    if not marks:
        return text
    missing = marks - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


class TokenStrings:
    """The logprob string of each token of one tokenizer (see the module docstring).

    One per server (its OpenAI routes own it), beside :class:`~.token_bytes.TokenBytes`, whose
    per-id decode it shares.
    """

    def __init__(self, table: Any) -> None:
        self._table = table
        self._tokenizer = table.tokenizer
        self.marker = leading_space_marker(self._tokenizer)
        # Tokens read as bytes (byte-level BPE, byte fallback): a decode whose bytes end inside a
        # character is known to end in U+FFFD without making it (see the module docstring).
        self._bytes_known = table.kind in (BYTE_LEVEL, BYTE_FALLBACK)
        self._alone: dict[int, str] = {}
        # Per token id read as bytes: _STARTS, the number of its bytes (1-3) if they are all
        # continuation bytes, or 0.
        self._classes: dict[int, int] = {}
        self._corrected: dict[tuple[tuple[int, ...], int], str] = {}
        # Decodes of runs of ids (joined with a mended token, or the whole tokens before it).
        self._decodes: dict[tuple[int, ...], str] = {}
        # Per run of earlier sampled tokens (as mending reads them): the bytes of its last 1, 2, ...
        # tokens, and for a token of 1, 2, 3 continuation bytes after it the numbers of those tokens
        # whose decode with it may not end in U+FFFD (empty: it is ""), worked out as asked.
        self._contexts: dict[tuple[int, ...], tuple[list[bytes], list[Optional[tuple[int, ...]]]]] = {}

    def decoded(self, token_id: int) -> str:
        """The token decoded on its own, nothing mended (vLLM's string for a prompt's first token)."""
        return self._table.text(token_id)

    def alone(self, token_id: int) -> str:
        """The token's string before split characters are mended: its decode, leading spaces restored."""
        text = self._alone.get(token_id)
        if text is None:
            text = self._table.text(token_id)
            if self.marker is not None:
                piece = self._piece(token_id)
                if piece:
                    text = restore_leading_spaces(piece, text, self.marker)
            self._alone[token_id] = text
        return text

    def at(self, token_id: int, context: Sequence[int]) -> str:
        """The token's string after the sampled tokens ``context`` (oldest first; the last
        :data:`CONTEXT_TOKENS` are read, and only when the token ends in U+FFFD)."""
        return self.at_all((token_id,), context)[0]

    def at_all(self, token_ids: Sequence[int], context: Sequence[int]) -> list[str]:
        """The strings of ``token_ids`` (a position's sampled token and alternatives), each after the
        same sampled tokens ``context``: what the position needs is worked out once for all of them."""
        alone = self._alone
        strings = []
        key: Optional[tuple[int, ...]] = None
        known: Optional[tuple[list[bytes], list[Optional[tuple[int, ...]]]]] = None
        for token_id in token_ids:
            text = alone.get(token_id)
            if text is None:
                text = self.alone(token_id)
            if not text.endswith(REPLACEMENT):
                strings.append(text)
                continue
            if key is None:
                key = tuple(context)[-CONTEXT_TOKENS:]
            mended = self._corrected.get((key, token_id))
            if mended is None:
                counts: Sequence[int] = range(1, len(key) + 1)
                if self._bytes_known:
                    kind = self._classes.get(token_id)
                    if kind is None:
                        kind = self._classes[token_id] = byte_class(self._table.raw(token_id))
                    if kind == _STARTS:  # ends inside a character it starts: every decode ends in U+FFFD
                        strings.append("")
                        continue
                    if known is None:
                        known = self._context(key)
                    if kind:  # continuation bytes only: the decodes the bytes before them leave open
                        counts = self._open_counts(known, kind)
                    else:
                        raw = self._table.raw(token_id)
                        counts = [count for count in counts if not ends_unfinished(known[0][count - 1] + raw)]
                    if not counts:
                        strings.append("")
                        continue
                if len(self._corrected) >= _CORRECTED_CACHE or len(self._decodes) >= _CORRECTED_CACHE:
                    self._corrected.clear()
                    self._decodes.clear()
                    self._contexts.clear()
                mended = self._corrected[(key, token_id)] = self._mend(token_id, key, counts)
            strings.append(mended)
        return strings

    def _mend(self, token_id: int, context: tuple[int, ...], counts: Sequence[int]) -> str:
        """What the token adds to the text after ``context``, or "" if no context completes it
        (vLLM's loop: the first of ``context[-1:] + token``, ``context[-2:] + token``, ... whose
        decode does not end in U+FFFD gives it; ``counts``: the numbers of earlier tokens whose decode
        may not, the others left out)."""
        for count in counts:
            before = context[-count:]
            joined = self._decode((*before, token_id))
            if joined.endswith(REPLACEMENT):
                continue
            # Earlier tokens that are themselves part of this character gave "": their text is this one's.
            whole = count
            while whole > 0 and self._table.text(before[whole - 1]).endswith(REPLACEMENT):
                whole -= 1
            prefix = self._decode(before[:whole]) if whole else ""
            if joined.startswith(prefix):
                return joined[len(prefix):]
            # A decoder that changed the earlier text when more followed: past their common start.
            common = 0
            for mine, theirs in zip(prefix, joined):
                if mine != theirs:
                    break
                common += 1
            return joined[common:]
        return ""

    def _context(self, context: tuple[int, ...]) -> tuple[list[bytes], list[Optional[tuple[int, ...]]]]:
        """The bytes of the last 1, 2, ... tokens of ``context`` (only their last 4 bytes are read,
        so longer ones are cut to 5), and room for :meth:`_open_counts` (filled as asked)."""
        known = self._contexts.get(context)
        if known is None:
            tails, joined = [], b""
            for token_id in reversed(context):
                joined = (self._table.raw(token_id) + joined)[-5:]
                tails.append(joined)
            if len(self._contexts) >= _CORRECTED_CACHE:
                # Kept for every context met, even where nothing was then decoded (a continuation
                # byte after ASCII): bounded on its own, not only with the mended strings.
                self._contexts.clear()
            known = self._contexts[context] = (tails, [None, None, None, None])
        return known

    @staticmethod
    def _open_counts(known: tuple[list[bytes], list[Optional[tuple[int, ...]]]], length: int) -> tuple[int, ...]:
        """For a token of ``length`` (1-3) continuation bytes after the context ``known``: the numbers
        of earlier tokens whose decode with it does not end inside a character (which continuation
        bytes they are does not change that)."""
        counts = known[1][length]
        if counts is None:
            ending = b"\x80" * length
            counts = known[1][length] = tuple(count for count, tail in enumerate(known[0], 1)
                                              if not ends_unfinished(tail + ending))
        return counts

    def _decode(self, token_ids: tuple[int, ...]) -> str:
        """``tokenizer.decode`` of the ids, kept (a decode depends on nothing else)."""
        text = self._decodes.get(token_ids)
        if text is None:
            text = self._decodes[token_ids] = self._tokenizer.decode(list(token_ids))
        return text

    def _piece(self, token_id: int) -> Optional[str]:
        try:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # noqa: BLE001 - an id outside the vocabulary has no piece
            return None
        return piece if isinstance(piece, str) else None
