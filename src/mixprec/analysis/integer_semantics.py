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
* **Bounds** (:mod:`mixprec.analysis.value_bounds`): intervals, with an "all integral" flag, go
  through Shape of static dimensions, integer type ranges (int8, uint8, int4 ...), constants,
  Gather/Slice/Concat of them and the arithmetic above; anything else is unbounded. A value is
  exact when it is integral with magnitude at most ``exact_int_max``, or a single known value
  representable in the target type (``Shape(x)[1] / 2`` with a static 64 converts).

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

Interval arithmetic lives in :mod:`mixprec.analysis.intervals`, the bounds of a model's values
in :mod:`mixprec.analysis.value_bounds`; this module is the taint analysis and the decision
(both passes share its state).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import onnx_ir as ir

from mixprec.analysis.constants import is_constant
from mixprec.analysis.value_bounds import (
    INTEGER_OR_BOOL_TYPES,
    ValueBounds,
    attr_int,
    is_integer_type,
)
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.graphs import format_op_name, is_default_domain, subgraphs_of, walk_nodes
from mixprec.policy.opfacts import Carrier, OpFacts, op_facts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Taint:
    """Forward taint: where an integer-meaning float value comes from."""

    origin: str
    from_cast: bool  # descends from a Cast of an integer (else only from integer constants)


def _fp32_values(values: Sequence[ir.Value | None]) -> list[ir.Value]:
    return [v for v in values if v is not None and is_fp32_tensor(v)]


def _merged(taints: Sequence[_Taint | None]) -> _Taint | None:
    """The first taint's origin, from a Cast when any is; None when none of them is tainted."""
    found = next((t for t in taints if t is not None), None)
    if found is None:
        return None
    return _Taint(found.origin, any(t is not None and t.from_cast for t in taints))


def _is_outer_product(node: ir.Node) -> bool:
    """Whether a MatMul/Gemm contracts over a static dimension of 1 (no sums: an outer product)."""
    first = node.inputs[0] if node.inputs else None
    shape = first.shape if first is not None else None
    if shape is None or len(shape) == 0:
        return False
    transposed = attr_int(node, "transA", 0)  # Gemm; MatMul has no such attribute
    return shape[0 if transposed else -1] == 1


class _Analysis:
    def __init__(self, model: ir.Model, target: LowPrecision) -> None:
        self.target = target
        self.limit = target.limits.exact_int_max
        self.order: list[ir.Node] = []
        for function in model.functions.values():
            self.order.extend(walk_nodes(function))
        self.order.extend(walk_nodes(model.graph))
        self.facts = self._facts_of(self.order)
        self.bounds = ValueBounds(self.facts, target)
        self.taint: dict[ir.Value, _Taint | None] = {}
        self.int_origin: dict[ir.Value, str] = {}
        self.sink: dict[ir.Value, str] = {}
        self.exact_use: dict[ir.Value, str] = {}
        self.data_free: dict[ir.Value, bool] = {}
        # FP32 values computed from data and not tainted (see `_reads_only_activations`).
        self.activations: set[ir.Value] = set()
        self.formal_owner: dict[ir.Value, ir.Node] = {}
        self.boundary_outputs: dict[ir.Value, str] = {}
        self.owners: set[ir.Node] = set()  # nodes with subgraphs
        # The nodes the backward pass can act on, in order (collected by the forward pass).
        self.backward_nodes: list[ir.Node] = []
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
        for graph in (model.graph, *(f.graph for f in model.functions.values())):
            self.activations.update(v for v in graph.inputs if is_fp32_tensor(v) and not is_constant(v))

    @staticmethod
    def _facts_of(nodes: list[ir.Node]) -> dict[ir.Node, OpFacts]:
        """Node -> its op facts (looked up once per op type)."""
        by_op: dict[tuple[str, str], OpFacts] = {}
        facts: dict[ir.Node, OpFacts] = {}
        for node in nodes:
            op = (node.domain, node.op_type)
            found = by_op.get(op)
            if found is None:
                found = by_op[op] = op_facts(*op)
            facts[node] = found
        return facts

    # -- forward: integer-meaning sources -----------------------------------------------
    def taint_of(self, value: ir.Value) -> _Taint | None:
        if value in self.taint:
            return self.taint[value]
        result: _Taint | None = None
        owner = self.formal_owner.get(value)
        if owner is not None and is_fp32_tensor(value):
            result = _merged([self.taint_of(v) for v in _fp32_values(owner.inputs)])
        elif is_fp32_tensor(value) and is_constant(value):
            bound = self.bounds.bound(value)
            if (
                self.bounds.constant_array(value) is not None
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

    def _carried_origin(self, node: ir.Node) -> str | None:
        """The origin of a carrier's first tainted FP32 or non-constant integer input, if any."""
        for value in node.inputs:
            if value is None:
                continue
            if is_fp32_tensor(value):
                taint = self.taint_of(value)
                if taint is not None:
                    return taint.origin
            elif is_integer_type(value.dtype) and not is_constant(value):
                return self.origin_of_int(value)
        return None

    def _record_int_origin(self, node: ir.Node, facts: OpFacts, outs: list[ir.Value]) -> None:
        """Record where the node's non-FP32 outputs `outs` get integer meaning from (Shape,
        carriers); the node is of the standard domain."""
        origin: str | None = None
        if facts.shape_only and node.inputs and node.inputs[0] is not None:
            origin = f"{node.op_type} of {node.inputs[0].name!r}"
        elif facts.carrier is not None:
            origin = self._carried_origin(node)
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

    def _computes_data_free(self, node: ir.Node, facts: OpFacts, std: bool) -> bool:
        """Whether the node's outputs are data-free (before counting constant outputs)."""
        if facts.shape_only and std:
            return True
        if node in self.owners or facts.random or not std:
            return False
        for value in node.inputs:
            if value is not None and not self.is_data_free(value):
                return False
        return True

    def integer_operands(self, node: ir.Node) -> bool:
        """At least one FP32 input is tainted, and every other is tainted or data-free."""
        if self.facts[node].carrier is Carrier.OUTER_PRODUCT and not _is_outer_product(node):
            return False
        inputs = node.inputs
        # Activations first: constants are read only when every other input qualifies. (An
        # activation is recorded as neither data-free nor tainted: its type is read last.)
        for value in inputs:
            if (
                value is not None
                and not self.is_data_free(value)
                and self.taint_of(value) is None
                and is_fp32_tensor(value)
            ):
                return False
        for value in inputs:
            if value is not None and is_fp32_tensor(value) and self.taint_of(value) is not None:
                return True
        return False

    def _cast_taint(self, source: ir.Value) -> _Taint | None:
        """The taint of a Cast of `source`: a source when it is an integer or bool."""
        if source.dtype == ir.DataType.BOOL:
            return _Taint(f"bool {source.name!r}", True)
        if is_integer_type(source.dtype):
            return _Taint(self.origin_of_int(source), True)
        if is_fp32_tensor(source):
            return self.taint_of(source)
        return None

    def _output_taint(self, node: ir.Node, facts: OpFacts, std: bool) -> _Taint | None:
        """The taint of the node's FP32 outputs, from its subgraphs or inputs."""
        if node in self.owners:
            subgraphs = subgraphs_of(node)
            return _merged(
                [self.taint_of(v) for sub in subgraphs for v in _fp32_values(sub.outputs)]
            )
        if not std:
            return None
        if node.op_type == "Cast" and node.inputs and node.inputs[0] is not None:
            return self._cast_taint(node.inputs[0])
        if facts.carrier is Carrier.GENERATOR:
            # Float positions from integer bounds (Range): integers themselves.
            taints = [self.taint_of(v) for v in _fp32_values(node.inputs)]
            return next((t for t in taints if t is not None), None)
        if facts.carries_floats and self.integer_operands(node):
            return _merged([self.taint_of(v) for v in _fp32_values(node.inputs)])
        return None

    def _record_outputs(self, node: ir.Node, facts: OpFacts, std: bool) -> bool:
        """Record the data-freeness, taint and integer origin of the node's outputs; whether
        one of its FP32 outputs is tainted."""
        fp32_outs: list[ir.Value] = []
        other_outs: list[ir.Value] = []
        for out in node.outputs:
            if out is not None:
                (fp32_outs if is_fp32_tensor(out) else other_outs).append(out)
        free = self._computes_data_free(node, facts, std)
        result = self._output_taint(node, facts, std) if fp32_outs else None
        tainted = False
        for out in fp32_outs:
            if is_constant(out):
                self.data_free[out] = True
                taint = self.taint_of(out)
            else:
                self.data_free[out] = free
                self.taint[out] = taint = result
                if not free and taint is None:
                    self.activations.add(out)
            tainted = tainted or taint is not None
        for out in other_outs:
            self.data_free[out] = free or is_constant(out)
        if other_outs and std:
            self._record_int_origin(node, facts, other_outs)
        return tainted

    # -- backward: integer-meaning sinks and uses that need exact values ----------------
    def _mark(self, table: dict[ir.Value, str], value: ir.Value | None, why: str) -> None:
        if value is None or not is_fp32_tensor(value) or value in table:
            return
        table[value] = why
        owner = self.formal_owner.get(value)
        if owner is not None:
            for outer in _fp32_values(owner.inputs):
                self._mark(table, outer, why)

    def _mark_cast_sink(self, node: ir.Node) -> None:
        """Mark the input of a Cast to an integer type as an integer sink."""
        inputs = node.inputs
        std = is_default_domain(node.domain)
        if std and node.op_type == "Cast" and inputs and inputs[0] is not None:
            to = attr_int(node, "to", None)
            if to is not None and to != ir.DataType.BOOL and ir.DataType(to).is_integer():
                self._mark(self.sink, inputs[0], f"Cast to {ir.DataType(to).name.lower()}")

    def _mark_integer_sinks(self, node: ir.Node, op: str) -> None:
        """Mark the inputs that must hold integers: of a Cast to an integer type, the op facts'
        integer inputs, and the operands of a comparison between integers."""
        facts = self.facts[node]
        inputs = node.inputs
        self._mark_cast_sink(node)
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

    def _carry_back(self, node: ir.Node) -> None:
        """Mark a carrier's inputs with the sink and exact use of its outputs."""
        for table in (self.sink, self.exact_use):
            why = next((table[o] for o in node.outputs if o is not None and o in table), None)
            if why is not None:
                for value in node.inputs:
                    self._mark(table, value, why)

    def _mark_exact_uses(self, node: ir.Node, op: str) -> None:
        """Mark the tainted inputs of an exact use (op fact, subgraph owner, other domain)."""
        std = is_default_domain(node.domain)
        if std and not self.facts[node].exact_use and node not in self.owners:
            return
        for value in node.inputs:
            if value is not None and self.taint_of(value) is not None:
                self._mark(self.exact_use, value, f"{op} {node.name!r}" if node.name else op)

    def _propagate(self, node: ir.Node) -> None:
        """Mark the node's inputs that are integer sinks or exact uses (the backward pass)."""
        op = format_op_name(node.domain, node.op_type)
        self._mark_integer_sinks(node, op)
        carrying = self.facts[node].carries_floats and any(
            self.taint_of(o) is not None for o in _fp32_values(node.outputs)
        )
        if carrying:
            # Only along integer paths: a carrier whose output is tainted forward.
            self._carry_back(node)
        else:
            self._mark_exact_uses(node, op)

    # -- decision -----------------------------------------------------------------------
    def _on_integer_chain(self, node: ir.Node, facts: OpFacts) -> bool:
        """Whether the node reads shapes, tainted values or integers (else its outputs are
        unbounded floats or typed integers, both read lazily)."""
        if facts.shape_only:
            return True
        taint = self.taint
        for value in node.inputs:
            if value is not None and (
                taint.get(value) is not None or value.dtype in INTEGER_OR_BOOL_TYPES
            ):
                return True
        return False

    def _acts_backward(self, node: ir.Node, facts: OpFacts, std: bool, tainted: bool) -> bool:
        """Whether `_propagate` may mark anything for the node (a superset: Casts, integer
        inputs, comparisons, exact uses, subgraph owners, other domains, tainted carriers)."""
        if not std or facts.integer_inputs or facts.comparison or facts.exact_use:
            return True
        if node in self.owners or (tainted and facts.carries_floats):
            return True
        return node.op_type == "Cast"

    def _reads_only_activations(self, node: ir.Node, facts: OpFacts, std: bool) -> bool:
        """Whether the node computes FP32 activations from an activation: it reads at least one
        value of `activations`, no integer or bool and nothing tainted so far, and writes FP32
        values only (no generator, no subgraph). Such a node records nothing: the activation
        makes its outputs neither data-free nor tainted (what `is_data_free` and `taint_of`
        answer for values never recorded), and it is on no integer chain."""
        if not std or facts.shape_only or facts.random or facts.carrier is Carrier.GENERATOR or node in self.owners:
            return False
        activations, taint = self.activations, self.taint
        found = False
        for value in node.inputs:
            if value is None:
                continue
            if value in activations:
                found = True
            elif value.dtype in INTEGER_OR_BOOL_TYPES or taint.get(value) is not None:
                return False
        if not found:
            return False
        for out in node.outputs:
            if not is_fp32_tensor(out) or is_constant(out):
                return False
        return True

    def _forward(self) -> list[ir.Node]:
        """Bounds, data-freeness, taint and integer origins in topological order (collecting
        `backward_nodes`); the nodes with an FP32 output of integer meaning, in order. Most
        nodes of a network compute activations from activations and weights: they are only
        checked for the backward pass (see `_reads_only_activations`)."""
        tainted: list[ir.Node] = []
        activations = self.activations
        for node in self.order:
            facts = self.facts[node]
            std = is_default_domain(node.domain)
            if self._reads_only_activations(node, facts, std):
                activations.update(node.outputs)
                if self._acts_backward(node, facts, std, False):
                    self.backward_nodes.append(node)
                continue
            if self._on_integer_chain(node, facts):
                self.bounds.record(node)
            is_tainted = self._record_outputs(node, facts, std)
            if is_tainted:
                tainted.append(node)
            if self._acts_backward(node, facts, std, is_tainted):
                self.backward_nodes.append(node)
        return tainted

    def _backward(self) -> None:
        """Integer sinks and exact uses, from the boundaries back along the reverse order (of
        the nodes that can mark any: the others would mark nothing)."""
        for value, why in self.boundary_outputs.items():
            self._mark(self.sink, value, why)
        for value in self.model_outputs:
            self._mark(self.exact_use, value, f"model output {value.name!r}")
        for node in reversed(self.backward_nodes):
            self._propagate(node)

    def _all_exact(self, node: ir.Node, outs: list[ir.Value]) -> bool:
        """Whether every tainted value the node reads or writes is provably exact."""
        touched = outs + [v for v in _fp32_values(node.inputs) if self.taint_of(v)]
        return all(self.bounds.exact(v) for v in touched)

    def _why_kept(self, node: ir.Node, limit: str) -> str | None:
        """The evidence for keeping a tainted node FP32; None when it converts."""
        if node in self.owners:
            return None
        outs = [(o, t) for o in _fp32_values(node.outputs) if (t := self.taint_of(o)) is not None]
        if not outs:
            return None
        sink = next((self.sink[o] for o, _ in outs if o in self.sink), None)
        use = next(
            (self.exact_use[o] for o, t in outs if t.from_cast and o in self.exact_use), None
        )
        if sink is None and use is None:
            return None
        if self._all_exact(node, [o for o, _ in outs]):
            return None
        origin = outs[0][1].origin
        if sink is not None:
            return f"computes integers from {origin} for {sink} ({limit})"
        return f"carries integers from {origin} into {use}, not provably exact ({limit})"

    def run(self) -> dict[ir.Node, str]:
        """Node -> evidence for the nodes to keep FP32."""
        tainted = self._forward()
        if not tainted:
            return {}  # no float value carries integers: no sink or use can matter
        self._backward()
        forced: dict[ir.Node, str] = {}
        limit = f"integers exact only to {self.limit} in {self.target.value}"
        for node in tainted:
            why = self._why_kept(node, limit)
            if why is not None:
                forced[node] = why
        return forced


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
