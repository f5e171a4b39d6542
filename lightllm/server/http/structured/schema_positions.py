"""Where a JSON schema holds other schemas, so that walks over a schema visit schemas only.

A schema's ``const``, ``enum``, ``default`` and ``examples`` hold JSON data, and the keys of its
``properties`` are property names: a property called ``default`` or ``$ref`` is not a keyword.
Walks that close objects (:mod:`lightllm.server.http.structured.closed_objects`) and the checks of what the
grammar compiler keeps go through :func:`subschemas` and :func:`schemas_with_places` so that they
follow the same positions.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

# Keywords whose value is one subschema, a list of them, or a map of names to them.
ONE_SCHEMA_KEYWORDS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
                       "unevaluatedItems", "unevaluatedProperties", "propertyNames")
SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keywords whose value is JSON data: what a value must be, and annotations the compiler ignores.
DATA_KEYWORDS = ("const", "enum")
ANNOTATION_KEYWORDS = ("default", "examples")


def subschemas(node: Dict[str, Any]) -> Iterator[Any]:
    """The schemas directly inside the schema ``node``."""
    for _place, inner in named_subschemas(node):
        yield inner


def named_subschemas(node: Dict[str, Any]) -> Iterator[Tuple[str, Any]]:
    """The schemas directly inside the schema ``node``, each with its place (``properties.x``, ``anyOf.0``)."""
    for key in ONE_SCHEMA_KEYWORDS:
        if isinstance(node.get(key), dict):
            yield key, node[key]
    for key in SCHEMA_LIST_KEYWORDS:
        if isinstance(node.get(key), list):
            for index, inner in enumerate(node[key]):
                yield f"{key}.{index}", inner
    for key in SCHEMA_MAP_KEYWORDS:
        if isinstance(node.get(key), dict):
            for name, inner in node[key].items():
                yield f"{key}.{name}", inner


def schemas_with_places(schema: Any) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """Every schema in ``schema`` (itself first), each with its place (``""`` for ``schema`` itself).

    A local ``$ref`` to a place no keyword holds (OpenAPI's ``#/components/schemas/P``) is followed
    too, so that every schema the grammar compiler reaches is seen; each schema is given once.
    """
    seen: set = set()
    stack: list = [("", schema)]
    while stack:
        here, current = stack.pop()
        if not isinstance(current, dict) or id(current) in seen:
            continue
        seen.add(id(current))
        yield here, current
        inner = [(f"{here}.{key}" if here else key, item) for key, item in named_subschemas(current)]
        target = local_reference_target(schema, current.get("$ref"))
        if isinstance(target, dict):
            inner.append((current["$ref"][2:].replace("/", "."), target))
        stack.extend(reversed(inner))


def local_reference_target(schema: Any, reference: Any) -> Any:
    """What the JSON pointer ``reference`` (``#``, ``#/$defs/x``) points to in ``schema``; None when it is
    not such a pointer or points nowhere."""
    if not isinstance(reference, str) or not (reference == "#" or reference.startswith("#/")):
        return None
    target = schema
    for token in reference[2:].split("/") if reference != "#" else []:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and token in target:
            target = target[token]
        elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
            target = target[int(token)]
        else:
            return None
    return target
