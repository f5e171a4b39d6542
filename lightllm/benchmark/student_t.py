"""Student's t distribution: its CDF and quantiles, without scipy.

The comparison report's intervals need ``t_{df, p}`` for any ``--confidence`` and any number of
repeats.  scipy is not a requirement of this project (requirements*.txt), so the quantile is
computed here: the CDF through the regularized incomplete beta function (a continued fraction,
evaluated with the modified Lentz method), inverted by bisection.  The result agrees with the
closed forms for one and two degrees of freedom and with published tables to well below their
printed precision (the unit tests check both).

For ``df`` degrees of freedom and ``t > 0``::

    P(T > t) = I_x(df / 2, 1 / 2) / 2,  x = df / (df + t^2)

where ``I_x(a, b)`` is the regularized incomplete beta function.
"""

from __future__ import annotations

import functools
import math

# Continued-fraction terms: the fraction converges in far fewer for the arguments used here
# (a = df / 2, b = 1 / 2); the cap only guards against a loop that never ends.
_MAX_TERMS = 10_000
_EPS = 1e-15
# Lentz's method replaces an exact zero denominator by this, so the recurrence can go on.
_TINY = 1e-300


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of ``I_x(a, b)`` (converges fast for ``x < (a + 1) / (a + b + 2)``)."""

    def guard(value: float) -> float:
        return _TINY if abs(value) < _TINY else value

    c = 1.0
    d = 1.0 / guard(1.0 - (a + b) * x / (a + 1.0))
    h = d
    for m in range(1, _MAX_TERMS + 1):
        # Even step: d_{2m} = m (b - m) x / ((a + 2m - 1)(a + 2m)).
        numerator = m * (b - m) * x / ((a + 2 * m - 1.0) * (a + 2 * m))
        d = 1.0 / guard(1.0 + numerator * d)
        c = guard(1.0 + numerator / c)
        h *= d * c
        # Odd step: d_{2m+1} = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1)).
        numerator = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1.0))
        d = 1.0 / guard(1.0 + numerator * d)
        c = guard(1.0 + numerator / c)
        step = d * c
        h *= step
        if abs(step - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"the incomplete beta fraction did not converge for a={a}, b={b}, x={x}")


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)`` for ``a, b > 0`` and ``0 <= x <= 1``.

    Raises:
        ValueError: an argument is out of range.
    """
    if not (a > 0 and b > 0):
        raise ValueError(f"a and b must be > 0, got a={a!r}, b={b!r}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be within [0, 1], got {x!r}")
    if x in (0.0, 1.0):
        return x
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    front = math.exp(log_front)
    # The fraction converges quickly only on one side of the mean of Beta(a, b); the other side
    # follows from the symmetry I_x(a, b) = 1 - I_{1-x}(b, a).
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def _check_df(df: float) -> None:
    if isinstance(df, bool) or not isinstance(df, (int, float)) or not math.isfinite(df) or df <= 0:
        raise ValueError(f"df must be a finite number > 0, got {df!r}")


def student_t_cdf(t: float, df: float) -> float:
    """``P(T <= t)`` for Student's t with ``df`` degrees of freedom.

    Raises:
        ValueError: ``df`` is not a finite number > 0, or ``t`` is NaN.
    """
    _check_df(df)
    if math.isnan(t):
        raise ValueError("t must not be NaN")
    tail = _tail(abs(t), df)
    return 1.0 - tail if t > 0 else tail


def _tail(t: float, df: float) -> float:
    """``P(T > t)`` for ``t >= 0`` (computed directly, so a tiny tail keeps its precision)."""
    if math.isinf(t):
        return 0.0
    return 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def student_t_quantile(p: float, df: float) -> float:
    """The ``t`` with ``P(T <= t) = p`` for Student's t with ``df`` degrees of freedom.

    Raises:
        ValueError: ``p`` is not within (0, 1), or ``df`` is not a finite number > 0.
    """
    _check_df(df)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p < 1.0:
        raise ValueError(f"p must be within (0, 1), got {p!r}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -_upper_quantile(1.0 - p, float(df))
    return _upper_quantile(p, float(df))


# Cached (after validation, so an argument equal to a valid one, such as True for 1, is still
# checked): a comparison asks for the same few quantiles, one per number of pairs, many times.
@functools.lru_cache(maxsize=1024)
def _upper_quantile(p: float, df: float) -> float:
    """:func:`student_t_quantile` for ``0.5 < p < 1``."""
    # Solved on the upper tail, 1 - p, which stays exact where p is close to 1.  Bracket the root,
    # then halve the bracket: the tail decreases, so bisection cannot miss, and it stops once the
    # bracket is as narrow as floats allow.
    upper = 1.0 - p
    low, high = 0.0, 1.0
    while _tail(high, df) > upper:
        low, high = high, high * 2.0
        if high > 1e300:
            raise ArithmeticError(f"no finite t quantile found for p={p}, df={df}")
    for _ in range(2000):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if _tail(middle, df) > upper:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)
