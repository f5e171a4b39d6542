"""The names a PromQL expression reads: metrics with their matcher labels, and grouping labels.

Not a PromQL parser: a scanner that knows enough of the grammar to tell a metric name from a
function, a keyword, a label or a duration, so that a dashboard check sees every metric an
expression queries, ``rate(name[5m])`` and a bare ``name`` as much as ``name{...}``.  Grafana's
``$variables`` and ``label_values(metric, label)`` queries are understood too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Tuple

_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_NUMBER = re.compile(r"(?:0x[0-9a-fA-F]+|[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)(?:[a-zA-Z]+[0-9]*)*")
_VARIABLE = re.compile(r"\$(?:\{[^}]*\}|[a-zA-Z0-9_]+)")
_MATCHER_LABEL = re.compile(r"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
# Grafana's variable query: label_values(metric, label) or label_values(metric{matchers}, label).
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^{}]*\})?\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)")
# Words that are never metric names where they stand: binary operators, modifiers, literals and the
# aggregation operators, which may be followed by ``by (...)`` before their parenthesis.
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
                       "group_right", "inf", "nan", "atan2", "sum", "min", "max", "avg", "group", "stddev",
                       "stdvar", "count", "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
# Keywords whose parenthesised list names labels: the key says whether a missing label matters
# (``by``/``on`` group or match by it; ``without``/``ignoring`` only drop it).
_LABEL_LISTS = {"by": True, "on": True, "group_left": True, "group_right": True, "without": False, "ignoring": False}


@dataclass
class Selector:
    """A metric an expression reads and the labels its matchers name (``__name__`` left out)."""

    metric: str
    labels: List[str] = field(default_factory=list)


@dataclass
class ExpressionNames:
    """What :func:`expression_names` found in one expression."""

    selectors: List[Selector] = field(default_factory=list)
    grouping: List[Tuple[str, str]] = field(default_factory=list)  # (keyword, label) of labels that must exist
    label_values: List[Tuple[str, str]] = field(default_factory=list)  # Grafana's (metric, label)


def _skip_string(expr: str, start: int) -> int:
    """The index after the string literal opening at ``start``."""
    quote = expr[start]
    index = start + 1
    while index < len(expr) and expr[index] != quote:
        index += 2 if expr[index] == "\\" and quote != "`" else 1
    return index + 1


def _matcher_labels(block: str) -> List[str]:
    """Label names of a ``{...}`` block's matchers (strings removed first)."""
    bare = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`', '""', block)
    return [name for part in bare.split(",") if (match := _MATCHER_LABEL.match(part))
            for name in [match.group(1)] if name != "__name__"]


def _closing(expr: str, start: int, opening: str, closing: str) -> int:
    """The index of the bracket closing the one at ``start`` (strings skipped); len(expr) if none."""
    depth, index = 0, start
    while index < len(expr):
        char = expr[index]
        if char in "\"'`":
            index = _skip_string(expr, index)
            continue
        if char == opening:
            depth += 1
        elif char == closing:
            depth -= 1
            if depth == 0:
                return index
        index += 1
    return len(expr)


def _next_char(expr: str, index: int) -> Tuple[str, int]:
    while index < len(expr) and expr[index].isspace():
        index += 1
    return (expr[index] if index < len(expr) else ""), index


def expression_names(expr: str) -> ExpressionNames:
    """The metrics, matcher labels and grouping labels ``expr`` names."""
    found = ExpressionNames()
    for metric, matchers, label in _LABEL_VALUES.findall(expr):
        found.label_values.append((metric, label))
        if matchers:
            found.selectors.append(Selector(metric, _matcher_labels(matchers[1:-1])))
    expr = _LABEL_VALUES.sub(" ", expr)
    index = 0
    while index < len(expr):
        char = expr[index]
        if char in "\"'`":
            index = _skip_string(expr, index)
        elif char == "#":  # a comment, to the end of the line
            end = expr.find("\n", index)
            index = len(expr) if end < 0 else end
        elif char == "[":  # a range or subquery duration
            index = _closing(expr, index, "[", "]") + 1
        elif char == "{":  # a selector with no metric name: {__name__=~"..."} or labels only
            index = _closing(expr, index, "{", "}") + 1
        elif char == "$":
            match = _VARIABLE.match(expr, index)
            index = match.end() if match else index + 1
        elif char.isdigit() or (char == "." and expr[index + 1:index + 2].isdigit()):
            match = _NUMBER.match(expr, index)
            index = match.end() if match else index + 1
        elif (match := _IDENT.match(expr, index)) is not None:
            word = match.group(0)
            keyword = word.lower()  # PromQL's keywords and Inf/NaN are case-insensitive
            following, after = _next_char(expr, match.end())
            index = match.end()
            if keyword in _LABEL_LISTS and following == "(":
                end = _closing(expr, after, "(", ")")
                if _LABEL_LISTS[keyword]:
                    labels = (part.strip() for part in expr[after + 1:end].split(","))
                    # A Grafana variable ($group, [[group]]) names its labels only when the panel renders.
                    found.grouping.extend((keyword, label) for label in labels
                                          if label and not label.startswith(("$", "[[")))
                index = end + 1
            elif keyword in _KEYWORDS or following == "(":
                continue  # an operator, a modifier or a function / aggregation name
            elif following == "{":
                end = _closing(expr, after, "{", "}")
                found.selectors.append(Selector(word, _matcher_labels(expr[after + 1:end])))
                index = end + 1
            else:
                found.selectors.append(Selector(word))
        else:
            index += 1
    return found
