"""HttpServerManager: tokenization, shared-memory slots, and per-request event streams."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
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

# How often a running request asks whether its client is still connected, whether or not
# tokens are flowing: a client that walked away is noticed within this time.
DISCONNECT_CHECK_SECONDS = 0.5


class ServerBusyError(RuntimeError):
    """No request slot became free in time."""


class ServerUnavailableError(RuntimeError):
    """The server takes no more requests (it is shutting down or one of its processes died).

    ``code`` is the machine-readable reason the HTTP layer puts in the 503 error body.
    """

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


# Put in a request's queue to wake it when the server fails every pending request.
_FAILED = object()


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
    # On a request's first event only, when prompt logprobs were asked for: ``(token_id,
    # logprob, {token_id: logprob})`` of prompt positions 1.. (position 0 has none).
    prompt_logprobs: Optional[List[Any]] = None


def _prompt_logprobs(entries: Optional[List[Any]]) -> Optional[List[Any]]:
    if entries is None:
        return None
    return [(token_id, logprob, dict(top)) for token_id, logprob, top in entries]


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
    # --model_name values; empty: the directory name and the --model_dir path.
    served_model_names: List[str] = field(default_factory=list)
    slot_wait_seconds: float = 600.0


class _Pending:
    """Per-request state in the HTTP process."""

    def __init__(self, prompt_tokens: int):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.first_token_seconds: Optional[float] = None  # since submission, for /metrics
        self.finished = False
        self.failure: Optional[ServerUnavailableError] = None


class HttpServerManager:
    """Accepts requests from the API layer and streams their tokens back."""

    def __init__(self, config: HttpServerConfig):
        self.config = config
        self.model_name = config.model_name
        # Names a request's ``model`` may use: the --model_name list, or by default the directory's
        # name and the checkpoint path as given on the command line (vLLM's default id).
        model_path = config.model_dir.rstrip("/") or config.model_dir
        if config.served_model_names:
            self.served_model_names = list(dict.fromkeys([config.model_name, *config.served_model_names]))
        else:
            self.served_model_names = list(dict.fromkeys([config.model_name, config.model_dir, model_path]))
        self.max_req_total_len = config.max_req_total_len
        self.vocab_size = config.vocab_size
        self.eos_token_ids = list(config.eos_token_ids)
        self.tokenizer = load_tokenizer(config.model_dir, config.tokenizer_mode)
        self.shm = ShmReqBuffer(config.shm_req_name, config.slot_num, config.max_req_total_len, create=False)
        self.stats = ShmStats(config.shm_stats_name, create=False)
        self.metrics = ServerMetrics(config.prefill_queue_strategy, self.stats, config.model_name, config.max_req_total_len)
        self._free_slots: List[int] = list(range(config.slot_num - 1, -1, -1))
        self._slot_freed: Optional[asyncio.Condition] = None
        self._pending: Dict[int, _Pending] = {}
        self._next_request_id = 1
        self._receiver: Optional[asyncio.Task] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        # Set once the server stops taking requests; new requests get it as their error.
        self._refusal: Optional[ServerUnavailableError] = None
        # Set once every pending request was failed; also fails requests still waiting for a slot.
        self._failure: Optional[ServerUnavailableError] = None
        self._backend_alive = True
        self._active_generations = 0

    # --- lifecycle (called from the FastAPI lifespan) ----------------------------------------
    async def start(self) -> None:
        """Open sockets and start the receiver task."""
        self.loop = asyncio.get_running_loop()
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
                    None if token.top_logprobs is None else dict(token.top_logprobs),
                    _prompt_logprobs(message.prompt_logprobs) if i == 0 else None,
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
                await asyncio.wait_for(
                    self._slot_freed.wait_for(lambda: bool(self._free_slots) or self._failure is not None),
                    self.config.slot_wait_seconds,
                )
            except asyncio.TimeoutError as exc:
                raise ServerBusyError("server is busy: no request slot became free in time") from exc
            if self._failure is not None:
                raise self._failure
            return self._free_slots.pop()

    # --- shutdown and failure (called on the event loop by the supervisor) ----------------------
    def refuse_new_requests(self, message: str, code: str) -> None:
        """From now on every new request fails with a 503 carrying ``message``; /health says 503."""
        if self._refusal is None:
            self._refusal = ServerUnavailableError(message, code)

    def fail_pending(self, message: str, code: str, backend_alive: bool) -> int:
        """End every pending request (and every later one) with ``message``; returns how many.

        ``backend_alive`` False means a child process died: nothing is sent to the router then,
        since no one would read it.
        """
        failure = ServerUnavailableError(message, code)
        self.refuse_new_requests(message, code)
        self._failure = failure
        self._backend_alive = self._backend_alive and backend_alive
        failed = 0
        for pending in self._pending.values():
            if not pending.finished and pending.failure is None:
                pending.failure = failure
                pending.queue.put_nowait(_FAILED)
                failed += 1
        if self._slot_freed is not None:
            asyncio.ensure_future(self._wake_slot_waiters())
        return failed

    async def _wake_slot_waiters(self) -> None:
        async with self._slot_freed:
            self._slot_freed.notify_all()

    async def wait_until_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every request to end; True if they all did."""
        deadline = time.monotonic() + timeout
        while self._active_generations:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(0.05, remaining))
        return True

    # --- the API layer's interface ---------------------------------------------------------------
    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of ``text``, by default with the special tokens (BOS) the checkpoint's tokenizer adds."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_chat(
        self,
        messages: List[Dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
    ) -> List[int]:
        """Token ids of a chat rendered with the checkpoint's chat template.

        ``chat_template_kwargs`` become variables of the template (vLLM's request extra).
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        # The template writes BOS itself when it wants one; encode without adding another.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def default_max_new_tokens(self, prompt_len: int, fallback: Optional[int] = None) -> int:
        """max_new_tokens for a request that gives none.

        ``--max_new_tokens_default`` when set, else the endpoint's own default ``fallback``
        (16 for ``/v1/completions`` and ``/generate``), else the rest of the context; never
        more than the rest of the context.
        """
        remaining = max(1, self.max_req_total_len - prompt_len)
        if self.config.max_new_tokens_default is not None:
            return min(self.config.max_new_tokens_default, remaining)
        if fallback is not None:
            return min(fallback, remaining)
        return remaining

    def health(self) -> bool:
        """Whether the server accepts requests."""
        return self._refusal is None and self._receiver is not None and not self._receiver.done()

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
        if self._refusal is not None:
            raise self._refusal
        self._active_generations += 1
        try:
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
            finish_reason = None
            try:
                await self.to_router.send_pyobj(NewRequest(request_id, slot))
                events = self._events(pending, request, started)
                try:
                    async for event in events:
                        finish_reason = event.finish_reason
                        yield event
                finally:
                    await events.aclose()
                if pending.failure is not None:
                    finish_reason = "error"
                    raise pending.failure
                if finish_reason is None:
                    finish_reason = "abort"  # the client went away
            finally:
                self._pending.pop(request_id, None)
                if (finish_reason in (None, "abort") or pending.failure is not None) and self._backend_alive:
                    # Client went away, the stream was closed early or the server gives up on the
                    # request: stop the work.
                    self.shm.records[slot]["abort_flag"] = 1
                    await self.to_router.send_pyobj(AbortRequest(request_id))
                self.metrics.on_finish(
                    finish_reason or "abort",
                    pending.completion_tokens,
                    time.perf_counter() - started,
                    prompt_tokens=pending.prompt_tokens,
                    first_token_seconds=pending.first_token_seconds,
                )
        finally:
            self._active_generations -= 1

    async def _events(self, pending: _Pending, request: Any, started: float) -> AsyncIterator[GenerationEvent]:
        """A request's token events until it finishes, fails, or its client disconnects.

        The client is asked every ``DISCONNECT_CHECK_SECONDS`` whether tokens are flowing or
        not, so a walk-away client of a long generation is noticed within that time.
        """
        last_token_at: Optional[float] = None
        next_check = time.monotonic() + DISCONNECT_CHECK_SECONDS
        while True:
            if not pending.queue.empty():
                event = pending.queue.get_nowait()
            else:
                try:
                    event = await asyncio.wait_for(pending.queue.get(), max(0.0, next_check - time.monotonic()))
                except asyncio.TimeoutError:
                    event = None
            if event is _FAILED:
                return
            if request is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_CHECK_SECONDS
                if await request.is_disconnected():
                    return
            if event is None:
                continue
            now = time.perf_counter()
            if event.token_id >= 0:
                if last_token_at is None:
                    pending.first_token_seconds = now - started
                    self.metrics.on_first_token(pending.first_token_seconds, event.cached_tokens)
                else:
                    self.metrics.on_next_token(now - last_token_at)
                last_token_at = now
            if event.token_id >= 0 or event.finish_reason is not None:
                yield event
            if event.finish_reason is not None:
                return
