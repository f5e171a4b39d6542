"""The range a sampling number must lie in, read both by the check and by the published schema.

:meth:`~lightllm.common.sampling.sampling_params.SamplingParams.validate` refuses a value outside
its field's :class:`NumberRange` (worded by :meth:`NumberRange.describe`), and the HTTP request
schemas publish the same object as JSON Schema keywords (:meth:`NumberRange.json_schema`), so the
bounds ``/openapi.json`` states are the ones the server enforces and cannot drift from them.
"""

from __future__ import annotations

from dataclasses import dataclass

Number = int | float


@dataclass(frozen=True)
class NumberRange:
    """``[minimum, maximum]`` (``(minimum, ...`` when ``exclusive_minimum``); None: unbounded on that side."""

    minimum: Number | None = None
    maximum: Number | None = None
    exclusive_minimum: bool = False

    def holds(self, value: Number) -> bool:
        """True when ``value`` (a finite number) lies in the range."""
        if self.minimum is not None:
            if value < self.minimum or (self.exclusive_minimum and value == self.minimum):
                return False
        return self.maximum is None or value <= self.maximum

    def describe(self) -> str:
        """The range as a refusal words it: ``in (0, 1]``, ``in [-2, 2]``, ``>= 0``, ``> 0``."""
        low = "(" if self.exclusive_minimum else "["
        if self.maximum is not None and self.minimum is not None:
            return f"in {low}{self.minimum:g}, {self.maximum:g}]"
        if self.minimum is not None:
            return f"{'>' if self.exclusive_minimum else '>='} {self.minimum:g}"
        return f"<= {self.maximum:g}" if self.maximum is not None else "any number"

    def json_schema(self) -> dict[str, Number]:
        """The range as JSON Schema keywords (``minimum`` or ``exclusiveMinimum``, ``maximum``)."""
        keywords: dict[str, Number] = {}
        if self.minimum is not None:
            keywords["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
        if self.maximum is not None:
            keywords["maximum"] = self.maximum
        return keywords
