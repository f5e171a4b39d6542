"""HttpServerManager: tokenization, shared-memory slots, and per-request event streams."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional

import zmq
import zmq.asyncio

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.io_messages import AbortRequest, DetokenizedOutput, NewRequest, SlotReleased
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.httpserver.metrics import ServerMetrics
from lightllm.utils.process_utils import zmq_socket
from lightllm.utils.tokenizer_utils import load_tokenizer

log = logging.getLogger("lightllm.httpserver")

DISCONNECT_CHECK_SECONDS = 0.5


class ServerBusyError(RuntimeError):
    """No request slot became free in time."""


@dataclass
class GenerationEvent:
    """One generated token as the API layer sees it."""

    request_id: int
    token_id: int
    text: str
    logprob: float
    finish_reason: Optional[str]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    top_logprobs: Optional[Dict[int, float]] = None


@dataclass
class HttpServerConfig:
    """What the HTTP process needs to reach the rest of the server."""

    model_dir: str
    model_name: str
    tokenizer_mode: str
    router_address: str
    http_address: str
    shm_req_name: str
    shm_stats_name: str
    slot_num: int
    max_req_total_len: int
    vocab_size: int
    eos_token_ids: List[int]
    prefill_queue_strategy: str
    max_new_tokens_default: Optional[int] = None
    slot_wait_seconds: float = 600.0


class _Pending:
    """Per-request state in the HTTP process."""

    def __init__(self, prompt_tokens: int):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finished = False


class HttpServerManager:
    """Accepts requests from the API layer and streams their tokens back."""

    def __init__(self, config: HttpServerConfig):
        self.config = config
        self.model_name = config.model_name
        self.max_req_total_len = config.max_req_total_len
        self.vocab_size = config.vocab_size
        self.eos_token_ids = list(config.eos_token_ids)
        self.tokenizer = load_tokenizer(config.model_dir, config.tokenizer_mode)
        self.shm = ShmReqBuffer(config.shm_req_name, config.slot_num, config.max_req_total_len, create=False)
        self.stats = ShmStats(config.shm_stats_name, create=False)
        self.metrics = ServerMetrics(config.prefill_queue_strategy, self.stats)
        self._free_slots: List[int] = list(range(config.slot_num - 1, -1, -1))
        self._slot_freed: Optional[asyncio.Condition] = None
        self._pending: Dict[int, _Pending] = {}
        self._next_request_id = 1
        self._receiver: Optional[asyncio.Task] = None

    # --- lifecycle (called from the FastAPI lifespan) ----------------------------------------
    async def start(self) -> None:
        """Open sockets and start the receiver task."""
        self.zmq_ctx = zmq.asyncio.Context()
        self.to_router = zmq_socket(self.zmq_ctx, zmq.PUSH, self.config.router_address, bind=False)
        self.inbox = zmq_socket(self.zmq_ctx, zmq.PULL, self.config.http_address, bind=True)
        self._slot_freed = asyncio.Condition()
        self._receiver = asyncio.create_task(self._receive_loop())

    async def stop(self) -> None:
        """Stop receiving and close sockets."""
        if self._receiver is not None:
            self._receiver.cancel()
        self.zmq_ctx.destroy(linger=0)

    async def _receive_loop(self) -> None:
        while True:
            message = await self.inbox.recv_pyobj()
            try:
                if isinstance(message, DetokenizedOutput):
                    self._deliver(message)
                elif isinstance(message, SlotReleased):
                    await self._release_slot(message.shm_index)
            except Exception:  # one bad message must not stop every stream
                log.exception("failed to handle %s", type(message).__name__)

    def _deliver(self, message: DetokenizedOutput) -> None:
        pending = self._pending.get(message.request_id)
        if pending is None or pending.finished:
            return
        tokens = message.tokens
        if not tokens and message.finish_reason is not None:
            pending.finished = True
            pending.queue.put_nowait(
                GenerationEvent(message.request_id, -1, "", 0.0, message.finish_reason, pending.prompt_tokens, message.prompt_cache_len, pending.completion_tokens)
            )
            return
        for i, token in enumerate(tokens):
            pending.completion_tokens += 1
            last = i == len(tokens) - 1
            finish = message.finish_reason if last else None
            pending.queue.put_nowait(
                GenerationEvent(
                    message.request_id,
                    token.token_id,
                    token.text,
                    token.logprob,
                    finish,
                    pending.prompt_tokens,
                    message.prompt_cache_len,
                    pending.completion_tokens,
                )
            )
        if message.finish_reason is not None:
            pending.finished = True

    async def _release_slot(self, slot: int) -> None:
        self.shm.release(slot)
        async with self._slot_freed:
            self._free_slots.append(slot)
            self._slot_freed.notify()

    async def _take_slot(self) -> int:
        async with self._slot_freed:
            try:
                await asyncio.wait_for(self._slot_freed.wait_for(lambda: bool(self._free_slots)), self.config.slot_wait_seconds)
            except asyncio.TimeoutError as exc:
                raise ServerBusyError("server is busy: no request slot became free in time") from exc
            return self._free_slots.pop()

    # --- the API layer's interface ---------------------------------------------------------------
    def encode_prompt(self, text: str) -> List[int]:
        """Token ids of ``text`` with the special tokens the checkpoint's tokenizer adds."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: List[Dict[str, Any]]) -> List[int]:
        """Token ids of a chat rendered with the checkpoint's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        # The template writes BOS itself when it wants one; encode without adding another.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def default_max_new_tokens(self, prompt_len: int) -> int:
        """max_new_tokens for a request that gives none."""
        remaining = max(1, self.max_req_total_len - prompt_len)
        if self.config.max_new_tokens_default is not None:
            return min(self.config.max_new_tokens_default, remaining)
        return remaining

    def health(self) -> bool:
        """Whether the server accepts requests."""
        return self._receiver is not None and not self._receiver.done()

    def metrics_text(self) -> tuple[bytes, str]:
        """Prometheus exposition of this server's metrics."""
        return self.metrics.render()

    async def generate(
        self,
        prompt_ids: List[int],
        params: SamplingParams,
        *,
        high_priority: bool = False,
        request: Any = None,
    ) -> AsyncIterator[GenerationEvent]:
        """Submit a request and yield one event per generated token (the last has finish_reason)."""
        params.validate(self.vocab_size)
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if len(prompt_ids) + params.max_new_tokens > self.max_req_total_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_req_total_len} tokens. However, you requested "
                f"{len(prompt_ids) + params.max_new_tokens} tokens ({len(prompt_ids)} in the prompt, "
                f"{params.max_new_tokens} for the completion)."
            )
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        slot = await self._take_slot()
        request_id = self._next_request_id
        self._next_request_id += 1
        pending = _Pending(len(prompt_ids))
        self._pending[request_id] = pending
        try:
            self.shm.write_request(slot, request_id, prompt_ids, params, high_priority)
        except Exception:
            del self._pending[request_id]
            await self._release_slot(slot)
            raise
        started = time.perf_counter()
        self.metrics.on_submit(len(prompt_ids))
        await self.to_router.send_pyobj(NewRequest(request_id, slot))
        last_token_at: Optional[float] = None
        finish_reason = None
        try:
            while True:
                try:
                    event = await asyncio.wait_for(pending.queue.get(), DISCONNECT_CHECK_SECONDS)
                except asyncio.TimeoutError:
                    if request is not None and await request.is_disconnected():
                        finish_reason = "abort"
                        return
                    continue
                now = time.perf_counter()
                if event.token_id >= 0:
                    if last_token_at is None:
                        self.metrics.on_first_token(now - started, event.cached_tokens)
                    else:
                        self.metrics.on_next_token(now - last_token_at)
                    last_token_at = now
                if event.finish_reason is not None:
                    finish_reason = event.finish_reason
                if event.token_id >= 0 or event.finish_reason is not None:
                    yield event
                if event.finish_reason is not None:
                    return
        finally:
            self._pending.pop(request_id, None)
            if finish_reason is None or finish_reason == "abort":
                # Client went away (or the stream was closed early): stop the work.
                self.shm.records[slot]["abort_flag"] = 1
                await self.to_router.send_pyobj(AbortRequest(request_id))
            self.metrics.on_finish(finish_reason or "abort", pending.completion_tokens, time.perf_counter() - started)
