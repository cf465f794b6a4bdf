"""What the rules after the policy read of a node, once per node: its policy class (a
conditional op's condition evaluated) and what its FP32 inputs hold (which must not be narrowed,
which saturate, which only flush to zero where the node adds or moves them); and whether a
data-movement node reads a large constant (the backward pass and the cast placement keep it
16-bit)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import onnx_ir as ir

from mixprec.analysis.constants import is_constant, small_constant_array
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


@dataclass(frozen=True)
class Inputs:
    """What a node's FP32 inputs hold, read once per node by the rules after the policy class.

    Attributes:
        facts: The node's facts with the type variables of pinned inputs no longer lowerable.
        considered: (index, value, type variable) of the FP32 inputs bound to lowerable type
            variables (flexible inputs aside), before pinning.
        states: Input value -> state, after saturation and the flush rule.
        wide: (index, value, state) of the inputs that must not be narrowed.
        castable: Inputs held FP32 whose 16-bit copy is safe -> why (what flushes is additive).
        moves_tiny: Data movement of constants that flush to zero (its readers decide).
        saturated: Constants whose out-of-range values saturate to the 16-bit maximum.
    """

    facts: NodeFacts
    considered: tuple[tuple[int, ir.Value, str], ...]
    states: Mapping[ir.Value, State]
    wide: tuple[tuple[int, ir.Value, State], ...]
    castable: Mapping[ir.Value, str]
    moves_tiny: bool
    saturated: tuple[ir.Value, ...] = field(default=())

    @property
    def lowerable(self) -> tuple[tuple[int, ir.Value, str], ...]:
        """The considered inputs whose type variable the node still lowers."""
        return tuple(item for item in self.considered if item[2] in self.facts.lowerable)


def classify(node: ir.Node, facts: NodeFacts) -> PolicyClass:
    """The node's op class from the policy; a conditional op's condition decides FOLLOW or FP32."""
    rule = facts.rule
    assert rule is not None  # noqa: S101 (unknown_op decided nodes without one)
    op_name = format_op_name(node.domain, node.op_type)
    if rule.op_class is not OpClass.CONDITIONAL:
        return PolicyClass(rule.op_class, Category.POLICY, f"{op_name}: {rule.reason}")
    result = CONDITIONS[rule.condition or ""](node, small_constant_array, rule.params)
    return PolicyClass(OpClass.FOLLOW, Category.CONDITION, f"{op_name}: {result.evidence}", held=result.ok)


def read_inputs(node: ir.Node, facts: NodeFacts, context: PlanContext, evidence: Callable[[ir.Value], str]) -> Inputs:
    """What the node's inputs hold: which must not be narrowed (their type variables are pinned
    to FP32), which saturate, and which only flush to zero where the node adds them (within the
    rounding of the 16-bit sum) or moves them."""
    assert facts.rule is not None  # noqa: S101 (unknown_op decided nodes without one)
    considered = _considered(node, facts)
    states = {v: context.value_state(v) for _, v, _ in considered}
    fact = op_facts(node.domain, node.op_type)
    moves_tiny = (
        context.classify(node, facts).op_class is OpClass.FOLLOW and fact.value_preserving
        and _only_flexible_tiny([v for _, v, _ in considered], states, context)
    )
    lowerable = set(facts.lowerable)
    pinned: list[str] = []
    wide: list[tuple[int, ir.Value, State]] = []
    castable: dict[ir.Value, str] = {}
    saturated: list[ir.Value] = []
    for index, value, var in considered:
        state = states[value]
        if state not in (State.WIDE, State.TINY):
            continue
        if index in facts.rule.saturate_inputs and is_constant(value):
            saturated.append(value)
            states[value] = State.FLEX
            continue
        if state is State.TINY and (moves_tiny or (fact.adds(index) and not guards_zero(node))):
            if context.is_flexible(value):
                states[value] = State.FLEX
            else:
                states[value] = State.HIGH
                castable[value] = f"what flushes to zero is below the rounding of the {context.target.short_name} sum"
            continue
        lowerable.discard(var)
        wide.append((index, value, state))
        pinned.append(f"{value.name}: {evidence(value)}")
    if pinned or facts.pinned_evidence:  # else the facts are those given (nothing was pinned)
        facts = replace(facts, lowerable=frozenset(lowerable), pinned_evidence=tuple(pinned))
    return Inputs(facts, considered, states, tuple(wide), castable, moves_tiny, tuple(saturated))


def _considered(node: ir.Node, facts: NodeFacts) -> tuple[tuple[int, ir.Value, str], ...]:
    """(index, value, type variable) of the FP32 inputs bound to lowerable type variables
    (flexible inputs are taken as they are)."""
    sig = facts.sig
    assert sig is not None  # noqa: S101 (unknown_op decided nodes without one)
    return tuple(
        (index, value, var)
        for index, (value, var) in enumerate(zip(node.inputs, sig.input_vars))
        if value is not None and var is not None and var in facts.lowerable
        and index not in facts.flexible and is_fp32_tensor(value)
    )


def _only_flexible_tiny(values: list[ir.Value], states: Mapping[ir.Value, State], context: PlanContext) -> bool:
    """Whether some values flush to zero and all are flexible (constants, data movement of them)."""
    return any(states[v] is State.TINY for v in values) and all(
        states[v] is State.FLEX or (states[v] is State.TINY and context.is_flexible(v)) for v in values
    )


def guards_zero(node: ir.Node, hops: int = 4) -> bool:
    """Whether the node's output reaches an input where zero is a singularity (a divisor, a
    logarithm) through ops that keep zeros or move values: an epsilon added there guards against
    zero, and a flushed epsilon does not (``x / (norm + 1e-12)``)."""
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
