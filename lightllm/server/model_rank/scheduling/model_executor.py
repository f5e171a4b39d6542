"""The seam between the pure-Python step engine and whatever computes the tokens.

The step engine decides *what* runs; a :class:`ModelExecutor` runs it.  On a model rank that is
:class:`~.torch_executor.TorchModelExecutor` (batch building, forward, sampling, structured-output
masks, prompt logprobs, tensor-parallel token sharing); in the scheduling simulator it is a cost
model that advances virtual time.  The engine has already reserved KV for every position a call
computes (``req.kv_slot_len`` covers them) and advances ``cur_kv_len`` itself once the call
returns, so an executor only reads requests and never changes their scheduling state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Protocol, Sequence, Tuple

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.step_planner import PrefillChunk

# ``(position, logprob, top)`` of one prompt token (see ``prompt_logprobs.py``).
PromptLogprobEntry = Tuple[int, float, List[Tuple[int, float]], int]


@dataclass
class SampledToken:
    """The next token of one request.

    Attributes:
        req: the request.
        token_id: the sampled token.
        logprob: its log-probability.
        top: the most likely alternatives ``(token_id, logprob)`` when the request asked for them.
        grammar_end: ``"stop"`` when the request's grammar is complete, ``"error"`` when the
            grammar could not go on past the token, ``None`` otherwise (and for unconstrained requests).
    """

    req: InferReq
    token_id: int
    logprob: float
    top: List[Tuple[int, float]] = field(default_factory=list)
    grammar_end: Optional[str] = None


@dataclass
class ExecutionResult:
    """What one forward produced.

    Attributes:
        sampled: the next token of every request that got one, in batch order (a prefill chunk
            samples only when it completes its request's pending tokens).
        failed: requests whose forward or sampling failed; the engine finishes them with an
            error.  When the whole forward failed this holds every request of the call and
            ``sampled`` is empty.
        grammar_failed: requests whose structured-output grammar allows no next token (the
            grammar's fault, not the server's); the engine finishes them with ``FINISH_GRAMMAR_FAILED``.
        prompt_logprobs: ``(request, entries)`` computed by this forward, for requests that
            asked for prompt logprobs.
        forward_seconds: time spent in the forward (virtual seconds in the simulator).
        sample_seconds: time spent sampling.
    """

    sampled: List[SampledToken] = field(default_factory=list)
    failed: List[InferReq] = field(default_factory=list)
    grammar_failed: List[InferReq] = field(default_factory=list)
    prompt_logprobs: List[Tuple[InferReq, List[PromptLogprobEntry]]] = field(default_factory=list)
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0


class ModelExecutor(Protocol):
    """Runs the forwards the step engine planned (see the module docstring).

    ``vocab_size`` and ``grammar_enabled`` feed the admission check (token ids in range,
    structured output available); :meth:`start_grammar` and :meth:`grammars_compiled` serve the
    engine's grammar hold (a constrained request waits for its compile, the others do not).
    """

    vocab_size: int
    grammar_enabled: bool

    def prefill(self, chunks: Sequence[PrefillChunk]) -> ExecutionResult:
        """Compute ``chunks`` in one forward; sample for every chunk that ends its request's pending tokens."""

    def decode(self, reqs: Sequence[InferReq]) -> ExecutionResult:
        """Compute the one pending token of each request and sample the next."""

    def start_grammar(self, req: InferReq) -> None:
        """``req``, a constrained request, joined: start compiling its grammar without waiting for it.

        Only called where ``grammar_enabled`` (admission refuses constrained requests elsewhere).
        """

    def grammars_compiled(self, request_ids: Sequence[int]) -> Tuple[List[int], List[int]]:
        """Those of ``request_ids`` whose grammar compile has ended here, as ``(succeeded, raised)``
        (each in the given order); never waits."""

    def forget(self, req: InferReq) -> None:
        """``req`` left the engine: drop any per-request state (grammar matchers, ...)."""
