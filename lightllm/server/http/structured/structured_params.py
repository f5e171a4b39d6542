"""vLLM's structured-output request parameters, turned into the same llguidance grammar as ``response_format``.

vLLM accepts ``structured_outputs: {json | regex | choice | grammar | json_object}`` and, in
older releases, the flat ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``.  Each becomes a grammar the model rank applies as a token mask
(:mod:`lightllm.server.http.structured.response_format` does the same for OpenAI's ``response_format``):

* ``json``: a JSON schema (an object, or a string holding one, read under the body's rules by
  :func:`~lightllm.server.http.validation.json_text.parse_json_text`), compact JSON output;
* ``json_object``: ``true`` for any JSON object;
* ``regex``: the output matches the regular expression (llguidance's regex syntax: Rust ``regex``
  without look-around or back-references); ``""`` matches the empty text only;
* ``choice``: the output is exactly one of the strings;
* ``grammar``: a context-free grammar in llguidance's Lark syntax (vLLM's xgrammar backend takes
  GBNF instead; a GBNF grammar is refused as invalid Lark); its ``%json`` blocks get a schema's
  checks (:mod:`lightllm.server.http.structured.lark_json`).

LightLLM's native ``/generate`` parameters ``regular_constraint``, ``guided_grammar`` and
``guided_json`` map onto ``regex``, ``grammar`` and ``json`` (:func:`native_constraint_grammar`).

A request may constrain its output one way only: two constraints (``guided_regex`` with
``response_format``, say) are refused.  vLLM's options beside the constraint
(``disable_any_whitespace`` ...) are accepted at their defaults and where the server already does
what they ask (:mod:`lightllm.server.http.structured.structured_options`).
"""

from __future__ import annotations

import json
from typing import Any

from lightllm.server.http.errors import invalid_request
from lightllm.server.http.validation.json_text import parse_json_text
from lightllm.server.http.structured.lark_json import LARK_GRAMMAR, lark_grammar_problem
from lightllm.server.http.structured.response_format import (STRUCTURAL_TAG_REFUSAL, check_grammar_size,
                                                             compile_json_schema, crashing_number, validated_grammar)
from lightllm.server.http.structured.structured_options import (OPTION_SCHEMAS, STRUCTURED_OPTIONS,
                                                                check_structured_options)

MAX_CHOICES = 256
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_JSON_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "object"}, {"type": "string", "minLength": 1}]}
_KIND_SCHEMAS: dict[str, Any] = {
    "json": GUIDED_JSON_SCHEMA,
    "regex": {"type": "string"},
    "choice": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_CHOICES},
    "grammar": {"type": "string", "minLength": 1},
    "json_object": {"const": True},
}
# null on any key is absent (structural_tag, refused when set, may only be null); exactly one kind is
# given, or the field is null itself (the null branch: the others need an object).  vLLM's options
# take the values the server accepts whatever the kind.
STRUCTURED_OUTPUTS_SCHEMA: dict[str, Any] = {
    "properties": {**{kind: {"anyOf": [schema, {"type": "null"}]} for kind, schema in _KIND_SCHEMAS.items()},
                   "structural_tag": {"type": "null"}, **OPTION_SCHEMAS},
    "additionalProperties": False,
    "oneOf": [{"type": "null"}, *({"type": "object", "required": [kind],
                                   "properties": {kind: {"not": {"type": "null"}}}} for kind in STRUCTURED_KINDS)],
}


def _json_schema(value: Any, param: str) -> str:
    if isinstance(value, str):
        value = parse_json_text(value, param)
    return compile_json_schema(value, param)


def _regex(value: Any, param: str) -> str:
    import llguidance

    # "" is a regular expression too: it matches the empty text only, so the output ends at once
    # (vLLM 0.32 answers it so); a grammar that matches nothing at all is refused below.
    if not isinstance(value, str):
        raise invalid_request("the regular expression must be a string", param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    except Exception as exc:  # noqa: BLE001
        raise invalid_request(f"invalid regular expression: {exc}", param) from None
    return validated_grammar(grammar, param, "regular expression")


def _choice(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise invalid_request("choice must be a non-empty list of strings", param)
    if len(value) > MAX_CHOICES:
        raise invalid_request(f"choice holds at most {MAX_CHOICES} strings, got {len(value)}", param)
    if any(not item for item in value):
        raise invalid_request("choice must not contain empty strings", param)
    # Lark string literals take JSON's escapes, so json.dumps quotes any text exactly.
    alternatives = " | ".join(json.dumps(item) for item in dict.fromkeys(value))
    return validated_grammar(f"start: {alternatives}\n", param, "choice")


def _grammar(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise invalid_request("grammar must be a non-empty string (llguidance Lark syntax)", param)
    what = LARK_GRAMMAR
    crashing = crashing_number(value)
    if crashing is not None:
        raise invalid_request(f"invalid {what}: it holds the number {crashing}, below what the grammar compiler "
                              "is given (-2^62)", param)
    # Sized first: the %json blocks are read from text the record can hold, no more.
    check_grammar_size(value, param, what)
    problem = lark_grammar_problem(value, param)
    if problem is not None:
        raise invalid_request(f"invalid {what}: {problem}", param)
    return validated_grammar(value, param, what)


def _json_object(value: Any, param: str) -> str:
    if value is not True:
        raise invalid_request("json_object must be true", param)
    return compile_json_schema({"type": "object"}, param)


_COMPILERS = {"json": _json_schema, "regex": _regex, "choice": _choice, "grammar": _grammar,
              "json_object": _json_object}


# LightLLM's native /generate constraint parameters -> the kind they ask for.
NATIVE_CONSTRAINTS = {"regular_constraint": "regex", "guided_grammar": "grammar", "guided_json": "json"}


def native_constraint_grammar(constraints: dict[str, Any]) -> str | None:
    """The grammar LightLLM's native ``parameters`` ask for (``regular_constraint``, ``guided_grammar``,
    ``guided_json``; None: absent), or None; one constraint at most, as on the OpenAI endpoints."""
    asked = [(f"parameters.{name}", NATIVE_CONSTRAINTS[name], value)
             for name, value in constraints.items() if value is not None]
    return _compile_one(asked)


def _refuse_a_second(asked: list[tuple[str, str, Any]]) -> None:
    """A request constrains its output one way at most: name every constraint it gave."""
    if len(asked) > 1:
        names = ", ".join(param for param, _, _ in asked)
        raise invalid_request(f"the output can be constrained one way only; got {names}", asked[1][0])


def _compile_one(asked: list[tuple[str, str, Any]]) -> str | None:
    """The grammar of the one constraint in ``asked`` ((param, kind, value)), None for none."""
    _refuse_a_second(asked)
    if not asked:
        return None
    param, kind, value = asked[0]
    return _COMPILERS[kind](value, param)


def structured_grammar(structured_outputs: dict[str, Any] | None, guided: dict[str, Any],
                       response_format_grammar: str | None = None) -> str | None:
    """The grammar the request's structured-output parameters ask for, or None.

    ``guided`` maps the legacy field names (``guided_json`` ...) to their values (None: absent);
    ``response_format_grammar`` is what ``response_format`` already asked for (chat only).
    """
    asked: list[tuple[str, str, Any]] = []  # (param, kind, value)
    if structured_outputs is not None:
        if structured_outputs.get("structural_tag") is not None:
            raise invalid_request(STRUCTURAL_TAG_REFUSAL, "structured_outputs.structural_tag")
        # structural_tag is a known key (refused above when set): null there is absent, as on every field.
        unknown = sorted(set(structured_outputs) - set(STRUCTURED_KINDS) - {"structural_tag", *STRUCTURED_OPTIONS})
        if unknown:
            raise invalid_request(f"unknown key(s) in structured_outputs: {', '.join(unknown)}; expected one of "
                                  f"{', '.join(STRUCTURED_KINDS)}", "structured_outputs")
        given = {kind: value for kind, value in structured_outputs.items()
                 if kind in STRUCTURED_KINDS and value is not None}
        asked.extend((f"structured_outputs.{kind}", kind, value) for kind, value in given.items())
        if not given:
            raise invalid_request(f"structured_outputs needs one of {', '.join(STRUCTURED_KINDS)}", "structured_outputs")
        # Checked before compiling: a refused option costs no grammar build.
        check_structured_options(structured_outputs, next(iter(given)) if len(given) == 1 else None)
    for name, value in guided.items():
        if value is not None:
            asked.append((name, name.removeprefix("guided_"), value))
    if response_format_grammar is None:
        return _compile_one(asked)
    asked.append(("response_format", "", None))
    _refuse_a_second(asked)
    return response_format_grammar


def usable_grammar(manager: Any, grammar: str | None, param: str) -> str | None:
    """``grammar``, or a 400 naming ``param`` when it is set and the manager's model cannot run
    grammars (``manager``: a RequestManager; blocking the first time: call on a tokenizer thread)."""
    if grammar is None:
        return None
    problem = manager.served.structured_output_problem()
    if problem is not None:
        raise invalid_request(f"structured output is not available for this model: the grammar engine "
                              f"(llguidance) cannot read its tokenizer ({problem})", param)
    return grammar
