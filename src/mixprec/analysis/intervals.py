"""Interval arithmetic over what is known of a value's elements, for the integer-semantics
analysis (:mod:`mixprec.analysis.integer_semantics`): bounds, per-element intervals of short
vectors; the interval rules the op-facts table names (`interval = "add"`, ...) are built from
them in :mod:`mixprec.analysis.value_bounds`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Per-element bounds are kept for 1-D values up to this length (shapes, small index vectors).
MAX_ELEMS = 64
INF = math.inf

Interval = tuple[float, float]


@dataclass(frozen=True)
class Bound:
    """What is known of a value's elements: an interval, integrality, per-element intervals."""

    lo: float
    hi: float
    integral: bool
    elems: tuple[Interval, ...] | None = None

    @property
    def magnitude(self) -> float:
        return max(abs(self.lo), abs(self.hi))

    def whole(self) -> Bound:
        return Bound(self.lo, self.hi, self.integral)


UNKNOWN = Bound(-INF, INF, False)
BOOL = Bound(0.0, 1.0, True)


def clean(lo: float, hi: float) -> Interval:
    if math.isnan(lo) or math.isnan(hi):
        return (-INF, INF)
    return (lo, hi)


def mul(a: Interval, b: Interval) -> Interval:
    products = [
        0.0 if math.isnan(p) else p for p in (a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1])
    ]
    return (min(products), max(products))


def div(a: Interval, b: Interval) -> Interval:
    if b[0] <= 0.0 <= b[1]:
        return (-INF, INF)
    return mul(a, (1.0 / b[1], 1.0 / b[0]))


def floor(x: float) -> float:
    return x if math.isinf(x) else float(math.floor(x))


def ceil(x: float) -> float:
    return x if math.isinf(x) else float(math.ceil(x))


def interval_abs(a: Interval) -> Interval:
    if a[0] >= 0:
        return a
    if a[1] <= 0:
        return (-a[1], -a[0])
    return (0.0, max(-a[0], a[1]))


def mod(a: Interval, b: Interval) -> Interval:
    m = max(abs(b[0]), abs(b[1]))
    return (0.0, m) if a[0] >= 0 and b[0] > 0 else (-m, m)


# Interval rules by name (the `interval` fact); variadic ops fold the binary rule.
BINARY: dict[str, Callable[[Interval, Interval], Interval]] = {
    "add": lambda a, b: (a[0] + b[0], a[1] + b[1]),
    "sub": lambda a, b: (a[0] - b[1], a[1] - b[0]),
    "mul": mul,
    "div": div,
    "max": lambda a, b: (max(a[0], b[0]), max(a[1], b[1])),
    "min": lambda a, b: (min(a[0], b[0]), min(a[1], b[1])),
    "mod": mod,
}
# Unary rules: (interval function, whether the results are integers whatever the operand).
UNARY: dict[str, tuple[Callable[[Interval], Interval], bool]] = {
    "neg": (lambda a: (-a[1], -a[0]), False),
    "abs": (interval_abs, False),
    "floor": (lambda a: (floor(a[0]), floor(a[1])), True),
    "ceil": (lambda a: (ceil(a[0]), ceil(a[1])), True),
    "round": (lambda a: (floor(a[0]), ceil(a[1])), True),
    "relu": (lambda a: (max(a[0], 0.0), max(a[1], 0.0)), False),
}


def from_elems(elems: Sequence[Interval], integral: bool) -> Bound:
    if not elems:
        return Bound(0.0, 0.0, integral, ())
    lo = min(e[0] for e in elems)
    hi = max(e[1] for e in elems)
    return Bound(lo, hi, integral, tuple(elems) if len(elems) <= MAX_ELEMS else None)


def element(bound: Bound, index: int) -> Interval:
    elems = bound.elems or ()
    return elems[0 if len(elems) == 1 else index]


def elementwise(fn: Callable[..., Interval], bounds: Sequence[Bound], integral: bool) -> Bound:
    """Apply an interval function elementwise (per element when every operand has elements)."""
    lengths = {len(b.elems) for b in bounds if b.elems is not None}
    if all(b.elems is not None for b in bounds) and len(lengths - {1}) <= 1:
        count = max(lengths)
        elems = [clean(*fn(*[element(b, i) for b in bounds])) for i in range(count)]
        return from_elems(elems, integral)
    lo, hi = clean(*fn(*[(b.lo, b.hi) for b in bounds]))
    return Bound(lo, hi, integral)


def singletons_integral(bound: Bound) -> bool:
    pairs = bound.elems if bound.elems is not None else ((bound.lo, bound.hi),)
    return all(lo == hi and math.isfinite(lo) and float(lo).is_integer() for lo, hi in pairs)
