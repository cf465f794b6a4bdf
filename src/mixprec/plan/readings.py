"""What the rules after the policy read of a node, once per node: its policy class (a
conditional op's condition evaluated) and what its FP32 inputs hold (which must not be narrowed,
which saturate, which only flush to zero where the node adds or moves them); and whether a
data-movement node reads a large constant (the backward pass and the cast placement keep it
16-bit)."""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import onnx_ir as ir

from mixprec.analysis.constants import is_constant, overflows_only_below, small_constant_array
from mixprec.analysis.small_floors import reads_singularly
from mixprec.dtypes import is_fp32_tensor
from mixprec.plan.model import Category, NodeFacts, State
from mixprec.policy.conditions import CONDITIONS
from mixprec.policy.opfacts import op_facts
from mixprec.policy.table import OpClass, format_op_name

if TYPE_CHECKING:
    from mixprec.plan.rules import PlanContext

__all__ = ["Inputs", "PolicyClass", "classify", "guards_zero", "read_inputs", "weight_heavy"]

# Constants of at least this many elements count as large weights.
_HEAVY_CONSTANT_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class PolicyClass:
    """How the policy classes a node: its op class, and the category and reason a decision by
    that class records (a conditional op's condition evaluated: FOLLOW when it holds)."""

    op_class: OpClass
    category: Category
    reason: str
    held: bool = True  # False: a condition that did not hold keeps the node FP32


class Inputs(NamedTuple):
    """What a node's FP32 inputs hold, read once per node by the rules after the policy class
    (immutable; a named tuple: one is made per node).

    Attributes:
        facts: The node's facts with the type variables of pinned inputs no longer lowerable.
        considered: (index, value, type variable) of the FP32 inputs bound to lowerable type
            variables (flexible inputs aside), before pinning.
        states: Input value -> state, after saturation and the flush rule.
        wide: (index, value, state) of the inputs that must not be narrowed.
        castable: Inputs held FP32 whose 16-bit copy is safe -> why (what flushes is additive).
        moves_tiny: Data movement of constants that flush to zero (its readers decide).
        lowerable: The considered inputs whose type variable the node still lowers.
        saturated: Constants whose out-of-range values saturate to the 16-bit maximum.
    """

    facts: NodeFacts
    considered: tuple[tuple[int, ir.Value, str], ...]
    states: Mapping[ir.Value, State]
    wide: tuple[tuple[int, ir.Value, State], ...]
    castable: Mapping[ir.Value, str]
    moves_tiny: bool
    lowerable: tuple[tuple[int, ir.Value, str], ...]
    saturated: tuple[ir.Value, ...] = ()


def classify(node: ir.Node, facts: NodeFacts) -> PolicyClass:
    """The node's op class from the policy; a conditional op's condition decides FOLLOW or FP32,
    an FP32 op's condition, where it holds, makes it FOLLOW, and a follow op's condition, where
    it does not hold, makes it FP32 (elsewhere it is a follow op like any other)."""
    rule = facts.rule
    assert rule is not None  # noqa: S101 (unknown_op decided nodes without one)
    op_name = format_op_name(node.domain, node.op_type)
    if rule.condition is None:
        return PolicyClass(rule.op_class, Category.POLICY, f"{op_name}: {rule.reason}")
    result = CONDITIONS[rule.condition](node, small_constant_array, rule.params)
    if rule.op_class is OpClass.FOLLOW:
        op_class = OpClass.FOLLOW if result.ok else OpClass.FP32
        return PolicyClass(op_class, Category.POLICY, f"{op_name}: {rule.reason}")
    if rule.op_class is OpClass.FP32:
        if result.ok:
            return PolicyClass(OpClass.FOLLOW, Category.CONDITION, f"{op_name}: {result.evidence}")
        return PolicyClass(OpClass.FP32, Category.POLICY, f"{op_name}: {rule.reason}")
    return PolicyClass(OpClass.FOLLOW, Category.CONDITION, f"{op_name}: {result.evidence}", held=result.ok)


def read_inputs(node: ir.Node, facts: NodeFacts, context: PlanContext, evidence: Callable[[ir.Value], str]) -> Inputs:
    """What the node's inputs hold: which must not be narrowed (their type variables are pinned
    to FP32), which saturate, and which only flush to zero where the node adds them (within the
    rounding of the 16-bit sum) or moves them."""
    assert facts.rule is not None  # noqa: S101 (unknown_op decided nodes without one)
    considered = _considered(node, facts, context.fp32)
    value_state = context.value_state
    states = {v: value_state(v) for _, v, _ in considered}
    found = states.values()
    if State.WIDE not in found and State.TINY not in found and not facts.pinned_evidence:
        # Nothing to saturate, flush or pin: the facts are those given.
        return Inputs(facts, considered, states, (), {}, False, considered)
    fact = op_facts(node.domain, node.op_type)
    moves_tiny = (
        context.classify(node, facts).op_class is OpClass.FOLLOW and fact.value_preserving
        and _only_flexible_tiny([v for _, v, _ in considered], states, context)
    )
    rule = facts.rule
    reading = _Reading(
        node, context, evidence, moves_tiny, rule.saturate_inputs, rule.mask_inputs, fact.adds, states,
        set(facts.lowerable),
    )
    for index, value, var in considered:
        reading.read(index, value, var)
    if reading.pinned or facts.pinned_evidence:  # else the facts are those given (nothing was pinned)
        facts = replace(facts, lowerable=frozenset(reading.lowerable), pinned_evidence=tuple(reading.pinned))
    lowerable = tuple(item for item in considered if item[2] in facts.lowerable)
    return Inputs(
        facts, considered, states, tuple(reading.wide), reading.castable, moves_tiny, lowerable,
        tuple(reading.saturated),
    )


@dataclass
class _Reading:
    """The FP32 inputs of one node read one at a time (see :func:`read_inputs`): the states they
    end in, the type variables still lowerable, and what is pinned, castable and saturated."""

    node: ir.Node
    context: PlanContext
    evidence: Callable[[ir.Value], str]
    moves_tiny: bool
    saturate_inputs: frozenset[int]
    mask_inputs: frozenset[int]
    adds: Callable[[int], bool]
    states: dict[ir.Value, State]
    lowerable: set[str]
    pinned: list[str] = field(default_factory=list)
    wide: list[tuple[int, ir.Value, State]] = field(default_factory=list)
    castable: dict[ir.Value, str] = field(default_factory=dict)
    saturated: list[ir.Value] = field(default_factory=list)

    def read(self, index: int, value: ir.Value, var: str) -> None:
        """Read input `index` (bound to type variable `var`): a wide or tiny value saturates
        (a constant the rule saturates), flushes (where the node adds or moves it) or pins `var`
        to FP32."""
        state = self.states[value]
        if state not in (State.WIDE, State.TINY):
            return
        # A bound beyond the range saturates to the 16-bit maximum; one that flushes to zero
        # does so harmlessly unless it guards a divisor or logarithm (Clip(x, 1e-9) before Log).
        if index in self.saturate_inputs and is_constant(value) and (state is State.WIDE or not guards_zero(self.node)):
            self.saturated.append(value)
            self.states[value] = State.FLEX
            return
        if (
            index in self.mask_inputs and state is State.WIDE and is_constant(value)
            and overflows_only_below(value, self.context.target)
        ):  # a mask fill of float32's lowest: the 16-bit lowest gives masked scores the same weight 0
            self.saturated.append(value)
            self.states[value] = State.FLEX
            return
        if state is State.TINY and (self.moves_tiny or (self.adds(index) and not guards_zero(self.node))):
            self._flush(value)
            return
        self.lowerable.discard(var)
        self.wide.append((index, value, state))
        self.pinned.append(f"{value.name}: {self.evidence(value)}")

    def _flush(self, value: ir.Value) -> None:
        """A tiny value that may flush to zero: flexible where it can be, else held FP32 with a
        16-bit copy that is safe."""
        context = self.context
        if context.is_flexible(value):
            self.states[value] = State.FLEX
        else:
            self.states[value] = State.HIGH
            self.castable[value] = f"what flushes to zero is below the rounding of the {context.target.short_name} sum"


def _considered(node: ir.Node, facts: NodeFacts, fp32: Container[ir.Value]) -> tuple[tuple[int, ir.Value, str], ...]:
    """(index, value, type variable) of the FP32 inputs (of `fp32`, the model's FP32 tensor
    values) bound to lowerable type variables (flexible inputs are taken as they are)."""
    sig = facts.sig
    assert sig is not None  # noqa: S101 (unknown_op decided nodes without one)
    lowerable, flexible = facts.lowerable, facts.flexible
    found = []
    index = 0
    # A plain loop: this runs once per node. None (a missing input, an unbound variable) is in
    # neither `lowerable` (variable names) nor `fp32` (values).
    for value, var in zip(node.inputs, sig.input_vars):
        if var in lowerable and value in fp32 and index not in flexible:
            found.append((index, value, var))
        index += 1
    return tuple(found)


def _only_flexible_tiny(values: list[ir.Value], states: Mapping[ir.Value, State], context: PlanContext) -> bool:
    """Whether some values flush to zero and all are flexible (constants, data movement of them)."""
    return any(states[v] is State.TINY for v in values) and all(
        states[v] is State.FLEX or (states[v] is State.TINY and context.is_flexible(v)) for v in values
    )


def guards_zero(node: ir.Node, hops: int = 4) -> bool:
    """Whether the node's output reaches an input where zero is a singularity (a divisor, a
    logarithm, a negative power) through ops that keep zeros or move values: an epsilon added
    there guards against zero, and a flushed epsilon does not (``x / (norm + 1e-12)``)."""
    frontier = [v for v in node.outputs if v is not None]
    seen: set[ir.Node] = set()
    for _ in range(hops):
        reached = []
        for value in frontier:
            for use in value.uses():
                if reads_singularly(use.node, use.idx):
                    return True
                fact = op_facts(use.node.domain, use.node.op_type)
                if (fact.value_preserving or fact.keeps_zero) and use.node not in seen:
                    seen.add(use.node)
                    reached.extend(out for out in use.node.outputs if out is not None)
        frontier = reached
    return False


def weight_heavy(node: ir.Node, facts: NodeFacts) -> bool:
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
