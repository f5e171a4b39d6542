"""The request-manager contract the HTTP layer is written against.

``create_app`` and the endpoint classes (native, OpenAI) depend on :class:`RequestManager`, not
on a concrete manager: the HTTP process's :class:`~lightllm.server.httpserver.manager.HttpServerManager`
implements it for a normal server, and a PD master's manager can serve the same API by
implementing it too.  What either knows of the model it serves is one member, ``served``
(:class:`ServedModelView`, which :class:`~lightllm.server.served_model.ServedModel` implements);
what stays on the manager is its own: running requests, its generation caps, health, metrics.
:class:`SupervisedRequestManager` adds what the launcher's supervisor needs for shutdown and
child failure.  Errors a manager raises are the types of
:mod:`lightllm.server.manager_errors`.

This module imports no shared memory, zmq or torch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AbstractSet, Any, AsyncIterator, Dict, List, Optional, Protocol, Tuple, get_type_hints, runtime_checkable

from lightllm.common.basemodel.generation_defaults import GenerationDefaults
from lightllm.server.core.objs.request_spec import RequestSpec


@dataclass
class GenerationEvent:
    """One generated token (or a token-less finish, ``token_id < 0``) as the API layer sees it."""

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
    # On a request's last event, when it finished with "stop": the stop string or stop token id
    # that ended it (vLLM's stop_reason; None for EOS).
    stop_reason: Optional[int | str] = None


def generations_per_request(slots: int) -> int:
    """Generations one request may run on ``slots`` places (request slots or top-logprob rows):
    half, so one client leaves room for others, but at least one (``--top_logprobs_slots 1``
    still serves a request asking for top logprobs)."""
    return max(1, slots // 2)


@runtime_checkable
class ServedModelView(Protocol):
    """What the HTTP layer reads of the model a manager serves: a request manager's ``served``.

    :class:`~lightllm.server.served_model.ServedModel` implements it, and both managers serve one;
    test doubles give their own (a word tokenizer, scripted chat rendering).

    Attributes: ``model_name`` (the id the API reports), ``served_model_names`` (every id a
    request's ``model`` may name), ``max_req_total_len`` (prompt + generated tokens of one
    request), ``vocab_size``, ``eos_token_ids``, ``tokenizer`` (for decoding token strings
    in responses) and ``generation_defaults`` (the sampling fields a request inherits).  A model
    loaded from a checkpoint may also have ``model_path`` (``--model_dir`` as an absolute path),
    which /v1/models reports as ``root``.
    """

    model_name: str
    served_model_names: List[str]
    max_req_total_len: int
    vocab_size: int
    eos_token_ids: List[int]
    tokenizer: Any
    generation_defaults: GenerationDefaults

    def encode_prompt(self, text: str, add_special_tokens: bool = True, within: Optional[int] = None) -> List[int]:
        """Token ids of a text prompt (may block: the HTTP layer calls it in a worker thread).

        ``within``: a token limit; a prompt that provably needs more may be refused with
        :class:`~lightllm.server.prompt_length_probe.PromptOverContextError` before it is tokenized
        whole.  None tokenizes it whatever its length.
        """

    def encode_chat(
        self,
        messages: List[Dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        within: Optional[int] = None,
        max_chars: Optional[int] = None,
        check_tools_read: bool = True,
        implied_variables: AbstractSet[str] = frozenset(),
    ) -> List[int]:
        """Token ids of a chat rendered with the model's template; ``ValueError`` if it cannot be.

        ``within``: as for :meth:`encode_prompt`, on the rendered chat; ``max_chars``: a limit on the
        rendered chat's characters (``RenderedChatTooLongError``), checked before it is tokenized.
        ``check_tools_read``: refuse tools the template does not render (true under tool_choice none only).
        ``implied_variables``: keys of ``chat_template_kwargs`` the server set from a request field
        (``enable_thinking`` from ``reasoning_effort``), never refused as unread on their own.
        """

    def default_max_new_tokens(self, prompt_len: int, fallback: Optional[int] = None) -> int:
        """max_new_tokens for a request that gives none (``fallback``: the endpoint's default)."""

    def structured_output_problem(self) -> Optional[str]:
        """Why the model's tokenizer cannot run structured-output grammars, or None when it can.

        May block the first time (it builds the grammar engine's view of the tokenizer): the HTTP
        layer calls it on a tokenizer thread, only for requests that carry a grammar.
        """


@runtime_checkable
class RequestManager(Protocol):
    """What the HTTP layer needs from whoever runs its requests.

    Attributes: ``served`` (the model it serves: names, tokenizer, limits and the encoding of
    prompts and chats, :class:`ServedModelView`), ``max_generations_per_request`` (prompts x
    ``n``/``best_of`` one request may run; None: no limit of the manager's own) and
    ``max_top_logprob_generations_per_request`` (the same for a request asking for top logprobs),
    with ``generation_caps_source``, whose places they are half of, as a refusal names them ("the
    server's", "the smallest PD node's").
    """

    served: ServedModelView
    max_generations_per_request: Optional[int]
    max_top_logprob_generations_per_request: Optional[int]
    generation_caps_source: str

    async def start(self) -> None:
        """Called once on the server's event loop before the first request."""

    async def stop(self) -> None:
        """Called once on the server's event loop after the last request."""

    def generate(self, spec: RequestSpec, *, request: Any = None) -> AsyncIterator[GenerationEvent]:
        """Run one generation of ``spec``: its events, the last one with a ``finish_reason``.

        The spec checked its own fields when it was built; the manager checks it against the
        served model (:meth:`RequestSpec.check_fits`).  Raises ``ValueError`` for a request it
        refuses and the errors of :mod:`lightllm.server.manager_errors` when it cannot take one;
        ``request`` (the client's connection, or None) is polled to stop the work when the
        client goes away.
        """

    def health(self) -> bool:
        """Whether requests are accepted."""

    def check_admission(self, request: Any = None) -> None:
        """Raise the ``ServerUnavailableError`` :meth:`generate` would raise for ``request`` (the
        client's connection) now: draining and it arrived after the stop signal, or failed.

        The HTTP handlers ask first, so a request arriving during a drain is refused before it
        is parsed, tokenized or its grammar checked (seconds of work on a queue that requests
        still in flight wait on), and :meth:`generate` still decides for the ones that pass.
        """

    def metrics_text(self) -> Tuple[bytes, str]:
        """Prometheus exposition and its content type."""

    def on_request_params(self, n: int, prompts: int = 1) -> None:
        """An API request's generations started: ``n`` choices for each of its ``prompts`` prompts
        (the metrics observe ``n`` once per prompt, vLLM's ``request_params_n``)."""


@runtime_checkable
class SupervisedRequestManager(RequestManager, Protocol):
    """A :class:`RequestManager` the launcher's supervisor can drain and fail."""

    # The event loop the manager runs on (set by start()); the supervisor schedules calls on it.
    loop: Optional[asyncio.AbstractEventLoop]

    def refuse_new_requests(self, message: str, code: str) -> None:
        """From now on refuse every new request with ``ServerUnavailableError(message, code)``."""

    def fail_pending(self, message: str, code: str, backend_alive: bool) -> int:
        """End every pending (and later) request with that error; returns how many were ended."""

    async def wait_until_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every request to end; True if they all did."""


def missing_request_manager_members(manager: object, protocol: type = RequestManager) -> List[str]:
    """Names of ``protocol``'s attributes and methods that ``manager`` lacks (empty: none).

    A member typed with a protocol (``served``: :class:`ServedModelView`) is checked in turn: what
    the manager's object lacks is named under it (``served.encode_prompt``).
    """
    members: Dict[str, Any] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        members.update((name, None) for name, value in vars(cls).items()
                       if callable(value) and not name.startswith("_"))
        members.update(get_type_hints(cls))
    missing = []
    for name in sorted(members):
        if not hasattr(manager, name):
            missing.append(name)
        elif getattr(members[name], "_is_protocol", False):
            missing.extend(f"{name}.{inner}" for inner in missing_request_manager_members(getattr(manager, name),
                                                                                          members[name]))
    return missing
