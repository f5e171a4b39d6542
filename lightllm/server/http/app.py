"""The FastAPI application: LightLLM's native endpoints plus the OpenAI-compatible ones.

Native endpoints
----------------
``POST /generate`` and ``POST /generate_stream`` take
``{"inputs": str | [int], "parameters": {...}, "high_priority_request": bool}`` (``inputs`` a
text or its token ids; see :class:`~lightllm.server.http.native_models.NativeParameters` for
``parameters``; unknown keys, including the internal ``infer_high_priority``, are rejected with
400). ``high_priority_request`` is honoured only from trusted clients and refused with 403
otherwise (:mod:`lightllm.server.http.middleware.auth`).

``/generate`` answers::

    {"generated_text": [text], "count_output_tokens": int, "finish_reason": "stop"|"length"|"abort",
     "prompt_tokens": int, "prompt_cache_len": int,
     "tokens": [{"id", "text", "logprob", "special", "top_logprobs": {id: logprob} | null}],
     "details": {"finish_reason", "prompt_tokens", "prompt_cache_len", "count_output_tokens", "tokens"}}

where ``tokens`` (top level, as LightLLM has it) and ``details`` are present only with
``parameters.return_details``.  With ``parameters.n`` > 1 ``generated_text``,
``count_output_tokens``, ``finish_reason``, ``tokens`` and ``details`` hold one entry per choice.
``max_new_tokens`` defaults to 16, as in LightLLM.

``/generate_stream`` sends one server-sent event per generated token::

    data: {"token": {"id", "text", "logprob", "special", "count_output_tokens", "prompt_tokens",
                     "prompt_cache_len", "top_logprobs" (with parameters.logprobs)},
           "generated_text": null | full text (last event), "finished": bool,
           "finish_reason": null | str, "details": null | {...}}

``details`` on the last event carries the counts when ``return_details`` is set. The native
stream has no ``[DONE]`` sentinel; ``finished`` marks the end.

Service endpoints: ``GET /health`` and ``/health/ready`` (readiness: 200 ``{"status": "ok"}`` or 503),
``GET /health/live`` (liveness, see :mod:`lightllm.server.http.service.health`), ``GET /metrics``, and vLLM's
``GET /version`` and ``GET``/``POST /ping`` (:mod:`lightllm.server.http.service.service_routes`).  vLLM's
``POST /tokenize`` and ``POST /detokenize`` are in :mod:`lightllm.server.http.tokenize.tokenize_routes`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator, Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lightllm.server.http.middleware.absolute_form import AbsoluteFormMiddleware
from lightllm.server.http.validation.body import parse_body_off_loop
from lightllm.server.http.middleware.cors import JsonErrorCorsMiddleware, cors_options
from lightllm.server.http.errors import (
    APIError,
    JSONErrorRoute,
    install_error_handlers,
    internal_error,
    sse_error,
)
from lightllm.server.http.generation.fanout import ChoiceJob, GenerationFanout, sse, sse_response
from lightllm.server.http.native_models import NativeGenerateRequest
from lightllm.server.http.native_sampling import NATIVE_DEFAULT_MAX_NEW_TOKENS, native_sampling_params
from lightllm.server.http.openai.openai_routes import OpenAIEndpoints
from lightllm.server.http.openai.chat_completion_request import ChatCompletionRequest
from lightllm.server.http.openai.openai_models import CompletionRequest
from lightllm.server.http.openai.logprob_formatter import json_logprob
from lightllm.server.http.openai.openai_shapes import best_choices, final_finish_reason, smallest_cached_tokens
from lightllm.server.http.openapi import install_request_schemas, request_body
from lightllm.server.http.generation.planning import (check_context_length,
                                                      check_generation_counts, check_min_tokens_fit, check_token_ids,
                                                      choice_jobs, default_length_for, encoded)
from lightllm.server.core.objs.shm_req_layout import wants_top_rows
from lightllm.server.http.middleware.auth import ApiKeyMiddleware, check_priority_allowed
from lightllm.server.http.middleware.client_share import ClientShare, ClientShareMiddleware
from lightllm.server.http.middleware.in_flight import (AdmissionMiddleware, DrainRefusalMiddleware, PreparingRequests,
                                                       check_admission)
from lightllm.server.http.service.health import HEALTH_PATHS, POST_PROBE_PATHS, health_answer, manager_readiness
from lightllm.server.http.middleware.request_guard import RequestGuardMiddleware
from lightllm.server.http.middleware.unread_body import UnreadBodyCloseMiddleware
from lightllm.server.http.retry_after import body_error_code, retry_after_headers
from lightllm.server.http.server_options import HttpServerOptions
from lightllm.server.http.generation.prompt_encoding import PromptEncoder
from lightllm.server.http.service.service_routes import ServiceEndpoints
from lightllm.server.http.tokenize.tokenize_models import (DetokenizeRequest, TokenizeChatRequest,
                                                           TokenizeCompletionRequest)
from lightllm.server.http.tokenize.tokenize_routes import TokenizeEndpoints
from lightllm.server.request_manager import RequestManager, missing_request_manager_members
from lightllm.utils.tokenizer_utils import tokenizer_special_ids

logger = logging.getLogger(__name__)


class NativeEndpoints:
    """LightLLM's native generation endpoints and the service endpoints, bound to a manager."""

    def __init__(self, manager: RequestManager, encoder: PromptEncoder | None = None) -> None:
        self.manager = manager
        self.encoder = encoder or PromptEncoder(manager)
        # Every id skip_special_tokens hides (added tokens flagged special too, as Llama 3's headers).
        self._special_ids = tokenizer_special_ids(manager.served.tokenizer) | frozenset(manager.served.eos_token_ids)

    def router(self) -> APIRouter:
        """An APIRouter with ``/generate``, ``/generate_stream``, ``/health`` and ``/metrics``."""
        router = APIRouter(route_class=JSONErrorRoute)
        body = request_body(NativeGenerateRequest, asks_priority=True)
        router.add_api_route("/generate", self.generate, methods=["POST"], openapi_extra=body)
        router.add_api_route("/generate_stream", self.generate_stream, methods=["POST"],
                             openapi_extra=request_body(NativeGenerateRequest, streams="always", asks_priority=True))
        for path in sorted(HEALTH_PATHS):
            router.add_api_route(path, self.health, methods=["GET"])
            router.add_api_route(path, self.health, methods=["HEAD"], include_in_schema=False)
        for path in sorted(POST_PROBE_PATHS):
            router.add_api_route(path, self.health, methods=["POST"])
        router.add_api_route("/metrics", self.metrics, methods=["GET"])
        # HEAD beside GET on every read-only path (RFC 9110 9.1: general-purpose servers support it;
        # monitors and proxies check a path with it); HEAD is left out of the schema, as on /health.
        router.add_api_route("/metrics", self.metrics, methods=["HEAD"], include_in_schema=False)
        return router

    async def health(self, request: Request) -> Response:
        """Readiness (``/health``, ``/health/ready``) or liveness (``/health/live``), and LightLLM's names for
        them (``/healthz``, ``/readiness``, ``/liveness``); the front door answers the same."""
        status, body = health_answer(request.url.path, manager_readiness(self.manager))
        return JSONResponse(body, status_code=status, headers=retry_after_headers(status, body_error_code(body)))

    async def metrics(self) -> Response:
        """Prometheus metrics as produced by the manager."""
        body, content_type = self.manager.metrics_text()
        return Response(content=body, media_type=content_type)

    async def _start(self, request: Request, stream: bool = False
                     ) -> tuple[NativeGenerateRequest, GenerationFanout, list[ChoiceJob]]:
        check_admission(self.manager, request)
        # A large body is decoded on a worker thread so other clients are not stalled behind it.
        body = await parse_body_off_loop(await request.body(), NativeGenerateRequest)
        check_priority_allowed(request, body.high_priority_request)
        parameters = body.parameters
        if stream and parameters.candidates > 1:
            param = "parameters.n" if parameters.n > 1 else "parameters.best_of"
            raise APIError(400, "n > 1 and best_of > 1 are supported by /generate only, not /generate_stream",
                           param=param)
        if not stream and parameters.logprobs is not None and not parameters.return_details:
            # /generate reports alternatives only in its per-token details; without them the field
            # would cost a top-logprob slot and change nothing.
            raise APIError(400, "parameters.logprobs is reported in the per-token details of /generate: "
                           "set parameters.return_details to true", param="parameters.logprobs")
        prompt_ids = await self._prompt_ids(body)
        max_new = parameters.max_new_tokens
        min_beyond_room = False
        if max_new is None:
            max_new, min_beyond_room = default_length_for(
                max(1, self.manager.served.default_max_new_tokens(len(prompt_ids), NATIVE_DEFAULT_MAX_NEW_TOKENS)),
                parameters.min_new_tokens, len(prompt_ids), self.manager.served.max_req_total_len)
        params = await native_sampling_params(self.manager, parameters, max_new, request)
        if min_beyond_room:
            check_min_tokens_fit(len(prompt_ids), params.min_new_tokens, self.manager.served.max_req_total_len,
                                 prompt_noun="prompt", min_param="parameters.min_new_tokens")
        check_context_length(len(prompt_ids), max_new, self.manager.served.max_req_total_len, prompt_param="inputs",
                             prompt_noun="prompt", tokens_param="parameters.max_new_tokens")
        check_generation_counts(self.manager, 1, parameters.candidates,
                                "parameters.best_of" if parameters.candidates > parameters.n else "parameters.n",
                                wants_top_rows(params))
        jobs = choice_jobs(0, prompt_ids, params, parameters.candidates)
        fanout = GenerationFanout(self.manager, jobs, high_priority=body.high_priority_request, request=request)
        await fanout.start()
        self.manager.on_request_params(parameters.n)  # accepted: vLLM's request_params_n
        return body, fanout, jobs

    async def _prompt_ids(self, body: NativeGenerateRequest) -> list[int]:
        """The prompt's token ids: ``inputs`` tokenized, or the ids it holds checked against the vocabulary."""
        if isinstance(body.inputs, str):
            options = {} if body.parameters.add_special_tokens else {"add_special_tokens": False}
            return await encoded(self.encoder.encode_prompt(body.inputs, "inputs", **options), "inputs",
                                 self.manager.served.vocab_size)
        # Token ids are used as given whatever add_special_tokens says, as /v1/completions (and vLLM,
        # and LightLLM's HTTP manager) use a token-id prompt; a client that tokenized chose its BOS.
        check_token_ids(body.inputs, self.manager.served.vocab_size, "inputs")
        return list(body.inputs)

    def _token(self, event: Any) -> dict[str, Any]:
        """The fields every native token record has (stream events and details add their own)."""
        return {"id": event.token_id, "text": event.text, "logprob": json_logprob(event.logprob),
                "special": event.token_id < 0 or event.token_id in self._special_ids}

    @staticmethod
    def _top_logprobs(event: Any, asked: bool) -> dict[int, Any] | None:
        """``{token_id: logprob}`` of the token's ``parameters.logprobs`` alternatives (``{}`` for 0), None unasked."""
        top = event.top_logprobs
        if top is None:
            return {} if asked else None
        return {token_id: json_logprob(value) for token_id, value in top.items()}

    @staticmethod
    def _counts(event: Any) -> dict[str, Any]:
        return {"finish_reason": event.finish_reason, "prompt_tokens": event.prompt_tokens,
                "prompt_cache_len": event.cached_tokens, "count_output_tokens": event.completion_tokens}

    async def generate(self, request: Request) -> Response:
        """``POST /generate``: the whole generation in one JSON answer."""
        body, fanout, jobs = await self._start(request)
        collected = await fanout.collect()
        parameters = body.parameters
        # The prompt's cache hit as the request reports it (the smallest of its generations', the
        # siblings' work left out), over every generation run, whichever ones best_of keeps.
        prompt_cached = smallest_cached_tokens(collected, jobs)[0]
        if parameters.candidates > parameters.n:
            collected, jobs = best_choices(collected, jobs, parameters.n)
        choices = [collected[index] for index in sorted(collected)]
        answers = [self._answer(events, parameters.return_details, parameters.logprobs is not None)
                   for events in choices]
        if len(answers) == 1:
            # One answer for the request: its details report the prompt's hit as the top level does.
            answer = {**answers[0], "prompt_cache_len": prompt_cached}
            if "details" in answer:
                answer["details"] = {**answer["details"], "prompt_cache_len": prompt_cached}
            return JSONResponse(answer)
        # n > 1: LightLLM's shape, one list entry per choice.
        merged: dict[str, Any] = {
            "generated_text": [answer["generated_text"][0] for answer in answers],
            "count_output_tokens": [answer["count_output_tokens"] for answer in answers],
            "finish_reason": [answer["finish_reason"] for answer in answers],
            "prompt_tokens": answers[0]["prompt_tokens"],
            "prompt_cache_len": prompt_cached,
        }
        if parameters.return_details:
            merged["tokens"] = [answer["tokens"] for answer in answers]
            merged["details"] = [answer["details"] for answer in answers]
        return JSONResponse(merged)

    def _answer(self, events: list[Any], return_details: bool, asked_top: bool) -> dict[str, Any]:
        """One choice's /generate answer; with details, ``tokens`` at the top level as LightLLM has it."""
        last = events[-1]
        answer: dict[str, Any] = {
            "generated_text": ["".join(event.text for event in events)],
            "count_output_tokens": last.completion_tokens,
            "finish_reason": final_finish_reason(events),
            "prompt_tokens": last.prompt_tokens,
            "prompt_cache_len": last.cached_tokens,
        }
        if return_details:
            tokens = []
            # A negative token id marks a finish event that carries no token.
            for event in (event for event in events if event.token_id >= 0):
                tokens.append({**self._token(event), "top_logprobs": self._top_logprobs(event, asked_top)})
            answer["tokens"] = tokens
            answer["details"] = {**self._counts(last), "finish_reason": answer["finish_reason"], "tokens": tokens}
        return answer

    async def generate_stream(self, request: Request) -> Response:
        """``POST /generate_stream``: one server-sent event per generated token."""
        body, fanout, _ = await self._start(request, stream=True)
        return sse_response(self._stream(body, fanout), fanout)

    async def _stream(self, body: NativeGenerateRequest, fanout: GenerationFanout) -> AsyncIterator[bytes]:
        pieces: list[str] = []
        try:
            async for _, event in fanout.events():
                pieces.append(event.text)
                finished = event.finish_reason is not None
                details = self._counts(event) if finished and body.parameters.return_details else None
                token = {**self._token(event), "count_output_tokens": event.completion_tokens,
                         "prompt_tokens": event.prompt_tokens, "prompt_cache_len": event.cached_tokens}
                if body.parameters.logprobs is not None:
                    token["top_logprobs"] = self._top_logprobs(event, True)
                yield sse({"token": token, "generated_text": "".join(pieces) if finished else None,
                           "finished": finished, "finish_reason": event.finish_reason, "details": details})
        except APIError as error:
            yield sse_error(error)
        except Exception:  # noqa: BLE001 - the status line is sent; report in-band instead
            logger.exception("native stream failed")
            yield sse_error(internal_error())


def create_app(
    manager: RequestManager, options: HttpServerOptions | None = None, extra_routers: Sequence[APIRouter] = ()
) -> FastAPI:
    """Build the HTTP application around a request manager.

    ``extra_routers`` (a PD master's membership and readiness endpoints, a PD node's control
    endpoints) are included before the public API, so a route they define (``/health`` on a PD
    master) takes precedence over the public API's own.

    ``manager`` implements :class:`~lightllm.server.request_manager.RequestManager` (the HTTP
    process's ``HttpServerManager``, or any other manager serving the same API); one that does
    not is refused with a ``TypeError`` naming what it lacks.
    """
    missing = missing_request_manager_members(manager)
    if missing:
        raise TypeError(f"create_app needs a RequestManager; {type(manager).__name__} lacks {', '.join(missing)}")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The manager's sockets and receiver task belong to the server's event loop.
        await manager.start()
        # anyio imports its asyncio backend lazily on the first streamed response; doing it
        # here keeps that import (about half a second) out of the first client's latency.
        import anyio._backends._asyncio  # noqa: F401
        try:
            yield
        finally:
            await manager.stop()

    # No trailing-slash redirects: a 307 with an empty body whose Location comes from the client's Host
    # header; /v1/completions/ is an unknown path like any other (a JSON 404).
    app = FastAPI(title="lightllm", summary="LLM serving with a configurable prefill-queue scheduler", lifespan=lifespan,
                  redirect_slashes=False)
    install_error_handlers(app)
    options = options or HttpServerOptions()
    encoder = PromptEncoder(manager, options.limits.prompt_chars_per_token)
    for router in extra_routers:
        app.include_router(router)
    app.include_router(NativeEndpoints(manager, encoder).router())
    openai = OpenAIEndpoints(manager, encoder, options.tool_call_parser, options.trust_request_chat_template)
    app.include_router(openai.router())
    # vLLM's tokenizer endpoints share the OpenAI endpoints' model and request-template rules.
    app.include_router(TokenizeEndpoints(manager, encoder, openai).router())
    app.include_router(ServiceEndpoints().router())
    # Added last = runs first: keys are checked before any body byte is read.
    app.add_middleware(RequestGuardMiddleware,
                       max_body_bytes=options.limits.body_limit(manager.served.max_req_total_len),
                       body_timeout=options.limits.body_timeout)
    # Inside the key check and CORS, before the body is read: a drain's 503 for a generation request.
    app.add_middleware(DrainRefusalMiddleware, manager=manager)
    app.add_middleware(ApiKeyMiddleware, policy=options.auth)
    cors = cors_options(options.allowed_origins)
    if cors is not None:
        # Outside the key check: a browser's preflight carries no API key and no body, and every
        # answer the app gives (a 401, a 400) needs the headers for the page to read it.
        app.add_middleware(JsonErrorCorsMiddleware, **cors)
    app.state.preparing = PreparingRequests()
    if options.limits.max_preparing_per_client > 0:
        # Outside CORS and the key check: a client's flood of cheap requests (preflights and 401s
        # included) waits in its own line before any of them spends time on it.
        app.add_middleware(ClientShareMiddleware, share=ClientShare(options.limits.max_preparing_per_client),
                           book=app.state.preparing, manager=manager)
    # Outside every layer that waits: a request counts for a graceful drain from its head's arrival, also while it waits
    # for its client's share (lightllm/server/http/middleware/in_flight.py).
    app.add_middleware(AdmissionMiddleware, book=app.state.preparing)
    # Around everything that may answer before the guard reads the body (401, a CORS refusal, 503).
    app.add_middleware(UnreadBodyCloseMiddleware)
    # Outermost: every layer inside reads the path (the key check's exemptions, the share, the routes).
    app.add_middleware(AbsoluteFormMiddleware)
    install_request_schemas(app, [NativeGenerateRequest, CompletionRequest, ChatCompletionRequest,
                                  TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest], options.auth)
    return app
