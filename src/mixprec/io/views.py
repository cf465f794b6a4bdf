"""Views of a model for the tools that read whole protobufs: the graph without its weights (for
shape inference, the version converter, a session that only proves the model loads), its
weight bytes, and whether it wants external data when saved."""

from __future__ import annotations

import math
from itertools import chain

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.errors import ModelLoadError
from mixprec.graphs import all_graphs, walk_nodes
from mixprec.io import value_types

__all__ = [
    "EXTERNAL_DATA_THRESHOLD", "typed_values", "uses_external_data",
    "wants_external_data", "weight_bytes", "weight_free_proto",
]

# Above this many bytes of weights the output is saved with external data.
EXTERNAL_DATA_THRESHOLD = 1 << 30


def weight_free_proto(model: ir.Model, max_inline_bytes: int = 1024) -> onnx.ModelProto:
    """Serialize `model` with large main-graph initializers turned into typed graph inputs
    (the in-memory counterpart of :func:`mixprec.io.onnx_file.graph_only_proto`; no weight is
    read)."""
    graph = model.graph
    removed: list[tuple[ir.Value, ir.TensorProtocol | None]] = []
    inlined: list[tuple[ir.Value, ir.TensorProtocol]] = []
    original_inputs = list(graph.inputs)
    input_set = set(original_inputs)
    try:
        for value in list(graph.initializers.values()):
            tensor = value.const_value
            if tensor is not None:
                if value.dtype is None:
                    value.dtype = tensor.dtype
                if value.shape is None:
                    value.shape = ir.Shape(tensor.shape)
            if tensor is None or tensor.nbytes > max_inline_bytes:
                removed.append((value, tensor))
                graph.initializers.pop(value.name)
                if value not in input_set:
                    graph.inputs.append(value)
            elif isinstance(tensor, ir.ExternalTensor):
                # A small tensor in an external file: inline its bytes (its file reference is
                # relative to the model's folder, which the copy does not have).
                try:
                    array = tensor.numpy()
                except OSError as e:
                    raise ModelLoadError(f"initializer {value.name!r}: its external data cannot be read: {e}") from e
                inlined.append((value, tensor))
                value.const_value = ir.Tensor(array, name=value.name)
        return value_types.to_proto(model)
    finally:
        for value, tensor in inlined:
            value.const_value = tensor
        for value, tensor in removed:
            value.const_value = tensor
            graph.initializers.add(value)
        graph.inputs.clear()
        graph.inputs.extend(original_inputs)


def tensor_size(tensor: ir.TensorProtocol) -> int:
    """`tensor.size`. onnx_ir builds a new Shape on every `shape` access of a tensor read from a
    protobuf (which `size` and `nbytes` go through): its dims are read directly."""
    if type(tensor) is ir.serde.TensorProtoTensor:
        return math.prod(tensor.raw.dims)
    return tensor.size


def float32_values(tensor: ir.TensorProtocol) -> np.ndarray:
    """A float32 tensor's values, flat. A tensor read from a protobuf with raw data is read from
    its bytes directly (onnx_ir's `numpy()` costs several times more per tensor, which tells on
    tens of thousands of small weights)."""
    if type(tensor) is ir.serde.TensorProtoTensor and tensor.dtype == ir.DataType.FLOAT:
        raw = tensor.raw
        if raw.HasField("raw_data") and len(raw.raw_data) == 4 * math.prod(raw.dims):
            return np.frombuffer(raw.raw_data, dtype="<f4")
    return np.asarray(tensor.numpy(), dtype=np.float32).reshape(-1)


def tensor_nbytes(tensor: ir.TensorProtocol) -> int:
    """`tensor.nbytes` (see `tensor_size`)."""
    if type(tensor) is ir.serde.TensorProtoTensor and tensor.dtype.bitwidth % 8 == 0:
        return math.prod(tensor.raw.dims) * tensor.dtype.itemsize
    return tensor.nbytes


def weight_bytes(model: ir.Model) -> int:
    """Total bytes of the weights: initializers and tensors held in Constant nodes (as some
    exporters store them), subgraphs and function bodies included."""
    total = 0
    graphs = all_graphs(model)
    for graph in graphs:
        total += sum(tensor_nbytes(v.const_value) for v in graph.initializers.values() if v.const_value is not None)
    bodies = [walk_nodes(function) for function in model.functions.values()]
    for node in chain(*graphs, *bodies):
        if node.op_type == "Constant" and (attr := node.attributes.get("value")) is not None:
            if attr.type is ir.AttributeType.TENSOR and not attr.is_ref():  # a caller's is counted there
                total += tensor_nbytes(attr.value)
    return total


def uses_external_data(model: ir.Model) -> bool:
    """Whether any initializer lives in an external data file."""
    return any(
        isinstance(v.const_value, ir.ExternalTensor)
        for graph in all_graphs(model)
        for v in graph.initializers.values()
    )


def wants_external_data(model: ir.Model, weights: int | None = None) -> bool:
    """The default for saving `model`: external data when it already uses external data or its
    weights exceed 1 GiB. `weights`: its `weight_bytes`, when already known."""
    if uses_external_data(model):
        return True
    return (weight_bytes(model) if weights is None else weights) > EXTERNAL_DATA_THRESHOLD


def typed_values(model: ir.Model) -> set[str]:
    """Names of the node outputs that carry a type or shape now (in a loaded model: those the
    file declared in its value_info). Initializers are left out: their tensors say their types
    (a loaded initializer is typed whether or not the file declared it)."""
    typed: set[str] = set()
    for graph in all_graphs(model):
        for node in graph:
            typed.update(v.name for v in node.outputs if v.name and (v.type is not None or v.shape is not None))
    return typed
