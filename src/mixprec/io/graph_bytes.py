"""Nodes and initializers of a graph as the protobuf bytes onnx_ir's serializer writes for
them, faster.

`onnx_ir.serde.serialize_graph_into` fills a `NodeProto` field by field through protobuf's
Python API (a few microseconds a field): on a graph of 100k nodes, writing the nodes costs
more than the rest of a save. Most nodes are names and small attributes, most initializers
references to external data; here their bytes are written directly in protobuf's wire format,
in the order protobuf's encoder writes fields (ascending field number), with the bytes of each
distinct attribute made once by onnx_ir's own serializer and reused. Anything else (metadata,
doc strings, reference attributes, device configurations, quantization annotations, unnamed
values, types other than a tensor's, string tensors, tensors read from the protobuf) goes
through onnx_ir. Either way the bytes are the ones onnx_ir writes (the tests compare them on
onnx's backend corpus).
"""

from __future__ import annotations

import functools
import os
import struct
import sys
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import onnx
import onnx_ir as ir

from mixprec.graphs import is_default_domain

__all__ = ["GraphFieldWriter", "GraphPieces", "Initializers", "keeps_type"]

# Field numbers (onnx.proto).
_NODE_INPUT, _NODE_OUTPUT, _NODE_NAME, _NODE_OP_TYPE, _NODE_ATTRIBUTE, _NODE_DOMAIN, _NODE_OVERLOAD = 1, 2, 3, 4, 5, 7, 8
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_VALUE_INFO, _GRAPH_ANNOTATION = 1, 5, 13, 14
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME, _TENSOR_RAW_DATA = 1, 2, 8, 9
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 13, 14
_VALUE_NAME, _VALUE_TYPE = 1, 2
# Value meta entry onnx_ir writes as a quantization annotation.
_QUANTIZATION_META = "quant_parameter_tensor_names"
# Attribute types whose bytes are keyed by value (others are written each time).
_KEYED_ATTRIBUTES = frozenset({ir.AttributeType.INT, ir.AttributeType.INTS, ir.AttributeType.STRING, ir.AttributeType.FLOAT})


def _varint(number: int) -> bytes:
    out = bytearray()
    while number > 0x7F:
        out.append(number & 0x7F | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def _tag(field: int) -> bytes:
    return _varint(field << 3 | 2)


_TAGS = {field: _tag(field) for field in range(1, 16)}
_NODE_TAG, _VALUE_INFO_TAG, _VALUE_NAME_TAG = _TAGS[_GRAPH_NODE], _TAGS[_GRAPH_VALUE_INFO], _TAGS[_VALUE_NAME]
_VARINT_TAGS = {field: _varint(field << 3) for field in range(1, 16)}
_EXTERNAL_LOCATION = _VARINT_TAGS[_TENSOR_DATA_LOCATION] + _varint(onnx.TensorProto.EXTERNAL)
# TypeProto.Tensor.shape.dim (TensorShapeProto field 1).
_DIM_TAG = _TAGS[1]
_SHORT_LENGTHS = [bytes((n,)) for n in range(128)]


def _field_bytes(data: bytes) -> bytes:
    """The value of a length-delimited field: length, bytes."""
    size = len(data)
    return (_SHORT_LENGTHS[size] if size < 128 else _varint(size)) + data


def _tagged(tag: bytes, data: bytes) -> bytes:
    """A length-delimited field: tag, length, bytes."""
    return tag + _field_bytes(data)


_PUBLIC_NAMES = {"_metadata": "meta", "_metadata_props": "metadata_props"}


def _stored(owner: object, slot: str) -> bool:
    """Whether an onnx_ir object holds something in a container it creates when first asked
    for (`_metadata`: `meta`, `_metadata_props`: `metadata_props`), without creating it (an
    onnx_ir without the slot is asked through the public name)."""
    try:
        return bool(getattr(owner, slot))
    except AttributeError:
        return bool(getattr(owner, _PUBLIC_NAMES[slot]))


def _quantization_annotated(value: ir.Value) -> bool:
    return _stored(value, "_metadata") and bool(value.meta.get(_QUANTIZATION_META))


@dataclass
class GraphPieces:
    """The serialized `node`, `value_info` and `quantization_annotation` fields of a run of
    nodes (each a list of whole tagged fields, in order)."""

    nodes: list[bytes] = field(default_factory=list)
    value_info: list[bytes] = field(default_factory=list)
    annotations: list[bytes] = field(default_factory=list)


@dataclass
class Initializers:
    """The serialized `initializer` and `value_info` fields of a graph's initializers."""

    tensors: list[bytes] = field(default_factory=list)
    value_info: list[bytes] = field(default_factory=list)


class GraphFieldWriter:
    """Writes nodes of one model, remembering the bytes of attributes and names it made
    (`model_ir_version`: as onnx_ir's serializer takes it).

    `declared`: the node outputs whose types and shapes are written (by name; None: all that
    have one); outputs of ops ONNX does not define at the model's default-domain `opset` keep
    theirs always (no ONNX inference can recover them).
    """

    def __init__(
        self, model_ir_version: int | None, declared: AbstractSet[str] | None = None, opset: int | None = None
    ) -> None:
        self._ir_version = model_ir_version
        self._declared = declared
        self._opset = opset
        self._attributes: dict[tuple, bytes] = {}
        self._strings: dict[str, bytes] = {}

    def write(self, nodes: Iterable[ir.Node]) -> GraphPieces:
        """The graph fields onnx_ir writes for `nodes`: each node, the value_info of its outputs
        that are no graph outputs, and their quantization annotations."""
        pieces = GraphPieces()
        for node in nodes:
            if not self._encode_fast(node, pieces):
                self._encode_with_onnx_ir(node, pieces)
        return pieces

    def _text(self, text: str) -> bytes:
        """The UTF-8 bytes of `text` with their length prefix."""
        encoded = self._strings.get(text)
        if encoded is None:
            data = text.encode()
            encoded = self._strings[text] = _field_bytes(data)
        return encoded

    def _encode_fast(self, node: ir.Node, pieces: GraphPieces) -> bool:
        """Append the node's fields; False (nothing appended) where it needs onnx_ir."""
        if _stored(node, "_metadata_props") or node.doc_string or getattr(node, "device_configurations", None):
            return False
        strings, text = self._strings, self._text
        parts: list[bytes] = []
        tag = _TAGS[_NODE_INPUT]
        for value in node.inputs:
            if value is None:
                parts.append(tag + b"\x00")
                continue
            name = value.name
            if name is None:
                return False
            parts.append(tag + (strings.get(name) or text(name)))
        outputs = node.outputs
        end = len(outputs)
        while end and not outputs[end - 1].name:
            end -= 1
        tag = _TAGS[_NODE_OUTPUT]
        infos: list[bytes] = []
        for index, value in enumerate(outputs):
            name = value.name
            if index < end:
                if name is None:
                    return False
                parts.append(tag + (strings.get(name) or text(name)))
            if value.is_graph_output():
                continue
            if _stored(value, "_metadata_props") or value.doc_string or _quantization_annotated(value):
                return False
            if name and (value.type is not None or value.shape is not None) and self.keeps_type(node, name):
                type_bytes = self._type_bytes(value)
                if type_bytes is None:
                    return False
                infos.append(_tagged(_VALUE_INFO_TAG, _VALUE_NAME_TAG + (strings.get(name) or text(name)) + type_bytes))
        if node.name:
            parts.append(_TAGS[_NODE_NAME] + _field_bytes(node.name.encode()))
        parts.append(_TAGS[_NODE_OP_TYPE] + (strings.get(node.op_type) or text(node.op_type)))
        attributes = node.attributes
        if attributes:
            tag = _TAGS[_NODE_ATTRIBUTE]
            for attr in getattr(attributes, "data", attributes).values():  # a UserDict's own dict
                data = self._attribute_bytes(attr)
                if data is None:
                    return False
                parts.append(tag + data)
        if node.domain:
            parts.append(_TAGS[_NODE_DOMAIN] + text(node.domain))
        if node.overload:
            parts.append(_TAGS[_NODE_OVERLOAD] + text(node.overload))
        pieces.nodes.append(_tagged(_NODE_TAG, b"".join(parts)))
        pieces.value_info.extend(infos)
        return True

    def initializers(self, graph: ir.Graph | ir.GraphView) -> Initializers | None:
        """The fields onnx_ir writes for the graph's initializers (each tensor, and the
        value_info of those that are no graph input); None where one has a quantization
        annotation (onnx_ir writes the graph's then)."""
        done = Initializers()
        inputs = {value.name for value in graph.inputs}
        text = self._text
        for value in graph.initializers.values():
            if _quantization_annotated(value):
                return None
            tensor = value.const_value
            described = _stored(value, "_metadata_props") or bool(value.doc_string)
            if value.name and value.name not in inputs and (value.type is not None or value.shape is not None or described):
                type_bytes = None if described else self._type_bytes(value)
                if type_bytes is None:
                    proto = onnx.ValueInfoProto()
                    ir.serde.serialize_value_into(proto, value)
                    done.value_info.append(_tagged(_VALUE_INFO_TAG, proto.SerializeToString()))
                else:
                    done.value_info.append(_tagged(_VALUE_INFO_TAG, _VALUE_NAME_TAG + text(value.name) + type_bytes))
            if tensor is None:
                continue  # onnx_ir skips it (with a warning)
            tensor.name = value.name  # as onnx_ir does
            data = _external_tensor_bytes(tensor) if type(tensor) is ir.ExternalTensor else _tensor_bytes(tensor)
            if data is None:
                proto = onnx.TensorProto()
                ir.serde.serialize_tensor_into(proto, tensor)
                data = proto.SerializeToString()
            done.tensors.append(_tagged(_TAGS[_GRAPH_INITIALIZER], data))
        return done

    def keeps_type(self, node: ir.Node, name: str) -> bool:
        """Whether the node's output called `name` gets its value_info."""
        return keeps_type(self._declared, node, name, self._opset)

    def _attribute_bytes(self, attr: Any) -> bytes | None:  # noqa: ANN401 - an onnx_ir attribute
        """The attribute's length-prefixed AttributeProto bytes; None for a reference."""
        if attr.is_ref():
            return None
        key = _attribute_key(attr)
        if key is not None:
            data = self._attributes.get(key)
            if data is not None:
                return data
        proto = onnx.AttributeProto()
        ir.serde.serialize_attribute_into(proto, attr)
        serialized = proto.SerializeToString()
        data = _field_bytes(serialized)
        if key is not None:
            self._attributes[key] = data
        return data

    def _type_bytes(self, value: ir.Value) -> bytes | None:
        """The tagged TypeProto field of a typed value's ValueInfoProto; None where onnx_ir
        should write it (no type, a type other than a tensor's, denotations, a negative
        dimension)."""
        kind, shape = value.type, value.shape
        if type(kind) is not ir.TensorType or kind.denotation:
            return None
        tensor = _VARINT_TAGS[1] + _varint(kind.dtype.value)
        if shape is not None:
            dims = []
            for index, dim in enumerate(shape.dims):
                if shape.get_denotation(index) is not None:
                    return None
                if isinstance(dim, int):
                    if dim < 0:
                        return None
                    dims.append(_DIM_TAG + _field_bytes(_VARINT_TAGS[1] + _varint(dim)))
                elif dim.value is None:
                    dims.append(_DIM_TAG + b"\x00")
                else:
                    dims.append(_DIM_TAG + _field_bytes(_TAGS[2] + self._text(str(dim.value))))
            tensor += _TAGS[2] + _field_bytes(b"".join(dims))
        return _TAGS[_VALUE_TYPE] + _field_bytes(_TAGS[1] + _field_bytes(tensor))

    def _encode_with_onnx_ir(self, node: ir.Node, pieces: GraphPieces) -> None:
        dropped = [
            (value, value.type, value.shape) for value in node.outputs
            if value.name and not value.is_graph_output() and not self.keeps_type(node, value.name)
        ]
        for value, _, _ in dropped:
            value.type, value.shape = None, None
        try:
            proto = onnx.GraphProto()
            ir.serde.serialize_graph_into(proto, ir.GraphView((), (), nodes=[node]), model_ir_version=self._ir_version)
        finally:
            for value, kind, shape in dropped:
                value.type, value.shape = kind, shape
        for message in proto.node:
            pieces.nodes.append(_tagged(_NODE_TAG, message.SerializeToString()))
        for message in proto.value_info:
            pieces.value_info.append(_tagged(_VALUE_INFO_TAG, message.SerializeToString()))
        for message in proto.quantization_annotation:
            pieces.annotations.append(_tagged(_TAGS[_GRAPH_ANNOTATION], message.SerializeToString()))


def keeps_type(declared: AbstractSet[str] | None, node: ir.Node, name: str, opset: int | None = None) -> bool:
    """Whether the output of `node` called `name` keeps its type and shape in the file: the
    input declared it (`declared`, by name; None: every value keeps its own), or the node is
    an op ONNX does not define at default-domain `opset` (None: at any opset): another
    domain's, or onnxruntime's own in the ONNX domain (SimplifiedLayerNormalization, or
    LayerNormalization below opset 17): no ONNX inference can recover it."""
    if declared is None or name in declared or not is_default_domain(node.domain):
        return True
    version = node.version if node.version is not None else opset
    return not _onnx_defines(node.op_type, version)


@functools.cache
def _onnx_defines(op_type: str, opset: int | None) -> bool:
    return onnx.defs.has(op_type) if opset is None else onnx.defs.has(op_type, opset)


def _tensor_bytes(tensor: Any) -> bytes | None:  # noqa: ANN401 - an onnx_ir tensor
    """A TensorProto's bytes for a tensor onnx_ir writes as raw data (an `ir.Tensor`, a lazy
    one), as it writes it; None for any other tensor, or one with a doc string or metadata."""
    if (
        type(tensor) not in (ir.Tensor, ir.LazyTensor) or tensor.dtype == ir.DataType.STRING
        or tensor.doc_string or _stored(tensor, "_metadata_props")
    ):
        return None
    head = _dims_and_type(tensor)
    if head is None:
        return None
    name = _TAGS[_TENSOR_NAME] + _field_bytes(tensor.name.encode()) if tensor.name else b""
    return head + name + _TAGS[_TENSOR_RAW_DATA] + _field_bytes(_raw_bytes(tensor))


def _raw_bytes(tensor: Any) -> bytes:  # noqa: ANN401 - an onnx_ir tensor
    """`tensor.tobytes()`; for a lazy tensor whose function gives its bytes itself (mixprec's
    16-bit copies) on a little-endian machine (ONNX's order), from that function, without
    the tensor object in between."""
    if type(tensor) is ir.LazyTensor and _LITTLE_ENDIAN:
        direct = getattr(tensor.raw, "tobytes", None)
        if direct is not None:
            return direct()
    return tensor.tobytes()


_LITTLE_ENDIAN = sys.byteorder == "little"


def _dims_and_type(tensor: Any) -> bytes | None:  # noqa: ANN401 - an onnx_ir tensor
    """The `dims` and `data_type` fields of a tensor; None for a dimension that is no
    non-negative integer."""
    dims = tensor.shape.dims
    if any(not isinstance(dim, int) or dim < 0 for dim in dims):
        return None
    return b"".join([_VARINT_TAGS[_TENSOR_DIMS] + _varint(dim) for dim in dims]) + _VARINT_TAGS[_TENSOR_DATA_TYPE] + _varint(tensor.dtype.value)


def _external_tensor_bytes(tensor: Any) -> bytes | None:  # noqa: ANN401 - an onnx_ir tensor
    """A TensorProto's bytes for a tensor in external data, as onnx_ir writes it; None for one
    with a doc string or metadata."""
    if tensor.doc_string or _stored(tensor, "_metadata_props"):
        return None
    head = _dims_and_type(tensor)
    if head is None:
        return None
    parts = [head]
    if tensor.name:
        parts.append(_TAGS[_TENSOR_NAME] + _field_bytes(tensor.name.encode()))
    for key, entry in (("location", os.fspath(tensor.location)), ("offset", tensor.offset), ("length", tensor.length)):
        if entry is not None:
            pair = _TAGS[1] + _field_bytes(key.encode()) + _TAGS[2] + _field_bytes(str(entry).encode())
            parts.append(_TAGS[_TENSOR_EXTERNAL_DATA] + _field_bytes(pair))
    parts.append(_EXTERNAL_LOCATION)
    return b"".join(parts)


def _attribute_key(attr: Any) -> tuple | None:  # noqa: ANN401 - an onnx_ir attribute
    """A key equal for attributes whose bytes are equal (None: not keyed)."""
    kind = attr.type
    if kind not in _KEYED_ATTRIBUTES:
        return None
    value = attr.value
    if kind == ir.AttributeType.FLOAT:
        value = struct.pack("<d", value)
    elif kind == ir.AttributeType.INTS:
        value = tuple(value)
    elif kind == ir.AttributeType.STRING and not isinstance(value, str):
        return None
    return (attr.name, kind, value, attr.doc_string)

