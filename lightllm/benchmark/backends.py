"""The HTTP APIs the benchmark can drive: endpoint, request body and event parsing of each.

Each backend knows its endpoint, how to build the JSON body for a prompt, and how to
read one decoded SSE ``data:`` payload. :func:`~lightllm.benchmark.stream_request.send_request`
does the transport part shared by all of them, and its module says how output tokens, failed
requests, TTFT and E2E are read from the stamps (:mod:`lightllm.benchmark.stream_request`).

What a timestamp stands for differs by API, and so does what ITL measures:

* native ``/generate_stream`` (:class:`LightLLMBackend`): one event per generated token, so
  ``token_times`` holds one stamp per token and ITL is per token.  A finish event that carries no
  token (``"id": -1``, which the server sends when it ends a request with nothing more to say, as
  on an abort) gets no stamp;
* OpenAI APIs (:class:`OpenAIBackend`): one stamp per streamed chunk that carries output (text,
  token logprobs, or the finish).  A server may merge tokens into one chunk (LightLLM sends a
  token that ends inside a UTF-8 character together with the next one) and may end with a
  chunk of empty text that carries only the finish; ITL is then per chunk, and each gap is a
  real wait the client saw.  The usage chunk and ``[DONE]`` carry no output and get no stamp.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

# Fields (of the body; natively, of the parameters) that ask for several generations per request.
# Their tokens would come interleaved in the one stream the benchmark reads as one request's:
# twice the output tokens, and TPOT and ITL mixing two generations.  --extra-body may not set them.
MULTI_GENERATION_FIELDS: tuple[str, ...] = ("n", "best_of")


@dataclasses.dataclass
class RequestInput:
    """A fully prepared request: prompt payload plus schedule and bookkeeping."""

    index: int
    request_class: str
    prompt: str | list[int]
    prompt_tokens: int
    output_len: int
    scheduled_time: float


@dataclasses.dataclass
class StreamState:
    """What a backend learned from the events of one response so far."""

    token_times: list[float] = dataclasses.field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    # The generated text, collected where the stream's events are not one token each (OpenAI).
    text_parts: list[str] = dataclasses.field(default_factory=list)
    usage_output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    end_time: float | None = None
    error: str | None = None


class Backend(abc.ABC):
    """Base class: endpoint path, request body and event parsing of one HTTP API."""

    name: str = ""
    path: str = ""
    needs_model: bool = True
    accepts_token_ids: bool = False
    # True when the event that reports completion is the last one the client needs.
    stops_on_finish: bool = False
    # True when every stamped event is one generated token, so counting them counts the tokens.
    one_token_per_event: bool = False
    # Fields of the body (of the parameters, natively) the benchmark controls: those it sets and
    # those that would override the output length it asks for.  --extra-body may not set them.
    controlled_fields: tuple[str, ...] = ()

    def __init__(self, model: str | None, ignore_eos: bool = True, extra_body: dict[str, Any] | None = None) -> None:
        if self.needs_model and not model:
            raise ValueError(f"model must be set for backend {self.name!r}")
        self.model = model
        self.ignore_eos = ignore_eos
        self.extra_body = dict(extra_body or {})

    @abc.abstractmethod
    def build_payload(self, request: RequestInput) -> dict[str, Any]:
        """JSON body for ``request``."""

    @abc.abstractmethod
    def consume(self, data: dict[str, Any], now: float, state: StreamState) -> None:
        """Update ``state`` with one decoded ``data:`` payload received at ``now``."""

    @abc.abstractmethod
    def is_complete(self, state: StreamState, saw_done: bool) -> bool:
        """Whether the stream ended the way a finished response should."""

    def check_prompt(self, prompt: str | list[int]) -> None:
        """Reject prompt kinds the API cannot take."""
        if isinstance(prompt, list) and not self.accepts_token_ids:
            raise ValueError(f"backend {self.name!r} needs text prompts; use prompt_format='text'")


class LightLLMBackend(Backend):
    """LightLLM's native ``/generate_stream``: one event per generated token."""

    name = "lightllm"
    path = "/generate_stream"
    needs_model = False
    stops_on_finish = True
    one_token_per_event = True
    controlled_fields = ("max_new_tokens", "ignore_eos")

    def build_payload(self, request: RequestInput) -> dict[str, Any]:
        """``{"inputs": ..., "parameters": ...}`` with the output length, ``ignore_eos`` and ``--extra-body``.

        Raises:
            ValueError: the prompt is token ids, which this backend does not send.
        """
        self.check_prompt(request.prompt)
        parameters = {"max_new_tokens": request.output_len, "ignore_eos": self.ignore_eos}
        parameters.update(self.extra_body)
        return {"inputs": request.prompt, "parameters": parameters}

    def consume(self, data: dict[str, Any], now: float, state: StreamState) -> None:
        """Stamp an event that carries a token (a negative-id finish carries none); note its count and the finish."""
        token = data.get("token")
        if token is not None:
            token_id = token.get("id") if isinstance(token, dict) else None
            # A negative id marks a finish that carries no token: no output arrived with it, so
            # it gets no stamp (it would add a token, an ITL gap and time to E2E that are not there).
            if not (isinstance(token_id, int) and token_id < 0):
                state.token_times.append(now)
            count = token.get("count_output_tokens") if isinstance(token, dict) else None
            if isinstance(count, int) and not isinstance(count, bool):
                state.usage_output_tokens = count
        if data.get("finished"):
            state.finished = True
            state.finish_reason = data.get("finish_reason")

    def is_complete(self, state: StreamState, saw_done: bool) -> bool:
        """Complete once an event said ``finished``; the native stream has no ``[DONE]``, so ``saw_done`` is unused."""
        return state.finished


class OpenAIBackend(Backend):
    """Shared parts of the OpenAI streaming APIs (usage chunk, ``[DONE]`` sentinel)."""

    controlled_fields = ("model", "max_tokens", "max_completion_tokens", "stream", "stream_options", "ignore_eos")

    def build_payload(self, request: RequestInput) -> dict[str, Any]:
        """The streaming body with ``max_tokens`` and a usage chunk, then the prompt fields and ``--extra-body``.

        Raises:
            ValueError: the prompt is token ids and the API takes only text.
        """
        self.check_prompt(request.prompt)
        payload: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        # ignore_eos is an extension most OpenAI-compatible engines accept; the strict
        # OpenAI API does not, so it is only sent when asked for.
        if self.ignore_eos:
            payload["ignore_eos"] = True
        payload.update(self._prompt_fields(request.prompt))
        payload.update(self.extra_body)
        return payload

    @abc.abstractmethod
    def _prompt_fields(self, prompt: str | list[int]) -> dict[str, Any]:
        """Body fields that carry the prompt."""

    @abc.abstractmethod
    def _chunk_text(self, choice: dict[str, Any]) -> str:
        """Generated text carried by one streamed choice."""

    @staticmethod
    def _chunk_tokens(choice: dict[str, Any]) -> bool:
        """Whether the choice lists token logprobs (a token whose text may be empty)."""
        logprobs = choice.get("logprobs")
        if not isinstance(logprobs, dict):
            return False
        # completions: {"tokens": [...], ...}; chat: {"content": [...]}.
        return bool(logprobs.get("tokens") or logprobs.get("content"))

    def _carries_output(self, choice: dict[str, Any]) -> bool:
        # A chunk of empty text still carries output when it brings the finish: the server sends
        # the last token's chunk with the finish even when its text is held back or empty (a
        # special token, the rest of an unfinished UTF-8 sequence).  A chat stream's opening
        # chunk (role only, empty content) carries none.
        return bool(self._chunk_text(choice)) or bool(choice.get("finish_reason")) or self._chunk_tokens(choice)

    def consume(self, data: dict[str, Any], now: float, state: StreamState) -> None:
        """One stamp per chunk that carries output; collect its text, the finish and the usage chunk's counts."""
        choices = data.get("choices") or []
        # One stamp per chunk that carries output, whatever number of tokens it merged: the gaps
        # between them are what the client waited (see the module docstring for ITL's meaning).
        if any(self._carries_output(choice) for choice in choices):
            state.token_times.append(now)
        for choice in choices:
            state.text_parts.append(self._chunk_text(choice))
            if choice.get("finish_reason"):
                state.finished = True
                state.finish_reason = choice["finish_reason"]
        usage = data.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                state.usage_output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                state.usage_prompt_tokens = int(usage["prompt_tokens"])

    def is_complete(self, state: StreamState, saw_done: bool) -> bool:
        """Complete once the ``data: [DONE]`` sentinel arrived: the usage chunk comes after the finish."""
        return saw_done


class OpenAICompletionsBackend(OpenAIBackend):
    """``/v1/completions``; the prompt may be text or a list of token ids."""

    name = "openai-completions"
    path = "/v1/completions"
    accepts_token_ids = True
    controlled_fields = (*OpenAIBackend.controlled_fields, "prompt")

    def _prompt_fields(self, prompt: str | list[int]) -> dict[str, Any]:
        return {"prompt": prompt}

    def _chunk_text(self, choice: dict[str, Any]) -> str:
        return choice.get("text") or ""


class OpenAIChatBackend(OpenAIBackend):
    """``/v1/chat/completions`` with the prompt as a single user message.

    The server wraps the message in its chat template, so the prompt length the server
    sees is larger than the built length; the usage chunk reports the real count.
    """

    name = "openai-chat"
    path = "/v1/chat/completions"
    controlled_fields = (*OpenAIBackend.controlled_fields, "messages")

    def _prompt_fields(self, prompt: str | list[int]) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": prompt}]}

    def _chunk_text(self, choice: dict[str, Any]) -> str:
        delta = choice.get("delta") or {}
        # Reasoning models stream their thinking separately; it is generated output too.  vLLM
        # 0.32 names it "reasoning", older servers "reasoning_content"; one of them, never both (a
        # server sending both names carries the same text twice).
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        return (delta.get("content") or "") + reasoning


BACKENDS: dict[str, type[Backend]] = {
    cls.name: cls for cls in (LightLLMBackend, OpenAICompletionsBackend, OpenAIChatBackend)
}


def make_backend(
    name: str, model: str | None, ignore_eos: bool = True, extra_body: dict[str, Any] | None = None
) -> Backend:
    """Instantiate the backend registered under ``name``."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}") from None
    return cls(model, ignore_eos=ignore_eos, extra_body=extra_body)
