"""A dequantized activation read both by an op group the runtime keeps FP32 and by other ops gets
one DequantizeLinear per side.

A quantizer writes one DequantizeLinear per quantized tensor, whatever reads it: in YOLO-style
CSP blocks a Split output feeds a Concat and the next Conv. Where the runtime keeps the Concat
group FP32 (`fp32_groups` in `policy/tables/quantized_groups.toml`: onnxruntime's CPU provider
fuses DQ -> Concat -> Q into a QLinearConcat that takes FP32 scales), the shared
DequantizeLinear has to stay FP32 (no Cast may follow it), and with it every op it feeds: whole
Conv groups stay FP32 for a Concat that only moves data.

Here such a DequantizeLinear gets a twin with the same inputs and attributes that the other
readers read; the original keeps the readers the runtime runs in FP32. Both read the same
integer tensor, scale and zero point, so the model computes the same values, its integer tensors
are untouched, and no Cast comes near a Q/DQ node. (onnxruntime itself gives every reader its own
DequantizeLinear before fusing: EnsureUniqueDQForNodeUnit.)

Rules: the node dequantizes a value that is no constant (constants are folded or kept as they
are), the runtime runs one-op groups in the target type (`group_scales`), and among its readers
some are ops in `fp32_groups` and some are not. The twin is named `<node>` + :data:`SUFFIX`.
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
            f"gave {len(self.nodes)} DequantizeLinear(s) read by a group {runtime} keeps FP32 and by "
            f"other ops a twin for the other ops (same integer input, scale and zero point; named "
            f"'{SUFFIX}'), so those can convert: {first}"
        )


def split_shared_dequantizations(model: ir.Model, profile: RuntimeProfile, target: LowPrecision) -> SplitDequantizations:
    """Split the shared dequantizations (in place; see the module docstring for the rules)."""
    facts = quantized_groups(profile.name)
    done = SplitDequantizations()
    if not facts.fp32_groups or target.ir_dtype not in facts.group_scales:
        return done
    fresh = _ModelNames(model)
    for graph in all_graphs(model):
        for node in list(graph):
            others = _other_readers(node, facts.fp32_groups)
            if others is None:
                continue
            _add_twin(graph, node, others, fresh)
            done.nodes.append(node.name or node.outputs[0].name or "DequantizeLinear")
    return done


class _ModelNames:
    """The value and node names of the whole model, read once when first needed."""

    def __init__(self, model: ir.Model) -> None:
        self._model = model
        self._names: tuple[FreshNames, FreshNames] | None = None

    def get(self) -> tuple[FreshNames, FreshNames]:
        """The fresh value names and node names."""
        if self._names is None:
            self._names = model_names(self._model)
        return self._names


def _other_readers(node: ir.Node, fp32_groups: Collection[tuple[str, str]]) -> list[Any] | None:
    """The readers of a shared dequantization that are not in an FP32 group, or None when `node`
    is not one to split (not a dequantization of a non-constant value read by both kinds)."""
    if role(node) != "dequantize" or not node.inputs or not node.outputs or node.inputs[0] is None:
        return None
    if is_constant(node.inputs[0]) or node.outputs[0].is_graph_output():
        return None
    uses = list(node.outputs[0].uses())
    others = [u for u in uses if (normalize_domain(u.node.domain), u.node.op_type) not in fp32_groups]
    if not others or len(others) == len(uses):
        return None
    return others


def _add_twin(graph: ir.Graph, node: ir.Node, others: list[Any], fresh: _ModelNames) -> None:
    """Insert a twin of `node` after it and let `others` read the twin's output."""
    values, names = fresh.get()
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
