"""What a generated text means under a tool-call format: content and calls, decided once for both paths.

:class:`CallReader` reads a text piece by piece through the parser's segmenter
(:mod:`~lightllm.server.http.openai.tool_calls.parsers`), which gives content as it comes and each call
block only once it is complete. A block that holds only well-formed call objects becomes calls;
any other block (not JSON, no ``name``, arguments not an object, text beside the objects) is
content, exactly as the model wrote it, tags included, so a client never receives half of what
the model meant and never loses text. White space right before a call is dropped, and so is
white space after a call that no content follows (between calls, at the end of the text). A stream and a non-streaming response run
the same reader, so for every text and every way of cutting it into pieces they answer the same:
the streamed content adds up to the message's content and the calls are the message's calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from lightllm.server.http.validation.body import find_structure_problem, float_reader
from lightllm.server.http.openai.tool_calls.json_scan import ARGUMENT_KEYS, CallObjectScanner, split_objects
from lightllm.server.http.openai.tool_calls.parsers import CALL, Segment, ToolCallParser

# Characters allowed between call objects of one block (llama3's ";" list, a JSON array's brackets).
_SEPARATORS = set(" \t\r\n;,[]")


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's ``call_...`` form."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    """One function call: its name and its arguments as JSON text."""

    name: str
    arguments: str

    def to_openai(self, call_id: str | None = None) -> dict:
        """The ``message.tool_calls`` entry."""
        return {"id": call_id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Extraction:
    """A text split into content (None when nothing but calls) and calls."""

    content: str | None
    calls: list[ParsedCall]


def _first_of_each_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for key, item in pairs:
        value.setdefault(key, item)
    return value


def parse_call_object(text: str) -> ParsedCall | None:
    """The call a JSON object text holds, or None unless it is ``{"name": <string>, "arguments"
    or "parameters": <object or JSON-object string>}`` (arguments may be left out: ``{}``)."""
    try:
        # The first "name" and the first arguments key in the text count, as the scanner that
        # takes the arguments' own text reads them.
        value = json.loads(text, object_pairs_hook=_first_of_each_key, parse_float=float_reader(text))
    except (ValueError, RecursionError):  # a model may nest deeper than the JSON reader goes
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if find_structure_problem(value) is not None:
        # NaN, Infinity, a number beyond a double or a lone surrogate: not JSON a client may send
        # back as this call's arguments (the history check refuses it), so the block is text.
        return None
    key = next((key for key in value if key in ARGUMENT_KEYS), None)
    if key is None:
        return ParsedCall(value["name"], "{}")
    arguments = value[key]
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON string, as the OpenAI API itself does.
        try:
            decoded = json.loads(arguments, parse_float=float_reader(arguments))
        except (ValueError, RecursionError):
            return None
        if not isinstance(decoded, dict) or find_structure_problem(decoded) is not None:
            return None
        return ParsedCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    # The model's own text of the arguments, as a stream forwards it.
    scanner = CallObjectScanner()
    scanner.feed(text)
    return ParsedCall(value["name"], scanner.arguments.strip())


def parse_call_block(text: str) -> list[ParsedCall] | None:
    """Every call object of one call block, or None if the block holds anything else."""
    spans = split_objects(text)
    outside, position = [], 0
    for start, end in spans:
        outside.append(text[position:start])
        position = end
    outside.append(text[position:])
    if not spans or set("".join(outside)) - _SEPARATORS:
        return None
    calls = [parse_call_object(text[start:end]) for start, end in spans]
    return None if any(call is None for call in calls) else calls  # type: ignore[return-value]


@dataclass
class Reading:
    """What one :meth:`CallReader.feed` or :meth:`CallReader.finish` decided: content and complete calls
    (a chunk carries both; a client adds content to content and calls to calls, so their order within
    one piece does not matter)."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class CallReader:
    """Content and calls of one generation, read incrementally (one instance per generation).

    Held back until decided: a call block until it is complete (a stream cannot take back a call
    or content it sent), and white space at the end of the content (a call may follow and drop it).
    So ``"Hi\\n<call>\\nDone"`` has the content ``"Hi\\nDone"``, and ``"Hi\\n<call>\\n"`` the content ``"Hi"``.
    """

    def __init__(self, parser: ToolCallParser, parallel: bool = True,
                 accepts: Callable[[ParsedCall], bool] | None = None) -> None:
        self._segmenter = parser.segmenter()
        self._parallel = parallel
        self._accepts = accepts
        self.calls_read = 0
        self._space = ""
        self._after_call = False

    def feed(self, text: str) -> Reading:
        """What the next piece of text decides."""
        reading = Reading()
        for segment in self._segmenter.feed(text):
            self._take(segment, reading)
        return reading

    def finish(self) -> Reading:
        """What the end of the text decides: held blocks and content, held white space."""
        reading = Reading()
        for segment in self._segmenter.finish():
            self._take(segment, reading)
        if not self._after_call:
            reading.content += self._space
        self._space = ""
        return reading

    def _take(self, segment: Segment, reading: Reading) -> None:
        if segment.kind == CALL:
            calls = parse_call_block(segment.text)
            if calls is not None and self._accepts is not None and not all(self._accepts(call) for call in calls):
                # A call of a function the request did not declare is no call a client can make, nor
                # a strict function's call whose arguments break its schema: the block stays the
                # model's text (OpenAI never names an undeclared tool nor breaks a strict schema).
                calls = None
            if calls is not None:
                self._space, self._after_call = "", True
                for call in calls:
                    # Without parallel calls only the first call is kept.
                    if self._parallel or self.calls_read == 0:
                        reading.calls.append(call)
                        self.calls_read += 1
                return
        self._content(segment.raw, reading)

    def _content(self, text: str, reading: Reading) -> None:
        # White space waits for what follows it: more content lets it out, a call or (right
        # after a call) the end of the text drops it.
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            reading.content += body
            self._after_call = False


def extract_calls(parser: ToolCallParser, text: str, parallel: bool = True,
                  accepts: Callable[[ParsedCall], bool] | None = None) -> Extraction:
    """Content and calls of a whole ``text`` in ``parser``'s format; ``parallel`` False keeps the first call only,
    a block holding a call that ``accepts`` (the request's tools: CallableTools.accepts) refuses is content."""
    reader = CallReader(parser, parallel, accepts)
    readings = (reader.feed(text), reader.finish())
    calls = [call for reading in readings for call in reading.calls]
    if not calls:
        return Extraction(text, [])
    return Extraction("".join(reading.content for reading in readings) or None, calls)


def read_named_call(name: str, text: str) -> Extraction:
    """The output of ``tool_choice`` naming a function: the whole text is that call's arguments object.

    Anything that is not a JSON object (a generation cut off by ``max_tokens`` or a stop) stays content.
    """
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        return Extraction(text, [])
    return Extraction(None, [ParsedCall(name, text.strip())])
