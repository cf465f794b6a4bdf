"""The cost model of a conversion: what its casts move and how much of its arithmetic is
16-bit, estimated from shapes (each named symbolic dimension, ``batch`` or ``seq``, taken as
`SYMBOLIC_DIM`, one consistent estimate; tensors with dimensions shape inference could not
name are left out). FLOPs come from a formula per op, named by the `flops` op fact; the
report and the accuracy search both use them."""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx_ir as ir

from mixprec.analysis.decisions import Category, Precision, PrecisionPlan
from mixprec.graphs import is_default_domain
from mixprec.policy.opfacts import op_facts

# A symbolic dimension (batch, sequence) counts as this many elements in estimates.
SYMBOLIC_DIM = 128
# Bytes per element: a Cast reads one type and writes the other (FP32 + 16-bit); an element a
# memory-bound op reads or writes in FP32 instead of 16 bits moves this many more. The report's
# cast bytes and the cast placement (mixprec.analysis.placement) price with them.
CAST_BYTES_PER_ELEMENT = 4 + 2
FP32_EXTRA_BYTES_PER_ELEMENT = 4 - 2
# Nodes that only own subgraphs or function bodies: they compute nothing themselves.
BOUNDARIES = frozenset({Category.CONTROL_FLOW, Category.FUNCTION})


def _size(dim: object, symbolic: int | None, unnamed: int | None = None) -> int | None:
    """A dimension's size: static, a named symbolic one (``seq``) as `symbolic`, an unnamed one
    (shape inference's ``unk__N``: nothing is known of it) as `unnamed` (None: unknown)."""
    if isinstance(dim, int):
        return int(dim)
    name = getattr(dim, "value", None)
    if symbolic is None:
        return None
    if not name or str(name).startswith("unk__"):
        return unnamed
    return symbolic


def tensor_elements(
    shape: ir.Shape | None, symbolic: int | None = None, unnamed: int | None = None
) -> int | None:
    """Elements of a tensor of `shape`, named symbolic dimensions as `symbolic` (None: a shape
    with symbolic dimensions is unknown) and unnamed ones as `unnamed` (None: unknown); None
    when the shape or a dimension is unknown."""
    if shape is None:
        return None
    sizes = [_size(d, symbolic, unnamed) for d in shape.dims]
    return None if any(s is None for s in sizes) else math.prod(sizes)  # type: ignore[arg-type]


def estimated_elements(shape: ir.Shape | None) -> int | None:
    """Elements of a tensor of `shape` with named symbolic dimensions as `SYMBOLIC_DIM`."""
    return tensor_elements(shape, SYMBOLIC_DIM)


def low_compute_share(plan: PrecisionPlan) -> float | None:
    """The estimated share of the float arithmetic that runs in 16 bits: FLOPs of the ops with
    a formula and known shapes; None when there is none."""
    low = total = 0.0
    for node in plan.order:
        decision = plan.decisions[node]
        if decision.precision is Precision.NONE or decision.category in BOUNDARIES:
            continue
        cost = flops_of(node, SYMBOLIC_DIM)
        if cost is None:
            continue
        total += cost
        if decision.precision is Precision.LOW:
            low += cost
    return low / total if total > 0 else None


def _dims(value: ir.Value | None, symbolic: int | None = None) -> list[int] | None:
    """Static dims of a value; symbolic ones as `symbolic` (None: the dims are unknown then)."""
    if value is None or value.shape is None:
        return None
    dims = [_size(d, symbolic) for d in value.shape.dims]
    return None if any(d is None for d in dims) else dims  # type: ignore[return-value]


def _matmul(node: ir.Node, out: list[int] | None, symbolic: int | None) -> float | None:
    a = _dims(node.inputs[0], symbolic)
    if a is None or out is None or not a:
        return None
    return 2.0 * math.prod(out) * a[-1]


def _gemm(node: ir.Node, out: list[int] | None, symbolic: int | None) -> float | None:
    a = _dims(node.inputs[0], symbolic)
    if a is None or out is None or len(a) != 2:
        return None
    trans_a = node.attributes.get_int("transA", 0)
    k = a[0] if trans_a else a[1]
    return 2.0 * math.prod(out) * k


def _conv(node: ir.Node, out: list[int] | None, symbolic: int | None) -> float | None:
    w = _dims(node.inputs[1], symbolic)
    if w is None or out is None:
        return None
    return 2.0 * math.prod(out) * math.prod(w[1:])


def _conv_transpose(node: ir.Node, out: list[int] | None, symbolic: int | None) -> float | None:
    x, w = _dims(node.inputs[0], symbolic), _dims(node.inputs[1], symbolic)
    if x is None or w is None:
        return None
    return 2.0 * math.prod(x) * math.prod(w[1:])


# The `flops` formulas of the op facts: (node, static output dims or None) -> FLOPs or None.
_FORMULAS: dict[str, Callable[[ir.Node, list[int] | None, int | None], float | None]] = {
    "matmul": _matmul,
    "gemm": _gemm,
    "conv": _conv,
    "conv_transpose": _conv_transpose,
}


def flops_of(node: ir.Node, symbolic: int | None = None) -> float | None:
    """FLOPs of a node by its op's formula (`flops` in the op facts); None where unknown.
    `symbolic`: the size taken for symbolic dimensions (None: such nodes are unknown)."""
    formula = op_facts(node.domain, node.op_type).flops if is_default_domain(node.domain) else None
    if formula is None or not node.outputs or len(node.inputs) < 2:
        return None
    return _FORMULAS[formula](node, _dims(node.outputs[0], symbolic), symbolic)
