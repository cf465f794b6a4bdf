"""A dequantized activation read by ops whose precision is decided apart gets one
DequantizeLinear per kind of reader.

A quantizer writes one DequantizeLinear per quantized tensor, whatever reads it: in YOLO-style
CSP blocks a Split output feeds a Concat and the next Conv; in a transformer a LayerNorm output
feeds the quantized MatMul of the next layer and a float pooling (Mul -> ReduceSum). No Cast may
follow a DequantizeLinear, so a shared one takes the precision of its widest reader, and with it
every reader: where the runtime keeps the Concat group FP32 (`fp32_groups` in
`policy/tables/quantized_groups.toml`: onnxruntime's CPU provider fuses DQ -> Concat -> Q into a
QLinearConcat that takes FP32 scales), or where the float ops after it stay FP32, whole Conv and
MatMul groups stayed FP32 for a reader that only moves data or pools.

Here the readers are told apart by kind: ops of a group the runtime keeps FP32, other quantized
groups (every output goes to a QuantizeLinear), and the rest (float ops outside groups). Where a
DequantizeLinear has readers of more than one kind, the first kind keeps it and each other kind
reads a twin with the same inputs and attributes. All read the same integer tensor, scale and
zero point, so the model computes the same values, its integer tensors are untouched, and no
Cast comes near a Q/DQ node. (onnxruntime itself gives every reader its own DequantizeLinear
before fusing: EnsureUniqueDQForNodeUnit.)

Rules: the node dequantizes a value that is no constant (constants are folded or kept as they
are), and the runtime runs one-op groups in the target type (`group_scales`). Twins are named
`<node>` + :data:`SUFFIX` (then `_1`, `_2`, ...).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from mixprec.analysis.constants import is_constant
from mixprec.analysis.qdq import role
from mixprec.dtypes import LowPrecision
from mixprec.graphs import FreshNames, all_graphs, model_names, normalize_domain
from mixprec.policy.profiles import RuntimeProfile
from mixprec.policy.quantized_groups import quantized_groups

__all__ = ["SUFFIX", "SplitDequantizations", "split_shared_dequantizations"]

SUFFIX = "_unshared"


@dataclass
class SplitDequantizations:
    """What :func:`split_shared_dequantizations` did: the names of the DequantizeLinear nodes
    that got a twin."""

    nodes: list[str] = field(default_factory=list)

    def note(self, runtime: str) -> str:
        """One line for the report."""
        first = ", ".join(self.nodes[:5]) + (" ..." if len(self.nodes) > 5 else "")
        return (
            f"gave {len(self.nodes)} DequantizeLinear(s) read by more than one kind of op (a group "
            f"{runtime} keeps FP32, other quantized groups, float ops outside groups) a twin per "
            f"further kind (same integer input, scale and zero point; named '{SUFFIX}'), so each "
            f"kind takes its own precision: {first}"
        )


def split_shared_dequantizations(model: ir.Model, profile: RuntimeProfile, target: LowPrecision) -> SplitDequantizations:
    """Split the shared dequantizations (in place; see the module docstring for the rules)."""
    facts = quantized_groups(profile.name)
    done = SplitDequantizations()
    if target.ir_dtype not in facts.group_scales:
        return done
    names: tuple[FreshNames, FreshNames] | None = None  # read when first needed
    for graph in all_graphs(model):
        for node in list(graph):
            kinds = _readers_by_kind(node, facts.fp32_groups)
            if len(kinds) < 2:
                continue
            names = names or model_names(model)
            for others in kinds[1:]:
                _add_twin(graph, node, others, names)
            done.nodes.append(node.name or node.outputs[0].name or "DequantizeLinear")
    return done


def _readers_by_kind(node: ir.Node, fp32_groups: Collection[tuple[str, str]]) -> list[list[Any]]:
    """The uses of a dequantization of a non-constant value, by kind of reader (ops of a group the
    runtime keeps FP32, other quantized groups, the rest; kinds without readers left out); none
    for any other node."""
    if role(node) != "dequantize" or not node.inputs or not node.outputs or node.inputs[0] is None:
        return []
    if is_constant(node.inputs[0]) or node.outputs[0].is_graph_output():
        return []
    kinds: list[list[Any]] = [[], [], []]
    for use in node.outputs[0].uses():
        reader = use.node
        if (normalize_domain(reader.domain), reader.op_type) in fp32_groups:
            kinds[0].append(use)
        elif _quantized_group(reader):
            kinds[1].append(use)
        else:
            kinds[2].append(use)
    return [uses for uses in kinds if uses]


def _quantized_group(node: ir.Node) -> bool:
    """Whether the node quantizes (a DequantizeLinear -> QuantizeLinear requantization) or every
    used output of it goes only to quantizers (none is a graph output)."""
    if role(node) == "quantize":
        return True
    used = [out for out in node.outputs if out.uses() or out.is_graph_output()]
    return bool(used) and all(
        not out.is_graph_output() and all(role(use.node) == "quantize" for use in out.uses()) for out in used
    )


def _add_twin(graph: ir.Graph, node: ir.Node, others: list[Any], fresh: tuple[FreshNames, FreshNames]) -> None:
    """Insert a twin of `node` after it and let `others` read the twin's output."""
    values, names = fresh
    name = names((node.name or node.outputs[0].name or "DequantizeLinear") + SUFFIX)
    out = node.outputs[0]
    twin_out = ir.Value(name=values((out.name or name) + SUFFIX), type=out.type, shape=out.shape)
    twin = ir.Node(
        node.domain, node.op_type, list(node.inputs), list(node.attributes.values()),
        outputs=[twin_out], name=name, version=node.version,
    )
    graph.insert_after(node, twin)
    for use in others:
        use.node.replace_input_with(use.idx, twin_out)
