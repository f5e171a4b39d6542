"""``add_special_tokens: true`` on chat: the tokenizer's special tokens around a rendered chat.

vLLM renders a chat with its template and tokenizes the text with ``add_special_tokens`` (default
false: the template writes BOS itself; true adds the tokenizer's BOS/EOS on top of it).  The
served model's ``encode_chat`` (a request manager's ``served``) tokenizes the rendered text without
them, so the HTTP layer adds them here, where both a normal server and a PD master answer the same way.

The tokens a tokenizer adds come from its post-processor (a fast tokenizer's ``TemplateProcessing``,
``BertProcessing``, ``RobertaProcessing``; a slow one's ``build_inputs_with_special_tokens``): a
fixed run of ids before the text's own ids and one after, whatever the text.  :func:`special_token_frame`
reads that frame once by tokenizing probe texts both ways, so ``frame.apply(tokenize(text, False))``
equals ``tokenize(text, True)``; a tokenizer whose probes disagree (special tokens that depend on
the text) has no frame, and the request is refused rather than tokenized differently from vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightllm.server.http.errors import invalid_request

# Ordinary text in any vocabulary; two probes of different lengths so a frame cannot fit by chance.
PROBES = ("a", "hello world 12")


@dataclass(frozen=True)
class SpecialTokenFrame:
    """The ids a tokenizer puts before and after a text's own ids when adding special tokens."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    def apply(self, ids: list[int]) -> list[int]:
        """``ids`` (tokenized without special tokens) as the tokenizer would give them with."""
        return [*self.prefix, *ids, *self.suffix]

    def strip(self, ids: list[int]) -> list[int]:
        """``ids`` without the prefix and suffix when they :meth:`frames` them, else as given: the
        text's own ids of a prompt tokenized with special tokens."""
        if not self.frames(ids):
            return ids
        return ids[len(self.prefix):len(ids) - len(self.suffix)]

    def frames(self, ids: list[int]) -> bool:
        """True when ``ids`` begin with the prefix and end with the suffix (room for both)."""
        edges = len(self.prefix) + len(self.suffix)
        return len(ids) >= edges and tuple(ids[:len(self.prefix)]) == self.prefix \
            and tuple(ids[len(ids) - len(self.suffix):]) == self.suffix


def _ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"])


def _frame_of(plain: list[int], full: list[int]) -> Optional[SpecialTokenFrame]:
    """The frame that turns ``plain`` into ``full``, or None when none or several do."""
    extra = len(full) - len(plain)
    if extra < 0:
        return None
    fits = [start for start in range(extra + 1) if full[start:start + len(plain)] == plain]
    if len(fits) != 1:
        return None
    start = fits[0]
    return SpecialTokenFrame(tuple(full[:start]), tuple(full[start + len(plain):]))


def special_token_frame(tokenizer: Any) -> Optional[SpecialTokenFrame]:
    """The special tokens ``tokenizer`` adds around any text, or None if they are not the same for every probe."""
    frames = {_frame_of(_ids(tokenizer, probe, False), _ids(tokenizer, probe, True)) for probe in PROBES}
    if len(frames) != 1:
        return None
    return frames.pop()


def add_special_tokens(frame: Optional[SpecialTokenFrame], ids: list[int], param: str) -> list[int]:
    """``ids`` of a rendered chat with the tokenizer's special tokens added; 400 naming ``param``
    when the tokenizer has no fixed frame (see :func:`special_token_frame`)."""
    if frame is None:
        raise invalid_request("add_special_tokens: true is not supported for chats on this model: its tokenizer's "
                              "special tokens depend on the text, so they cannot be added to a rendered chat", param)
    return frame.apply(ids)
