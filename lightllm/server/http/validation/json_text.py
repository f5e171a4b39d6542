"""JSON that a client sends inside a string field, read under the same rules as the body itself.

Some fields carry JSON as text: the ``arguments`` of a tool call in the chat history (OpenAI's
form), and a JSON schema given as a string (``guided_json``, ``structured_outputs.json``,
``/generate``'s ``parameters.guided_json``).  Read with a bare ``json.loads`` such text escapes
the checks the body gets (:mod:`lightllm.server.http.validation.body`): a lone ``\\ud800`` escape reached
the tokenizer, ``NaN`` passed as a number, and text nested a thousand levels overflowed the
JSON reader's recursion (a 500).  :func:`parse_json_text` applies the body's rules to the
string's own JSON: valid JSON, nested at most :data:`~lightllm.server.http.validation.body.MAX_JSON_DEPTH`
levels counted from the string's own top value, finite numbers (and none a double reads as 0
though it is not), no lone surrogates, integers
within Python's digit limit, and (unless the caller allows them) no key repeated in one object.
Every failure is a 400 naming the field.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Callable, Optional, TypeVar

from lightllm.server.http.validation.body import (MAX_JSON_DEPTH, DuplicateKeyError, find_structure_problem,
                                                  float_reader, object_with_unique_keys)
from lightllm.server.http.errors import invalid_request


# find_structure_problem's kinds, as what the text does wrong.
_PROBLEMS = {
    "deep": f"its JSON is nested more than {MAX_JSON_DEPTH} levels deep",
    "number": "its JSON holds a number that is not finite ({value!r}); JSON has no NaN or Infinity",
    "underflow": "its JSON holds {value}, too close to 0 for a 64-bit float (it would be read as 0)",
    "string": "its JSON holds a string with a lone UTF-16 surrogate (not valid Unicode)",
    "key": "its JSON holds an object key with a lone UTF-16 surrogate (not valid Unicode)",
}


def _lead(param: str) -> str:
    """How a refusal of the field ``param``'s JSON text begins, as the body's own refusals do."""
    return f"Invalid value for '{param}': "


def parse_json_text(text: str, param: str, unique_keys: bool = True) -> Any:
    """The value the JSON ``text`` of the field ``param`` encodes; 400 naming ``param`` unless it keeps the body's rules.

    ``unique_keys`` False lets an object repeat a key (the last value counts, as JSON readers
    commonly take it): for text this server itself may have written, such as tool-call
    arguments copied from a model's output, which a client sends back in the history.
    """
    try:
        value = _read(lambda: json.loads(text, object_pairs_hook=object_with_unique_keys if unique_keys else None,
                                         parse_float=float_reader(text)), param, _lead(param))
    except json.JSONDecodeError as exc:
        raise invalid_request(f"{_lead(param)}it is not valid JSON ({exc})", param) from None
    _check_structure(value, param, _lead(param))
    return value


def parse_json_at(text: str, start: int, param: str, lead: str) -> Optional[tuple[Any, int]]:
    """The JSON value that begins at ``start`` of ``text`` (after JSON white space) and the index
    where it ends, under the body's rules (no key repeated); None where no JSON value begins there.

    For JSON embedded in other text (a Lark grammar's ``%json`` blocks), which ends where its value
    does.  A value that breaks the rules is a 400 naming ``param`` whose message begins with ``lead``
    (the text the embedding field's own refusals begin with, and which part of it this value is:
    "invalid grammar (...): the %json block at line 3, column 1: ").
    """
    begin = _JSON_SPACE.match(text, start).end()
    decoder = json.JSONDecoder(object_pairs_hook=object_with_unique_keys, parse_float=float_reader(text))
    try:
        value, end = _read(lambda: decoder.raw_decode(text, begin), param, lead)
    except json.JSONDecodeError:
        return None
    _check_structure(value, param, lead)
    return value, end


_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_T = TypeVar("_T")


def _read(decode: Callable[[], _T], param: str, lead: str) -> _T:
    """What ``decode`` reads with json (400 naming ``param``, its message beginning with ``lead``, for a
    repeated key, deep nesting or an integer too long to read); json's syntax errors are the caller's."""
    try:
        return decode()
    except DuplicateKeyError as exc:
        raise invalid_request(f"{lead}its JSON repeats the key {exc.key!r} in one object", param) from None
    except RecursionError:
        raise invalid_request(f"{lead}its JSON is nested more than {MAX_JSON_DEPTH} levels deep", param) from None
    except json.JSONDecodeError:
        raise
    except ValueError:
        # json's one other ValueError: an integer longer than Python's digit limit.
        raise invalid_request(f"{lead}its JSON holds an integer written with more than "
                              f"{sys.get_int_max_str_digits()} digits", param) from None


def _check_structure(value: Any, param: str, lead: str) -> None:
    """400 naming ``param`` (the message beginning with ``lead``) unless ``value`` keeps the body's
    structural rules (depth, finite numbers, Unicode)."""
    problem = find_structure_problem(value)
    if problem is not None:
        # The path of a container nested too deep is the long chain of keys leading to it: left out.
        place = f" (at '{problem.path}')" if problem.path and problem.kind != "deep" else ""
        raise invalid_request(lead + _PROBLEMS[problem.kind].format(value=problem.value) + place, param)
