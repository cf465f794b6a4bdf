"""How a model uses its inputs, for the data generated to run it: token ids index an
embedding, so they are drawn over its rows, not only 0 and 1."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.analysis.constants import constant_tensor
from mixprec.policy.opfacts import Carrier, op_facts
from mixprec.runtime.data import InputSpec

__all__ = ["with_index_limits"]


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
