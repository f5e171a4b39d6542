"""What a pydantic validation error tells the client: a message, and the field as the client wrote it.

pydantic's error locations mix the request's own keys and indices with the names of the union
alternatives it tried (``prediction.content.str`` for a ``str | list`` field given a number), and
it reports one error per alternative.  A client can only act on paths through its own body, so
the path keeps the parts found in the body (plus a missing field's name), and of several errors
the one that reaches deepest into the body is reported: the alternative the client evidently meant.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

# What a value of the wrong JSON type should have been, by pydantic error type.
_EXPECTED_TYPES = {
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
}
# Error types whose last location part names a field the body lacks or should not have.
_NAMED_FIELD_TYPES = ("missing", "extra_forbidden")


def describe_validation_error(errors: Sequence[Mapping[str, Any]], data: Any = None) -> tuple[str, Optional[str]]:
    """Message and ``param`` for pydantic's ``errors`` of validating ``data`` (the decoded body).

    Without ``data`` every location part is taken as written (a body-less check).
    """
    if not errors:
        return "invalid request", None
    located = [(_client_path(error, data), error) for error in errors]
    deepest = max(len(path) for path, _ in located)
    path, error = next((path, error) for path, error in located if len(path) == deepest)
    same_place = [other for other_path, other in located if other_path == path]
    param = ".".join(path) or None
    kind = error.get("type")
    if kind == "extra_forbidden":
        return f"Unknown parameter '{param}'; it is not accepted by this endpoint", param
    if kind == "missing":
        return f"Missing required parameter '{param}'", param
    expected = [_EXPECTED_TYPES.get(str(other.get("type"))) for other in same_place]
    if len(same_place) > 1 and all(expected):
        # One sentence for every alternative the field allows.
        message = "Input should be " + " or ".join(dict.fromkeys(expected))  # type: ignore[arg-type]
    elif kind in ("model_type", "model_attributes_type"):
        # pydantic's own sentence names the model's Python class, which means nothing to a client.
        message = "Input should be an object"
    else:
        message = str(error.get("msg", "invalid value"))
        if kind == "value_error" and isinstance(error.get("ctx", {}).get("error"), ValueError):
            message = str(error["ctx"]["error"])
    if param is not None:
        message = f"Invalid value for '{param}': {message}"
    return message, param


def _client_path(error: Mapping[str, Any], data: Any) -> tuple[str, ...]:
    """The parts of ``error``'s location that lead through ``data``, and a missing field's name."""
    loc = tuple(error.get("loc", ()))
    if data is None:
        return tuple(str(part) for part in loc)
    path: list[str] = []
    node = data
    for index, part in enumerate(loc):
        if isinstance(node, Mapping) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
            node = node[part]
        elif index == len(loc) - 1 and isinstance(node, Mapping) and error.get("type") in _NAMED_FIELD_TYPES:
            pass
        else:
            # The name of a union alternative pydantic tried: not a place in the body.
            continue
        path.append(str(part))
    return tuple(path)
