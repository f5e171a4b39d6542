"""``text_offset`` of completions logprobs: where each token's text begins in the choice's text.

A token's offset is a position in the returned ``text`` (the echoed prompt included), as OpenAI and
vLLM define it.  It cannot be summed from the tokens' own strings: a special token such as BOS is
not in the text when special tokens are skipped, a token holding part of a character decodes to
U+FFFD on its own, and the detokenizer releases a character only with the token that completes it.
So the tokens are placed by their raw bytes (:mod:`lightllm.server.http.openai.token_bytes`) and each
placement is checked against the text itself.

The rules, the same for a streamed and a whole response (both feed :class:`TextOffsets` the same
pieces in the same order, so the offsets are equal for the same tokens):

* a token's offset is where the first character its bytes belong to begins; the tokens holding the
  bytes of one character all get that character's offset (a token that only starts or continues
  a character gets the position where the text after the tokens before it begins);
* a token with no text in the output gets the position where the following text begins: a
  skipped special token (BOS, EOS), a stop token whose text is left out;
* text held back while it may be the start of a stop string is placed where it will be sent; if
  the stop string completes and cuts it off, its tokens keep those positions, at or past the end
  of the text (a streamed offset cannot be taken back);
* an echoed prompt is decoded apart from the completion, so a token-id prompt that ends inside a
  character ends in U+FFFD and the completion's bytes do not finish that character;
* whitespace the pre-tokenizer dropped (WordPiece) is the client's in an echoed prompt: each token
  is at its own first character (a ``##`` piece that continues a word too); in generated text the
  space the decoder puts before a word goes with the word's first token;
* the offsets never decrease.

Where the text differs from the tokens' bytes in a way not foreseen here (a normalizer changed an
echoed prompt, a tokenizer whose vocabulary does not give bytes, a byte-fallback run of invalid
bytes that the decoder turned into U+FFFD whole), a token that cannot be placed gets the current
position, and the next token starts after all the text sent so far.
"""

from __future__ import annotations

import codecs
from typing import Callable, Sequence

from lightllm.server.http.openai.token_bytes import BYTE_FALLBACK, TokenBytes

REPLACEMENT = "\ufffd"


def _is_replacement(char: str) -> bool:
    """Whether ``char`` is U+FFFD, what decoders put for invalid bytes."""
    return char == REPLACEMENT


def _continues(pending: bytes, byte: int) -> bool:
    """Whether ``byte`` goes on with the unfinished character ``pending`` (else it breaks it)."""
    try:
        (pending + bytes([byte])).decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start == 0 and error.reason == "unexpected end of data"
    return True


class TextOffsets:
    """The ``text_offset`` of one choice's tokens, fed in the order the choice's text is sent."""

    def __init__(self, table: TokenBytes) -> None:
        self._table = table
        self._tail = ""  # the text known so far, from position _base on (what is behind is not needed)
        self._base = 0
        self._known = 0  # characters of text known so far
        self._pos = 0  # where the next token's text begins (past _known for text not sent yet)
        self._pending = b""  # bytes of a character the tokens have not completed yet
        self._pending_tokens = 0
        self._floor = 0  # the last offset given

    def feed(self, text: str, token_ids: Sequence[int], whole: bool = False) -> list[int]:
        """The offsets of ``token_ids``, sent with ``text`` (which may also hold earlier tokens' text).

        ``whole``: ``text`` is these tokens decoded on their own (an echoed prompt), so a character
        they leave unfinished is U+FFFD in it and the tokens after start a new one.
        """
        self._tail += text
        self._known += len(text)
        offsets = []
        lost = False
        for token_id in token_ids:
            offset, placed = self._place(token_id, whole)
            offsets.append(offset)
            lost = lost or not placed
        if offsets:
            self._floor = offsets[-1]
        if whole and not lost and self._pending:
            self._flush_pending()
        if lost:
            # The text sent with these tokens could not be matched with them; the tokens after
            # start after it, so one misplaced token does not shift all the following ones
            # (never before an offset already given: they must not decrease).
            self._pos = max(self._known, self._floor)
            self._pending, self._pending_tokens = b"", 0
        cut = min(self._pos, self._known) - self._base
        if cut > 0:
            self._tail = self._tail[cut:]
            self._base += cut
        return offsets

    def _peek(self, at: int, size: int) -> str:
        """The known text of ``size`` characters from ``at`` (shorter past what is known)."""
        start = at - self._base
        return self._tail[start:start + size] if start >= 0 else ""

    def _run(self, at: int, member: Callable[[str], bool]) -> int:
        """How many characters of the known text from ``at`` on are ``member``s."""
        start = index = max(0, at - self._base)
        # By index, not over a slice: the tail may hold a long echoed prompt.
        while index < len(self._tail) and member(self._tail[index]):
            index += 1
        return index - start

    def _agrees(self, at: int, text: str, partial: bool) -> bool:
        """Whether ``text`` is at ``at`` in the known text; with ``partial``, text past what is known
        (not sent yet) is taken on trust."""
        known = self._peek(at, len(text))
        if len(known) < len(text) and not partial:
            return False
        return text.startswith(known)

    def _place(self, token_id: int, whole: bool) -> tuple[int, bool]:
        """The token's offset before clamping, and whether it could be placed."""
        if token_id in self._table.special_ids:
            return self._place_special(self._table.text(token_id))
        if not self._table.knows_bytes:
            text = self._table.text_in_word(token_id)
            if REPLACEMENT in text:  # part of a character: where it lands is not known
                return self._pos, False
            return self._place_text(text, partial=False, whole=whole)
        raw = self._table.raw(token_id)
        if not raw:
            return self._pos, True
        if self._pending and not _continues(self._pending, raw[0]):
            self._flush_pending()
        offset = self._pos
        buffer = self._pending + raw
        text, used = codecs.utf_8_decode(buffer, "replace", False)
        if used < len(buffer):
            self._pending_tokens = self._pending_tokens + 1 if used == 0 else 1
        else:
            self._pending_tokens = 0
        self._pending = buffer[used:]
        if not text:
            return offset, True
        return self._place_text(text, partial=True, whole=whole)

    def _place_special(self, content: str) -> tuple[int, bool]:
        """A special token is in the text only when the request keeps special tokens."""
        # A special token shown in the text breaks an unfinished character (its U+FFFD comes first).
        at = self._pos + self._pending_width()
        if content and not self._agrees(at, content, partial=False):
            at += self._run(at, _is_replacement)  # after invalid bytes, as in _place_text
        if content and self._agrees(at, content, partial=False):
            self._pending, self._pending_tokens = b"", 0
            self._pos = at + len(content)
            return at, True
        return self._pos, True  # skipped: its bytes do not break an unfinished character either

    def _pending_width(self) -> int:
        """How many U+FFFD the bytes of the unfinished character become when it is broken.

        One (Python and the byte-level decoder replace a broken sequence as one); a byte-fallback
        decoder gives one per byte token.  Where the text is known it has the last word.
        """
        if not self._pending:
            return 0
        count = self._pending_tokens if self._table.kind == BYTE_FALLBACK else 1
        if self._pos >= self._known:
            return count
        return min(count, self._run(self._pos, _is_replacement))

    def _flush_pending(self) -> None:
        """The unfinished character was broken: its bytes are U+FFFD in the text."""
        self._pos += self._pending_width()
        self._pending, self._pending_tokens = b"", 0

    def _place_text(self, text: str, partial: bool, whole: bool = False) -> tuple[int, bool]:
        """Match ``text``, a token's characters, with the text at the current position.

        ``whole``: the text is an echoed prompt, whose whitespace is the client's, not a token's.
        """
        at = self._pos
        if self._agrees(at, text, partial):
            self._pos = at + len(text)
            return at, True
        head = self._peek(at, 1)
        if head == REPLACEMENT and not text.startswith(REPLACEMENT):
            # Invalid bytes before it came out as more U+FFFD than foreseen (a byte-fallback
            # decoder turns a whole run of byte tokens with an invalid byte into U+FFFD).
            after = at + self._run(at, _is_replacement)
            if self._agrees(after, text, partial):
                self._pos = after + len(text)
                return after, True
        # The decoder strips the space of a word-start mark at the start of a text (SentencePiece).
        trimmed = text
        while head and head not in (" ", REPLACEMENT) and trimmed.startswith(" "):
            trimmed = trimmed[1:]
            if not trimmed or self._agrees(at, trimmed, partial):
                self._pos = at + len(trimmed)
                return at, True
        if head.isspace() and not text[0].isspace():
            # Whitespace the pre-tokenizer dropped (WordPiece-like tokenizers).  In generated text
            # the decoder puts a space before the word's token, so it goes with the word; in an
            # echoed prompt it is the client's, and the word is at its own first character.
            after = at + self._run(at, str.isspace)
            if self._agrees(after, text, partial):
                self._pos = after + len(text)
                return (after if whole else at), True
        return at, False
