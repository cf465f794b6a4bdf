"""Constant dequantizations folded into float constants, where the runtime computes them in float.

A DequantizeLinear whose inputs are all constants (the int32 bias of a quantized Conv or Gemm,
whose scale is input scale x weight scale, ~1e-5; the int8 weights of an op the runtime runs in
float) is a constant. Runtimes that fuse a quantized group into an integer kernel read its
integers (ONNX Runtime's CPU provider: QLinearConv); runtimes that run the group in float
dequantize it at run time, in the group's type: in float16 the bias scale is sub-normal and
loses most of its digits. Where the runtime does the latter (`float_dequantize` in
`policy/tables/quantized_groups.toml`) and can run the group in the target type, the
DequantizeLinear is computed here once, in FP32, and becomes an FP32 initializer with the
output's name: the plan stores it in the target type, rounded once, and reads it as a plain
constant, so its group converts with cast-free DequantizeLinear -> op -> QuantizeLinear edges.

Rules:
  1. The node dequantizes (the `quantization` op fact), every input is a constant, its integer
     type is one the runtime dequantizes in float, and its output is no graph output.
  2. Every reader is in a quantized group (it also reads a DequantizeLinear of a non-constant
     value: weight-only quantization keeps its integers) and the runtime has a kernel for it and
     for DequantizeLinear in the target type.
  3. The values are computed when first read (`ir.LazyTensor`); integer inputs no other node
     reads leave the model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import constant_tensor, is_constant, read_array
from mixprec.analysis.qdq import FOLDED, role
from mixprec.dtypes import LowPrecision
from mixprec.graphs import all_graphs, static_shape
from mixprec.policy.quantized_groups import QuantizedGroups, quantized_groups
from mixprec.policy.profiles import RuntimeProfile

__all__ = [
    "FoldedDequantizations", "dequantize", "dequantized_constant", "drop_if_unused", "fold_constant_dequantizations",
    "fold_node",
]


@dataclass
class FoldedDequantizations:
    """What :func:`fold_constant_dequantizations` did.

    Attributes:
        nodes: The folded DequantizeLinear nodes' names.
        readers: The ops that read the folded constants (their groups).
        types: The folded integer types, by name.
    """

    nodes: list[str] = field(default_factory=list)
    readers: dict[ir.Node, None] = field(default_factory=dict)
    types: Counter[str] = field(default_factory=Counter)

    def note(self, runtime: str, target: LowPrecision) -> str:
        """One line for the report."""
        types = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items()))
        groups = ", ".join(f"{op} {n}" for op, n in Counter(node.op_type for node in self.readers).most_common())
        first = ", ".join(self.nodes[:5]) + (" ..." if len(self.nodes) > 5 else "")
        return (
            f"folded {len(self.nodes)} constant DequantizeLinear(s) ({types}) into float constants, "
            f"computed in FP32 and stored in {target.value} where their group converts: {runtime} "
            f"dequantizes them in float at run time (no integer kernel reads them), so their "
            f"groups ({groups}) run in {target.value} without a 16-bit scale: {first}"
        )


def fold_constant_dequantizations(model: ir.Model, profile: RuntimeProfile, target: LowPrecision) -> FoldedDequantizations:
    """Fold the constant dequantizations `profile` computes in float (in place; see the module
    docstring for the rules)."""
    facts = quantized_groups(profile.name)
    folded = FoldedDequantizations()
    if not facts.float_dequantize:
        return folded
    for graph in all_graphs(model):
        for node in list(graph):
            if _foldable(node, facts, profile, target):
                folded.readers.update(dict.fromkeys(use.node for use in node.outputs[0].uses()))
                folded.nodes.append(node.name or node.outputs[0].name or "DequantizeLinear")
                folded.types[fold_node(graph, node).name.lower()] += 1
    return folded


def _foldable(node: ir.Node, facts: QuantizedGroups, profile: RuntimeProfile, target: LowPrecision) -> bool:
    """Whether `node` is a constant dequantization `profile` computes in float, read only by
    quantized groups that run in the target type."""
    if not _float_constant_dequantization(node, facts):
        return False
    out = node.outputs[0]
    if out.is_graph_output() or not out.uses() or _output_type(node) is None:
        return False
    return _readers_convert(node, profile, target)


def _float_constant_dequantization(node: ir.Node, facts: QuantizedGroups) -> bool:
    """Whether `node` is a DequantizeLinear of constants whose integer type the runtime
    dequantizes in float."""
    if role(node) != "dequantize" or not node.inputs or not node.outputs:
        return False
    if not all(value is None or is_constant(value) for value in node.inputs):
        return False
    source = constant_tensor(node.inputs[0]) if node.inputs[0] is not None else None
    return source is not None and facts.dequantizes_in_float(source.dtype)


def _readers_convert(node: ir.Node, profile: RuntimeProfile, target: LowPrecision) -> bool:
    """Whether the runtime runs `node` and each of its readers (all in quantized groups) in the
    target type."""
    out = node.outputs[0]
    if not profile.runs_in(node.domain, node.op_type, target.type_str):
        return False
    return all(
        _in_quantized_group(use.node) and profile.runs_in(use.node.domain, use.node.op_type, target.type_str)
        for use in out.uses()
    )


def _in_quantized_group(node: ir.Node) -> bool:
    """Whether the node reads a dequantized activation (a DequantizeLinear of a non-constant)."""
    for value in node.inputs:
        producer = value.producer() if value is not None else None
        if producer is not None and role(producer) == "dequantize" and producer.inputs:
            source = producer.inputs[0]
            if source is not None and not is_constant(source):
                return True
    return False


def _output_type(node: ir.Node) -> ir.DataType | None:
    """The float type a DequantizeLinear yields: its `output_dtype`, else its scale's type
    (read from the constant: the model is not typed yet)."""
    attr = node.attributes.get("output_dtype")
    if attr is not None and attr.as_int():
        return ir.DataType(attr.as_int())
    scale = node.inputs[1] if len(node.inputs) > 1 else None
    tensor = constant_tensor(scale) if scale is not None else None
    return tensor.dtype if tensor is not None and tensor.dtype.is_floating_point() else None


def fold_node(graph: ir.Graph, node: ir.Node) -> ir.DataType:
    """Replace a DequantizeLinear of constants by an initializer holding its values (computed
    in FP32 and rounded once to the output type, when read); the integer type it dequantized."""
    out, out_type = node.outputs[0], _output_type(node)
    tensors = [constant_tensor(v) if v is not None else None for v in node.inputs]
    source = tensors[0]
    assert source is not None and out_type is not None
    attributes, name = _dequantize_attributes(node), out.name
    shape = static_shape(tuple(int(d) for d in source.shape))
    lazy = ir.LazyTensor(
        lambda: ir.Tensor(dequantized_constant(tensors, attributes, out_type)), out_type, shape, name=name
    )
    value = ir.Value(name=None, type=ir.TensorType(out_type), shape=shape, const_value=lazy)
    value.meta[FOLDED] = node.name or name
    out.replace_all_uses_with(value, replace_graph_outputs=True)
    inputs = [v for v in node.inputs if v is not None]
    graph.remove(node, safe=True)
    value.name = name
    graph.initializers.add(value)
    for old in inputs:
        drop_if_unused(graph, old)
    return source.dtype


def _dequantize_attributes(node: ir.Node) -> tuple[int, int]:
    """(axis, block_size) of a DequantizeLinear (their schema defaults when unset)."""
    axis = node.attributes.get("axis")
    block = node.attributes.get("block_size")
    return (axis.as_int() if axis is not None else 1, block.as_int() if block is not None else 0)


def drop_if_unused(graph: ir.Graph, value: ir.Value) -> None:
    """Remove an initializer or Constant output that nothing reads any more."""
    if value.uses() or value.is_graph_output() or value.is_graph_input():
        return
    if value.name in graph.initializers and graph.initializers[value.name] is value:
        graph.initializers.pop(value.name)
        return
    producer = value.producer()
    if producer is not None and producer.graph is graph and producer.op_type == "Constant":
        graph.remove(producer, safe=True)


def dequantized_constant(
    inputs: list[ir.TensorProtocol | None], attributes: tuple[int, int], out_type: ir.DataType
) -> np.ndarray:
    """The values of DequantizeLinear(x, scale, zero_point) over constant tensors, in `out_type`."""
    x, scale = inputs[0], inputs[1]
    zero_point = inputs[2] if len(inputs) > 2 else None
    assert x is not None and scale is not None
    axis, block_size = attributes
    values = dequantize(
        read_array(x), read_array(scale), None if zero_point is None else read_array(zero_point), axis, block_size,
    )
    return values if out_type == ir.DataType.FLOAT else values.astype(out_type.numpy())


def dequantize(
    x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None, axis: int = 1, block_size: int = 0
) -> np.ndarray:
    """DequantizeLinear in FP32 as runtimes compute it: `float(x - zero_point) * scale`, the
    difference in integers (float8 inputs: their values), the product in float32. The scale is
    per tensor (a scalar), per axis (1-D along `axis`) or per block (`block_size` > 0)."""
    integer = not ir.DataType.from_numpy(x.dtype).is_floating_point()
    scale = scale.astype(np.float32)
    zp = np.zeros((), np.int64) if zero_point is None else zero_point
    if scale.ndim and x.ndim:
        axis = axis % x.ndim
        if block_size > 0:
            scale, zp = (_blocks(a, x.shape[axis], axis, block_size) for a in (scale, np.broadcast_to(zp, scale.shape)))
        else:
            layout = [scale.size if i == axis else 1 for i in range(x.ndim)]
            scale = scale.reshape(layout)
            zp = zp.reshape(layout) if zp.ndim else zp
    if integer:
        return (x.astype(np.int64) - zp.astype(np.int64)).astype(np.float32) * scale
    return x.astype(np.float32) * scale


def _blocks(values: np.ndarray, length: int, axis: int, block_size: int) -> np.ndarray:
    """A per-block tensor repeated to `length` elements along `axis`."""
    repeated = np.repeat(values, block_size, axis=axis)
    return np.take(repeated, np.arange(length), axis=axis)
