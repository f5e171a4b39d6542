"""vLLM's ``structured_outputs`` options: the fields of its ``StructuredOutputsParams`` besides the constraint.

vLLM's request models dump every field that has a default (``model_dump(exclude_none=True)``), so
a request built with them sends ``{"json": ..., "disable_any_whitespace": false,
"disable_additional_properties": false, "_backend_was_auto": false}``, which vLLM takes and which
was refused here as holding unknown keys.  Each option is accepted at vLLM's default (``null``
being absent, as on every field); another value is accepted where the server already does what it
asks, and refused otherwise with a 400 naming the option and saying why:

* ``disable_any_whitespace`` (false): true asks for JSON without any white space, which is what
  ``json`` and ``json_object`` produce here (their grammar is compiled with llguidance's
  ``whitespace_flexible`` off and the default separators: no white space between tokens); refused
  with ``regex``, ``choice`` or ``grammar``, which write the white space they allow (a Lark
  ``%json`` block keeps llguidance's rule, which allows it).  With ``json``, the schema's own
  ``x-guidance`` may then only repeat the compact layout: ``whitespace_flexible`` true or a
  separator with white space is refused naming that option
  (:mod:`lightllm.server.http.structured.guidance_options`).
* ``disable_additional_properties`` (false): true is refused.  The server already closes an object
  schema that lists ``properties`` and says nothing of other keys; vLLM's option (its guidance
  backend) also closes ``patternProperties`` objects and the branches of an ``allOf``, which the
  server leaves as the schema says.
* ``whitespace_pattern`` (null): refused when set; JSON has no free white space here unless the
  schema's ``x-guidance`` sets ``whitespace_flexible``, and no pattern shapes it.
* ``_backend`` (null) and ``_backend_was_auto`` (false): vLLM's record of the backend it picked and
  whether it picked it itself.  vLLM's request model takes both and drops them on input (they are
  ``init=False`` fields of its dataclass; only its own engine sets them), so a value there asks for
  nothing: any string (or null) and any boolean are accepted.  Another type is refused, as the
  fields' types say (vLLM drops a value of any type there, unread).

vLLM 0.32 reads none of these options per request (its backends read the server's
``--structured-outputs-config``), so there a value changes nothing; here a value the server would
not apply is refused rather than dropped.
"""

from __future__ import annotations

from typing import Any, Optional

from lightllm.server.http.errors import invalid_request
from lightllm.server.http.structured.guidance_options import check_guidance_options
from lightllm.server.http.validation.json_text import parse_json_text

# Each option's schema (null: absent), for the OpenAPI document; the values the server accepts.
OPTION_SCHEMAS: dict[str, Any] = {
    "disable_any_whitespace": {"type": ["boolean", "null"]},
    "disable_additional_properties": {"enum": [False, None]},
    "whitespace_pattern": {"type": "null"},
    "_backend": {"type": ["string", "null"]},
    "_backend_was_auto": {"type": ["boolean", "null"]},
}
STRUCTURED_OPTIONS = tuple(OPTION_SCHEMAS)

# The kinds whose JSON the server compiles itself, compact.
_COMPACT_KINDS = ("json", "json_object")


def check_structured_options(structured_outputs: dict[str, Any], kind: Optional[str]) -> None:
    """400 naming ``structured_outputs.<option>`` for an option the server would not apply.

    ``kind`` is the one constraint given (``json``, ``regex`` ...), None where there are several
    (refused on their own).
    """
    given = {name: structured_outputs[name] for name in STRUCTURED_OPTIONS if structured_outputs.get(name) is not None}
    for name in ("disable_any_whitespace", "disable_additional_properties", "_backend_was_auto"):
        if name in given and not isinstance(given[name], bool):
            raise invalid_request(f"structured_outputs.{name} must be true or false", f"structured_outputs.{name}")
    if "whitespace_pattern" in given:
        raise invalid_request("structured_outputs.whitespace_pattern is not supported: JSON from a schema has no "
                              "white space between tokens here unless the schema's x-guidance sets "
                              "whitespace_flexible, which allows JSON's own; no pattern shapes it; send null or omit "
                              "it", "structured_outputs.whitespace_pattern")
    if "_backend" in given and not isinstance(given["_backend"], str):
        raise invalid_request("structured_outputs._backend must be a string", "structured_outputs._backend")
    if given.get("disable_additional_properties"):
        raise invalid_request("structured_outputs.disable_additional_properties true is not applied: objects that "
                              "list properties already take no other keys unless the schema allows them, but the "
                              "option would also close patternProperties objects and allOf branches (as vLLM's "
                              "guidance backend does), which this server leaves as the schema says; send false or "
                              "omit it", "structured_outputs.disable_additional_properties")
    if given.get("disable_any_whitespace") and kind is not None:
        if kind not in _COMPACT_KINDS:
            lark = " (a Lark %json block keeps llguidance's rule, which allows white space)" if kind == "grammar" else ""
            raise invalid_request(f"structured_outputs.disable_any_whitespace true cannot be applied: the {kind} "
                                  f"constraint sets its own white space{lark}; the option applies to json and "
                                  "json_object, whose JSON has none here; send false or omit it",
                                  "structured_outputs.disable_any_whitespace")
        value = structured_outputs[kind]
        schema = parse_json_text(value, f"structured_outputs.{kind}") if isinstance(value, str) else value
        # The schema's own llguidance options override the server's compact ones: they may only repeat them.
        compact = "structured_outputs.disable_any_whitespace true asks for JSON without white space"
        check_guidance_options(schema, f"structured_outputs.{kind}", compact_because=compact)
