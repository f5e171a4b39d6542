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
  Only tokens whose decode ends in U+FFFD pay for these decodes, and their results are kept; a token
  read as bytes that ends inside a character it starts is ``""`` without any.
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
        # Tokens read as bytes (byte-level BPE, byte fallback): one that starts a character without
        # finishing it is "" whatever is before it, without decoding (the decodes would all end in U+FFFD).
        self._bytes_known = table.kind in (BYTE_LEVEL, BYTE_FALLBACK)
        self._alone: dict[int, str] = {}
        self._corrected: dict[tuple[tuple[int, ...], int], str] = {}
        self._prefixes: dict[tuple[int, ...], str] = {}

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
        text = self.alone(token_id)
        if not text.endswith(REPLACEMENT):
            return text
        if self._bytes_known and starts_a_character(self._table.raw(token_id)):
            return ""
        key = (tuple(context)[-CONTEXT_TOKENS:], token_id)
        mended = self._corrected.get(key)
        if mended is None:
            mended = self._mend(token_id, key[0])
            if len(self._corrected) >= _CORRECTED_CACHE:
                self._corrected.clear()
                self._prefixes.clear()
            self._corrected[key] = mended
        return mended

    def _mend(self, token_id: int, context: tuple[int, ...]) -> str:
        """What the token adds to the text after ``context``, or "" if no context completes it."""
        decode = self._tokenizer.decode
        for count in range(1, len(context) + 1):
            before = context[-count:]
            joined = decode([*before, token_id])
            if joined.endswith(REPLACEMENT):
                continue
            # Earlier tokens that are themselves part of this character gave "": their text is this one's.
            whole = count
            while whole > 0 and self._table.text(before[whole - 1]).endswith(REPLACEMENT):
                whole -= 1
            prefix = self._prefix(before[:whole])
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

    def _prefix(self, tokens: tuple[int, ...]) -> str:
        """The earlier tokens decoded (shared by the alternatives mended after them)."""
        if not tokens:
            return ""
        prefix = self._prefixes.get(tokens)
        if prefix is None:
            prefix = self._prefixes[tokens] = self._tokenizer.decode(list(tokens))
        return prefix

    def _piece(self, token_id: int) -> Optional[str]:
        try:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # noqa: BLE001 - an id outside the vocabulary has no piece
            return None
        return piece if isinstance(piece, str) else None
