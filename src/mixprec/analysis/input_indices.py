"""How a model uses its inputs, for the data generated to run it: token ids index an
embedding, so they are drawn over its rows, not only 0 and 1; a key/value cache's head size
is the one its attention op computes with, whatever the dimension is named; a feature size
left symbolic is the one the weights that read it have."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.analysis.constants import constant_tensor
from mixprec.policy.opfacts import Carrier, op_facts
from mixprec.runtime.data import InputSpec, Shape, shape_from_proto

__all__ = ["cache_head_sizes", "fixed_input_dims", "weight_sized_dims", "with_fixed_dims", "with_index_limits"]


@dataclass(frozen=True)
class _NodeView:
    """What the index limits read of a node: its op, input and output names, the `axis`
    attribute, and the dims of its constant inputs (initializers, Constant outputs)."""

    domain: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    axis: int
    constant_dims: tuple[tuple[int, ...] | None, ...]


def _proto_nodes(graph: onnx.GraphProto) -> list[_NodeView]:
    dims: dict[str, tuple[int, ...]] = {t.name: tuple(t.dims) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    dims[node.output[0]] = tuple(attr.t.dims)
    views = []
    for node in graph.node:
        axis = next((int(a.i) for a in node.attribute if a.name == "axis"), 0)
        views.append(_NodeView(
            node.domain, node.op_type, tuple(node.input), tuple(node.output), axis,
            tuple(dims.get(name) for name in node.input),
        ))
    return views


def _ir_nodes(graph: ir.Graph) -> list[_NodeView]:
    def constant_dims(value: ir.Value | None) -> tuple[int, ...] | None:
        tensor = constant_tensor(value) if value is not None else None
        return None if tensor is None else tuple(int(d) for d in tensor.shape)

    return [
        _NodeView(
            node.domain, node.op_type, tuple(v.name if v is not None else "" for v in node.inputs),
            tuple(v.name or "" for v in node.outputs), node.attributes.get_int("axis", 0),
            tuple(constant_dims(v) for v in node.inputs),
        )
        for node in graph
    ]


def with_index_limits(specs: list[InputSpec], model: onnx.ModelProto | ir.Model) -> list[InputSpec]:
    """`specs` (of `model`'s inputs) with the index limit of each integer input the graph uses
    as indices into a constant table: its values reach the indices of a Gather of a constant
    (token ids into an embedding), through data movement (Cast, Reshape, Unsqueeze, Concat,
    ...: ops whose outputs hold values of their data inputs); the limit is the table's size
    along the gathered axis, the smallest where it indexes several."""
    integer = {s.name for s in specs if s.kind == "tensor" and np.issubdtype(s.dtype, np.integer)}
    if not integer:
        return specs
    nodes = _proto_nodes(model.graph) if isinstance(model, onnx.ModelProto) else _ir_nodes(model.graph)
    readers: dict[str, list[tuple[_NodeView, int]]] = {}
    for node in nodes:
        for index, name in enumerate(node.inputs):
            if name:
                readers.setdefault(name, []).append((node, index))
    limits: dict[str, int] = {}
    for name in integer:
        found: list[int] = []
        pending, seen = [name], {name}
        while pending:
            for node, index in readers.get(pending.pop(), ()):
                facts = op_facts(node.domain, node.op_type)
                if facts.interval == "gather" and index == 1:
                    table = node.constant_dims[0]
                    if table is not None and table and -len(table) <= node.axis < len(table):
                        found.append(table[node.axis])
                elif facts.carrier is Carrier.MOVEMENT and (index == 0 or facts.interval == "concat"):
                    # the data it moves (its first input; every input of a concatenation)
                    for out in node.outputs:
                        if out and out not in seen:
                            seen.add(out)
                            pending.append(out)
        if found and min(found) > 0:
            limits[name] = min(found)
    return [replace(s, index_limit=limits[s.name]) if s.name in limits else s for s in specs]


# Attention ops that read a key/value cache whose last dimension is the head size, by the
# input positions of the past key and past value; the head size follows from the op's other
# inputs and attributes (`_head_sizes`). onnxruntime refuses any other size.
_CACHES: dict[tuple[str, str], tuple[int, int]] = {
    ("com.microsoft", "GroupQueryAttention"): (3, 4),
    ("com.microsoft", "MultiHeadAttention"): (6, 7),
    ("", "Attention"): (4, 5),
}


def _head_sizes(op: tuple[str, str], dims: list[Shape | None], present: list[bool],
                attrs: dict[str, int]) -> tuple[int | None, int | None]:
    """(key head size, value head size) of one attention node, from the static dims of its
    query/key/value inputs (`dims`: None where absent or of unknown shape), which of them the
    node names (`present`) and its head counts; None where that does not fix it."""

    def split(shape: Shape | None, heads: int) -> int | None:
        if shape is None or not shape or not isinstance(shape[-1], int) or heads <= 0:
            return None
        if len(shape) in (4, 5):  # (batch, heads, sequence, head) or packed (..., heads, 2|3, head)
            return shape[-1]
        return shape[-1] // heads if shape[-1] % heads == 0 else None

    query, key, value = (dims + [None, None, None])[:3]
    heads, kv_heads = attrs.get("num_heads", 0), attrs.get("kv_num_heads", attrs.get("num_heads", 0))
    if op == ("com.microsoft", "GroupQueryAttention"):
        if not present[1]:  # query, key and value packed in the query
            size = split(query, heads + 2 * kv_heads) if query is not None and len(query) == 3 else None
            return size, size
        return split(key, kv_heads), split(value, kv_heads)
    if op == ("com.microsoft", "MultiHeadAttention"):  # both caches at the query's head size
        size = split(query, heads)
        return size, size
    return split(key, kv_heads), split(value, kv_heads)


class _Shapes:
    """The shapes of a model's main-graph values: its value_info and initializers, and shapes
    inferred (without weights) at most once, when a value asked for has none."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._model = model
        self._shapes: dict[str, Shape] | None = None
        self._inferred = False

    def covering(self, names: Iterable[str]) -> dict[str, Shape]:
        """The shapes, inferred first where one of `names` has none."""
        if self._shapes is None:
            graph = self._model.graph
            self._shapes = _static_shapes(graph)
            self._shapes.update((t.name, tuple(int(d) for d in t.dims)) for t in graph.initializer)
        if not self._inferred and any(name and name not in self._shapes for name in names):
            self._inferred = True
            try:
                self._shapes.update(_static_shapes(onnx.shape_inference.infer_shapes(self._model).graph))
            except Exception:  # noqa: BLE001 - a shape inference failure only leaves names unbound
                pass
        return self._shapes


def fixed_input_dims(model: onnx.ModelProto) -> dict[str, tuple[int, str]]:
    """The sizes `model` fixes for symbolic dimensions of its inputs, each with why: a feature
    size the weights reading it have (:func:`weight_sized_dims`) and a key/value cache's head
    size (:func:`cache_head_sizes`, which wins where both name one). Shapes are inferred at
    most once for both."""
    shapes = _Shapes(model)
    return {
        **{name: (size, f"the size {node!r} reads with its weights") for name, (size, node) in weight_sized_dims(model, shapes).items()},
        **{
            name: (size, f"the head size of the key/value cache {node!r} reads")
            for name, (size, node) in cache_head_sizes(model, shapes).items()
        },
    }


def cache_head_sizes(model: onnx.ModelProto, shapes: _Shapes | None = None) -> dict[str, tuple[int, str]]:
    """Symbolic dimension names that a key/value cache input of `model`'s main graph takes as
    its head size, each with the size the attention op reading it computes with and that op's
    name: a name such as "kv_cache_dim" does not say that it must be, say, 32. Reads the
    graph's value_info, and infers shapes (without weights) when an attention input has none
    (`shapes`: shared with another reading of the same model)."""
    graph = model.graph
    nodes = [n for n in graph.node if _op(n) in _CACHES]
    inputs = {i.name for i in graph.input}
    if not any(n.input[i] in inputs for n in nodes for i in _CACHES[_op(n)] if i < len(n.input)):
        return {}
    found = (shapes or _Shapes(model)).covering(name for n in nodes for name in n.input[:3])
    fixed: dict[str, tuple[int, str]] = {}
    for node in nodes:
        op = _op(node)
        attrs = {a.name: int(a.i) for a in node.attribute if a.type == onnx.AttributeProto.INT}
        named = [i < len(node.input) and bool(node.input[i]) for i in range(3)]
        sizes = _head_sizes(op, [found.get(name) if name else None for name in node.input[:3]], named, attrs)
        for index, size in zip(_CACHES[op], sizes):
            name = node.input[index] if index < len(node.input) else ""
            shape = found.get(name) if name in inputs else None
            if size and shape and isinstance(shape[-1], str) and shape[-1]:
                fixed.setdefault(shape[-1], (size, node.name or node.op_type))
    return fixed


# Ops whose data input (the first) has a dimension the shape of their weight (the second input)
# fixes: given the node's integer attributes and the weight's rank, (data axis, weight axis,
# factor: the data dimension is the weight dimension times the attribute of that name, or 1), or
# None where the node fixes none. A model whose input names such a size (an LSTM's input size,
# a MatMul's contracted features, a Conv's channels) runs with that size alone.
_SizedBy = Callable[[dict[str, int], int], tuple[int, int, str | None] | None]
_FEATURES_LAST: _SizedBy = lambda attrs, rank: (-1, -1, None)  # noqa: E731
_CHANNELS: _SizedBy = lambda attrs, rank: (1, 0, None)  # noqa: E731
_SIZED_BY: dict[tuple[str, str], _SizedBy] = {
    ("", "MatMul"): lambda attrs, rank: (-1, -2 if rank >= 2 else -1, None),
    ("", "Gemm"): lambda attrs, rank: (0 if attrs.get("transA") else 1, 1 if attrs.get("transB") else 0, None),
    ("", "Conv"): lambda attrs, rank: (1, 1, "group"),
    ("", "ConvTranspose"): _CHANNELS,
    ("", "LSTM"): _FEATURES_LAST,
    ("", "GRU"): _FEATURES_LAST,
    ("", "RNN"): _FEATURES_LAST,
    ("", "BatchNormalization"): _CHANNELS,
    ("", "InstanceNormalization"): _CHANNELS,
    ("", "LayerNormalization"): lambda attrs, rank: (-1, -1, None) if rank == 1 and attrs.get("axis", -1) == -1 else None,
}


def weight_sized_dims(model: onnx.ModelProto, shapes: _Shapes | None = None) -> dict[str, tuple[int, str]]:
    """Symbolic dimension names of `model`'s main-graph inputs that an op (`_SIZED_BY`) fixes by
    the static shape of its weight, each with that size and the op's name: an input of
    ``[frames, features]`` whose LSTM weights read 314 features runs with 314 alone. Reads the
    graph's value_info, and infers shapes (without weights) when a data input has none
    (`shapes`: shared with another reading of the same model)."""
    graph = model.graph
    nodes = [n for n in graph.node if _op(n) in _SIZED_BY and len(n.input) > 1 and n.input[0] and n.input[1]]
    constants = {t.name for t in graph.initializer}
    names = {
        d.dim_param for i in graph.input if i.name not in constants and i.type.HasField("tensor_type")
        for d in i.type.tensor_type.shape.dim if d.dim_param
    }
    if not nodes or not names:
        return {}
    found = (shapes or _Shapes(model)).covering(n.input[0] for n in nodes)
    fixed: dict[str, tuple[int, str]] = {}
    for node in nodes:
        data, weight = found.get(node.input[0]), found.get(node.input[1])
        if not data or not weight:
            continue
        attrs = {a.name: int(a.i) for a in node.attribute if a.type == onnx.AttributeProto.INT}
        axes = _SIZED_BY[_op(node)](attrs, len(weight))
        if axes is None:
            continue
        data_axis, weight_axis, factor = axes
        if not (-len(data) <= data_axis < len(data) and -len(weight) <= weight_axis < len(weight)):
            continue
        name, size = data[data_axis], weight[weight_axis]
        if isinstance(name, str) and name in names and isinstance(size, int) and size > 0:
            fixed.setdefault(name, (size * (attrs.get(factor, 1) if factor else 1), node.name or node.op_type))
    return fixed


def _op(node: onnx.NodeProto) -> tuple[str, str]:
    return ("" if node.domain == "ai.onnx" else node.domain, node.op_type)


def _static_shapes(graph: onnx.GraphProto) -> dict[str, Shape]:
    """Shapes of the graph's typed values (see `shape_from_proto`)."""
    shapes = {}
    for info in (*graph.input, *graph.value_info, *graph.output):
        if info.type.HasField("tensor_type") and (shape := shape_from_proto(info.type.tensor_type)) is not None:
            shapes[info.name] = shape
    return shapes


def with_fixed_dims(specs: list[InputSpec], fixed: dict[str, tuple[int, str]]) -> list[InputSpec]:
    """`specs` with each symbolic dimension named in `fixed` at its size there."""
    if not fixed:
        return specs
    return [
        replace(s, shape=tuple(fixed[d][0] if isinstance(d, str) and d in fixed else d for d in s.shape))
        if s.shape is not None else s
        for s in specs
    ]
