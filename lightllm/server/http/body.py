"""Decoding a request body: JSON, structural checks, then the endpoint's pydantic model.

Before any field is validated the decoded body must be a JSON object nested at most
:data:`MAX_JSON_DEPTH` levels, every number in it must be finite (Python's JSON reader accepts
``NaN``, ``Infinity`` and overflowing literals such as ``1e999``, which standard JSON has no
place for), and no string in it (key or value) may hold a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but not valid Unicode; tokenizers and UTF-8 encoders
fail on it).  Every failure is a 400 :class:`~lightllm.server.http.errors.APIError` naming the
dotted field path (``messages.0.content``).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, TypeVar

from pydantic import BaseModel, ValidationError

from lightllm.server.http.errors import invalid_request

# Real requests nest about five levels (messages -> content parts -> text); the limit leaves
# room for clients that wrap values in extra objects while bounding the work per body.
MAX_JSON_DEPTH = 32

ModelT = TypeVar("ModelT", bound=BaseModel)


def _describe_validation_error(error: Mapping[str, Any]) -> tuple[str, str | None]:
    param = ".".join(str(part) for part in error.get("loc", ())) or None
    kind = error.get("type")
    if kind == "extra_forbidden":
        return f"Unknown parameter '{param}'; it is not accepted by this endpoint", param
    if kind == "missing":
        return f"Missing required parameter '{param}'", param
    message = str(error.get("msg", "invalid value"))
    if kind == "value_error" and isinstance(error.get("ctx", {}).get("error"), ValueError):
        message = str(error["ctx"]["error"])
    if param is not None:
        message = f"Invalid value for '{param}': {message}"
    return message, param


def _has_lone_surrogate(text: str) -> bool:
    # JSON's \uD800-style escapes can produce code points that are not valid Unicode text;
    # tokenizers and UTF-8 encoders fail on them.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json_structure(data: Any) -> None:
    """Reject bodies nested deeper than :data:`MAX_JSON_DEPTH` or holding non-finite numbers or lone surrogates.

    Walks iteratively, so a hostile body cannot exhaust the interpreter's stack here.  The
    400 names the dotted path of the offending value (or of the object holding a bad key).
    """
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise invalid_request(f"The request body is nested more than {MAX_JSON_DEPTH} levels deep",
                                  path[0] if path else None)
        if isinstance(value, str):
            if _has_lone_surrogate(value):
                param = ".".join(path) or None
                raise invalid_request(f"Invalid value for '{param}': the string contains a lone UTF-16 surrogate "
                                      "(not valid Unicode)", param)
        elif isinstance(value, float) and not math.isfinite(value):
            param = ".".join(path) or None
            raise invalid_request(f"Invalid value for '{param}': must be finite, got {value!r}", param)
        elif isinstance(value, dict):
            for key, item in value.items():
                if _has_lone_surrogate(key):
                    param = ".".join(path) or None
                    where = f"an object key in '{param}'" if param else "an object key"
                    raise invalid_request(f"{where} contains a lone UTF-16 surrogate (not valid Unicode)", param)
                stack.append((item, path + (key,)))
        elif isinstance(value, list):
            stack.extend((item, path + (str(index),)) for index, item in enumerate(value))


def parse_body(raw: bytes, model_cls: type[ModelT]) -> ModelT:
    """Decode a JSON body and validate it into ``model_cls``, raising 400 on any problem."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise invalid_request(f"The request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:
        # JSONDecodeError and UnicodeDecodeError are ValueErrors, and so is an integer
        # literal longer than Python's digit limit.
        raise invalid_request(f"Malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise invalid_request(f"The request body must be a JSON object, got {type(data).__name__}")
    check_json_structure(data)
    try:
        body = model_cls.model_validate(data)
    except ValidationError as exc:
        message, param = _describe_validation_error(exc.errors(include_url=False)[0])
        raise invalid_request(message, param) from None
    check_consistency = getattr(body, "check_consistency", None)
    if check_consistency is not None:
        check_consistency()
    return body
