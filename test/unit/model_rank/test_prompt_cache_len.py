"""The cached prompt tokens a request reports (``prompt_cache_len``, usage ``cached_tokens``)."""

from __future__ import annotations

from typing import Dict, Tuple

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.model_rank.scheduling.request_state import ReqState
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_engine import StepEngine
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.scheduling.step_report import StepReport

from prefill_queue_test_support import NoForward, make_req


class PublishedPrefixKvView(TokenCountKvView):
    """A "cache" holding the first ``published[request_id]`` tokens of a prompt: a prefilling
    request adopts them (as other requests' published chunks), and a pause loses everything."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.published: Dict[int, int] = {}

    def share_prefix(self, req: InferReq) -> int:
        level = min(self.published.get(req.request_id, 0), req.cacheable_prefix_len)
        if level <= req.cur_kv_len:
            return 0
        gained = level - req.cur_kv_len
        self.used += level - req.kv_slot_len if level > req.kv_slot_len else 0
        req.cur_kv_len = req.kv_slot_len = level
        return gained


def _joined(prompt_len: int) -> Tuple[PublishedPrefixKvView, StepEngine, InferReq]:
    """An engine over a fresh "cache", and request 1 of ``prompt_len`` tokens joined to it."""
    kv = PublishedPrefixKvView()
    engine = StepEngine(NoForward(), kv, build_prefill_queue_strategy("default"),
                        StepPlanner(batch_max_tokens=1, chunked_prefill_size=1), eos_token_ids=[],
                        max_req_total_len=1 << 20)
    req = make_req(1, prompt_len)
    engine.join(req)
    return kv, engine, req


def _pause_and_resume(engine: StepEngine, req: InferReq) -> None:
    """KV ran out: the request gives its KV back (and the cache evicts it); later it resumes."""
    engine._pause(req, StepReport())
    engine.resume_paused()


def test_tokens_adopted_again_after_a_pause_are_not_counted_twice():
    kv, engine, req = _joined(100)
    kv.published[1] = 60
    engine.share_prefixes([req], StepReport())
    assert req.prompt_cache_len == 60
    req.cur_kv_len = req.kv_slot_len = 80  # it computed 20 tokens of its own
    _pause_and_resume(engine, req)
    assert req.state is ReqState.PREFILLING
    # Another request computed the prompt meanwhile: the paused one adopts 99 tokens on resuming.
    kv.published[1] = 100
    engine.share_prefixes([req], StepReport())
    assert req.cur_kv_len == 99
    # Its count stays what it was at its first scheduling (vLLM's rule), not 60 + 99 (which,
    # capped at the prompt, reported the whole prompt as cached).
    assert req.prompt_cache_len == 60


def test_a_request_paused_before_computing_counts_its_hits_when_it_resumes():
    """A stalled step pauses the newest holder even if it only holds cached tokens: it was never
    scheduled, so the hits it gets on resuming are its first scheduling's, counted once."""
    kv, engine, req = _joined(100)
    kv.published[1] = 10
    engine.share_prefixes([req], StepReport())
    _pause_and_resume(engine, req)
    assert req.prompt_cache_len == 0  # the 10 went with the evicted KV
    kv.published[1] = 100
    engine.share_prefixes([req], StepReport())
    assert req.cur_kv_len == 99 and req.prompt_cache_len == 99


def test_the_last_prompt_token_is_never_counted_as_cached():
    kv, engine, req = _joined(50)
    kv.published[1] = 30
    engine.share_prefixes([req], StepReport())
    # A view whose gains add up past the prompt (none should, but the count must hold anyway).
    kv.published[1] = 50
    req.cur_kv_len = req.kv_slot_len = 10
    engine.share_prefixes([req], StepReport())
    assert req.prompt_cache_len == 49
