"""The vocabulary llguidance's matchers see: the checkpoint's tokens, special only where the
tokenizer says so.

``llguidance.hf.from_tokenizer`` marks an added token as special when its text looks like a tag
(``<tool_call>``, ``<think>``, whatever the tokenizer's ``special`` flag says), and then its own
matcher disagrees with itself: when a grammar leaves one possible text, the mask allows the
token the tokenizer splits that text into (``<tool_call>`` is one added token in Qwen2.5, as
``<think>`` is in Qwen3), and consuming that token fails because a special token is no text.  A
request whose grammar forces such a text ended with an error after generating.  vLLM's default
grammar backend (xgrammar) treats added tokens that are not special as their text, and so does
this vocabulary: it keeps llguidance's bytes of every token and only the special flags are the
tokenizer's own (``all_special_ids`` and the added tokens flagged ``special``).

Texts are tokenized by llguidance's own tokenizer, except the text of a special token, which is
spelled with ordinary tokens: a grammar's text never stands for a special token, so ``<s>`` or
``<|im_start|>`` forced by a grammar is produced as characters, as xgrammar does.
"""

from __future__ import annotations

import re
from typing import Any, FrozenSet, List, Optional, Sequence

from lightllm.utils.tokenizer_utils import tokenizer_special_ids


class GrammarVocabulary:
    """A ``llguidance.TokenizerWrapper`` source: token bytes, special ids and a text tokenizer.

    Args:
        base: the ``LLTokenizer`` llguidance builds from the checkpoint's tokenizer (bytes and
            tokenization come from it).
        special_ids: the tokenizer's special ids (:func:`tokenizer_special_ids`).
        eos_token_id: the tokenizer's end-of-sequence id.
        bos_token_id: its beginning-of-sequence id, if any.
    """

    def __init__(self, base: Any, special_ids: FrozenSet[int], eos_token_id: int,
                 bos_token_id: Optional[int]) -> None:
        self._base = base
        self.tokens: List[bytes] = [base.decode_bytes([token_id]) for token_id in range(base.vocab_size)]
        self.special_token_ids: List[int] = sorted(i for i in special_ids if 0 <= i < base.vocab_size)
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        texts = sorted({self.tokens[i].decode("utf-8", "replace") for i in self.special_token_ids} - {""},
                       key=len, reverse=True)
        # Longest first, so a special text that contains a shorter one is cut whole.
        self._special_text = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None

    def __call__(self, text: str) -> List[int]:
        """Token ids of ``text``; a special token's text is spelled with ordinary tokens."""
        if isinstance(text, bytes):
            # llguidance probes whether the tokenizer takes bytes; this one takes text.
            raise TypeError("GrammarVocabulary tokenizes str, not bytes")
        if self._special_text is None:
            return list(self._base.tokenize_str(text))
        ids: List[int] = []
        for index, part in enumerate(self._special_text.split(text)):
            if not part:
                continue
            # split() with one group alternates plain text (even) and a special token's text (odd).
            ids.extend(self._base.greedy_tokenize(part) if index % 2 else self._base.tokenize_str(part))
        return ids


def grammar_tokenizer(tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> Any:
    """The ``llguidance.LLTokenizer`` the server's matchers use (see the module docstring).

    ``eos_token_ids``: the server's end-of-sequence ids; a finished grammar ends with one of them.
    """
    import llguidance
    import llguidance.hf

    eos = list(eos_token_ids) or None
    base = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
    vocabulary = GrammarVocabulary(base, tokenizer_special_ids(tokenizer), base.eos_token,
                                   getattr(tokenizer, "bos_token_id", None))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), eos_token=eos or base.eos_token)
