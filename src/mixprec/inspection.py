"""Inspect any ONNX model: which precision each node computes in, its casts, its weights."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx_ir as ir


from mixprec.graphs import all_graphs, walk_nodes
from mixprec.analysis.typeinfo import infer_types
from mixprec.io import load_model

_FLOAT_NAMES = {
    ir.DataType.FLOAT: "fp32",
    ir.DataType.FLOAT16: "fp16",
    ir.DataType.BFLOAT16: "bf16",
    ir.DataType.DOUBLE: "fp64",
}


@dataclass
class ModelSummary:
    """Precision facts of a model."""

    path: str
    nodes: int
    nodes_by_precision: dict[str, int]
    ops_by_precision: dict[str, dict[str, int]]
    casts: dict[str, int]
    weights_by_dtype: dict[str, int]
    io: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)

    def format_text(self) -> str:
        """A readable summary."""
        lines = [f"{self.path}: {self.nodes} nodes"]
        for precision, count in sorted(self.nodes_by_precision.items(), key=lambda x: -x[1]):
            ops = self.ops_by_precision.get(precision, {})
            top = ", ".join(f"{op} {n}" for op, n in sorted(ops.items(), key=lambda x: -x[1])[:12])
            lines.append(f"  {precision:<6} {count:>7} nodes  {top}")
        if self.casts:
            casts = ", ".join(f"{k} {v}" for k, v in sorted(self.casts.items()))
            lines.append(f"  casts: {casts}")
        weights = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(self.weights_by_dtype.items()))
        lines.append(f"  weights: {weights or 'none'}")
        lines.extend(f"  {entry}" for entry in self.io)
        return "\n".join(lines)


def _node_precision(node: ir.Node) -> str:
    kinds = {
        _FLOAT_NAMES[v.dtype]
        for v in (*node.inputs, *node.outputs)
        if v is not None and v.dtype in _FLOAT_NAMES and isinstance(v.type, ir.TensorType)
    }
    if not kinds:
        return "other"
    if len(kinds) == 1:
        return kinds.pop()
    return "mixed"


def summarize_model(source: str | os.PathLike | ir.Model) -> ModelSummary:
    """Summarise the precision of every node (a node computes in the float type it touches)."""
    model, path = load_model(source)
    infer_types(model)
    count, by_precision, ops, casts = _tally_nodes(model)
    return ModelSummary(
        path=str(path) if path else "(in memory)",
        nodes=count,
        nodes_by_precision=dict(by_precision),
        ops_by_precision={k: dict(v) for k, v in ops.items()},
        casts=dict(casts),
        weights_by_dtype=dict(_weight_bytes(model)),
        io=[_io_line("input ", v) for v in model.graph.inputs]
        + [_io_line("output", v) for v in model.graph.outputs],
    )


def _tally_nodes(
    model: ir.Model,
) -> tuple[int, Counter[str], dict[str, Counter[str]], Counter[str]]:
    """Over all nodes, subgraphs included: how many there are, the non-Cast nodes per
    precision, their op types per precision, and the Casts per conversion."""
    by_precision: Counter[str] = Counter()
    ops: dict[str, Counter[str]] = {}
    casts: Counter[str] = Counter()
    count = 0
    for node in walk_nodes(model.graph):
        count += 1
        if node.op_type == "Cast" and node.inputs and node.inputs[0] is not None:
            casts[_cast_kind(node.inputs[0], node.outputs[0])] += 1
            continue
        precision = _node_precision(node)
        by_precision[precision] += 1
        ops.setdefault(precision, Counter())[node.op_type] += 1
    return count, by_precision, ops, casts


def _cast_kind(source: ir.Value, result: ir.Value) -> str:
    """A Cast of `source` to `result` as "source->destination" float type names ("other" for
    non-float types)."""
    src = _FLOAT_NAMES.get(source.dtype or ir.DataType.UNDEFINED, "other")
    dst = _FLOAT_NAMES.get(result.dtype or ir.DataType.UNDEFINED, "other")
    return f"{src}->{dst}"


def _weight_bytes(model: ir.Model) -> Counter[str]:
    """Bytes of the initializers of all graphs, per data type."""
    weights: Counter[str] = Counter()
    for graph in all_graphs(model):
        for value in graph.initializers.values():
            if value.const_value is not None:
                key = _FLOAT_NAMES.get(value.const_value.dtype, value.const_value.dtype.name.lower())
                weights[key] += value.const_value.nbytes
    return weights


def _io_line(kind: str, value: ir.Value) -> str:
    """A model input or output (`kind`) with its name, data type and shape."""
    dtype = value.dtype.name.lower() if value.dtype else "?"
    return f"{kind} {value.name}: {dtype} {value.shape}"
