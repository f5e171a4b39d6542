"""Which parsed calls a request's client can receive as calls: declared functions, strict arguments kept.

Under ``tool_choice: "auto"`` the model writes calls in free text, so nothing forces a call's
name or arguments.  A call of a function the request did not declare stays content (OpenAI never
names an undeclared tool).  A function declared with ``"strict": true`` promises arguments valid
under its ``parameters`` (OpenAI's strict mode, objects closed as
:mod:`lightllm.server.http.structured.closed_objects` reads them); a block whose arguments break that schema
stays content too, exactly as the model wrote it, rather than reach the client as a call it was
promised would not happen.  Forced calls (``required``, a named function) are held to the schema by
their grammar and need no check here.

The check is JSON Schema validation (draft 2020-12 unless the schema names another, formats
checked), not the forced grammar: that grammar fixes the order of properties, which a model writing
freely need not keep.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterator, Mapping, Optional

from lightllm.server.http.structured.closed_objects import closed_objects
from lightllm.server.http.structured.schema_positions import local_reference_target
from lightllm.server.http.errors import invalid_request
from lightllm.server.http.openai.tool_calls.extraction import ParsedCall

log = logging.getLogger(__name__)


class CallableTools:
    """The functions a request declared, and a validator for each strict one's arguments."""

    def __init__(self, declared: frozenset[str], strict_validators: Optional[Mapping[str, Any]] = None) -> None:
        self.declared = declared
        self._strict = dict(strict_validators or {})

    @classmethod
    def for_tools(cls, tools: list[Any]) -> "CallableTools":
        """From the request's function tools; a 400 names a strict tool whose schema is not a valid JSON schema."""
        validators = {}
        for index, tool in enumerate(tools):
            if tool.strict:
                validators[tool.name] = _validator(tool.parameters_schema, f"tools.{index}.function.parameters")
        return cls(frozenset(tool.name for tool in tools), validators)

    def accepts(self, call: ParsedCall) -> bool:
        """True when ``call`` names a declared function and, for a strict one, its arguments are valid."""
        if call.name not in self.declared:
            return False
        validator = self._strict.get(call.name)
        if validator is None:
            return True
        # The arguments were read as JSON already (parse_call_object), so loading cannot fail.
        try:
            return validator.is_valid(json.loads(call.arguments))
        except Exception:  # noqa: BLE001 - what the validator cannot evaluate is not held against the call
            # A pattern Python's re cannot read (\p{L}, (?<name>...): ECMA-262, which the grammar
            # compiler takes) raises here; the schema compiled, so the call goes out unchecked.
            log.debug("strict arguments of %s not checked: the validator failed", call.name, exc_info=True)
            return True


def _validator(schema: dict[str, Any], param: str) -> Any:
    import jsonschema

    # Only references are checked ahead: the grammar compiler's own limits (its size, numbers
    # beyond 2^53, ranges it cannot keep) bind a grammar that samples, not this validation.
    unresolved = _unresolved_reference(schema)
    if unresolved is not None:
        raise invalid_request(f"{param} holds the reference {unresolved!r}, which points nowhere in the schema "
                              "(references to other documents are not fetched)", param)
    closed = closed_objects(schema)
    kind = jsonschema.validators.validator_for(closed, default=jsonschema.Draft202012Validator)
    kind = jsonschema.validators.extend(kind, {"pattern": _pattern})
    try:
        # No format checks of the schema itself: "regex" would hold patterns to Python's re, which
        # refuses ECMA-262 ones (\p{L}, named groups) that the grammar compiler takes.
        kind.check_schema(closed, format_checker=None)
    except jsonschema.SchemaError as exc:
        raise invalid_request(f"{param} is not a valid JSON schema: {exc.message}", param) from None
    return kind(closed, format_checker=kind.FORMAT_CHECKER)


# The longest one ``pattern`` may take on one string: a pattern such as ^(a+)+$ on a string the
# model wrote takes time doubling with each character (27 characters held the HTTP process 7.5 s).
PATTERN_TIMEOUT_S = 0.05


def _pattern(validator: Any, pattern: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """JSON Schema's ``pattern`` through the ``regex`` module, not Python's ``re``.

    ``regex`` reads what ECMA-262 patterns commonly hold and ``re`` refuses (``\\p{L}``,
    ``(?<name>...)``), and stops a search after :data:`PATTERN_TIMEOUT_S`; ASCII classes, as
    ECMA's ``\\d`` and ``\\w`` (``re``'s ``\\d`` took Arabic-Indic digits).  A pattern it cannot
    read or a search that times out leaves this keyword unchecked, not the whole call.
    """
    import regex
    from jsonschema import ValidationError

    if not isinstance(instance, str) or not isinstance(pattern, str):
        return
    try:
        found = regex.search(pattern, instance, flags=regex.ASCII, timeout=PATTERN_TIMEOUT_S)
    except (regex.error, TimeoutError):
        return
    if found is None:
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _unresolved_reference(schema: Any) -> Optional[str]:
    """The first ``$ref`` in ``schema`` that is not a JSON pointer into it (``#``, ``#/$defs/x``), or None.

    An anchor (``#name``) is left to the validator, which resolves it or leaves the call unchecked.
    """
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            reference = node.get("$ref")
            if isinstance(reference, str) and (not reference.startswith("#") or reference.startswith("#/")):
                if local_reference_target(schema, reference) is None:
                    return reference
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None
