"""The JSON schemas inside a Lark grammar (``%json {...}`` blocks), checked as a JSON schema is checked.

A grammar in llguidance's Lark syntax (``guided_grammar``, ``structured_outputs.grammar``,
``/generate``'s ``parameters.guided_grammar``) may embed JSON schemas: ``start: %json {"type":
"integer"}``.  llguidance compiles each as it compiles ``guided_json``, but the blocks were only
scanned as text for numbers that crashed the compiler: ``%json {"type": "integer", "multipleOf":
999983}`` was accepted and cost about 10 s of compiling in the HTTP process and again in the
model rank, while the same schema as ``guided_json`` is refused at once.

Each block now gets the checks of a schema's content: the numbers the compiler would change
(:func:`~lightllm.server.http.structured.response_format.inexact_number`), the ``multipleOf`` cost (summed
over every block: one grammar builds them all), the number ranges it would not keep, the
``minProperties`` it cannot keep, and the JSON rules of a schema sent as a string (no key
repeated, the body's depth, finite numbers, valid Unicode).  Two things the server does to a
JSON schema are not done to a block, which means what llguidance's Lark syntax says it means:
its objects keep JSON Schema's rule (open unless ``additionalProperties`` says otherwise; the
``minProperties`` check reads them so) and its JSON keeps llguidance's whitespace rule.

llguidance's lexer reads ``%json`` and then one JSON value (after JSON white space), so a block
may hold nested braces and strings with braces in them, and the text after the value is Lark
again.  The grammar is scanned the way that lexer reads it: a ``%json`` inside a Lark string
(``"..."``, its ``i`` flag), a regex (``/.../`` and its flags), a comment (``//`` or ``#`` to the end of
the line), a token reference (``<|im_end|>``) or a block's own JSON is text, not a block, and is not
checked (``start: "%json NaN"`` was refused for a NaN llguidance never reads).  Where the scan and
the lexer could part (a string holding a tab, a reference holding white space), the lexer stops
with an error, so the grammar is refused either way.  Where no JSON value follows ``%json``, the
text is not a block, or it is one llguidance refuses itself.

A block's refusal begins as every refusal of the grammar does (``invalid grammar (llguidance Lark
syntax expected): the %json block at line 1, column 8: ...``), and its schema's top-level
``x-guidance`` options are held to the rule of :mod:`lightllm.server.http.structured.guidance_options` (white
space allowed: a block keeps llguidance's whitespace rule).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from lightllm.server.http.structured.closed_objects import unkept_min_properties
from lightllm.server.http.structured.guidance_options import guidance_options_problem
from lightllm.server.http.validation.json_text import parse_json_at
from lightllm.server.http.structured.number_bounds import unkept_number_range
from lightllm.server.http.structured.response_format import inexact_number_problem
from lightllm.server.http.structured.schema_cost import costly_multiple_of_all

# What the grammar's error messages call a Lark grammar (the start of every refusal of one).
LARK_GRAMMAR = "grammar (llguidance Lark syntax expected)"

# The keyword, and the lexemes of llguidance's Lark inside which "%json" is text (a string on one
# line with backslash escapes; a comment; a regex, which may span lines; a token reference).  Each
# alternative stops at its own closing character, a newline or a "<".  A quote or slash that opens
# no string or regex is the lexer's error (it lexes the whole text before compiling any block), so
# the scan stops there: retrying from each such opener was quadratic (a 16 KiB grammar of '/\'
# took seconds).  llguidance reads "%json" even as the start of a longer word ("%jsonx {...}"
# fails as bad JSON).
_LEXEME = re.compile(r'%json|"(?:\\.|[^"\\\n])*"|//[^\n]*|#[^\n]*|/(?:\\.|[^/\\])+/|<[^<>\n]*>|["/]')

# A grammar whose text begins with "{" (after JSON white space) is llguidance's JSON grammar format
# (TopLevelGrammar): its "json_schema" entries would reach the compiler unchecked, and vLLM takes
# Lark or GBNF there, not this format.
JSON_FORMAT_REFUSAL = ("text beginning with '{' is read by llguidance as its JSON grammar format, which is not "
                       "accepted here (its JSON schemas would skip the checks a schema gets): write the grammar in "
                       "Lark, with a JSON schema as a %json block")


def _guidance_problem(schema: Any) -> Optional[str]:
    """Why the block's ``x-guidance`` options are refused (white space allowed), or None."""
    problem = guidance_options_problem(schema)
    return None if problem is None else problem[1]


_CHECKS = (_guidance_problem, inexact_number_problem, unkept_number_range,
           lambda schema: unkept_min_properties(schema, open_by_default=True))


def json_blocks(grammar: str, param: str) -> list[tuple[str, Any]]:
    """Every ``%json`` block of ``grammar``: where it stands ("the %json block at line 2, column 4")
    and its schema; a block breaking the JSON rules is a 400 naming ``param``."""
    blocks: list[tuple[str, Any]] = []
    line, counted, position = 1, 0, 0
    while True:
        match = _LEXEME.search(grammar, position)
        if match is None:
            return blocks
        position = match.end()
        if match.group() in ('"', "/"):
            return blocks  # an opener that never closes: llguidance refuses the grammar before any block
        if match.group() != "%json":
            continue  # a string, regex, comment or reference: "%json" there is text
        # Lines counted from the previous block on: each character is looked at once.
        line += grammar.count("\n", counted, match.start())
        line_start = grammar.rfind("\n", 0, match.start()) + 1
        counted = match.start()
        label = f"the %json block at line {line}, column {match.start() - line_start + 1}"
        read = parse_json_at(grammar, match.end(), param, f"invalid {LARK_GRAMMAR}: {label}: ")
        if read is not None:
            blocks.append((label, read[0]))
            position = read[1]  # the block's JSON is not Lark: its strings may hold "%json"


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
