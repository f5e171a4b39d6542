"""The raw bytes of each token, for the ``bytes`` of chat logprobs and the ``text_offset`` of completions.

OpenAI documents a logprob's ``bytes`` as the token's own UTF-8 bytes, so that a client joining the
``bytes`` of consecutive tokens rebuilds a character split over several of them.  A token's decoded
text cannot give that: a token holding part of a character decodes to U+FFFD on its own.  The bytes
come from the token's vocabulary string instead, read the way the tokenizer's decoder reads it:

* byte-level BPE (GPT-2, Llama 3, Qwen): every character of the string stands for one byte through
  GPT-2's byte-to-character alphabet; a string with a character outside it (an added token such as
  ``語x``) is its own UTF-8, as the ``ByteLevel`` decoder treats it;
* SentencePiece-style byte fallback (Llama 2, Mistral): ``<0xE8>`` is the byte 0xE8, and other
  pieces are text with the word-start mark ``▁`` standing for a space;
* metaspace (``▁`` = space, no byte tokens): the piece with its marks turned into spaces.

The kind is read from the tokenizer's backend (its decoder, pre-tokenizer and model), never guessed
from a model name.  Any other tokenizer gets the UTF-8 of the token's decoded text (U+FFFD's bytes
for a token that holds part of a character: nothing better is known there).

The server keeps one :class:`TokenBytes` (its OpenAI routes own it), filled as tokens are met, so a
token's bytes are worked out once per server, not once per response.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator, Optional

from lightllm.utils.tokenizer_utils import tokenizer_special_ids

BYTE_LEVEL = "byte_level"
BYTE_FALLBACK = "byte_fallback"
METASPACE = "metaspace"
TEXT = "text"

# SentencePiece's word-start mark, the default of the Metaspace decoder.
WORD_MARK = "\u2581"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-character alphabet, reversed: the byte each of the 256 characters stands for.

    Bytes that are printable Latin-1 characters stand for themselves; the others (controls, space,
    soft hyphen...) are given the characters from U+0100 on, in byte order, so that every byte has a
    visible character a BPE vocabulary can hold.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(0x100 + shifted)
            shifted += 1
    return {char: byte for byte, char in chars.items()}


_BYTE_OF_CHAR = byte_level_alphabet()


def _component(component: Any) -> Optional[dict]:
    """The JSON description of a backend component (decoder, pre-tokenizer), or None."""
    if component is None:
        return None
    try:
        return json.loads(component.__getstate__())
    except Exception:  # noqa: BLE001 - an unknown component only means an unknown kind
        return None


def _parts(description: Optional[dict]) -> Iterator[dict]:
    """A component and, for a ``Sequence``, every component in it."""
    if not description:
        return
    yield description
    for key in ("decoders", "pretokenizers"):
        for inner in description.get(key) or []:
            yield from _parts(inner)


def tokenizer_kind(tokenizer: Any) -> tuple[str, str]:
    """``(kind, word mark)``: how the tokenizer's vocabulary strings stand for bytes.

    The word mark is the character the decoder turns into a space (metaspace and byte-fallback
    kinds; ``▁`` unless the decoder names another).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        # A slow SentencePiece tokenizer (LlamaTokenizer...): pieces with ``▁`` and ``<0xNN>``.
        return (BYTE_FALLBACK, WORD_MARK) if getattr(tokenizer, "sp_model", None) is not None else (TEXT, "")
    decoder = list(_parts(_component(getattr(backend, "decoder", None))))
    pre_tokenizer = list(_parts(_component(getattr(backend, "pre_tokenizer", None))))
    types = {part.get("type") for part in decoder}
    if "ByteLevel" in types or (not decoder and any(part.get("type") == "ByteLevel" for part in pre_tokenizer)):
        return BYTE_LEVEL, ""
    mark = ""
    for part in decoder:
        if part.get("type") == "Metaspace":
            mark = part.get("replacement") or WORD_MARK
        elif part.get("type") == "Replace" and part.get("content") == " ":
            mark = (part.get("pattern") or {}).get("String") or mark
    if "ByteFallback" in types or getattr(getattr(backend, "model", None), "byte_fallback", False):
        return BYTE_FALLBACK, mark or WORD_MARK
    if mark:
        return METASPACE, mark
    return TEXT, ""


def continuation_prefix(tokenizer: Any) -> str:
    """The prefix of a WordPiece decoder's word-continuing pieces (``##``), or "" for other decoders.

    Decoded on its own such a piece keeps it (``##ing``); in a text it is glued to the piece before.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    for part in _parts(_component(getattr(backend, "decoder", None)) if backend is not None else None):
        if part.get("type") == "WordPiece":
            return part.get("prefix") or "##"
    return ""


class TokenBytes:
    """The raw bytes of one tokenizer's tokens, worked out once per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind, self._mark = tokenizer_kind(tokenizer)
        self.special_ids = tokenizer_special_ids(tokenizer)
        self._continuing = continuation_prefix(tokenizer)
        self._bytes: dict[int, bytes] = {}
        self._texts: dict[int, str] = {}
        self._inner: dict[int, str] = {}

    @property
    def knows_bytes(self) -> bool:
        """True when the bytes come from the vocabulary (False: from each token's decoded text)."""
        return self.kind != TEXT

    def text(self, token_id: int) -> str:
        """The token decoded on its own (U+FFFD for part of a character)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def text_in_word(self, token_id: int) -> str:
        """The token's text as it reads in a decoded text: :meth:`text`, less the prefix of a WordPiece
        piece that continues a word (``##ing`` reads ``ing``)."""
        text = self._inner.get(token_id)
        if text is None:
            text = self.text(token_id)
            prefix = self._continuing
            if prefix and len(text) > len(prefix) and text.startswith(prefix):
                piece = self._piece(token_id)
                if piece is not None and piece.startswith(prefix):
                    text = text[len(prefix):]
            self._inner[token_id] = text
        return text

    def raw(self, token_id: int) -> bytes:
        """The token's own bytes (see the module docstring for how each kind is read)."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._work_out(token_id)
        return raw

    def _work_out(self, token_id: int) -> bytes:
        piece = self._piece(token_id) if self.kind != TEXT else None
        if piece is None:
            return self.text(token_id).encode("utf-8")
        if self.kind == BYTE_LEVEL:
            if all(char in _BYTE_OF_CHAR for char in piece):
                return bytes(_BYTE_OF_CHAR[char] for char in piece)
            return piece.encode("utf-8")
        if self.kind == BYTE_FALLBACK:
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        return piece.replace(self._mark, " ").encode("utf-8")

    def _piece(self, token_id: int) -> Optional[str]:
        """The token's vocabulary string, or None when the tokenizer does not give one."""
        try:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # noqa: BLE001 - an id outside the vocabulary falls back to its text
            return None
        return piece if isinstance(piece, str) else None
