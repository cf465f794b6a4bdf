"""Writing a model's protobuf a batch of nodes at a time.

`onnx_ir`'s `save` builds the whole `ModelProto` before writing it: on a graph of 100k nodes
that copy costs as much memory as the IR itself. Here the main graph's nodes are serialized
in batches (:mod:`mixprec.io.graph_bytes`), and the file is assembled from the pieces: the
bytes are the ones `ir.save` writes, field for field, in the same order (the tests compare
them).

The other pieces come from onnx_ir's serializer and rely on one property of protobuf's
encoders: a message's fields are written in ascending field number, so the bytes of one field
of a serialized message are a slice of it (`_field_slices` finds the slice boundaries with
`ByteSize` and checks each slice's tag).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import onnx
import onnx_ir as ir
from onnx import serialization

from mixprec.graphs import default_domain_version
from mixprec.io.graph_bytes import GraphFieldWriter, keeps_type

__all__ = ["ProtobufTooLarge", "save"]

# Nodes serialized at a time: large enough that the per-batch overhead is nothing, small
# enough that a batch's protobuf is a few MB.
_NODES_PER_BATCH = 4096
# A single protobuf message cannot exceed this.
_PROTOBUF_LIMIT = (2 << 30) - 1

# Field numbers (onnx.proto).
_MODEL_GRAPH = 7
_GRAPH_DOC_STRING, _GRAPH_OUTPUT, _GRAPH_VALUE_INFO, _GRAPH_ANNOTATION, _GRAPH_METADATA = 10, 12, 13, 14, 16
# ModelProto's fields numbered below `graph`: written before it.
_MODEL_HEAD = ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string")
_LENGTH_DELIMITED = 2


class ProtobufTooLarge(ValueError):
    """The model does not fit in one protobuf message (2 GB)."""


def save(model: ir.Model, path: str | os.PathLike, declared: AbstractSet[str] | None = None) -> None:
    """Write `model` to `path`: the same bytes as `ir.save(model, path)` without external data
    (tensors that are external stay external), with the types and shapes of the main graph's
    intermediate values where :class:`GraphFieldWriter` keeps them (`declared`).

    Raises:
        ProtobufTooLarge: The model does not fit in one protobuf message.
    """
    if not _streamable(model, path):
        with _main_types_of(model, declared):
            ir.save(model, path)
        return
    graph = model.graph
    writer = GraphFieldWriter(model.ir_version, declared, default_domain_version(model.opset_imports))
    initializers = writer.initializers(graph)
    # Everything but the main graph's nodes, outputs and (where written above) initializers,
    # through onnx_ir's serializer.
    shell = onnx.ModelProto()
    ir.serde.serialize_model_into(shell, _WithGraph(model, _view(graph, initialized=initializers is None)))
    outputs = onnx.GraphProto()
    ir.serde.serialize_graph_into(outputs, ir.GraphView((), graph.outputs, nodes=()))
    graph_proto = shell.graph
    shell_parts = _field_slices(graph_proto, (_GRAPH_DOC_STRING, _GRAPH_VALUE_INFO, _GRAPH_ANNOTATION, _GRAPH_METADATA))
    output_parts = _field_slices(outputs, (_GRAPH_OUTPUT, _GRAPH_ANNOTATION))
    nodes: list[bytes | memoryview] = []
    value_info: list[bytes | memoryview] = [shell_parts[_GRAPH_VALUE_INFO]]
    annotations: list[bytes | memoryview] = [shell_parts[_GRAPH_ANNOTATION]]
    if initializers is not None:
        value_info += initializers.value_info
    for batch in _batches(graph):
        pieces = writer.write(batch)
        nodes.append(b"".join(pieces.nodes))
        value_info.append(b"".join(pieces.value_info))
        annotations.append(b"".join(pieces.annotations))
    annotations.append(output_parts[_GRAPH_ANNOTATION])
    graph_pieces = [
        *nodes, shell_parts[0], *(initializers.tensors if initializers is not None else ()),
        shell_parts[_GRAPH_DOC_STRING], output_parts[_GRAPH_OUTPUT], *value_info, *annotations,
        shell_parts[_GRAPH_METADATA],
    ]
    graph_size = sum(len(piece) for piece in graph_pieces)

    shell.ClearField("graph")
    head = onnx.ModelProto()
    for name in _MODEL_HEAD:
        if shell.HasField(name):
            setattr(head, name, getattr(shell, name))
            shell.ClearField(name)
    head_bytes, tail_bytes = head.SerializeToString(), shell.SerializeToString()
    graph_header = _tag(_MODEL_GRAPH) + _varint(graph_size)
    if len(head_bytes) + len(graph_header) + graph_size + len(tail_bytes) > _PROTOBUF_LIMIT:
        raise ProtobufTooLarge("the model exceeds protobuf's 2 GB limit for one .onnx file")
    with open(path, "wb") as f:
        f.write(head_bytes)
        f.write(graph_header)
        f.writelines(graph_pieces)
        f.write(tail_bytes)


@contextlib.contextmanager
def _main_types_of(model: ir.Model, declared: AbstractSet[str] | None) -> Iterator[None]:
    """Leave out the types and shapes of the main graph's node outputs that the writer would
    leave out (:func:`mixprec.io.graph_bytes.keeps_type`), for onnx_ir's own serializer."""
    opset = default_domain_version(model.opset_imports)
    dropped = [
        (value, value.type, value.shape) for node in model.graph for value in node.outputs
        if value.name and not value.is_graph_output() and not keeps_type(declared, node, value.name, opset)
    ]
    for value, _, _ in dropped:
        value.type, value.shape = None, None
    try:
        yield
    finally:
        for value, kind, shape in dropped:
            value.type, value.shape = kind, shape


def _streamable(model: ir.Model, path: str | os.PathLike) -> bool:
    """Whether the pieces make the file `ir.save` writes: binary protobuf (onnx infers the
    format from the extension; unknown extensions are protobuf), and no function value types
    that IR versions below 10 keep in the main graph."""
    format_ = serialization.registry.get_format_from_file_extension(os.path.splitext(path)[1])
    return format_ in (None, "protobuf") and (model.ir_version >= 10 or not model.functions)


class _WithGraph:
    """`model` seen with another graph (what onnx_ir's model serializer reads of it)."""

    def __init__(self, model: ir.Model, graph: ir.GraphView) -> None:
        self._model = model
        self.graph = graph

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - whatever the model has
        return getattr(self._model, name)


def _view(graph: ir.Graph, *, initialized: bool) -> ir.GraphView:
    """`graph`'s name, documentation, inputs, metadata and (`initialized`) initializers, without
    nodes and outputs."""
    return ir.GraphView(
        graph.inputs, (), nodes=(), initializers=tuple(graph.initializers.values()) if initialized else (),
        doc_string=graph.doc_string, opset_imports=graph.opset_imports, name=graph.name,
        metadata_props=graph.metadata_props,
    )


def _batches(graph: ir.Graph) -> Iterator[list[ir.Node]]:
    batch: list[ir.Node] = []
    for node in graph:
        batch.append(node)
        if len(batch) == _NODES_PER_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _field_slices(message: Any, fields: Sequence[int]) -> dict[int, memoryview]:  # noqa: ANN401 - a protobuf message
    """The serialized bytes of `message`, sliced at the start of each of `fields` (ascending
    field numbers): slice 0 holds the fields numbered below `fields[0]`, slice `f` the fields
    from `f` up to the next one listed. Clears `message` as it goes."""
    whole = memoryview(message.SerializeToString())
    numbers = sorted(field.number for field in message.DESCRIPTOR.fields)
    by_number = {field.number: field.name for field in message.DESCRIPTOR.fields}
    slices: dict[int, memoryview] = {}
    end, upper = len(whole), max(numbers) + 1
    for number in sorted(fields, reverse=True):
        for cleared in numbers:
            if number <= cleared < upper:
                message.ClearField(by_number[cleared])
        start = message.ByteSize()
        piece = whole[start:end]
        if piece and not number <= _first_field(piece) < upper:
            raise AssertionError(f"serialized fields out of order at field {number}")
        slices[number] = piece
        end, upper = start, number
    slices[0] = whole[:end]
    return slices


def _first_field(piece: memoryview) -> int:
    """The field number of the first tag in `piece`."""
    tag, shift = 0, 0
    for byte in piece:
        tag |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
    return tag >> 3


def _tag(field: int) -> bytes:
    return _varint(field << 3 | _LENGTH_DELIMITED)


def _varint(number: int) -> bytes:
    out = bytearray()
    while True:
        low = number & 0x7F
        number >>= 7
        if number:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)
