"""The detokenization process: token ids in shared memory -> text pieces for the HTTP process."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

import zmq

from lightllm.server.core.objs.io_messages import (
    AbortRequest,
    DetokenizedOutput,
    SlotReleased,
    StepOutput,
    StepTexts,
    TokenEvent,
)
from lightllm.server.core.objs.finish_status import FINISH_ERROR, FINISH_REASON_NAMES
from lightllm.server.core.objs.shm_heartbeats import beat_of
from lightllm.server.detokenization.incremental_decoder import IncrementalDecoder, request_decoder
from lightllm.server.server_layout import ServerLayout
from lightllm.utils.log_utils import init_logging
from lightllm.utils.process_utils import run_child, zmq_socket
from lightllm.utils.tokenizer_utils import load_tokenizer
from lightllm.utils.gc_tuning import freeze_startup_objects

log = logging.getLogger("lightllm.detokenization")

# The longest wait for a message: an idle detokenizer still completes an iteration (and beats for
# the watchdog, --watchdog_timeout) this often.
IDLE_WAKE_MS = 1000


@dataclass
class DetokenizationConfig:
    """Everything the detokenization process needs (picklable for spawn)."""

    model_dir: str
    tokenizer_mode: str
    layout: ServerLayout
    log_level: str
    # This process's name (its log, its heartbeat field): the launcher's, launch/plan.py child_process_names.
    process_name: str
    # The model's EOS ids, whose text a request with print_eos_token keeps.
    eos_token_ids: List[int] = field(default_factory=list)


@dataclass
class _RequestText:
    decoder: Optional[IncrementalDecoder]  # None: a request that failed before it was read
    seen: int = 0
    finished: bool = False
    prompt_logprobs_sent: bool = False


class DetokenizationManager:
    """Reads new tokens from shared memory, decodes them, applies stop strings."""

    def __init__(self, config: DetokenizationConfig, tokenizer: Any = None):
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.model_dir, config.tokenizer_mode)
        self.zmq_ctx = zmq.Context()
        layout = config.layout
        self.inbox = zmq_socket(self.zmq_ctx, zmq.PULL, layout.detokenization_address, bind=True)
        self.to_http = zmq_socket(self.zmq_ctx, zmq.PUSH, layout.http_address, bind=False)
        self.to_router = zmq_socket(self.zmq_ctx, zmq.PUSH, layout.router_address, bind=False)
        self.shm = layout.open_requests()
        # This process's field of the watchdog's heartbeats (a no-op when it is not watched).
        self.beat = beat_of(layout.open_heartbeat(config.process_name))
        self.requests: Dict[int, _RequestText] = {}
        # The current step's messages to the HTTP process, sent together at the end of the step.
        self._outbox: List[Union[DetokenizedOutput, SlotReleased, Any]] = []

    def _state(self, request_id: int, slot: int) -> _RequestText:
        state = self.requests.get(request_id)
        if state is None:
            options = self.shm.decode_options(slot, request_id)
            decoder = request_decoder(self.tokenizer, options.prompt_ids, options, self.config.eos_token_ids)
            state = self.requests[request_id] = _RequestText(decoder)
        return state

    def handle(self, message: StepOutput) -> None:
        """Turn one step's updates into text messages; forward notices and releases (one message per step)."""
        try:
            self._handle_step(message)
        finally:
            if self._outbox:
                outbox, self._outbox = self._outbox, []
                self.to_http.send_pyobj(StepTexts(outbox))

    def _handle_step(self, message: StepOutput) -> None:
        # Rank 0's notices precede the step's outputs on its side; they keep that place here.
        self._outbox.extend(message.notices)
        for request_id, slot, published in message.updates:
            try:
                self._update(request_id, slot, published)
            except Exception:  # noqa: BLE001 - one unreadable record must not stop every stream
                log.exception("decoding request %d failed; ending it with an error", request_id)
                self._fail(request_id)
        for request_id, slot in message.released:
            state = self.requests.pop(request_id, None)
            if state is None or not state.finished:
                self._outbox.append(DetokenizedOutput(request_id, [], "abort", 0))
            self._outbox.append(SlotReleased(request_id, slot))

    def _fail(self, request_id: int) -> None:
        state = self.requests.get(request_id)
        if state is not None and state.finished:
            return
        if state is not None:
            state.finished = True
        else:
            # Keep a finished marker so the release that follows does not report "abort".
            self.requests[request_id] = _RequestText(decoder=None, finished=True)
        self._outbox.append(DetokenizedOutput(request_id, [], FINISH_REASON_NAMES[FINISH_ERROR], 0))
        # The rank may still be generating for it (a no-op if it already finished).
        self.to_router.send_pyobj(AbortRequest(request_id))

    def _update(self, request_id: int, slot: int, published: int) -> None:
        state = self._state(request_id, slot)
        if state.finished:
            return
        output = self.shm.read_output(slot, request_id, state.seen, published)
        status = output.finish_status
        tops = output.top_logprobs
        state.seen = output.output_len
        events = []
        finish_reason = None
        for index, (token_id, logprob) in enumerate(zip(output.token_ids, output.logprobs)):
            top = None if tops is None else tops[index]
            events.append(TokenEvent(token_id, state.decoder.add(token_id), logprob, top))
            if state.decoder.stopped:
                finish_reason = "stop"
                self.to_router.send_pyobj(AbortRequest(request_id))
                break
        if finish_reason is None and status:
            # A status this build does not name (a newer writer) still ends the request.
            finish_reason = FINISH_REASON_NAMES.get(status) or FINISH_REASON_NAMES[FINISH_ERROR]
            tail = state.decoder.flush()
            if tail and events:
                events[-1].text += tail
            finish_reason = state.decoder.finish_reason_after_flush(finish_reason)
        if finish_reason is not None:
            state.finished = True
        if events or finish_reason is not None:
            prompt_logprobs = None
            if not state.prompt_logprobs_sent:
                # Complete once the first token is out: every prefill chunk ran before it.
                prompt_logprobs = self.shm.prompt_logprobs(slot, request_id)
                state.prompt_logprobs_sent = True
            stop_reason = state.decoder.stop_reason if finish_reason == "stop" else None
            self._outbox.append(DetokenizedOutput(request_id, events, finish_reason, output.prompt_cache_len,
                                                  prompt_logprobs, stop_reason))

    def serve_forever(self) -> None:
        """Process messages as they come, beating before and right after each wait (at most a second)."""
        freeze_startup_objects()
        beat, inbox = self.beat, self.inbox
        while True:
            beat()
            if inbox.poll(IDLE_WAKE_MS):
                beat()  # the message's handling counts from the end of the wait
                self.handle(inbox.recv_pyobj())


def detokenization_process_main(config: DetokenizationConfig, ready_conn: Any) -> None:
    """Entry point of the detokenization process."""
    init_logging(config.log_level)

    def body(mark_ready: Callable[[], None]) -> None:
        manager = DetokenizationManager(config)
        mark_ready()
        manager.serve_forever()

    run_child(config.process_name, ready_conn, body)
