"""``response_format`` of both OpenAI endpoints: from the OpenAI object to a structured-output grammar.

Chat completions take it as OpenAI does; ``/v1/completions`` takes it too, as vLLM does.

``{"type": "text"}`` (or no ``response_format``) means free text.  ``json_object`` constrains
the output to a JSON object, ``json_schema`` to JSON valid under the given schema (as OpenAI's
``strict`` mode: an object listing its properties takes no others unless the schema says so,
:mod:`lightllm.server.http.structured.closed_objects`); both become an llguidance grammar that the
model rank applies as a token mask (:mod:`lightllm.server.model_rank.execution.structured_output`).
A schema the grammar compiler cannot use is a 400 naming ``response_format.json_schema.schema``.
Every schema compiled here has its top-level ``x-guidance`` (llguidance's own options) held to
:mod:`lightllm.server.http.structured.guidance_options`' rule first.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional

from lightllm.common.sampling.grammar_limits import grammar_limits
from lightllm.common.sampling.storage_width import GRAMMAR_BYTES
from lightllm.server.http.structured.closed_objects import closed_objects, unkept_min_properties
from lightllm.server.http.errors import invalid_request
from lightllm.server.http.structured.guidance_options import check_guidance_options
from lightllm.server.http.structured.number_bounds import unkept_number_range
from lightllm.server.http.structured.schema_cost import costly_multiple_of
from lightllm.server.http.structured.schema_positions import ANNOTATION_KEYWORDS, DATA_KEYWORDS, SCHEMA_MAP_KEYWORDS


def validated_grammar(grammar: str, param: str, what: str) -> str:
    """``grammar`` if it fits, llguidance accepts it and it admits some output; else a 400 naming ``param``."""
    import llguidance

    check_grammar_size(grammar, param, what)
    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar, None, limits=grammar_limits())
    except Exception as exc:  # noqa: BLE001 - the compiler's message is the client's answer
        problem = str(exc) or type(exc).__name__
    if problem:
        raise invalid_request(f"invalid {what}: {problem.strip()}", param)
    # Token references (<[300]>, <|im_end|>) name the model's vocabulary, which the check's byte
    # vocabulary does not have: such a grammar is checked by the model rank's matcher alone, which
    # ends a request it cannot start with a 400 grammar_failed.
    empty = None if _TOKEN_REFERENCE.search(grammar) else _no_output_reason(grammar)
    if empty:
        raise invalid_request(f"the {what} admits no output at all ({empty})", param)
    return grammar


def check_grammar_size(grammar: str, param: str, what: str) -> None:
    """400 naming ``param`` when ``grammar`` is larger than the request's record holds."""
    size = len(grammar.encode())
    if size > GRAMMAR_BYTES:
        # Checked here, where the field it came from is known (the request holds no "grammar" field).
        raise invalid_request(f"the {what} compiles to a grammar of {size} bytes; at most {GRAMMAR_BYTES} bytes "
                              "fit (make it smaller)", param)


# llguidance's Lark syntax for a token by id (<[300]>, <[0-99]>) or by special-token name (<|im_end|>).
_TOKEN_REFERENCE = re.compile(r"<\[|<\|")


class _ByteVocabulary:
    """Every byte a token of its own, plus an end token: the tokenizer llguidance asks whether a
    grammar can begin at all, whatever the model's vocabulary (any text is some byte sequence)."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([value]) for value in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: Any) -> list[int]:
        return list(text if isinstance(text, bytes) else str(text).encode("utf-8"))


@functools.lru_cache(maxsize=1)
def _byte_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


# Grammars whose no-output check is remembered.  The check builds a matcher, up to a second for a
# costly one, and clients resend the same schema with every request; a grammar is at most 16 KiB,
# so the cache holds at most a few MiB of text.
CHECKED_GRAMMARS_CACHED = 256


@functools.lru_cache(maxsize=CHECKED_GRAMMARS_CACHED)
def _no_output_reason(grammar: str) -> Optional[str]:
    """llguidance's reason when ``grammar`` cannot even begin (it matches no text, not even the
    empty one), else None.  Without this check such a request reaches the model rank, whose
    mask then allows nothing, and fails there as a 500."""
    import llguidance
    # numpy, not llguidance.torch: this runs in the HTTP process, which keeps torch out
    # (lightllm.utils.torch_free); importing torch there fails.
    import llguidance.numpy as ll_numpy

    tokenizer = _byte_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar, limits=grammar_limits())
    if not matcher.is_error():
        bitmask = ll_numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        ll_numpy.fill_next_token_bitmask(matcher, bitmask, 0)
    if matcher.is_error():
        reason = (matcher.get_error() or "").strip().splitlines()[0] if matcher.get_error() else ""
        # A bare internal name (llguidance's "NoExtensionBias") tells a client nothing.
        return reason if " " in reason else "no text matches it"
    return None


# The numbers a schema may hold.  The grammar compiler reads every number as a 64-bit float, so an
# enum or const integer beyond 2^53 comes out as another one (9007199254740993 produced
# 9007199254740992, 2^64-1 produced 18446744073709552000, an integer-typed 1e19 produced
# 9223372036854775807), and one near -2^63 in an integer schema's enum or const, written as an
# integer or a float (-1e19), crashed the process (a segmentation fault in llguidance 1.9).  A
# bound only needs to be readable: beyond 64 bits the compiler failed naming neither the number
# nor its place, so bounds keep -2^62 (a margin below the crash) to 2^64-1, which lets int64
# maxima and uint64 bounds through (an int64 minimum, -2^63, is refused: the compiler cannot
# build that range either).
EXACT_NUMBER_LIMIT = 2**53
BOUND_NUMBERS = (-(2**62), 2**64 - 1)


def inexact_number(schema: Any) -> Optional[tuple[str, Any, str]]:
    """The first number in ``schema`` the grammar compiler would change or cannot read, with its path
    and the range allowed there; None when none."""
    # (value, path, inside data, its keys are names, inside an annotation)
    stack: list[tuple[Any, str, bool, bool, bool]] = [(schema, "", False, False, False)]
    while stack:
        value, path, data, names, annotation = stack.pop()
        if isinstance(value, dict):
            stack.extend((item, f"{path}.{key}" if path else str(key),
                          data or (not names and key in DATA_KEYWORDS), not data and not names and key in SCHEMA_MAP_KEYWORDS,
                          annotation or (not data and not names and key in ANNOTATION_KEYWORDS))
                         for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{index}" if path else str(index), data, False, annotation)
                         for index, item in reversed(list(enumerate(value))))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if annotation and isinstance(value, float):
                continue  # default and examples are not compiled; the compiler reads any float there
            if data and abs(value) > EXACT_NUMBER_LIMIT:
                return path, value, "-2^53 to 2^53 in an enum or const: it reads numbers as 64-bit floats"
            if not BOUND_NUMBERS[0] <= value <= BOUND_NUMBERS[1]:
                return path, value, "-2^62 to 2^64-1"
    return None


def inexact_number_problem(schema: Any) -> Optional[str]:
    """:func:`inexact_number`'s finding in words, or None."""
    beyond = inexact_number(schema)
    if beyond is None:
        return None
    path, number, allowed = beyond
    return f"the number {number!r} at '{path}' is beyond what the grammar compiler keeps ({allowed})"


# A negative number written alone in a Lark grammar's text (its embedded %json schema's enum or
# const): checked by value in crashing_number.  Not one inside a word (a UUID's "-4e50").
_NEGATIVE_NUMBER = re.compile(r"(?<![\w.])-(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)(?![\w.])")

# At or below this, a negative number in a grammar's text is refused (the crash began near -2^63).
_CRASHING_BELOW = -(2**62)


def crashing_number(grammar: str) -> Optional[str]:
    """A negative number in a Lark grammar's text at or below -2^62 (near -2^63 one crashed the
    compiler inside ``%json``), as written; None when none.

    Read from the text, not parsed: such a number in a Lark string or regex is refused too, which
    costs nothing real and covers every way a %json block can be written.
    """
    for match in _NEGATIVE_NUMBER.finditer(grammar):
        literal = match.group(1)
        if len(literal) < 19 and "e" not in literal.lower():
            continue  # short plain literals are far above the limit: skip the conversion
        try:
            value = -float(literal)
        except (ValueError, OverflowError):
            continue
        if value <= _CRASHING_BELOW:
            return "-" + literal
    return None


def _compile(schema: Any, param: str, what: str = "JSON schema") -> str:
    import llguidance

    if not isinstance(schema, dict):
        raise invalid_request("the JSON schema must be an object", param)
    # Checked first: the options decide how llguidance reads every keyword checked below.
    check_guidance_options(schema, param, what)
    beyond = inexact_number_problem(schema)
    if beyond is not None:
        raise invalid_request(f"invalid {what}: {beyond}", param)
    costly = costly_multiple_of(schema)
    if costly is not None:
        raise invalid_request(f"invalid {what}: {costly}", param)
    unkept_range = unkept_number_range(schema)
    if unkept_range is not None:
        raise invalid_request(f"invalid {what}: {unkept_range}", param)
    schema = closed_objects(schema)
    unkept = unkept_min_properties(schema)
    if unkept is not None:
        raise invalid_request(f"invalid {what}: {unkept}", param)
    try:
        # Compact JSON (no free whitespace between tokens): a weak or random model cannot stall in
        # endless whitespace, and a bounded schema always ends within a bounded number of tokens.
        # A schema's own x-guidance whitespace_flexible true (checked above) overrides this default.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                defaults={"whitespace_flexible": False})
    except Exception as exc:  # noqa: BLE001 - the compiler's message is the client's answer
        raise invalid_request(f"invalid JSON schema: {str(exc) or type(exc).__name__}", param) from None
    return validated_grammar(grammar, param, what)


def compile_json_schema(schema: Any, param: str, what: str = "JSON schema") -> str:
    """An llguidance grammar for JSON valid under ``schema`` (compact); 400 naming ``param`` (and
    ``what`` the schema is) if unusable.

    Shared with tool calling (:mod:`lightllm.server.http.openai.tool_calls.request`), which forces calls this way.
    """
    return _compile(schema, param, what)


# vLLM's structural tags are xgrammar's own format (tags and triggers, and the newer "format"
# objects: const_string, sequence, triggered_tags, ...), which llguidance does not read; building
# them here would mean a second grammar language kept in step with xgrammar's.
STRUCTURAL_TAG_REFUSAL = ("structural_tag is not supported: it is xgrammar's tag format, which this server's grammar "
                          "backend (llguidance) does not read; constrain the output with a JSON schema, a regex or a "
                          "Lark grammar instead")

# OpenAI's rule for a response format's name (as for a function's).
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# The shapes response_format_grammar accepts, for the OpenAPI document (one of them, no other keys):
# a field's json_schema_extra, replacing pydantic's "any object or null".
RESPONSE_FORMAT_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "null"}, {"oneOf": [
    *({"type": "object", "required": ["type"], "properties": {"type": {"const": kind}}, "additionalProperties": False}
      for kind in ("text", "json_object")),
    {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False, "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["name", "schema"], "additionalProperties": False, "properties": {
            "name": {"type": "string", "pattern": SCHEMA_NAME.pattern},
            "schema": {"type": "object", "description": "A JSON schema the output follows (compiled when the "
                                                        "request arrives; one the compiler cannot use is a 400)"},
            "strict": {"type": ["boolean", "null"]},
            "description": {"type": ["string", "null"]}}}}},
]}]}


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The grammar ``response_format`` asks for, or None for free text; 400 for anything else."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text" and set(response_format) == {"type"}:
        return None
    if kind == "json_object" and set(response_format) == {"type"}:
        return _compile({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if "json_schema" not in response_format:
            raise invalid_request("response_format.json_schema is required when type is 'json_schema'",
                                  "response_format.json_schema")
        if not isinstance(spec, dict):
            raise invalid_request("response_format.json_schema must be an object", "response_format.json_schema")
        extra = sorted(set(response_format) - {"type", "json_schema"})
        if extra:
            raise invalid_request(f"unknown key(s) in response_format: {', '.join(extra)}", "response_format")
        unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
        if unknown:
            raise invalid_request(f"unknown key(s) in response_format.json_schema: {', '.join(unknown)}",
                                  "response_format.json_schema")
        if not isinstance(spec.get("name"), str) or not SCHEMA_NAME.fullmatch(spec["name"]):
            raise invalid_request("response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-' "
                                  "(OpenAI's rule)", "response_format.json_schema.name")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise invalid_request("response_format.json_schema.strict must be true or false (the output follows "
                                  "the schema strictly either way)", "response_format.json_schema.strict")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise invalid_request("response_format.json_schema.description must be a string",
                                  "response_format.json_schema.description")
        if "schema" not in spec:
            raise invalid_request("response_format.json_schema.schema is required", "response_format.json_schema.schema")
        return _compile(spec["schema"], "response_format.json_schema.schema")
    if kind == "structural_tag":
        raise invalid_request(f"response_format type {STRUCTURAL_TAG_REFUSAL}", "response_format.type")
    raise invalid_request("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                          "{'type': 'json_schema', 'json_schema': {...}}", "response_format")
