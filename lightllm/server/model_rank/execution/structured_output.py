"""Structured output: grammar-constrained decoding as a token mask before sampling.

A request whose ``SamplingParams.grammar`` is set (an llguidance grammar, e.g. compiled from a
JSON schema by the HTTP process) gets one ``llguidance.LLMatcher`` here.  Each step the
matchers of the batch's constrained rows fill a token bitmask, disallowed tokens' logits go to
``-inf`` (unconstrained rows in the same batch are untouched), and after sampling every
constrained request consumes its token; the grammar ending (or failing) finishes the request.

llguidance was chosen over xgrammar and outlines-core: all three are maintained Rust/C++ cores
with Python wheels, but llguidance computes masks lazily per step (no table of masks per grammar
state, which xgrammar and outlines build per schema up front), needs no GPU or compiler at run time,
and its wheel installs in seconds.  The tokenizer view is built on the first constrained
request, so servers that never see one pay nothing.

A matcher is a copy of its grammar's compiled template (:mod:`.grammar_compiler`): the compile
starts when the request joins the rank (:meth:`GrammarConstraints.start`, on every rank alike),
on the compile thread, and the request is not scheduled before rank 0's compile has finished
(``GrammarsReady``, see ``rank_process.py``).  Another TP rank whose own compile of the same
grammar is still running waits for it where it takes the matcher; every rank takes it in the
same step, so they wait at the same point and stay in step.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from lightllm.common.sampling.grammar_limits import grammar_limits
from lightllm.common.sampling.grammar_vocabulary import grammar_tokenizer
from lightllm.server.model_rank.execution.grammar_compiler import GRAMMAR_CACHE_SIZE, GrammarCompiler
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.utils.daemon_workers import DaemonWorkers

log = logging.getLogger("lightllm.structured_output")

# Bit positions of one int32 word of llguidance's packed token bitmask.
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarConstraints:
    """The matchers of the constrained requests of one rank, and its compiled grammars.

    Args:
        tokenizer_loader: the model's tokenizer (called on the compile thread, until it succeeds).
        eos_token_ids: the server's end-of-sequence ids.
        cache_size: distinct grammars kept compiled (see :data:`GRAMMAR_CACHE_SIZE`).
        workers: the compile thread; default: one of this instance's own (tests pass theirs).
    """

    def __init__(self, tokenizer_loader: Callable[[], Any], eos_token_ids: Sequence[int] = (),
                 cache_size: int = GRAMMAR_CACHE_SIZE, workers: Optional[DaemonWorkers] = None):
        self._tokenizer_loader = tokenizer_loader
        # The server's end-of-sequence ids (--eos_id or the checkpoint's): a finished grammar ends
        # the output with one of them, not only with the tokenizer's own eos_token.
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        # The compile thread builds the tokenizer view with the first grammar; the loop may ask for
        # it meanwhile (another TP rank's first mask), and it must be built once.
        self._tokenizer_lock = threading.Lock()
        self.compiler = GrammarCompiler(self._build, cache_size, workers)
        # request id -> its grammar's template, from intake until its matcher is taken.
        self._compiles: Dict[int, Future] = {}
        self._matchers: Dict[int, Any] = {}

    def _tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = grammar_tokenizer(self._tokenizer_loader(), self._eos_token_ids)
            return self._ll_tokenizer

    def _build(self, grammar: str) -> Any:
        """A grammar's template matcher (on the compile thread; never advanced, only copied)."""
        import llguidance

        return llguidance.LLMatcher(self._tokenizer(), grammar, limits=grammar_limits())

    def start(self, req: InferReq) -> None:
        """``req`` joined the rank: start compiling its grammar (cached: nothing to do); never waits."""
        if self.constrained(req) and req.request_id not in self._matchers:
            self._compiles[req.request_id] = self.compiler.compile(req.sampling.grammar)

    def compiled(self, request_ids: Sequence[int]) -> List[int]:
        """Those of ``request_ids`` whose compile has ended here, well or not (a failure shows in
        the request's first mask); never waits.  A request with no compile in flight counts as compiled."""
        compiles = self._compiles
        return [request_id for request_id in request_ids
                if request_id not in compiles or compiles[request_id].done()]

    def _matcher(self, req: InferReq) -> Any:
        matcher = self._matchers.get(req.request_id)
        if matcher is None:
            compile_ = self._compiles.pop(req.request_id, None)
            if compile_ is None:  # a caller that never started it (its own engine, a test)
                compile_ = self.compiler.compile(req.sampling.grammar)
            # Rank 0 gets here after its compile ended; another rank may wait for its own here.
            matcher = compile_.result().deep_copy()
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

        A grammar fails there when its compile failed on this rank, or when it allows no next
        token at all (one that can never end runs into llguidance's limits, or a text the grammar
        cannot continue): its request ends with an error, logged with the reason, instead of
        sampling from an empty row.
        """
        rows = [row for row, req in enumerate(reqs) if self.constrained(req)]
        if not rows:
            return logits, set()
        # llguidance.numpy, not llguidance.torch: importing that one imports torch.compile's
        # machinery (4 s measured), which the first constrained request paid in the step.
        import llguidance.numpy as ll_numpy

        failed: Set[int] = set()
        matchers = [self._matcher_or_failure(reqs[row], failed) for row in rows]
        if all(matcher is None for matcher in matchers):  # no tokenizer view may exist (it failed to load)
            return logits, failed
        packed = ll_numpy.allocate_token_bitmask(len(rows), self._tokenizer().vocab_size)
        for index, (row, matcher) in enumerate(zip(rows, matchers)):
            if matcher is None:
                continue
            ll_numpy.fill_next_token_bitmask(matcher, packed, index)
            if matcher.is_error():
                req = reqs[row]
                failed.add(req.request_id)
                reason = (matcher.get_error() or "no token allowed").strip().splitlines()[0]
                log.warning("request %d: its structured-output grammar allows no token after %d output tokens "
                            "(%s); finishing it with an error", req.request_id, len(req.output_ids), reason)
        bitmask = torch.from_numpy(packed)
        allowed = ((bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1).bool().reshape(len(rows), -1)
        width = logits.shape[1]
        allowed = allowed[:, :width]
        if allowed.shape[1] < width:  # model rows past the tokenizer's vocabulary are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
        masked = logits.clone()
        row_index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        masked[row_index] = masked[row_index].masked_fill(~allowed.to(logits.device), float("-inf"))
        return masked, failed

    def _matcher_or_failure(self, req: InferReq, failed: Set[int]) -> Any:
        """``req``'s matcher, or None (its id added to ``failed``, the reason logged) when its compile failed."""
        try:
            return self._matcher(req)
        except Exception as exc:  # noqa: BLE001 - the request's compile failed: it alone ends
            failed.add(req.request_id)
            log.warning("request %d: its structured-output grammar could not be compiled on this rank (%s); "
                        "finishing it with an error", req.request_id, str(exc) or type(exc).__name__)
            return None

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
        """Drop the matcher (or the compile it waits for) of a request that left; no-op for
        unconstrained ones.  A compile in flight goes on: its template is cached for the next request."""
        self._matchers.pop(request_id, None)
        self._compiles.pop(request_id, None)
