"""FLOPs of the nodes (a formula per op, named in the op facts) and the FP32 share of a plan."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnx.shape_inference
import onnx_ir as ir

from mixprec.analysis.plan import Category, Precision, PrecisionPlan
from mixprec.graphs import is_default_domain, node_keys
from mixprec.policy.opfacts import op_facts

logger = logging.getLogger(__name__)

# Nodes that only own subgraphs or function bodies: they compute nothing themselves.
_BOUNDARIES = frozenset({Category.CONTROL_FLOW, Category.FUNCTION})


def node_flops(proto: onnx.ModelProto, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
    """FLOPs of the nodes with a FLOPs formula whose shapes are known for this batch."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    for value in model.graph.input:
        array = batch.get(value.name)
        if array is None or not value.type.HasField("tensor_type"):
            continue
        shape = value.type.tensor_type.shape
        shape.ClearField("dim")
        for size in np.shape(array):
            shape.dim.add().dim_value = int(size)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
        ir_model = ir.from_proto(inferred)
    except Exception as e:  # noqa: BLE001 - shape inference raises assorted types
        logger.debug("shape inference for FLOPs failed: %s", e)
        return {}
    names = node_keys(ir_model)
    nodes = list(names)
    flops: dict[str, float] = {}
    for node in nodes:
        cost = flops_of(node)
        if cost is not None:
            flops[names[node]] = cost
    return flops


def _dims(value: ir.Value | None) -> list[int] | None:
    if value is None or value.shape is None:
        return None
    dims = list(value.shape.dims)
    if not all(isinstance(d, int) for d in dims):
        return None
    return [int(d) for d in dims]


def _matmul(node: ir.Node, out: list[int] | None) -> float | None:
    a = _dims(node.inputs[0])
    if a is None or out is None or not a:
        return None
    return 2.0 * math.prod(out) * a[-1]


def _gemm(node: ir.Node, out: list[int] | None) -> float | None:
    a = _dims(node.inputs[0])
    if a is None or out is None or len(a) != 2:
        return None
    trans_a = node.attributes.get_int("transA", 0)
    k = a[0] if trans_a else a[1]
    return 2.0 * math.prod(out) * k


def _conv(node: ir.Node, out: list[int] | None) -> float | None:
    w = _dims(node.inputs[1])
    if w is None or out is None:
        return None
    return 2.0 * math.prod(out) * math.prod(w[1:])


def _conv_transpose(node: ir.Node, out: list[int] | None) -> float | None:
    x, w = _dims(node.inputs[0]), _dims(node.inputs[1])
    if x is None or w is None:
        return None
    return 2.0 * math.prod(x) * math.prod(w[1:])


# The `flops` formulas of the op facts: (node, static output dims or None) -> FLOPs or None.
_FORMULAS: dict[str, Callable[[ir.Node, list[int] | None], float | None]] = {
    "matmul": _matmul,
    "gemm": _gemm,
    "conv": _conv,
    "conv_transpose": _conv_transpose,
}


def flops_of(node: ir.Node) -> float | None:
    """FLOPs of a node by its op's formula (`flops` in the op facts); None where unknown."""
    formula = op_facts(node.domain, node.op_type).flops if is_default_domain(node.domain) else None
    if formula is None or not node.outputs or len(node.inputs) < 2:
        return None
    return _FORMULAS[formula](node, _dims(node.outputs[0]))


def fp32_share(plan: PrecisionPlan, flops: Mapping[str, float]) -> tuple[float, float | None]:
    """FP32 share of the nodes that compute floats (control-flow and function-call nodes aside)."""
    names = plan.keys
    low = fp32 = 0
    low_flops = fp32_flops = 0.0
    known = False
    for node in plan.order:
        decision = plan.decisions[node]
        if decision.precision is Precision.NONE or decision.category in _BOUNDARIES:
            continue
        cost = flops.get(names[node])
        if decision.precision is Precision.FP32:
            fp32 += 1
            fp32_flops += cost or 0.0
        else:
            low += 1
            low_flops += cost or 0.0
        known = known or cost is not None
    share = fp32 / (low + fp32) if low + fp32 else 0.0
    total = low_flops + fp32_flops
    return share, (fp32_flops / total if known and total > 0 else None)
