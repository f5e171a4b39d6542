"""The server's executor and the simulator's cost model make the step engine plan identically.

One recorded workload (requests arriving at given steps, prompts long enough to be chunked, a
KV cache small enough that decode runs dry and requests pause) drives two engines step by step:
the model rank's (tiny real model, token-slot KV cache, torch executor) and the simulator's
(token-count KV view, cost-model executor).  Every step's order, plan, pauses and finishes must be
the same: the scheduling the simulator measures is the scheduling the server runs.
"""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

import pytest
import torch

from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.benchmark.simulator.cost_executor import CostModelExecutor
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.backend_registry import build_backend
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.scheduling.step_report import StepReport
from lightllm.server.core.objs.request_spec import RequestSpec

KV_TOKENS = 420
MAX_LEN = 512
BUDGET, CHUNK = 96, 48


def recorded_workload(seed: int) -> List[Tuple[int, int, int, int]]:
    """``(arrival_step, request_id, prompt_len, max_new_tokens)``: bursts of short and long prompts."""
    rng = random.Random(seed)
    workload = []
    step = 0
    for request_id in range(14):
        step += rng.choice([0, 0, 1, 3])
        prompt_len = rng.choice([6, 12, 30, 90, 170])
        workload.append((step, request_id, prompt_len, rng.randint(4, 24)))
    return workload


def plan_signature(report: StepReport) -> Dict[str, object]:
    """Everything the step decided, by request id."""
    plan = report.plan
    return {
        "ordered": [r.request_id for r in report.ordered],
        "decode": [r.request_id for r in plan.decode_reqs] if plan else [],
        "chunks": [(c.req.request_id, c.start, c.token_num) for c in plan.prefill_chunks] if plan else [],
        "paused": [r.request_id for r in report.paused],
        "finished": [(r.request_id, status) for r, status in report.finished],
        "tokens_for": [r.request_id for r, _, _ in report.tokens],
        "prefill_tokens": report.prefill_token_num,
    }


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


@pytest.mark.parametrize("strategy", ["default", "promote_shortest", "hrrn"])
@pytest.mark.parametrize("seed", [1, 2])
def test_server_and_simulator_plan_every_step_identically(model, strategy: str, seed: int) -> None:
    context = InferenceContext(model.new_kv_cache(KV_TOKENS), ReqManager(16, MAX_LEN + 1), use_prefix_cache=False)
    server = build_rank_backend(
        "normal", model, context, build_prefill_queue_strategy(strategy, OvertakeBoundSpec(512, 0.15)), StepPlanner(BUDGET, CHUNK),
        Sampler(0), [], MAX_LEN,
    )
    simulated = build_backend("normal")(
        CostModelExecutor(load_profile("h100_qwen_0p8b")), TokenCountKvView(KV_TOKENS),
        build_prefill_queue_strategy(strategy, OvertakeBoundSpec(512, 0.15)), StepPlanner(BUDGET, CHUNK), [], MAX_LEN,
    )
    workload = recorded_workload(seed)
    gen = torch.Generator().manual_seed(seed)
    pending = list(workload)
    steps = paused = 0
    while pending or server.has_work or simulated.has_work:
        while pending and pending[0][0] <= steps:
            _, request_id, prompt_len, max_new = pending.pop(0)
            prompt = torch.randint(5, 1000, (prompt_len,), generator=gen).tolist()
            params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
            server.add_request(request_id, RequestSpec(prompt, params))
            simulated.join(InferReq(request_id, [0] * prompt_len, max_new_tokens=max_new,
                                    arrival_processed_prefill_tokens=simulated.counter.snapshot()))
        server_report, simulated_report = server.step(), simulated.step()
        assert plan_signature(server_report) == plan_signature(simulated_report), f"step {steps}"
        assert server.counter.value == simulated.counter.value
        paused += len(server_report.paused)
        steps += 1
        assert steps < 2000
    assert paused > 0  # the small cache made the engines pause requests, which must also agree
    assert context.allocatable_token_num() == KV_TOKENS and simulated.kv.used == 0
