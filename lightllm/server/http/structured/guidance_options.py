"""A JSON schema's own llguidance options (its top-level ``x-guidance`` object), held to what keeps the
output JSON that the schema's checks hold to.

llguidance reads ``x-guidance`` at the root of a schema it compiles (nested copies, in a property,
a ``$defs`` entry or an ``allOf`` branch, are ignored) and lets it override the options the server
compiles with.  Several of them undo what the server promises: ``lenient: true`` drops every
keyword llguidance does not implement (``uniqueItems``, ``not``, ``contains``, ``if``/``then``,
unknown formats ...), which the server otherwise refuses, so
``{"type": "array", "uniqueItems": true, "x-guidance": {"lenient": true}}`` was served with
``[2,0,0,0]``; ``coerce_one_of: true`` reads ``oneOf`` as ``anyOf``; ``whitespace_pattern`` and
separators such as ``";"`` make a JSON constraint write text that is not JSON.

One rule, wherever a schema is read (``guided_json``, ``response_format``'s ``json_schema``,
``structured_outputs.json``, tool parameters, ``/generate``'s ``guided_json``, a Lark grammar's
``%json`` blocks):

* ``whitespace_flexible``: true or false (true lets white space in between tokens, JSON's own);
* ``item_separator`` / ``key_separator``: ``","`` / ``":"`` with JSON white space (space, tab,
  newline, carriage return) around it, if any;
* ``lenient`` and ``coerce_one_of``: false only;
* ``whitespace_pattern``: null only;
* any other key (llguidance's ``json_allowed_escapes`` and ``json_allow_general_unicode_escapes``,
  or one llguidance does not know) is refused.

Where the output must stay compact (``structured_outputs.disable_any_whitespace`` true), or where the
options would not be read (a tool's schema under ``tool_choice: "required"``, compiled inside one
schema whose root alone llguidance reads), ``whitespace_flexible`` must be false and the separators
exactly ``","`` and ``":"``.  Each refusal names the option's path and says why.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from lightllm.server.http.errors import invalid_request

GUIDANCE_KEY = "x-guidance"

# JSON's own white space (RFC 8259): what may stand around a separator and the output stay JSON.
_SEPARATORS = {"item_separator": re.compile(r"[ \t\n\r]*,[ \t\n\r]*"),
               "key_separator": re.compile(r"[ \t\n\r]*:[ \t\n\r]*")}
_COMPACT_SEPARATORS = {"item_separator": ",", "key_separator": ":"}
_ACCEPTED = ("whitespace_flexible", "item_separator", "key_separator", "lenient", "coerce_one_of",
             "whitespace_pattern")
# llguidance 1.9's other JsonCompileOptions: each changes how strings are written, nothing a schema needs.
_LLGUIDANCE_OTHERS = ("json_allowed_escapes", "json_allow_general_unicode_escapes")

_REFUSED_TRUE = {
    "lenient": ("it makes llguidance drop the schema keywords it does not implement (uniqueItems, not, contains, "
                "if/then, dependentRequired, propertyNames, unevaluatedProperties, unknown formats ...), which the "
                "server refuses, so the output would not be held to them"),
    "coerce_one_of": ("it makes llguidance read oneOf as anyOf, so the output could match several branches, which "
                      "oneOf forbids (a oneOf whose branches llguidance cannot tell apart is refused instead)"),
}


def guidance_options_problem(schema: Any, compact_because: Optional[str] = None) -> Optional[tuple[str, str]]:
    """The first ``x-guidance`` option of ``schema`` the server refuses, as (its path under the schema,
    ``"x-guidance.lenient"``; why, beginning with that path), or None.

    ``compact_because``: why the whitespace options may only repeat the server's compact layout (a
    clause that follows "cannot be applied: "); None where they may add JSON's own white space.
    """
    if not isinstance(schema, dict) or schema.get(GUIDANCE_KEY) is None:
        return None
    options = schema[GUIDANCE_KEY]
    if not isinstance(options, dict):
        # llguidance ignores any other value without a word: refused, not dropped.
        return GUIDANCE_KEY, (f"{GUIDANCE_KEY} must be an object (llguidance's JSON options), got "
                              f"{type(options).__name__}")
    for name, value in options.items():
        problem = _option_problem(str(name), value, compact_because)
        if problem is not None:
            return f"{GUIDANCE_KEY}.{name}", f"{GUIDANCE_KEY}.{name} {problem}"
    return None


def check_guidance_options(schema: Any, param: str, what: str = "JSON schema",
                           compact_because: Optional[str] = None) -> None:
    """400 naming ``<param>.x-guidance.<option>`` for the first option of ``schema`` the server refuses
    (:func:`guidance_options_problem`); ``what`` the schema is, for the message."""
    problem = guidance_options_problem(schema, compact_because)
    if problem is not None:
        path, why = problem
        raise invalid_request(f"invalid {what}: {why}", f"{param}.{path}")


def _option_problem(name: str, value: Any, compact_because: Optional[str]) -> Optional[str]:
    """Why the option ``name`` set to ``value`` is refused (the text after its path), or None."""
    if name not in _ACCEPTED:
        kind = "llguidance's option" if name in _LLGUIDANCE_OTHERS else "not one of llguidance's options"
        return (f"is not accepted here ({kind}): the server takes whitespace_flexible, item_separator, key_separator, "
                "lenient (false), coerce_one_of (false) and whitespace_pattern (null) only")
    if name == "whitespace_flexible":
        if not isinstance(value, bool):
            return "must be true or false"
        if value and compact_because is not None:
            return f"true cannot be applied: {compact_because}; send false or omit it"
        return None
    if name in _SEPARATORS:
        return _separator_problem(name, value, compact_because)
    if name in _REFUSED_TRUE:
        if value is True:
            return f"true is refused: {_REFUSED_TRUE[name]}; send false or omit it"
        return None if value is False else "must be false (true is refused) or left out"
    # whitespace_pattern: llguidance writes whatever it matches between tokens (null: its default).
    if value is None:
        return None
    return (f"{_json(value)} is refused: llguidance would write any text the pattern matches between tokens, so the "
            "output need not be JSON; send null or omit it (whitespace_flexible true allows JSON's white space)")


def _json(value: Any) -> str:
    """``value`` as the client wrote it (JSON: ``false``, ``","``), not as Python prints it."""
    try:
        return json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        return repr(value)


def _separator_problem(name: str, value: Any, compact_because: Optional[str]) -> Optional[str]:
    """Why ``value`` is refused as the separator ``name``, or None."""
    if not isinstance(value, str):
        return "must be a string"
    compact = _COMPACT_SEPARATORS[name]
    if compact_because is not None and value != compact:
        return f"{_json(value)} cannot be applied: {compact_because}; send {_json(compact)} or omit it"
    if not _SEPARATORS[name].fullmatch(value):
        return (f"{_json(value)} is refused: the output would not be JSON; JSON's separator is {_json(compact)}, with white "
                "space (space, tab, newline, carriage return) around it if any")
    return None
