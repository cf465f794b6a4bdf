"""Decomposed normalizations decided as one block: fused where the opset and the runtime allow,
else FP32.

PyTorch's TorchScript exporter (below opset 17), TensorFlow and Paddle write LayerNorm as
ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div(/Mul/Add) and RMSNorm as Pow/ReduceMean/Add/Sqrt/
Div(/Mul); jax2onnx writes Flax's LayerNorm with the variance as the mean of squares less the
squared mean, clamped at 0 (ReduceMean/Sub, Mul/ReduceMean, Mul/Sub/Max/Add/Sqrt/Div/Mul/Add),
and casts epsilon like the input (CastLike), and Equinox's with x - mean set to 0 on rows whose
values are all equal (ReduceMin/ReduceMax/Equal/Sub/Equal/And/Where) and the mean of squares
taken in double (Cast/ReduceMean/Cast); tf2onnx writes Keras's LayerNormalization as
TensorFlow's batch_normalization, x * g + (beta - mean * g) with g = gamma / sqrt(var + eps),
its means by GlobalAveragePool. Converted node by node, such a block ends up part
16-bit, part FP32 behind Casts, and runtimes' own fusions (onnxruntime's LayerNormFusion) then
build a normalization op with mixed input types that fails to load. Here each block is found
and either

* fused into `LayerNormalization` (opset 17) / `RMSNormalization` (opset 23) with
  `stash_type=1` where the runtime runs that op in the target type, so the statistics
  accumulate in FP32 inside the op and the block costs no Cast, or
* where the opset, the runtime (or a non-static shape) does not allow that, kept FP32 as a
  whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import read_array, reduction_axes, small_constant_array
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.graphs import FreshNames, all_graphs, keep_structure, model_names
from mixprec.passes.opset import default_opset
from mixprec.policy.opfacts import op_facts
from mixprec.policy.profiles import RuntimeProfile

# Per kind of block: the op it fuses into and the opset that op first exists at.
_FUSED_OP = {"layer": ("LayerNormalization", 17), "rms": ("RMSNormalization", 23)}


@dataclass
class NormBlock:
    """One decomposed normalization.

    Attributes:
        kind: "layer" or "rms".
        nodes: Its nodes, the last one the producer of its output.
        input: The normalized tensor.
        output: The block's result (after the affine Mul/Add when present).
        axes: The normalized axes (trailing; positive, or negative where the input's rank is
            unknown).
        epsilon: The constant added to the variance.
        scale: The gamma constant, if any.
        bias: The beta constant, if any (LayerNorm only).
    """

    kind: str
    nodes: list[ir.Node]
    input: ir.Value
    output: ir.Value
    axes: list[int]
    epsilon: float
    scale: ir.Value | None
    bias: ir.Value | None

    @property
    def name(self) -> str:
        """A readable name: the nodes' common name prefix and the fused op (else the name of
        the block's last node and the fused op)."""
        names = [n.name for n in self.nodes if n.name]
        prefix = os.path.commonprefix(names).rsplit("/", 1)[0] if names else ""
        op_type = _FUSED_OP[self.kind][0]
        if prefix:
            return f"{prefix}/{op_type}"
        return f"{names[-1]}/{op_type}" if names else op_type

    @cached_property
    def affine(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Scale and bias (None without one) as the fused op wants them, of the normalized
        shape; None when the normalized shape or an affine constant is not static. Computed
        once per block (its constants do not change while it is found and not fused)."""
        scale = _affine_tensor(self, self.scale, 1.0)
        if scale is None:
            return None
        if self.bias is None:
            return scale, None
        bias = _affine_tensor(self, self.bias, 0.0)
        return None if bias is None else (scale, bias)


@dataclass
class NormBlocks:
    """What :func:`fuse_norm_blocks` did: fused blocks (by fused node name) and blocks kept
    FP32 (their nodes), with the reason."""

    fused: list[str]
    kept: dict[ir.Node, str]
    # Fused op -> the opset it needs, for blocks kept FP32 only because the model's is older.
    needs_opset: dict[str, int] = field(default_factory=dict)
    # The nodes of those blocks (they go when the blocks fuse after an upgrade); None when one
    # of them could not fuse even then (its affine constants are not static).
    waiting: set[ir.Node] | None = field(default_factory=set)
    # Every block found, by graph (those fused included), in the order they were found.
    found: dict[ir.Graph, list[NormBlock]] = field(default_factory=dict)


def _sole_consumer(value: ir.Value, graph_outputs: set[ir.Value]) -> ir.Node | None:
    uses = value.uses()
    if len(uses) != 1 or value in graph_outputs:
        return None
    return uses[0].node


def _other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    return b if a is value else a if b is value else None


def _scalar(value: ir.Value | None) -> float | None:
    array = small_constant_array(value) if value is not None else None
    if array is None or array.size != 1:
        return None
    return float(np.asarray(array, dtype=np.float64).reshape(-1)[0])


# Ops that compute a mean over trailing axes, keeping them (GlobalAveragePool: every axis
# after the first two; tf2onnx writes a mean over the last axis of a rank-3 tensor so).
_MEANS = ("ReduceMean", "GlobalAveragePool")


def _axes(node: ir.Node, rank: int | None) -> list[int] | None:
    """The reduced axes of a ReduceMean with keepdims=1 (or a GlobalAveragePool), when they are
    trailing: positive where the input's rank is known; where it is not (shape inference lost
    it past a computed Reshape), counted from the end as the node writes them ([-1]: the last
    axis whatever the rank)."""
    if node.op_type not in _MEANS:
        return None
    if node.op_type == "GlobalAveragePool":
        return list(range(2, rank)) if rank is not None and rank > 2 else None
    if node.attributes.get_int("keepdims", 1) != 1:
        return None
    axes = reduction_axes(node)
    if not axes:
        return None
    if rank is None:
        axes = sorted(axes)
        return axes if axes == list(range(-len(axes), 0)) else None
    axes = sorted(a % rank for a in axes)
    return axes if axes and axes == list(range(rank - len(axes), rank)) else None


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _squared(node: ir.Node) -> ir.Value | None:
    """x when `node` computes x**2 (Pow(x, 2) or Mul(x, x))."""
    if node.op_type == "Pow" and len(node.inputs) == 2 and _scalar(node.inputs[1]) == 2.0:
        return node.inputs[0]
    if node.op_type == "Mul" and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    return None


def _normalized(std: ir.Node, base: ir.Value, outputs: set[ir.Value]) -> tuple[list[ir.Node], ir.Value] | None:
    """The nodes dividing `base` by the standard deviation `std` computes, and the result:
    Div(base, std), Mul(base, Reciprocal(std)) or Mul(base, Div(1, std))."""
    consumer = _sole_consumer(std.outputs[0], outputs)
    if consumer is None:
        return None
    if consumer.op_type == "Div" and consumer.inputs[0] is base and consumer.inputs[1] is std.outputs[0]:
        return [consumer], consumer.outputs[0]
    inverse = consumer.op_type == "Reciprocal" or (
        consumer.op_type == "Div" and consumer.inputs[1] is std.outputs[0] and _scalar(consumer.inputs[0]) == 1.0
    )
    if not inverse:
        return None
    mul = _sole_consumer(consumer.outputs[0], outputs)
    if mul is None or mul.op_type != "Mul" or _other_input(mul, consumer.outputs[0]) is not base:
        return None
    return [consumer, mul], mul.outputs[0]


def _affine(value: ir.Value, op_type: str, outputs: set[ir.Value]) -> tuple[ir.Node, ir.Value] | None:
    node = _sole_consumer(value, outputs)
    if node is None or node.op_type != op_type:
        return None
    other = _other_input(node, value)
    return (node, other) if _is_constant_operand(other) else None


def _match(variance: ir.Node, outputs: set[ir.Value]) -> NormBlock | None:
    """A normalization block whose variance (mean of squares) is `variance`."""
    chain = _variance_chain(variance, outputs)
    if chain is None:
        return None
    square, base, moment, add, epsilon, std = chain
    if moment is not None:
        return _match_second_moment(square, variance, base, moment, add, epsilon, std, outputs)
    found = _normalized(std, base, outputs)
    if found is None:
        return _match_scale_shift(square, variance, base, add, epsilon, std, outputs)
    divide, result = found
    nodes = [square, variance, *add, std, *divide]
    kind, source = "rms", base
    centered = _centering(base, square, divide[-1], outputs) or _guarded_centering(base, square, divide[-1], outputs)
    if centered is not None:
        mean, center, *guard = centered
        kind, source = "layer", center.inputs[0]
        nodes = [mean, center, *guard, *nodes]
        if _axes(mean, _rank(source)) != _axes(variance, _rank(source)):
            return None
    axes = _axes(variance, _rank(source))
    if axes is None or source is None:
        return None
    affine_nodes, scale, bias, result = _affine_tail(result, kind, outputs)
    nodes.extend(affine_nodes)
    return NormBlock(kind, nodes, source, result, axes, epsilon, scale, bias)


def _match_second_moment(
    square: ir.Node, variance: ir.Node, base: ir.Value, moment: tuple[ir.Node, list[ir.Node]], add: list[ir.Node],
    epsilon: float, std: ir.Node, outputs: set[ir.Value],
) -> NormBlock | None:
    """A LayerNorm whose variance is the mean of squares less the squared mean (Flax's
    LayerNorm as jax2onnx writes it): (x - mean(x)) / sqrt(max(mean(x*x) - mean(x)**2, 0) + eps)."""
    mean, correction = moment
    center = next((
        use.node for use in mean.outputs[0].uses()
        if use.node.op_type == "Sub" and use.node.inputs[0] is base and use.node.inputs[1] is mean.outputs[0]
    ), None)
    if center is None or center.outputs[0] in outputs:
        return None
    found = _normalized(std, center.outputs[0], outputs)
    if found is None:
        return None
    divide, result = found
    if {use.node for use in center.outputs[0].uses()} != {divide[-1]}:
        return None
    if {use.node for use in mean.outputs[0].uses()} != {center, correction[0]} or mean.outputs[0] in outputs:
        return None
    axes = _axes(variance, _rank(base))
    if axes is None or _axes(mean, _rank(base)) != axes:
        return None
    nodes = [mean, center, square, variance, *correction, *add, std, *divide]
    affine_nodes, scale, bias, result = _affine_tail(result, "layer", outputs)
    nodes.extend(affine_nodes)
    return NormBlock("layer", nodes, base, result, axes, epsilon, scale, bias)


def _match_scale_shift(
    square: ir.Node, variance: ir.Node, base: ir.Value, add: list[ir.Node], epsilon: float, std: ir.Node,
    outputs: set[ir.Value],
) -> NormBlock | None:
    """A LayerNorm as TensorFlow's batch_normalization writes it (Keras's LayerNormalization
    through tf2onnx): with g = gamma / sqrt(mean((x - mean(x))**2) + eps), the result is
    x * g + (beta - mean(x) * g), the shift written Add(Mul(Neg(mean), g), beta) or
    Sub(beta, Mul(mean, g)); gamma and beta optional."""
    center = base.producer()
    if center is None or center.op_type != "Sub" or center.inputs[1] is None or base in outputs:
        return None
    source, mean_value = center.inputs
    mean = mean_value.producer() if mean_value is not None else None
    if mean is None or mean.inputs[0] is not source or {use.node for use in base.uses()} != {square}:
        return None
    inverse = _sole_consumer(std.outputs[0], outputs)
    if inverse is None or not (inverse.op_type == "Reciprocal" or (
        inverse.op_type == "Div" and inverse.inputs[1] is std.outputs[0] and _scalar(inverse.inputs[0]) == 1.0
    )):
        return None
    nodes = [mean, center, square, variance, *add, std, inverse]
    factor, scale = inverse.outputs[0], None
    scaled = _affine(factor, "Mul", outputs)
    if scaled is not None:
        nodes.append(scaled[0])
        factor, scale = scaled[0].outputs[0], scaled[1]
    found = _shifted(source, mean, center, factor, outputs)
    if found is None:
        return None
    shift_nodes, bias, result = found
    axes = _axes(variance, _rank(source))
    if axes is None or _axes(mean, _rank(source)) != axes:
        return None
    return NormBlock("layer", [*nodes, *shift_nodes], source, result, axes, epsilon, scale, bias)


def _shifted(
    source: ir.Value, mean: ir.Node, center: ir.Node, factor: ir.Value, outputs: set[ir.Value]
) -> tuple[list[ir.Node], ir.Value | None, ir.Value] | None:
    """x * g + (beta - mean * g) after the factor g: its nodes, beta (None without) and result.
    Every intermediate value is read once, inside."""
    readers = [use.node for use in factor.uses()]
    if len(readers) != 2 or factor in outputs or any(node.op_type != "Mul" for node in readers):
        return None
    scaled = next((node for node in readers if _other_input(node, factor) is source), None)
    if scaled is None:
        return None
    product = readers[1] if readers[0] is scaled else readers[0]
    mean_readers = {use.node for use in mean.outputs[0].uses()}
    term = _other_input(product, factor)
    negated = term.producer() if term is not None else None
    nodes = [scaled, product]
    if negated is not None and negated.op_type == "Neg" and negated.inputs[0] is mean.outputs[0]:
        # x * g + (-mean * g + beta)
        if mean_readers != {center, negated} or _sole_consumer(term, outputs) is not product:
            return None
        nodes.insert(0, negated)
        shift = _sole_consumer(product.outputs[0], outputs)
        bias = None
        if shift is not None and shift.op_type == "Add" and _other_input(shift, product.outputs[0]) is not None \
                and _is_constant_operand(_other_input(shift, product.outputs[0])):
            nodes.append(shift)
            bias, shifted = _other_input(shift, product.outputs[0]), shift.outputs[0]
        else:
            shifted = product.outputs[0]
        total = _sole_consumer(shifted, outputs)
        if total is None or total.op_type != "Add" or _other_input(total, shifted) is not scaled.outputs[0]:
            return None
    elif term is mean.outputs[0]:
        # x * g + (beta - mean * g), or x * g - mean * g
        if mean_readers != {center, product}:
            return None
        shift = _sole_consumer(product.outputs[0], outputs)
        bias = None
        if shift is not None and shift.op_type == "Sub" and shift.inputs[1] is product.outputs[0] \
                and _is_constant_operand(shift.inputs[0]):
            nodes.append(shift)
            bias = shift.inputs[0]
            total = _sole_consumer(shift.outputs[0], outputs)
            if total is None or total.op_type != "Add" or _other_input(total, shift.outputs[0]) is not scaled.outputs[0]:
                return None
        else:
            total = shift
            if total is None or total.op_type != "Sub" or total.inputs[0] is not scaled.outputs[0] \
                    or total.inputs[1] is not product.outputs[0]:
                return None
    else:
        return None
    if _sole_consumer(scaled.outputs[0], outputs) is not total:
        return None
    nodes.append(total)
    return nodes, bias, total.outputs[0]


def _is_constant_operand(value: ir.Value | None) -> bool:
    """An initializer or a Constant's output (an affine scale or shift)."""
    if value is None:
        return False
    producer = value.producer()
    if value.const_value is not None:
        return producer is None
    if producer is None:
        return False
    if producer.op_type == "Constant":
        return small_constant_array(value) is not None
    return op_facts(producer.domain, producer.op_type).reshapes and _constant_array(value) is not None


def _variance_chain(
    variance: ir.Node, outputs: set[ir.Value]
) -> tuple[ir.Node, ir.Value, tuple[ir.Node, list[ir.Node]] | None, list[ir.Node], float, ir.Node] | None:
    """Square, its base x, the second-moment correction (see :func:`_second_moment`), Add of
    epsilon (after the cast of epsilon, if any: :func:`_epsilon`), epsilon and Sqrt around the
    ReduceMean `variance` of x**2 + epsilon, each the sole consumer of the one before (x in
    FP32)."""
    square = variance.inputs[0].producer() if variance.inputs and variance.inputs[0] is not None else None
    widened = _cast_to(square, ir.DataType.DOUBLE)  # the mean of squares taken in double (Equinox)
    if widened is not None:
        if _sole_consumer(widened.outputs[0], outputs) is not variance:
            return None
        square = widened.inputs[0].producer() if widened.inputs[0] is not None else None
    first = widened if widened is not None else variance
    if square is None or _sole_consumer(square.outputs[0], outputs) is not first:
        return None
    base = _squared(square)
    if base is None or not is_fp32_tensor(base):
        return None
    last = variance
    if widened is not None:  # and cast back to FP32
        last = _sole_consumer(variance.outputs[0], outputs)
        if last is None or _cast_to(last, ir.DataType.FLOAT) is None:
            return None
    around = [widened, last] if widened is not None else []
    add = _sole_consumer(last.outputs[0], outputs)
    moment = _second_moment(variance, add, base, outputs) if add is not None and add.op_type == "Sub" and not around else None
    if moment is not None:
        add = _sole_consumer(moment[1][-1].outputs[0], outputs)
        last = moment[1][-1]
    if add is None or add.op_type != "Add":
        return None
    found = _epsilon(_other_input(add, last.outputs[0]), add, outputs)
    std = _sole_consumer(add.outputs[0], outputs)
    if found is None or std is None or std.op_type != "Sqrt":
        return None
    epsilon, cast = found
    return square, base, moment, [*around, *cast, add], epsilon, std


def _cast_to(node: ir.Node | None, dtype: ir.DataType) -> ir.Node | None:
    """`node` when it is a Cast to `dtype`."""
    if node is None or node.op_type != "Cast" or not node.inputs:
        return None
    to = node.attributes.get("to")
    return node if to is not None and to.as_int() == dtype else None


def _epsilon(value: ir.Value | None, add: ir.Node, outputs: set[ir.Value]) -> tuple[float, list[ir.Node]] | None:
    """The constant epsilon `add` adds, and the Cast / CastLike to FP32 of it that only `add`
    reads (jax2onnx casts epsilon like the input), which belongs to the block."""
    epsilon = _scalar(value)
    if epsilon is not None:
        return epsilon, []
    cast = value.producer() if value is not None else None
    if cast is None or value is None or cast.op_type not in ("Cast", "CastLike") or not is_fp32_tensor(value):
        return None
    if _sole_consumer(value, outputs) is not add or cast.inputs[0] is None:
        return None
    epsilon = _scalar(cast.inputs[0])
    return None if epsilon is None else (epsilon, [cast])


def _second_moment(
    variance: ir.Node, sub: ir.Node, base: ir.Value, outputs: set[ir.Value]
) -> tuple[ir.Node, list[ir.Node]] | None:
    """Where the mean of squares `variance` of x has mean(x)**2 taken off (Sub, then a Max
    with 0 or none): the ReduceMean of x, and the Mul, Sub (and Max) that do it."""
    if sub.inputs[0] is not variance.outputs[0] or len(sub.inputs) != 2 or sub.inputs[1] is None:
        return None
    squared_mean = sub.inputs[1].producer()
    if squared_mean is None or squared_mean.op_type != "Mul" or _sole_consumer(squared_mean.outputs[0], outputs) is not sub:
        return None
    mean_value = _squared(squared_mean)
    mean = mean_value.producer() if mean_value is not None else None
    if mean is None or mean.op_type not in _MEANS or mean.inputs[0] is not base:
        return None
    correction = [squared_mean, sub]
    clamp = _sole_consumer(sub.outputs[0], outputs)
    if clamp is not None and clamp.op_type == "Max" and _scalar(_other_input(clamp, sub.outputs[0])) == 0.0:
        correction.append(clamp)
    return mean, correction


def _centering(
    base: ir.Value, square: ir.Node, divide: ir.Node, outputs: set[ir.Value]
) -> tuple[ir.Node, ir.Node] | None:
    """The ReduceMean and Sub when `base` is x - mean(x) read only by `square` and `divide`."""
    center = base.producer()
    if center is None or center.op_type != "Sub" or center.inputs[1] is None:
        return None
    mean = center.inputs[1].producer()
    users = {use.node for use in base.uses()}
    if (
        mean is not None and mean.op_type in _MEANS and mean.inputs[0] is center.inputs[0]
        and users == {square, divide} and base not in outputs
        and _sole_consumer(mean.outputs[0], outputs) is center
    ):
        return mean, center
    return None


def _guarded_centering(
    base: ir.Value, square: ir.Node, divide: ir.Node, outputs: set[ir.Value]
) -> tuple[ir.Node, ...] | None:
    """The ReduceMean, Sub and guard nodes when `base` is x - mean(x) set to 0 on rows whose
    values are all equal (Equinox's LayerNorm as jax2onnx writes it): Where(And(Equal(min(x),
    max(x)), Equal(mean - mean, 0)), 0, x - mean(x)), read only by `square` and `divide`. A
    fused LayerNorm gives such rows 0 too (their mean is their value)."""
    where = base.producer()
    if where is None or where.op_type != "Where" or len(where.inputs) != 3 or base in outputs:
        return None
    condition, zero, centered = where.inputs
    if _scalar(zero) != 0.0 or centered is None or condition is None or {use.node for use in base.uses()} != {square, divide}:
        return None
    center = centered.producer()
    if center is None or center.op_type != "Sub" or center.inputs[1] is None or _sole_consumer(centered, outputs) is not where:
        return None
    source, mean_value = center.inputs
    mean = mean_value.producer()
    both = condition.producer()
    if mean is None or mean.op_type not in _MEANS or mean.inputs[0] is not source or both is None or both.op_type != "And":
        return None
    equal_extrema, finite = (value.producer() if value is not None else None for value in both.inputs)
    if equal_extrema is None or finite is None or equal_extrema.op_type != "Equal" or finite.op_type != "Equal":
        return None
    if _scalar(finite.inputs[1]) != 0.0:
        equal_extrema, finite = finite, equal_extrema
    delta = finite.inputs[0].producer() if finite.inputs[0] is not None and _scalar(finite.inputs[1]) == 0.0 else None
    if delta is None or delta.op_type != "Sub" or list(delta.inputs) != [mean_value, mean_value]:
        return None
    extrema = [value.producer() if value is not None else None for value in equal_extrema.inputs]
    if sorted(n.op_type if n is not None else "" for n in extrema) != ["ReduceMax", "ReduceMin"]:
        return None
    rank = _rank(source)
    axes = _axes(mean, rank)
    if axes is None or rank is None or any(not _extremum_over(n, source, axes, rank) for n in extrema):  # type: ignore[arg-type]
        return None
    guard = [*extrema, equal_extrema, delta, finite, both, where]  # type: ignore[list-item]
    inside = {mean, center, *guard, square, divide}
    for node in (mean, *guard[:-1]):
        if any(out in outputs or any(use.node not in inside for use in out.uses()) for out in node.outputs):
            return None
    return (mean, center, *guard)


def _extremum_over(node: ir.Node, source: ir.Value, axes: list[int], rank: int) -> bool:
    """Whether the ReduceMin / ReduceMax `node` reduces `source` over `axes` (positive) keeping
    them, as the guard's mean does: a row's extrema then line up with its mean."""
    if node.inputs[0] is not source or node.attributes.get_int("keepdims", 1) != 1:
        return False
    found = reduction_axes(node)
    return bool(found) and sorted(a % rank for a in found) == axes


def _affine_tail(
    result: ir.Value, kind: str, outputs: set[ir.Value]
) -> tuple[list[ir.Node], ir.Value | None, ir.Value | None, ir.Value]:
    """The constant Mul (scale) after the normalized `result` and, for a LayerNorm, the Add
    (bias) after it: their nodes, scale, bias and the block's output."""
    nodes: list[ir.Node] = []
    scale = bias = None
    affine = _affine(result, "Mul", outputs)
    if affine is not None:
        nodes.append(affine[0])
        scale, result = affine[1], affine[0].outputs[0]
        if kind == "layer":
            shift = _affine(result, "Add", outputs)
            if shift is not None:
                nodes.append(shift[0])
                bias, result = shift[1], shift[0].outputs[0]
    return nodes, scale, bias, result


def find_norm_blocks(graph: ir.Graph) -> list[NormBlock]:
    """The decomposed LayerNorm/RMSNorm blocks of one graph (not its subgraphs)."""
    outputs = set(graph.outputs)
    blocks = []
    claimed: set[ir.Node] = set()
    for node in graph:
        if node.op_type not in _MEANS or node in claimed or node.domain not in ("", "ai.onnx"):
            continue
        block = _match(node, outputs)
        if block is not None and not claimed.intersection(block.nodes):
            blocks.append(block)
            claimed.update(block.nodes)
    return blocks


def _constant_array(value: ir.Value, depth: int = 4) -> np.ndarray | None:
    """The constant's values; through ops that only reshape a constant (Paddle2ONNX writes a
    LayerNorm's gamma as a Reshape of a Constant) where the result's shape is static."""
    if value.const_value is not None:
        return read_array(value.const_value)
    array = small_constant_array(value)
    producer = value.producer()
    if array is not None or producer is None or depth == 0 or not producer.inputs:
        return array
    shape, source = value.shape, producer.inputs[0]
    if source is None or shape is None or not shape.is_static() or not op_facts(producer.domain, producer.op_type).reshapes:
        return None
    array, dims = _constant_array(source, depth - 1), tuple(int(d) for d in shape.dims)
    if array is None or array.size != int(np.prod(dims)):
        return None
    return array.reshape(dims)


def _normalized_shape(block: NormBlock) -> tuple[int, ...] | None:
    """The shape of the normalized axes: from the input's static dimensions, else from an
    affine constant that spans every normalized axis (gamma [C] of a LayerNorm over the last
    axis: the product with gamma fixes that size anyway)."""
    shape = block.input.shape
    dims = [shape[a] for a in block.axes] if shape is not None else []
    if dims and all(isinstance(d, int) for d in dims):
        return tuple(int(d) for d in dims)
    for value in (block.scale, block.bias):
        array = _constant_array(value) if value is not None else None
        if array is not None and array.ndim == len(block.axes) and array.size > 1:
            return tuple(array.shape)
    return None


def _affine_tensor(block: NormBlock, value: ir.Value | None, fill: float) -> np.ndarray | None:
    """Scale/bias as the fused op wants them: of the normalized shape."""
    normalized = _normalized_shape(block)
    if normalized is None:
        return None
    if value is None:
        return np.full(normalized, fill, dtype=np.float32)
    array = _constant_array(value)
    if array is None or array.dtype != np.float32:
        return None
    extra = array.ndim - len(normalized)
    if extra > 0:  # leading axes of 1 ([1, 1, C] for a norm over the last axis) broadcast away
        if any(d != 1 for d in array.shape[:extra]):
            return None
        array = array.reshape(array.shape[extra:])
    try:
        return np.ascontiguousarray(np.broadcast_to(array, normalized))
    except ValueError:
        return None


def _fuse(
    graph: ir.Graph, block: NormBlock, index: int, names: tuple[FreshNames, FreshNames], read: set[ir.Value]
) -> str | None:
    """Replace the block by one fused node; its name (fresh in the model), or None when the
    block's affine constants are not static. What the block's nodes read joins `read`."""
    op_type, _ = _FUSED_OP[block.kind]
    if block.affine is None:
        return None
    scale, bias = block.affine
    value_names, node_names = names
    name = node_names(block.name)
    inputs = [block.input]
    for role, array in (("scale", scale), ("bias", bias)):
        if array is None:
            continue
        value = ir.Value(name=value_names(f"{name}.{role}_{index}"), shape=ir.Shape(array.shape), type=ir.TensorType(ir.DataType.FLOAT))
        value.const_value = ir.Tensor(array, name=value.name)
        graph.register_initializer(value)
        inputs.append(value)
    fused = ir.Node(
        "", op_type, inputs,
        attributes=[
            ir.AttrInt64("axis", block.axes[0]),
            ir.AttrFloat32("epsilon", block.epsilon),
            ir.AttrInt64("stash_type", 1),
        ],
        name=name,
    )
    graph.insert_after(block.nodes[-1], fused)
    _take_over_output(block.output, fused.outputs[0])
    _remove_block(graph, block, read)
    return name


def _take_over_output(old: ir.Value, out: ir.Value) -> None:
    """Let `out` replace `old`: its type, shape, uses, name and place among the graph outputs."""
    out.dtype, out.shape = old.dtype, old.shape
    ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
    name, old.name = old.name, None
    out.name = name


def _remove_block(graph: ir.Graph, block: NormBlock, read: set[ir.Value]) -> None:
    """Remove the block's nodes; the values they read join `read` (the constants among them
    that nothing reads any more go once the graph's blocks are fused:
    :func:`_drop_unread_constants`)."""
    read.update(value for node in block.nodes for value in node.inputs if value is not None)
    graph.remove(block.nodes, safe=True)


def _drop_unread_constants(graph: ir.Graph, read: set[ir.Value]) -> None:
    """Remove the Constant nodes of `graph` and the initializers among the values fused blocks
    read (`read`: epsilon, exponent, 1 of 1/x, the old scale and bias) that nothing reads any
    more. Once per graph, after its blocks fused: a constant that many blocks share is looked at
    once, not once per block (a fused op reads only what its block read, so a value nothing
    reads now went dead with some block and the other way round)."""
    constants: list[ir.Node] = []
    pending = list(read)
    while pending:
        producer = pending.pop().producer()
        if producer is None or producer.graph is not graph or any(
            out.uses() or out in graph.outputs for out in producer.outputs
        ):
            continue
        if producer.op_type == "Constant":
            constants.append(producer)
        elif op_facts(producer.domain, producer.op_type).reshapes and all(map(_is_constant_operand, producer.inputs)):
            fresh = [v for v in producer.inputs if v is not None and v not in read]
            graph.remove(producer, safe=True)  # a reshaped constant (gamma as Reshape(Constant)): its own go too
            read.update(fresh)
            pending.extend(fresh)
    graph.remove(constants, safe=True)
    _drop_unused_initializers(graph, read)


def _drop_unused_initializers(graph: ir.Graph, values: set[ir.Value]) -> None:
    """Delete those of `values` that are initializers of `graph` and no longer used."""
    for value in values:
        if value.is_initializer() and graph.initializers.get(value.name) is value and not value.uses() \
                and value not in graph.outputs and value not in graph.inputs:
            del graph.initializers[value.name]


def opset_for_fusion(blocks: NormBlocks, profile: RuntimeProfile, target: LowPrecision) -> int | None:
    """The opset to upgrade to so that the blocks kept for the model's opset fuse (the newest
    their fused ops need): when the runtime has a kernel of every fused op that admits the
    target type and its table, if it states one, reaches that opset; else None (then no block
    is upgraded, also those a lower opset would fuse)."""
    if not blocks.needs_opset:
        return None
    version = max(blocks.needs_opset.values())
    if profile.opset_range is not None and version > profile.opset_range[1]:
        return None
    if not all(profile.runs_in("", op, target.type_str) for op in blocks.needs_opset):
        return None
    return version


@dataclass(frozen=True)
class FusedKernels:
    """What a runtime profile runs of the fused ops, in the conversion's target type."""

    profile: RuntimeProfile
    target: LowPrecision

    def missing(self, op_type: str) -> str | None:
        """Why the runtime cannot run `op_type` (a default-domain op) in the target type, or
        None when it can."""
        if self.profile.runs_in("", op_type, self.target.type_str):
            return None
        return f"{self.profile.name} has no {self.target.value} kernel of {op_type}"


def fuse_norm_blocks(
    model: ir.Model, found: dict[ir.Graph, list[NormBlock]] | None = None, kernels: FusedKernels | None = None
) -> NormBlocks:
    """Fuse decomposed normalizations where the opset and the runtime allow (typed model:
    shapes are needed); the others are returned to be kept FP32 as one block.

    `found`: the blocks an earlier call found (its `NormBlocks.found`), taken instead of
    searching again; only where that call fused none and the model has not changed since, its
    types included (an upgrade that only declared a newer opset): the search would find the
    same blocks. `kernels`: where the runtime has no kernel of a fused op in the target type,
    its blocks stay as they are (None: every fused op runs).
    """
    opset = default_opset(model) or 0
    result = NormBlocks(fused=[], kept={})
    names: tuple[FreshNames, FreshNames] | None = None
    count = 0
    for graph in all_graphs(model):
        blocks = find_norm_blocks(graph) if found is None else found[graph]
        result.found[graph] = blocks
        read: set[ir.Value] = set()
        for block in blocks:
            op_type, since = _FUSED_OP[block.kind]
            what = "LayerNorm" if block.kind == "layer" else "RMSNorm"
            missing = kernels.missing(op_type) if kernels is not None else None
            if missing is not None:
                reason = f"decomposed {what} kept FP32 as one block: {missing}"
            elif opset >= since:
                names = names or model_names(model)
                count += 1
                fused = _fuse(graph, block, count, names, read)
                if fused is not None:
                    result.fused.append(fused)
                    continue
                reason = f"decomposed {what} kept FP32 as one block: its normalized shape or affine constants are not static"
            else:
                result.needs_opset[op_type] = since
                if result.waiting is not None:
                    if block.affine is not None:  # fusable
                        result.waiting.update(block.nodes)  # in place: one copy per node, not per block
                    else:
                        result.waiting = None
                reason = (
                    f"decomposed {what} kept FP32 as one block (no mixed types for runtime fusions); "
                    f"fusing it into {op_type} needs opset {since} (--opset {since})"
                )
            for node in block.nodes:
                result.kept[node] = reason
        if read:  # blocks fused
            _drop_unread_constants(graph, read)
            keep_structure(graph)  # all_graphs scanned it; fused ops and their blocks own no subgraphs
    return result

