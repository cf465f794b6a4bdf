"""Integer semantics: float values that carry integer meaning stay FP32.

Exporters of audio and speech models compute sequence lengths in float, e.g.
``Cast(Shape(x)[1] -> float) - 400) / 160 -> Floor -> Cast(-> int64)``. Integers are exact only
up to 2048 in float16 and 256 in bfloat16, so in 16 bits a length of 1500 frames becomes 1504.
This analysis finds such values from the graph alone (no data) and names the nodes the planner
must keep FP32 (category ``INTEGER``).

The rule, on FP32 values:

* **Sources** (forward taint): ``Cast`` from an integer or bool type (which covers Shape and
  Size results, length inputs, integer Range), float Range over tainted bounds, and small
  constants (at most 4,096 elements) whose values are all integers, one beyond
  ``exact_int_max``.
* **Carriers**: arithmetic and data movement (Add, Sub, Mul, Div, Floor, Ceil, Round, Neg, Abs,
  Max, Min, Mod, Sum, Relu, Clip, Reshape, Concat, Gather, Slice, Squeeze, Unsqueeze, Identity,
  Expand, Tile, Transpose, Split, Where, Cast, and MatMul/Gemm that contract over a static
  dimension of 1: outer products such as positions times inverse frequencies). Which op is
  what comes from the op facts (`policy/tables/opfacts.toml`: ``carrier``, ``interval``,
  ``comparison``, ``exact_use``, ``integer_inputs``, ``shape_only``, ``random``). The taint goes
  forward only when every FP32 input is tainted or *data-free* (computed from constants and
  shapes only): an activation mixed with an integer (``mask * x``, ``x / length``) is
  ordinary data and stops it.
* **Integer sinks** (backward taint): the input of a Cast to an integer type (which covers the
  integer shape arguments of Reshape, Expand, Tile, ConstantOfShape, Slice, TopK, Resize
  sizes ...), every input of Range, Resize/Upsample scales, OneHot indices and depth, and the
  operands of comparisons between integer values. Backward taint goes through carriers whose
  output is tainted forward, so Floor/Ceil/Round on integer values feeding such a Cast are
  sinks too.
* **Exact uses**: uses that need the absolute value of an integer tainted from a Cast even
  where it meets activations: Sin/Cos/Tan (positions), comparisons, Mod, model outputs, control
  flow and ops outside the standard domain. Backward through tainted carriers like sinks.
* **Kept FP32**: a node with a tainted FP32 output that (a) lies on a path from a source to an
  integer sink, or (b) descends from a Cast of an integer and reaches an exact use, *unless*
  every tainted value it reads or writes is provably exact in the 16-bit type.
* **Bounds**: intervals, with an "all integral" flag, go through Shape of static dimensions,
  integer type ranges (int8, uint8, int4 ...), constants, Gather/Slice/Concat of them and the
  arithmetic above; anything else is unbounded. A value is exact when it is integral with
  magnitude at most ``exact_int_max``, or a single known value representable in the target
  type (``Shape(x)[1] / 2`` with a static 64 converts).

Left alone on purpose: activations that end in Floor/Round and a Cast (quantised outputs,
argmax-like flows) have no integer source; large constants that meet activations (-1e4 mask
fills, a RoPE base) are no integer arithmetic; an integer that is mixed into activations by
other ops (a length that normalises features, ``q * rsqrt(head_size)``, an int64 attention
mask turned into an additive bias, a Cast of indices fed to a MatMul with weights) loses no
more there than any 16-bit value, and keeping it FP32 would drag the activations it meets to
FP32 too; large weights are never read.

Subgraphs and functions: a subgraph's formal inputs are tainted when an FP32 input of the node
owning it is, and backward taint on them reaches the owner's inputs; outputs of subgraphs and
function bodies count as integer sinks; an owner's outputs are tainted when a subgraph output is.

One forward and one backward pass over the topological order: linear in the model size. The
backward pass is skipped when no float value carries integers (then no node is kept).

Interval arithmetic lives in :mod:`mixprec.analysis.intervals`; this module is the analysis
itself (both passes share its state), which is why it is longer than the others.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import constant_tensor, is_constant
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
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.graphs import format_op_name, is_default_domain, subgraphs_of, walk_nodes
from mixprec.policy.opfacts import Carrier, OpFacts, op_facts

logger = logging.getLogger(__name__)

# Constants larger than this are weights, not index arithmetic: their values are not read.
_MAX_CONSTANT_ELEMENTS = 4096

@dataclass(frozen=True)
class _Taint:
    """Forward taint: where an integer-meaning float value comes from."""

    origin: str
    from_cast: bool  # descends from a Cast of an integer (else only from integer constants)


def _attr_int(node: ir.Node, name: str, default: int | None) -> int | None:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.as_int())


# `DataType.is_integer` builds a set per call; this runs for every value of the model.
_INTEGER_TYPES = frozenset(dtype for dtype in ir.DataType if dtype.is_integer())
_INTEGER_OR_BOOL_TYPES = _INTEGER_TYPES | {ir.DataType.BOOL}


def _is_integer_type(dtype: ir.DataType | None) -> bool:
    return dtype in _INTEGER_TYPES


def _fp32_values(values: Sequence[ir.Value | None]) -> list[ir.Value]:
    return [v for v in values if v is not None and is_fp32_tensor(v)]


def _is_outer_product(node: ir.Node) -> bool:
    """Whether a MatMul/Gemm contracts over a static dimension of 1 (no sums: an outer product)."""
    first = node.inputs[0] if node.inputs else None
    shape = first.shape if first is not None else None
    if shape is None or len(shape) == 0:
        return False
    transposed = _attr_int(node, "transA", 0)  # Gemm; MatMul has no such attribute
    return shape[0 if transposed else -1] == 1


def _type_bound(dtype: ir.DataType | None) -> Bound:
    """The range of an integer or bool element type."""
    if dtype == ir.DataType.BOOL:
        return BOOL
    if not _is_integer_type(dtype):
        return UNKNOWN
    bits = dtype.bitwidth  # type: ignore[union-attr]
    if dtype.is_signed():  # type: ignore[union-attr]
        return Bound(-float(2 ** (bits - 1)), float(2 ** (bits - 1) - 1), True)
    return Bound(0.0, float(2**bits - 1), True)


class _Analysis:
    def __init__(self, model: ir.Model, target: LowPrecision) -> None:
        self.target = target
        self.limit = target.limits.exact_int_max
        self.order: list[ir.Node] = []
        for function in model.functions.values():
            self.order.extend(walk_nodes(function))
        self.order.extend(walk_nodes(model.graph))
        self.facts: dict[ir.Node, OpFacts] = {n: op_facts(n.domain, n.op_type) for n in self.order}
        self.bounds: dict[ir.Value, Bound] = {}
        self.taint: dict[ir.Value, _Taint | None] = {}
        self.int_origin: dict[ir.Value, str] = {}
        self.sink: dict[ir.Value, str] = {}
        self.exact_use: dict[ir.Value, str] = {}
        self.data_free: dict[ir.Value, bool] = {}
        self.formal_owner: dict[ir.Value, ir.Node] = {}
        self.boundary_outputs: dict[ir.Value, str] = {}
        self.owners: set[ir.Node] = set()  # nodes with subgraphs
        for node in self.order:
            subgraphs = subgraphs_of(node) if node.attributes else []
            if subgraphs:
                self.owners.add(node)
            for sub in subgraphs:
                for value in sub.inputs:
                    self.formal_owner[value] = node
                for value in sub.outputs:
                    self.boundary_outputs.setdefault(
                        value, f"an output of a {node.op_type} subgraph"
                    )
        for function in model.functions.values():
            for value in function.outputs:
                self.boundary_outputs.setdefault(value, f"an output of function {function.name!r}")
        self.model_outputs = [v for v in model.graph.outputs if v is not None]

    # -- bounds -------------------------------------------------------------------------
    def constant_array(self, value: ir.Value) -> np.ndarray | None:
        tensor = constant_tensor(value) if is_constant(value) else None
        if tensor is None or tensor.size > _MAX_CONSTANT_ELEMENTS:
            return None
        try:
            return np.asarray(tensor.numpy())
        except Exception:  # noqa: BLE001 - unreadable or exotic types: no bound
            return None

    def bound(self, value: ir.Value | None) -> Bound:
        if value is None:
            return UNKNOWN
        known = self.bounds.get(value)
        if known is not None:
            return known
        result = _type_bound(value.dtype)
        array = self.constant_array(value)
        if array is not None and array.dtype.kind in "iufb":
            flat = array.astype(np.float64).reshape(-1)
            if flat.size == 0:
                result = Bound(0.0, 0.0, True, ())
            elif np.isfinite(flat).all():
                integral = bool((flat == np.round(flat)).all())
                if array.ndim <= 1 and flat.size <= MAX_ELEMS:
                    result = from_elems([(float(x), float(x)) for x in flat], integral)
                else:
                    result = Bound(float(flat.min()), float(flat.max()), integral)
        self.bounds[value] = result
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
        start = _attr_int(node, "start", 0)
        end = _attr_int(node, "end", None)
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
        if indices is None or _attr_int(node, "axis", 0) not in (0, -1):
            return data.whole()
        picked = []
        for index in indices.reshape(-1).tolist():
            index = int(index) + (len(elems) if index < 0 else 0)
            if not 0 <= index < len(elems):
                return data.whole()
            picked.append(elems[index])
        return from_elems(picked, data.integral)

    def sliced(self, node: ir.Node, data: Bound) -> Bound:
        """Slice of a 1-D value with constant starts, ends, axes and steps; else the interval."""
        if data.elems is None:
            return data.whole()
        elems = list(data.elems)
        arrays = self._index_arrays(node)
        starts, ends = (arrays + [None, None])[:2]
        axes = arrays[2] if len(arrays) > 2 else None
        steps = arrays[3] if len(arrays) > 3 else None
        present = [len(node.inputs) > i and node.inputs[i] is not None for i in (3, 4)]
        if starts is None or ends is None or starts.size != 1 or ends.size != 1:
            return data.whole()
        if (present[0] and (axes is None or int(axes.reshape(-1)[0]) not in (0, -1))) or (
            present[1] and (steps is None or int(steps.reshape(-1)[0]) == 0)
        ):
            return data.whole()
        step = int(steps.reshape(-1)[0]) if steps is not None else 1
        picked = elems[int(starts.reshape(-1)[0]) : int(ends.reshape(-1)[0]) : step]
        return from_elems(picked, data.integral)

    def _output_bounds(self, node: ir.Node) -> list[Bound] | None:
        rule = self.facts[node].interval
        if rule is None or not is_default_domain(node.domain):
            return None
        if rule in _SHAPE_RULES:
            return _INTERVAL_RULES[rule](self, node, [])
        operands = [self.bound(v) for v in node.inputs if v is not None]
        if not operands:
            return None
        return _INTERVAL_RULES[rule](self, node, operands)

    def _record_bounds(self, node: ir.Node) -> None:
        if not self.facts[node].shape_only and not any(
            v is not None
            and (self.taint.get(v) is not None or v.dtype in _INTEGER_OR_BOOL_TYPES)
            for v in node.inputs
        ):
            return  # no integer chain: unbounded floats, typed integers (both read lazily)
        bounds = self._output_bounds(node)
        for index, out in enumerate(node.outputs):
            if out is None:
                continue
            bound = bounds[index] if bounds is not None and index < len(bounds) else None
            if out.dtype == ir.DataType.BOOL:
                bound = BOOL
            elif bound is None:
                if is_constant(out):
                    continue  # read lazily from the constant
                bound = _type_bound(out.dtype)
            elif _is_integer_type(out.dtype):
                # Integer results: whole numbers, within the type's range (the bound is a claim
                # about correct, non-wrapping arithmetic).
                limits = _type_bound(out.dtype)
                elems = None
                if bound.elems is not None:
                    elems = tuple(
                        (max(floor(lo), limits.lo), min(ceil(hi), limits.hi))
                        for lo, hi in bound.elems
                    )
                if elems is not None and any(lo > hi for lo, hi in elems):
                    elems = None
                lo, hi = max(floor(bound.lo), limits.lo), min(ceil(bound.hi), limits.hi)
                bound = Bound(lo, hi, True, elems) if lo <= hi else limits
            if bound.elems is not None and (out.shape is None or out.shape.rank() > 1):
                bound = bound.whole()
            self.bounds[out] = bound

    def exact(self, value: ir.Value) -> bool:
        """Whether every element of `value` is provably exact in the 16-bit type."""
        bound = self.bound(value)
        if bound.integral and bound.magnitude <= self.limit:
            return True
        if bound.lo == bound.hi and math.isfinite(bound.lo):
            rounded = np.array(bound.lo, dtype=np.float64).astype(self.target.numpy_dtype)
            return float(rounded.astype(np.float64)) == bound.lo
        return False

    # -- forward: integer-meaning sources -----------------------------------------------
    def taint_of(self, value: ir.Value) -> _Taint | None:
        if value in self.taint:
            return self.taint[value]
        result: _Taint | None = None
        owner = self.formal_owner.get(value)
        if owner is not None and is_fp32_tensor(value):
            outer = [self.taint_of(v) for v in _fp32_values(owner.inputs)]
            found = next((t for t in outer if t is not None), None)
            if found is not None:
                result = _Taint(found.origin, any(t is not None and t.from_cast for t in outer))
        elif is_fp32_tensor(value) and is_constant(value):
            bound = self.bound(value)
            if (
                self.constant_array(value) is not None
                and bound.integral
                and bound.magnitude > self.limit
            ):
                result = _Taint(
                    f"integer constant {value.name!r} (up to {bound.magnitude:g})", False
                )
        self.taint[value] = result
        return result

    def origin_of_int(self, value: ir.Value) -> str:
        known = self.int_origin.get(value)
        if known is not None:
            return known
        kind = value.dtype.name.lower() if value.dtype is not None else "integer"
        producer = value.producer()
        if is_constant(value):
            origin = f"{kind} constant {value.name!r}"
        elif producer is None:
            origin = f"{kind} input {value.name!r}"
        else:
            origin = f"{producer.op_type} output {value.name!r}"
        self.int_origin[value] = origin
        return origin

    def _record_int_origin(self, node: ir.Node) -> None:
        outs = [o for o in node.outputs if o is not None and not is_fp32_tensor(o)]
        if not outs or not is_default_domain(node.domain):
            return
        facts = self.facts[node]
        origin: str | None = None
        if facts.shape_only and node.inputs and node.inputs[0] is not None:
            origin = f"{node.op_type} of {node.inputs[0].name!r}"
        elif facts.carrier is not None:
            for value in node.inputs:
                if value is None:
                    continue
                if is_fp32_tensor(value):
                    taint = self.taint_of(value)
                    if taint is not None:
                        origin = taint.origin
                        break
                elif _is_integer_type(value.dtype) and not is_constant(value):
                    origin = self.origin_of_int(value)
                    break
        if origin is not None:
            for out in outs:
                self.int_origin[out] = origin

    def is_data_free(self, value: ir.Value) -> bool:
        """Whether the value is computed from constants and shapes only (no input data)."""
        known = self.data_free.get(value)
        if known is None:
            known = is_constant(value)
            self.data_free[value] = known
        return known

    def _record_data_free(self, node: ir.Node) -> None:
        facts = self.facts[node]
        std = is_default_domain(node.domain)
        if facts.shape_only and std:
            free = True
        elif node in self.owners or facts.random or not std:
            free = False
        else:
            free = all(self.is_data_free(v) for v in node.inputs if v is not None)
        for out in node.outputs:
            if out is not None:
                self.data_free[out] = free or is_constant(out)

    def integer_operands(self, node: ir.Node) -> bool:
        """At least one FP32 input is tainted, and every other is tainted or data-free."""
        if self.facts[node].carrier is Carrier.OUTER_PRODUCT and not _is_outer_product(node):
            return False
        values = _fp32_values(node.inputs)
        # Activations first: constants are read only when every other input qualifies.
        if any(not self.is_data_free(v) and self.taint_of(v) is None for v in values):
            return False
        return any(self.taint_of(v) is not None for v in values)

    def _record_taint(self, node: ir.Node) -> bool:
        """Record the taint of the node's FP32 outputs; whether one of them is tainted."""
        outs = _fp32_values(node.outputs)
        if not outs:
            return False
        result: _Taint | None = None
        facts = self.facts[node]
        if node in self.owners:
            subgraphs = subgraphs_of(node)
            inner = [self.taint_of(v) for sub in subgraphs for v in _fp32_values(sub.outputs)]
            found = next((t for t in inner if t is not None), None)
            if found is not None:
                result = _Taint(found.origin, any(t is not None and t.from_cast for t in inner))
        elif not is_default_domain(node.domain):
            result = None
        elif node.op_type == "Cast" and node.inputs and node.inputs[0] is not None:
            source = node.inputs[0]
            if source.dtype == ir.DataType.BOOL:
                result = _Taint(f"bool {source.name!r}", True)
            elif _is_integer_type(source.dtype):
                result = _Taint(self.origin_of_int(source), True)
            elif is_fp32_tensor(source):
                result = self.taint_of(source)
        elif facts.carrier is Carrier.GENERATOR:
            # Float positions from integer bounds (Range): integers themselves.
            taints = [self.taint_of(v) for v in _fp32_values(node.inputs)]
            result = next((t for t in taints if t is not None), None)
        elif facts.carries_floats and self.integer_operands(node):
            taints = [self.taint_of(v) for v in _fp32_values(node.inputs)]
            first = next(t for t in taints if t is not None)
            result = _Taint(first.origin, any(t is not None and t.from_cast for t in taints))
        for out in outs:
            if is_constant(out):
                self.taint_of(out)
            else:
                self.taint[out] = result
        return any(self.taint[out] is not None for out in outs)

    # -- backward: integer-meaning sinks and uses that need exact values ----------------
    def _mark(self, table: dict[ir.Value, str], value: ir.Value | None, why: str) -> None:
        if value is None or not is_fp32_tensor(value) or value in table:
            return
        table[value] = why
        owner = self.formal_owner.get(value)
        if owner is not None:
            for outer in _fp32_values(owner.inputs):
                self._mark(table, outer, why)

    def _propagate(self, node: ir.Node) -> None:
        std = is_default_domain(node.domain)
        facts = self.facts[node]
        op = format_op_name(node.domain, node.op_type)
        inputs = node.inputs
        if std and node.op_type == "Cast" and inputs and inputs[0] is not None:
            to = _attr_int(node, "to", None)
            if to is not None and to != ir.DataType.BOOL and ir.DataType(to).is_integer():
                self._mark(self.sink, inputs[0], f"Cast to {ir.DataType(to).name.lower()}")
        if facts.integer_inputs:
            roles = dict(facts.integer_inputs)
            # Named by its roles, unless every input is one (Range).
            every = all(index in roles for index in range(len(inputs)))
            why = op if every else f"{op} {_join(roles.values())}"
            for index in roles:
                if index < len(inputs):
                    self._mark(self.sink, inputs[index], why)
        if facts.comparison and self.integer_operands(node):
            for value in inputs:
                self._mark(self.sink, value, f"{op} of integers")
        carrying = facts.carries_floats and any(
            self.taint_of(o) is not None for o in _fp32_values(node.outputs)
        )
        if carrying:
            # Only along integer paths: a carrier whose output is tainted forward.
            for table in (self.sink, self.exact_use):
                why = next((table[o] for o in node.outputs if o is not None and o in table), None)
                if why is not None:
                    for value in inputs:
                        self._mark(table, value, why)
            return
        if std and not facts.exact_use and node not in self.owners:
            return
        for value in inputs:
            if value is not None and self.taint_of(value) is not None:
                self._mark(self.exact_use, value, f"{op} {node.name!r}" if node.name else op)

    # -- decision -----------------------------------------------------------------------
    def run(self) -> dict[ir.Node, str]:
        tainted: list[ir.Node] = []  # nodes with an FP32 output of integer meaning, in order
        for node in self.order:
            self._record_bounds(node)
            self._record_data_free(node)
            if self._record_taint(node):
                tainted.append(node)
            self._record_int_origin(node)
        if not tainted:
            return {}  # no float value carries integers: no sink or use can matter
        for value, why in self.boundary_outputs.items():
            self._mark(self.sink, value, why)
        for value in self.model_outputs:
            self._mark(self.exact_use, value, f"model output {value.name!r}")
        for node in reversed(self.order):
            self._propagate(node)
        forced: dict[ir.Node, str] = {}
        limit = f"integers exact only to {self.limit} in {self.target.value}"
        for node in tainted:
            if node in self.owners:
                continue
            outs = [
                (o, t) for o in _fp32_values(node.outputs) if (t := self.taint_of(o)) is not None
            ]
            if not outs:
                continue
            sink = next((self.sink[o] for o, _ in outs if o in self.sink), None)
            use = next(
                (self.exact_use[o] for o, t in outs if t.from_cast and o in self.exact_use), None
            )
            if sink is None and use is None:
                continue
            touched = [o for o, _ in outs] + [
                v for v in _fp32_values(node.inputs) if self.taint_of(v)
            ]
            if all(self.exact(v) for v in touched):
                continue
            origin = outs[0][1].origin
            if sink is not None:
                why = f"computes integers from {origin} for {sink} ({limit})"
            else:
                why = f"carries integers from {origin} into {use}, not provably exact ({limit})"
            forced[node] = why
        return forced


# -- interval rules (the `interval` fact): (analysis, node, bounds of its inputs) -> outputs ------

_IntervalRule = Callable[[_Analysis, ir.Node, list[Bound]], list[Bound] | None]
_SHAPE_RULES = frozenset({"shape", "size"})  # read the input's shape: no operand bounds


def _same(analysis: _Analysis, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    return [analysis.bound(node.inputs[0])]


def _whole(analysis: _Analysis, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    return [analysis.bound(node.inputs[0]).whole()] * len(node.outputs)


def _concat(analysis: _Analysis, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
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


def _cast(analysis: _Analysis, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    if _attr_int(node, "to", None) == ir.DataType.BOOL:
        return [BOOL]
    return [analysis.bound(node.inputs[0])]  # integer targets are widened to integers later


def _unary(name: str) -> _IntervalRule:
    fn, integral_result = UNARY[name]

    def rule(analysis: _Analysis, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
        integral = integral_result or all(b.integral for b in operands)
        return [elementwise(fn, [analysis.bound(node.inputs[0])], integral)]

    return rule


def _binary(name: str) -> _IntervalRule:
    fn = BINARY[name]

    def rule(analysis: _Analysis, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
        integral = all(b.integral for b in operands)
        bound = operands[0]
        for other in operands[1:]:
            bound = elementwise(fn, [bound, other], integral)
        if name == "div" and not singletons_integral(bound):
            bound = Bound(bound.lo, bound.hi, False, bound.elems)
        return [bound]

    return rule


def _where(analysis: _Analysis, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    if len(node.inputs) != 3:
        return None
    a, b = analysis.bound(node.inputs[1]), analysis.bound(node.inputs[2])
    return [Bound(min(a.lo, b.lo), max(a.hi, b.hi), a.integral and b.integral)]


def _clip(analysis: _Analysis, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    inputs = node.inputs
    first = analysis.bound(inputs[0])
    lo, hi = first.lo, first.hi
    if len(inputs) > 1 and inputs[1] is not None:
        lo = max(lo, analysis.bound(inputs[1]).lo)
    if len(inputs) > 2 and inputs[2] is not None:
        hi = min(hi, analysis.bound(inputs[2]).hi)
    return [Bound(min(lo, hi), max(lo, hi), all(b.integral for b in operands))]


def _range(analysis: _Analysis, node: ir.Node, operands: list[Bound]) -> list[Bound] | None:
    if len(node.inputs) != 3:
        return None
    start, limit = analysis.bound(node.inputs[0]), analysis.bound(node.inputs[1])
    integral = all(b.integral for b in operands)
    return [Bound(min(start.lo, limit.lo), max(start.hi, limit.hi), integral)]


_INTERVAL_RULES: dict[str, _IntervalRule] = {
    "same": _same,
    "whole": _whole,
    "gather": lambda analysis, node, _: [analysis.gathered(node, analysis.bound(node.inputs[0]))],
    "slice": lambda analysis, node, _: [analysis.sliced(node, analysis.bound(node.inputs[0]))],
    "concat": _concat,
    "cast": _cast,
    "where": _where,
    "clip": _clip,
    "range": _range,
    "shape": lambda analysis, node, _: [analysis.shape_bound(node, size=False)],
    "size": lambda analysis, node, _: [analysis.shape_bound(node, size=True)],
    **{name: _unary(name) for name in UNARY},
    **{name: _binary(name) for name in BINARY},
}


def _join(words: Iterable[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = list(words)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def integer_semantics(model: ir.Model, target: LowPrecision) -> dict[ir.Node, str]:
    """Find the nodes whose float values carry integer meaning that 16 bits would round.

    Args:
        model: A typed FP32 model (see `infer_types`). Not modified.
        target: The 16-bit type; its `exact_int_max` is the largest safe integer.

    Returns:
        Node -> evidence for the nodes to keep FP32 (the planner's category "integer
        semantics").
    """
    forced = _Analysis(model, target).run()
    if forced:
        logger.debug("integer semantics: %d node(s) kept FP32", len(forced))
    return forced
