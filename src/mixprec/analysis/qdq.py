"""Quantized (QDQ) models: which nodes quantize or dequantize, and which quantizers close a
float chain that may run in 16 bits.

Runtimes fuse a DequantizeLinear, the op it feeds and the QuantizeLinear after it into one
integer kernel (ONNX Runtime's QDQ transformers, TensorRT's explicit quantization), and only
when nothing stands between them; the planner keeps such pairs cast-free
(:mod:`mixprec.plan.qdq_pairs`) and the report counts what they hold
(:mod:`mixprec.report.quantized`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import onnx_ir as ir

from mixprec.analysis.constants import is_constant
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.policy.opfacts import op_facts
from mixprec.policy.quantized_groups import quantized_groups

__all__ = [
    "FOLDED", "ON_INTEGERS", "REQUANTIZES", "folded_from", "has_qdq", "on_integers", "quantizes_float_chain",
    "requantizes", "role",
]

# Value meta key of a constant folded from a DequantizeLinear: that node's name.
FOLDED = "mixprec.folded_dequantize"
# Node meta key of an op whose quantized group was written on integers: the QuantizeLinear it
# replaced and the DequantizeLinear(s) it no longer needs, by name.
ON_INTEGERS = "mixprec.on_integers"
# Node meta key of a DequantizeLinear / QuantizeLinear that requantizes an input of such an op to
# its output's scale, in FP32: the op's name.
REQUANTIZES = "mixprec.requantizes"


def _metadata(item: ir.Value | ir.Node) -> Mapping[str, Any] | None:
    """The metadata store of a value or node if it has one, without creating it as reading
    `meta` would (~0.5 kB on each of tens of thousands of weights)."""
    try:
        return item._metadata  # noqa: SLF001 - `meta` creates the store
    except AttributeError:  # an onnx_ir that names it otherwise
        return item.meta


def folded_from(value: ir.Value) -> str | None:
    """The DequantizeLinear `value` was folded from (its name; None: not folded)."""
    store = _metadata(value)
    return None if store is None else store.get(FOLDED)


def requantizes(node: ir.Node) -> str | None:
    """The op whose input the node requantizes in FP32 (None: not such a node)."""
    store = _metadata(node)
    return None if store is None else store.get(REQUANTIZES)


def on_integers(node: ir.Node) -> tuple[str, ...] | None:
    """The Q/DQ nodes an op written on integers replaced (None: not such an op)."""
    store = _metadata(node)
    return None if store is None else store.get(ON_INTEGERS)


def role(node: ir.Node) -> str | None:
    """``"dequantize"``, ``"quantize"`` or None (the op's `quantization` fact)."""
    return op_facts(node.domain, node.op_type).quantization


def has_qdq(nodes: Iterable[ir.Node]) -> bool:
    """Whether any node quantizes or dequantizes (each op kind looked up once)."""
    kinds = {(node.domain, node.op_type) for node in nodes}
    return any(op_facts(domain, op_type).quantization is not None for domain, op_type in kinds)


def quantizes_at_run_time(node: ir.Node) -> bool:
    """Whether the node quantizes a float input to integers as it runs (dynamic quantization,
    `quantizes_input` in the op facts): a 16-bit rounding before it can move a value to the next
    integer step."""
    rule = op_facts(node.domain, node.op_type).quantizes_input
    if rule == "int8_accuracy":
        level = node.attributes.get("accuracy_level")
        return level is not None and level.type == ir.AttributeType.INT and level.value == 4
    return rule == "always"


def quantizes_float_chain(node: ir.Node, runtime: str | None = None, target: LowPrecision | None = None) -> bool:
    """Whether the node quantizes a value computed by ops that may run in `target`: a chain
    after the DequantizeLinear(s), or a single-op group (DequantizeLinear -> MaxPool / Relu ->
    QuantizeLinear) where `runtime` runs such a group in `target` (`group_scales`, `fp32_groups`
    in `policy/tables/quantized_groups.toml`). ONNX Runtime's CPU provider fuses a single-op group
    into an integer kernel that takes FP32 scales only (QLinearConcat); graph inputs stay as
    they are."""
    if role(node) != "quantize" or not node.inputs:
        return False
    x = node.inputs[0]
    producer = x.producer() if x is not None else None
    if producer is None:
        return False
    floats = [v for v in producer.inputs if v is not None and is_fp32_tensor(v) and not is_constant(v)]
    chain = not floats or not all((p := v.producer()) is not None and role(p) == "dequantize" for v in floats)
    return chain or (
        target is not None and quantized_groups(runtime).runs_group_in(target, producer.domain, producer.op_type)
    )
