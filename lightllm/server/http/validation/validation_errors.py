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


def describe_validation_error(errors: Sequence[Mapping[str, Any]], data: Any = None,
                              refused_reasons: Optional[Mapping[str, str]] = None) -> tuple[str, Optional[str]]:
    """Message and ``param`` for pydantic's ``errors`` of validating ``data`` (the decoded body).

    Without ``data`` every location part is taken as written (a body-less check).
    ``refused_reasons`` gives, for top-level fields the schema leaves out on purpose, the reason a
    refusal of one states instead of calling it unknown.
    """
    if not errors:
        return "invalid request", None
    located = [(_client_path(error, data), error) for error in errors]
    deepest = max(len(path) for path, _ in located)
    path, error = next((path, error) for path, error in located if len(path) == deepest)
    same_place = [other for other_path, other in located if other_path == path]
    param = ".".join(path) or None
    kind = error.get("type")
    if kind == "extra_forbidden" and refused_reasons and param in refused_reasons:
        return f"'{param}' is not supported: {refused_reasons[param]}", param
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
    """The parts of ``error``'s location that lead through ``data``, and a missing field's name.

    A body key that happens to share an alternative's name (``{"str": ...}``) would lead the walk
    past the value pydantic refused, so the path ends at the deepest value equal to the error's
    ``input`` when there is one.
    """
    loc = tuple(error.get("loc", ()))
    if data is None:
        return tuple(str(part) for part in loc)
    path: list[str] = []
    node = data
    # Lengths of the path at which the node reached is the value pydantic refused.
    at_input: list[int] = [0] if _same(node, error) else []
    for index, part in enumerate(loc):
        if isinstance(node, Mapping) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
            node = node[part]
        elif index == len(loc) - 1 and isinstance(node, Mapping) and error.get("type") in _NAMED_FIELD_TYPES:
            path.append(str(part))
            return tuple(path)
        else:
            # The name of a union alternative pydantic tried: not a place in the body.
            continue
        path.append(str(part))
        if _same(node, error):
            at_input.append(len(path))
    if error.get("type") not in _NAMED_FIELD_TYPES and at_input:
        return tuple(path[:at_input[-1]])
    return tuple(path)


def _same(node: Any, error: Mapping[str, Any]) -> bool:
    """Whether ``node`` is the value ``error`` refused (equal in type and value: ``1 == True`` is not enough)."""
    if "input" not in error:
        return False
    refused = error["input"]
    try:
        return type(node) is type(refused) and bool(node == refused)
    except Exception:  # noqa: BLE001 - an exotic __eq__ only means "not provably the same value"
        return False
