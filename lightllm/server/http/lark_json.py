"""The JSON schemas inside a Lark grammar (``%json {...}`` blocks), checked as a JSON schema is checked.

A grammar in llguidance's Lark syntax (``guided_grammar``, ``structured_outputs.grammar``,
``/generate``'s ``parameters.guided_grammar``) may embed JSON schemas: ``start: %json {"type":
"integer"}``.  llguidance compiles each as it compiles ``guided_json``, but the blocks were only
scanned as text for numbers that crashed the compiler: ``%json {"type": "integer", "multipleOf":
999983}`` was accepted and cost about 10 s of compiling in the HTTP process and again in the
model rank, while the same schema as ``guided_json`` is refused at once.

Each block now gets the checks of a schema's content: the numbers the compiler would change
(:func:`~lightllm.server.http.response_format.inexact_number`), the ``multipleOf`` cost (summed
over every block: one grammar builds them all), the number ranges it would not keep, the
``minProperties`` it cannot keep, and the JSON rules of a schema sent as a string (no key
repeated, the body's depth, finite numbers, valid Unicode).  Two things the server does to a
JSON schema are not done to a block, which means what llguidance's Lark syntax says it means:
its objects keep JSON Schema's rule (open unless ``additionalProperties`` says otherwise; the
``minProperties`` check reads them so) and its JSON keeps llguidance's whitespace rule.

llguidance's lexer reads ``%json`` and then one JSON value (after JSON white space), so a block
may hold nested braces and strings with braces in them, and the text after the value is Lark
again.  Every ``%json`` in the text is tried, wherever it stands: one inside a Lark string, regex
or comment is checked too when a JSON value follows it (text there seldom reads as JSON; a
commented-out schema refused costs an edit, a block this check missed costs seconds per compile).
Where no JSON value follows, the text is not a block, or it is one llguidance refuses itself.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from lightllm.server.http.closed_objects import unkept_min_properties
from lightllm.server.http.json_text import parse_json_at
from lightllm.server.http.number_bounds import unkept_number_range
from lightllm.server.http.response_format import inexact_number_problem
from lightllm.server.http.schema_cost import costly_multiple_of_all

# llguidance reads "%json" even as the start of a longer word ("%jsonx {...}" fails as bad JSON).
_JSON_KEYWORD = re.compile(r"%json")

# A grammar whose text begins with "{" (after JSON white space) is llguidance's JSON grammar format
# (TopLevelGrammar): its "json_schema" entries would reach the compiler unchecked, and vLLM takes
# Lark or GBNF there, not this format.
JSON_FORMAT_REFUSAL = ("text beginning with '{' is read by llguidance as its JSON grammar format, which is not "
                       "accepted here (its JSON schemas would skip the checks a schema gets): write the grammar in "
                       "Lark, with a JSON schema as a %json block")

_CHECKS = (inexact_number_problem, unkept_number_range,
           lambda schema: unkept_min_properties(schema, open_by_default=True))


def json_blocks(grammar: str, param: str) -> list[tuple[str, Any]]:
    """Every ``%json`` block of ``grammar``: where it stands ("the %json block at line 2, column 4")
    and its schema; a block breaking the JSON rules is a 400 naming ``param``."""
    blocks: list[tuple[str, Any]] = []
    line, counted = 1, 0
    for match in _JSON_KEYWORD.finditer(grammar):
        # Lines counted from the previous block on: each character is looked at once.
        line += grammar.count("\n", counted, match.start())
        line_start = grammar.rfind("\n", 0, match.start()) + 1
        counted = match.start()
        label = f"the %json block at line {line}, column {match.start() - line_start + 1}"
        read = parse_json_at(grammar, match.end(), param, f"{label}: ")
        if read is not None:
            blocks.append((label, read[0]))
    return blocks


def lark_grammar_problem(grammar: str, param: str) -> Optional[str]:
    """Why the Lark ``grammar`` is refused before it is compiled, or None: written in llguidance's
    JSON grammar format, or a ``%json`` block a schema would be refused for (the JSON rules' breaches
    are a 400 naming ``param`` at once)."""
    if grammar.lstrip().startswith("{"):
        return JSON_FORMAT_REFUSAL
    blocks = json_blocks(grammar, param)
    for label, schema in blocks:
        for check in _CHECKS:
            problem = check(schema)
            if problem is not None:
                return f"{label}: {problem}"
    return costly_multiple_of_all(blocks, "the grammar's")
