"""Structured output: grammar-constrained decoding as a token mask before sampling.

A request whose ``SamplingParams.grammar`` is set (an llguidance grammar, e.g. compiled from a
JSON schema by the HTTP process) gets one ``llguidance.LLMatcher`` here.  Each step the
matchers of the batch's constrained rows fill a token bitmask, disallowed tokens' logits go to
``-inf`` (unconstrained rows in the same batch are untouched), and after sampling every
constrained request consumes its token; the grammar ending (or failing) finishes the request.

llguidance was chosen over xgrammar and outlines-core: all three are maintained Rust/C++ cores
with Python wheels, but llguidance computes masks lazily per step (no grammar precompilation,
which xgrammar and outlines pay per schema up front), needs no GPU or compiler at run time,
and its wheel installs in seconds.  The tokenizer view is built on the first constrained
request, so servers that never see one pay nothing.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from lightllm.common.sampling.grammar_limits import grammar_limits
from lightllm.common.sampling.grammar_vocabulary import grammar_tokenizer
from lightllm.server.model_rank.scheduling.infer_req import InferReq

log = logging.getLogger("lightllm.structured_output")

# Bit positions of one int32 word of llguidance's packed token bitmask.
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarConstraints:
    """The matchers of the constrained requests of one rank."""

    def __init__(self, tokenizer_loader: Callable[[], Any], eos_token_ids: Sequence[int] = ()):
        self._tokenizer_loader = tokenizer_loader
        # The server's end-of-sequence ids (--eos_id or the checkpoint's): a finished grammar ends
        # the output with one of them, not only with the tokenizer's own eos_token.
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._matchers: Dict[int, Any] = {}

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = grammar_tokenizer(self._tokenizer_loader(), self._eos_token_ids)
        return self._ll_tokenizer

    def _matcher(self, req: InferReq) -> Any:
        matcher = self._matchers.get(req.request_id)
        if matcher is None:
            import llguidance

            matcher = llguidance.LLMatcher(self._tokenizer(), req.sampling.grammar, limits=grammar_limits())
            # A request prefilled again after a pause keeps its matcher; a new one starts here,
            # past the output earlier segments generated (the prompt's tail) and this one's.
            earlier = req.prompt_ids[len(req.prompt_ids) - req.generated_before:] if req.generated_before else []
            if earlier or req.output_ids:
                matcher.consume_tokens(list(earlier) + list(req.output_ids))
            self._matchers[req.request_id] = matcher
        return matcher

    @staticmethod
    def constrained(req: InferReq) -> bool:
        """Whether ``req`` asked for structured output."""
        return req.sampling is not None and req.sampling.grammar is not None

    def mask(self, logits: torch.Tensor, reqs: List[InferReq]) -> Tuple[torch.Tensor, Set[int]]:
        """``logits`` with tokens the grammar forbids at ``-inf`` on constrained rows (a copy if
        any), and the ids of the requests whose grammar failed while computing its mask.

        A grammar fails there when it allows no next token at all (one that can never end runs
        into llguidance's limits, or a text the grammar cannot continue): its request ends with
        an error, logged with llguidance's reason, instead of sampling from an empty row.
        """
        rows = [row for row, req in enumerate(reqs) if self.constrained(req)]
        if not rows:
            return logits, set()
        import llguidance.torch as ll_torch

        tokenizer = self._tokenizer()
        bitmask = ll_torch.allocate_token_bitmask(len(rows), tokenizer.vocab_size)
        failed: Set[int] = set()
        for index, row in enumerate(rows):
            matcher = self._matcher(reqs[row])
            ll_torch.fill_next_token_bitmask(matcher, bitmask, index)
            if matcher.is_error():
                req = reqs[row]
                failed.add(req.request_id)
                reason = (matcher.get_error() or "no token allowed").strip().splitlines()[0]
                log.warning("request %d: its structured-output grammar allows no token after %d output tokens "
                            "(%s); finishing it with an error", req.request_id, len(req.output_ids), reason)
        allowed = ((bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1).bool().reshape(len(rows), -1)
        width = logits.shape[1]
        allowed = allowed[:, :width]
        if allowed.shape[1] < width:  # model rows past the tokenizer's vocabulary are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
        masked = logits.clone()
        row_index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        masked[row_index] = masked[row_index].masked_fill(~allowed.to(logits.device), float("-inf"))
        return masked, failed

    def accept(self, req: InferReq, token: int) -> Optional[str]:
        """Advance ``req``'s matcher; returns "stop" when the grammar ended, "error" when it failed."""
        if not self.constrained(req):
            return None
        matcher = self._matcher(req)
        matcher.consume_token(token)
        if matcher.is_error():
            log.warning("request %d: token %d does not continue its structured-output grammar (%s); finishing it "
                        "with an error", req.request_id, token,
                        (matcher.get_error() or "rejected").strip().splitlines()[0])
            return "error"
        if matcher.is_stopped():
            return "stop"
        return None

    def forget_request(self, request_id: int) -> None:
        """Drop the matcher of a request that left (no-op for unconstrained ones)."""
        self._matchers.pop(request_id, None)
