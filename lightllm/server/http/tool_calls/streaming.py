"""Streaming deltas of a chat choice that may call tools, in the shape OpenAI streams them.

:class:`ToolCallStream` turns the text pieces of one generation into delta fields: ``content``
for text outside calls, ``tool_calls`` for calls. A call is announced once its name is complete
(``index``, ``id``, ``type``, ``function.name`` and the arguments known so far, possibly
``""``); later deltas of the call carry only ``index`` and the next ``function.arguments``
piece. Concatenating a call's argument pieces gives the arguments the non-streaming path reports
for the same text. Tag text never reaches ``content``.

Limits (a stream cannot take back what it sent): a call object that ends without a name is sent
as content; once a call is announced, its arguments are forwarded as written even if the model
never completes them (the finish reason then says ``length``).
"""

from __future__ import annotations

from typing import Any

from lightllm.server.http.tool_calls.extraction import new_call_id
from lightllm.server.http.tool_calls.json_scan import CallObjectScanner
from lightllm.server.http.tool_calls.parsers import CALL, ToolCallParser


class _DeltaBuilder:
    """Collects one chunk's content and tool-call entries, merging pieces of the same call."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[dict[str, Any]] = []

    def call_entry(self, index: int) -> dict[str, Any]:
        if self.calls and self.calls[-1]["index"] == index:
            return self.calls[-1]
        entry: dict[str, Any] = {"index": index, "function": {"arguments": ""}}
        self.calls.append(entry)
        return entry

    def to_delta(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self.content:
            delta["content"] = self.content
        if self.calls:
            delta["tool_calls"] = self.calls
        return delta


class ToolCallStream:
    """Delta fields of one choice's stream (one instance per choice)."""

    def __init__(self, parser: ToolCallParser, parallel: bool = True) -> None:
        self._segmenter = parser.segmenter()
        self._parallel = parallel
        self.calls_announced = 0
        self._scanner: CallObjectScanner | None = None
        self._object_text = ""
        self._pending_arguments = ""
        self._announced = False
        self._skipping = False

    def feed(self, text: str) -> dict[str, Any]:
        """Delta fields for the next text piece (empty when it completes nothing to send)."""
        out = _DeltaBuilder()
        for kind, piece in self._segmenter.feed(text):
            self._segment(kind, piece, out)
        return out.to_delta()

    def finish(self) -> dict[str, Any]:
        """Delta fields for what was held back, at the end of the generation."""
        out = _DeltaBuilder()
        for kind, piece in self._segmenter.finish():
            self._segment(kind, piece, out)
        if self._scanner is not None and not self._announced:
            # An unfinished object that never named a function was text after all.
            out.content += self._object_text
        self._scanner = None
        return out.to_delta()

    def _segment(self, kind: str, piece: str, out: _DeltaBuilder) -> None:
        if kind != CALL:
            out.content += piece
            return
        while piece:
            if self._scanner is None:
                start = piece.find("{")
                if start < 0:
                    return  # separators between calls
                piece = piece[start:]
                self._begin_object()
            result = self._scanner.feed(piece)
            self._object_text += piece[: result.consumed]
            piece = piece[result.consumed:]
            if not self._skipping:
                self._forward(result.name, result.arguments, out)
            if self._scanner.done:
                self._end_object(out)

    def _begin_object(self) -> None:
        self._scanner = CallObjectScanner()
        self._object_text = ""
        self._pending_arguments = ""
        self._announced = False
        # Without parallel calls only the first call is kept.
        self._skipping = not self._parallel and self.calls_announced > 0

    def _forward(self, name: str | None, arguments: str, out: _DeltaBuilder) -> None:
        if name is not None and not self._announced:
            self._announced = True
            index = self.calls_announced
            self.calls_announced += 1
            entry = out.call_entry(index)
            entry.update({"id": new_call_id(), "type": "function"})
            entry["function"] = {"name": name, "arguments": self._pending_arguments}
            self._pending_arguments = ""
        if not arguments:
            return
        if self._announced:
            out.call_entry(self.calls_announced - 1)["function"]["arguments"] += arguments
        else:
            self._pending_arguments += arguments

    def _end_object(self, out: _DeltaBuilder) -> None:
        scanner = self._scanner
        self._scanner = None
        if self._skipping:
            return
        if not self._announced:
            out.content += self._object_text
        elif not scanner.has_arguments:
            out.call_entry(self.calls_announced - 1)["function"]["arguments"] += "{}"


class NamedCallStream:
    """The stream of ``tool_choice`` naming a function: the whole output is that call's arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.calls_announced = 0

    def feed(self, text: str) -> dict[str, Any]:
        """The call's announcement with the first piece, then argument pieces."""
        if self.calls_announced == 0:
            self.calls_announced = 1
            return {"tool_calls": [{"index": 0, "id": new_call_id(), "type": "function",
                                    "function": {"name": self._name, "arguments": text}}]}
        if not text:
            return {}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

    def finish(self) -> dict[str, Any]:
        """Nothing is held back."""
        return {}
