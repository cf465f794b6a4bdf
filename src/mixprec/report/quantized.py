"""What a report says of a quantized (QDQ) model: the Q/DQ nodes, the ops they wrap, and how
much of the float compute outside them runs in 16 bits."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import onnx_ir as ir

from mixprec.analysis.qdq import folded_from, has_qdq, on_integers, role
from mixprec.plan.model import Category, Precision, PrecisionPlan

__all__ = ["QuantizedSummary", "quantized_summary"]


@dataclass
class QuantizedSummary:
    """What a converted QDQ model holds (report field ``quantization``).

    Attributes:
        qdq_nodes: QuantizeLinear / DequantizeLinear nodes by op type.
        quantized_ops: Ops between a DequantizeLinear and a QuantizeLinear (runtimes run them
            as integer kernels), by op type.
        quantized_low: How many of those compute their float side in 16 bits.
        float_low: Float ops outside quantized groups in 16 bits.
        float_fp32: Float ops outside quantized groups kept FP32.
        fp32_ops: The FP32 ones among those, by op type.
        float_low_share: float_low / (float_low + float_fp32); None without such ops.
        folded: The constant DequantizeLinear nodes folded into float constants (the runtime
            dequantizes them in float), by name.
        on_integers: The data-movement ops whose quantized group was written on integers
            (:mod:`mixprec.passes.integer_groups`), by name, with the Q/DQ nodes that left the
            model with it.
    """

    qdq_nodes: dict[str, int] = field(default_factory=dict)
    quantized_ops: dict[str, int] = field(default_factory=dict)
    quantized_low: int = 0
    float_low: int = 0
    float_fp32: int = 0
    fp32_ops: dict[str, int] = field(default_factory=dict)
    float_low_share: float | None = None
    folded: list[str] = field(default_factory=list)
    on_integers: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def format_line(self, target: str) -> str:
        """One line for the terminal report."""
        qdq = ", ".join(f"{n} {op}" for op, n in self.qdq_nodes.items())
        wrapped = ", ".join(f"{op} {n}" for op, n in self.quantized_ops.items()) or "none"
        total = self.float_low + self.float_fp32
        outside = (
            f"{self.float_low} of {total} in {target} ({self.float_low_share:.1%})"
            if self.float_low_share is not None else "none"
        )
        folded = f"; {len(self.folded)} constant DequantizeLinear folded into float constants" if self.folded else ""
        moved = f"; {len(self.on_integers)} data-movement group(s) written on integers" if self.on_integers else ""
        return (
            f"  quantized: {qdq}; ops between them: {wrapped} ({self.quantized_low} with a "
            f"{target} float side); float ops outside them: {outside}{folded}{moved}"
        )


def _quantized(node: ir.Node) -> bool:
    """Whether the node reads a dequantized value and every float output goes to quantizers."""
    reads = any(
        value is not None and (p := value.producer()) is not None and role(p) == "dequantize"
        for value in node.inputs
    )
    if not reads:
        return False
    outputs = [out for out in node.outputs if out.dtype is not None and out.dtype.is_floating_point()]
    return bool(outputs) and all(
        out.uses() and all(role(use.node) == "quantize" for use in out.uses()) for out in outputs
    )


def quantized_summary(plan: PrecisionPlan) -> QuantizedSummary | None:
    """Counts for the report; None for a model without QuantizeLinear/DequantizeLinear."""
    folded = [name for graph in plan.graphs for value in graph.initializers.values() if (name := folded_from(value))]
    if not has_qdq(plan.order) and not folded:
        return None
    summary = QuantizedSummary(folded=folded)
    qdq: Counter[str] = Counter()
    wrapped: Counter[str] = Counter()
    fp32: Counter[str] = Counter()
    for node in plan.order:
        decision = plan.decisions[node]
        if (replaced := on_integers(node)) is not None:
            summary.on_integers[node.name or node.op_type] = replaced
        if role(node) is not None:
            qdq[node.op_type] += 1
        elif _quantized(node):
            wrapped[node.op_type] += 1
            summary.quantized_low += decision.precision is Precision.LOW
        elif decision.precision is Precision.LOW:
            summary.float_low += 1
        elif (
            decision.precision is Precision.FP32 and node.inputs and decision.category is not Category.INTEGER_KERNEL
            and node not in plan.folded_nodes
        ):
            # Constant nodes compute nothing; integer kernels (QLinearConv, ...) compute on
            # integers; what the runtime folds when it loads the model runs once
            summary.float_fp32 += 1
            fp32[node.op_type] += 1
    summary.qdq_nodes = dict(sorted(qdq.items()))
    summary.quantized_ops = dict(wrapped.most_common())
    summary.fp32_ops = dict(fp32.most_common())
    total = summary.float_low + summary.float_fp32
    summary.float_low_share = summary.float_low / total if total else None
    return summary
