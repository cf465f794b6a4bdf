"""Named conditions for `conditional` policy rules.

A condition looks at one node (its attributes, constant inputs and known shapes) and says
whether the node may convert, with the evidence for the report.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import onnx_ir as ir

from mixprec.graphs import reduction_axes


class ConditionResult(NamedTuple):
    """Outcome of a condition: whether the node may convert, and why."""

    ok: bool
    evidence: str


ConstantLookup = Callable[[ir.Value], "np.ndarray | None"]
Condition = Callable[[ir.Node, ConstantLookup, Mapping[str, Any]], ConditionResult]


def constant_exponent_at_most(
    node: ir.Node, constant: ConstantLookup, params: Mapping[str, Any]
) -> ConditionResult:
    """The exponent input is a constant with every |value| <= `max_abs`."""
    index = int(params.get("input", 1))
    limit = float(params["max_abs"])
    value = node.inputs[index] if index < len(node.inputs) else None
    array = constant(value) if value is not None else None
    if array is None:
        return ConditionResult(False, "exponent is not a constant")
    largest = float(np.max(np.abs(array.astype(np.float64)))) if array.size else 0.0
    if largest <= limit:
        return ConditionResult(True, f"constant exponent |{largest:g}| <= {limit:g}")
    return ConditionResult(False, f"constant exponent |{largest:g}| > {limit:g}")


def reduced_size_at_most(
    node: ir.Node, constant: ConstantLookup, params: Mapping[str, Any]
) -> ConditionResult:
    """The number of elements reduced into each output element is known and small (the
    reduced dimensions are static; the others, a dynamic batch say, may be anything)."""
    limit = int(params["max_elements"])
    data = node.inputs[0] if node.inputs else None
    shape = data.shape if data is not None else None
    if shape is None:
        return ConditionResult(False, "reduced size unknown")
    dims = list(shape.dims)
    axes = reduction_axes(node, constant)
    if axes is None:
        return ConditionResult(False, "reduction axes are not constant")
    if not axes:
        noop = node.attributes.get("noop_with_empty_axes")
        if noop is not None and noop.as_int() == 1:
            return ConditionResult(True, "no reduction")
        axes = list(range(len(dims)))
    reduced = [dims[a % len(dims)] for a in axes] if dims else []
    if not all(isinstance(d, int) for d in reduced):
        return ConditionResult(False, "reduced size unknown (a reduced dimension is not static)")
    size = math.prod(int(d) for d in reduced)
    if size <= limit:
        return ConditionResult(True, f"reduces {size} <= {limit} elements")
    return ConditionResult(False, f"reduces {size} > {limit} elements")


def attribute_in(
    node: ir.Node, constant: ConstantLookup, params: Mapping[str, Any]
) -> ConditionResult:
    """A string or int attribute (or its default) is one of `values`."""
    name = str(params["attribute"])
    allowed = list(params["values"])
    attr = node.attributes.get(name)
    if attr is None:
        value: Any = params.get("default")
    elif attr.type == ir.AttributeType.STRING:
        value = attr.as_string()
    elif attr.type == ir.AttributeType.INT:
        value = attr.as_int()
    else:
        return ConditionResult(False, f"attribute {name} has an unexpected type")
    if value in allowed:
        return ConditionResult(True, f"{name}={value!r}")
    return ConditionResult(False, f"{name}={value!r} (converts only with {name} in {allowed})")


def between_quantizers(
    node: ir.Node, constant: ConstantLookup, params: Mapping[str, Any]
) -> ConditionResult:
    """Every non-constant input is dequantized from integers of at most `max_bits` bits and
    every output is read only by quantizers to such integers: the op's inputs and result hold
    no more than those bits (a quantized group: DequantizeLinear -> op -> QuantizeLinear)."""
    from mixprec.policy.opfacts import op_facts  # noqa: PLC0415 - the policy table reads this module

    bits = int(params.get("max_bits", 8))

    def narrow(value: ir.Value | None) -> bool:
        dtype = value.dtype if value is not None else None
        return dtype is not None and dtype.is_integer() and dtype.bitwidth <= bits

    def role(other: ir.Node) -> str | None:
        return op_facts(other.domain, other.op_type).quantization

    def constant(value: ir.Value) -> bool:
        producer = value.producer()
        return value.const_value is not None or (producer is not None and producer.op_type == "Constant")

    producers = [v.producer() for v in node.inputs if v is not None and not constant(v)]  # None: a graph input
    if not producers or not all(p is not None and role(p) == "dequantize" and narrow(p.inputs[0]) for p in producers):
        return ConditionResult(False, f"not every input is dequantized from {bits}-bit integers")
    for out in node.outputs:
        uses = list(out.uses())
        quantized = all(role(u.node) == "quantize" and u.idx == 0 and narrow(u.node.outputs[0]) for u in uses)
        if out.is_graph_output() or not uses or not quantized:
            return ConditionResult(False, f"not every output is quantized to {bits}-bit integers")
    return ConditionResult(True, f"between {bits}-bit DequantizeLinear and QuantizeLinear: its result keeps {bits} bits")


def distinct_inputs(node: ir.Node, constant: ConstantLookup, params: Mapping[str, Any]) -> ConditionResult:
    """No value is read twice: the op is no square (Mul(x, x))."""
    inputs = [value for value in node.inputs if value is not None]
    if len(set(inputs)) == len(inputs):
        return ConditionResult(True, "distinct inputs")
    return ConditionResult(False, "multiplies a value by itself (a square)")


CONDITIONS: dict[str, Condition] = {
    "attribute_in": attribute_in,
    "between_quantizers": between_quantizers,
    "distinct_inputs": distinct_inputs,
    "constant_exponent_at_most": constant_exponent_at_most,
    "reduced_size_at_most": reduced_size_at_most,
}
