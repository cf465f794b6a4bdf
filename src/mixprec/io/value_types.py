"""Value types the IR cannot hold: a map, or a sequence of maps (what ZipMap writes, the usual
output of a classifier exported from scikit-learn, LightGBM or XGBoost).

Nothing here converts such values; they only have to come back out as they went in. When a
protobuf becomes IR, those types are taken out of it (the values stay, untyped) and the main
graph's are remembered on the model (:data:`SET_ASIDE`, by value name); saving writes them back
(:func:`restore`), as does every protobuf made from the IR for a tool (:func:`to_proto`,
:func:`save`): ONNX's inference crashes on an untyped graph input.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import onnx
import onnx_ir as ir

from mixprec.graphs import graph_protos

__all__ = [
    "SET_ASIDE", "carry", "deserialize", "load", "readable", "restore", "restore_file", "save", "set_aside", "to_proto",
]

# The key, in `ir.Model.meta`, of the main graph's set-aside types: value name -> TypeProto bytes.
SET_ASIDE = "mixprec.set_aside_types"


def readable(type_proto: onnx.TypeProto) -> bool:
    """Whether the IR can hold the type (tensors, sparse tensors, and sequences or optionals
    of those)."""
    kind = type_proto.WhichOneof("value")
    if kind == "map_type":
        return False
    if kind == "sequence_type":
        return readable(type_proto.sequence_type.elem_type)
    if kind == "optional_type":
        return readable(type_proto.optional_type.elem_type)
    return True


def _value_infos(graph: onnx.GraphProto) -> Iterator[onnx.ValueInfoProto]:
    yield from graph.input
    yield from graph.output
    yield from graph.value_info


def _unreadable(proto: onnx.ModelProto) -> Iterator[tuple[bool, onnx.ValueInfoProto]]:
    """(in the main graph?, value info) of every value whose type the IR cannot hold."""
    for index, graph in enumerate(graph_protos(proto.graph)):
        for info in _value_infos(graph):
            if info.type.WhichOneof("value") not in ("tensor_type", None) and not readable(info.type):
                yield index == 0, info
    for function in proto.functions:
        subgraphs = [
            graph
            for node in function.node for attr in node.attribute
            for body in ((attr.g,) if attr.type == onnx.AttributeProto.GRAPH else attr.graphs)
            for graph in graph_protos(body)
        ]
        infos = [*function.value_info, *(info for graph in subgraphs for info in _value_infos(graph))]
        yield from ((False, info) for info in infos if not readable(info.type))


def set_aside(proto: onnx.ModelProto) -> dict[str, bytes]:
    """Take the types the IR cannot hold out of `proto` (in place); the main graph's, by value
    name (subgraphs' and functions' types are optional and stay out)."""
    found: dict[str, bytes] = {}
    for main, info in list(_unreadable(proto)):
        if main:
            found.setdefault(info.name, info.type.SerializeToString())
        info.ClearField("type")
    return found


def deserialize(proto: onnx.ModelProto, *, owned: bool = True) -> ir.Model:
    """The IR of `proto`, with the types it cannot hold set aside on the model (`owned`:
    `proto` may be changed; else it is copied first where it must be). Only a model the IR
    refuses is searched for them."""
    try:
        return ir.serde.deserialize_model(proto)
    except Exception:
        if next(_unreadable(proto), None) is None:
            raise
    if not owned:
        copy = onnx.ModelProto()
        copy.CopyFrom(proto)
        proto = copy
    found = set_aside(proto)
    model = ir.serde.deserialize_model(proto)
    if found:
        model.meta[SET_ASIDE] = found
    return model


def load(path: str | os.PathLike) -> ir.Model:
    """`ir.load(path)`, with the types the IR cannot hold set aside (see :func:`deserialize`)."""
    model = deserialize(onnx.load(os.fspath(path), load_external_data=False))
    ir.external_data.set_base_dir(model.graph, os.path.dirname(os.path.abspath(path)))
    return model


def carry(source: ir.Model, result: ir.Model) -> ir.Model:
    """Give `result` (made from `source`: a clone, an upgrade) the types set aside on `source`."""
    found = source.meta.get(SET_ASIDE)
    if found:
        result.meta[SET_ASIDE] = found
    return result


def restore(proto: onnx.GraphProto, types: Mapping[str, bytes]) -> bool:
    """Write set-aside types back onto the untyped inputs, outputs and value infos of a main
    graph; whether any was."""
    restored = False
    for info in _value_infos(proto):
        found = types.get(info.name)
        if found is not None and not info.HasField("type"):
            info.type.ParseFromString(found)
            restored = True
    return restored


def restore_file(path: str | os.PathLike, types: Mapping[str, bytes]) -> None:
    """Write set-aside types back into a saved model file (its external data stays where it
    is)."""
    proto = onnx.load(os.fspath(path), load_external_data=False)
    if restore(proto.graph, types):
        onnx.save(proto, os.fspath(path))


def to_proto(model: ir.Model) -> onnx.ModelProto:
    """`ir.to_proto(model)`, with the set-aside types written back."""
    proto = ir.serde.serialize_model(model)
    found = model.meta.get(SET_ASIDE)
    if found:
        restore(proto.graph, found)
    return proto


def save(model: ir.Model, path: str | os.PathLike, **options: Any) -> None:  # noqa: ANN401
    """`ir.save(model, path, **options)`, with the set-aside types written back."""
    ir.save(model, path, **options)
    found = model.meta.get(SET_ASIDE)
    if found:
        restore_file(path, found)
