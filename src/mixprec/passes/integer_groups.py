"""Quantized groups of data movement written on integers, where their 16-bit form cannot load.

A Concat group (DequantizeLinear(s) -> Concat -> QuantizeLinear) only moves values and
requantizes them to the output's scale. In 16 bits it fails to load on onnxruntime's CPU
provider, where every converted model is checked and GPU providers fall back: its QDQ rules fuse
the group into a QLinearConcat that takes FP32 scales only (`fp32_groups` in
`policy/tables/quantized_groups.toml`), so the group would stay FP32. Quantization is
elementwise and Concat moves elements, so

    QuantizeLinear(Concat(DequantizeLinear(x_i, s_i, z_i)), s, z)
        == Concat(QuantizeLinear(DequantizeLinear(x_i, s_i, z_i), s, z))

element for element: each input is requantized to the output's scale by a DequantizeLinear ->
QuantizeLinear pair of its own, which stays FP32 (the planner reads :data:`REQUANTIZES`), so the
integers are bit for bit those of the FP32 group; an input whose scale and zero point already
are the output's needs none (the pair is the identity). The op then moves integers. The
runtime must run the op on the integer type (its profile says so: ONNX Runtime's CUDA Concat
does, TensorRT's does not).

Rules (`integer_groups` in the same table):
  1. The op is listed for the runtime, the runtime keeps its group FP32 in the target type,
     and its profile runs the op on the group's integer type.
  2. Every input is a DequantizeLinear output (of the op's graph) of the integer type that the
     single QuantizeLinear reader of the op's only output yields; that output is no graph output.
  3. The QuantizeLinear's scale and zero point are constant and per tensor (one value each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import constant_tensor, read_array
from mixprec.analysis.qdq import ON_INTEGERS, REQUANTIZES, role
from mixprec.dtypes import LowPrecision
from mixprec.graphs import FreshNames, all_graphs, model_names, normalize_domain
from mixprec.passes.fold_dequantize import drop_if_unused
from mixprec.policy.profiles import RuntimeProfile
from mixprec.policy.quantized_groups import QuantizedGroups, quantized_groups

__all__ = ["IntegerGroups", "write_groups_on_integers"]


@dataclass
class IntegerGroups:
    """What :func:`write_groups_on_integers` did.

    Attributes:
        nodes: The rewritten ops' names.
        requantized: How many of their inputs got a QuantizeLinear to the output's scale (the
            others already had it).
    """

    nodes: list[str] = field(default_factory=list)
    requantized: int = 0

    def note(self, runtime: str, target: LowPrecision) -> str:
        """One line for the report."""
        first = ", ".join(self.nodes[:5]) + (" ..." if len(self.nodes) > 5 else "")
        inputs = f"{self.requantized} input(s) requantized in FP32 to their group's output scale"
        return (
            f"wrote {len(self.nodes)} quantized data-movement group(s) on integers ({inputs}, the "
            f"others already on it): onnxruntime's CPU provider fuses their {target.value} form into "
            f"an integer kernel that takes FP32 scales only, and {runtime} runs them on integers; "
            f"the integers are those of the FP32 groups: {first}"
        )


@dataclass(frozen=True)
class _Group:
    """One group to rewrite: the op, the DequantizeLinear feeding each input, the QuantizeLinear
    after it and the integer type."""

    op: ir.Node
    dequantizers: tuple[ir.Node, ...]
    quantizer: ir.Node
    dtype: ir.DataType


def write_groups_on_integers(model: ir.Model, profile: RuntimeProfile, target: LowPrecision) -> IntegerGroups:
    """Rewrite the data-movement groups the runtime runs on integers (in place; see the module
    docstring for the rules)."""
    facts = quantized_groups(profile.name)
    done = IntegerGroups()
    if not facts.integer_groups or target.ir_dtype not in facts.group_scales:
        return done
    names: tuple[FreshNames, FreshNames] | None = None
    for graph in all_graphs(model):
        for node in list(graph):
            group = _group(node, facts, profile, target)
            if group is None:
                continue
            names = names or model_names(model)
            done.requantized += _rewrite(graph, group, names)
            done.nodes.append(node.name or node.op_type)
    return done


def _group(node: ir.Node, facts: QuantizedGroups, profile: RuntimeProfile, target: LowPrecision) -> _Group | None:
    """The group `node` heads, if it is one to rewrite."""
    key = (normalize_domain(node.domain), node.op_type)
    if key not in facts.integer_groups or facts.runs_group_in(target, *key) or len(node.outputs) != 1:
        return None
    out = node.outputs[0]
    uses = list(out.uses())
    if out.is_graph_output() or len(uses) != 1 or uses[0].idx != 0 or role(uses[0].node) != "quantize":
        return None
    quantizer = uses[0].node
    dtype = _quantized_type(quantizer)
    if dtype is None or _per_tensor(quantizer) is None:
        return None
    if not profile.runs_in(node.domain, node.op_type, f"tensor({dtype.name.lower()})"):
        return None
    dequantizers = []
    for value in node.inputs:
        producer = value.producer() if value is not None else None
        if producer is None or producer.graph is not node.graph or role(producer) != "dequantize":
            return None
        if _dequantized_type(producer) != dtype:
            return None
        dequantizers.append(producer)
    return _Group(node, tuple(dequantizers), quantizer, dtype)


def _quantized_type(node: ir.Node) -> ir.DataType | None:
    """The integer type a QuantizeLinear yields: its declared output type, its zero point's or
    its `output_dtype` (None: unknown or not an integer)."""
    dtype = node.outputs[0].dtype
    if dtype is None:
        attr = node.attributes.get("output_dtype")
        zero_point = node.inputs[2] if len(node.inputs) > 2 else None
        if zero_point is not None:
            tensor = constant_tensor(zero_point)
            dtype = tensor.dtype if tensor is not None else None
        elif attr is not None and attr.as_int():
            dtype = ir.DataType(attr.as_int())
        else:
            dtype = ir.DataType.UINT8  # the schema's default
    return dtype if dtype is not None and dtype.is_integer() else None


def _dequantized_type(node: ir.Node) -> ir.DataType | None:
    """The integer type a DequantizeLinear reads (its input's, its zero point's, or that of the
    QuantizeLinear producing its input)."""
    x = node.inputs[0] if node.inputs else None
    if x is None:
        return None
    if x.dtype is not None:
        return x.dtype if x.dtype.is_integer() else None
    zero_point = node.inputs[2] if len(node.inputs) > 2 else None
    tensor = constant_tensor(zero_point) if zero_point is not None else None
    if tensor is not None:
        return tensor.dtype if tensor.dtype.is_integer() else None
    producer = x.producer()
    return _quantized_type(producer) if producer is not None and role(producer) == "quantize" else None


def _per_tensor(node: ir.Node) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The scale and zero point of a Q/DQ node, when both are constant single values."""
    scale = node.inputs[1] if len(node.inputs) > 1 else None
    zero_point = node.inputs[2] if len(node.inputs) > 2 else None
    scale_tensor = constant_tensor(scale) if scale is not None else None
    zp_tensor = constant_tensor(zero_point) if zero_point is not None else None
    if scale_tensor is None or scale_tensor.size != 1:
        return None
    if zero_point is not None and (zp_tensor is None or zp_tensor.size != 1):
        return None
    return read_array(scale_tensor).reshape(()), None if zp_tensor is None else read_array(zp_tensor).reshape(())


def _same_quantization(dequantizer: ir.Node, quantizer: ir.Node) -> bool:
    """Whether a DequantizeLinear and a QuantizeLinear share their scale and zero point (values
    and types): the pair is then the identity."""
    a, b = _per_tensor(dequantizer), _per_tensor(quantizer)
    if a is None or b is None or a[0].dtype != b[0].dtype or a[0] != b[0]:
        return False
    zero_a, zero_b = (0 if z is None else int(z) for z in (a[1], b[1]))
    return zero_a == zero_b


def _unused_but_by(node: ir.Node, reader: ir.Node) -> bool:
    """Whether `reader` is the only reader of the node's output, which is no graph output."""
    out = node.outputs[0]
    return not out.is_graph_output() and all(use.node is reader for use in out.uses())


def _rewrite(graph: ir.Graph, group: _Group, names: tuple[FreshNames, FreshNames]) -> int:
    """Rewrite one group; how many inputs got a QuantizeLinear."""
    op, quantizer = group.op, group.quantizer
    base = op.name or op.op_type
    requantized: dict[ir.Node, ir.Value] = {}  # one requantization per DequantizeLinear
    integers: list[ir.Value] = []
    for dequantizer in group.dequantizers:
        if _same_quantization(dequantizer, quantizer):
            integers.append(dequantizer.inputs[0])
        elif dequantizer in requantized:
            integers.append(requantized[dequantizer])
        else:
            requantized[dequantizer] = _requantize(graph, op, dequantizer, quantizer, group.dtype, names, base)
            integers.append(requantized[dequantizer])
    result = ir.Value(name=None, type=ir.TensorType(group.dtype), shape=quantizer.outputs[0].shape)
    moved = ir.Node(
        op.domain, op.op_type, integers, list(op.attributes.values()), outputs=[result], name=op.name,
        version=op.version, doc_string=op.doc_string, metadata_props=dict(op.metadata_props),
    )
    graph.insert_before(op, moved)
    removed = [quantizer] + [d for d in dict.fromkeys(group.dequantizers) if _unused_but_by(d, op)]
    moved.meta[ON_INTEGERS] = tuple(n.name or n.op_type for n in removed)
    name = quantizer.outputs[0].name
    quantizer.outputs[0].replace_all_uses_with(result, replace_graph_outputs=True)
    graph.remove([op, quantizer], safe=True)
    result.name = name
    graph.remove(removed[1:], safe=True)
    for value in (v for node in removed for v in node.inputs[1:]):
        if value is not None:
            drop_if_unused(graph, value)
    return len(requantized)


def _requantize(
    graph: ir.Graph, op: ir.Node, dequantizer: ir.Node, quantizer: ir.Node, dtype: ir.DataType,
    names: tuple[FreshNames, FreshNames], base: str,
) -> ir.Value:
    """A QuantizeLinear of `dequantizer`'s values to `quantizer`'s scale, through a
    DequantizeLinear of its own (a copy of `dequantizer` where `op` is not its only reader),
    both marked to stay FP32; the integers it yields."""
    values, node_names = names
    source = dequantizer
    if not _unused_but_by(dequantizer, op):
        copy_name = node_names(f"{base}_{dequantizer.name or 'input'}_dequantized")
        copy_out = ir.Value(name=values(copy_name), type=dequantizer.outputs[0].type, shape=dequantizer.outputs[0].shape)
        source = ir.Node(
            dequantizer.domain, dequantizer.op_type, list(dequantizer.inputs), list(dequantizer.attributes.values()),
            outputs=[copy_out], name=copy_name, version=dequantizer.version,
        )
        graph.insert_before(op, source)
        source.meta[REQUANTIZES] = op.name or op.op_type
    name = node_names(f"{base}_{dequantizer.name or 'input'}_requantized")
    out = ir.Value(name=values(name), type=ir.TensorType(dtype))
    requantize = ir.Node(
        quantizer.domain, quantizer.op_type, [source.outputs[0], *quantizer.inputs[1:]],
        list(quantizer.attributes.values()), outputs=[out], name=name, version=quantizer.version,
    )
    requantize.meta[REQUANTIZES] = op.name or op.op_type
    graph.insert_before(op, requantize)
    if source is dequantizer:
        dequantizer.meta[REQUANTIZES] = op.name or op.op_type
    return out
