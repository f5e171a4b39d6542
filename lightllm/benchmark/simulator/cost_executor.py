"""The simulator's :class:`ModelExecutor`: a cost model instead of a forward pass.

Every request that completes its pending tokens gets token :data:`SAMPLED_TOKEN_ID`; the call
takes the virtual time the :class:`CostProfile` gives for the batch.  Scheduling never looks at
token values, so the engine makes the same decisions as with the real model.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from lightllm.benchmark.simulator.cost_model import CostProfile
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.model_executor import ExecutionResult, SampledToken
from lightllm.server.model_rank.scheduling.step_planner import PrefillChunk

# The simulator never looks at token values; every sampled token is this id.
SAMPLED_TOKEN_ID = 0


class CostModelExecutor:
    """Virtual-time forwards; ``last_prefill_seconds`` / ``last_decode_seconds`` hold the latest costs."""

    # Simulated requests carry no sampling parameters or grammar; nothing is out of vocabulary.
    vocab_size = 1 << 31
    grammar_enabled = False

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile
        self.last_prefill_seconds = 0.0
        self.last_decode_seconds = 0.0

    def prefill(self, chunks: Sequence[PrefillChunk]) -> ExecutionResult:
        """Cost of the chunks; a token for each chunk that ends its request's pending tokens."""
        seconds = self.profile.prefill_seconds([(chunk.token_num, chunk.end) for chunk in chunks])
        self.last_prefill_seconds = seconds
        sampled = [SampledToken(c.req, SAMPLED_TOKEN_ID, 0.0) for c in chunks if c.end == c.req.total_len]
        return ExecutionResult(sampled=sampled, forward_seconds=seconds)

    def decode(self, reqs: Sequence[InferReq]) -> ExecutionResult:
        """Cost of one decode step over ``reqs`` (their context includes the token computed now)."""
        seconds = self.profile.decode_seconds(len(reqs), sum(req.cur_kv_len + 1 for req in reqs))
        self.last_decode_seconds = seconds
        return ExecutionResult(sampled=[SampledToken(r, SAMPLED_TOKEN_ID, 0.0) for r in reqs], forward_seconds=seconds)

    def start_grammar(self, req: InferReq) -> None:
        """Nothing to compile: the simulator runs no grammar (a server refuses such requests here,
        ``grammar_enabled`` being False; a test joining one directly sees it held until released)."""

    def grammars_compiled(self, request_ids: Sequence[int]) -> Tuple[List[int], List[int]]:
        """No compiles: every request counts as compiled, none failed."""
        return list(request_ids), []

    def forget(self, req: InferReq) -> None:
        """No per-request state."""
