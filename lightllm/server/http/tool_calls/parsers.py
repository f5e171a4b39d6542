"""Tool-call formats of model outputs (``--tool_call_parser``): where calls are in the text.

A parser splits generated text into *content* (what the user sees) and *call text* (JSON call
objects, ``{"name": ..., "arguments"|"parameters": {...}}``), incrementally: a stream feeds it
pieces as they arrive, and a non-streaming response feeds it the whole text at once, so both
paths split a text the same way. Reading the call objects themselves is
:mod:`lightllm.server.http.tool_calls.json_scan`'s job.

* ``hermes``: calls inside ``<tool_call>...</tool_call>`` tags, anywhere in the text (the
  format of Qwen2/Qwen2.5 and Hermes chat templates); a call left open at the end of the text
  still counts.
* ``llama3_json``: the whole output is one or more call objects (separated by ``;``),
  optionally after ``<|python_tag|>`` (Llama 3.1/3.2 JSON tool calling); output that starts
  with anything else is plain content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

CONTENT = "content"
CALL = "call"

Segment = tuple[str, str]


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker`` (kept until the next piece)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class Segmenter(ABC):
    """Splits a growing text into content and call-text segments."""

    @abstractmethod
    def feed(self, text: str) -> list[Segment]:
        """Segments that ``text`` completes; text that may still change kind is held back."""

    @abstractmethod
    def finish(self) -> list[Segment]:
        """Whatever was held back, once the text is complete."""


class TaggedSegmenter(Segmenter):
    """Call text between a start and an end tag; everything else is content."""

    def __init__(self, start: str, end: str) -> None:
        self._start = start
        self._end = end
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> list[Segment]:
        self._buffer += text
        segments: list[Segment] = []
        while True:
            marker = self._end if self._in_call else self._start
            kind = CALL if self._in_call else CONTENT
            found = self._buffer.find(marker)
            if found < 0:
                keep = _held_back(self._buffer, marker)
                ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                if ready:
                    segments.append((kind, ready))
                return segments
            if found:
                segments.append((kind, self._buffer[:found]))
            self._buffer = self._buffer[found + len(marker):]
            self._in_call = not self._in_call
            if self._in_call:
                # An empty call segment marks where a call begins, so two calls never merge.
                segments.append((CALL, ""))

    def finish(self) -> list[Segment]:
        rest, self._buffer = self._buffer, ""
        return [(CALL if self._in_call else CONTENT, rest)] if rest else []


class LeadingCallSegmenter(Segmenter):
    """All of the text is call text when it starts (after white space) with ``{`` or a marker;
    otherwise all of it is content."""

    def __init__(self, marker: str) -> None:
        self._marker = marker
        self._buffer = ""
        self._kind: str | None = None

    def feed(self, text: str) -> list[Segment]:
        if self._kind is not None:
            return [(self._kind, text)] if text else []
        self._buffer += text
        head = self._buffer.lstrip()
        if not head or (self._marker.startswith(head) and head != self._marker):
            return []
        if head.startswith(self._marker):
            self._kind, rest = CALL, head[len(self._marker):]
        elif head.startswith("{"):
            self._kind, rest = CALL, head
        else:
            self._kind, rest = CONTENT, self._buffer
        self._buffer = ""
        return [(self._kind, rest)] if rest else [(self._kind, "")]

    def finish(self) -> list[Segment]:
        rest, self._buffer = self._buffer, ""
        return [(CONTENT, rest)] if rest else []


class AllCallSegmenter(Segmenter):
    """Every character is call text (structured output forced the format)."""

    def feed(self, text: str) -> list[Segment]:
        return [(CALL, text)] if text else []

    def finish(self) -> list[Segment]:
        return []


class ToolCallParser(ABC):
    """One output format: its name (the flag's value) and a fresh segmenter per generation."""

    name: str
    # True when the format's markers may be special tokens, which skip_special_tokens would
    # strip from the text before the segmenter sees it.
    reads_special_tokens: bool = False

    @abstractmethod
    def segmenter(self) -> Segmenter:
        """A segmenter for one generation."""


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2/Qwen2.5, Hermes)."""

    name = "hermes"
    # Hermes-style checkpoints often register <tool_call> and </tool_call> as special tokens.
    reads_special_tokens = True
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def segmenter(self) -> Segmenter:
        return TaggedSegmenter(self.start_tag, self.end_tag)


class Llama3JsonParser(ToolCallParser):
    """``[<|python_tag|>]{"name": ..., "parameters": {...}}`` (Llama 3.1/3.2 JSON tool calls)."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def segmenter(self) -> Segmenter:
        return LeadingCallSegmenter(self.python_tag)


class ForcedCallParser(ToolCallParser):
    """The JSON array of ``{"name", "parameters"}`` objects that ``tool_choice: "required"``'s grammar produces."""

    name = "required"

    def segmenter(self) -> Segmenter:
        return AllCallSegmenter()


TOOL_CALL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
}
TOOL_CALL_PARSER_NAMES = tuple(TOOL_CALL_PARSERS)


def make_parser(name: str) -> ToolCallParser:
    """The parser ``--tool_call_parser name`` selects (``KeyError`` for an unknown name)."""
    return TOOL_CALL_PARSERS[name]()
