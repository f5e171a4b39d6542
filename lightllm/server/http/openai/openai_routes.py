"""OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Each choice of a request (every prompt times ``n``) is one ``manager.generate`` call; the
calls run concurrently and :class:`GenerationFanout` merges their token events. Choice
``j`` of prompt ``i`` has index ``i * n + j``. Every call is primed (its first event
awaited) before any response byte is sent, so a request the manager refuses still gets a
proper 400/503 status even when streaming.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lightllm.server.http.openai.answer_size import large_answer
from lightllm.server.http.openai.model_id_path import MODEL_ID_CONVERTOR, register_model_id_convertor
from lightllm.server.http.validation.body import parse_body_off_loop
from lightllm.server.http.openai.chat_content_format import rendering_template, template_iterates_content
from lightllm.server.http.openai.chat_message import unread_reasoning
from lightllm.server.http.openai.developer_role import template_names_developer_role
from lightllm.server.http.errors import (INVALID_REQUEST, APIError, JSONErrorRoute, internal_error, invalid_request,
                                         model_not_found, sse_error)
from lightllm.server.http.generation.fanout import ChoiceJob, GenerationFanout, sse, sse_response
from lightllm.server.http.openai.grammar_thread import openai_request_grammar, planned_tool_calls
from lightllm.server.http.middleware.in_flight import check_admission
from lightllm.server.http.openai.request_id_header import client_request_id
from lightllm.server.http.openai.chat_completion_request import ChatCompletionRequest
from lightllm.server.http.openai.openai_models import CompletionRequest, OpenAISamplingRequest
from lightllm.server.http.openai.logprob_formatter import TokenLogprobFormatter
from lightllm.server.http.openai.openai_shapes import (
    ChatShaper,
    CompletionShaper,
    UsageTracker,
    best_choices,
    smallest_cached_tokens,
)
from lightllm.server.http.openapi import request_body
from lightllm.server.http.generation.planning import (
    build_sampling_params,
    check_generation_counts,
    check_min_tokens_fit,
    check_token_ids,
    completion_room,
    default_length_for,
    choice_jobs,
    encoded,
    prompt_noun,
)
from lightllm.server.http.generation.special_tokens import SpecialTokenFrame
from lightllm.server.http.openai.token_bytes import TokenBytes
from lightllm.server.http.openai.token_strings import TokenStrings
from lightllm.server.http.openai.response_shaper import ResponseShaper
from lightllm.server.http.openai.token_ids import TokenIdShaper
from lightllm.server.http.generation.prompt_encoding import PromptEncoder
from lightllm.server.request_manager import RequestManager
from lightllm.server.http.openai.tool_calls.request import ToolPlan
from lightllm.server.http.openai.tool_calls.shaper import ToolChatShaper

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


class OpenAIEndpoints:
    """The OpenAI-compatible handlers bound to one request manager."""

    def __init__(self, manager: RequestManager, encoder: PromptEncoder | None = None,
                 tool_call_parser: str | None = None, trust_request_chat_template: bool = False) -> None:
        self.manager = manager
        # /v1/models' "created": when this server started serving the model.
        self.created = int(time.time())
        self.encoder = encoder or PromptEncoder(manager)
        # --tool_call_parser: how tool calls are read from free text (tool_choice "auto").
        self.tool_call_parser = tool_call_parser
        # --trust_request_chat_template: whether a request may bring its own template.
        self.trust_request_chat_template = trust_request_chat_template
        # Every token's raw bytes (logprob ``bytes``, ``text_offset``), worked out once per server.
        self.token_bytes = TokenBytes(manager.served.tokenizer)
        # Every token's logprob string (vLLM's), worked out once per server where it can be.
        self.token_strings = TokenStrings(self.token_bytes)

    def check_request_template(self, template: str | None) -> None:
        """Refuse a request's own ``chat_template`` unless the server trusts its clients with one.

        A template is a program: its loops run on the tokenization threads, which every request
        shares, for as long as the template says (vLLM refuses them the same way by default).
        """
        if template is not None and not self.trust_request_chat_template:
            raise APIError(400, "this server does not accept a request's own chat_template (it runs on the "
                           "server; start it with --trust_request_chat_template to allow it, or --chat_template "
                           "to set one for every request)", param="chat_template")

    def router(self) -> APIRouter:
        """An APIRouter with every OpenAI route."""
        register_model_id_convertor()
        router = APIRouter(route_class=JSONErrorRoute)
        router.add_api_route("/v1/models", self.list_models, methods=["GET"])
        router.add_api_route("/v1/models", self.list_models, methods=["HEAD"], include_in_schema=False)
        # model_id: a path (a served name may hold '/'), never empty: /v1/models/ is an unknown path for
        # every method (with {model_id:path} it matched, so DELETE got a 405 advertising GET, and GET a 404).
        model_path = f"/v1/models/{{model_id:{MODEL_ID_CONVERTOR}}}"
        router.add_api_route(model_path, self.get_model, methods=["GET"])
        router.add_api_route(model_path, self.get_model, methods=["HEAD"], include_in_schema=False)
        router.add_api_route("/v1/completions", self.completions, methods=["POST"],
                             openapi_extra=request_body(CompletionRequest, streams=True))
        router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"],
                             openapi_extra=request_body(ChatCompletionRequest, streams=True))
        return router

    def served_names(self) -> list[str]:
        """Every name a request's ``model`` may use (the first is the one /v1/models reports)."""
        return list(getattr(self.manager.served, "served_model_names", None) or [self.manager.served.model_name])

    def check_model(self, model: str | None) -> str:
        """The model name to answer with: the requested one if served (a missing or empty one
        means the served model, as in vLLM), else a 404 naming the served names."""
        if not model:
            return self.manager.served.model_name
        served = self.served_names()
        if model not in served:
            raise model_not_found(model, served)
        return model

    async def truncation_frame(self, body: Any, added: bool) -> SpecialTokenFrame | None:
        """The special tokens a truncated prompt keeps: those the tokenizer added (``added``), else none."""
        if body.truncate_prompt_tokens is None or not added:
            return None
        return await self.encoder.special_token_frame()

    def _model_card(self, model_id: str | None = None) -> dict[str, Any]:
        """A model entry shaped as vLLM shapes it (``vllm bench serve`` reads ``root``)."""
        model_id = model_id or self.manager.served.model_name
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "lightllm",
                "root": self.model_root(), "parent": None, "max_model_len": self.manager.served.max_req_total_len,
                "permission": [{"id": f"modelperm-{model_id}", "object": "model_permission", "created": self.created,
                                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                                "organization": "*", "group": None, "is_blocking": False}]}

    def model_root(self) -> str:
        """``root`` of a model card: where the checkpoint was loaded from, as vLLM reports its
        ``--model`` (``vllm bench serve`` without ``--model`` loads its tokenizer from it); the
        served name where this process loaded none (a PD master)."""
        return getattr(self.manager.served, "model_path", None) or self.manager.served.model_name

    async def list_models(self) -> dict[str, Any]:
        """``GET /v1/models``: the single served model."""
        return {"object": "list", "data": [self._model_card()]}

    async def get_model(self, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{id}``: the model card, or 404 for any other id."""
        served = self.served_names()
        if model_id not in served:
            raise model_not_found(model_id, served)
        return self._model_card(model_id)

    def _plan_jobs(self, body: OpenAISamplingRequest, prompts: list[list[int]], logprobs: int | None,
                   prompt_param: str, prompt_logprobs: int | None = None,
                   grammar: str | None = None) -> list[ChoiceJob]:
        """Every choice of every prompt; ``prompt_param`` names the prompt field in context errors."""
        # The same for every prompt; only the completion length may depend on the prompt's.
        requested = body.requested_max_tokens()
        # The checkpoint's generation_config.json values for the fields the request leaves out (vLLM's default).
        fields = {**self.manager.served.generation_defaults.sampling_fields(), **body.sampling_fields(),
                  "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
                  "grammar": grammar}
        public_names = body.public_names()
        tokens_param = body.max_tokens_param()
        jobs = []
        for prompt_index, prompt_ids in enumerate(prompts):
            # With several prompts, errors name the one at fault (a batch of 64 from lm-eval).
            noun = prompt_noun(prompt_param, prompt_index, len(prompts))
            min_beyond_room = False
            if requested == 0:
                # echo with max_tokens 0: one token is generated (the prefill must finish) and dropped.
                max_new = 1
            elif requested is not None:
                max_new = requested
            else:
                max_new, min_beyond_room = default_length_for(
                    max(1, self.manager.served.default_max_new_tokens(len(prompt_ids), body.DEFAULT_MAX_TOKENS)),
                    body.min_tokens, len(prompt_ids), self.manager.served.max_req_total_len)
            # Checked as the client sent them first (their own width and range), then fitted.
            params = build_sampling_params({**fields, "max_new_tokens": max_new}, self.manager.served.vocab_size,
                                           public_names)
            if min_beyond_room:
                check_min_tokens_fit(len(prompt_ids), params.min_new_tokens, self.manager.served.max_req_total_len,
                                     prompt_noun=noun, min_param="min_tokens")
            if requested == 0:
                limit = self.manager.served.max_req_total_len
                if len(prompt_ids) >= limit:
                    raise APIError(400, f"echo with max_tokens 0 still runs the prompt to its first token (then "
                                   f"dropped), so the {noun} may hold at most {limit - 1} tokens on this server "
                                   f"(--max_req_total_len {limit}); it has {len(prompt_ids)}", INVALID_REQUEST,
                                   prompt_param, "context_length_exceeded")
            else:
                # A default length already fits the room; a requested one is cut to it.
                fitted = completion_room(len(prompt_ids), max_new, self.manager.served.max_req_total_len,
                                         prompt_param=prompt_param, prompt_noun=noun,
                                         tokens_param=tokens_param, min_new_tokens=params.min_new_tokens)
                if fitted != max_new:
                    params = replace(params, max_new_tokens=fitted)
            jobs.extend(choice_jobs(prompt_index, prompt_ids, params, body.candidates))
        return jobs

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        check_admission(self.manager, request)
        # A large body is decoded on a worker thread so other clients are not stalled behind it.
        body = await parse_body_off_loop(await request.body(), CompletionRequest)
        model = self.check_model(body.model)
        body.check_truncation(self.manager.served.max_req_total_len)
        # Before the prompts are tokenized: 64 of them are work to spare on a request refused anyway.
        check_generation_counts(self.manager, len(body.prompt), body.candidates,
                                "best_of" if body.best_of is not None else "n",
                                (body.logprobs or 0) > 0 or (body.prompt_logprobs or 0) > 0)
        prompts = []
        # What echo shows of each prompt: a text as sent, or ids to decode (see _echo_texts).
        echo_sources: list[str | list[int]] = []
        for index, prompt in enumerate(body.prompt):
            noun = prompt_noun("prompt", index, len(body.prompt))
            if isinstance(prompt, str):
                # Only a text prompt is tokenized; token ids are used as given, whatever add_special_tokens says.
                options = {} if body.add_special_tokens else {"add_special_tokens": False}
                keeps_end = body.truncate_prompt_tokens is not None
                ids = await encoded(self.encoder.encode_prompt(prompt, "prompt", keeps_end, **options), "prompt",
                                    self.manager.served.vocab_size, noun=noun)
                frame = await self.truncation_frame(body, body.add_special_tokens)
                kept = body.truncated(ids, frame)
                prompts.append(kept)
                if len(kept) == len(ids):
                    echo_sources.append(prompt)
                else:
                    echo_sources.append(frame.strip(kept) if frame is not None else kept)
            else:
                check_token_ids(prompt, self.manager.served.vocab_size, "prompt", noun=noun)
                prompts.append(body.truncated(list(prompt)))
                echo_sources.append(prompts[-1])
        # echo with logprobs reports the prompt's own logprobs, computed in the prefill forward (vLLM's
        # rule for how many alternatives: prompt_logprobs when given, else logprobs).
        prompt_logprobs = body.prompt_logprob_count()
        grammar = await openai_request_grammar(self.manager, body, request=request)
        jobs = self._plan_jobs(body, prompts, body.logprobs, "prompt", prompt_logprobs, grammar)
        formatter = TokenLogprobFormatter(self.token_bytes, body.logprobs or 0, body.return_tokens_as_token_ids,
                                          self.token_strings)
        echo = list(zip(await self._echo_texts(echo_sources), prompts)) if body.echo else None
        shaper: ResponseShaper = CompletionShaper(
            formatter, body.logprobs is not None, echo=echo, n=body.n, drop_output=body.max_tokens == 0,
            prompt_logprobs=prompt_logprobs, prompts=prompts, every_token=body.return_token_ids)
        if body.return_token_ids:
            shaper = TokenIdShaper(shaper, prompts, body.n, prompt_in_choice=True)
        return await self._respond(request, body, model, jobs, shaper)

    async def _echo_texts(self, sources: list[str | list[int]]) -> list[str]:
        """The text ``echo`` puts before each prompt's choices: a text prompt as the client sent it; one
        ``truncate_prompt_tokens`` cut as the tokens that were used (so its echoed logprobs and
        ``text_offset`` describe the text shown), decoded without the special tokens the tokenizer
        added around it, which an uncut text prompt's echo does not show either (BOS keeps its
        logprob entry at offset 0); a token-id prompt decoded, cut or not (its special tokens are ids
        the client sent).  Decoded on the tokenizer threads: a long prompt takes milliseconds."""
        tokenizer = self.manager.served.tokenizer
        if all(isinstance(source, str) for source in sources):
            return list(sources)
        return await self.encoder.on_tokenizer_thread(
            lambda: [source if isinstance(source, str) else tokenizer.decode(source) for source in sources])

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        check_admission(self.manager, request)
        # A large body is decoded on a worker thread so other clients are not stalled behind it.
        body = await parse_body_off_loop(await request.body(), ChatCompletionRequest)
        model = self.check_model(body.model)
        self.check_request_template(body.chat_template)
        body.check_truncation(self.manager.served.max_req_total_len)
        # Before the template renders and the prompt is tokenized, as for completions.
        wants_top = (bool(body.logprobs) and (body.top_logprobs or 0) > 0) or (body.prompt_logprobs or 0) > 0
        check_generation_counts(self.manager, 1, body.candidates, "best_of" if body.best_of is not None else "n",
                                wants_top)
        # Forced calls compile their tools' schemas: on the grammar thread, as every grammar.
        tool_plan = await planned_tool_calls(self.manager, body, self.tool_call_parser, request)
        if tool_plan.keeps_special_tokens:
            if "skip_special_tokens" in body.model_fields_set and body.skip_special_tokens:
                # Turned off below as vLLM does; a client that asked for it by name hears so.
                raise invalid_request(
                    f"skip_special_tokens true cannot hold with tool_choice auto and the {self.tool_call_parser} "
                    "tool-call parser: its call markers may be special tokens, which the server must keep to read "
                    "calls; leave skip_special_tokens out (it is turned off) or set tool_choice none",
                    "skip_special_tokens")
            body.skip_special_tokens = False
        prompt_ids = await encoded(self.render_chat(body, tool_plan, body.truncate_prompt_tokens is not None),
                                   "messages", self.manager.served.vocab_size)
        prompt_ids = body.truncated(prompt_ids, await self.truncation_frame(body, body.add_special_tokens))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        grammar = await openai_request_grammar(self.manager, body, tool_plan, request)
        jobs = self._plan_jobs(body, [prompt_ids], logprobs, "messages", body.prompt_logprobs, grammar)
        formatter = TokenLogprobFormatter(self.token_bytes, body.top_logprobs or 0,
                                          body.return_tokens_as_token_ids, self.token_strings)
        shaper_options = dict(prompt_logprobs=body.prompt_logprobs, prompt_ids=prompt_ids, echo=body.echo_text(),
                              every_token=body.return_token_ids)
        shaper: ResponseShaper = (ToolChatShaper(tool_plan, formatter, body.logprobs, **shaper_options)
                                  if tool_plan.reads_calls else ChatShaper(formatter, body.logprobs, **shaper_options))
        if body.return_token_ids:
            shaper = TokenIdShaper(shaper, [prompt_ids], body.n, prompt_in_choice=False)
        return await self._respond(request, body, model, jobs, shaper)

    def render_chat(self, body: ChatCompletionRequest, tool_plan: ToolPlan, keeps_end: bool,
                    generating: bool = True) -> Awaitable[list[int]]:
        """The chat's prompt ids, pending on a tokenizer thread: its messages in the shape the template
        wants, rendered with the request's template options and ``tool_plan``'s tools (``/tokenize``
        renders through here too, so both give the same ids).  ``keeps_end``: the prompt will be
        truncated from the left, so a long chat is tokenized whole rather than refused early.
        ``generating``: false for ``/tokenize`` (see :meth:`ToolPlan.template_options`)."""
        tokenizer_template = getattr(self.manager.served.tokenizer, "chat_template", None)
        template = rendering_template(tokenizer_template, body.chat_template, bool(tool_plan.tools))
        # A request's own template is parsed for this request only, not kept in the parse caches.
        own = body.chat_template is not None
        content_parts = template is not None and template_iterates_content(template, request_template=own)
        developer_role = template_names_developer_role(template, request_template=own)
        unread = unread_reasoning(body.messages, template)
        if unread is not None:
            raise invalid_request(*unread)
        messages = [message.to_template_dict(content_parts, developer_role) for message in body.messages]
        template_options = tool_plan.template_options(body.template_options(), generating)
        return self.encoder.encode_chat(messages, "messages", body.add_special_tokens, keeps_end, **template_options)

    async def _respond(self, request: Request, body: OpenAISamplingRequest, model: str, jobs: list[ChoiceJob],
                       shaper: ResponseShaper) -> Response:
        """Start every job, then answer with one JSON body or a stream; ``model`` is the name to report."""
        given_id = client_request_id(request, body.request_id)
        response_id = f"{shaper.id_prefix}-{given_id or uuid.uuid4().hex}"
        if given_id is not None:
            logger.info("request %s: %d generation(s)", response_id, len(jobs))
        fanout = GenerationFanout(self.manager, jobs, request=request, label=response_id)
        await fanout.start()
        # Accepted: its n, once per prompt (vLLM's request_params_n).
        self.manager.on_request_params(body.n, len({job.prompt_index for job in jobs}))
        header = {"id": response_id, "object": shaper.object_name,
                  "created": int(time.time()), "model": model}
        # The response's id as OpenAI's request-id header (the SDKs expose it as ``request_id``).
        id_header = {"x-request-id": response_id}
        if body.stream:
            chunk_header = {**header, "object": shaper.chunk_object_name}
            streamed = sse_response(self._stream(body, jobs, fanout, shaper, chunk_header), fanout)
            streamed.headers.update(id_header)
            return streamed
        collected = await fanout.collect()
        prompt_cached = None
        if body.candidates > body.n:
            prompt_cached = smallest_cached_tokens(collected, jobs)
            collected, jobs = best_choices(collected, jobs, body.n)

        def answer() -> Response:
            usage = UsageTracker(jobs, shaper.counts_completion, prompt_cached)
            choices = []
            for index in sorted(collected):
                for event in collected[index]:
                    usage.update(index, event)
                choices.append(shaper.final_choice(index, collected[index]))
            return JSONResponse({**header, "choices": choices, **shaper.response_extras(collected),
                                 "usage": usage.to_dict()}, headers=id_header)

        if large_answer(collected.values(), jobs):
            # Shaped and encoded on a worker thread: 16 choices' prompt logprobs of a 4,085-token
            # prompt made a 98 MB answer that held the event loop, every other stream included, 7 s.
            return await asyncio.to_thread(answer)
        return answer()

    @staticmethod
    async def _stream(body: OpenAISamplingRequest, jobs: list[ChoiceJob], fanout: GenerationFanout,
                      shaper: ResponseShaper, header: dict[str, Any]) -> AsyncIterator[bytes]:
        usage = UsageTracker(jobs, shaper.counts_completion)
        # With include_usage every chunk carries "usage": null except the final usage chunk;
        # with continuous usage every chunk carries its choice's counts so far (as vLLM: that
        # choice's prompt and completion, not the request's sums).
        def tail(index: int) -> dict[str, Any]:
            if body.continuous_usage:
                return {"usage": usage.choice_dict(index)}
            return {"usage": None} if body.include_usage else {}

        for opening in shaper.opening_choices([job.index for job in jobs]):
            yield sse({**header, "choices": [opening], **shaper.chunk_fields(opening), **tail(opening["index"])})
        try:
            async for index, event in fanout.events():
                usage.update(index, event)
                for choice in shaper.stream_choices(index, event):
                    yield sse({**header, "choices": [choice], **shaper.chunk_fields(choice), **tail(index)})
        except APIError as error:
            yield sse_error(error)
        except Exception:  # noqa: BLE001 - the status line is sent; report in-band instead
            logger.exception("streaming response failed")
            yield sse_error(internal_error())
        else:
            if body.include_usage:
                yield sse({**header, "choices": [], "usage": usage.to_dict()})
        yield SSE_DONE
