"""The model rank's :class:`~.model_executor.ModelExecutor`: batches, forward, sampling.

One request never takes the rank down: a request whose sampling fails (``row_sampling.py``) or
whose structured-output mask fails is returned as failed and the rest of the batch goes on.
Under tensor parallelism rank 0's sampled tokens are broadcast, and a failed row travels as
token ``-1``, so every rank fails the same requests; a rank whose own mask failed where rank 0's
did not cannot follow rank 0's token under a grammar it has no matcher for, and raises (as does a
grammar compile that raised on this rank only: ``GrammarCompileFailed``).  A failing forward pass fails the requests
of that batch on a single rank; with several ranks it cannot be recovered (their collectives
would be out of step) and is raised, as is a forward that keeps failing step after step (the
model or device is broken, not a request).
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer
from lightllm.common.sampling.sampler import Sampler
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.execution.forward_cost import attended_positions
from lightllm.server.model_rank.execution.forward_threads import ForwardThreads
from lightllm.server.model_rank.scheduling.model_executor import ExecutionResult, SampledToken
from lightllm.server.model_rank.execution.prompt_logprobs import collect_prompt_logprobs, prefill_logit_rows
from lightllm.server.model_rank.execution.row_sampling import FAILED_TOKEN, sample_rows
from lightllm.server.model_rank.scheduling.step_planner import PrefillChunk
from lightllm.server.model_rank.execution.structured_output import GrammarCompileFailed, GrammarConstraints

TokenSync = Callable[[torch.Tensor], torch.Tensor]

log = logging.getLogger("lightllm.model_rank")

MAX_CONSECUTIVE_FORWARD_FAILURES = 3


def _prefill_size(chunks: Sequence[PrefillChunk]) -> Tuple[int, int, int]:
    """New tokens, (token, attended position) pairs and finished prompts of a prefill forward."""
    new_tokens = attended = finished = 0
    for c in chunks:
        n = c.end - c.start
        new_tokens += n
        attended += attended_positions(c.start, n)
        finished += c.end == c.req.total_len
    return new_tokens, attended, finished


class TorchModelExecutor:
    """Runs forwards of a :class:`DecoderOnlyTransformer` over the token-slot KV cache.

    Args:
        model: this rank's model shard.
        context: the KV view the engine reserved slots in (the executor reads the slots back).
        sampler: the rank's sampler.
        eos_token_ids: for penalties and ``min_new_tokens``.
        token_sync: under tensor parallelism, shares rank 0's sampled tokens with every rank.
        grammar: structured output; None refuses requests that carry a grammar.
        threads: a CPU rank's torch threads per kind of forward; None: never changed here.
    """

    def __init__(
        self,
        model: DecoderOnlyTransformer,
        context: InferenceContext,
        sampler: Sampler,
        eos_token_ids: Sequence[int],
        token_sync: Optional[TokenSync] = None,
        grammar: Optional[GrammarConstraints] = None,
        threads: Optional[ForwardThreads] = None,
    ) -> None:
        self.model = model
        self.context = context
        self.sampler = sampler
        self.eos_token_ids = list(eos_token_ids)
        self.token_sync = token_sync
        self.grammar = grammar
        self.vocab_size = model.vocab_size
        self.grammar_enabled = grammar is not None
        self._forward_failures = 0
        self.threads = threads

    def prefill(self, chunks: Sequence[PrefillChunk]) -> ExecutionResult:
        """One forward over every chunk; sample where a chunk completes its request."""
        slots = torch.cat([self.context.slots(c.req, c.start, c.end) for c in chunks])
        batch = ForwardBatch.build(
            [c.req.token_slice(c.start, c.end) for c in chunks],
            [c.start for c in chunks],
            [c.req.req_row for c in chunks],
            slots,
            self.model.device,
            # Dynamic NTK RoPE: a prompt token scales by the original prompt's length, a token
            # generated earlier (re-prefilled after a pause, or a PD continuation) by the length it made.
            rope_lengths=[c.req.input_len - c.req.generated_before for c in chunks],
        )
        last_rows, prompt_rows = prefill_logit_rows(batch, chunks)
        result = ExecutionResult()
        # Prompt log-probabilities and sampling run under the forward's thread count (see decode).
        with nullcontext() if self.threads is None else self.threads.prefill_forward(*_prefill_size(chunks)):
            logits = self._forward(batch, [c.req for c in chunks], result)
            if logits is None:
                return result
            result.prompt_logprobs = collect_prompt_logprobs(logits, prompt_rows)
            done = [(row, c.req) for row, c in zip(last_rows, chunks) if c.end == c.req.total_len]
            if done:
                self._sample(logits[[row for row, _ in done]], [req for _, req in done], result)
        return result

    def decode(self, reqs: Sequence[InferReq]) -> ExecutionResult:
        """One forward computing each request's pending token; sample the next one."""
        positions = [req.cur_kv_len for req in reqs]
        rows = [req.req_row for req in reqs]
        req_to_token = self.context.req_manager.req_to_token
        slots = req_to_token[torch.tensor(rows, device=req_to_token.device), torch.tensor(positions, device=req_to_token.device)]
        batch = ForwardBatch.build(
            [[req.token_at(position)] for req, position in zip(reqs, positions)],
            positions,
            rows,
            slots,
            self.model.device,
        )
        result = ExecutionResult()
        # Sampling runs under the forward's thread count: its arg-max and log-softmax over every
        # row's vocabulary halve on two threads (0.65 against 1.4 ms for 64 rows of a 16K
        # vocabulary), and the front end has none of this step's tokens to stream until it ends.
        with nullcontext() if self.threads is None else self.threads.decode_forward(len(reqs), sum(positions)):
            logits = self._forward(batch, list(reqs), result)
            if logits is not None:
                self._sample(logits, list(reqs), result)
        return result

    def start_grammar(self, req: InferReq) -> None:
        """Start compiling ``req``'s grammar on the compile thread (see :class:`GrammarConstraints`)."""
        if self.grammar is not None:
            self.grammar.start(req)

    def grammars_compiled(self, request_ids: Sequence[int]) -> Tuple[List[int], List[int]]:
        """Those of ``request_ids`` whose grammar compile has ended on this rank, ``(succeeded,
        raised)``; never waits."""
        return self.grammar.compiled(request_ids) if self.grammar is not None else (list(request_ids), [])

    def forget(self, req: InferReq) -> None:
        """Drop the request's grammar matcher."""
        if self.grammar is not None:
            self.grammar.forget_request(req.request_id)

    # --- internals -----------------------------------------------------------------------------
    def _forward(self, batch: ForwardBatch, reqs: List[InferReq], result: ExecutionResult) -> Optional[torch.Tensor]:
        started = time.perf_counter()
        try:
            logits = self.model.forward(batch, self.context.kv_cache, self.context.req_manager.req_to_token)
        except Exception:
            self._forward_failures += 1
            if self.token_sync is not None or self._forward_failures >= MAX_CONSECUTIVE_FORWARD_FAILURES:
                raise
            log.exception("forward pass failed; finishing its %d request(s) with an error", len(reqs))
            result.failed.extend(reqs)
            return None
        finally:
            result.forward_seconds += time.perf_counter() - started
        self._forward_failures = 0
        return logits

    def _sample(self, logits: torch.Tensor, reqs: List[InferReq], result: ExecutionResult) -> None:
        started = time.perf_counter()
        # Two kinds of failure: llguidance saying a grammar cannot go on (the request's own input)
        # and the mask code raising (a server fault; every constrained row of the batch fails).
        grammar_failed: set[int] = set()
        mask_broken: set[int] = set()
        if self.grammar is not None:
            try:
                logits, grammar_failed = self.grammar.mask(logits, reqs)
            except GrammarCompileFailed:
                raise  # rank 0 released the request with its grammar compiled: this rank cannot follow
            except Exception:  # noqa: BLE001 - a broken mask fails its requests, not the batch
                log.exception("structured-output mask failed; finishing the constrained requests with an error")
                mask_broken = {r.request_id for r in reqs if self.grammar.constrained(r)}
        tokens, logprobs, tops = sample_rows(self.sampler, logits, reqs, self.eos_token_ids)
        if mask_broken:  # travels as a failed row, so under TP rank 0's mask decides for every rank
            broken_rows = [row for row, req in enumerate(reqs) if req.request_id in mask_broken]
            tokens[torch.tensor(broken_rows, device=tokens.device)] = FAILED_TOKEN
        if self.token_sync is not None:
            tokens = self.token_sync(tokens)
        for req, token, logprob, top in zip(reqs, tokens.tolist(), logprobs, tops):
            if token == FAILED_TOKEN:
                result.failed.append(req)
                continue
            if req.request_id in mask_broken:
                raise RuntimeError(f"request {req.request_id}: the structured-output mask failed on this rank but "
                                   "not on rank 0, whose token this rank cannot follow without the grammar")
            if req.request_id in grammar_failed:
                result.grammar_failed.append(req)
                continue
            grammar_end = self.grammar.accept(req, token) if self.grammar is not None else None
            result.sampled.append(SampledToken(req, token, logprob, top, grammar_end))
        result.sample_seconds += time.perf_counter() - started
