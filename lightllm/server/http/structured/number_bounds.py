"""Number ranges in a JSON schema that the grammar compiler would not keep.

llguidance 1.9 compiles ``{"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}`` to a
grammar that lets ``0`` itself through (and ``{"exclusiveMaximum": 0, "minimum": -0.5}`` lets
``-0``): whenever the bound left out is a whole number and every number the range allows shares
its integer part, the bare integer slips past the exclusion.  A sampled answer then breaks the
schema the client asked us to guarantee (11 of 12 did on the demo model), so such a range is
refused with a way to say it that compiles right; no rewrite keeps the range exactly (a fraction
just above the bound, or splitting the range, meets the same fault or excludes real numbers).

Measured on llguidance 1.9.1 over every pair of bounds among -3..3 in quarter steps: the fault
needs an exclusive lower bound E >= 0 with the upper bound below E + 1, or an exclusive upper
bound E <= 0 with the lower bound above E - 1; ``integer`` schemas are not affected.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Iterator, Optional

from lightllm.server.http.structured.schema_positions import local_reference_target, schemas_with_places

_Bound = tuple[Fraction, bool, str, Any]  # value, exclusive, keyword, the value as the client wrote it


def unkept_number_range(schema: Any) -> Optional[str]:
    """Why a number range somewhere in ``schema`` would not be kept by the compiled grammar, or None."""
    for place, node in schemas_with_places(schema):
        reason = _unkept_here(node, schema, f" at '{place}'" if place else "")
        if reason is not None:
            return reason
    return None


def _unkept_here(node: dict, root: Any, where: str) -> Optional[str]:
    parts = list(_conjoined(node, root, set()))
    if not all(_allows_fractions(part) for part in parts):
        return None
    lower = _tightest([bound for part in parts for bound in _bounds(part, ("minimum", "exclusiveMinimum"))],
                      tighter=lambda a, b: a > b)
    upper = _tightest([bound for part in parts for bound in _bounds(part, ("maximum", "exclusiveMaximum"))],
                      tighter=lambda a, b: a < b)
    if lower is None or upper is None or lower[0] >= upper[0]:
        return None
    if lower[1] and lower[0].denominator == 1 and lower[0] >= 0 and upper[0] < lower[0] + 1:
        left_out, other = lower, upper
        advice = f"an inclusive minimum just above {lower[3]!r}"
    elif upper[1] and upper[0].denominator == 1 and upper[0] <= 0 and lower[0] > upper[0] - 1:
        left_out, other = upper, lower
        advice = f"an inclusive maximum just below {upper[3]!r}"
    else:
        return None
    return (f"{left_out[2]} {left_out[3]!r} with {other[2]} {other[3]!r}{where} cannot be kept: the grammar "
            f"compiler lets {left_out[3]!r} itself through when every number allowed shares its integer part; "
            f"give {advice} instead")


def _conjoined(node: dict, root: Any, seen: set[int]) -> Iterator[dict]:
    """``node`` and the schemas it must also meet: its ``allOf`` branches and a local ``$ref``'s target."""
    if id(node) in seen:
        return
    seen.add(id(node))
    yield node
    branches = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    target = local_reference_target(root, node.get("$ref"))
    for inner in [*branches, target]:
        if isinstance(inner, dict):
            yield from _conjoined(inner, root, seen)


def _allows_fractions(node: dict) -> bool:
    kind = node.get("type")
    if kind is None:
        return True
    kinds = kind if isinstance(kind, list) else [kind]
    return "number" in kinds


def _bounds(node: dict, keywords: tuple[str, str]) -> Iterator[_Bound]:
    for keyword in keywords:
        value = node.get(keyword)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            yield Fraction(value), keyword.startswith("exclusive"), keyword, value


def _tightest(bounds: list[_Bound], tighter: Any) -> Optional[_Bound]:
    best: Optional[_Bound] = None
    for bound in bounds:
        if best is None or tighter(bound[0], best[0]) or (bound[0] == best[0] and bound[1] and not best[1]):
            best = bound
    return best
