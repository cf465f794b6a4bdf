"""Quantized (QDQ) models: keep every DequantizeLinear -> op -> QuantizeLinear chain cast-free.

The planner converts a DequantizeLinear (with its scale) when its consumers compute in 16 bits
and a QuantizeLinear when its producer does; this module adds the rule that binds the two sides:
where one side of such an edge is 16-bit and the other FP32 (the schema or the runtime has no
16-bit DequantizeLinear, the op is kept FP32, a scale is too small for the 16-bit type), the
16-bit side is kept FP32 too, and the plan is made again, until no edge would need a Cast. Zero
points and integer tensors are never touched; constant dequantizations the runtime computes in
float arrive here already folded into float constants (:mod:`mixprec.passes.fold_dequantize`),
and the decisions of the ops reading them say so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import is_constant, read_array
from mixprec.analysis.qdq import folded_from, has_qdq, requantizes, role
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.plan.model import Category, Decision, PrecisionPlan
from mixprec.policy.opfacts import op_facts
from mixprec.policy.quantized_groups import quantized_groups

__all__ = [
    "broken_pairs", "fine_integers", "fp32_quantizers", "fp32_readers", "fp32_requantizations", "keep_pairs",
    "small_scales",
]

Forced = dict[ir.Node, tuple[Category, str]]


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
        values = np.abs(read_array(tensor).astype(np.float32, copy=False))
        small = values[(values > 0) & (values < target.limits.tiny)]
        if small.size:
            found[node] = (
                Category.CONSTANT_RANGE,
                f"scale {scale.name!r} holds {float(small.min()):.3g}, below the smallest normal "
                f"{target.short_name} ({target.limits.tiny:.3g}): it stays FP32",
            )
    return found


def fine_integers(nodes: list[ir.Node], target: LowPrecision) -> Forced:
    """Q/DQ nodes whose integers have more steps than the target holds exactly (16-bit
    activations: 65,536 steps, where float16 holds every integer up to 2,048 and bfloat16 up
    to 256): in 16 bits the dequantized value, and the value a QuantizeLinear reads, would round
    away the steps those integers were chosen for. A constant's dequantization is a weight (an
    int32 bias, say): it rounds like any weight stored in 16 bits, and is judged by its scale."""
    exact = target.limits.exact_int_max
    found: Forced = {}
    for node in nodes:
        kind = role(node)
        if kind is None:
            continue
        values = node.inputs if kind == "dequantize" else node.outputs
        integer = values[0] if values else None
        if integer is None or (kind == "dequantize" and is_constant(integer)):
            continue
        dtype = integer.dtype
        if dtype is None or not dtype.is_integer() or 2**dtype.bitwidth - 1 <= exact:
            continue
        found[node] = (
            Category.QDQ,
            f"{dtype.name.lower()} quantization: {2**dtype.bitwidth:,} integer steps, more than "
            f"{target.short_name} holds exactly (every integer up to {exact:,}): it stays FP32",
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


def fp32_quantizers(nodes: list[ir.Node], runtime: str | None, target: LowPrecision) -> Forced:
    """Every Q/DQ node where the runtime compiles no `target` scales (`qdq_scales` in
    `policy/tables/quantized_groups.toml`)."""
    facts = quantized_groups(runtime)
    if facts.compiles_scales_in(target):
        return {}
    reason = (
        f"{runtime} compiles QuantizeLinear/DequantizeLinear with FP32 scales only "
        f"({facts.runtime} in quantized_groups.toml)"
    )
    return {node: (Category.RUNTIME, reason) for node in nodes if role(node) is not None}


def fp32_requantizations(nodes: list[ir.Node]) -> Forced:
    """The DequantizeLinear -> QuantizeLinear pairs that requantize an input of a group written
    on integers (:mod:`mixprec.passes.integer_groups`): in FP32 its integers stay those of the
    FP32 model."""
    return {
        node: (Category.QDQ, f"requantizes an input of {op!r} to its output's scale: in FP32 the integers stay exact")
        for node in nodes if (op := requantizes(node)) is not None
    }


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
    found = (*fp32_quantizers(nodes, runtime, target).items(), *fine_integers(nodes, target).items(),
             *small_scales(nodes, target).items(), *fp32_readers(nodes, runtime).items(),
             *fp32_requantizations(nodes).items())
    for node, finding in found:
        extra.setdefault(node, finding)
    while True:
        result = plan(extra)
        broken = {node: finding for node, finding in broken_pairs(result).items() if node not in extra}
        if not broken:
            return _explain_folds(result)
        extra.update(broken)


def _explain_folds(plan: PrecisionPlan) -> PrecisionPlan:
    """The plan with the decision of each op that reads a folded dequantization saying where
    that input came from."""
    explained: dict[ir.Node, Decision] = {}
    for node in plan.order:
        # Folded values are initializers: other values are not asked (asking creates their metadata).
        folded = [v for v in node.inputs if v is not None and v.const_value is not None and folded_from(v)]
        if not folded:
            continue
        d = plan.decisions[node]
        inputs = ", ".join(f"{v.name!r} (DequantizeLinear {folded_from(v)!r})" for v in folded)
        explained[node] = Decision(
            d.precision, d.category,
            f"{d.reason}; constant input(s) {inputs} folded: the runtime dequantizes them in float, "
            "so they were computed once in FP32",
        )
    if not explained:
        return plan
    return dataclasses.replace(plan, decisions={**plan.decisions, **explained})
