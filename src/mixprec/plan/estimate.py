"""The estimated price of a plan on its runtime (the report's `speed:` line): every node in its
precision plus the runtime Casts, against the FP32 model, by the cost model
(:mod:`mixprec.analysis.cost_model`)."""

from __future__ import annotations

from dataclasses import dataclass

from mixprec.analysis.cost_model import SYMBOLIC_DIM, cast_time, computes_elementwise, float_elements, flops_of, node_time
from mixprec.graphs import is_default_domain
from mixprec.plan.model import Category, Precision, PrecisionPlan
from mixprec.policy.costs import RuntimeCost
from mixprec.policy.opfacts import op_facts

__all__ = ["BOUNDARIES", "PlanEstimate", "estimate_plan"]

# Nodes that only own subgraphs or function bodies: they compute nothing themselves.
BOUNDARIES = frozenset({Category.CONTROL_FLOW, Category.FUNCTION})


@dataclass(frozen=True)
class PlanEstimate:
    """The cost model's view of a converted model.

    Attributes:
        low_flops_share: Share of the matrix and convolution FLOPs (ops with a formula and
            shapes known up to named symbolic dimensions) computed in 16 bits; None when there
            are none.
        time: Estimated time on the runtime's device (byte-times), runtime Casts included,
            every dimension that is not static guessed as `SYMBOLIC_DIM`.
        fp32_time: The same for the FP32 model (every node FP32, no Casts).
    """

    low_flops_share: float | None
    time: float
    fp32_time: float

    @property
    def speedup(self) -> float | None:
        """FP32 time / converted time."""
        return self.fp32_time / self.time if self.time > 0 else None


def estimate_plan(plan: PrecisionPlan, cast_elements: list[int | None], cost: RuntimeCost) -> PlanEstimate:
    """Price `plan` on `cost`'s device in one pass: every node in its precision (nodes without
    float compute and control flow at one launch each in both models) plus the runtime Casts
    (`cast_elements`, guessed like the tensors; unknown sizes count their launch only), against
    the FP32 model."""
    converted = fp32 = low_flops = total_flops = 0.0
    known: dict[int, int] = {}  # id(shape) -> elements; the plan's values keep their shapes alive
    formulas: dict[tuple[str, str], bool] = {}
    movers: dict[tuple[str, str], bool] = {}  # op -> it computes element by element (see `node_time`)
    for node in plan.order:
        decision = plan.decisions[node]
        if node in plan.folded_nodes:
            continue  # computed once when the model loads, in both models
        if decision.precision is Precision.NONE or decision.category in BOUNDARIES:
            converted += cost.launch_bytes
            fp32 += cost.launch_bytes
            continue
        low = decision.precision is Precision.LOW
        kind = (node.domain, node.op_type)
        has_formula = formulas.get(kind)
        if has_formula is None:
            has_formula = formulas[kind] = is_default_domain(node.domain) and op_facts(node.domain, node.op_type).flops is not None
        flops = flops_of(node, SYMBOLIC_DIM) if has_formula else None
        if flops is not None:
            total_flops += flops
            low_flops += flops if low else 0.0
        elif has_formula:
            flops = flops_of(node, SYMBOLIC_DIM, SYMBOLIC_DIM)
        elements = float_elements(node, SYMBOLIC_DIM, known)
        elementwise = movers.get(kind)
        if elementwise is None:
            elementwise = movers[kind] = computes_elementwise(node.domain, node.op_type)
        converted += node_time(elements, flops, low, cost, elementwise=elementwise)
        fp32 += node_time(elements, flops, False, cost)
    converted += sum(cast_time(e or 0, cost) for e in cast_elements)
    return PlanEstimate(low_flops / total_flops if total_flops > 0 else None, converted, fp32)
