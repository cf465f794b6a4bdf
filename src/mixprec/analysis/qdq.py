"""Quantized (QDQ) models: which nodes quantize or dequantize, and which quantizers close a
float chain that may run in 16 bits.

Runtimes fuse a DequantizeLinear, the op it feeds and the QuantizeLinear after it into one
integer kernel (ONNX Runtime's QDQ transformers, TensorRT's explicit quantization), and only
when nothing stands between them; the planner keeps such pairs cast-free
(:mod:`mixprec.plan.qdq_pairs`) and the report counts what they hold
(:mod:`mixprec.report.quantized`).
"""

from __future__ import annotations

import onnx_ir as ir

from mixprec.analysis.constants import is_constant
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.policy.opfacts import op_facts
from mixprec.policy.quantized_groups import quantized_groups

__all__ = ["FOLDED", "folded_from", "has_qdq", "quantizes_float_chain", "role"]

# Value meta key of a constant folded from a DequantizeLinear: that node's name.
FOLDED = "mixprec.folded_dequantize"


def folded_from(value: ir.Value) -> str | None:
    """The DequantizeLinear `value` was folded from (its name; None: not folded). Reads the
    value's metadata without creating its store, as reading `meta` would (~0.5 kB on each of
    tens of thousands of weights)."""
    try:
        store = value._metadata  # noqa: SLF001 - `meta` creates the store
    except AttributeError:  # an onnx_ir that names it otherwise
        store = value.meta
    return None if store is None else store.get(FOLDED)


def role(node: ir.Node) -> str | None:
    """``"dequantize"``, ``"quantize"`` or None (the op's `quantization` fact)."""
    return op_facts(node.domain, node.op_type).quantization


def has_qdq(nodes: list[ir.Node]) -> bool:
    """Whether any node quantizes or dequantizes."""
    return any(role(node) is not None for node in nodes)


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
