"""Comparisons that decide at thresholds on the model's own inputs.

A tree ensemble written as tensor ops (hummingbird's GEMM form) selects features with a product
by a 0/1 matrix and compares them with the trees' thresholds: `LessOrEqual(Gemm(selector, x),
thresholds)`. In 16 bits the selected features are rounded, and every one within half a step of
its threshold (thresholds lie midway between training values) may be decided the other way: a
forest of features near 1000 changed 2 of 200 labels in float16, a boosted regression 8% of its
range, while generated N(0, 1) inputs never reach the thresholds.

Where a comparison reads, on one side, a constant the 16-bit type cannot hold exactly and, on the
other, the values of an FP32 graph input moved or selected without arithmetic (ops that move
values, products by a constant 0/1 matrix that pick one element each), the comparison and the
selecting products stay FP32: a selection costs little, and every decision stays exact.
Thresholds the 16-bit type holds (0, 0.5, a mask's 1) and compared values computed by the model
are left to the other rules.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import constant_tensor
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.graphs import is_default_domain
from mixprec.policy.opfacts import op_facts

__all__ = ["threshold_decisions"]


def threshold_decisions(model: ir.Model, target: LowPrecision) -> dict[ir.Node, str]:
    """The main-graph nodes kept FP32 so that comparisons decide exactly where the 16-bit
    type would move their thresholds (see the module docstring), each with why."""
    inputs = {value for value in model.graph.inputs if is_fp32_tensor(value)}
    kept: dict[ir.Node, str] = {}
    for node in model.graph:
        if not is_default_domain(node.domain) or not op_facts(node.domain, node.op_type).comparison:
            continue
        if len(node.inputs) != 2 or any(value is None for value in node.inputs):
            continue
        for threshold, compared in ((node.inputs[1], node.inputs[0]), (node.inputs[0], node.inputs[1])):
            if not _rounded(threshold, target):
                continue
            selecting = _selection_of_inputs(compared, inputs)
            if selecting is None:
                continue
            moved = f"thresholds {threshold.name!r} that {target.value} would move: decisions near them would flip"
            kept[node] = f"{node.op_type} of {compared.name!r}, values of the model's inputs, with {moved}"
            for product in selecting:
                kept.setdefault(product, f"selects the input values {compared.name!r} that {node.op_type} compares with {moved}")
            break
    return kept


def _rounded(value: ir.Value, target: LowPrecision) -> bool:
    """Whether `value` is a float32 constant some of whose elements the target type rounds."""
    tensor = constant_tensor(value)
    if tensor is None or tensor.dtype != ir.DataType.FLOAT:
        return False
    array = np.asarray(tensor.numpy(), dtype=np.float32)
    with np.errstate(over="ignore"):
        return bool(np.any(array.astype(target.numpy_dtype).astype(np.float32) != array))


def _selection_of_inputs(value: ir.Value, inputs: set[ir.Value]) -> list[ir.Node] | None:
    """The selecting products between an FP32 graph input and `value`, where `value` holds
    values of the input moved or selected without arithmetic; else None."""
    products: list[ir.Node] = []
    while value not in inputs:
        node = value.producer()
        if node is None or not is_default_domain(node.domain) or not node.inputs or node.inputs[0] is None:
            return None
        fact = op_facts(node.domain, node.op_type)
        if fact.carrier == "movement" and fact.value_preserving:
            value = node.inputs[0]
            continue
        data = _selected_operand(node)
        if data is None:
            return None
        products.append(node)
        value = data
    return products


def _selected_operand(node: ir.Node) -> ir.Value | None:
    """The operand a MatMul or Gemm selects from (its other operand a constant 0/1 matrix with
    at most one 1 for each output element, and no bias that adds to it); else None."""
    if op_facts(node.domain, node.op_type).flops not in ("matmul", "gemm") or len(node.inputs) < 2:
        return None
    if node.op_type == "Gemm" and node.attributes.get_float("alpha", 1.0) != 1.0:
        return None  # a scaled selection rounds too
    if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
        bias = constant_tensor(node.inputs[2])
        if bias is None or np.any(np.asarray(bias.numpy())):
            return None
    transposed = (
        (node.attributes.get_int("transA", 0), node.attributes.get_int("transB", 0)) if node.op_type == "Gemm" else (0, 0)
    )
    for side in (0, 1):
        matrix = constant_tensor(node.inputs[side]) if node.inputs[side] is not None else None
        if matrix is None or len(matrix.shape) != 2:
            continue
        array = np.asarray(matrix.numpy())
        if transposed[side]:
            array = array.T
        contracted = 1 if side == 0 else 0  # A [M, K] contracts its columns, B [K, N] its rows
        if np.isin(array, (0, 1)).all() and (np.count_nonzero(array, axis=contracted) <= 1).all():
            return node.inputs[1 - side]
    return None
