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
from pathlib import Path

import onnx
import onnx.shape_inference
import onnx_ir as ir

from mixprec.analysis.constants import constant_node_tensor
from mixprec.graphs import all_graphs, has_subgraphs, walk_nodes
from mixprec.io import graph_only_proto

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


class _TypeCache:
    """Parsed inferred types, one entry per distinct TypeProto (most values share a few).

    Values of equal static shape share one frozen ir.Shape.
    """

    def __init__(self) -> None:
        self._types: dict[bytes, tuple[int, ir.Shape | None]] = {}
        self._shapes: dict[tuple, ir.Shape] = {}

    def get(self, type_proto: onnx.TypeProto) -> tuple[int, ir.Shape | None]:
        """The element type (0 when unknown) and shape (None when unknown) of a TypeProto."""
        key = type_proto.SerializeToString()
        parsed = self._types.get(key)
        if parsed is None:
            elem_type, dims = _dtype_and_dims(type_proto)
            shape = None
            if dims is not None:
                shape = self._shapes.get(dims)
                if shape is None:
                    shape = ir.Shape(dims, frozen=True)
                    self._shapes[dims] = shape
            parsed = (elem_type, shape)
            self._types[key] = parsed
        return parsed


def _dtype_and_dims(type_proto: onnx.TypeProto) -> tuple[int, tuple | None]:
    if not type_proto.HasField("tensor_type"):
        return 0, None
    tensor_type = type_proto.tensor_type
    if not tensor_type.HasField("shape"):
        return tensor_type.elem_type, None
    dims = tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
        for d in tensor_type.shape.dim
    )
    return tensor_type.elem_type, dims


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
        if not (node.attributes and has_subgraphs(node)):
            continue  # no graph attributes: nothing to read from the protobuf node
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


def _apply(graph: ir.Graph, proto: onnx.GraphProto, types: _TypeCache) -> int:
    """Copy inferred types onto the values of `graph` that lack a dtype or shape."""
    values: list[ir.Value] = [*graph.inputs, *graph.initializers.values()]
    for node in graph:
        values.extend(node.outputs)
    untyped = [v for v in values if v.dtype is None or v.shape is None]
    if not untyped:
        return 0
    inferred = {}
    for info in (*proto.input, *proto.value_info, *proto.output):
        inferred[info.name] = info.type
    count = 0
    for value in untyped:
        type_proto = inferred.get(value.name)
        if type_proto is None:
            continue
        elem_type, shape = types.get(type_proto)
        if value.dtype is None and elem_type:
            value.dtype = ir.DataType(elem_type)
            count += 1
        if value.shape is None and shape is not None:
            value.shape = shape
    return count


def infer_types(model: ir.Model, source: Path | None = None) -> TypeInfo:
    """Fill in element types and shapes of all values of `model` in place.

    Args:
        model: The model.
        source: The file `model` was loaded from, unchanged since: parsing it again is much
            faster than serializing the IR for large graphs.
    """
    for value in model.graph.initializers.values():
        if value.const_value is not None and value.dtype is None:
            value.dtype = value.const_value.dtype
    warning = None
    inferred = 0
    try:
        proto = graph_only_proto(source) if source is not None else _weight_free_proto(model)
        proto = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False)
    except Exception as e:  # noqa: BLE001 - inference is best effort; the planner copes
        warning = str(e).splitlines()[0] if str(e) else type(e).__name__
        logger.warning("type inference failed, unknown types stay unconverted: %s", warning)
    else:
        types = _TypeCache()
        for graph, graph_proto in _graph_pairs(model.graph, proto.graph):
            inferred += _apply(graph, graph_proto, types)
    main_nodes = walk_nodes(model.graph)
    _fill_constant_types(model, main_nodes)
    typed = infer_function_types(model)
    for function in typed:
        for node in walk_nodes(function.graph):
            if node.op_type == "Constant" and node.outputs and node.outputs[0].dtype is None:
                tensor = constant_node_tensor(node)
                if tensor is not None:
                    node.outputs[0].dtype = tensor.dtype
    unknown = sum(
        1 for node in main_nodes for out in node.outputs if out.dtype is None and out.uses()
    )
    return TypeInfo(inferred=inferred, unknown=unknown, warning=warning)


def _fill_constant_types(model: ir.Model, main_nodes: list[ir.Node]) -> None:
    """Constant nodes and subgraph initializers carry their type in their tensors.

    `main_nodes`: the nodes of the main graph and its subgraphs (`walk_nodes(model.graph)`).
    """
    for graph in all_graphs(model):
        for value in graph.initializers.values():
            if value.dtype is None and value.const_value is not None:
                value.dtype = value.const_value.dtype
                value.shape = ir.Shape(value.const_value.shape)
    for node in main_nodes:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.outputs:
            out = node.outputs[0]
            if out.dtype is None:
                tensor = constant_node_tensor(node)
                if tensor is not None:
                    out.dtype = tensor.dtype


def _call_sites(model: ir.Model) -> dict[tuple[str, str, str], list[ir.Node]]:
    calls: dict[tuple[str, str, str], list[ir.Node]] = {}
    nodes = list(walk_nodes(model.graph))
    for function in model.functions.values():
        nodes.extend(walk_nodes(function.graph))
    for node in nodes:
        key = (node.domain, node.op_type, node.overload)
        if key in model.functions:
            calls.setdefault(key, []).append(node)
    return calls


def _has_attribute_refs(function: ir.Function) -> bool:
    return any(
        isinstance(attr, ir.RefAttr) for node in walk_nodes(function.graph) for attr in node.attributes.values()
    )


def infer_function_types(model: ir.Model) -> list[ir.Function]:
    """Type the bodies of model-local functions from their call sites.

    A function is typed when every call site passes inputs of the same known element types and
    its body uses no attribute references; the body is then inferred like a graph whose inputs
    have those types. Returns the functions that were typed (the others keep unknown types, so
    the planner leaves their bodies unchanged).
    """
    typed: list[ir.Function] = []
    if not model.functions:
        return typed
    calls = _call_sites(model)
    other_functions = [ir.to_proto(f) for f in model.functions.values()]
    types = _TypeCache()
    for key, function in model.functions.items():
        sites = calls.get(key, [])
        if not sites or _has_attribute_refs(function):
            continue
        signatures = {
            tuple(v.dtype if v is not None else None for v in site.inputs) for site in sites
        }
        if len(signatures) != 1:
            continue
        dtypes = signatures.pop()
        if len(dtypes) != len(function.inputs) or any(d is None for d in dtypes):
            continue
        function_proto = ir.to_proto(function)
        graph = onnx.helper.make_graph(
            list(function_proto.node),
            f"{function.name}_body",
            [
                onnx.helper.make_tensor_value_info(name, int(dtype), None)  # type: ignore[arg-type]
                for name, dtype in zip(function_proto.input, dtypes)
            ],
            [onnx.helper.make_empty_tensor_value_info(name) for name in function_proto.output],
        )
        opsets = dict(model.opset_imports)
        opsets.update(function.opset_imports)
        proto = onnx.helper.make_model(
            graph,
            opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
            functions=other_functions,
            ir_version=max(model.ir_version, 8),
        )
        try:
            proto = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False)
        except Exception as e:  # noqa: BLE001 - a body we cannot type stays as it is
            logger.info("cannot type function %s: %s", function.name, e)
            continue
        for value, dtype in zip(function.inputs, dtypes):
            if value.dtype is None:
                value.dtype = dtype
        for graph, graph_proto in _graph_pairs(function.graph, proto.graph):
            _apply(graph, graph_proto, types)
        typed.append(function)
    return typed
