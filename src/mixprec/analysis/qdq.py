"""Quantized (QDQ) models: keep every DequantizeLinear -> op -> QuantizeLinear chain cast-free.

Runtimes fuse a DequantizeLinear, the op it feeds and the QuantizeLinear after it into one
integer kernel (ONNX Runtime's QDQ transformers, TensorRT's explicit quantization), and only
when nothing stands between them. The planner converts a DequantizeLinear (with its scale) when
its consumers compute in 16 bits and a QuantizeLinear when its producer does; this module adds
the rule that binds the two sides: where one side of such an edge is 16-bit and the other FP32
(the schema or the runtime has no 16-bit DequantizeLinear, the op is kept FP32, a scale is too
small for the 16-bit type), the 16-bit side is kept FP32 too, and the plan is made again, until
no edge would need a Cast. Zero points and integer tensors are never touched; constant
dequantizations the runtime computes in float arrive here already folded into float constants
(:mod:`mixprec.passes.fold_dequantize`), and the decisions of the ops reading them say so.

It also counts what a report says of a quantized model: the Q/DQ nodes, the ops they wrap, and
how much of the float compute outside them runs in 16 bits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import is_constant
from mixprec.plan.model import Category, Decision, Precision, PrecisionPlan
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.policy.opfacts import op_facts
from mixprec.policy.quantized_groups import quantized_groups

__all__ = [
    "FOLDED", "QuantizedSummary", "broken_pairs", "fp32_readers", "keep_pairs", "quantized_summary",
    "quantizes_float_chain", "small_scales",
]

Forced = dict[ir.Node, tuple[Category, str]]
# Value meta key of a constant folded from a DequantizeLinear: that node's name.
FOLDED = "mixprec.folded_dequantize"


def role(node: ir.Node) -> str | None:
    """``"dequantize"``, ``"quantize"`` or None (the op's `quantization` fact)."""
    return op_facts(node.domain, node.op_type).quantization


def has_qdq(nodes: list[ir.Node]) -> bool:
    """Whether any node quantizes or dequantizes."""
    return any(role(node) is not None for node in nodes)


def quantizes_float_chain(node: ir.Node, runtime: str | None = None, target: LowPrecision | None = None) -> bool:
    """Whether the node quantizes a value computed by ops that may run in `target`: a chain
    after the DequantizeLinear(s), or a single-op group (DequantizeLinear -> MaxPool / Relu ->
    QuantizeLinear) where `runtime` runs such a group in `target` (`group_scales`, `fp32_groups`
    in `policy/tables/quantized_groups.toml`). ONNX Runtime's CPU provider fuses a single-op group
    into an integer kernel that takes FP32 scales only (QLinearConcat); graph inputs stay as
    they are."""
    if role(node) != "quantize" or not node.inputs:
        return False
    x = node.inputs[0]
    producer = x.producer() if x is not None else None
    if producer is None:
        return False
    floats = [v for v in producer.inputs if v is not None and is_fp32_tensor(v) and not is_constant(v)]
    chain = not floats or not all((p := v.producer()) is not None and role(p) == "dequantize" for v in floats)
    return chain or (
        target is not None and quantized_groups(runtime).runs_group_in(target, producer.domain, producer.op_type)
    )


def _pair_edges(plan: PrecisionPlan) -> Iterator[tuple[ir.Node, int, ir.Node, int]]:
    """(producer, output index, consumer, input index) of every float edge that leaves a
    DequantizeLinear or enters a QuantizeLinear."""
    for node in plan.order:
        kind = role(node)
        if kind == "dequantize":
            out = node.outputs[0]
            if not is_fp32_tensor(out):
                continue
            for use in out.uses():
                if use.node in plan.decisions:
                    yield node, 0, use.node, use.idx
        elif kind == "quantize":
            x = node.inputs[0] if node.inputs else None
            producer = x.producer() if x is not None else None
            if x is not None and producer is not None and producer in plan.decisions and is_fp32_tensor(x):
                yield producer, producer.outputs.index(x), node, 0


def broken_pairs(plan: PrecisionPlan) -> Forced:
    """Nodes to keep FP32 so that no QDQ edge needs a Cast: for each edge whose two ends differ
    in type, the 16-bit end, with a reason naming the FP32 end."""
    found: Forced = {}
    for producer, out_index, consumer, in_index in _pair_edges(plan):
        facts = plan.facts.get(consumer)
        if facts is not None and in_index in facts.flexible:
            continue  # read as it is (Shape, CastLike's input): no Cast either way
        low_out = plan.output_is_lowered(producer, out_index)
        low_in = plan.input_is_lowered(consumer, in_index)
        if low_out == low_in:
            continue
        low, high = (producer, consumer) if low_out else (consumer, producer)
        if low in found:
            continue
        decision = plan.decisions[high]
        name = plan.keys.get(high) or high.name or high.op_type
        found[low] = (
            Category.QDQ,
            f"stays FP32 with {high.op_type} {name!r} (no Cast may separate them): {decision.reason}",
        )
    return found


def small_scales(nodes: list[ir.Node], target: LowPrecision) -> Forced:
    """Q/DQ nodes (and weight-only quantized ops) whose constant scale has nonzero values below
    the target's smallest normal number: a 16-bit scale would lose most of its digits there,
    and every value it scales with them."""
    if target.limits.tiny <= np.finfo(np.float32).tiny:
        return {}  # bfloat16: the FP32 exponent range
    found: Forced = {}
    for node in nodes:
        index = op_facts(node.domain, node.op_type).scale_input
        if index is None or index >= len(node.inputs):
            continue
        scale = node.inputs[index]
        tensor = scale.const_value if scale is not None else None
        if tensor is None or not is_fp32_tensor(scale):
            continue
        values = np.abs(tensor.numpy().astype(np.float32, copy=False))
        small = values[(values > 0) & (values < target.limits.tiny)]
        if small.size:
            found[node] = (
                Category.CONSTANT_RANGE,
                f"scale {scale.name!r} holds {float(small.min()):.3g}, below the smallest normal "
                f"{target.short_name} ({target.limits.tiny:.3g}): it stays FP32",
            )
    return found


def fp32_readers(nodes: list[ir.Node], runtime: str | None) -> Forced:
    """DequantizeLinear nodes read by an op that `runtime` runs only with an FP32 dequantized
    input (`fp32_readers` in `policy/tables/quantized_groups.toml`)."""
    facts = quantized_groups(runtime)
    found: Forced = {}
    for node in nodes:
        if role(node) != "dequantize" or not node.outputs:
            continue
        reader = next(
            (u.node for u in node.outputs[0].uses() if facts.reads_dequantized_in_fp32(u.node.domain, u.node.op_type)),
            None,
        )
        if reader is not None:
            found[node] = (
                Category.RUNTIME,
                f"{runtime} runs {reader.op_type} {reader.name or ''!r} only with an FP32 DequantizeLinear input",
            )
    return found


def keep_pairs(
    plan: Callable[[Mapping[ir.Node, tuple[Category, str]]], PrecisionPlan],
    nodes: list[ir.Node],
    target: LowPrecision,
    forced: Mapping[ir.Node, tuple[Category, str]] | None = None,
    runtime: str | None = None,
) -> PrecisionPlan:
    """Plan with `plan(forced)`, keeping more nodes FP32 until no QDQ edge needs a Cast.

    Each round keeps at least one more node FP32, so the rounds end; a model without
    quantization is planned once.
    """
    extra: Forced = dict(forced or {})
    if not has_qdq(nodes):
        return plan(extra)
    for node, finding in (*small_scales(nodes, target).items(), *fp32_readers(nodes, runtime).items()):
        extra.setdefault(node, finding)
    while True:
        result = plan(extra)
        broken = {node: finding for node, finding in broken_pairs(result).items() if node not in extra}
        if not broken:
            _explain_folds(result)
            return result
        extra.update(broken)


def _explain_folds(plan: PrecisionPlan) -> None:
    """Add to the decision of each op that reads a folded dequantization where it came from."""
    for node in plan.order:
        folded = [v for v in node.inputs if v is not None and FOLDED in v.meta]
        if not folded:
            continue
        d = plan.decisions[node]
        inputs = ", ".join(f"{v.name!r} (DequantizeLinear {v.meta[FOLDED]!r})" for v in folded)
        plan.decisions[node] = Decision(
            d.precision, d.category,
            f"{d.reason}; constant input(s) {inputs} folded: the runtime dequantizes them in float, "
            "so they were computed once in FP32",
        )


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
    """

    qdq_nodes: dict[str, int] = field(default_factory=dict)
    quantized_ops: dict[str, int] = field(default_factory=dict)
    quantized_low: int = 0
    float_low: int = 0
    float_fp32: int = 0
    fp32_ops: dict[str, int] = field(default_factory=dict)
    float_low_share: float | None = None
    folded: list[str] = field(default_factory=list)

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
        return (
            f"  quantized: {qdq}; ops between them: {wrapped} ({self.quantized_low} with a "
            f"{target} float side); float ops outside them: {outside}{folded}"
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
    folded = [value.meta[FOLDED] for graph in plan.graphs for value in graph.initializers.values() if FOLDED in value.meta]
    if not has_qdq(plan.order) and not folded:
        return None
    summary = QuantizedSummary(folded=folded)
    qdq: Counter[str] = Counter()
    wrapped: Counter[str] = Counter()
    fp32: Counter[str] = Counter()
    for node in plan.order:
        decision = plan.decisions[node]
        if role(node) is not None:
            qdq[node.op_type] += 1
        elif _quantized(node):
            wrapped[node.op_type] += 1
            summary.quantized_low += decision.precision is Precision.LOW
        elif decision.precision is Precision.LOW:
            summary.float_low += 1
        elif decision.precision is Precision.FP32 and node.inputs:  # Constant nodes compute nothing
            summary.float_fp32 += 1
            fp32[node.op_type] += 1
    summary.qdq_nodes = dict(sorted(qdq.items()))
    summary.quantized_ops = dict(wrapped.most_common())
    summary.fp32_ops = dict(fp32.most_common())
    total = summary.float_low + summary.float_fp32
    summary.float_low_share = summary.float_low / total if total else None
    return summary
