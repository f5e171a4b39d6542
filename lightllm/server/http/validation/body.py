"""Decoding a request body: UTF-8 text, JSON, structural checks, then the endpoint's pydantic model.

The body must be JSON encoded as UTF-8 (RFC 8259 section 8.1). A leading UTF-8 byte order mark is
ignored, as the RFC allows and as FastAPI-based servers do; a UTF-16 or UTF-32 body (with or
without a byte order mark) and invalid UTF-8 are refused. Python's ``json.loads(bytes)`` would
guess those encodings and accept them, so the bytes are decoded strictly here first.

Before any field is validated the decoded body must be a JSON object with no key repeated within
one object (Python's JSON reader keeps the last value and drops the others silently), nested at most
:data:`MAX_JSON_DEPTH` levels, every number in it must be finite (Python's JSON reader accepts
``NaN``, ``Infinity`` and overflowing literals such as ``1e999``, which standard JSON has no
place for, and reads a nonzero literal too small for a double, ``1e-400``, as 0: a temperature
or bound that silently changed its meaning, even its sign for ``-1e-400``), and no string in it
(key or value) may hold a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but not valid
Unicode; tokenizers and UTF-8 encoders fail on it).  Every failure is a
400 :class:`~lightllm.server.http.errors.APIError` naming the dotted field path
(``messages.0.content``).  JSON that a field carries as text (tool-call arguments, a JSON schema
string) is held to the same rules by :mod:`lightllm.server.http.validation.json_text`.

A body of several MiB takes a noticeable time to decode and validate, so the handlers call
:func:`parse_body_off_loop`, which does the work on a worker thread for bodies above
:data:`OFF_LOOP_BODY_BYTES`.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

from pydantic import BaseModel, ValidationError

from lightllm.server.http.errors import invalid_request
from lightllm.utils.daemon_workers import DaemonWorkers
from lightllm.server.http.validation.validation_errors import describe_validation_error

# Real requests nest about five levels (messages -> content parts -> text); the limit leaves
# room for clients that wrap values in extra objects while bounding the work per body.
MAX_JSON_DEPTH = 32

# Parsing costs 0.05-0.3 s per MiB of small JSON values (token ids: least, short chat messages:
# most), so up to this size at most a few milliseconds: about what handing the work to the thread
# can add in latency (the worker may wait up to a GIL switch interval to start).
OFF_LOOP_BODY_BYTES = 16 * 1024

ModelT = TypeVar("ModelT", bound=BaseModel)

# One thread: decoding is pure Python or holds the GIL, so more threads would not finish sooner,
# they would only take the interpreter away from the event loop more often.
_PARSERS = DaemonWorkers(1, "lightllm-body")

# A lone surrogate can only come from a \uD800-\uDFFF escape: strictly decoded UTF-8 holds none.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# A JSON string (optionally followed by the colon that makes it a key), a bracket or a number
# (to find an integer longer than Python's digit limit).
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?|[\[\]{}]|-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?')

# A link from a container back to the root: (parent trail, parent container, the container).
# The container's key or index is looked up only when an error is reported.
_Trail = Optional[tuple]


def _has_lone_surrogate(text: str) -> bool:
    # JSON's \uD800-style escapes can produce code points that are not valid Unicode text;
    # tokenizers and UTF-8 encoders fail on them.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _member_key(container: Any, member: Any) -> str:
    # By identity: the walk holds the very object, and an equal value elsewhere in the
    # container is not the one that failed.
    members = container.items() if isinstance(container, dict) else enumerate(container)
    return str(next(key for key, item in members if item is member))


def _param(trail: _Trail, container: Any = None, member: Any = None) -> str | None:
    """The dotted path of ``member`` of ``container`` (the container at the end of ``trail``), or of that container."""
    parts = [] if container is None else [_member_key(container, member)]
    while trail is not None:
        trail, parent, child = trail
        parts.append(_member_key(parent, child))
    parts.reverse()
    return ".".join(parts) or None


@dataclass(frozen=True)
class StructureProblem:
    """What :func:`find_structure_problem` found wrong: ``kind`` is ``"deep"``, ``"string"`` (a lone
    surrogate), ``"key"`` (a lone surrogate in a key) or ``"number"`` (not finite, ``value``).

    ``path`` is the dotted path inside the checked value: of the container nested too deep, of the
    bad string or number, or of the object holding the bad key (None: the value itself).
    """

    kind: str
    path: str | None
    value: Any = None


class UnderflowedNumber(float):
    """A JSON number literal that is not zero but rounds to 0.0 as a double; remembers its text."""

    literal: str

    def __new__(cls, literal: str) -> "UnderflowedNumber":
        number = super().__new__(cls, 0.0)
        number.literal = literal
        return number


# Where a literal may underflow: a negative exponent of three digits or more, or a run of zeros
# after the point (0.<20 zeros>1e-305 is 1e-326).  Text without either is parsed by json's C float
# reader alone; a Python hook on every float made a body of floats a quarter to two thirds slower.
_UNDERFLOW_CANDIDATE = re.compile(r"[eE]-0*\d{3,}|\.0{20,}")


def read_json_float(literal: str) -> float:
    """``json.loads``' ``parse_float``: the double of ``literal``, or an :class:`UnderflowedNumber` for a
    nonzero literal that underflows to 0 (found by :func:`find_structure_problem`)."""
    value = float(literal)
    if value == 0.0 and any(digit in "123456789" for digit in literal.partition("e")[0].partition("E")[0]):
        return UnderflowedNumber(literal)
    return value


def float_reader(text: str) -> Optional[Any]:
    """The ``parse_float`` for JSON ``text``: :func:`read_json_float` where a literal may underflow, else None
    (json's own reader)."""
    return read_json_float if _UNDERFLOW_CANDIDATE.search(text) else None


def find_structure_problem(data: Any, check_strings: bool = True) -> StructureProblem | None:
    """The first reason ``data`` breaks the body's structural rules, or None.

    The rules: nested at most :data:`MAX_JSON_DEPTH` levels (``data`` itself being the first),
    every number finite and no nonzero literal read as 0 (:func:`read_json_float`), no lone UTF-16
    surrogate in a string or key (``check_strings`` False skips that check: the caller knows the
    text has none).

    Walks iteratively, so a hostile value cannot exhaust the interpreter's stack here.  A body of
    millions of token ids passes through here, so the walk looks at each value once and builds no
    path on the way: a container keeps a link to its parent, and the path is spelled out only for
    a problem.
    """
    isfinite = math.isfinite
    stack: list[tuple[Any, int, _Trail]] = [(data, 0, None)]
    push, pop = stack.append, stack.pop
    while stack:
        container, depth, trail = pop()
        if isinstance(container, dict):
            if check_strings:
                for key in container:
                    if _has_lone_surrogate(key):
                        return StructureProblem("key", _param(trail))
            members = container.values()
        elif isinstance(container, list):
            members = container
        else:  # a scalar: only the top level can be one
            members = [container]
            container = None
        if container and depth >= MAX_JSON_DEPTH:
            return StructureProblem("deep", _param(trail))
        for item in members:
            kind = type(item)
            if kind is int:
                continue  # the bulk of a large body: token ids
            if kind is str:
                if check_strings and _has_lone_surrogate(item):
                    return StructureProblem("string", _param(trail, container, item))
            elif kind is float:
                if not isfinite(item):
                    return StructureProblem("number", _param(trail, container, item), item)
            elif kind is UnderflowedNumber:
                return StructureProblem("underflow", _param(trail, container, item), item.literal)
            elif kind is dict or kind is list or isinstance(item, (dict, list)):
                push((item, depth + 1, (trail, container, item)))
    return None


def check_json_structure(data: Any, check_strings: bool = True) -> None:
    """Reject bodies nested deeper than :data:`MAX_JSON_DEPTH` or holding non-finite numbers or lone surrogates.

    The 400 names the dotted path of the offending value (or of the object holding a bad key);
    see :func:`find_structure_problem`.
    """
    problem = find_structure_problem(data, check_strings)
    if problem is None:
        return
    param = problem.path
    if problem.kind == "deep":
        raise invalid_request(f"The request body is nested more than {MAX_JSON_DEPTH} levels deep",
                              param.split(".", 1)[0] if param else None)
    if problem.kind == "key":
        where = f"an object key in '{param}'" if param else "an object key"
        raise invalid_request(f"{where} contains a lone UTF-16 surrogate (not valid Unicode)", param)
    if problem.kind == "number":
        raise invalid_request(f"Invalid value for '{param}': must be finite, got {problem.value!r}", param)
    if problem.kind == "underflow":
        raise invalid_request(f"Invalid value for '{param}': {problem.value} is too close to 0 for a 64-bit float "
                              "and would be read as 0; send 0 if that is what is meant",
                              param)
    raise invalid_request(f"Invalid value for '{param}': the string contains a lone UTF-16 surrogate "
                          "(not valid Unicode)", param)


def json_type_name(value: Any) -> str:
    """The JSON name of the type of a decoded JSON value (``null``, ``array``, ...), for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def too_long_integer_message(field: str | None) -> str:
    """The error for an integer literal longer than Python's digit limit (``json.loads`` refuses it)."""
    limit = sys.get_int_max_str_digits()
    where = f"Invalid value for '{field}': it holds" if field else "The request body holds"
    return f"{where} an integer written with more than {limit} digits, longer than any number a field takes"


def decode_body_text(raw: bytes) -> str:
    """The body as text: strictly UTF-8, a leading UTF-8 byte order mark dropped; 400 otherwise."""
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    # JSON text starts with an ASCII character, so a NUL among the first four bytes means UTF-16
    # or UTF-32 (the same test RFC 4627 gave); both byte order marks of UTF-16 start UTF-32's too.
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) or b"\x00" in raw[:4]:
        raise invalid_request("The request body must be JSON encoded as UTF-8; it looks like UTF-16 or UTF-32")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(f"The request body must be JSON encoded as UTF-8; the byte at offset {exc.start} is not "
                              f"valid UTF-8 ({exc.reason})") from None


def _top_level_field(text: str, stop: Any) -> str | None:
    """The top-level field being read when ``stop(token, depth)`` first holds, scanning ``text`` token by token.

    Scans strings, brackets (and, when the pattern finds them, long integers) only, so it costs little
    more than the part of the body before the stopping token; None when ``stop`` never holds.
    """
    depth = 0
    field: str | None = None
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        first = token[0]
        if first == '"':
            if depth == 1 and match.group(1):
                try:
                    field = json.loads(token[:token.rindex('"') + 1])
                except ValueError:
                    field = None
            continue
        if first in "[{":
            depth += 1
        elif first in "]}":
            depth -= 1
        if stop(token, depth):
            return field if depth >= 1 else None
    return None


def deep_field(text: str) -> str | None:
    """The top-level field whose value nests deeper than :data:`MAX_JSON_DEPTH`, read from the raw text.

    For bodies too deep for ``json.loads`` itself: scans strings and brackets only until the
    nesting passes the limit, so it costs little more than the part of the body before that.
    """
    # The body's object is level 1, so a value of a top-level field at nesting N is at N + 1.
    return _top_level_field(text, lambda token, depth: depth > MAX_JSON_DEPTH + 1)


def long_integer_field(text: str) -> str | None:
    """The top-level field holding an integer literal longer than Python's digit limit (None: none found)."""
    limit = sys.get_int_max_str_digits()
    return _top_level_field(text, lambda token, depth: token.lstrip("-").isdigit() and len(token.lstrip("-")) > limit)


class DuplicateKeyError(ValueError):
    """A JSON object of the body holds ``key`` twice (``json.loads`` would keep the last value)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def object_with_unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` ``object_pairs_hook``: the object as a dict, refusing a key written twice.

    Raises:
        DuplicateKeyError: naming the first repeated key.
    """
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return data


def parse_body(raw: bytes, model_cls: type[ModelT]) -> ModelT:
    """Decode a JSON body and validate it into ``model_cls``, raising 400 on any problem.

    Takes time proportional to the body (about 0.1 s per MiB of token ids): on the event loop,
    call :func:`parse_body_off_loop` instead.
    """
    text = decode_body_text(raw)
    try:
        data = json.loads(text, object_pairs_hook=object_with_unique_keys, parse_float=float_reader(text))
    except DuplicateKeyError as exc:
        raise invalid_request(f"The request body repeats the key {exc.key!r} in one object: which value to use "
                              "would be a guess, so send each field once") from None
    except RecursionError:
        raise invalid_request(f"The request body is nested more than {MAX_JSON_DEPTH} levels deep",
                              deep_field(text)) from None
    except json.JSONDecodeError as exc:
        raise invalid_request(f"Malformed JSON body: {exc}") from None
    except ValueError:
        # The one other ValueError of json.loads: an integer literal longer than Python's digit
        # limit (its own message tells the reader to call sys.set_int_max_str_digits()).
        field = long_integer_field(text)
        raise invalid_request(too_long_integer_message(field), field) from None
    if not isinstance(data, dict):
        raise invalid_request(f"The request body must be a JSON object, got {json_type_name(data)}")
    check_json_structure(data, check_strings=_SURROGATE_ESCAPE.search(text) is not None)
    try:
        body = model_cls.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_error(exc.errors(include_url=False), data,
                                                   getattr(model_cls, "REFUSED_FIELD_REASONS", None))
        raise invalid_request(message, param) from None
    check_consistency = getattr(body, "check_consistency", None)
    if check_consistency is not None:
        check_consistency()
    return body


async def parse_body_off_loop(raw: bytes, model_cls: type[ModelT]) -> ModelT:
    """:func:`parse_body`, on a worker thread when ``raw`` is larger than :data:`OFF_LOOP_BODY_BYTES`.

    An 8 MiB body of token ids took seconds to parse; on the event loop that froze every other
    client (streams, ``/v1/models``) meanwhile. The worker still shares the GIL, but the loop gets
    it back at least every switch interval while pure-Python checks run.
    """
    if len(raw) <= OFF_LOOP_BODY_BYTES:
        return parse_body(raw, model_cls)
    # Cancelling the await (the client left) cancels the job if it has not started yet.
    return await asyncio.wrap_future(_PARSERS.submit(lambda: parse_body(raw, model_cls)))
