"""Value bounds for the integer-semantics analysis (:mod:`mixprec.analysis.integer_semantics`).

Intervals, with an "all integral" flag and per-element intervals of short 1-D values, go through
Shape and Size of static dimensions, integer and bool type ranges (int8, uint8, int4 ...), small
constants (at most 4,096 elements; larger ones are weights and never read), Gather/Slice/Concat
of them and the op facts' ``interval`` rules (`policy/tables/opfacts.toml`); anything else is
unbounded. Integer results are whole numbers within their type's range. A value is exact when it
is integral with magnitude at most ``exact_int_max``, or a single known value representable in
the target type. The interval arithmetic itself lives in :mod:`mixprec.analysis.intervals`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import constant_tensor, is_constant, read_array
from mixprec.analysis.intervals import (
    BINARY,
    BOOL,
    INF,
    MAX_ELEMS,
    UNARY,
    UNKNOWN,
    Bound,
    ceil,
    elementwise,
    floor,
    from_elems,
    singletons_integral,
)
from mixprec.dtypes import LowPrecision
from mixprec.graphs import is_default_domain
from mixprec.policy.opfacts import OpFacts

# Constants larger than this are weights, not index arithmetic: their values are not read.
_MAX_CONSTANT_ELEMENTS = 4096

# `DataType.is_integer` builds a set per call; this runs for every value of the model.
INTEGER_TYPES = frozenset(dtype for dtype in ir.DataType if dtype.is_integer())
INTEGER_OR_BOOL_TYPES = INTEGER_TYPES | {ir.DataType.BOOL}


def attr_int(node: ir.Node, name: str, default: int | None) -> int | None:
    """The node's integer attribute `name`, or `default` when it is absent."""
    attributes = node.attributes
    # Not `attributes.get`: the mapping's generic `get` raises and catches KeyError when absent.
    if name not in attributes:
        return default
    return int(attributes[name].as_int())


def is_integer_type(dtype: ir.DataType | None) -> bool:
    """Whether `dtype` is an integer element type (bool is not)."""
    return dtype in INTEGER_TYPES


def _type_bound(dtype: ir.DataType | None) -> Bound:
    """The range of an integer or bool element type."""
    if dtype == ir.DataType.BOOL:
        return BOOL
    if not is_integer_type(dtype):
        return UNKNOWN
    bits = dtype.bitwidth  # type: ignore[union-attr]
    if dtype.is_signed():  # type: ignore[union-attr]
        return Bound(-float(2 ** (bits - 1)), float(2 ** (bits - 1) - 1), True)
    return Bound(0.0, float(2**bits - 1), True)


def _array_bound(array: np.ndarray) -> Bound | None:
    """The bound of a constant's integer, float or bool values; None when some are not finite."""
    flat = array.astype(np.float64).reshape(-1)
    if flat.size == 0:
        return Bound(0.0, 0.0, True, ())
    if not np.isfinite(flat).all():
        return None
    integral = bool((flat == np.round(flat)).all())
    if array.ndim <= 1 and flat.size <= MAX_ELEMS:
        return from_elems([(float(x), float(x)) for x in flat], integral)
    return Bound(float(flat.min()), float(flat.max()), integral)


def _as_integer(bound: Bound, limits: Bound) -> Bound:
    """`bound` for an integer result: whole numbers within the type's range `limits` (the bound
    is a claim about correct, non-wrapping arithmetic)."""
    elems = None
    if bound.elems is not None:
        elems = tuple(
            (max(floor(lo), limits.lo), min(ceil(hi), limits.hi)) for lo, hi in bound.elems
        )
    if elems is not None and any(lo > hi for lo, hi in elems):
        elems = None
    lo, hi = max(floor(bound.lo), limits.lo), min(ceil(bound.hi), limits.hi)
    return Bound(lo, hi, True, elems) if lo <= hi else limits


def _first(array: np.ndarray) -> int:
    """The first element of a constant index array."""
    return int(array.reshape(-1)[0])


def _given(node: ir.Node, index: int) -> bool:
    """Whether the node has optional input `index`."""
    return len(node.inputs) > index and node.inputs[index] is not None


class ValueBounds:
    """The bounds of a model's values: recorded node by node in topological order, else read
    lazily from constants and element types."""

    def __init__(self, facts: dict[ir.Node, OpFacts], target: LowPrecision) -> None:
        self.facts = facts
        self.target = target
        self.limit = target.limits.exact_int_max
        self.known: dict[ir.Value, Bound] = {}

    def constant_array(self, value: ir.Value) -> np.ndarray | None:
        """The values of a small constant; None for non-constants, weights and unreadable ones."""
        tensor = constant_tensor(value) if is_constant(value) else None
        if tensor is None or tensor.size > _MAX_CONSTANT_ELEMENTS:
            return None
        try:
            return read_array(tensor)
        except Exception:  # noqa: BLE001 - unreadable or exotic types: no bound
            return None

    def bound(self, value: ir.Value | None) -> Bound:
        """The bound of `value`: recorded, else from its constant values or element type."""
        if value is None:
            return UNKNOWN
        known = self.known.get(value)
        if known is not None:
            return known
        result = _type_bound(value.dtype)
        array = self.constant_array(value)
        if array is not None and array.dtype.kind in "iufb":
            found = _array_bound(array)
            if found is not None:
                result = found
        self.known[value] = result
        return result

    def shape_bound(self, node: ir.Node, size: bool) -> Bound:
        """The bound of a Shape (`size` False) or Size output of the node's input."""
        shape = node.inputs[0].shape if node.inputs and node.inputs[0] is not None else None
        if shape is None:
            return Bound(0.0, INF, True)
        dims = [(float(d), float(d)) if isinstance(d, int) else (0.0, INF) for d in shape.dims]
        if size:
            if all(lo == hi for lo, hi in dims):
                product = float(math.prod(lo for lo, _ in dims))
                return Bound(product, product, True, ((product, product),))
            return Bound(0.0, INF, True)
        start = attr_int(node, "start", 0)
        end = attr_int(node, "end", None)
        return from_elems(dims[start:end], True)

    def _index_arrays(self, node: ir.Node) -> list[np.ndarray | None]:
        return [self.constant_array(v) if v is not None else None for v in node.inputs[1:]]

    def gathered(self, node: ir.Node, data: Bound) -> Bound:
        """Gather of a 1-D value with constant indices; else the data's interval."""
        if data.elems is None:
            return data.whole()
        elems = list(data.elems)
        arrays = self._index_arrays(node)
        indices = arrays[0] if arrays else None
        if indices is None or attr_int(node, "axis", 0) not in (0, -1):
            return data.whole()
        picked = []
        for index in indices.reshape(-1).tolist():
            index = int(index) + (len(elems) if index < 0 else 0)
            if not 0 <= index < len(elems):
                return data.whole()
            picked.append(elems[index])
        return from_elems(picked, data.integral)

    def _slice_arguments(self, node: ir.Node) -> tuple[int, int, int] | None:
        """(start, end, step) of a Slice along axis 0 with constant arguments; else None."""
        starts, ends, axes, steps = (self._index_arrays(node) + [None] * 4)[:4]
        if starts is None or ends is None or starts.size != 1 or ends.size != 1:
            return None
        if _given(node, 3) and (axes is None or _first(axes) not in (0, -1)):
            return None
        if _given(node, 4) and (steps is None or _first(steps) == 0):
            return None
        step = _first(steps) if steps is not None else 1
        return _first(starts), _first(ends), step

    def sliced(self, node: ir.Node, data: Bound) -> Bound:
        """Slice of a 1-D value with constant starts, ends, axes and steps; else the interval."""
        if data.elems is None:
            return data.whole()
        arguments = self._slice_arguments(node)
        if arguments is None:
            return data.whole()
        start, end, step = arguments
        return from_elems(list(data.elems)[start:end:step], data.integral)

    def _output_bounds(self, node: ir.Node) -> list[Bound] | None:
        rule = self.facts[node].interval
        if rule is None or not is_default_domain(node.domain):
            return None
        if rule in _SHAPE_RULES:
            return INTERVAL_RULES[rule](self, node, [])
        operands = [self.bound(v) for v in node.inputs if v is not None]
        if not operands:
            return None
        return INTERVAL_RULES[rule](self, node, operands)

    def _settled(self, out: ir.Value, bound: Bound | None) -> Bound | None:
        """The bound to record for output `out` from its rule's `bound` (None: no rule); None
        when it is read lazily from the constant."""
        if out.dtype == ir.DataType.BOOL:
            bound = BOOL
        elif bound is None:
            if is_constant(out):
                return None
            bound = _type_bound(out.dtype)
        elif is_integer_type(out.dtype):
            bound = _as_integer(bound, _type_bound(out.dtype))
        if bound.elems is not None and (out.shape is None or out.shape.rank() > 1):
            bound = bound.whole()
        return bound

    def record(self, node: ir.Node) -> None:
        """Record the bounds of the node's outputs, from its interval rule or their types."""
        bounds = self._output_bounds(node)
        for index, out in enumerate(node.outputs):
            if out is None:
                continue
            bound = bounds[index] if bounds is not None and index < len(bounds) else None
            settled = self._settled(out, bound)
            if settled is not None:
                self.known[out] = settled

    def exact(self, value: ir.Value) -> bool:
        """Whether every element of `value` is provably exact in the 16-bit type."""
        bound = self.bound(value)
        if bound.integral and bound.magnitude <= self.limit:
            return True
        if bound.lo == bound.hi and math.isfinite(bound.lo):
            with np.errstate(over="ignore"):  # beyond the 16-bit range: inf, not exact
                rounded = np.array(bound.lo, dtype=np.float64).astype(self.target.numpy_dtype)
            return float(rounded.astype(np.float64)) == bound.lo
        return False


# -- interval rules (the `interval` fact): (bounds, node, bounds of its inputs) -> outputs --------

_IntervalRule = Callable[[ValueBounds, ir.Node, list[Bound]], list[Bound] | None]
_SHAPE_RULES = frozenset({"shape", "size"})  # read the input's shape: no operand bounds


def _same(bounds: ValueBounds, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    return [bounds.bound(node.inputs[0])]


def _whole(bounds: ValueBounds, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    return [bounds.bound(node.inputs[0]).whole()] * len(node.outputs)


def _concat(bounds: ValueBounds, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    if all(b.elems is not None for b in operands):
        elems = [e for b in operands for e in b.elems]  # type: ignore[union-attr]
        return [from_elems(elems, all(b.integral for b in operands))]
    return [
        elementwise(
            lambda *xs: (min(x[0] for x in xs), max(x[1] for x in xs)),
            [b.whole() for b in operands],
            all(b.integral for b in operands),
        )
    ]


def _cast(bounds: ValueBounds, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    if attr_int(node, "to", None) == ir.DataType.BOOL:
        return [BOOL]
    return [bounds.bound(node.inputs[0])]  # integer targets are widened to integers later


def _unary(name: str) -> _IntervalRule:
    fn, integral_result = UNARY[name]

    def rule(bounds: ValueBounds, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
        integral = integral_result or all(b.integral for b in operands)
        return [elementwise(fn, [bounds.bound(node.inputs[0])], integral)]

    return rule


def _binary(name: str) -> _IntervalRule:
    fn = BINARY[name]

    def rule(bounds: ValueBounds, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
        integral = all(b.integral for b in operands)
        bound = operands[0]
        for other in operands[1:]:
            bound = elementwise(fn, [bound, other], integral)
        if name == "div" and not singletons_integral(bound):
            bound = Bound(bound.lo, bound.hi, False, bound.elems)
        return [bound]

    return rule


def _where(bounds: ValueBounds, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    if len(node.inputs) != 3:
        return None
    a, b = bounds.bound(node.inputs[1]), bounds.bound(node.inputs[2])
    return [Bound(min(a.lo, b.lo), max(a.hi, b.hi), a.integral and b.integral)]


def _clip(bounds: ValueBounds, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    inputs = node.inputs
    first = bounds.bound(inputs[0])
    lo, hi = first.lo, first.hi
    if len(inputs) > 1 and inputs[1] is not None:
        lo = max(lo, bounds.bound(inputs[1]).lo)
    if len(inputs) > 2 and inputs[2] is not None:
        hi = min(hi, bounds.bound(inputs[2]).hi)
    return [Bound(min(lo, hi), max(lo, hi), all(b.integral for b in operands))]


def _range(bounds: ValueBounds, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    if len(node.inputs) != 3:
        return None
    start, limit = bounds.bound(node.inputs[0]), bounds.bound(node.inputs[1])
    integral = all(b.integral for b in operands)
    return [Bound(min(start.lo, limit.lo), max(start.hi, limit.hi), integral)]


INTERVAL_RULES: dict[str, _IntervalRule] = {
    "same": _same,
    "whole": _whole,
    "gather": lambda bounds, node, _: [bounds.gathered(node, bounds.bound(node.inputs[0]))],
    "slice": lambda bounds, node, _: [bounds.sliced(node, bounds.bound(node.inputs[0]))],
    "concat": _concat,
    "cast": _cast,
    "where": _where,
    "clip": _clip,
    "range": _range,
    "shape": lambda bounds, node, _: [bounds.shape_bound(node, size=False)],
    "size": lambda bounds, node, _: [bounds.shape_bound(node, size=True)],
    **{name: _unary(name) for name in UNARY},
    **{name: _binary(name) for name in BINARY},
}
