"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer over HTTP, as vLLM serves it.

``/tokenize`` answers ``{"count", "max_model_len", "tokens", "token_strs"}``: the ids the
generation endpoints would give the model for the same prompt or chat (``token_strs``, the
vocabulary's spelling of each id, only with ``return_token_strs``; null otherwise).  A text
prompt is encoded as ``/v1/completions`` encodes it, a chat rendered as ``/v1/chat/completions``
renders it: the same message conversion, request-template rule, tools and template options, and
the same :class:`~lightllm.server.http.generation.prompt_encoding.PromptEncoder` (its character bound
included).  Unlike the generation endpoints, a prompt longer than the context is tokenized whole
and counted, as vLLM does (``count`` above ``max_model_len`` tells the client it will not fit),
so the prefix probe that refuses such prompts early is not used; the character bound still caps
the work.

``/detokenize`` answers ``{"prompt"}``: the text of ``tokens`` decoded as vLLM decodes it (special
tokens kept).  Ids outside ``[0, vocab_size)`` and lists longer than the context are a 400 naming
``tokens``.

``/tokens`` (LightLLM's, ``GET`` or ``POST``) answers ``{"ntokens"}``: how many tokens ``/generate``
would count as the prompt of ``inputs`` = ``text`` with the same ``parameters`` (its
``add_special_tokens``), the character bound included and the context not; ``parameters`` and
``multimodal_params`` are checked as ``/generate`` checks them (their values, grammars included),
as LightLLM checks them there.

``/tokenize`` and ``/detokenize`` follow the OpenAI endpoints' ``model`` rule (missing, null or ``""``: the served model; an
unknown name: 404) and need the API key when the server has one.
"""

from __future__ import annotations

from typing import Any, Awaitable, List, Optional, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from lightllm.server.http.validation.body import parse_body_off_loop
from lightllm.server.http.errors import JSONErrorRoute, invalid_request, manager_error
from lightllm.server.manager_errors import ServerChatTemplateError
from lightllm.server.http.openai.openai_routes import OpenAIEndpoints
from lightllm.server.http.native_models import NativeTokenCountRequest
from lightllm.server.http.native_sampling import NATIVE_DEFAULT_MAX_NEW_TOKENS, native_sampling_params
from lightllm.server.http.openapi import request_body, request_body_any
from lightllm.server.http.generation.planning import check_token_ids
from lightllm.server.http.generation.prompt_encoding import PromptEncoder
from lightllm.server.http.tokenize.tokenize_models import (DetokenizeRequest, TokenizeBody, TokenizeChatRequest,
                                                           TokenizeCompletionRequest)
from lightllm.server.http.openai.tool_calls.request import ToolPlan, parse_tools
from lightllm.server.request_manager import RequestManager

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
# LightLLM's token count (GET and POST, as LightLLM serves it).
TOKEN_COUNT_PATH = "/tokens"


class TokenizeEndpoints:
    """``/tokenize``, ``/detokenize`` and LightLLM's ``/tokens`` over one manager's tokenizer.

    ``openai``: the server's OpenAI endpoints, whose ``model`` and request-template rules these
    share, so that both answer a request the same way.
    """

    def __init__(self, manager: RequestManager, encoder: PromptEncoder, openai: OpenAIEndpoints) -> None:
        self.manager = manager
        self.encoder = encoder
        self.openai = openai

    def router(self) -> APIRouter:
        """An APIRouter with ``POST /tokenize``, ``POST /detokenize`` and ``GET``/``POST /tokens``."""
        router = APIRouter(route_class=JSONErrorRoute)
        router.add_api_route(TOKENIZE_PATH, self.tokenize, methods=["POST"],
                             openapi_extra=request_body_any(TokenizeCompletionRequest, TokenizeChatRequest))
        router.add_api_route(DETOKENIZE_PATH, self.detokenize, methods=["POST"],
                             openapi_extra=request_body(DetokenizeRequest))
        # One route per method, so each has an OpenAPI operation id of its own.
        for method in ("GET", "POST"):
            router.add_api_route(TOKEN_COUNT_PATH, self.count_tokens, methods=[method],
                                 openapi_extra=request_body(NativeTokenCountRequest))
        return router

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``."""
        # A large body is decoded on a worker thread so other clients are not stalled behind it.
        body = await parse_body_off_loop(await request.body(), cast(Any, TokenizeBody))
        self.openai.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = await self._chat_ids(body)
        else:
            ids = await self._prompt_ids(body)
        token_strs = await self._token_strs(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.manager.served.max_req_total_len, "tokens": ids,
                             "token_strs": token_strs})

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``."""
        body = await parse_body_off_loop(await request.body(), DetokenizeRequest)
        self.openai.check_model(body.model)
        limit = self.manager.served.max_req_total_len
        if len(body.tokens) > limit:
            # No request can hold more ids than the context, and the bound keeps one body from
            # holding a tokenizer thread for long.
            raise invalid_request(f"tokens holds {len(body.tokens)} ids, more than the model's context length "
                                  f"({limit})", "tokens")
        check_token_ids(body.tokens, self.manager.served.vocab_size, "tokens")
        tokenizer = self.manager.served.tokenizer
        tokens = list(body.tokens)
        text = await self.encoder.on_tokenizer_thread(lambda: tokenizer.decode(tokens))
        return JSONResponse({"prompt": text})

    async def count_tokens(self, request: Request) -> Response:
        """LightLLM's ``/tokens``: ``{"ntokens"}`` of ``text``, as ``/generate`` would count its prompt."""
        body = await parse_body_off_loop(await request.body(), NativeTokenCountRequest)
        parameters = body.parameters
        # Checked as /generate checks them; no generation runs, so a max_new_tokens left out needs only
        # to leave min_new_tokens room (/generate's default is cut to the prompt's room instead).
        max_new = parameters.max_new_tokens
        if max_new is None:
            max_new = max(NATIVE_DEFAULT_MAX_NEW_TOKENS, parameters.min_new_tokens or 0)
        await native_sampling_params(self.manager, parameters, max_new, request)
        options = {} if body.parameters.add_special_tokens else {"add_special_tokens": False}
        ids = await _encoded(self.encoder.encode_prompt(body.text, "text", True, **options), "text")
        return JSONResponse({"ntokens": len(ids)})

    async def _prompt_ids(self, body: TokenizeCompletionRequest) -> List[int]:
        """The prompt's ids as /v1/completions encodes a text prompt."""
        options = {} if body.add_special_tokens else {"add_special_tokens": False}
        return await _encoded(self.encoder.encode_prompt(body.prompt, "prompt", True, **options), "prompt")

    async def _chat_ids(self, body: TokenizeChatRequest) -> List[int]:
        """The chat's ids as /v1/chat/completions renders them (the same steps, in the same order)."""
        chat = body.chat_request()
        self.openai.check_request_template(chat.chat_template)
        # The template gets the tools whatever tool_choice says (there is none here): only what is
        # done with the output depends on it, and /tokenize produces none.  So tools the template
        # does not render are not refused here (the chat endpoint refuses them under none only);
        # a history's unrendered tool_calls are, as on the chat endpoint whatever tool_choice says.
        tools = parse_tools(chat.tools) if chat.tools is not None else []
        return await _encoded(self.openai.render_chat(chat, ToolPlan(tools=tools), True, generating=False), "messages")

    async def _token_strs(self, ids: List[int]) -> List[Optional[str]]:
        """The vocabulary's spelling of each id (``Ġhello``, ``▁the``), as vLLM's ``token_strs``."""
        convert = getattr(self.manager.served.tokenizer, "convert_ids_to_tokens", None)
        if convert is None:
            raise invalid_request("return_token_strs is not supported: this model's tokenizer does not spell out "
                                  "its tokens", "return_token_strs")
        return list(await self.encoder.on_tokenizer_thread(lambda: convert(ids)))


async def _encoded(pending: Awaitable[List[int]], param: str) -> List[int]:
    """Await an encoding; a prompt or chat the tokenizer or template refuses is a 400 naming ``param``.

    Unlike :func:`~lightllm.server.http.generation.planning.encoded`, an empty result is an answer (``""``
    without special tokens has no ids) and ids beyond the model's vocabulary are reported as
    they are: /tokenize says what the tokenizer gives, the generation endpoints decide what runs.
    """
    try:
        return list(await pending)
    except (ValueError, ServerChatTemplateError) as exc:
        raise manager_error(exc, param) from None
