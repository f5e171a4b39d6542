"""Whether the structured-output engine can read the served model's tokenizer, found out once.

llguidance builds its token view from a fast tokenizer's JSON and knows the decoders that map
tokens to bytes (byte-level BPE, byte fallback with word marks); a tokenizer it cannot read (a
WordPiece decoder, a slow tokenizer) makes every grammar unusable.  The model rank would find out
only after admission and end the request with a server error, so the request manager asks first,
on the first request that carries a grammar, and the HTTP layer refuses such requests with a 400
naming the field that asked for structured output.  Servers that never see a grammar pay nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional, Sequence

from lightllm.common.sampling.grammar_vocabulary import grammar_tokenizer

log = logging.getLogger(__name__)


class GrammarTokenizerCheck:
    """Builds the model rank's grammar tokenizer view once, to learn whether it can be built.

    Args:
        tokenizer: the served model's tokenizer.
        eos_token_ids: the server's end-of-sequence ids (as the model rank passes them).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._checked = False
        self._problem: Optional[str] = None

    def problem(self) -> Optional[str]:
        """Why grammars cannot run with this tokenizer, or None.  Blocking (about a second for a
        150K vocabulary, once): call it on a tokenizer thread."""
        with self._lock:
            if not self._checked:
                try:
                    grammar_tokenizer(self._tokenizer, self._eos_token_ids)
                except Exception as exc:  # noqa: BLE001 - any failure means the rank's would fail too
                    self._problem = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    log.warning("structured output is not available with this model's tokenizer: %s", self._problem)
                self._checked = True
            return self._problem
