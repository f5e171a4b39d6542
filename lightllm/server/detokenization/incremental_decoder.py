"""Turning a growing list of token ids into text pieces, with stop-string handling."""

from __future__ import annotations

from typing import Any, List, Optional, Protocol, Sequence, Tuple

PROMPT_CONTEXT_TOKENS = 4
# Tokens that may hold the bytes of one unfinished UTF-8 character (it has at most 4 bytes).
CHARACTER_TOKENS = 4
# Tokens held back waiting for a character to complete before invalid bytes are let out as U+FFFD.
MAX_HELD_TOKENS = 2 * CHARACTER_TOKENS


class TextOptions(Protocol):
    """A request's text options (``SamplingParams`` and the detokenizer's ``DecodeOptions`` have them)."""

    stop_sequences: Sequence[str]
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    print_eos_token: bool
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    min_new_tokens: int


class IncrementalDecoder:
    """Emits the new text each token adds, never a broken UTF-8 character.

    Text is decoded over a window that starts a few tokens back (tokenizers that mark word
    starts need the previous token to decide on a leading space); a piece whose decoding ends in
    the replacement character is held back until the next token completes the character.

    Stop strings: text that could be the start of a stop string is held back; when a stop
    string appears, the text before it (and the stop string itself with
    ``include_stop_str``) is released and the decoder reports the hit.  As in vLLM, stop strings
    count only after ``min_tokens`` output tokens, where stop token ids may first be sampled too:
    one that ends in the text of the ``min_tokens``-th token or an earlier one does not stop the
    request (it may begin there).

    ``ending_ids`` are the tokens that end the request when sampled (its stop token ids, and
    the EOS ids unless it ignores EOS): their own text is left out unless ``include_stop_str``
    (vLLM's rule).  :attr:`stop_reason` is the stop string, or the id among ``stop_token_ids``,
    that ended the request; None for EOS and length, as vLLM reports it.

    ``skip_special_tokens=False`` keeps the text of special tokens (EOS, chat markers);
    ``shown_ids`` are special tokens whose text is kept even when the others are skipped
    (LightLLM's ``print_eos_token`` puts the EOS ids here).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        stop_sequences: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
        shown_ids: Sequence[int] = (),
        min_tokens: int = 0,
        ending_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: List[int] = self._prompt_window(prompt_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop_sequences = [s for s in stop_sequences if s]
        # Fixed for the request; _find_stop needs it for every token.
        self._longest_stop = max((len(s) for s in self.stop_sequences), default=0)
        self.text = ""  # all text decoded so far
        self.emitted = 0  # chars of self.text already handed out
        self.stopped = False
        self.include_stop_str = include_stop_str
        self.shown_ids = frozenset(shown_ids) if skip_special_tokens else frozenset()
        self.min_tokens = min_tokens
        self.outputs = 0  # output tokens added
        # A stop string must end beyond this many characters of text (the text up to and
        # including the min_tokens-th token's, as vLLM counts it).
        self._stop_floor = 0
        self._hidden_ids = frozenset() if include_stop_str else frozenset(ending_ids)
        self._stop_token_ids = frozenset(stop_token_ids)
        self.stop_reason: int | str | None = None

    def _prompt_window(self, prompt_ids: Sequence[int]) -> List[int]:
        """The last prompt tokens the text is decoded after, starting at a character boundary.

        A window that starts inside a character (among its byte tokens) decodes those bytes as
        U+FFFD, and a byte-fallback decoder (SentencePiece's ``<0xE6>`` tokens) turns a whole run
        of byte tokens into U+FFFD when the run is not valid UTF-8, the output's own bytes
        included: "x 語" + "文字" came out as six U+FFFD.  So the window moves back, at most
        :data:`CHARACTER_TOKENS` tokens, until it no longer starts with one.
        """
        start = max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS)
        floor = max(0, start - CHARACTER_TOKENS)
        while start > floor and self._decode(prompt_ids[start:]).startswith("\ufffd"):
            start -= 1
        return list(prompt_ids[start:])

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, token_id: int) -> str:
        """Append a token; returns the text that may be shown now (possibly empty)."""
        if self.stopped:
            return ""
        self.outputs += 1
        if self.outputs == self.min_tokens + 1:
            self._stop_floor = len(self.text)
        if token_id in self._stop_token_ids:
            self.stop_reason = token_id
        if token_id in self._hidden_ids:
            return self._release()
        if token_id in self.shown_ids:
            # Skipped special tokens decode to nothing, so leaving this one out of the window
            # changes no neighbour's text; its own text is appended whole, after the bytes of a
            # character still held back (no token after a special token completes it: the
            # tokenizer decodes them as U+FFFD before the special token's text).
            if self.read_offset < len(self.ids):
                self._advance(self._text_after_window(len(self.ids)), len(self.ids))
            self.text += self.tokenizer.decode([token_id], skip_special_tokens=False)
            return self._release()
        self.ids.append(token_id)
        new_text = self._text_after_window(len(self.ids))
        if new_text and not new_text.endswith("\ufffd"):
            self._advance(new_text, len(self.ids))
        elif len(self.ids) - self.read_offset > MAX_HELD_TOKENS:
            self._release_invalid_bytes()
        return self._release()

    def _text_after_window(self, end: int) -> str:
        """The text ``ids[read_offset:end]`` adds after the window's tokens.

        Normally the window's text decoded with the new tokens, minus its text without them.  A
        byte-fallback decoder decodes a run of byte tokens as a whole, so new bytes that make an
        invalid run of the window's last character ("🎉" then a lone 0x80) change the window's own
        text into U+FFFD; then the new tokens are decoded alone, as the tokenizer decodes the
        output by itself (one U+FFFD, not four).
        """
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset : end])
        if full_text.startswith(prefix_text):
            return full_text[len(prefix_text) :]
        return self._decode(self.ids[self.read_offset : end])

    def _advance(self, new_text: str, read_to: int) -> None:
        self.text += new_text
        self.prefix_offset = self.read_offset
        self.read_offset = read_to

    def _release_invalid_bytes(self) -> None:
        """Let a run of tokens that never completes a character out (each invalid byte as U+FFFD).

        Without this the window would grow with every such token and each step decode all of it
        again (quadratic; a client can ask for such tokens with logit_bias).  A character is at
        most 4 bytes, so the last :data:`CHARACTER_TOKENS` tokens stay held back; the cut is put
        where the text does not end in U+FFFD when there is such a place, so a character that is
        still being completed is not split.
        """
        last = len(self.ids) - CHARACTER_TOKENS
        cuts = range(last, self.read_offset, -1)
        for cut in cuts:
            text = self._text_after_window(cut)
            if not text.endswith("\ufffd"):
                break
        else:
            cut = last
            text = self._text_after_window(cut)
        # Also when the run decodes to nothing (skipped special tokens): the window must not grow.
        self._advance(text, cut)

    def _release(self) -> str:
        if self.stop_sequences:
            found = self._find_stop() if self.outputs > self.min_tokens else None
            if found is not None:
                hit, stop = found
                self.stopped = True
                self.stop_reason = stop
                if self.include_stop_str:
                    hit += len(stop)
                piece = self.text[self.emitted : hit]
                self.text = self.text[:hit]
                self.emitted = hit
                return piece
            safe = len(self.text) - self._partial_stop_len()
        else:
            safe = len(self.text)
        piece = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return piece

    def _find_stop(self) -> Optional[Tuple[int, str]]:
        """Where the stop string that completes first starts, and which one it is.

        vLLM's rule: of the stop strings the new text completes, the one that ends earliest wins,
        ties going to the earlier one in the request's list (``["_args", "rg"]`` over ``"_args"``
        stops at ``"rg"``; ``["latin", "dedlatin"]`` at ``"latin"``), which is also what a client
        checking the text after every character would find first.
        """
        # Only text not yet released can contain a new stop string, and it must end past the floor.
        start = max(0, self.emitted - self._longest_stop)
        best: Optional[Tuple[int, int, str]] = None
        for stop in self.stop_sequences:
            # A stop string's first occurrence is also the one that ends first.
            position = self.text.find(stop, max(start, self._stop_floor - len(stop) + 1))
            if position >= 0 and (best is None or position + len(stop) < best[0]):
                best = (position + len(stop), position, stop)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self) -> int:
        longest = 0
        for stop in self.stop_sequences:
            for size in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:size]):
                    longest = max(longest, size)
                    break
        return longest

    def flush(self) -> str:
        """Release held-back text at the end of the request (no stop string completed).

        Tokens still held for an unfinished UTF-8 character will get no continuation: their
        bytes are let out as U+FFFD, so the whole text equals the tokenizer's decode of the
        output (as a client comparing the two expects) instead of losing them.
        """
        if self.stopped:
            return ""
        piece = ""
        if self.read_offset < len(self.ids):
            new_text = self._text_after_window(len(self.ids))
            if new_text:
                self._advance(new_text, len(self.ids))
                piece = self._release()
                if self.stopped:
                    return piece
        piece += self.text[self.emitted :]
        self.emitted = len(self.text)
        return piece

    def finish_reason_after_flush(self, reason: str) -> str:
        """The finish reason of a request that ended with ``reason``, once :meth:`flush` ran.

        The U+FFFD of an unfinished character let out by the flush can complete a stop string
        (``"\ufffd"``); the text is then cut there, so the request ended on that stop string
        ("stop", with :attr:`stop_reason`), not on its length.  An abort or an error stays one.
        """
        return "stop" if self.stopped and reason in ("length", "stop") else reason



def request_decoder(
    tokenizer: Any, prompt_ids: Sequence[int], options: TextOptions, eos_token_ids: Sequence[int]
) -> IncrementalDecoder:
    """The decoder of one request's output text from its options.

    The one place that maps request options to decoder settings: a normal server's detokenizer
    and the PD master (which decodes a generation across its segments) must produce the same
    text from the same tokens.
    """
    ending = list(options.stop_token_ids)
    if not options.ignore_eos and not options.print_eos_token:
        ending += eos_token_ids  # print_eos_token keeps the EOS text (LightLLM's native option)
    return IncrementalDecoder(
        tokenizer,
        prompt_ids,
        options.stop_sequences,
        skip_special_tokens=options.skip_special_tokens,
        include_stop_str=options.include_stop_str_in_output,
        shown_ids=eos_token_ids if options.print_eos_token else (),
        min_tokens=options.min_new_tokens,
        ending_ids=ending,
        stop_token_ids=reported_stop_ids(tokenizer, options, eos_token_ids),
    )


def reported_stop_ids(tokenizer: Any, options: TextOptions, eos_token_ids: Sequence[int]) -> list[int]:
    """The ending ids a choice names as its ``stop_reason`` (vLLM's rule).

    vLLM ends at the tokenizer's EOS with ``stop_reason`` null and treats every other end id, the
    checkpoint's ``generation_config`` ones included, as a stop token id that names itself; with
    ``ignore_eos`` only the request's own ``stop_token_ids`` end it, each naming itself.
    """
    if options.ignore_eos:
        return list(options.stop_token_ids)
    if options.print_eos_token:
        # LightLLM's native option shows the EOS text; no OpenAI choice reports it.
        return [t for t in options.stop_token_ids if t not in eos_token_ids]
    primary = getattr(tokenizer, "eos_token_id", None)
    return [t for t in dict.fromkeys([*options.stop_token_ids, *eos_token_ids]) if t != primary]
