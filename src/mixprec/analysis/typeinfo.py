"""Full type information: fill in the element type (and shape) of every value.

Runs ONNX shape inference once on a weight-free copy of the model (never a >2 GB protobuf)
and copies the inferred types back onto the IR values, main graph and subgraphs alike.
Values whose type inference cannot tell keep `dtype is None`; the planner leaves the nodes
that touch them at their original types.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import onnx
import onnx.shape_inference
import onnx_ir as ir

logger = logging.getLogger(__name__)

# Initializers larger than this are dropped from the copy handed to shape inference.
_INLINE_INITIALIZER_BYTES = 1024


@dataclass(frozen=True)
class TypeInfo:
    """Outcome of type inference.

    Attributes:
        inferred: Number of values whose type was filled in.
        unknown: Number of node outputs whose element type is still unknown.
        warning: Shape inference's error message when it could not run, else None.
    """

    inferred: int
    unknown: int
    warning: str | None


def _weight_free_proto(model: ir.Model) -> onnx.ModelProto:
    """Serialize `model` with large main-graph initializers turned into typed graph inputs."""
    graph = model.graph
    removed: list[tuple[ir.Value, ir.TensorProtocol | None]] = []
    original_inputs = list(graph.inputs)
    input_set = set(original_inputs)
    for value in list(graph.initializers.values()):
        tensor = value.const_value
        if tensor is not None:
            if value.dtype is None:
                value.dtype = tensor.dtype
            if value.shape is None:
                value.shape = ir.Shape(tensor.shape)
        if tensor is None or tensor.nbytes > _INLINE_INITIALIZER_BYTES:
            removed.append((value, tensor))
            graph.initializers.pop(value.name)
            if value not in input_set:
                graph.inputs.append(value)
    try:
        return ir.serde.serialize_model(model)
    finally:
        for value, tensor in removed:
            value.const_value = tensor
            graph.initializers.add(value)
        graph.inputs.clear()
        graph.inputs.extend(original_inputs)


def _dtype_and_shape(type_proto: onnx.TypeProto) -> tuple[ir.DataType | None, ir.Shape | None]:
    if not type_proto.HasField("tensor_type"):
        return None, None
    tensor_type = type_proto.tensor_type
    dtype = ir.DataType(tensor_type.elem_type) if tensor_type.elem_type else None
    shape = None
    if tensor_type.HasField("shape"):
        dims: list[int | str | None] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(dim.dim_value)
            elif dim.HasField("dim_param"):
                dims.append(dim.dim_param)
            else:
                dims.append(None)
        shape = ir.Shape(dims)
    return dtype, shape


def _graph_pairs(
    graph: ir.Graph, proto: onnx.GraphProto
) -> Iterator[tuple[ir.Graph, onnx.GraphProto]]:
    """Pair each IR graph with its inferred protobuf graph, subgraphs included."""
    yield graph, proto
    if len(proto.node) != len(graph):
        return
    for node, node_proto in zip(graph, proto.node):
        if node.op_type != node_proto.op_type:
            return
        graph_attrs = {a.name: a for a in node_proto.attribute if a.type in (5, 10)}
        for attr in node.attributes.values():
            attr_proto = graph_attrs.get(attr.name)
            if attr_proto is None:
                continue
            if attr.type == ir.AttributeType.GRAPH:
                yield from _graph_pairs(attr.as_graph(), attr_proto.g)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub, sub_proto in zip(attr.as_graphs(), attr_proto.graphs):
                    yield from _graph_pairs(sub, sub_proto)


def _apply(graph: ir.Graph, proto: onnx.GraphProto) -> int:
    inferred = {}
    for info in (*proto.input, *proto.value_info, *proto.output):
        inferred[info.name] = info.type
    count = 0
    values: list[ir.Value] = [*graph.inputs, *graph.initializers.values()]
    for node in graph:
        values.extend(node.outputs)
    for value in values:
        type_proto = inferred.get(value.name)
        if type_proto is None:
            continue
        dtype, shape = _dtype_and_shape(type_proto)
        if value.dtype is None and dtype is not None:
            value.dtype = dtype
            count += 1
        if value.shape is None and shape is not None:
            value.shape = shape
    return count


def infer_types(model: ir.Model) -> TypeInfo:
    """Fill in element types and shapes of all values of `model` in place."""
    for value in model.graph.initializers.values():
        if value.const_value is not None and value.dtype is None:
            value.dtype = value.const_value.dtype
    warning = None
    inferred = 0
    try:
        proto = _weight_free_proto(model)
        proto = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False)
    except Exception as e:  # noqa: BLE001 - inference is best effort; the planner copes
        warning = str(e).splitlines()[0] if str(e) else type(e).__name__
        logger.warning("type inference failed, unknown types stay unconverted: %s", warning)
    else:
        for graph, graph_proto in _graph_pairs(model.graph, proto.graph):
            inferred += _apply(graph, graph_proto)
    _fill_constant_types(model)
    unknown = sum(
        1
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        for out in node.outputs
        if out.dtype is None and out.uses()
    )
    return TypeInfo(inferred=inferred, unknown=unknown, warning=warning)


def _fill_constant_types(model: ir.Model) -> None:
    """Constant nodes and subgraph initializers carry their type in their tensors."""
    for graph in model.graphs():
        for value in graph.initializers.values():
            if value.dtype is None and value.const_value is not None:
                value.dtype = value.const_value.dtype
                value.shape = ir.Shape(value.const_value.shape)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.outputs:
            out = node.outputs[0]
            attr = node.attributes.get("value")
            if out.dtype is None and attr is not None and attr.type == ir.AttributeType.TENSOR:
                out.dtype = attr.as_tensor().dtype
