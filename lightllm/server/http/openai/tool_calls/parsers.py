"""Tool-call formats of model outputs (``--tool_call_parser``): where calls are in the text.

A parser's segmenter splits generated text into *content* (what the user sees) and *call
blocks* (the text of JSON call objects, ``{"name": ..., "arguments"|"parameters": {...}}``),
incrementally: a stream feeds it pieces as they arrive, and a non-streaming response feeds it the
whole text at once. Content is let out as soon as it cannot become the start of a call; a call
block is given only once it is complete (its end marker arrived, or the text ended), whole, with
the text it was written as. So whatever the chunking, the same blocks come out, and the content
between two blocks adds up to the same text: deciding what a block is
(:mod:`lightllm.server.http.openai.tool_calls.extraction`) then gives a stream and a whole response the
same answer.

* ``hermes``: calls inside ``<tool_call>...</tool_call>`` tags, anywhere in the text (the
  format of Qwen2/Qwen2.5 and Hermes chat templates); the first end tag closes a call (also one
  inside a JSON string); a call left open at the end of the text is a block too.
* ``llama3_json``: the whole output is one or more call objects (separated by ``;``),
  optionally after ``<|python_tag|>`` (Llama 3.1/3.2 JSON tool calling), so it is one block that
  ends with the text; output that starts with anything else is plain content.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Callable, NamedTuple

CONTENT = "content"
CALL = "call"


class Segment(NamedTuple):
    """A piece of content, or one complete call block.

    ``text`` is the content, or the call text inside the block's markers; ``raw`` is the text
    exactly as the model wrote it (markers included), which becomes content when the block does
    not parse as calls.
    """

    kind: str
    text: str
    raw: str


def content(text: str) -> Segment:
    """A content segment."""
    return Segment(CONTENT, text, text)


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker`` (kept until the next piece)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class Segmenter(ABC):
    """Splits a growing text into content segments and complete call blocks."""

    @abstractmethod
    def feed(self, text: str) -> list[Segment]:
        """Segments that ``text`` completes; text that may still change kind is held back."""

    @abstractmethod
    def finish(self) -> list[Segment]:
        """Whatever was held back, once the text is complete (an open call block included)."""


class TaggedSegmenter(Segmenter):
    """Call blocks between a start and an end tag; everything else is content."""

    def __init__(self, start: str, end: str) -> None:
        self._start = start
        self._end = end
        self._in_call = False
        # Content: an end of the text that may be the start of the start tag.
        self._held = ""
        # A call: its pieces so far (joined once, when it ends) and their last characters, where
        # an end tag split over two pieces begins.
        self._call: list[str] = []
        self._tail = ""

    def feed(self, text: str) -> list[Segment]:
        """Content up to each start tag and each call up to its end tag; a possible partial tag is held back."""
        segments: list[Segment] = []
        while text:
            text = self._feed_call(text, segments) if self._in_call else self._feed_content(text, segments)
        return segments

    def _feed_content(self, text: str, segments: list[Segment]) -> str:
        """Content up to a start tag; returns the text after the tag ("" when there is none)."""
        buffer, self._held = self._held + text, ""
        found = buffer.find(self._start)
        if found < 0:
            keep = _held_back(buffer, self._start)
            self._held = buffer[len(buffer) - keep:]
            if len(buffer) > keep:
                segments.append(content(buffer[: len(buffer) - keep]))
            return ""
        if found:
            segments.append(content(buffer[:found]))
        self._in_call, self._call, self._tail = True, [], ""
        return buffer[found + len(self._start):]

    def _feed_call(self, text: str, segments: list[Segment]) -> str:
        """Call text up to the end tag; returns the text after the tag ("" when it has not come)."""
        window = self._tail + text
        found = window.find(self._end)
        if found < 0:
            self._call.append(text)
            self._tail = window[max(0, len(window) - len(self._end) + 1):]
            return ""
        # Where the tag begins in ``text``; negative when it began in an earlier piece.
        cut = found - len(self._tail)
        body = "".join(self._call)
        body = body[: len(body) + cut] if cut < 0 else body + text[:cut]
        segments.append(Segment(CALL, body, self._start + body + self._end))
        self._in_call, self._call, self._tail = False, [], ""
        return text[cut + len(self._end):]

    def finish(self) -> list[Segment]:
        """An unclosed call block (its ``raw`` without the end tag), or the held-back content."""
        if self._in_call:
            body = "".join(self._call)
            self._in_call, self._call, self._tail = False, [], ""
            return [Segment(CALL, body, self._start + body)]
        rest, self._held = self._held, ""
        return [content(rest)] if rest else []


class LeadingCallSegmenter(Segmenter):
    """All of the text is one call block when it starts (after white space) with ``{`` or a marker;
    otherwise all of it is content."""

    def __init__(self, marker: str) -> None:
        self._marker = marker
        self._pieces: list[str] = []
        self._kind: str | None = None
        # Where the call text starts in the joined pieces (after the marker).
        self._body = 0

    def feed(self, text: str) -> list[Segment]:
        """Content as it comes once the text is known not to start with a call; nothing while it may or does."""
        if self._kind == CONTENT:
            return [content(text)] if text else []
        self._pieces.append(text)
        if self._kind == CALL:
            return []
        buffer = "".join(self._pieces)
        self._pieces = [buffer]
        head = buffer.lstrip()
        if not head or (self._marker.startswith(head) and head != self._marker):
            return []
        if head.startswith(self._marker):
            self._kind, self._body = CALL, len(buffer) - len(head) + len(self._marker)
        elif head.startswith("{"):
            self._kind, self._body = CALL, len(buffer) - len(head)
        else:
            self._kind, self._pieces = CONTENT, []
            return [content(buffer)]
        return []

    def finish(self) -> list[Segment]:
        """The whole text as one call block when it started one, else what is left as content."""
        rest, self._pieces = "".join(self._pieces), []
        if self._kind == CALL:
            return [Segment(CALL, rest[self._body:], rest)]
        return [content(rest)] if rest else []


class ArraySegmenter(Segmenter):
    """The whole text is one call block if it is a whole JSON array (structured output forced the
    format); anything else is content.

    The grammar makes a finished output a whole array, so only a generation cut off (by
    ``max_tokens``) is not: ``[{...},{...},`` holds two complete objects, but the model had not
    finished its list, and a client could not tell the calls it gets were cut; vLLM, which reads
    the whole text as a list of calls, returns it as content too.
    """

    def __init__(self) -> None:
        self._pieces: list[str] = []

    def feed(self, text: str) -> list[Segment]:
        """Nothing: whether the text is an array is known only at the end."""
        self._pieces.append(text)
        return []

    def finish(self) -> list[Segment]:
        """The whole text as one call block when it parses as a JSON array, else as content."""
        rest, self._pieces = "".join(self._pieces), []
        if not rest:
            return []
        try:
            whole = isinstance(json.loads(rest), list)
        except (ValueError, RecursionError):
            whole = False
        return [Segment(CALL, rest, rest) if whole else content(rest)]


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
        """Calls between ``<tool_call>`` and ``</tool_call>``."""
        return TaggedSegmenter(self.start_tag, self.end_tag)


class Llama3JsonParser(ToolCallParser):
    """``[<|python_tag|>]{"name": ..., "parameters": {...}}`` (Llama 3.1/3.2 JSON tool calls)."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def segmenter(self) -> Segmenter:
        """One call block when the text starts (after white space) with ``<|python_tag|>`` or ``{``."""
        return LeadingCallSegmenter(self.python_tag)


class ForcedCallParser(ToolCallParser):
    """The JSON array of ``{"name", "parameters"}`` objects that ``tool_choice: "required"``'s grammar produces."""

    name = "required"

    def segmenter(self) -> Segmenter:
        """The whole text as one array of calls."""
        return ArraySegmenter()


TOOL_CALL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
}
TOOL_CALL_PARSER_NAMES = tuple(TOOL_CALL_PARSERS)


def make_parser(name: str) -> ToolCallParser:
    """The parser ``--tool_call_parser name`` selects (``KeyError`` for an unknown name)."""
    return TOOL_CALL_PARSERS[name]()
