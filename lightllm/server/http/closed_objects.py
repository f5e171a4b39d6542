"""JSON schemas read the way vLLM's default backend and OpenAI's strict mode read them: an object
that lists its properties takes no others unless it says so.

JSON Schema itself allows any undeclared key when ``additionalProperties`` is absent, and so did
the grammar compiled from it: a weak model writing a forced tool call or a ``json_schema`` answer
could go on adding junk keys until ``max_tokens``, and the call was then lost (langchain's
``with_structured_output``, instructor and litellm send pydantic's schemas, which leave the key
out).  vLLM's default xgrammar backend compiles schemas in strict mode, where an absent
``additionalProperties`` means false; OpenAI's strict mode requires it false.  A schema that
gives ``additionalProperties`` (true or a schema), ``patternProperties`` or
``unevaluatedProperties`` keeps its own rule; an object without ``properties`` (``{"type":
"object"}``, json_object mode) stays open, and so do the branches of an ``allOf``, which declare
one object's keys between them.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Optional

# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
               "unevaluatedItems", "unevaluatedProperties", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPENING_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema listing ``properties`` and saying nothing
    of other keys has ``additionalProperties: false``.  Only schema positions are visited
    (``const``, ``enum``, ``default`` and ``examples`` hold data and are left as they are)."""
    copied = copy.deepcopy(schema)
    _close(copied)
    return copied


def _close(node: Any, closable: bool = True) -> None:
    if not isinstance(node, dict):
        return
    if closable and isinstance(node.get("properties"), dict) and not any(key in node for key in _OPENING_KEYWORDS):
        node["additionalProperties"] = False
    if isinstance(node.get("allOf"), list):
        # The branches of allOf describe one object together: each closed on its own keys would
        # refuse the keys the others declare, so only what lies inside them is closed.
        for item in node["allOf"]:
            _close(item, closable=False)
    for key in _ONE_SCHEMA:
        if isinstance(node.get(key), dict):
            _close(node[key])
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for item in node[key]:
                _close(item)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for item in node[key].values():
                _close(item)


def _subschemas(node: dict) -> Iterator[Any]:
    """The schemas directly inside ``node`` (data keywords are not schemas)."""
    for key in _ONE_SCHEMA:
        if isinstance(node.get(key), dict):
            yield node[key]
    for key in _SCHEMA_LISTS + ("allOf",):
        if isinstance(node.get(key), list):
            yield from node[key]
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from node[key].values()


def unkept_min_properties(schema: Any) -> Optional[str]:
    """Why a ``minProperties`` of ``schema`` (closed as :func:`closed_objects` closes it) cannot be
    kept, or None.

    A grammar cannot keep the keys of an object distinct where they are not named: one that takes
    other keys (``additionalProperties``, ``patternProperties``, no ``properties`` at all) may write
    the same key twice, and a JSON parser keeps one of them, so ``{"a": 1, "a": 2}`` met
    ``minProperties: 2`` in the grammar and has one property once parsed. Only the required named
    keys are sure to be distinct.
    """
    if not isinstance(schema, dict):
        return None
    least = schema.get("minProperties")
    open_keys = "properties" not in schema or any(schema.get(key, False) is not False for key in _OPENING_KEYWORDS)
    if isinstance(least, int) and not isinstance(least, bool) and open_keys:
        named = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = {key for key in schema.get("required") or () if key in named}
        if least > len(required):
            return (f"minProperties {least} on an object that takes keys it does not name cannot be guaranteed: "
                    f"generated keys may repeat, and a JSON parser keeps one of each (only its {len(required)} "
                    f"required named properties are sure to be distinct); require named properties instead")
    for inner in _subschemas(schema):
        reason = unkept_min_properties(inner)
        if reason is not None:
            return reason
    return None
