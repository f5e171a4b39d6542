"""The router process: admission of waiting requests into the model ranks' running batch.

The process shell is the same in every run mode; what differs (when and which requests are
admitted) is the run mode's queue, from ``build_req_queue`` (``req_queue/queue_registry.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import zmq

from lightllm.server.core.objs.io_messages import (
    AbortRequest,
    AbortRequests,
    AddRequests,
    NewRequest,
    RequestsReleased,
    StepOutput,
)
from lightllm.server.core.objs.shm_heartbeats import beat_of
from lightllm.server.core.objs.shm_req_views import StaleRecordError
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.router.req_queue.queue_registry import build_req_queue
from lightllm.server.router.req_queue.router_req import RouterReq, reserved_new_tokens
from lightllm.server.run_mode import RunMode
from lightllm.server.server_layout import ServerLayout
from lightllm.utils.log_utils import init_logging
from lightllm.utils.process_utils import run_child, zmq_socket
from lightllm.utils.gc_tuning import freeze_startup_objects

log = logging.getLogger("lightllm.router")


@dataclass
class RouterConfig:
    """Everything the router process needs (picklable for spawn)."""

    layout: ServerLayout
    running_max_req_size: int
    router_token_ratio: float
    router_max_wait_tokens: int
    schedule_time_interval: float
    log_level: str
    # This process's name (its log, its heartbeat field): the launcher's, launch/plan.py child_process_names.
    process_name: str
    # The prefill-queue overtaking bound: admission limits how far the high-priority lane may
    # overtake a normal request by the same rule (None: the defaults).
    prefill_overtake_bound: Optional[OvertakeBoundSpec] = None
    # --run_mode: picks the admission queue (build_req_queue).
    run_mode: str = RunMode.NORMAL.value


class RouterManager:
    """Receives new requests and aborts, admits requests as capacity allows, tracks releases."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.zmq_ctx = zmq.Context()
        layout = config.layout
        self.inbox = zmq_socket(self.zmq_ctx, zmq.PULL, layout.router_address, bind=True)
        self.to_model = zmq_socket(self.zmq_ctx, zmq.PUSH, layout.model_rank0_address, bind=False)
        self.to_detokenization = zmq_socket(self.zmq_ctx, zmq.PUSH, layout.detokenization_address, bind=False)
        self.shm = layout.open_requests()
        self.stats = layout.open_stats()
        # This process's field of the watchdog's heartbeats (a no-op when it is not watched).
        self.beat = beat_of(layout.open_heartbeat(config.process_name))
        self.queue = build_req_queue(
            config.run_mode,
            int(layout.max_total_token_num * config.router_token_ratio),
            config.running_max_req_size,
            overtake_bound=config.prefill_overtake_bound,
        )

    def handle(self, message: Any) -> None:
        """Apply one inbound message."""
        if isinstance(message, NewRequest):
            self._queue_new(message)
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
            # Only the server's own processes write to the router: an unknown message is a bug.
            log.error("router ignores unknown message %s (a bug in the sender): %.200r", type(message).__name__, message)

    def _queue_new(self, message: NewRequest) -> None:
        try:
            fields = self.shm.admission_fields(message.shm_index, message.request_id)
        except StaleRecordError:
            # The HTTP side writes the record before it sends the message and frees the slot only
            # after this request is reported released, so this is a protocol bug.  The request is
            # reported released (its client gets "abort"); the slot's real holder is untouched,
            # since the HTTP side frees a slot only for the request that holds it.
            log.exception("dropping new request %d", message.request_id)
            self.to_detokenization.send_pyobj(StepOutput(released=[(message.request_id, message.shm_index)]))
            return
        self.queue.append(RouterReq(
            request_id=message.request_id,
            shm_index=message.shm_index,
            input_len=fields.prompt_len,
            max_new_tokens=reserved_new_tokens(fields.max_new_tokens, fields.pd_kind),
            high_priority_request=fields.high_priority_request,
        ))

    def admit(self) -> None:
        """Send the requests the queue admits on its cadence to the model ranks.

        The queue paces itself (``ReqQueue.admit_if_due``) by rank 0's step counter, so the
        simulator, which passes its own step count, admits on the same cadence.
        """
        if not len(self.queue):
            return  # nothing waits: no need to read the step counter
        admitted = self.queue.admit_if_due(self.stats.get("backend_steps"), self.config.router_max_wait_tokens)
        if admitted:
            self.to_model.send_pyobj(AddRequests([(r.request_id, r.shm_index) for r in admitted]))

    def serve_forever(self) -> None:
        """Poll for messages and run admission rounds, beating before and right after each wait (at most 1 s)."""
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        timeout_ms = max(1, int(self.config.schedule_time_interval * 1000))
        freeze_startup_objects()
        beat = self.beat
        while True:
            beat()
            events = dict(poller.poll(timeout_ms))
            beat()  # the round's work counts from the end of the wait
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

    run_child(config.process_name, ready_conn, body)
