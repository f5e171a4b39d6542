"""The client's text of a PD generation, decoded by the master over every segment.

A node's detokenizer sees one segment only: a continuation segment's earlier output is its
prompt.  A segment that ends inside a multi-byte UTF-8 character (or inside a stop string)
would leave the node that ended it flushing the partial bytes as replacement characters while
the next segment's node treats them as prompt.  So the master ignores the nodes' ``text`` and
decodes the token ids itself, from the client's prompt on, with the normal server's
detokenizer rules (:func:`~lightllm.server.detokenization.incremental_decoder.request_decoder`):
the same held-back bytes, special-token handling and stop strings, whatever the segment
boundaries.

Stop strings are decided here, as a normal server's detokenizer decides them: the token that
completes one ends the request with ``finish_reason`` ``stop`` (the master then closes the node
streams, which aborts the request on the nodes), and text held back at a node's finish is
released with that finish.
"""

from __future__ import annotations

from typing import Sequence

from lightllm.common.sampling import SamplingParams
from lightllm.server.detokenization.incremental_decoder import request_decoder
from lightllm.server.request_manager import GenerationEvent


class GenerationText:
    """Rewrites the text of a generation's events as one decoder over all its segments.

    Args:
        tokenizer: the served model's tokenizer (the one the nodes' detokenizers load).
        prompt_ids: the client's prompt (not a continuation segment's).
        params: the client's sampling parameters (stop strings and text options).
        eos_token_ids: the model's EOS ids (kept in the text with ``print_eos_token``).
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: Sequence[int]) -> None:
        self._decoder = request_decoder(tokenizer, prompt_ids, params, eos_token_ids)

    @property
    def stopped(self) -> bool:
        """A stop string completed: the request ends at the event that completed it."""
        return self._decoder.stopped

    def apply(self, event: GenerationEvent) -> None:
        """Set ``event.text`` to the text the client gets now; ``finish_reason`` ``stop`` on a stop string,
        and ``stop_reason`` on a stop (the string or the stop token id).

        A token-less finish (``token_id`` < 0) and any finishing event carry the text still
        held back (a partial stop string), as the detokenizer releases it at a request's end.
        """
        if event.token_id >= 0:
            event.text = self._decoder.add(event.token_id)
            if self._decoder.stopped:
                event.finish_reason = "stop"
                event.stop_reason = self._decoder.stop_reason
                return
        else:
            event.text = ""
        if event.finish_reason:
            event.text += self._decoder.flush()
            event.finish_reason = self._decoder.finish_reason_after_flush(event.finish_reason)
            if event.finish_reason == "stop":
                event.stop_reason = self._decoder.stop_reason
