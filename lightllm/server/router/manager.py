"""The router process: admission of waiting requests into the model ranks' running batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from lightllm.server.core.objs.io_messages import (
    AbortRequest,
    AbortRequests,
    AddRequests,
    NewRequest,
    RequestsReleased,
    StepOutput,
)
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.router.req_queue.normal_queue import NormalReqQueue, RouterReq
from lightllm.utils.log_utils import init_logging
from lightllm.utils.process_utils import run_child, zmq_socket

log = logging.getLogger("lightllm.router")


@dataclass
class RouterConfig:
    """Everything the router process needs (picklable for spawn)."""

    router_address: str
    model_rank0_address: str
    detokenization_address: str
    shm_req_name: str
    shm_stats_name: str
    slot_num: int
    max_req_total_len: int
    max_total_token_num: int
    running_max_req_size: int
    router_token_ratio: float
    router_max_wait_tokens: int
    schedule_time_interval: float
    log_level: str
    # --prefill_max_wait_tokens: admission ages waiting requests on the same bound (0: off).
    prefill_max_wait_tokens: int = 0


class RouterManager:
    """Receives new requests and aborts, admits requests as capacity allows, tracks releases."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.zmq_ctx = zmq.Context()
        self.inbox = zmq_socket(self.zmq_ctx, zmq.PULL, config.router_address, bind=True)
        self.to_model = zmq_socket(self.zmq_ctx, zmq.PUSH, config.model_rank0_address, bind=False)
        self.to_detokenization = zmq_socket(self.zmq_ctx, zmq.PUSH, config.detokenization_address, bind=False)
        self.shm = ShmReqBuffer(config.shm_req_name, config.slot_num, config.max_req_total_len, create=False)
        self.stats = ShmStats(config.shm_stats_name, create=False)
        self.queue = NormalReqQueue(
            int(config.max_total_token_num * config.router_token_ratio),
            config.running_max_req_size,
            max_wait_tokens=config.prefill_max_wait_tokens,
        )
        self._steps_at_last_admission = -(10**9)

    def handle(self, message: Any) -> None:
        """Apply one inbound message."""
        if isinstance(message, NewRequest):
            rec = self.shm.records[message.shm_index]
            self.queue.append(
                RouterReq(
                    request_id=message.request_id,
                    shm_index=message.shm_index,
                    input_len=int(rec["prompt_len"]),
                    max_new_tokens=int(rec["max_new_tokens"]),
                    high_priority_request=bool(rec["high_priority_request"]),
                )
            )
        elif isinstance(message, AbortRequest):
            waiting = self.queue.remove_waiting(message.request_id)
            if waiting is not None:
                # Never reached a model rank: report it released so the HTTP side frees the slot.
                self.to_detokenization.send_pyobj(StepOutput(released=[(waiting.request_id, waiting.shm_index)]))
            elif message.request_id in self.queue.running:
                self.to_model.send_pyobj(AbortRequests([message.request_id]))
        elif isinstance(message, RequestsReleased):
            for request_id in message.request_ids:
                self.queue.release(request_id)
        else:
            log.warning("router ignores unknown message %r", type(message).__name__)

    def admission_due(self) -> bool:
        """Admit again once the backend ran ``router_max_wait_tokens`` steps (or sits idle)."""
        if not self.queue.running:
            return True
        steps = self.stats.get("backend_steps")
        return steps - self._steps_at_last_admission >= self.config.router_max_wait_tokens

    def admit(self) -> None:
        """Send newly admitted requests to the model ranks."""
        if not len(self.queue) or not self.admission_due():
            return
        admitted = self.queue.admit()
        if admitted:
            self._steps_at_last_admission = self.stats.get("backend_steps")
            self.to_model.send_pyobj(AddRequests([(r.request_id, r.shm_index) for r in admitted]))

    def serve_forever(self) -> None:
        """Poll for messages and run admission rounds."""
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        timeout_ms = max(1, int(self.config.schedule_time_interval * 1000))
        while True:
            events = dict(poller.poll(timeout_ms))
            if self.inbox in events:
                while True:
                    try:
                        self.handle(self.inbox.recv_pyobj(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            self.admit()
            self.stats.set("waiting_requests", len(self.queue))
            self.stats.set("running_requests", len(self.queue.running))


def router_process_main(config: RouterConfig, ready_conn: Any) -> None:
    """Entry point of the router process."""
    init_logging(config.log_level)

    def body(mark_ready: Callable[[], None]) -> None:
        manager = RouterManager(config)
        mark_ready()
        manager.serve_forever()

    run_child("router", ready_conn, body)
