"""OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Each choice of a request (every prompt times ``n``) is one ``manager.generate`` call; the
calls run concurrently and :class:`GenerationFanout` merges their token events. Choice
``j`` of prompt ``i`` has index ``i * n + j``. Every call is primed (its first event
awaited) before any response byte is sent, so a request the manager refuses still gets a
proper 400/503 status even when streaming.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lightllm.server.api_errors import APIError, JSONErrorRoute, internal_error, manager_error, model_not_found, sse_error
from lightllm.server.api_fanout import ChoiceJob, GenerationFanout, sse, sse_response
from lightllm.server.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAISamplingRequest,
    build_sampling_params,
    check_context_length,
    check_token_ids,
    parse_body,
)

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "stop_sequences": "stop"}
_SEED_MODULUS = 2**63


def json_logprob(value: float) -> float:
    """A logprob that JSON can carry: -inf/NaN (a masked token) become OpenAI's -9999.0."""
    return value if math.isfinite(value) else -9999.0


def final_finish_reason(events: list[Any]) -> str:
    """The finish reason of a collected choice; a generation cut off without one was aborted."""
    return events[-1].finish_reason or "abort"


class UsageTracker:
    """Token counts of a request: each prompt counted once, every choice's completion."""

    def __init__(self, jobs: list[ChoiceJob]) -> None:
        owners: dict[int, int] = {}
        for job in jobs:
            owners.setdefault(job.prompt_index, job.index)
        # The first choice of each prompt reports that prompt's token counts.
        self._prompt_owner = set(owners.values())
        self._prompt: dict[int, tuple[int, int]] = {}
        self._completion: dict[int, int] = {}

    def update(self, index: int, event: Any) -> None:
        """Record the counts carried by ``event`` of choice ``index``."""
        self._completion[index] = event.completion_tokens
        if index in self._prompt_owner:
            self._prompt[index] = (event.prompt_tokens, event.cached_tokens)

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI ``usage`` object."""
        prompt_tokens = sum(tokens for tokens, _ in self._prompt.values())
        completion_tokens = sum(self._completion.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached for _, cached in self._prompt.values())},
        }


class TokenLogprobFormatter:
    """Turns per-token logprobs into the completions or chat ``logprobs`` shapes."""

    def __init__(self, tokenizer: Any, top_count: int) -> None:
        self._tokenizer = tokenizer
        self._top_count = top_count

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own.

        Events with a negative ``token_id`` are finish markers that carry no token; they
        are left out of every logprobs list.
        """
        return self._tokenizer.decode([token_id])

    def _top(self, event: Any) -> list[tuple[int, float]]:
        ranked = sorted((event.top_logprobs or {}).items(), key=lambda item: -item[1])
        return [(token_id, json_logprob(value)) for token_id, value in ranked[: self._top_count]]

    def completion(self, events: list[Any], start_offset: int) -> dict[str, Any]:
        """Legacy completions logprobs; the sampled token is always among ``top_logprobs``."""
        tokens, offsets, top = [], [], []
        offset = start_offset
        events = [event for event in events if event.token_id >= 0]
        for event in events:
            tokens.append(self.token_text(event.token_id))
            offsets.append(offset)
            offset += len(event.text)
            alternatives = {self.token_text(token_id): value for token_id, value in self._top(event)}
            alternatives.setdefault(tokens[-1], json_logprob(event.logprob))
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [json_logprob(event.logprob) for event in events],
                "top_logprobs": top, "text_offset": offsets}

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode("utf-8"))}

    def chat(self, events: list[Any]) -> dict[str, Any]:
        """Chat logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
        content = []
        for event in events:
            if event.token_id < 0:
                continue
            entry = self._chat_entry(event.token_id, event.logprob)
            entry["top_logprobs"] = [self._chat_entry(token_id, value) for token_id, value in self._top(event)]
            content.append(entry)
        return {"content": content}


class OpenAIEndpoints:
    """The OpenAI-compatible handlers bound to one request manager."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def router(self) -> APIRouter:
        """An APIRouter with every OpenAI route."""
        router = APIRouter(route_class=JSONErrorRoute)
        router.add_api_route("/v1/models", self.list_models, methods=["GET"])
        router.add_api_route("/v1/models/{model_id:path}", self.get_model, methods=["GET"])
        router.add_api_route("/v1/completions", self.completions, methods=["POST"])
        router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return router

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.manager.model_name, "object": "model", "created": 0, "owned_by": "lightllm",
                "max_model_len": self.manager.max_req_total_len}

    async def list_models(self) -> dict[str, Any]:
        """``GET /v1/models``: the single served model."""
        return {"object": "list", "data": [self._model_card()]}

    async def get_model(self, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{id}``: the model card, or 404 for any other id."""
        if model_id != self.manager.model_name:
            raise model_not_found(model_id)
        return self._model_card()

    def _plan_jobs(self, body: OpenAISamplingRequest, prompts: list[list[int]], logprobs: int | None,
                   prompt_param: str, prompt_noun: str) -> list[ChoiceJob]:
        jobs = []
        for prompt_index, prompt_ids in enumerate(prompts):
            requested = body.requested_max_tokens()
            max_new = requested if requested is not None else max(
                1, self.manager.default_max_new_tokens(len(prompt_ids)))
            values = {**body.sampling_fields(), "max_new_tokens": max_new, "logprobs": logprobs}
            params = build_sampling_params(values, self.manager.vocab_size, OPENAI_NAMES)
            check_context_length(len(prompt_ids), max_new, self.manager.max_req_total_len,
                                 prompt_param=prompt_param, prompt_noun=prompt_noun, tokens_param="max_tokens")
            for choice in range(body.n):
                # Offsetting the seed keeps a seeded request reproducible while its n
                # choices still differ from one another.
                choice_params = params if params.seed is None or choice == 0 else replace(
                    params, seed=(params.seed + choice) % _SEED_MODULUS)
                jobs.append(ChoiceJob(prompt_index * body.n + choice, prompt_index, prompt_ids, choice_params))
        return jobs

    def _encode(self, encoder: Callable[[Any], list[int]], value: Any, param: str) -> list[int]:
        try:
            ids = list(encoder(value))
        except ValueError as exc:
            raise manager_error(exc, param) from None
        if not ids:
            raise APIError(400, f"{param} is empty after tokenization", param=param)
        return ids

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        body = parse_body(await request.body(), CompletionRequest)
        if body.model != self.manager.model_name:
            raise model_not_found(body.model)
        prompts = []
        for prompt in body.prompt:
            if isinstance(prompt, str):
                prompts.append(self._encode(self.manager.encode_prompt, prompt, "prompt"))
            else:
                check_token_ids(prompt, self.manager.vocab_size, "prompt")
                prompts.append(list(prompt))
        jobs = self._plan_jobs(body, prompts, body.logprobs, "prompt", "prompt")
        formatter = TokenLogprobFormatter(self.manager.tokenizer, body.logprobs or 0)
        return await self._respond(request, body, jobs, CompletionShaper(formatter, body.logprobs is not None))

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        body = parse_body(await request.body(), ChatCompletionRequest)
        if body.model != self.manager.model_name:
            raise model_not_found(body.model)
        messages = [message.to_template_dict() for message in body.messages]
        prompt_ids = self._encode(self.manager.encode_chat, messages, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        jobs = self._plan_jobs(body, [prompt_ids], logprobs, "messages", "messages")
        formatter = TokenLogprobFormatter(self.manager.tokenizer, body.top_logprobs or 0)
        return await self._respond(request, body, jobs, ChatShaper(formatter, body.logprobs))

    async def _respond(self, request: Request, body: OpenAISamplingRequest, jobs: list[ChoiceJob],
                       shaper: "CompletionShaper | ChatShaper") -> Response:
        fanout = GenerationFanout(self.manager, jobs, request=request)
        await fanout.start()
        header = {"id": f"{shaper.id_prefix}-{uuid.uuid4().hex}", "object": shaper.object_name,
                  "created": int(time.time()), "model": self.manager.model_name}
        if body.stream:
            chunk_header = {**header, "object": shaper.chunk_object_name}
            return sse_response(self._stream(body, jobs, fanout, shaper, chunk_header), fanout)
        collected = await fanout.collect()
        usage = UsageTracker(jobs)
        choices = []
        for index in sorted(collected):
            for event in collected[index]:
                usage.update(index, event)
            choices.append(shaper.final_choice(index, collected[index]))
        return JSONResponse({**header, "choices": choices, "usage": usage.to_dict()})

    @staticmethod
    async def _stream(body: OpenAISamplingRequest, jobs: list[ChoiceJob], fanout: GenerationFanout,
                      shaper: "CompletionShaper | ChatShaper", header: dict[str, Any]) -> AsyncIterator[bytes]:
        usage = UsageTracker(jobs)
        # With include_usage every chunk carries "usage": null except the final usage chunk.
        tail = {"usage": None} if body.include_usage else {}
        for job in jobs:
            opening = shaper.opening_choice(job.index)
            if opening is not None:
                yield sse({**header, "choices": [opening], **tail})
        try:
            async for index, event in fanout.events():
                usage.update(index, event)
                choice = shaper.stream_choice(index, event)
                if choice is not None:
                    yield sse({**header, "choices": [choice], **tail})
        except APIError as error:
            yield sse_error(error)
        except Exception:  # noqa: BLE001 - the status line is sent; report in-band instead
            logger.exception("streaming response failed")
            yield sse_error(internal_error())
        else:
            if body.include_usage:
                yield sse({**header, "choices": [], "usage": usage.to_dict()})
        yield SSE_DONE


class CompletionShaper:
    """Choice objects of ``/v1/completions`` (``text_completion``) responses and chunks."""

    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, formatter: TokenLogprobFormatter, with_logprobs: bool) -> None:
        self._formatter = formatter
        self._with_logprobs = with_logprobs
        self._offsets: dict[int, int] = {}

    def opening_choice(self, index: int) -> None:
        """Completion streams start directly with text."""
        return None

    def stream_choice(self, index: int, event: Any) -> dict[str, Any] | None:
        """The chunk choice for one token; None for a token that adds nothing to send."""
        if not event.text and event.finish_reason is None and not self._with_logprobs:
            return None
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(event.text)
        logprobs = self._formatter.completion([event], offset) if self._with_logprobs else None
        return {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": event.finish_reason}

    def final_choice(self, index: int, events: list[Any]) -> dict[str, Any]:
        """The whole choice of a non-streaming response."""
        logprobs = self._formatter.completion(events, 0) if self._with_logprobs else None
        return {"index": index, "text": "".join(event.text for event in events), "logprobs": logprobs,
                "finish_reason": final_finish_reason(events)}


class ChatShaper:
    """Choice objects of ``/v1/chat/completions`` responses and ``chat.completion.chunk`` chunks."""

    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, formatter: TokenLogprobFormatter, with_logprobs: bool) -> None:
        self._formatter = formatter
        self._with_logprobs = with_logprobs

    def opening_choice(self, index: int) -> dict[str, Any]:
        """The first chunk of every choice announces the assistant role."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def stream_choice(self, index: int, event: Any) -> dict[str, Any] | None:
        """The chunk choice for one token; None for a token that adds nothing to send."""
        if not event.text and event.finish_reason is None and not self._with_logprobs:
            return None
        logprobs = self._formatter.chat([event]) if self._with_logprobs else None
        return {"index": index, "delta": {"content": event.text}, "logprobs": logprobs,
                "finish_reason": event.finish_reason}

    def final_choice(self, index: int, events: list[Any]) -> dict[str, Any]:
        """The whole choice of a non-streaming response."""
        return {"index": index, "message": {"role": "assistant", "content": "".join(event.text for event in events)},
                "logprobs": self._formatter.chat(events) if self._with_logprobs else None,
                "finish_reason": final_finish_reason(events)}
