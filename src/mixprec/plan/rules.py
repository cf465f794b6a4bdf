"""The rules that decide a node's precision, in the order the planner tries them.

Each rule is a function ``(node, facts, context) -> Ruling | None``: it looks at one node (its
facts: policy rule, schema binding, lowerable type variables) and at what the planner knows of
the values it reads (the context), and either decides the node or passes (None). The first rule
that decides wins (:data:`RULES`); the last one always decides. The planner tries, per op
template, only the rules that may decide its nodes (:func:`rules_for`): the same ruling, fewer
calls. A ruling names the decision the plan records (precision, category, reason) and what the
node's FP32 outputs hold afterwards (a state of the planner's lattice, see
:mod:`mixprec.plan.planner`). The rules after the policy share what they read of a node (its
policy class, what its inputs hold: :mod:`mixprec.plan.readings`).

The rules, in order:

1. ``control_flow``: a node with subgraphs keeps its types (the subgraphs are converted inside).
2. ``function_call``: a call of a model-local function keeps its signature.
3. ``integer_kernel``: an op computing on integers (QLinearConv, ...) has nothing to convert.
4. ``unknown_op``: an op without a policy rule or a schema stays FP32.
5. ``no_float``: a node without FP32 values has nothing to convert.
6. ``unknown_type``: an input whose type is unknown keeps the node FP32.
7. ``excluded``: the user excluded the node by name.
8. ``forced``: an analysis run before planning (integer semantics, ...) keeps it FP32.
9. ``measured_wide``: an output measured beyond the 16-bit range keeps it FP32.
10. ``dtype_source``: ops whose output type is an attribute (Cast, Constant, ...).
11. ``fixed_type``: an attribute fixes the output type.
12. ``runtime_blocked``: the runtime has no 16-bit kernel for its FP32 values.
13. ``schema``: the schema has no 16-bit type for its FP32 values.
14. ``policy_class``: the policy (or a condition) keeps the op FP32.
15. ``runtime_one_type``: the runtime needs one element type where an input must stay FP32.
16. ``wide_inputs``: inputs that must not be narrowed keep the node FP32.
17. ``folded_at_load``: a node the runtime folds into a constant when it loads the model, with
    kernels that have no 16-bit one for it, stays FP32.
18. ``low_class``: the policy lowers the op.
19. ``follow_fp32``: a follow op with an FP32 input stays FP32.
20. ``follow_low``: a follow op with a 16-bit input is lowered.
21. ``flexible``: a follow op over flexible values is left to its consumers.
"""

from __future__ import annotations

import enum
import functools
from collections import ChainMap
from collections.abc import Callable, Container, Mapping
from dataclasses import replace
from typing import NamedTuple, Protocol

import onnx_ir as ir

from mixprec.analysis.constants import ConstantRange, is_constant, tensor_range
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.plan.model import Category, Decision, NodeFacts, NodeMatcher, Precision, State
from mixprec.plan.readings import Inputs, PolicyClass
from mixprec.policy.opfacts import OpFacts, op_facts
from mixprec.policy.profiles import ConstantFolding, RuntimeProfile
from mixprec.policy.table import OpClass, OpRule, format_op_name

__all__ = ["RULES", "Action", "PlanContext", "Rule", "Ruling", "decide", "rules_for"]

_FP32_STATES = (State.HIGH, State.WIDE, State.TINY)


class Action(enum.Enum):
    """What the planner does with a node a rule decided."""

    KEEP = "keep"  # FP32 (the ruling's state says what its FP32 outputs hold)
    LOWER = "lower"  # computes in the 16-bit type
    FLEX = "flex"  # provisional: its consumers decide (the backward pass)


class Ruling(NamedTuple):
    """A rule's verdict on a node (immutable; a named tuple: one is made per node decided).

    Attributes:
        action: Keep FP32, lower, or leave to the consumers.
        category: Why (the report groups by this).
        reason: The evidence, in words.
        state: For KEEP, what the node's FP32 outputs hold (HIGH, WIDE or TINY).
        tiny: For FLEX, whether the outputs hold values that flush to zero in 16 bits.
        facts: The node's facts as the rule found them, when they differ from the planner's
            (a dtype source lowers its output type variable only).
        carries: An input whose origin the node's FP32 outputs carry (values not to narrow).
        scaled: Evidence that the FP32 outputs are safe in 16 bits (a product with a factor
            that flushes to zero).
        evidence: Values -> why they stay FP32 (out-of-range constants).
        fill: Generated values -> why they flush to zero (a fill value).
    """

    action: Action
    category: Category
    reason: str
    state: State = State.HIGH
    tiny: bool = False
    facts: NodeFacts | None = None
    carries: ir.Value | None = None
    scaled: str | None = None
    evidence: tuple[tuple[ir.Value, str], ...] = ()
    fill: tuple[tuple[ir.Value, str], ...] = ()

    @property
    def decision(self) -> Decision:
        """The decision the plan records (before the backward pass for FLEX)."""
        if self.action is Action.LOWER:
            return Decision(Precision.LOW, self.category, self.reason)
        return Decision(Precision.FP32, self.category, self.reason)


def _keep(category: Category, reason: str, state: State = State.HIGH, **more: object) -> Ruling:
    return Ruling(Action.KEEP, category, reason, state, **more)  # type: ignore[arg-type]


def _lower(category: Category, reason: str, **more: object) -> Ruling:
    return Ruling(Action.LOWER, category, reason, State.LOW, **more)  # type: ignore[arg-type]


def _flex(*, tiny: bool = False, **more: object) -> Ruling:
    return Ruling(Action.FLEX, Category.CONSUMERS, "pending", State.FLEX, tiny, **more)  # type: ignore[arg-type]


class PlanContext(Protocol):
    """What the rules read from the planner (:class:`mixprec.plan.planner.Planner`)."""

    target: LowPrecision
    runtime: RuntimeProfile
    exclude: NodeMatcher
    forced: Mapping[ir.Node, tuple[Category, str]]  # nodes analyses keep FP32 -> (category, evidence)
    wide_values: Mapping[ir.Value, str]  # values measured beyond the 16-bit range -> evidence
    bounded: Mapping[ir.Value, str]  # FP32 values a 16-bit copy holds safely -> evidence
    carried: Mapping[ir.Value, ir.Value]  # FP32 values that carry a wide value's range -> that value
    fp32: Container[ir.Value]  # the model's FP32 tensor values (read once when planning starts)
    folding: ConstantFolding | None  # how the runtime folds constant nodes when it loads a model

    has_control_flow: bool  # some node owns subgraphs
    has_functions: bool  # the model has functions of its own

    def is_control_flow(self, node: ir.Node) -> bool: ...  # the node owns subgraphs
    def is_function_call(self, node: ir.Node) -> bool: ...  # the node calls a model-local function
    def touches_fp32(self, node: ir.Node) -> bool: ...  # reads or writes FP32 (flexible inputs aside)
    def value_state(self, value: ir.Value) -> State: ...
    def measured_state(self, value: ir.Value) -> State: ...  # WIDE or TINY for a measured value
    def is_flexible(self, value: ir.Value) -> bool: ...  # a constant, or data movement of constants
    def constant_range(self, value: ir.Value) -> ConstantRange | None: ...
    def folds_at_load(self, node: ir.Node) -> bool: ...  # computed when the model loads from fitting constants
    def opset_of(self, node: ir.Node) -> int | None: ...  # the opset version of the node's op
    def saturates(self, value: ir.Value) -> bool: ...  # an out-of-range constant all of whose readers saturate it
    def normalized_output_fits(self, node: ir.Node) -> bool: ...  # a normalization's output, scaled after it, fits
    def classify(self, node: ir.Node, facts: NodeFacts) -> PolicyClass: ...  # `readings.classify`, once per node
    def inputs(self, node: ir.Node, facts: NodeFacts) -> Inputs: ...  # `readings.read_inputs`, once per node


Rule = Callable[[ir.Node, NodeFacts, PlanContext], "Ruling | None"]


# -- rules before the policy ------------------------------------------------------------------
def control_flow(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """A node with subgraphs keeps its types; its subgraphs are converted inside."""
    if context.is_control_flow(node):
        return _keep(Category.CONTROL_FLOW, "boundary keeps its types; subgraphs are converted inside")
    return None


def function_call(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """A call of a model-local function keeps its signature; its body is converted inside."""
    if context.is_function_call(node):
        op_name = format_op_name(node.domain, node.op_type)
        return _keep(Category.FUNCTION, f"{op_name}: signature kept; its body is converted inside")
    return None


def integer_kernel(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """An op that computes on 8-bit integers (QLinearConv, ...) reads FP32 only as its
    quantization scales and writes no float values: nothing in it to convert."""
    if not op_facts(node.domain, node.op_type).integer_kernel or any(map(is_fp32_tensor, node.outputs)):
        return None
    op_name = format_op_name(node.domain, node.op_type)
    return _keep(Category.INTEGER_KERNEL, f"{op_name}: computes on integers; its float inputs are quantization scales")


def unknown_op(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """An op the policy does not know, or without a schema, stays FP32."""
    if facts.rule is not None and facts.sig is not None:
        return None
    why = "not in the policy" if facts.sig is not None else "no ONNX schema for this op and opset"
    return _keep(Category.UNKNOWN_OP, f"{format_op_name(node.domain, node.op_type)}: {why}")


def no_float(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """A node that neither reads nor writes FP32 values has nothing to convert."""
    if context.touches_fp32(node):
        return None
    return _keep(Category.NO_FLOAT, "no FP32 values")


def unknown_type(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """An input of a lowerable type variable whose type is unknown keeps the node FP32."""
    sig = facts.sig
    assert sig is not None  # noqa: S101 (unknown_op decided nodes without one)
    lowerable, fp32 = facts.lowerable, context.fp32
    for value, var in zip(node.inputs, sig.input_vars):
        # An FP32 value's type is known: only the others' is read.
        if value is not None and var in lowerable and value not in fp32 and value.dtype is None:
            return _keep(Category.UNKNOWN_TYPE, f"type of {value.name!r} is unknown")
    return None


def excluded(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """The user excluded the node by name (exact name or regular expression)."""
    pattern = context.exclude.match(node.name or "")
    if pattern is None:
        return None
    return _keep(Category.EXCLUDED, f"node name matches {pattern!r}")


def forced(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """An analysis run before planning (integer semantics, a plan file, ...) keeps it FP32."""
    found = context.forced.get(node)
    if found is None:
        return None
    return _keep(found[0], found[1])


def measured_wide(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """An output measured on data beyond the 16-bit range keeps the node FP32."""
    if not context.wide_values:
        return None
    out = next((out for out in node.outputs if out in context.wide_values), None)
    if out is None:
        return None
    return _keep(Category.DATA_RANGE, f"{out.name}: {context.wide_values[out]}", context.measured_state(out))


# -- dtype sources ------------------------------------------------------------------------------
def dtype_source(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """Ops whose output type is an attribute (Cast, Constant, ConstantOfShape, EyeLike, ...):
    kept FP32 where the schema or runtime has no 16-bit output, the value does not fit or the
    input it copies is FP32; else left to their consumers."""
    rule = facts.rule
    if rule is None or rule.dtype_attribute is None:
        return None
    if not node.outputs or not is_fp32_tensor(node.outputs[0]):
        return _keep(Category.NO_FLOAT, "no FP32 values")
    sig = facts.sig
    out_var = sig.output_vars[0] if sig is not None and sig.output_vars else None
    if out_var is not None:
        kept = _output_type_kept(node, facts, out_var, context)
        if kept is not None:
            return kept
    facts = replace(facts, lowerable=frozenset({out_var}) if out_var is not None else frozenset())
    generated = _generated_value(node, facts, context)
    if isinstance(generated, Ruling):
        return generated
    tiny, fill = generated
    source = _followed_input(node, rule.dtype_attribute)
    if source is not None:
        return _copy(source, facts, fill, tiny, context)
    return _flex(tiny=tiny, facts=facts, fill=fill)


def _followed_input(node: ir.Node, dtype_attribute: str) -> ir.Value | None:
    """The FP32 input whose type a dtype source's output follows (a Cast, or an op without its
    dtype attribute set); None when there is none."""
    source = node.inputs[0] if node.inputs else None
    follows_input = (
        source is not None
        and is_fp32_tensor(source)
        and (dtype_attribute == "to" or node.attributes.get(dtype_attribute) is None)
    )
    return source if follows_input else None


def _copy(
    source: ir.Value, facts: NodeFacts, fill: tuple[tuple[ir.Value, str], ...], tiny: bool, context: PlanContext
) -> Ruling:
    """A dtype source that copies its FP32 input (a Cast to FP32, ...)."""
    state = context.value_state(source)
    if state is State.LOW:
        # An FP32 copy of a 16-bit value: it vanishes when its consumers compute in 16 bits,
        # else it is the upcast they need.
        return _flex(facts=facts, fill=fill)
    if state in _FP32_STATES:
        # An FP32 copy carries what its input holds.
        carries = source if state is not State.HIGH else None
        reason = f"follows FP32 input {source.name!r}"
        return _keep(Category.FOLLOW, reason, state, facts=facts, carries=carries, fill=fill)
    return _flex(tiny=tiny, facts=facts, fill=fill)


def _output_type_kept(node: ir.Node, facts: NodeFacts, out_var: str, context: PlanContext) -> Ruling | None:
    """A dtype source whose schema or runtime has no 16-bit output type stays FP32."""
    sig = facts.sig
    assert sig is not None  # noqa: S101 (out_var comes from it)
    if context.target.type_str not in sig.allowed.get(out_var, ()):
        return _keep(Category.SCHEMA, f"{node.op_type}-{sig.since_version} has no {context.target.value} output type")
    if out_var in facts.runtime_blocked:
        return _keep(Category.RUNTIME, facts.runtime_reason or "no 16-bit kernel")
    return None


def _generated_value(
    node: ir.Node, facts: NodeFacts, context: PlanContext
) -> Ruling | tuple[bool, tuple[tuple[ir.Value, str], ...]]:
    """For a dtype source, the ruling that keeps a constant or fill value out of the 16-bit
    range FP32, or whether its value flushes to zero (it stays flexible: its readers decide)
    and the evidence for a fill value that does."""
    out = node.outputs[0]
    if is_constant(out):
        rng = context.constant_range(out)
        if rng is not None and rng.overflow and context.saturates(out):
            return False, ()  # every reader saturates it: its readers decide
        if rng is not None and rng.overflow:
            note = rng.describe(context.target)
            reason = f"{out.name}: {note}"
            return _keep(Category.CONSTANT_RANGE, reason, State.WIDE, facts=facts, evidence=((out, note),))
        return rng is not None and rng.only_flushes, ()
    if node.op_type == "Constant":
        # e.g. a sparse_value Constant: nothing this rewrite can retype.
        return _keep(Category.UNKNOWN_TYPE, "Constant without a dense tensor value", facts=facts)
    fills = facts.rule is not None and facts.rule.dtype_attribute == "value"
    tensor_attr = node.attributes.get("value") if fills else None
    if tensor_attr is None:
        return False, ()
    if tensor_attr.is_ref():  # a function's caller gives it: nothing this rewrite can retype
        return _keep(Category.UNKNOWN_TYPE, f"fill value given by the function's caller ({tensor_attr.ref_attr_name})", facts=facts)
    array = tensor_attr.as_tensor().numpy().astype("float32")
    rng = tensor_range(ir.Tensor(array), context.target)
    note = f"fill value {array.reshape(-1)[:1]}: {rng.describe(context.target)}"
    if rng.overflow:
        return _keep(Category.CONSTANT_RANGE, note, State.WIDE, facts=facts)
    tiny = rng.flushed > 0
    return tiny, ((out, note),) if tiny else ()


# -- schema and runtime -------------------------------------------------------------------------
def fixed_type(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """An attribute that, when set, fixes the output type (DequantizeLinear's output_dtype):
    the node keeps its types."""
    fixed_by = op_facts(node.domain, node.op_type).dtype_attribute
    fixing = node.attributes.get(fixed_by) if fixed_by is not None else None
    if fixing is None or (fixing.type is ir.AttributeType.INT and fixing.as_int() == 0):  # 0: unset
        return None
    op_name = format_op_name(node.domain, node.op_type)
    return _keep(Category.SCHEMA, f"{op_name}: its {fixed_by} attribute fixes its output type")


def _always_fp32(rule: OpRule) -> bool:
    """Whether the policy keeps every node of the rule's op FP32 (an fp32 rule without a
    condition under which some follow their inputs)."""
    return rule.op_class is OpClass.FP32 and rule.condition is None


def runtime_blocked(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """The runtime has no 16-bit kernel for the node's FP32 values (and the policy would not
    keep it FP32 anyway)."""
    if facts.lowerable or not facts.runtime_blocked & facts.float_vars:
        return None
    if facts.rule is None or context.classify(node, facts).op_class is OpClass.FP32:
        return None
    return _keep(Category.RUNTIME, facts.runtime_reason or "no 16-bit kernel")


def schema(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """The schema allows no 16-bit type for the node's FP32 values."""
    if facts.lowerable:
        return None
    op_name = format_op_name(node.domain, node.op_type)
    if facts.float_vars:
        since = facts.sig.since_version  # type: ignore[union-attr]
        reason = f"{op_name}-{since} has no {context.target.value} type for its FP32 values"
    else:
        reason = f"{op_name} fixes its float types in the schema"
    return _keep(Category.SCHEMA, reason)


# -- the policy ----------------------------------------------------------------------------------
def policy_class(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """The policy keeps the op FP32, or its condition does not hold (a follow op's: for the
    rule's reason)."""
    found = context.classify(node, facts)
    if not found.held:
        return _keep(Category.CONDITION, found.reason)
    if found.op_class is OpClass.FP32:
        return _keep(Category.POLICY, found.reason)
    rule = facts.rule
    if rule is not None and rule.kernel_accumulation and not context.normalized_output_fits(node):
        # Converted for its runtime's FP32 accumulation, a normalization's 16-bit output must fit.
        op_name = format_op_name(node.domain, node.op_type)
        return _keep(Category.POLICY, (
            f"{op_name}: its output, through the constant scale and shift after it, is not bounded "
            f"within the {context.target.value} range"
        ))
    return None


def runtime_one_type(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """The runtime needs one element type for all of the op's inputs, and one must stay FP32."""
    inputs = context.inputs(node, facts)
    if not inputs.wide or not context.runtime.needs_one_type(node.domain, node.op_type):
        return None
    op_name = format_op_name(node.domain, node.op_type)
    pinned = "; ".join(inputs.facts.pinned_evidence)
    return _keep(Category.RUNTIME, f"{context.runtime.name} needs one element type for all {op_name} inputs; {pinned}")


def wide_inputs(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """Inputs that must not be narrowed keep the node FP32 when none of its outputs is lowered.

    Its outputs' state says what they hold: data movement passes WIDE and TINY values on, an
    elementwise op WIDE ones, and a product of a TINY factor with values that fit is an ordinary
    value a 16-bit reader may take through a Cast (the FP32 ends at this node).
    """
    inputs = context.inputs(node, facts)
    if not inputs.wide or _has_lowered_output(node, inputs.facts):
        return None
    measured = any(context.carried.get(v, v) in context.wide_values for _, v, _ in inputs.wide)
    category = Category.DATA_RANGE if measured else Category.CONSTANT_RANGE
    reason = "; ".join(inputs.facts.pinned_evidence)
    fact = op_facts(node.domain, node.op_type)
    wide = [v for _, v, st in inputs.wide if st is State.WIDE]
    if wide and context.classify(node, facts).op_class is OpClass.FOLLOW:
        if fact.bounded or _outputs_fit(node, context):
            # What leaves the range ends here (a Sigmoid's output, an integer accumulator times
            # its scale measured to fit): FP32 values a 16-bit reader may take through a Cast.
            return _keep(category, reason)
        return _keep(category, reason, State.WIDE, carries=wide[0])
    if not wide and fact.value_preserving:
        return _keep(category, reason, State.TINY, carries=inputs.wide[0][1])
    return _keep(category, reason, scaled=_scaled(inputs, fact, context) if not wide else None)


def _outputs_fit(node: ir.Node, context: PlanContext) -> bool:
    """Whether every FP32 output of the node is known to fit the 16-bit type (measured on data,
    or bounded), so that nothing it writes carries its inputs' range on."""
    outputs = [out for out in node.outputs if out is not None and out in context.fp32]
    return bool(outputs) and all(out in context.bounded for out in outputs)


def _scaled(inputs: Inputs, fact: OpFacts, context: PlanContext) -> str | None:
    """Evidence that a product of TINY factors with values that fit is safe in 16 bits."""
    pinned = {v for _, v, _ in inputs.wide}
    if not all(fact.scales(i) for i, _, _ in inputs.wide):
        return None
    others_fit = all(
        inputs.states[v] in (State.LOW, State.FLEX, State.TINY) or v in context.bounded
        for _, v, _ in inputs.considered
        if v not in pinned
    )
    if not others_fit:
        return None
    return f"scaled by {inputs.wide[0][1].name!r}, below the {context.target.short_name} normal range"


def _has_lowered_output(node: ir.Node, facts: NodeFacts) -> bool:
    sig = facts.sig
    if sig is None:
        return False
    return any(
        out is not None and is_fp32_tensor(out) and var is not None and var in facts.lowerable
        for out, var in zip(node.outputs, sig.output_vars)
    )


def folded_at_load(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """A node computed from constants alone, which the runtime folds into a constant when it
    loads the model with kernels that have no 16-bit one for it (at its opset), stays FP32:
    lowered, it would run at every inference instead (a weight dequantized from int8 by a Mul
    with its scale: the whole weight, each time). Only where its FP32 inputs are constants that
    fit the 16-bit type, or computed from such alone (`Planner.folds_at_load`): its 16-bit
    readers read a Cast of it, folded too, and to them it is a constant (FLEX). Constants beyond
    the range, flushing or saturating, and values other rules hold FP32, are theirs to decide.
    """
    if not context.folds_at_load(node):
        return None
    folding = context.folding
    assert folding is not None  # noqa: S101 (folds_at_load holds)
    op_name = format_op_name(node.domain, node.op_type)
    return _keep(Category.FOLDED, (
        f"{op_name} of constants: {context.runtime.engine} computes it once when it loads the model, with "
        f"{folding.kernels.name} kernels, which have no {context.target.value} {op_name}"
    ), State.FLEX)


def low_class(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """The policy lowers the op."""
    found = context.classify(node, facts)
    if found.op_class is not OpClass.LOW:
        return None
    return _lower(found.category, found.reason)


def _safe(inputs: Inputs, context: PlanContext) -> Mapping[ir.Value, str]:
    """FP32 inputs whose 16-bit copy is safe: bounded values (a Cos, Sigmoid or Softmax output,
    a range measured to fit) and additive values that only flush to zero."""
    # A view, not a merged copy: `bounded` grows with the graph and this runs per node.
    return ChainMap(inputs.castable, context.bounded) if inputs.castable else context.bounded  # type: ignore[arg-type]


def follow_fp32(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """A follow op with an FP32 input that is not safe in 16 bits stays FP32.

    A bounded FP32 input does not hold the node in FP32: a 16-bit copy of it costs no more
    accuracy than 16-bit compute, and one Cast of it replaces casts around everything downstream.
    """
    inputs = context.inputs(node, facts)
    safe = _safe(inputs, context)
    high = next((v for _, v, _ in inputs.lowerable if inputs.states[v] in _FP32_STATES and v not in safe), None)
    if high is None:
        return None
    return _keep(Category.FOLLOW, f"follows FP32 input {high.name!r}")


def follow_low(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling | None:
    """A follow op with a 16-bit input computes in 16 bits (safe FP32 inputs are cast)."""
    inputs = context.inputs(node, facts)
    considered = inputs.lowerable
    if not any(inputs.states[v] is State.LOW for _, v, _ in considered):
        return None
    found = context.classify(node, facts)
    condition = found.category is Category.CONDITION
    reason = found.reason if condition else _follows_low_reason(node.domain, node.op_type)
    safe = _safe(inputs, context)
    cast = next((v for _, v, _ in considered if inputs.states[v] is State.HIGH and v in safe), None)
    if cast is not None:
        reason += f"; its FP32 input {cast.name!r} is cast to 16 bits ({safe[cast]})"
    return _lower(Category.CONDITION if condition else Category.FOLLOW, reason)


@functools.lru_cache(maxsize=None)
def _follows_low_reason(domain: str, op_type: str) -> str:
    """The reason of a follow op lowered with its 16-bit inputs (made once per op)."""
    return f"follows 16-bit inputs ({format_op_name(domain, op_type)})"


def flexible(node: ir.Node, facts: NodeFacts, context: PlanContext) -> Ruling:
    """A follow op over flexible values (constants, graph inputs, ...): its consumers decide."""
    inputs = context.inputs(node, facts)
    carries = None
    if inputs.moves_tiny:
        carries = next(v for _, v, _ in inputs.lowerable if context.value_state(v) is State.TINY)
    return _flex(tiny=inputs.moves_tiny, carries=carries)


RULES: tuple[Rule, ...] = (
    control_flow,
    function_call,
    integer_kernel,
    unknown_op,
    no_float,
    unknown_type,
    excluded,
    forced,
    measured_wide,
    dtype_source,
    fixed_type,
    runtime_blocked,
    schema,
    policy_class,
    runtime_one_type,
    wide_inputs,
    folded_at_load,
    low_class,
    follow_fp32,
    follow_low,
    flexible,
)


# When a rule may decide a node, judged from what every node of one op template shares (its
# policy rule, schema binding and runtime binding, op facts) and from the run's inputs (exclusion
# patterns, forced nodes, measured values): where its condition is false, the rule passes on every
# such node. Rules not listed may decide any node.
_MAY_DECIDE: dict[Rule, Callable[[ir.Node, NodeFacts, PlanContext], bool]] = {
    control_flow: lambda node, facts, context: context.has_control_flow,
    function_call: lambda node, facts, context: context.has_functions,
    integer_kernel: lambda node, facts, context: op_facts(node.domain, node.op_type).integer_kernel,
    unknown_op: lambda node, facts, context: facts.rule is None or facts.sig is None,
    excluded: lambda node, facts, context: bool(context.exclude.patterns),
    forced: lambda node, facts, context: bool(context.forced),
    measured_wide: lambda node, facts, context: bool(context.wide_values),
    dtype_source: lambda node, facts, context: facts.rule is not None and facts.rule.dtype_attribute is not None,
    fixed_type: lambda node, facts, context: op_facts(node.domain, node.op_type).dtype_attribute is not None,
    runtime_blocked: lambda node, facts, context: (
        bool(facts.runtime_blocked) and facts.rule is not None and not _always_fp32(facts.rule)
    ),
    policy_class: lambda node, facts, context: facts.rule is not None and (
        facts.rule.op_class in (OpClass.FP32, OpClass.CONDITIONAL) or facts.rule.condition is not None
        or facts.rule.kernel_accumulation
    ),
    runtime_one_type: lambda node, facts, context: context.runtime.needs_one_type(node.domain, node.op_type),
    folded_at_load: lambda node, facts, context: context.folding is not None and context.folding.folds_only_in_fp32(
        node.domain, node.op_type, context.opset_of(node), context.target.type_str
    ),
    low_class: lambda node, facts, context: facts.rule is not None and facts.rule.op_class is OpClass.LOW,
}


def rules_for(node: ir.Node, facts: NodeFacts, context: PlanContext) -> tuple[Rule, ...]:
    """The rules of :data:`RULES`, in order, that may decide a node of the op template of `node`
    in this run (the others pass on every such node: :func:`decide` gives the same ruling with
    these alone). Only what the template fixes is read of `facts` (policy rule, schema and
    runtime bindings); the exclusion patterns, forced nodes and measured values must not change
    afterwards."""
    return tuple(rule for rule in RULES if rule not in _MAY_DECIDE or _MAY_DECIDE[rule](node, facts, context))


def decide(node: ir.Node, facts: NodeFacts, context: PlanContext, rules: tuple[Rule, ...] = RULES) -> Ruling:
    """The ruling of the first rule that decides the node, of `rules` (default: all of
    :data:`RULES`; the planner passes those of :func:`rules_for` the node's template)."""
    for rule in rules:
        ruling = rule(node, facts, context)
        if ruling is not None:
            return ruling
    raise AssertionError("the last rule decides every node")  # pragma: no cover
