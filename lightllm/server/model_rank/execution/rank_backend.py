"""Assembles the backend a model rank runs: the mode's class, the torch executor, the slot KV cache."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer
from lightllm.common.sampling.sampler import Sampler
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.backend_registry import ModeBackend, build_backend
from lightllm.server.model_rank.execution.forward_threads import ForwardThreads
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import PrefillQueueStrategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.execution.structured_output import GrammarConstraints
from lightllm.server.model_rank.execution.torch_executor import TokenSync, TorchModelExecutor


def build_rank_backend(
    run_mode: str,
    model: DecoderOnlyTransformer,
    context: InferenceContext,
    strategy: PrefillQueueStrategy,
    planner: StepPlanner,
    sampler: Sampler,
    eos_token_ids: Sequence[int],
    max_req_total_len: int,
    token_sync: Optional[TokenSync] = None,
    grammar: Optional[GrammarConstraints] = None,
    threads: Optional[ForwardThreads] = None,
    **mode_settings: Any,
) -> ModeBackend:
    """The ``run_mode`` backend over ``model`` and ``context`` (see ``TorchModelExecutor`` for the rest).

    ``mode_settings`` go to the mode's constructor as they are (a PD node's ``transfer``, a decode
    node's segment settings), so a setting the mode does not have is refused there.
    """
    executor = TorchModelExecutor(model, context, sampler, eos_token_ids, token_sync=token_sync, grammar=grammar,
                                  threads=threads)
    return build_backend(run_mode)(executor, context, strategy, planner, eos_token_ids, max_req_total_len,
                                   **mode_settings)
