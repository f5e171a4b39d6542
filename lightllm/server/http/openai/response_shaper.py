"""The interface of the objects that turn generation events into OpenAI response JSON.

The OpenAI routes (:mod:`lightllm.server.http.openai.openai_routes`) stream and collect events the same
way for every endpoint; what the choices look like is the shaper's business: completions and chat
in :mod:`lightllm.server.http.openai.openai_shapes`, chat with tool calls in
:mod:`lightllm.server.http.openai.tool_calls.shaper`, and ``return_token_ids`` wrapped around any of them
in :mod:`lightllm.server.http.openai.token_ids`.
"""

from __future__ import annotations

from typing import Any, Protocol


class ResponseShaper(Protocol):
    """What the OpenAI routes need from a shaper (:mod:`lightllm.server.http.openai.openai_shapes`)."""

    id_prefix: str
    object_name: str
    chunk_object_name: str
    counts_completion: bool

    def opening_choices(self, indices: list[int]) -> list[dict[str, Any]]:
        """Stream choices sent before any token (chat's role chunks), for the choices ``indices``."""

    def stream_choices(self, index: int, event: Any) -> list[dict[str, Any]]:
        """The stream choices (one chunk each) for one event of choice ``index``; none to skip it."""

    def final_choice(self, index: int, events: list[Any]) -> dict[str, Any]:
        """Choice ``index`` of a whole response from all its events."""

    def response_extras(self, collected: dict[int, list[Any]]) -> dict[str, Any]:
        """Top-level fields of a whole response besides the header, choices and usage."""

    def chunk_fields(self, choice: dict[str, Any]) -> dict[str, Any]:
        """Top-level fields of the stream chunk carrying ``choice`` besides its header and usage."""
