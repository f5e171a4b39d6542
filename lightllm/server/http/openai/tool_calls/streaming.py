"""Streaming deltas of a chat choice that may call tools, in the shape OpenAI streams them.

:class:`ToolCallStream` turns the text pieces of one generation into delta fields: ``content``
for text outside calls, ``tool_calls`` for calls. It runs the same
:class:`~lightllm.server.http.openai.tool_calls.extraction.CallReader` as the non-streaming response,
so the deltas can never contradict the final answer: the content pieces add up to the message's
``content`` and every call is the message's call.

That is why a call is sent whole, in one delta (``index``, ``id``, ``type``, ``function.name``
and the complete ``function.arguments``), once its block is complete: until then the block may
still turn out not to be a call (malformed JSON, an end tag inside a string, an output that stops
in the middle), and a stream cannot take back a call it announced. Content is sent as it comes,
except text that may still be the start of a call and white space that a following call would
drop.
"""

from __future__ import annotations

from typing import Any, Callable

from lightllm.server.http.openai.tool_calls.extraction import CallReader, ParsedCall, Reading, read_named_call
from lightllm.server.http.openai.tool_calls.parsers import ToolCallParser


class ToolCallStream:
    """Delta fields of one choice's stream (one instance per choice)."""

    def __init__(self, parser: ToolCallParser, parallel: bool = True,
                 accepts: Callable[[ParsedCall], bool] | None = None) -> None:
        self._reader = CallReader(parser, parallel, accepts)
        self.calls_announced = 0

    def feed(self, text: str) -> dict[str, Any]:
        """Delta fields for the next text piece (empty when it completes nothing to send)."""
        return self._delta(self._reader.feed(text))

    def finish(self) -> dict[str, Any]:
        """Delta fields for what was held back, at the end of the generation."""
        return self._delta(self._reader.finish())

    def _delta(self, reading: Reading) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reading.content:
            delta["content"] = reading.content
        if reading.calls:
            delta["tool_calls"] = [{"index": self.calls_announced + offset, **call.to_openai()}
                                   for offset, call in enumerate(reading.calls)]
            self.calls_announced += len(reading.calls)
        return delta


class NamedCallStream:
    """The stream of ``tool_choice`` naming a function: the whole output is that call's arguments.

    The output is held until it ends: only then is it known to be a whole JSON object (a
    generation cut off by ``max_tokens`` or a stop is content, as in the non-streaming response).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._pieces: list[str] = []
        self.calls_announced = 0

    def feed(self, text: str) -> dict[str, Any]:
        """Nothing yet: the text is held."""
        self._pieces.append(text)
        return {}

    def finish(self) -> dict[str, Any]:
        """The call, or the text as content when it is not a JSON object."""
        extraction = read_named_call(self._name, "".join(self._pieces))
        self._pieces = []
        if not extraction.calls:
            return {"content": extraction.content} if extraction.content else {}
        self.calls_announced = 1
        return {"tool_calls": [{"index": 0, **extraction.calls[0].to_openai()}]}
