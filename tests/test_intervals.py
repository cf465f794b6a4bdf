"""Interval arithmetic for the integer-semantics analysis (`mixprec.analysis.intervals`): the
binary and unary rules on known intervals, the NaN and infinity guards, and per-element bounds.

Each rule is also checked for soundness against sampled points: every result of the operation
on values inside the operand intervals lies inside the computed interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from mixprec.analysis.intervals import (
    BINARY,
    BOOL,
    INF,
    MAX_ELEMS,
    UNARY,
    UNKNOWN,
    Bound,
    Interval,
    clean,
    div,
    element,
    elementwise,
    from_elems,
    interval_abs,
    mod,
    mul,
    singletons_integral,
)


@pytest.mark.parametrize(
    ("name", "a", "b", "expected"),
    [
        ("add", (1.0, 2.0), (10.0, 20.0), (11.0, 22.0)),
        ("add", (-INF, 0.0), (1.0, 2.0), (-INF, 2.0)),
        ("sub", (1.0, 2.0), (10.0, 20.0), (-19.0, -8.0)),
        ("sub", (0.0, 0.0), (-3.0, 5.0), (-5.0, 3.0)),
        ("mul", (2.0, 3.0), (4.0, 5.0), (8.0, 15.0)),
        ("mul", (-2.0, 3.0), (4.0, 5.0), (-10.0, 15.0)),
        ("mul", (-2.0, 3.0), (-5.0, 4.0), (-15.0, 12.0)),
        ("mul", (-3.0, -2.0), (-5.0, -4.0), (8.0, 15.0)),
        ("div", (1.0, 2.0), (4.0, 8.0), (0.125, 0.5)),
        ("div", (-6.0, 3.0), (-3.0, -1.0), (-3.0, 6.0)),
        ("div", (1.0, 2.0), (-1.0, 1.0), (-INF, INF)),  # a divisor that may be zero
        ("div", (1.0, 2.0), (0.0, 4.0), (-INF, INF)),
        ("max", (-5.0, 1.0), (0.0, 0.5), (0.0, 1.0)),
        ("min", (-5.0, 1.0), (0.0, 0.5), (-5.0, 0.5)),
        ("mod", (0.0, 100.0), (1.0, 7.0), (0.0, 7.0)),  # non-negative operands: [0, |b|]
        ("mod", (-100.0, 100.0), (1.0, 7.0), (-7.0, 7.0)),
        ("mod", (0.0, 100.0), (-7.0, -1.0), (-7.0, 7.0)),
    ],
)
def test_binary_rules(name: str, a: Interval, b: Interval, expected: Interval) -> None:
    assert BINARY[name](a, b) == expected


@pytest.mark.parametrize(
    ("name", "a", "expected", "integral"),
    [
        ("neg", (-2.0, 5.0), (-5.0, 2.0), False),
        ("abs", (1.0, 3.0), (1.0, 3.0), False),
        ("abs", (-3.0, -1.0), (1.0, 3.0), False),
        ("abs", (-4.0, 3.0), (0.0, 4.0), False),
        ("floor", (-1.5, 2.5), (-2.0, 2.0), True),
        ("ceil", (-1.5, 2.5), (-1.0, 3.0), True),
        ("round", (-1.5, 2.25), (-2.0, 3.0), True),  # widened to cover either rounding
        ("floor", (-INF, 2.5), (-INF, 2.0), True),  # infinities pass through
        ("ceil", (0.5, INF), (1.0, INF), True),
        ("relu", (-3.0, 2.0), (0.0, 2.0), False),
        ("relu", (-3.0, -1.0), (0.0, 0.0), False),
    ],
)
def test_unary_rules(name: str, a: Interval, expected: Interval, integral: bool) -> None:
    fn, is_integral = UNARY[name]
    assert fn(a) == expected
    assert is_integral is integral


_NUMPY_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "max": np.maximum, "min": np.minimum, "mod": np.fmod,
}


@pytest.mark.parametrize("name", sorted(_NUMPY_BINARY))
def test_binary_rules_are_sound_on_sampled_points(name: str) -> None:
    rng = np.random.default_rng(0)
    fn = _NUMPY_BINARY[name]
    for _ in range(200):
        a = tuple(sorted(rng.integers(-20, 21, 2).astype(float)))
        b = tuple(sorted(rng.integers(-20, 21, 2).astype(float)))
        if name in ("div", "mod") and b[0] <= 0.0 <= b[1]:
            continue  # division by zero: the rule's answer is (-inf, inf) or undefined points
        lo, hi = BINARY[name](a, b)
        x = np.concatenate([a, rng.uniform(*a, 50)])
        y = np.concatenate([b, rng.uniform(*b, 50)])
        values = fn(x[:, None], y[None, :])
        assert lo <= values.min() + 1e-9 and values.max() - 1e-9 <= hi, (a, b, (lo, hi))


def test_mul_takes_zero_times_infinity_as_zero() -> None:
    assert mul((0.0, 0.0), (-INF, INF)) == (0.0, 0.0)
    assert mul((0.0, 2.0), (3.0, INF)) == (0.0, INF)


def test_div_is_mul_by_the_reciprocal_interval() -> None:
    assert div((3.0, 6.0), (2.0, 3.0)) == mul((3.0, 6.0), (1 / 3, 0.5))
    assert div((-1.0, 1.0), (-INF, -2.0)) == (-0.5, 0.5)


def test_mod_and_abs_directly() -> None:
    assert mod((5.0, 9.0), (2.0, 3.0)) == (0.0, 3.0)
    assert mod((5.0, 9.0), (-3.0, 2.0)) == (-3.0, 3.0)
    assert interval_abs((-INF, -2.0)) == (2.0, INF)


def test_clean_turns_nan_into_the_unknown_interval() -> None:
    assert clean(1.0, 2.0) == (1.0, 2.0)
    assert clean(math.nan, 2.0) == (-INF, INF)
    assert clean(1.0, math.nan) == (-INF, INF)
    # inf - inf: "add" of opposite infinities would give NaN; elementwise cleans it.
    bound = elementwise(BINARY["add"], [Bound(-INF, 0.0, False), Bound(0.0, INF, False)], False)
    assert (bound.lo, bound.hi) == (-INF, INF)


def test_bound_helpers() -> None:
    bound = Bound(-7.0, 3.0, True, ((-7.0, -7.0), (3.0, 3.0)))
    assert bound.magnitude == 7.0
    assert bound.whole() == Bound(-7.0, 3.0, True)
    assert UNKNOWN.magnitude == INF and not UNKNOWN.integral
    assert (BOOL.lo, BOOL.hi, BOOL.integral) == (0.0, 1.0, True)


def test_from_elems_bounds_the_elements_and_drops_long_vectors() -> None:
    bound = from_elems([(1.0, 2.0), (-3.0, 0.0), (5.0, 5.0)], True)
    assert (bound.lo, bound.hi, bound.integral) == (-3.0, 5.0, True)
    assert bound.elems == ((1.0, 2.0), (-3.0, 0.0), (5.0, 5.0))
    long = from_elems([(float(i), float(i)) for i in range(MAX_ELEMS + 1)], True)
    assert (long.lo, long.hi) == (0.0, float(MAX_ELEMS)) and long.elems is None
    at_limit = from_elems([(0.0, 0.0)] * MAX_ELEMS, False)
    assert at_limit.elems is not None and len(at_limit.elems) == MAX_ELEMS
    assert from_elems([], True) == Bound(0.0, 0.0, True, ())


def test_element_broadcasts_a_single_element() -> None:
    one = Bound(4.0, 4.0, True, ((4.0, 4.0),))
    many = Bound(0.0, 2.0, True, ((0.0, 0.0), (1.0, 1.0), (2.0, 2.0)))
    assert [element(one, i) for i in range(3)] == [(4.0, 4.0)] * 3
    assert [element(many, i) for i in range(3)] == [(0.0, 0.0), (1.0, 1.0), (2.0, 2.0)]


def test_elementwise_per_element_with_broadcasting() -> None:
    shape = Bound(1.0, 3.0, True, ((1.0, 1.0), (2.0, 2.0), (3.0, 3.0)))
    scalar = Bound(10.0, 10.0, True, ((10.0, 10.0),))
    result = elementwise(BINARY["mul"], [shape, scalar], True)
    assert result.elems == ((10.0, 10.0), (20.0, 20.0), (30.0, 30.0))
    assert (result.lo, result.hi, result.integral) == (10.0, 30.0, True)
    # Per element, max(x - 2, 0) keeps each element's own bound (not the whole interval's).
    shifted = elementwise(BINARY["sub"], [shape, Bound(2.0, 2.0, True, ((2.0, 2.0),))], True)
    relu = elementwise(UNARY["relu"][0], [shifted], True)
    assert relu.elems == ((0.0, 0.0), (0.0, 0.0), (1.0, 1.0))


def test_elementwise_falls_back_to_whole_intervals() -> None:
    shape = Bound(1.0, 3.0, True, ((1.0, 1.0), (2.0, 2.0), (3.0, 3.0)))
    # An operand without elements, or lengths that do not broadcast: whole intervals.
    for other in (Bound(-1.0, 1.0, True), Bound(0.0, 1.0, True, ((0.0, 0.0), (1.0, 1.0)))):
        result = elementwise(BINARY["add"], [shape, other], True)
        assert result.elems is None
        assert (result.lo, result.hi) == BINARY["add"]((1.0, 3.0), (other.lo, other.hi))


def test_singletons_integral() -> None:
    assert singletons_integral(Bound(3.0, 3.0, True))
    assert singletons_integral(Bound(1.0, 4.0, True, ((1.0, 1.0), (4.0, 4.0))))
    assert not singletons_integral(Bound(1.0, 4.0, True))  # a range, not one value
    assert not singletons_integral(Bound(0.5, 0.5, False))
    assert not singletons_integral(Bound(INF, INF, False))
    assert not singletons_integral(Bound(1.0, 4.0, True, ((1.0, 1.0), (2.0, 4.0))))


def test_unary_rules_are_sound_on_sampled_points() -> None:
    numpy_unary = {
        "neg": np.negative, "abs": np.abs, "floor": np.floor, "ceil": np.ceil,
        "round": np.round, "relu": lambda x: np.maximum(x, 0.0),
    }
    assert set(numpy_unary) == set(UNARY)
    rng = np.random.default_rng(1)
    for name, (fn, integral) in UNARY.items():
        for _ in range(100):
            first, second = sorted(float(v) for v in rng.uniform(-10, 10, 2))
            lo_hi = (first, second)
            lo, hi = fn(lo_hi)
            values = numpy_unary[name](np.concatenate([lo_hi, rng.uniform(*lo_hi, 50)]))
            assert lo <= values.min() and values.max() <= hi, (name, lo_hi, (lo, hi))
            if integral:
                assert float(lo).is_integer() and float(hi).is_integer()
