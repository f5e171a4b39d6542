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

A compile that raises is a server fault (llguidance does not raise on a bad grammar: it returns a
matcher in error, which the first mask reports as the request's ``grammar_failed``), and it may
raise on one rank only (its tokenizer file unreadable for a moment).  So rank 0 decides: a
request whose compile raised on rank 0 is listed as failed in ``GrammarsReady`` and every rank
finishes it with ``FINISH_ERROR``; a rank whose own compile raised while rank 0's succeeded cannot
follow rank 0's tokens for it and raises :class:`GrammarCompileFailed` out of the step, which
stops the rank as a forward failure under tensor parallelism does.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from lightllm.common.sampling.grammar_limits import grammar_limits
from lightllm.common.sampling.grammar_vocabulary import grammar_tokenizer
from lightllm.server.model_rank.execution.grammar_compiler import GRAMMAR_CACHE_SIZE, GrammarCompiler, compile_error
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.utils.daemon_workers import DaemonWorkers

log = logging.getLogger("lightllm.structured_output")

# Bit positions of one int32 word of llguidance's packed token bitmask.
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarCompileFailed(RuntimeError):
    """A request's grammar compile raised on this rank although rank 0 released the request.

    Rank 0 releases a request only once its own compile succeeded, so this rank would have to
    sample a token rank 0 chose under a grammar it does not have: the ranks cannot stay in step,
    and the rank stops (see the module docstring).
    """

    def __init__(self, request_id: int, cause: BaseException) -> None:
        super().__init__(f"request {request_id}: its structured-output grammar could not be compiled on this rank "
                         f"though rank 0 compiled it ({str(cause) or type(cause).__name__})")
        self.request_id = request_id


class GrammarConstraints:
    """The matchers of the constrained requests of one rank, and its compiled grammars.

    Args:
        tokenizer_loader: the model's tokenizer (called on the compile thread, until it succeeds).
        eos_token_ids: the server's end-of-sequence ids.
        cache_size: distinct grammars kept compiled (see :data:`GRAMMAR_CACHE_SIZE`).
        workers: the compile thread; default: one of this instance's own (tests pass theirs).
        cancel_abandoned: cancel a compile no live request waits for any more (one rank only: see
            :mod:`~lightllm.server.model_rank.execution.grammar_compiler`).
    """

    def __init__(self, tokenizer_loader: Callable[[], Any], eos_token_ids: Sequence[int] = (),
                 cache_size: int = GRAMMAR_CACHE_SIZE, workers: Optional[DaemonWorkers] = None,
                 cancel_abandoned: bool = True):
        self._tokenizer_loader = tokenizer_loader
        # The server's end-of-sequence ids (--eos_id or the checkpoint's): a finished grammar ends
        # the output with one of them, not only with the tokenizer's own eos_token.
        self._eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        # The compile thread builds the tokenizer view with the first grammar; the loop may ask for
        # it meanwhile (another TP rank's first mask), and it must be built once.
        self._tokenizer_lock = threading.Lock()
        self.compiler = GrammarCompiler(self._build, cache_size, workers, cancel_abandoned)
        # request id -> (its grammar, the compile of its template), from intake until its matcher is
        # taken or it leaves; each entry counts as one waiter of the compile (GrammarCompiler.acquire).
        self._compiles: Dict[int, Tuple[str, Future]] = {}
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
        if self.constrained(req) and req.request_id not in self._matchers and req.request_id not in self._compiles:
            grammar = req.sampling.grammar
            self._compiles[req.request_id] = (grammar, self.compiler.acquire(grammar))

    def compiled(self, request_ids: Sequence[int]) -> Tuple[List[int], List[int]]:
        """Those of ``request_ids`` whose compile has ended here: ``(succeeded, raised)``, each in
        the given order; never waits.  A request with no compile in flight counts as succeeded."""
        succeeded: List[int] = []
        raised: List[int] = []
        for request_id in request_ids:
            entry = self._compiles.get(request_id)
            if entry is None:
                succeeded.append(request_id)
            elif entry[1].done():
                (raised if compile_error(entry[1]) is not None else succeeded).append(request_id)
        return succeeded, raised

    def _matcher(self, req: InferReq) -> Any:
        matcher = self._matchers.get(req.request_id)
        if matcher is None:
            if req.request_id not in self._compiles:  # a caller that never started it (its own engine, a test)
                self.start(req)
            grammar, compile_ = self._compiles.pop(req.request_id)
            # Rank 0 gets here after its compile succeeded; another rank may wait for its own here
            # (before the release: a compile still queued with no other waiter would be cancelled).
            error = compile_error(compile_)
            self.compiler.release(grammar, compile_)
            if error is not None:
                raise GrammarCompileFailed(req.request_id, error) from error
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

        A grammar fails there when it allows no next token at all (one that can never end runs
        into llguidance's limits, or a text the grammar cannot continue, or one llguidance could
        not parse): its request ends with an error, logged with the reason, instead of sampling
        from an empty row.  A compile that raised on this rank raises :class:`GrammarCompileFailed`
        (rank 0 finished the requests whose compile raised there before any mask).
        """
        rows = [row for row, req in enumerate(reqs) if self.constrained(req)]
        if not rows:
            return logits, set()
        # llguidance.numpy, not llguidance.torch: importing that one imports torch.compile's
        # machinery (4 s measured), which the first constrained request paid in the step.
        import llguidance.numpy as ll_numpy

        failed: Set[int] = set()
        matchers = [self._matcher(reqs[row]) for row in rows]
        packed = ll_numpy.allocate_token_bitmask(len(rows), self._tokenizer().vocab_size)
        for index, (row, matcher) in enumerate(zip(rows, matchers)):
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
        unconstrained ones.  A compile no other live request waits for and not started yet is
        cancelled; one running goes on, its template cached for the next request.  A compile that
        raised is logged here, on each rank where it did, once per request that asked for it."""
        self._matchers.pop(request_id, None)
        entry = self._compiles.pop(request_id, None)
        if entry is None:
            return
        grammar, compile_ = entry
        error = compile_error(compile_) if compile_.done() else None
        if error is not None:
            log.error("request %d: its structured-output grammar could not be compiled on this rank (%s)",
                      request_id, str(error) or type(error).__name__,
                      exc_info=(type(error), error, error.__traceback__))
        self.compiler.release(grammar, compile_)
