"""The internal request path: a caller-owned request id and a RequestSpec's internal fields travel
unchanged from the HTTP manager's generate() through the shared-memory record and the router
to the model rank's InferReq, and back to the caller's events.

Every component is the real one, in this process: HttpServerManager (real shared memory and
zmq sockets), RouterManager, ModelRank's admission code over a real backend and tiny model,
and DetokenizationManager.  The only stand-in is rank 0's forward: the test publishes the
output token through ShmReqBuffer as rank 0 does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
import torch
import zmq

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.finish_status import FINISH_LENGTH
from lightllm.server.core.objs.io_messages import AddRequests, NewRequest, SlotReleased, StepOutput
from lightllm.server.core.objs.request_spec import RequestSpec, RequestSpecError
from lightllm.server.core.objs.shm_req_layout import NO_REQUEST
from lightllm.server.detokenization.manager import DetokenizationConfig, DetokenizationManager
from lightllm.server.httpserver.manager import HttpServerConfig, HttpServerManager
from lightllm.server.manager_errors import DuplicateRequestIdError
from lightllm.server.request_manager import RequestManager, SupervisedRequestManager, missing_request_manager_members
from lightllm.server.router.manager import RouterConfig, RouterManager
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.prefill_wait_tracker import PrefillWaitTracker
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.rank_process import ModelRank
from lightllm.server.server_layout import ServerLayout

MAX_LEN = 64
OWNED_ID = 7_000_000_000_123  # beyond 32 bits: the id must travel unchanged as a 64-bit value


class Pipeline:
    """The server's request path in one process, wired through real sockets and shared memory."""

    def __init__(self, model_dir: str, ipc_dir: str) -> None:
        tag = f"lightllm_test_{uuid.uuid4().hex[:10]}"
        self.layout = ServerLayout(
            f"{tag}_req", f"{tag}_stats", 2, MAX_LEN, 1024,
            *(f"ipc://{ipc_dir}/{name}.sock" for name in ("router", "rank0", "detok", "http")),
        )
        self.shm = self.layout.open_requests(create=True)
        self.stats = self.layout.open_stats(create=True)
        self.ctx = zmq.Context()
        self.rank_inbox = self.ctx.socket(zmq.PULL)
        self.rank_inbox.bind(self.layout.model_rank0_address)
        self.router = RouterManager(RouterConfig(self.layout, running_max_req_size=8, router_token_ratio=1.0,
                                                 router_max_wait_tokens=1, schedule_time_interval=0.01,
                                                 log_level="warning", process_name="router"))
        self.detok = DetokenizationManager(DetokenizationConfig(model_dir, "auto", self.layout, "warning",
                                                                "detokenization"))
        self.http = HttpServerManager.from_config(HttpServerConfig(
            model_dir=model_dir, model_name="tiny", tokenizer_mode="auto", layout=self.layout,
            vocab_size=ModelConfig.from_dir(model_dir).vocab_size,
            eos_token_ids=[2], prefill_queue_strategy="default", slot_wait_seconds=5.0,
        ))
        model = load_model(model_dir, dtype=torch.float32)
        context = InferenceContext(model.new_kv_cache(1024), ReqManager(8, MAX_LEN + 1))
        backend = build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"),
                                     StepPlanner(256, 64), Sampler(0), [2], MAX_LEN)
        # Rank 0's admission code over a real backend; the test plays its inbox, so no loop runs.
        self.rank = ModelRank(backend, self.layout.open_requests(), is_leader=True, inbox=self.rank_inbox,
                              wait_tracker=PrefillWaitTracker())

    def close(self) -> None:
        for manager in (self.router, self.detok):
            manager.zmq_ctx.destroy(linger=0)
            manager.shm.close()
        self.router.stats.close()
        self.rank.shm.close()
        self.ctx.destroy(linger=0)
        self.http.shm.close()
        self.http.stats.close()
        for segment in (self.shm, self.stats):
            segment.close()
            segment.unlink()

    async def receive(self, socket: zmq.Socket, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while not socket.poll(0):
            assert time.monotonic() < deadline, "no message arrived"
            await asyncio.sleep(0.01)
        return socket.recv_pyobj()

    async def route_new_request(self) -> NewRequest:
        """The router takes the HTTP side's next request and admits it to rank 0."""
        message = await self.receive(self.router.inbox)
        assert isinstance(message, NewRequest)
        self.router.handle(message)
        self.router.admit()
        return message

    async def wait_until(self, condition: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "condition never held"
            await asyncio.sleep(0.01)


@pytest.fixture()
def pipeline(tiny_llama_dir, tmp_path):
    pipe = Pipeline(str(tiny_llama_dir), str(tmp_path))
    yield pipe
    pipe.close()


def _params() -> SamplingParams:
    return SamplingParams(max_new_tokens=3, temperature=0.0)


def _spec(prompt_ids, **internal) -> RequestSpec:
    return RequestSpec.build(prompt_ids, _params(), **internal)


def test_owned_id_and_internal_fields_reach_the_rank_and_come_back(pipeline: Pipeline) -> None:
    async def scenario() -> None:
        http = pipeline.http
        await http.start()
        try:
            spec = _spec([5, 6, 7], high_priority_request=True, infer_high_priority=-2, segment_index=1,
                         generated_before=1)
            events = http.generate(spec, request_id=OWNED_ID)
            first = asyncio.ensure_future(events.__anext__())
            new = await pipeline.route_new_request()
            assert new.request_id == OWNED_ID
            slot = new.shm_index
            queued = pipeline.router.queue.running[OWNED_ID]
            assert (queued.input_len, queued.max_new_tokens, queued.high_priority_request) == (3, 3, True)
            add = await pipeline.receive(pipeline.rank_inbox)
            assert add == AddRequests([(OWNED_ID, slot)])
            screened = pipeline.rank.screen([add])
            assert pipeline.rank._screened[OWNED_ID] == spec  # the whole spec, as generate() got it
            pipeline.rank.apply(screened)
            req = pipeline.rank.backend.requests[OWNED_ID]
            assert (req.infer_high_priority, req.generated_before, req.request_id) == (-2, 1, OWNED_ID)
            assert req.prompt_ids == [5, 6, 7] and req.sampling == spec.params

            # While it is live the id cannot be taken again.
            with pytest.raises(DuplicateRequestIdError, match=str(OWNED_ID)):
                await http.generate(_spec([5]), request_id=OWNED_ID).__anext__()

            # A late release naming another request must not free this request's slot.
            pipeline.detok.to_http.send_pyobj(SlotReleased(OWNED_ID + 1, slot))
            assert pipeline.rank.shm.publish_token(slot, OWNED_ID, 9, -0.25)
            assert pipeline.rank.shm.set_finish_status(slot, OWNED_ID, FINISH_LENGTH)
            pipeline.detok.handle(StepOutput([(OWNED_ID, slot, 1)], [(OWNED_ID, slot)]))
            event = await asyncio.wait_for(first, 10)
            assert (event.request_id, event.token_id, event.finish_reason) == (OWNED_ID, 9, "length")
            with pytest.raises(StopAsyncIteration):
                await events.__anext__()
            await pipeline.wait_until(lambda: pipeline.shm.holder(slot) == NO_REQUEST)
        finally:
            await http.stop()

    asyncio.run(scenario())


def test_own_ids_skip_live_caller_ids_and_a_released_id_is_free_again(pipeline: Pipeline) -> None:
    async def scenario() -> None:
        http = pipeline.http
        await http.start()
        try:
            owned = http.generate(_spec([5, 6]), request_id=1)  # the manager's next own id
            owned_first = asyncio.ensure_future(owned.__anext__())
            assert (await pipeline.route_new_request()).request_id == 1
            auto = http.generate(_spec([5, 6]))
            auto_first = asyncio.ensure_future(auto.__anext__())
            assert (await pipeline.route_new_request()).request_id == 2
            for waiter in (owned_first, auto_first):
                waiter.cancel()  # the client goes away: generate() sends the router an abort
            await asyncio.gather(owned_first, auto_first, return_exceptions=True)
            # The abandoned requests end as the router and detokenizer report them released.
            pipeline.router.handle(await pipeline.receive(pipeline.router.inbox))
            pipeline.router.handle(await pipeline.receive(pipeline.router.inbox))
            for request_id in (1, 2):
                pipeline.router.queue.release(request_id)
            pipeline.detok.handle(StepOutput([], [(1, 0), (2, 1)]))
            await pipeline.wait_until(lambda: pipeline.shm.holder(0) == pipeline.shm.holder(1) == NO_REQUEST)
            again = http.generate(_spec([5, 6]), request_id=1)
            again_first = asyncio.ensure_future(again.__anext__())
            assert (await pipeline.route_new_request()).request_id == 1
            again_first.cancel()
            await asyncio.gather(again_first, return_exceptions=True)
        finally:
            await http.stop()

    asyncio.run(scenario())


def test_generate_checks_the_spec_once_against_the_served_model(pipeline: Pipeline) -> None:
    async def scenario() -> None:
        http = pipeline.http
        await http.start()
        try:
            with pytest.raises(RequestSpecError, match="prompt_ids"):
                await http.generate(_spec([5, http.served.vocab_size])).__anext__()
            with pytest.raises(RequestSpecError, match="max_req_total_len"):
                await http.generate(RequestSpec([5] * 10, SamplingParams(max_new_tokens=MAX_LEN))).__anext__()
            with pytest.raises(ValueError, match="RequestSpec"):
                await http.generate(([5], _params())).__anext__()  # type: ignore[arg-type]
            # Refused before an id, a slot or a message was taken.
            assert not http._live and [pipeline.shm.holder(slot) for slot in range(2)] == [NO_REQUEST] * 2
            assert not pipeline.router.inbox.poll(100)
        finally:
            await http.stop()

    asyncio.run(scenario())


def test_router_and_rank_refuse_a_record_that_is_not_the_named_request(pipeline: Pipeline) -> None:
    """A stale (request_id, slot) pair is reported released or rejected, never admitted."""
    pipeline.shm.write_request(0, 41, _spec([5, 6]))
    pipeline.router.handle(NewRequest(40, 0))  # slot 0 holds request 41, not 40
    assert len(pipeline.router.queue) == 0 and not pipeline.router.queue.running
    assert pipeline.detok.inbox.poll(5000)
    assert pipeline.detok.inbox.recv_pyobj() == StepOutput(released=[(40, 0)])
    commands = pipeline.rank.screen([AddRequests([(40, 0), (41, 0)])])
    assert [type(command).__name__ for command in commands] == ["AddRequests", "RejectRequests"]
    assert commands[0].requests == [(41, 0)] and commands[1].requests == [(40, 0)]
    assert pipeline.shm.holder(0) == 41


def test_the_http_manager_implements_the_protocols_the_http_layer_and_supervisor_use(pipeline: Pipeline) -> None:
    assert missing_request_manager_members(pipeline.http, SupervisedRequestManager) == []
    assert isinstance(pipeline.http, RequestManager)
