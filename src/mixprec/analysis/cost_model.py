"""The cost model of a conversion: what its casts move, how much of its arithmetic is 16-bit
and how long it should take on its runtime, estimated from shapes: each named symbolic
dimension (``batch``, ``seq``) taken as `SYMBOLIC_DIM`, one consistent estimate; dimensions
shape inference could not name make sizes and FLOPs unknown, except in the time estimate and
the cast placement, which guess them as `SYMBOLIC_DIM` too (they compare costs, and need one for
every tensor). FLOPs come from a formula per op,
named by the `flops` op fact. Time is a roofline per op on the runtime's figures
(`mixprec.policy.costs`): the larger of its float traffic and its matrix arithmetic, plus a
launch. The report, the accuracy search and the cast placement all use them; the price of a whole
plan is :func:`mixprec.plan.estimate.estimate_plan`."""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx_ir as ir

from mixprec.graphs import is_default_domain
from mixprec.policy.costs import RuntimeCost
from mixprec.policy.opfacts import op_facts

# A symbolic dimension (batch, sequence) counts as this many elements in estimates.
SYMBOLIC_DIM = 128
# Bytes per element: a Cast reads one type and writes the other (FP32 + 16-bit); an element a
# memory-bound op reads or writes in FP32 instead of 16 bits moves this many more. The report's
# cast bytes and the cast placement (mixprec.plan.placement) price with them.
CAST_BYTES_PER_ELEMENT = 4 + 2
FP32_EXTRA_BYTES_PER_ELEMENT = 4 - 2
LOW_BYTES_PER_ELEMENT, FP32_BYTES_PER_ELEMENT = 2, 4
_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def _size(dim: object, symbolic: int | None, unnamed: int | None) -> int | None:
    """A dimension's size: static, a named symbolic one (``seq``) as `symbolic`, an unnamed one
    (shape inference's ``unk__N``: nothing is known of it) as `unnamed` (None: unknown)."""
    if isinstance(dim, int):
        return dim
    if symbolic is None:
        return None
    name = getattr(dim, "value", None)
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
    total = 1
    if symbolic is not None and symbolic == unnamed:  # every dimension that is not static alike
        for dim in shape.dims:
            total *= dim if isinstance(dim, int) else symbolic
        return total
    for dim in shape.dims:
        size = dim if isinstance(dim, int) else _size(dim, symbolic, unnamed)
        if size is None:
            return None
        total *= size
    return total


def estimated_elements(shape: ir.Shape | None) -> int | None:
    """Elements of a tensor of `shape` with named symbolic dimensions as `SYMBOLIC_DIM`."""
    return tensor_elements(shape, SYMBOLIC_DIM)


def guessed_elements(shape: ir.Shape | None) -> int | None:
    """Elements of a tensor of `shape` with every dimension that is not static, named or not,
    as `SYMBOLIC_DIM` (None only for an unknown rank)."""
    return tensor_elements(shape, SYMBOLIC_DIM, SYMBOLIC_DIM)


def _dims(value: ir.Value | None, symbolic: int | None = None, unnamed: int | None = None) -> list[int] | None:
    """Static dims of a value; symbolic ones as `symbolic` and unnamed ones as `unnamed` (None:
    the dims are unknown then)."""
    if value is None or value.shape is None:
        return None
    dims = [_size(d, symbolic, unnamed) for d in value.shape.dims]
    return None if any(d is None for d in dims) else dims  # type: ignore[return-value]


def _matmul(node: ir.Node, out: list[int] | None, symbolic: int | None, unnamed: int | None) -> float | None:
    a = _dims(node.inputs[0], symbolic, unnamed)
    if a is None or out is None or not a:
        return None
    return 2.0 * math.prod(out) * a[-1]


def _gemm(node: ir.Node, out: list[int] | None, symbolic: int | None, unnamed: int | None) -> float | None:
    a = _dims(node.inputs[0], symbolic, unnamed)
    if a is None or out is None or len(a) != 2:
        return None
    trans_a = node.attributes.get_int("transA", 0)
    k = a[0] if trans_a else a[1]
    return 2.0 * math.prod(out) * k


def _conv(node: ir.Node, out: list[int] | None, symbolic: int | None, unnamed: int | None) -> float | None:
    w = _dims(node.inputs[1], symbolic, unnamed)
    if w is None or out is None:
        return None
    return 2.0 * math.prod(out) * math.prod(w[1:])


def _conv_transpose(node: ir.Node, out: list[int] | None, symbolic: int | None, unnamed: int | None) -> float | None:
    x, w = _dims(node.inputs[0], symbolic, unnamed), _dims(node.inputs[1], symbolic, unnamed)
    if x is None or w is None:
        return None
    return 2.0 * math.prod(x) * math.prod(w[1:])


def _recurrent(node: ir.Node, out: list[int] | None, symbolic: int | None, unnamed: int | None) -> float | None:
    """RNN, GRU, LSTM: every gate's input and recurrent matrix products at every step of every
    sequence (X [seq, batch, input] or [batch, seq, input]; W and R hold all gates and
    directions)."""
    x = _dims(node.inputs[0], symbolic, unnamed)
    w = _dims(node.inputs[1], symbolic, unnamed)
    r = _dims(node.inputs[2], symbolic, unnamed) if len(node.inputs) > 2 else None
    if x is None or w is None or r is None or len(x) != 3:
        return None
    return 2.0 * math.prod(x[:-1]) * (math.prod(w) + math.prod(r))


# The `flops` formulas of the op facts: (node, static output dims or None, size of named and of
# unnamed symbolic dimensions) -> FLOPs or None.
_FORMULAS: dict[str, Callable[[ir.Node, list[int] | None, int | None, int | None], float | None]] = {
    "matmul": _matmul,
    "gemm": _gemm,
    "conv": _conv,
    "conv_transpose": _conv_transpose,
    "recurrent": _recurrent,
}


def flops_of(node: ir.Node, symbolic: int | None = None, unnamed: int | None = None) -> float | None:
    """FLOPs of a node by its op's formula (`flops` in the op facts); None where unknown.
    `symbolic` / `unnamed`: the size taken for named / unnamed symbolic dimensions (None: such
    nodes are unknown)."""
    formula = op_facts(node.domain, node.op_type).flops if is_default_domain(node.domain) else None
    if formula is None or not node.outputs or len(node.inputs) < 2:
        return None
    return _FORMULAS[formula](node, _dims(node.outputs[0], symbolic, unnamed), symbolic, unnamed)


def float_elements(node: ir.Node, symbolic: int | None = SYMBOLIC_DIM, known: dict[int, int] | None = None) -> int:
    """Elements of the float tensors a node reads and writes, every dimension that is not static
    as `symbolic` (None: such tensors and those of unknown rank count none); `known` remembers
    the count of each shape object across calls (values of equal static shape share one)."""
    total = 0
    for value in (*node.inputs, *node.outputs):
        if value is None or value.dtype not in _FLOAT_TYPES:
            continue
        shape = value.shape
        if shape is None:
            continue
        elements = known.get(id(shape)) if known is not None else None
        if elements is None:
            elements = tensor_elements(shape, symbolic, symbolic) or 0
            if known is not None:
                known[id(shape)] = elements
        total += elements
    return total


def node_time(elements: int, flops: float | None, low: bool, cost: RuntimeCost, *, elementwise: bool = False) -> float:
    """Estimated time of one op (in byte-times of `cost`'s device): the larger of its traffic
    (`elements` in 16 bits or FP32; in 16 bits, `cost.low_arithmetic_bytes` per element for an
    `elementwise` op: one that computes without matrix FLOPs rather than moving values) and its
    matrix arithmetic, plus one launch."""
    if low:
        per_element = max(LOW_BYTES_PER_ELEMENT, cost.low_arithmetic_bytes) if elementwise else LOW_BYTES_PER_ELEMENT
    else:
        per_element = FP32_BYTES_PER_ELEMENT
    traffic = elements * per_element
    arithmetic = (flops or 0.0) / cost.flops_per_byte * (1.0 if low else cost.fp32_flop_cost)
    return max(float(traffic), arithmetic) + cost.launch_bytes


def computes_elementwise(domain: str, op_type: str) -> bool:
    """Whether the op computes its outputs element by element: no FLOPs formula (a matrix
    product's), and it neither moves nor selects values (Transpose, Gather, MaxPool: its
    integer-semantics carrier is not "movement", and it is not value-preserving without being
    arithmetic)."""
    fact = op_facts(domain, op_type)
    if fact.flops is not None or fact.carrier == "movement":
        return False
    return not (fact.value_preserving and fact.carrier != "arithmetic")


def cast_time(elements: int, cost: RuntimeCost) -> float:
    """Estimated time of one Cast of `elements` between FP32 and 16 bits."""
    return elements * CAST_BYTES_PER_ELEMENT + cost.launch_bytes
