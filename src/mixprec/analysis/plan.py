"""Precision planning: decide, for every node, whether it computes in the 16-bit type.

The planner is pure analysis: it reads a typed model (see :mod:`mixprec.analysis.typeinfo`) and
returns a :class:`PrecisionPlan`; it never edits the model. Decisions follow a small lattice over
FP32 values:

* ``LOW``  the value is produced in the 16-bit type;
* ``HIGH`` the value stays FP32;
* ``WIDE`` the value stays FP32 and may hold values the 16-bit type cannot represent
  (out-of-range constants and what data movement makes of them): it is never narrowed;
* ``TINY`` the value's meaningful values flush to zero in the 16-bit type (a constant, a value
  measured on data, or data movement of those). A flushed element is at most half the smallest
  subnormal, within the rounding of a 16-bit sum: a node that only adds it (the
  ``additive_inputs`` op fact: a bias, a summand) converts as if it were not there. Any other
  reader computes in FP32, and the FP32 ends there: data movement passes ``TINY`` on, and the
  output of a product (``scaling_inputs``) of values that fit is small enough for its 16-bit
  readers to take a Cast of it;
* ``FLEX`` the value can be had in either type without extra error (constants, graph inputs,
  tensors generated from attributes, and follow ops over those): its consumers decide.

A forward pass in topological order (subgraphs before the node that owns them) decides every
node from the states of its inputs, so decisions do not depend on visit order; a backward pass
then resolves ``FLEX`` producers from what their consumers need.

Each node's schema binds its inputs and outputs to type variables; converting a node lowers the
type variables that are FP32 and admit the 16-bit type at the node's opset, except pinned ones.

The plan's data types are in :mod:`mixprec.analysis.decisions`. This module is one algorithm (the
forward pass, the backward resolution of ``FLEX`` values and the storage decisions share the
planner's state), which is why it is longer than the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import (
    FLUSH_WORDS,
    constant_range,
    is_constant,
    small_constant_array,
    tensor_range,
)
from mixprec.analysis.placement import min_cut_islands
from mixprec.analysis.qdq import quantizes_float_chain
from mixprec.analysis.decisions import (
    Category,
    Decision,
    NodeFacts,
    NodeMatcher,
    Precision,
    PrecisionPlan,
    State,
    Storage,
)
from mixprec.dtypes import is_fp32_tensor
from mixprec.graphs import (
    all_nodes,
    default_domain_version,
    function_graphs,
    is_default_domain,
    subgraphs_of,
    unique_names,
)
from mixprec.policy.conditions import CONDITIONS
from mixprec.policy.runtime import RuntimeProfile, load_runtime
from mixprec.policy.schemas import Signature, signature
from mixprec.policy.opfacts import OpFacts, op_facts
from mixprec.policy.table import OpClass, OpRule, Policy, format_op_name, normalize_domain

__all__ = [
    "Category",
    "Decision",
    "NodeFacts",
    "NodeMatcher",
    "Precision",
    "PrecisionPlan",
    "plan_precision",
    "weights_only",
]

FLOAT = ir.DataType.FLOAT
# Constants of at least this many elements count as large weights.
_HEAVY_CONSTANT_ELEMENTS = 1 << 16


_ANY_FLOAT = frozenset({"tensor(float)", "tensor(float16)", "tensor(bfloat16)"})


def _user_op_signature(n_inputs: int, n_outputs: int) -> Signature:
    """A binding for a custom op the user classified: every FP32 input and output share one
    type variable (its non-FP32 tensors are never touched)."""
    return Signature(
        since_version=1,
        input_vars=("T",) * n_inputs,
        output_vars=("T",) * n_outputs,
        allowed={"T": _ANY_FLOAT},
    )


@dataclass(frozen=True)
class _OpTemplate:
    """What the planner knows of an op before looking at a node's values (shared by its nodes).

    Attributes:
        rule: The policy rule (None for ops the policy does not know).
        sig: The schema binding of the node's inputs and outputs (None without a schema).
        excluded: Type variables the node never lowers (schema, policy pins or runtime).
        name: The op's name for reasons (`Op` or `domain::Op`).
        runtime_blocked: Type variables the schema would lower but the runtime has no 16-bit
            kernel for.
        runtime_reason: Why, naming the kernel and provider.
    """

    rule: OpRule | None
    sig: Signature | None
    excluded: frozenset[str]
    name: str
    runtime_blocked: frozenset[str] = frozenset()
    runtime_reason: str | None = None
    fixed_by: str | None = None  # an attribute that, when set, fixes the output type (no retarget)


class _Planner:
    def __init__(
        self,
        model: ir.Model,
        policy: Policy,
        exclude: NodeMatcher,
        keep_io_types: bool,
        forced: Mapping[ir.Node, tuple[Category, str]] | None = None,
        wide_values: Mapping[ir.Value, str] | None = None,
        runtime: RuntimeProfile | None = None,
        keys: Mapping[ir.Node, str] | None = None,
        safe_values: Mapping[ir.Value, str] | None = None,
    ) -> None:
        self.model = model
        self.runtime = runtime if runtime is not None else load_runtime("onnx")
        self.forced = dict(forced or {})
        self.wide_values = dict(wide_values or {})
        self.policy = policy
        self.target = policy.target
        self.target_type = policy.target.type_str
        self.exclude = exclude
        self.keep_io_types = keep_io_types
        self.state: dict[ir.Value, State] = {}
        self.decisions: dict[ir.Node, Decision] = {}
        self.lowered: dict[ir.Node, frozenset[str]] = {}
        self.facts: dict[ir.Node, NodeFacts] = {}
        self.storage: dict[ir.Value, Storage] = {}
        self.constant_notes: dict[ir.Value, str] = {}
        self.saturated: set[ir.Value] = set()
        # FP32 values a 16-bit copy holds safely (bounded op outputs, ranges measured on data),
        # with the evidence: they do not hold the follow ops they feed in FP32.
        self.bounded: dict[ir.Value, str] = dict(safe_values or {})
        self.flex_nodes: list[ir.Node] = []
        # TINY values made from constants by data movement: like constants, their readers decide.
        self.tiny_flex: set[ir.Value] = set()
        # Values kept FP32 for carrying an input that must not be narrowed -> that input's origin.
        self.carried: dict[ir.Value, ir.Value] = {}
        # Evidence for generated values that flush to zero (a ConstantOfShape fill value).
        self.fill_notes: dict[ir.Value, str] = {}
        self.main_outputs = frozenset(model.graph.outputs)
        self.sub_outputs: set[ir.Value] = set()
        self.order = all_nodes(model)
        self.keys = dict(keys) if keys is not None else unique_names(self.order)
        self.graphs = [model.graph, *function_graphs(model)]
        self.owners: set[ir.Node] = set()  # nodes with subgraphs (control flow)
        for node in self.order:
            subgraphs = subgraphs_of(node) if node.attributes else []
            if subgraphs:
                self.owners.add(node)
                self.graphs.extend(subgraphs)
        self.opsets = dict(model.opset_imports)
        self._templates: dict[tuple, _OpTemplate] = {}
        # Decisions are immutable and repeat across nodes: one shared object per distinct one.
        self._decisions: dict[tuple[Precision, Category, str], Decision] = {}

    # -- states ---------------------------------------------------------------------------
    def _constant_state(self, value: ir.Value) -> State:
        rng = constant_range(value, self.target)
        if rng is not None and rng.overflow:
            return State.WIDE
        if rng is not None and rng.significant_flush:
            return State.TINY
        return State.FLEX

    def _init_graph(self, graph: ir.Graph, *, main: bool) -> None:
        for value in graph.inputs:
            if is_fp32_tensor(value):
                if main and not self.keep_io_types:
                    self.state[value] = State.LOW
                else:
                    self.state[value] = State.FLEX
        for value in graph.initializers.values():
            if is_fp32_tensor(value) and value not in self.state:
                self.state[value] = self._constant_state(value)
        if not main:
            self.sub_outputs.update(v for v in graph.outputs if v is not None)

    def _measured_state(self, value: ir.Value) -> State:
        """WIDE or TINY for a value measured beyond the 16-bit range, by what its evidence says."""
        return State.TINY if FLUSH_WORDS in self.wide_values[value] else State.WIDE

    def _flexible(self, value: ir.Value) -> bool:
        """Whether the value is a constant or made from constants by data movement alone."""
        return value in self.tiny_flex or is_constant(value)

    def value_state(self, value: ir.Value) -> State:
        state = self.state.get(value)
        if state is not None:
            return state if value not in self.wide_values else self._measured_state(value)
        # Outer-scope values not seen yet, values without a producer, unknown cases.
        if is_constant(value):
            state = self._constant_state(value)
        else:
            state = State.HIGH
        self.state[value] = state
        return state

    # -- facts --------------------------------------------------------------------------
    def _opset(self, node: ir.Node) -> int | None:
        if node.version is not None:
            return node.version
        graph = node.graph
        opsets = getattr(graph, "opset_imports", None) or self.opsets
        domain = normalize_domain(node.domain)
        version = default_domain_version(opsets) if domain == "" else opsets.get(domain)
        if version is None:
            version = self.opsets.get(domain)
        return version

    def _template(self, node: ir.Node, opset: int | None) -> _OpTemplate:
        """Rule, schema binding, never-lowered type variables and name of an op (cached per op)."""
        key = (node.op_type, node.domain, opset, len(node.inputs), len(node.outputs))
        cached = self._templates.get(key)
        if cached is not None:
            return cached
        rule = self.policy.rule_for(node.domain, node.op_type)
        sig = None
        if is_default_domain(node.domain) and opset is not None:
            sig = signature(node.op_type, node.domain, opset, len(node.inputs), len(node.outputs))
        blocked: frozenset[str] = frozenset()
        runtime_reason = None
        if sig is None and self.runtime.has_table and opset is not None:
            # Contrib ops (and runtime-internal ones such as SimplifiedLayerNormalization) have
            # no ONNX schema: the runtime's kernel binding is their signature.
            sig = self.runtime.signature(node.domain, node.op_type, opset, len(node.inputs), len(node.outputs))
            if sig is not None:
                blocked = frozenset(v for v, allowed in sig.allowed.items() if self.target_type not in allowed)
                runtime_reason = (
                    f"no {self.target.value} kernel for {format_op_name(node.domain, node.op_type)}"
                    f"({sig.since_version}) on {self.runtime.provider}"
                )
        if sig is None and rule is not None and rule.source == "user" and not is_default_domain(node.domain):
            sig = _user_op_signature(len(node.inputs), len(node.outputs))
        facts = op_facts(node.domain, node.op_type)
        tied = facts.output_type_from
        if sig is not None and tied is not None and tied < len(sig.input_vars) and sig.output_vars:
            # The output takes that input's type (DequantizeLinear-23: the scale's) unless an
            # attribute says otherwise (such nodes keep their types, see `_decide`).
            sig = replace(sig, output_vars=(sig.input_vars[tied], *sig.output_vars[1:]))
        excluded: set[str] = set()
        if sig is not None:
            excluded = {v for v, allowed in sig.allowed.items() if self.target_type not in allowed}
            if rule is not None:
                for index in rule.fp32_inputs:
                    if index < len(sig.input_vars) and sig.input_vars[index] is not None:
                        excluded.add(sig.input_vars[index])  # type: ignore[arg-type]
                for index in rule.flexible_inputs:
                    # A flexible input's own type variable is never lowered by the node.
                    if index < len(sig.input_vars):
                        var = sig.input_vars[index]
                        others = {sig.input_vars[i] for i in range(len(sig.input_vars)) if i != index}
                        if var is not None and var not in others | set(sig.output_vars):
                            excluded.add(var)
        if sig is not None and self.runtime.has_table and not blocked:
            candidates = frozenset(v for v, allowed in sig.allowed.items() if self.target_type in allowed)
            version = sig.since_version if is_default_domain(node.domain) else (opset or 1)
            blocked, runtime_reason = self.runtime.blocked_vars(
                node.domain, node.op_type, version, sig, self.target_type, candidates - excluded
            )
            excluded |= blocked
        name = format_op_name(node.domain, node.op_type)
        fixed_by = facts.dtype_attribute if rule is None or rule.dtype_attribute is None else None
        template = _OpTemplate(rule, sig, frozenset(excluded), name, blocked, runtime_reason, fixed_by)
        self._templates[key] = template
        return template

    def _facts(self, node: ir.Node, template: _OpTemplate) -> NodeFacts:
        rule, sig, excluded = template.rule, template.sig, template.excluded
        facts = NodeFacts(
            rule=rule, sig=sig, runtime_blocked=template.runtime_blocked, runtime_reason=template.runtime_reason
        )
        if rule is not None:
            facts.flexible = rule.flexible_inputs
        if sig is None:
            return facts
        float_vars: set[str] = set()
        # Type variables bound only to outputs (e.g. LayerNormalization's U, set by stash_type)
        # are the op's own choice: they keep their types.
        input_vars: set[str] = set()
        for value, var in zip(node.inputs, sig.input_vars):
            if value is not None and var is not None:
                input_vars.add(var)
                if is_fp32_tensor(value):
                    float_vars.add(var)
        for value, var in zip(node.outputs, sig.output_vars):
            if var is not None and is_fp32_tensor(value):
                float_vars.add(var)
        facts.float_vars = frozenset(float_vars)
        facts.lowerable = {v for v in float_vars if v in input_vars and v not in excluded}
        return facts

    def _touches_fp32(self, node: ir.Node) -> bool:
        """Whether the node reads or writes FP32 values (inputs it takes as they are aside)."""
        facts = self.facts.get(node)
        flexible = facts.flexible if facts is not None else frozenset()
        for value in node.outputs:
            if is_fp32_tensor(value):
                return True
        for index, value in enumerate(node.inputs):
            if is_fp32_tensor(value) and index not in flexible:
                return True
        return False

    # -- forward pass -------------------------------------------------------------------
    def run(self) -> PrecisionPlan:
        names = {node.name for node in self.order if node.name} if self.exclude.patterns else set()
        self.exclude.prepare(names)
        self._init_graph(self.model.graph, main=True)
        for graph in self.graphs[1:]:
            # Subgraphs and function bodies keep their signatures: inputs are flexible, outputs
            # stay FP32.
            self._init_graph(graph, main=False)
        for node in self.order:
            self._decide(node)
        self._resolve_flex()
        self._place_casts()
        self._decide_storage()
        return self.view()

    def _decision(self, precision: Precision, category: Category, reason: str) -> Decision:
        key = (precision, category, reason)
        decision = self._decisions.get(key)
        if decision is None:
            decision = self._decisions[key] = Decision(precision, category, reason)
        return decision

    def _keep(self, node: ir.Node, category: Category, reason: str, out_state: State) -> None:
        touches = self._touches_fp32(node)
        precision = Precision.FP32 if touches else Precision.NONE
        if not touches:
            category, reason = Category.NO_FLOAT, "no FP32 values"
        self.decisions[node] = self._decision(precision, category, reason)
        self.lowered[node] = frozenset()
        bounded = out_state is State.HIGH and is_default_domain(node.domain) and op_facts("", node.op_type).bounded
        for out in node.outputs:
            if is_fp32_tensor(out):
                self.state[out] = out_state
                if bounded:
                    self.bounded[out] = f"{node.op_type} output: within a fixed small interval"

    def _lower(self, node: ir.Node, facts: NodeFacts, category: Category, reason: str) -> None:
        self.decisions[node] = self._decision(Precision.LOW, category, reason)
        self.lowered[node] = frozenset(facts.lowerable)
        for index, out in enumerate(node.outputs):
            if not is_fp32_tensor(out):
                continue
            var = facts.sig.output_vars[index] if facts.sig and index < len(facts.sig.output_vars) else None
            lowered = var in facts.lowerable if var is not None else False
            if facts.rule is not None and facts.rule.dtype_attribute is not None:
                lowered = index == 0
            self.state[out] = State.LOW if lowered else State.HIGH

    def _flex(self, node: ir.Node, facts: NodeFacts, *, tiny: bool = False) -> None:
        """Provisional: resolved by the backward pass. `tiny`: the outputs hold values that
        flush to zero in 16 bits (a TINY constant or data movement of one)."""
        self.decisions[node] = self._decision(Precision.FP32, Category.CONSUMERS, "pending")
        self.lowered[node] = frozenset(facts.lowerable)
        self.flex_nodes.append(node)
        for index, out in enumerate(node.outputs):
            if is_fp32_tensor(out):
                flexible = self._output_var_lowerable(facts, index)
                self.state[out] = (State.TINY if tiny else State.FLEX) if flexible else State.HIGH
                if flexible and tiny:
                    self.tiny_flex.add(out)

    @staticmethod
    def _output_var_lowerable(facts: NodeFacts, index: int) -> bool:
        if facts.rule is not None and facts.rule.dtype_attribute is not None:
            return index == 0
        if facts.sig is None or index >= len(facts.sig.output_vars):
            return False
        var = facts.sig.output_vars[index]
        return var is not None and var in facts.lowerable

    def _decide(self, node: ir.Node) -> None:
        template = self._template(node, self._opset(node))
        facts = self._facts(node, template)
        self.facts[node] = facts
        name = node.name or ""
        if node in self.owners:
            self._keep(node, Category.CONTROL_FLOW, "boundary keeps its types; subgraphs are converted inside", State.HIGH)
            return
        rule = facts.rule
        op_name = template.name
        if (node.domain, node.op_type, node.overload) in self.model.functions:
            self._keep(node, Category.FUNCTION, f"{op_name}: signature kept; its body is converted inside", State.HIGH)
            return
        if rule is None or facts.sig is None:
            why = "not in the policy" if facts.sig is not None else "no ONNX schema for this op and opset"
            self._keep(node, Category.UNKNOWN_OP, f"{op_name}: {why}", State.HIGH)
            return
        if not self._touches_fp32(node):
            self._keep(node, Category.NO_FLOAT, "no FP32 values", State.HIGH)
            return
        unknown = [
            v.name
            for v, var in zip(node.inputs, facts.sig.input_vars)
            if v is not None and var is not None and var in facts.lowerable and v.dtype is None
        ]
        if unknown:
            self._keep(node, Category.UNKNOWN_TYPE, f"type of {unknown[0]!r} is unknown", State.HIGH)
            return
        pattern = self.exclude.match(name)
        if pattern is not None:
            self._keep(node, Category.EXCLUDED, f"node name matches {pattern!r}", State.HIGH)
            return
        forced = self.forced.get(node)
        if forced is not None:
            self._keep(node, forced[0], forced[1], State.HIGH)
            return
        wide_out = self._wide_output(node)
        if wide_out is not None:
            self._keep(
                node, Category.DATA_RANGE, f"{wide_out.name}: {self.wide_values[wide_out]}",
                self._measured_state(wide_out),
            )
            return
        if rule.dtype_attribute is not None:
            self._decide_dtype_source(node, facts, rule)
            return
        fixed_by = template.fixed_by
        fixing = node.attributes.get(fixed_by) if fixed_by is not None else None
        if fixing is not None and not (fixing.type is ir.AttributeType.INT and fixing.as_int() == 0):  # 0: unset
            self._keep(node, Category.SCHEMA, f"{op_name}: its {fixed_by} attribute fixes its output type", State.HIGH)
            return
        if not facts.lowerable and facts.runtime_blocked & facts.float_vars and rule.op_class is not OpClass.FP32:
            self._keep(node, Category.RUNTIME, facts.runtime_reason or "no 16-bit kernel", State.HIGH)
            return
        if not facts.lowerable:
            if facts.float_vars:
                reason = f"{op_name}-{facts.sig.since_version} has no {self.target.value} type for its FP32 values"
            else:
                reason = f"{op_name} fixes its float types in the schema"
            self._keep(node, Category.SCHEMA, reason, State.HIGH)
            return
        op_class = rule.op_class
        category, reason = Category.POLICY, f"{op_name}: {rule.reason}"
        if op_class is OpClass.CONDITIONAL:
            condition = CONDITIONS[rule.condition or ""]
            result = condition(node, small_constant_array, rule.params)
            if not result.ok:
                self._keep(node, Category.CONDITION, f"{op_name}: {result.evidence}", State.HIGH)
                return
            op_class, category, reason = OpClass.FOLLOW, Category.CONDITION, f"{op_name}: {result.evidence}"
        if op_class is OpClass.FP32:
            self._keep(node, Category.POLICY, reason, State.HIGH)
            return
        # Inputs bound to lowerable type variables (flexible inputs are taken as they are).
        considered: list[tuple[int, ir.Value, str]] = []
        for index, (value, var) in enumerate(zip(node.inputs, facts.sig.input_vars)):
            if value is None or var is None or var not in facts.lowerable:
                continue
            if index in facts.flexible or not is_fp32_tensor(value):
                continue
            considered.append((index, value, var))
        states = {id(v): self.value_state(v) for _, v, _ in considered}
        fact = op_facts(node.domain, node.op_type)
        # Data movement of constants that flush to zero stays flexible: its readers decide.
        moves_tiny = (
            op_class is OpClass.FOLLOW and fact.value_preserving
            and any(states[id(v)] is State.TINY for _, v, _ in considered)
            and all(
                states[id(v)] is State.FLEX or (states[id(v)] is State.TINY and self._flexible(v))
                for _, v, _ in considered
            )
        )
        # Values that must not be narrowed pin their type variable to FP32; a value that only
        # flushes to zero does not where the node adds it (within the rounding of the 16-bit sum).
        wide_inputs: list[tuple[int, ir.Value, State]] = []
        castable: dict[ir.Value, str] = {}  # unpinned TINY inputs read through a Cast
        for index, value, var in considered:
            input_state = states[id(value)]
            if input_state not in (State.WIDE, State.TINY):
                continue
            if index in rule.saturate_inputs and is_constant(value):
                self.saturated.add(value)
                states[id(value)] = State.FLEX
                continue
            if input_state is State.TINY and (moves_tiny or (fact.adds(index) and not self._guards_zero(node))):
                if self._flexible(value):
                    states[id(value)] = State.FLEX
                else:
                    states[id(value)] = State.HIGH
                    castable[value] = f"what flushes to zero is below the rounding of the {self.target.short_name} sum"
                continue
            facts.lowerable.discard(var)
            wide_inputs.append((index, value, input_state))
            evidence = self._wide_evidence(value)
            facts.pinned_evidence.append(f"{value.name}: {evidence}")
        if wide_inputs and self.runtime.needs_one_type(node.domain, node.op_type):
            reason = f"{self.runtime.name} needs one element type for all {op_name} inputs; " + "; ".join(facts.pinned_evidence)
            self._keep(node, Category.RUNTIME, reason, State.HIGH)
            return
        if wide_inputs and not self._has_lowered_output(node, facts):
            self._keep_for_range(node, fact, op_class, considered, states, wide_inputs)
            return
        considered = [(i, v, var) for i, v, var in considered if var in facts.lowerable]
        if op_class is OpClass.LOW:
            self._lower(node, facts, category, reason)
            return
        # An FP32 input whose values are bounded (a Cos, Sigmoid or Softmax output) does not hold
        # the node in FP32: a 16-bit copy of it costs no more accuracy than 16-bit compute, and
        # one Cast of it replaces casts around everything downstream.
        safe = {**self.bounded, **castable} if castable else self.bounded
        high = [
            v for _, v, _ in considered
            if states[id(v)] in (State.HIGH, State.WIDE, State.TINY) and v not in safe
        ]
        if high:
            self._keep(node, Category.FOLLOW, f"follows FP32 input {high[0].name!r}", State.HIGH)
            return
        if any(states[id(v)] is State.LOW for _, v, _ in considered):
            follow_reason = reason if category is Category.CONDITION else f"follows 16-bit inputs ({op_name})"
            cast = [v for _, v, _ in considered if states[id(v)] is State.HIGH and v in safe]
            if cast:
                follow_reason += f"; its FP32 input {cast[0].name!r} is cast to 16 bits ({safe[cast[0]]})"
            self._lower(node, facts, category if category is Category.CONDITION else Category.FOLLOW, follow_reason)
            return
        if moves_tiny:
            source = next(v for _, v, _ in considered if self.value_state(v) is State.TINY)
            origin = self.carried.get(source, source)
            self.carried.update({out: origin for out in node.outputs if is_fp32_tensor(out)})
        self._flex(node, facts, tiny=moves_tiny)

    @staticmethod
    def _guards_zero(node: ir.Node, hops: int = 4) -> bool:
        """Whether the node's output reaches an input where zero is a singularity (a divisor,
        a logarithm) through ops that keep zeros or move values: an epsilon added there guards
        against zero, and a flushed epsilon does not (``x / (norm + 1e-12)``)."""
        frontier = [v for v in node.outputs if v is not None]
        seen: set[ir.Node] = set()
        for _ in range(hops):
            reached = []
            for value in frontier:
                for use in value.uses():
                    fact = op_facts(use.node.domain, use.node.op_type)
                    if fact.singular(use.idx):
                        return True
                    if (fact.value_preserving or fact.keeps_zero) and use.node not in seen:
                        seen.add(use.node)
                        reached.extend(out for out in use.node.outputs if out is not None)
            frontier = reached
        return False

    def _keep_for_range(
        self,
        node: ir.Node,
        fact: OpFacts,
        op_class: OpClass,
        considered: list[tuple[int, ir.Value, str]],
        states: Mapping[int, State],
        wide_inputs: list[tuple[int, ir.Value, State]],
    ) -> None:
        """Keep a node FP32 for inputs that must not be narrowed; its outputs' state says what
        they hold: data movement passes WIDE and TINY values on, an elementwise op WIDE ones, and
        a product of a TINY factor with values that fit is an ordinary value a 16-bit reader may
        take through a Cast (the FP32 ends at this node)."""
        facts = self.facts[node]
        measured = any(v in self.wide_values for _, v, _ in wide_inputs)
        category = Category.DATA_RANGE if measured else Category.CONSTANT_RANGE
        reason = "; ".join(facts.pinned_evidence)
        wide = [v for _, v, st in wide_inputs if st is State.WIDE]
        if wide and op_class is OpClass.FOLLOW:
            carried: ir.Value | None = wide[0]
            out_state = State.WIDE
        elif not wide and fact.value_preserving:
            carried, out_state = wide_inputs[0][1], State.TINY
        else:
            carried, out_state = None, State.HIGH
        self._keep(node, category, reason, out_state)
        fp32_outputs = [out for out in node.outputs if is_fp32_tensor(out)]
        if carried is not None:
            origin = self.carried.get(carried, carried)
            self.carried.update(dict.fromkeys(fp32_outputs, origin))
            return
        pinned = {id(v) for _, v, _ in wide_inputs}
        scaled = not wide and all(fact.scales(i) for i, _, _ in wide_inputs) and all(
            states[id(v)] in (State.LOW, State.FLEX, State.TINY) or v in self.bounded
            for _, v, _ in considered
            if id(v) not in pinned
        )
        if scaled:
            factor = wide_inputs[0][1].name
            for out in fp32_outputs:
                self.bounded.setdefault(
                    out, f"scaled by {factor!r}, below the {self.target.short_name} normal range"
                )

    def _wide_output(self, node: ir.Node) -> ir.Value | None:
        """The first output of `node` measured beyond the 16-bit range, if any."""
        if not self.wide_values:
            return None
        return next((out for out in node.outputs if out in self.wide_values), None)

    def _has_lowered_output(self, node: ir.Node, facts: NodeFacts) -> bool:
        sig = facts.sig
        if sig is None:
            return False
        return any(
            out is not None and is_fp32_tensor(out) and var is not None and var in facts.lowerable
            for out, var in zip(node.outputs, sig.output_vars)
        )

    def _wide_evidence(self, value: ir.Value) -> str:
        note = self.constant_notes.get(value) or self.wide_values.get(value)
        if note is not None:
            return note
        rng = constant_range(value, self.target)
        carried = self.carried.get(value)
        if rng is not None:
            note = rng.describe(self.target)
        elif carried is not None:
            note = f"carries {carried.name!r}: {self._wide_evidence(carried)}"
        elif value in self.fill_notes:
            note = self.fill_notes[value]
        else:
            producer = value.producer()
            origin = producer.name or producer.op_type if producer is not None else "?"
            if self.state.get(value) is State.TINY:
                note = f"may hold values that {FLUSH_WORDS} in {self.target.short_name} (underflow, from {origin})"
            else:
                note = f"may hold values beyond the {self.target.short_name} range (from {origin})"
        self.constant_notes[value] = note
        return note

    def _decide_dtype_source(self, node: ir.Node, facts: NodeFacts, rule: OpRule) -> None:
        """Ops whose output type is an attribute (Cast, Constant, ConstantOfShape, EyeLike, ...)."""
        if not node.outputs or not is_fp32_tensor(node.outputs[0]):
            self._keep(node, Category.NO_FLOAT, "no FP32 values", State.HIGH)
            return
        out = node.outputs[0]
        sig = facts.sig
        out_var = sig.output_vars[0] if sig is not None and sig.output_vars else None
        if out_var is not None and self.target_type not in sig.allowed.get(out_var, ()):  # type: ignore[union-attr]
            self._keep(
                node,
                Category.SCHEMA,
                f"{node.op_type}-{sig.since_version} has no {self.target.value} output type",  # type: ignore[union-attr]
                State.HIGH,
            )
            return
        if out_var is not None and out_var in facts.runtime_blocked:
            self._keep(node, Category.RUNTIME, facts.runtime_reason or "no 16-bit kernel", State.HIGH)
            return
        facts.lowerable = {out_var} if out_var is not None else set()
        constant = is_constant(out)
        if node.op_type == "Constant" and not constant:
            # e.g. a sparse_value Constant: nothing this rewrite can retype.
            self._keep(node, Category.UNKNOWN_TYPE, "Constant without a dense tensor value", State.HIGH)
            return
        # A constant or fill value that flushes to zero stays flexible: its readers decide.
        tiny = False
        if constant:
            rng = constant_range(out, self.target)
            if rng is not None and rng.overflow:
                self.constant_notes[out] = rng.describe(self.target)
                self._keep(node, Category.CONSTANT_RANGE, f"{out.name}: {self.constant_notes[out]}", State.WIDE)
                return
            tiny = rng is not None and rng.only_flushes
        elif rule.dtype_attribute == "value":
            tensor_attr = node.attributes.get("value")
            if tensor_attr is not None:
                array = tensor_attr.as_tensor().numpy().astype("float32")
                rng = tensor_range(ir.Tensor(array), self.target)
                note = f"fill value {array.reshape(-1)[:1]}: {rng.describe(self.target)}"
                if rng.overflow:
                    self._keep(node, Category.CONSTANT_RANGE, note, State.WIDE)
                    return
                tiny = rng.flushed > 0
                if tiny:
                    self.fill_notes[out] = note
        source = node.inputs[0] if node.inputs else None
        follows_input = (
            source is not None
            and is_fp32_tensor(source)
            and (rule.dtype_attribute == "to" or node.attributes.get(rule.dtype_attribute) is None)
        )
        if follows_input:
            state = self.value_state(source)  # type: ignore[arg-type]
            if state is State.LOW:
                # An FP32 copy of a 16-bit value: it vanishes when its consumers compute in
                # 16 bits, else it is the upcast they need.
                self._flex(node, facts)
                return
            if state in (State.HIGH, State.WIDE, State.TINY):
                # An FP32 copy carries what its input holds.
                self._keep(node, Category.FOLLOW, f"follows FP32 input {source.name!r}", state)  # type: ignore[union-attr]
                if state is not State.HIGH:
                    self.carried[out] = self.carried.get(source, source)  # type: ignore[arg-type]
                return
        self._flex(node, facts, tiny=tiny)

    # -- backward pass ------------------------------------------------------------------
    def demands(self, value: ir.Value) -> set[State]:
        """What the consumers of an FP32 value need: LOW and/or HIGH."""
        wanted: set[State] = set()
        for use in value.uses():
            consumer, index = use.node, use.idx
            facts = self.facts.get(consumer)
            if facts is None:
                wanted.add(State.HIGH)
                continue
            if index in facts.flexible:
                continue
            decision = self.decisions[consumer]
            if decision.precision is Precision.LOW:
                var = facts.sig.input_vars[index] if facts.sig and index < len(facts.sig.input_vars) else None
                wanted.add(State.LOW if var is not None and var in self.lowered[consumer] else State.HIGH)
            else:
                wanted.add(State.HIGH)
        if value in self.main_outputs:
            wanted.add(State.HIGH if self.keep_io_types else State.LOW)
        if value in self.sub_outputs:
            wanted.add(State.HIGH)
        return wanted

    def _resolve_flex(self) -> None:
        for node in reversed(self.flex_nodes):
            facts = self.facts[node]
            wanted: set[State] = set()
            for index, out in enumerate(node.outputs):
                if is_fp32_tensor(out) and (self.state.get(out) is State.FLEX or out in self.tiny_flex):
                    wanted |= self.demands(out)
            op_name = format_op_name(node.domain, node.op_type)
            if wanted == {State.LOW}:
                self._lower(node, facts, Category.CONSUMERS, f"{op_name}: all consumers compute in {self.target.short_name}")
            elif not wanted and quantizes_float_chain(node):
                # A QuantizeLinear has no float output: in 16 bits it lets the ops before it
                # (back to their DequantizeLinear) convert without a Cast.
                self._lower(node, facts, Category.CONSUMERS, f"{op_name}: reads a chain of ops computed in {self.target.short_name}")
            elif self._weight_heavy(node, facts):
                self._lower(
                    node,
                    facts,
                    Category.CONSUMERS,
                    f"{op_name}: reads a large constant, stored in {self.target.short_name}; "
                    "its output is cast for FP32 consumers",
                )
            else:
                why = "some consumers compute in FP32" if State.HIGH in wanted else "no 16-bit consumer"
                self._keep(node, Category.CONSUMERS, f"{op_name}: {why}", State.HIGH)

    # -- cast placement -----------------------------------------------------------------
    def view(self) -> PrecisionPlan:
        """The decisions so far as a plan (shares the planner's dictionaries)."""
        return PrecisionPlan(
            target=self.target, keep_io_types=self.keep_io_types, decisions=self.decisions,
            lowered_vars=self.lowered, facts=self.facts, storage=self.storage,
            constant_notes=self.constant_notes, saturated=self.saturated, order=self.order,
            graphs=self.graphs, keys=self.keys,
        )

    def op_types(self) -> set[tuple[str, str]]:
        """The (op type, domain) pairs the model uses."""
        return {(key[0], key[1]) for key in self._templates}

    def is_weight_heavy(self, node: ir.Node) -> bool:
        """Whether the node was lowered for the large constant it reads (kept as decided)."""
        return self._weight_heavy(node, self.facts[node])

    def _place_casts(self) -> None:
        """Re-decide the follow-class nodes of each FP32 island by cast cost (minimum cut)."""
        changed = False
        for island, assignment, before, after in min_cut_islands(self):
            anchor = self.keys.get(island.nodes[0]) or island.nodes[0].op_type
            why = (
                f"the cheapest cast placement for the {len(island.nodes)} follow node(s) around "
                f"{anchor!r}: {before[0]} -> {after[0]} casts, {before[1]:,} -> {after[1]:,} bytes per inference"
            )
            for node in island.nodes:
                low = assignment[node]
                if low == (self.decisions[node].precision is Precision.LOW):
                    continue
                facts = self.facts[node]
                op_name = format_op_name(node.domain, node.op_type)
                if low:
                    for out in node.outputs:
                        self.bounded.pop(out, None)
                    self._lower(node, facts, Category.CAST_COST, f"{op_name} in {self.target.short_name}: {why}")
                else:
                    self._keep(node, Category.CAST_COST, f"{op_name} in FP32: {why}", State.HIGH)
            changed = True
        if changed:
            self._settle_constants()

    def _settle_constants(self) -> None:
        """Constant nodes decided 16-bit before the placement keep FP32 where a reader now
        computes in FP32 (their FP32 value serves it; 16-bit readers get a stored copy)."""
        for node in self.order:
            if node.op_type != "Constant" or self.decisions[node].precision is not Precision.LOW:
                continue
            if any(State.HIGH in self.demands(out) for out in node.outputs if is_fp32_tensor(out)):
                op_name = format_op_name(node.domain, node.op_type)
                self._keep(node, Category.CONSUMERS, f"{op_name}: some consumers compute in FP32", State.HIGH)

    def _weight_heavy(self, node: ir.Node, facts: NodeFacts) -> bool:
        """Whether a data-movement node reads constants far larger than what it produces.

        Storing such a constant (an embedding table read by Gather, say) in 16 bits and casting
        the small output is cheaper than keeping the table in FP32.
        """
        # Ops that read a selection of a (possibly large) constant (`gathers` in the op facts).
        if facts.sig is None or not op_facts(node.domain, node.op_type).gathers:
            return False
        constant_elements = 0
        for value, var in zip(node.inputs, facts.sig.input_vars):
            if value is not None and var in facts.lowerable and is_fp32_tensor(value) and is_constant(value):
                tensor = value.const_value
                if tensor is not None:
                    constant_elements += tensor.size
        if constant_elements < _HEAVY_CONSTANT_ELEMENTS:
            return False
        output_elements = 0
        for out in node.outputs:
            shape = out.shape
            if shape is None or not all(isinstance(d, int) for d in shape.dims):
                return True
            output_elements += int(math.prod(int(d) for d in shape.dims))
        return constant_elements >= 4 * output_elements

    def _decide_storage(self) -> None:
        for graph in self.graphs:
            for value in graph.initializers.values():
                if not is_fp32_tensor(value) or value.is_graph_input():
                    continue
                self.storage[value] = self._storage_for(value)
        for node in self.order:
            if node.op_type == "Constant" and is_default_domain(node.domain) and node.outputs:
                out = node.outputs[0]
                if is_fp32_tensor(out) and self.decisions[node].precision is not Precision.LOW:
                    wanted = self.demands(out)
                    if State.LOW in wanted and self.state.get(out) not in (State.WIDE, State.TINY):
                        self.storage[out] = Storage.BOTH

    def _storage_for(self, value: ir.Value) -> Storage:
        wanted = self.demands(value)
        if self.state.get(value) is State.WIDE and value not in self.saturated:
            note = self._wide_evidence(value)
            self.constant_notes[value] = note
            return Storage.FP32
        if wanted == {State.LOW}:
            return Storage.LOW
        if State.LOW in wanted:
            return Storage.BOTH
        return Storage.FP32


def plan_precision(
    model: ir.Model,
    policy: Policy,
    *,
    exclude_nodes: Sequence[str] | NodeMatcher = (),
    keep_io_types: bool = True,
    forced_fp32: Mapping[ir.Node, tuple[Category, str]] | None = None,
    wide_values: Mapping[ir.Value, str] | None = None,
    runtime: RuntimeProfile | None = None,
    keys: Mapping[ir.Node, str] | None = None,
    safe_values: Mapping[ir.Value, str] | None = None,
) -> PrecisionPlan:
    """Decide the precision of every node of a typed model.

    Args:
        model: The FP32 model, with types filled in (see `infer_types`). Not modified.
        policy: The op policy for the target type.
        exclude_nodes: Node names or regular expressions (`re.search`) of nodes kept FP32.
        keep_io_types: Keep the model's FP32 inputs and outputs in FP32.
        forced_fp32: Nodes that analyses (integer semantics, ...) keep FP32, with category and
            evidence.
        wide_values: FP32 values known (e.g. measured on data) to leave the 16-bit range, with
            evidence: they are never narrowed, and nodes producing them stay FP32.
        runtime: The runtime profile whose kernels the converted nodes must have (default: the
            ONNX schema alone).
        keys: The nodes' stable keys, when already known (default: `node_keys(model)`).
        safe_values: FP32 values known (e.g. measured on data) to fit the 16-bit type, with
            evidence: like bounded op outputs, they do not hold the follow ops they feed in FP32.

    Returns:
        The plan.
    """
    matcher = exclude_nodes if isinstance(exclude_nodes, NodeMatcher) else NodeMatcher(exclude_nodes)
    return _Planner(model, policy, matcher, keep_io_types, forced_fp32, wide_values, runtime, keys, safe_values).run()


# Weights-only storage skips tensors smaller than this: a Cast node costs more than it saves.
_WEIGHTS_ONLY_MIN_ELEMENTS = 1024


def weights_only(plan: PrecisionPlan) -> PrecisionPlan:
    """The plan that stores weights in the 16-bit type and computes everything in FP32.

    Every FP32 initializer of at least 1,024 elements whose values the 16-bit type represents
    is stored in 16 bits and cast back to FP32 once where it is read (runtimes fold that Cast
    into a constant when loading): half the file, FP32 arithmetic.
    """
    keep = Decision(Precision.FP32, Category.WEIGHTS_ONLY, "weights-only conversion: computes in FP32")
    decisions = {
        node: keep if d.precision is Precision.LOW else d for node, d in plan.decisions.items()
    }
    storage: dict[ir.Value, Storage] = {}
    for graph in plan.graphs:
        for value in graph.initializers.values():
            tensor = value.const_value
            if not is_fp32_tensor(value) or value.is_graph_input() or tensor is None:
                continue
            if tensor.size < _WEIGHTS_ONLY_MIN_ELEMENTS or not value.uses():
                continue
            rng = constant_range(value, plan.target)
            storage[value] = Storage.LOW if rng is None or rng.representable else Storage.FP32
    return replace(
        plan,
        decisions=decisions,
        lowered_vars={node: frozenset() for node in plan.lowered_vars},
        storage=storage,
        saturated=set(),
    )
