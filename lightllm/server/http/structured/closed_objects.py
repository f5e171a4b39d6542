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
from typing import Any, Optional

from lightllm.server.http.structured.schema_positions import local_reference_target, schemas_with_places, subschemas

_OPENING_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema listing ``properties`` and saying nothing
    of other keys has ``additionalProperties: false``.  Only schema positions are visited
    (``const``, ``enum``, ``default`` and ``examples`` hold data and are left as they are)."""
    copied = copy.deepcopy(schema)
    _close(copied)
    # Schemas a local $ref reaches where no keyword holds them (OpenAPI's #/components/schemas/P)
    # are closed too, as those under $defs are.
    for _place, node in schemas_with_places(copied):
        target = local_reference_target(copied, node.get("$ref"))
        if isinstance(target, dict) and target is not copied:
            _close(target)
    return copied


def _close(node: Any, closable: bool = True) -> None:
    if not isinstance(node, dict):
        return
    if closable and isinstance(node.get("properties"), dict) and not any(key in node for key in _OPENING_KEYWORDS):
        node["additionalProperties"] = False
    # The branches of allOf describe one object together: each closed on its own keys would
    # refuse the keys the others declare, so only what lies inside them is closed.
    branches = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    for inner in subschemas(node):
        _close(inner, closable=not any(inner is branch for branch in branches))


def unkept_min_properties(schema: Any, open_by_default: bool = False) -> Optional[str]:
    """Why a ``minProperties`` of ``schema`` (closed as :func:`closed_objects` closes it) cannot be
    kept, or None.  ``open_by_default``: ``schema`` is read by JSON Schema's own rule, where an
    object without ``additionalProperties`` takes other keys (a Lark grammar's ``%json`` blocks,
    which are not closed).

    A grammar cannot keep the keys of an object distinct where they are not named: one that takes
    other keys (``additionalProperties``, ``patternProperties``, no ``properties`` at all) may write
    the same key twice, and a JSON parser keeps one of them, so ``{"a": 1, "a": 2}`` met
    ``minProperties: 2`` in the grammar and has one property once parsed. Only the required named
    keys are sure to be distinct, and one key (a non-empty object parses to at least one).
    """
    if not isinstance(schema, dict):
        return None
    least = schema.get("minProperties")
    open_keys = ("properties" not in schema or any(schema.get(key, False) is not False for key in _OPENING_KEYWORDS)
                 or (open_by_default and not any(key in schema for key in _OPENING_KEYWORDS)))
    if isinstance(least, int) and not isinstance(least, bool) and open_keys:
        named = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = {key for key in schema.get("required") or () if key in named}
        # Any generated pair is one key once parsed, so a minimum of one always holds.
        if least > max(len(required), 1):
            return (f"minProperties {least} on an object that takes keys it does not name cannot be guaranteed: "
                    f"generated keys may repeat, and a JSON parser keeps one of each (only its {len(required)} "
                    f"required named properties, or one key, are sure to be distinct); require named properties "
                    f"instead")
    for inner in subschemas(schema):
        reason = unkept_min_properties(inner, open_by_default)
        if reason is not None:
            return reason
    return None
