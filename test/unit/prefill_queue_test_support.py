"""Helpers shared by the prefill-queue strategy tests: request builders and order shorthands."""

from __future__ import annotations

from typing import List, Sequence, Tuple

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.model_rank.scheduling.request_classifier import NORMAL_CLASSIFIER, RequestClassifier
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner


def make_req(
    request_id: int,
    prompt_len: int,
    *,
    output_len: int = 0,
    cur_kv_len: int = 0,
    arrival: int = 0,
    infer_high_priority: int = 0,
) -> InferReq:
    """Build a request; ``arrival`` is its processed-prefill-token snapshot."""
    return InferReq(
        request_id=request_id,
        prompt_ids=list(range(prompt_len)),
        output_ids=[1] * output_len,
        cur_kv_len=cur_kv_len,
        arrival_processed_prefill_tokens=arrival,
        infer_high_priority=infer_high_priority,
    )


def decode_req(request_id: int, arrival: int = 0) -> InferReq:
    """A request with one generated token pending."""
    return make_req(request_id, 8, output_len=1, cur_kv_len=8, arrival=arrival)


def ids(reqs: Sequence[InferReq]) -> List[int]:
    """The request ids of ``reqs``, in order."""
    return [r.request_id for r in reqs]


def order(name: str, prefill_reqs: Sequence[InferReq], processed: int = 0) -> List[int]:
    """Ids of ``prefill_reqs`` as a freshly built strategy ``name`` orders them at ``processed``."""
    return ids(build_prefill_queue_strategy(name).order(prefill_reqs, processed))


class NoForward:
    """An executor for engines whose phases are called one by one: no forward may run."""

    def prefill(self, chunks):
        raise AssertionError("no forward runs in a phase test")

    def decode(self, reqs):
        raise AssertionError("no forward runs in a phase test")

    def forget(self, req: InferReq) -> None:
        pass


def phase_engine(
    name: str = "default", classifier: RequestClassifier = NORMAL_CLASSIFIER, processed: int = 0
) -> StepEngine:
    """A step engine whose phases can be called alone: strategy ``name``, ``classifier``, and the
    processed-prefill-token counter at ``processed``."""
    engine = StepEngine(NoForward(), TokenCountKvView(1 << 20), build_prefill_queue_strategy(name),
                        StepPlanner(batch_max_tokens=64), eos_token_ids=[], max_req_total_len=1 << 20)
    engine.classifier = classifier
    engine.counter = ProcessedPrefillTokenCounter(initial=processed)
    return engine


def classify_and_order(
    name: str, reqs: Sequence[InferReq], processed: int = 0, classifier: RequestClassifier = NORMAL_CLASSIFIER
) -> Tuple[List[int], List[int]]:
    """Ids of ``(decode, ordered prefill)`` after an engine's classify and order phases."""
    engine = phase_engine(name, classifier, processed)
    classified = engine.classify(list(reqs))
    return ids(classified.decode), ids(engine.order(classified.prefill))
