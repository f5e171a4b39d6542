"""Tool calls of a whole generated text (non-streaming responses).

The text is split by the same segmenter a stream uses (:mod:`~lightllm.server.http.tool_calls.parsers`);
every call block must then hold only well-formed call objects. If any call is malformed the
whole text is returned as content with no calls, so a client never receives half of what the
model meant.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lightllm.server.http.tool_calls.json_scan import ARGUMENT_KEYS, CallObjectScanner, split_objects
from lightllm.server.http.tool_calls.parsers import CALL, ToolCallParser

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
        # The first "name" and the first arguments key in the text count, as a stream reads them.
        value = json.loads(text, object_pairs_hook=_first_of_each_key)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((key for key in value if key in ARGUMENT_KEYS), None)
    if key is None:
        return ParsedCall(value["name"], "{}")
    arguments = value[key]
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON string, as the OpenAI API itself does.
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return None
        return ParsedCall(value["name"], arguments) if isinstance(decoded, dict) else None
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


def extract_calls(parser: ToolCallParser, text: str, parallel: bool = True) -> Extraction:
    """Content and calls of ``text`` in ``parser``'s format; ``parallel`` False keeps the first call only."""
    segmenter = parser.segmenter()
    content: list[str] = []
    blocks: list[str] = []
    for kind, piece in segmenter.feed(text) + segmenter.finish():
        if kind != CALL:
            content.append(piece)
        elif piece == "" or not blocks:
            blocks.append(piece)
        else:
            blocks[-1] += piece
    blocks = [block for block in blocks if block.strip()]
    if not blocks:
        return Extraction(text, [])
    calls: list[ParsedCall] = []
    for block in blocks:
        parsed = parse_call_block(block)
        if parsed is None:
            return Extraction(text, [])
        calls.extend(parsed)
    if not parallel:
        calls = calls[:1]
    return Extraction("".join(content).strip() or None, calls)
