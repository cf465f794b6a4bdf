"""Normalization scales folded into the weights of the matrix products that read them.

A normalization stored in 16 bits multiplies by a 16-bit copy of its scale (gamma): on top of the
rounding of its output, every feature of every token then carries the rounding of its scale, a
systematic error the size of the type's epsilon that no later op averages out (on a LLaMA-style
decoder it is most of the error that computing the normalization in 16 bits adds). When every
reader of the normalization's output is a matrix product with a constant weight of its own,
`(n * g) @ W == n @ (g[:, None] * W)`: the scale moves into the weights, multiplied in FP32 and
rounded once to 16 bits as those weights are anyway, and the normalization's scale becomes ones,
exact in every type.

A normalization folds when its scale is a constant that is stored in 16 bits, used by it alone,
and broadcast along the last axis only; it has no bias; its output is no graph output and is read
only as input A of MatMul / Gemm (transA = 0) nodes whose weight (input B) is an FP32 constant
used by that node alone; and the folded weights neither come near the edge of the 16-bit range
nor shrink below its normal numbers as a whole. The folded weights are computed when first
read, in chunks (`ScaledTensor`), so a large weight is never held twice. Which ops are normalizations (and where their scale and bias are) and which are
matrix products are op facts (`norm_scale`, `norm_bias`, `flops` in `policy/tables/opfacts.toml`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import ScaledTensor, constant_range, replace_constant, small_constant_array
from mixprec.plan.model import PrecisionPlan, Storage
from mixprec.dtypes import is_fp32_tensor
from mixprec.graphs import is_default_domain
from mixprec.policy.opfacts import op_facts

__all__ = ["FoldedScales", "fold_norm_scales"]

# Matrix products by their FLOPs formula: the attribute that transposes input A (must be 0),
# and the attribute that transposes the weight (None: the weight is never transposed).
_PRODUCTS = {"matmul": (None, None), "gemm": ("transA", "transB")}
_SCALE_BYTES = 1 << 20


@dataclass
class FoldedScales:
    """What :func:`fold_norm_scales` did: the normalizations whose scale became ones, and the
    weights that took it."""

    norms: list[str] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)


def fold_norm_scales(model: ir.Model, plan: PrecisionPlan) -> FoldedScales:
    """Fold the 16-bit-stored scales of `plan`'s normalizations into the weights of the matrix
    products that read them, in place in `model` (the model `plan` was made for)."""
    if plan.graphs and plan.graphs[0] is not model.graph:
        raise ValueError("fold_norm_scales: the plan was made for another model")
    folded = FoldedScales()
    for node in plan.order:
        facts = op_facts(node.domain, node.op_type)
        if facts.norm_scale is None:
            continue
        fold = _fold_of(node, facts.norm_scale, facts.norm_bias, plan)
        if fold is None:
            continue
        scale, gamma, weights = fold
        for weight, axis in weights:
            replace_constant(weight, ScaledTensor(weight.const_value, gamma, axis))  # type: ignore[arg-type]
            folded.weights.append(weight.name or "")
        ones = ir.Tensor(np.ones(scale.const_value.shape.numpy(), dtype=np.float32), name=scale.const_value.name)  # type: ignore[union-attr]
        replace_constant(scale, ones)
        folded.norms.append(node.name or node.op_type)
    return folded


def _fold_of(
    node: ir.Node, scale_index: int, bias_index: int | None, plan: PrecisionPlan
) -> tuple[ir.Value, np.ndarray, list[tuple[ir.Value, int]]] | None:
    """(scale, its values as a vector, [(weight, axis of the weight the scale multiplies)]), or
    None when the normalization does not fold."""
    found = _scale_of(node, scale_index, bias_index, plan)
    if found is None:
        return None
    scale, gamma = found
    out = node.outputs[0]
    if out.is_graph_output():
        return None
    weights = _weights_of(out, gamma, plan)
    if weights is None:
        return None
    return scale, gamma, weights


def _scale_of(
    node: ir.Node, scale_index: int, bias_index: int | None, plan: PrecisionPlan
) -> tuple[ir.Value, np.ndarray] | None:
    """(scale, its values as a vector) when the normalization has no bias and its scale is a
    16-bit-stored constant of its own, broadcast along the last axis, finite and not all zero."""
    if bias_index is not None and bias_index < len(node.inputs) and node.inputs[bias_index] is not None:
        return None
    scale = node.inputs[scale_index] if scale_index < len(node.inputs) else None
    if scale is None or plan.storage.get(scale) is not Storage.LOW or not _own_constant(scale):
        return None
    array = small_constant_array(scale, _SCALE_BYTES)
    if array is None or array.ndim == 0 or any(d != 1 for d in array.shape[:-1]):
        return None
    gamma = array.reshape(-1).astype(np.float32)
    if not np.all(np.isfinite(gamma)) or not np.any(gamma):
        return None
    return scale, gamma


def _weights_of(out: ir.Value, gamma: np.ndarray, plan: PrecisionPlan) -> list[tuple[ir.Value, int]] | None:
    """[(weight, axis the scale multiplies)] of the matrix products reading `out`, when every
    reader is one and every folded weight fits; None otherwise."""
    weights: list[tuple[ir.Value, int]] = []
    for use in out.uses():
        found = _weight_of(use.node, use.idx, gamma.size)
        if found is None:
            return None
        weights.append(found)
    if not weights or not all(_fits(weight, gamma, plan) for weight, _ in weights):
        return None
    return weights


def _weight_of(reader: ir.Node, index: int, size: int) -> tuple[ir.Value, int] | None:
    """(weight, axis the scale multiplies) when `reader` is a matrix product reading the
    normalization as input A and a foldable weight as input B."""
    kind = _PRODUCTS.get(op_facts(reader.domain, reader.op_type).flops or "")
    if kind is None or index != 0 or not is_default_domain(reader.domain) or len(reader.inputs) < 2:
        return None
    trans_a, trans_b = kind
    if trans_a is not None and reader.attributes.get_int(trans_a, 0):
        return None
    weight = reader.inputs[1]
    if weight is None or not _own_constant(weight) or not is_fp32_tensor(weight):
        return None
    shape = weight.const_value.shape  # type: ignore[union-attr]
    if len(shape) < 2:
        return None
    axis = len(shape) - 1 if trans_b is not None and reader.attributes.get_int(trans_b, 0) else len(shape) - 2
    return (weight, axis) if shape[axis] == size else None


def _own_constant(value: ir.Value) -> bool:
    """An initializer (not a graph input) read by exactly one node, and by no graph output."""
    return (
        value.const_value is not None
        and not value.is_graph_input()
        and not value.is_graph_output()
        and len(value.uses()) == 1
    )


def _fits(weight: ir.Value, gamma: np.ndarray, plan: PrecisionPlan) -> bool:
    """Whether the folded weight stays inside the 16-bit type's range with room to spare, and
    the magnitude of its rows inside the normal numbers: bounded from the weight's cached range
    (no second read of the weight), so single elements near zero may still become subnormal, as
    they may without the fold."""
    found = constant_range(weight, plan.target)
    if found is None or not found.representable:
        return False
    limits = plan.target.limits
    magnitude = np.abs(gamma)
    nonzero = magnitude[magnitude > 0]
    return (
        float(magnitude.max()) * found.absmax <= limits.max / 2
        and float(nonzero.min()) * found.absmax >= limits.tiny
    )
