"""Schema keywords whose grammar the compiler takes too long to build: refused before it starts.

llguidance 1.9 builds ``multipleOf`` as an automaton over the number's digits whose size follows
the divisor's significant digits (trailing zeros cost nothing): measured on this 2-core VM, an
integer ``multipleOf`` of 99983 took 0.4 s to compile, 1048576 0.9 s, 999983 5.6 to 8 s, and 2^24
or 5^10 more than 20 s; 3000000 and 0.01 take no time.  Compiling runs off the event loop, but a
request costing seconds of a core per compile is refused rather than served.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any, Iterable, Optional

from lightllm.server.http.structured.schema_positions import schemas_with_places

# The largest significand (the divisor without trailing zeros, decimal point dropped) compiled.
MULTIPLE_OF_SIGNIFICAND_LIMIT = 100_000


def costly_multiple_of(schema: Any) -> Optional[str]:
    """Why the ``multipleOf`` keywords of ``schema`` are refused, or None.

    Their significands add up: each builds its own automaton, so twenty of 99983 cost as much as
    one of two million (52 s of compiling measured).  A divisor must be above 0, as JSON Schema
    says (llguidance silently used the absolute value of a negative one, escaping this bound).
    """
    return costly_multiple_of_all([("", schema)], "the schema's")


def costly_multiple_of_all(schemas: Iterable[tuple[str, Any]], whose: str) -> Optional[str]:
    """Why the ``multipleOf`` keywords of ``schemas``, compiled into one grammar, are refused, or None.

    ``schemas`` pairs each schema with the words saying where it stands (a Lark grammar's ``%json``
    blocks: "the %json block at line 3"; "" for a schema given alone); ``whose`` names them all in
    the message ("the schema's").  One grammar builds every block's automata, so the bound is on
    their sum over all the schemas, as over one schema's keywords.
    """
    total = 0
    for label, schema in schemas:
        within = f" in {label}" if label else ""
        for place, node in schemas_with_places(schema):
            value = node.get("multipleOf")
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            where = (f" at '{place}'" if place else "") + within
            if not value > 0:
                return f"multipleOf {value!r}{where} must be greater than 0"
            significand = _significand(value)
            if significand is None:
                continue
            total += significand
            if total > MULTIPLE_OF_SIGNIFICAND_LIMIT:
                return (f"multipleOf {value!r}{where} would take the grammar compiler too long to build (the "
                        f"significant digits of {whose} multipleOf values add up to more than "
                        f"{MULTIPLE_OF_SIGNIFICAND_LIMIT}; trailing zeros cost nothing)")
    return None


def _significand(value: int | float) -> Optional[int]:
    """``value``'s decimal digits without trailing zeros, as an integer (3000000 -> 3, 0.25 -> 25)."""
    try:
        digits = Decimal(value if isinstance(value, int) else repr(value)).normalize().as_tuple().digits
    except InvalidOperation:
        return None
    return int("".join(map(str, digits)))
