"""Reading one tool-call JSON object: its function name and the raw text of its arguments.

A model writes a call as ``{"name": "f", "arguments": {...}}`` (Hermes), ``{"name": "f",
"parameters": {...}}`` (Llama 3.1, and the structured-output form of ``tool_choice:
"required"``). :class:`CallObjectScanner` reads such an object one character at a time and keeps
the arguments as the model's own text (not re-serialized): that text is the ``arguments`` string
a client receives, streamed or not. :func:`split_objects` finds the objects of a call block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")

_OPENERS = "{["
_CLOSERS = "}]"


@dataclass
class ScanResult:
    """What one :meth:`CallObjectScanner.feed` call found: the name once known, new argument text,
    and how many of the fed characters belonged to the object (the rest follow its end)."""

    name: str | None = None
    arguments: str = ""
    consumed: int = 0


@dataclass
class CallObjectScanner:
    """Reads one JSON object character by character (the first character fed must be ``{``).

    Only the top level of the object is interpreted: the string value of ``"name"`` and the raw
    text of the first ``"arguments"``/``"parameters"`` value. Nested values are tracked only to
    find where they end.
    """

    name: str | None = None
    done: bool = False
    # The raw text of the arguments value read so far.
    arguments: str = ""
    has_arguments: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    # Top-level parsing state: "key", "colon", "value" (waiting for its first character),
    # "in_value", "after_value".
    _state: str = "key"
    _key_text: str = ""
    _current_key: str | None = None
    _value_text: str = ""
    _value_depth: int = 0
    _value_is_string: bool = False
    _capturing: bool = False

    def feed(self, text: str) -> ScanResult:
        """Read ``text``; stop right after the object's closing brace."""
        result = ScanResult()
        for position, char in enumerate(text):
            if self.done:
                result.consumed = position
                return result
            self._step(char, result)
        result.consumed = len(text)
        return result

    def _step(self, char: str, result: ScanResult) -> None:
        if self._depth == 0:
            if char == "{":
                self._depth = 1
            return
        if self._state == "in_value":
            self._value_step(char, result)
            return
        if self._in_string:
            self._string_step(char)
            if self._state == "key":
                self._key_text += char
            return
        if char.isspace():
            return
        if self._state == "key":
            if char == '"':
                self._in_string = True
                self._key_text = char
            elif char == "}":
                self._close()
        elif self._state == "colon":
            if char == ":":
                self._state = "value"
        elif self._state == "value":
            self._begin_value(char, result)
        elif self._state == "after_value":
            if char == ",":
                self._state = "key"
            elif char == "}":
                self._close()

    def _string_closes(self, char: str) -> bool:
        """Whether ``char`` (inside a string) is the unescaped quote that ends it; tracks escapes."""
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            return True
        return False

    def _string_step(self, char: str) -> None:
        if self._string_closes(char):
            if self._state == "key":
                self._key_text += char
                try:
                    self._current_key = json.loads(self._key_text)
                except ValueError:
                    self._current_key = None
                self._state = "colon"

    def _begin_value(self, char: str, result: ScanResult) -> None:
        self._state = "in_value"
        self._value_text = ""
        self._value_depth = 0
        self._value_is_string = char == '"'
        # Only the first arguments value counts; a repeated key is read past like any other.
        self._capturing = self._current_key in ARGUMENT_KEYS and not self.has_arguments
        self._value_step(char, result)

    def _value_step(self, char: str, result: ScanResult) -> None:
        """One character of a top-level value; the value ends at its closing bracket or quote, or
        (for a number, true, false, null) at the ``,`` or ``}`` after it."""
        if not self._in_string and self._value_depth == 0 and self._value_text and not self._value_is_string \
                and self._value_text[0] not in _OPENERS and char in ",}":
            self._end_value(result)
            if char == ",":
                self._state = "key"
            else:
                self._close()
            return
        self._value_text += char
        # Arguments written as a JSON string are given as the string's content, once it is whole
        # (the non-streaming path decodes them the same way): its escaped text is not arguments.
        if self._capturing and not self._value_is_string:
            self.arguments += char
            result.arguments += char
        if self._in_string:
            if self._string_closes(char) and self._value_depth == 0:
                self._end_value(result)
            return
        if char == '"':
            self._in_string = True
        elif char in _OPENERS:
            self._value_depth += 1
        elif char in _CLOSERS:
            self._value_depth -= 1
            if self._value_depth == 0:
                self._end_value(result)

    def _end_value(self, result: ScanResult) -> None:
        key = self._current_key
        if key == "name" and self.name is None:
            try:
                name = json.loads(self._value_text)
            except ValueError:
                name = None
            if isinstance(name, str):
                self.name = name
                result.name = name
        if self._capturing:
            if self._value_is_string:
                try:
                    content = json.loads(self._value_text)
                except ValueError:
                    content = self._value_text
                self.arguments += content
                result.arguments += content
            self.has_arguments = True
            self._capturing = False
        self._state = "after_value"

    def _close(self) -> None:
        self._depth = 0
        self.done = True


def split_objects(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of every complete top-level JSON object in ``text`` (brackets matched, strings respected).

    Text between objects (separators, an enclosing array's brackets) is skipped.
    """
    spans = []
    depth = 0
    start = 0
    in_string = escape = False
    for position, char in enumerate(text):
        if depth == 0:
            if char == "{":
                start, depth = position, 1
            continue
        if in_string:
            if escape:
                escape = False
            elif char == "\\":
                escape = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in _OPENERS:
            depth += 1
        elif char in _CLOSERS:
            depth -= 1
            if depth == 0:
                spans.append((start, position + 1))
    return spans
