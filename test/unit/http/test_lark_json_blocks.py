"""A Lark grammar's ``%json`` blocks get the checks a JSON schema gets, on every field that takes Lark.

``guided_grammar: 'start: %json {"type": "integer", "multipleOf": 999983}'`` was accepted (200 after
26 s: about 10 s of compiling in the HTTP process and again in the model rank, stalling other
clients), while the same schema as ``guided_json``, ``response_format`` or a tool's parameters
was refused at once naming ``multipleOf``: the grammar's text was only scanned for negative numbers.
Then every "%json" in the text was read as a block, one inside a Lark string, regex or comment too
(``start: "%json NaN"`` was refused for a NaN llguidance never reads); the scan now reads the blocks
llguidance's lexer reads, checked against it here.

The app is the real ``create_app`` over ``api_fakes``' scripted manager, and the grammar compiler
is the real llguidance; a refusal must come before the compiler is reached, which the
``compiler_tripwire`` fixture makes fail fast (the old code took seconds to compile these).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager, assert_error, chat, completion
from lightllm.server.http.errors import APIError
from lightllm.server.http.structured.structured_params import structured_grammar

COSTLY = 'start: %json {"type": "integer", "multipleOf": 999983}'


def _native(client: TestClient, grammar: str) -> Any:
    return client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2,
                                                                         "guided_grammar": grammar}})


# Every way a Lark grammar reaches the server, with the field its refusal names.
ROUTES: list[tuple[Callable[[TestClient, str], Any], str]] = [
    (lambda client, grammar: completion(client, guided_grammar=grammar), "guided_grammar"),
    (lambda client, grammar: chat(client, guided_grammar=grammar), "guided_grammar"),
    (lambda client, grammar: completion(client, structured_outputs={"grammar": grammar}), "structured_outputs.grammar"),
    (lambda client, grammar: chat(client, structured_outputs={"grammar": grammar}), "structured_outputs.grammar"),
    (_native, "parameters.guided_grammar"),
]


@pytest.fixture()
def compiler_tripwire(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Grammars that reached llguidance's check; each is refused there at once instead of compiled."""
    import llguidance

    reached: list[str] = []

    def tripwire(grammar: str, *args: Any, **kwargs: Any) -> str:
        reached.append(grammar)
        return "the compiler was reached"

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", staticmethod(tripwire))
    return reached


@pytest.mark.parametrize(("send", "param"), ROUTES)
def test_a_costly_multiple_of_in_a_json_block_is_refused_before_compiling(
        client: TestClient, compiler_tripwire: list[str], send: Callable[[TestClient, str], Any], param: str) -> None:
    error = assert_error(send(client, COSTLY), 400, param)
    assert "multipleOf 999983 in the %json block at line 1, column 8 would take the grammar compiler too long" \
        in error["message"], error
    assert compiler_tripwire == []


@pytest.mark.parametrize(("grammar", "named"), [
    # Nested braces, and strings holding braces and "%json" before the schema's divisor.
    ('start: %json {"properties": {"a": {"type": "string", "pattern": "^[{}]+%json$"}, '
     '"n": {"type": "integer", "multipleOf": 999983}}}', "multipleOf 999983 at 'properties.n' in the %json block"),
    # Blocks spread over lines, after a Lark string that holds braces and one that holds "%json {".
    ('start: "{" a "}" | "%json {" b\na: "x"\nb: %json\n  {"type": "number", "multipleOf": 1234.567}',
     "multipleOf 1234.567 in the %json block at line 3, column 4"),
    # Two blocks each under the bound: one grammar builds both automata, so their digits add up.
    ('start: a | b\na: %json {"type": "integer", "multipleOf": 60001}\n'
     'b: %json {"type": "integer", "multipleOf": 50003}', "the grammar's multipleOf values add up to more than"),
    # A block inside a nested %lark grammar.
    ('start: a\na: %lark {\nstart: %json {"type": "integer", "multipleOf": 16777216}\n}',
     "multipleOf 16777216 in the %json block at line 3, column 8"),
])
def test_every_json_block_is_found(compiler_tripwire: list[str], grammar: str, named: str) -> None:
    with pytest.raises(APIError) as refused:
        structured_grammar(None, {"guided_grammar": grammar})
    assert named in refused.value.message
    assert compiler_tripwire == []


@pytest.mark.parametrize(("block", "message"), [
    ('{"enum": [9007199254740993]}',
     "the number 9007199254740993 at 'enum.0' is beyond what the grammar compiler keeps"),
    ('{"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}', "exclusiveMinimum 0 with maximum 0.5 cannot be kept"),
    # A %json object is open (JSON Schema's rule, llguidance's reading), so its keys may repeat.
    ('{"type": "object", "properties": {"a": {}}, "required": ["a"], "minProperties": 3}',
     "minProperties 3 on an object that takes keys it does not name cannot be guaranteed"),
    ('{"type": "integer", "multipleOf": -7}', "multipleOf -7 in the %json block at line 1, column 8 must be greater"),
    # The rules of a schema sent as a string: llguidance kept the last of two values.
    ('{"type": "integer", "type": "string"}', "the %json block at line 1, column 8: its JSON repeats the key 'type'"),
    ('{"type": "number", "maximum": NaN}', "its JSON holds a number that is not finite (nan)"),
])
def test_a_json_block_gets_the_checks_of_a_schema(compiler_tripwire: list[str], block: str, message: str) -> None:
    with pytest.raises(APIError) as refused:
        structured_grammar(None, {"guided_grammar": f"start: %json {block}"})
    assert refused.value.param == "guided_grammar"
    assert message in refused.value.message
    assert compiler_tripwire == []


@pytest.mark.parametrize("grammar", [
    '{"grammars": [{"json_schema": {"type": "integer", "multipleOf": 999983}}]}',
    ' \n{"grammars": [{"lark_grammar": "start: %json {\\"multipleOf\\": 999983}"}]}',
])
def test_llguidance_json_grammar_format_is_refused(compiler_tripwire: list[str], grammar: str) -> None:
    # llguidance reads text starting with "{" as its JSON grammar format, whose schemas the checks
    # never saw (this one was accepted after seconds of compiling).
    with pytest.raises(APIError) as refused:
        structured_grammar(None, {"guided_grammar": grammar})
    assert "read by llguidance as its JSON grammar format, which is not accepted here" in refused.value.message
    assert compiler_tripwire == []


@pytest.mark.parametrize("grammar", [
    'start: %json {"type": "integer", "multipleOf": 99983}',
    'start: %json{"type": "string", "pattern": "^[{}]+$"} | "%json {" "}"',
    'start: a "," b\na: %json {"type": "integer", "multipleOf": 3000000}\nb: %json true',
    # An open object may require at least one key: any key written is one once parsed.
    'start: %json {"type": "object", "minProperties": 1}',
])
def test_grammars_with_cheap_json_blocks_compile(client: TestClient, manager: FakeManager, grammar: str) -> None:
    assert structured_grammar(None, {"guided_grammar": grammar}) == grammar
    assert completion(client, guided_grammar=grammar).status_code == 200
    assert manager.calls[-1].params.grammar == grammar


def test_a_json_block_past_the_size_limit_is_not_read(compiler_tripwire: list[str]) -> None:
    # The record holds 16 KiB of grammar: a longer one is refused on its size before any block is read.
    grammar = "start: " + " | ".join(['%json {"type": "integer", "type": "string"}'] * 600)
    with pytest.raises(APIError) as refused:
        structured_grammar(None, {"guided_grammar": grammar})
    assert "at most" in refused.value.message and "repeats the key" not in refused.value.message


# A schema llguidance refuses ("Unimplemented keys") if and only if it reads it as a block.
_NOT = '%json {"not": {}}'


@pytest.mark.parametrize(("grammar", "block"), [
    (f"start: {_NOT}", True),
    ('start: "%json {\\"not\\": {}}"', False),
    ('start: "%json {\\"not\\": {}}"i', False),
    ('start: "a" // ' + _NOT, False),
    ("# " + _NOT + '\nstart: "a"', False),
    ('start: %json {"description": "' + _NOT.replace('"', '\\"') + '"}', False),
    ('start: %regex {"substring_words": "' + _NOT.replace('"', '\\"') + '"}', False),
    # What ends a string, regex, comment or token reference, and what does not.
    ('start: "a\\"" ' + _NOT, True),
    ('start: "a\\\\" ' + _NOT, True),
    ('start: "a/" ' + _NOT, True),
    ('start: "#" ' + _NOT, True),
    ('start: /a"/ ' + _NOT, True),
    ('start: /a\\/b/ ' + _NOT, True),
    ('start: /a#b/i' + _NOT, True),
    ('// c "\nstart: ' + _NOT, True),
    ('start: <|x"|> ' + _NOT, True),
    ('start: "%lark {" ' + _NOT, True),
    ('start: %json {"description": "x"} ' + _NOT, True),
])
def test_the_scan_reads_the_blocks_llguidance_reads(grammar: str, block: bool) -> None:
    """Checked against llguidance's own lexer: a "%json" in a Lark string, regex, comment or a block's
    JSON is text (``start: "%json NaN"`` was refused for a NaN llguidance never reads)."""
    import llguidance

    from lightllm.server.http.structured.lark_json import json_blocks

    problem = llguidance.LLMatcher.validate_grammar(grammar, None) or ""
    assert ("Unimplemented keys" in problem) is block, problem
    assert ({"not": {}} in [schema for _, schema in json_blocks(grammar, "guided_grammar")]) is block


@pytest.mark.parametrize("opener", ['/\\', '"\\'])
def test_an_opener_that_never_closes_ends_the_scan(monkeypatch: pytest.MonkeyPatch, opener: str) -> None:
    """Each quote or slash opening no string or regex was scanned to the end again (a 16 KiB grammar of
    them took seconds); llguidance's lexer refuses the grammar there, before compiling any block, so
    the scan stops: the blocks after it are never compiled."""
    import llguidance

    from lightllm.server.http.structured import lark_json

    grammar = 'start: "a" ' + opener * 8187 + '\nb: %json {"type": "integer", "multipleOf": 999983}'
    searches = []
    lexeme = lark_json._LEXEME

    class CountingLexeme:
        def search(self, text: str, position: int) -> Any:
            searches.append(position)
            return lexeme.search(text, position)

    monkeypatch.setattr(lark_json, "_LEXEME", CountingLexeme())
    assert lark_json.json_blocks(grammar, "guided_grammar") == []
    assert len(searches) <= 3
    assert "lexer error" in (llguidance.LLMatcher.validate_grammar(grammar, None) or "").lower()


@pytest.mark.parametrize("grammar", [
    'start: "%json NaN"',
    'start: /%json 99999999999999999999/',
    'start: "%json {\\"a\\": 1, \\"a\\": 2}"',
    '// start: %json {"type": "integer", "multipleOf": 999983}\nstart: "a"',
    'start: %json {"type": "string", "description": "%json NaN"}',
])
def test_json_that_is_not_a_block_is_not_checked(client: TestClient, manager: FakeManager, grammar: str) -> None:
    assert completion(client, guided_grammar=grammar).status_code == 200
    assert manager.calls[-1].params.grammar == grammar


@pytest.mark.parametrize(("block", "message"), [
    ('{"type": "integer", "type": "string"}', "its JSON repeats the key 'type' in one object"),
    ('{"type": "number", "maximum": NaN}', "its JSON holds a number that is not finite (nan)"),
    ('{"type": "integer", "multipleOf": 999983}', "multipleOf 999983 in the %json block"),
    # A block's own llguidance options, held to the rule every schema is (white space allowed).
    ('{"type": "array", "uniqueItems": true, "x-guidance": {"lenient": true}}',
     "x-guidance.lenient true is refused: it makes llguidance drop the schema keywords"),
    ('{"type": "array", "x-guidance": {"item_separator": ";"}}', 'x-guidance.item_separator ";" is refused'),
])
def test_a_block_refusal_begins_as_every_grammar_refusal(client: TestClient, compiler_tripwire: list[str],
                                                         block: str, message: str) -> None:
    error = assert_error(completion(client, guided_grammar=f"start: a\na: %json {block}"), 400, "guided_grammar")
    assert error["message"].startswith("invalid grammar (llguidance Lark syntax expected): "), error
    assert message in error["message"], error
    assert compiler_tripwire == []


def test_a_block_may_ask_for_json_white_space(client: TestClient) -> None:
    grammar = 'start: %json {"type": "array", "x-guidance": {"whitespace_flexible": true, "item_separator": ", "}}'
    assert completion(client, guided_grammar=grammar).status_code == 200
