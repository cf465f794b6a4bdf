"""Values whose small magnitudes a logarithm or divisor reads: a floor below the 16-bit normal range.

`log(clip(mel, 1e-7))`, `log(x + 1e-10)`, `y / max(norm, 1e-12)`: a constant floor in front of a
singular input (the op fact `singular_inputs`: a logarithm's argument, a divisor) says that the
floored value is meaningful down to that constant. Where the floor lies below the target type's
smallest normal number (6.1e-5 in float16; never in bfloat16), a 16-bit copy of those values is
subnormal or zero: a few bits of them are left, and the logarithm or quotient turns that into
large absolute errors (the quiet frames of a log-mel spectrogram). The node that computes the
floored value (the first one behind the floors and the ops that only move values) therefore
computes in FP32; what follows it then follows FP32 inputs.

Floors are the constant operands of the ops whose interval rule (op fact `interval`) bounds the
output below by them: Clip's lower bound, Max's operands, Add's operands (an epsilon added to a
value that is not negative).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import is_constant, small_constant_array
from mixprec.dtypes import LowPrecision
from mixprec.graphs import all_nodes, format_op_name, is_default_domain
from mixprec.policy.opfacts import op_facts

__all__ = ["small_floors"]

# Interval rule -> the inputs that floor the output where they are constant (None: any input).
_FLOOR_INPUTS: dict[str, tuple[int, ...] | None] = {"clip": (1,), "max": None, "add": None}
# Producers looked through (floors, movers) before the node that computes the value.
_MAX_HOPS = 8


def small_floors(model: ir.Model, target: LowPrecision) -> dict[ir.Node, str]:
    """Nodes that compute a value floored below the target's normal range before a singular
    input -> the evidence (see the module docstring)."""
    tiny = target.limits.tiny
    found: dict[ir.Node, str] = {}
    for reader in all_nodes(model):
        if not is_default_domain(reader.domain):
            continue
        fact = op_facts(reader.domain, reader.op_type)
        if not fact.singular_inputs:
            continue
        for index, value in enumerate(reader.inputs):
            if value is None or not fact.singular(index):
                continue
            source = _floored_source(value)
            if source is None:
                continue
            producer, floor, guard = source
            if 0.0 < floor < tiny and producer not in found:
                found[producer] = (
                    f"its output reaches {format_op_name(reader.domain, reader.op_type)} {reader.name!r} "
                    f"floored at {floor:.3g} by {guard.op_type} {guard.name!r}: values that small are below "
                    f"the {target.value} normal range ({tiny:.2g}) and keep few bits there"
                )
    return found


def _floored_source(value: ir.Value) -> tuple[ir.Node, float, ir.Node] | None:
    """The node computing `value` behind its floors and movers, the smallest floor met and the
    node that applies it; None where no floor is met or no node computes the value."""
    floor: float | None = None
    guard: ir.Node | None = None
    for _ in range(_MAX_HOPS):
        producer = value.producer()
        if producer is None or not is_default_domain(producer.domain):
            return None
        fact = op_facts(producer.domain, producer.op_type)
        floored = _floor_of(producer, fact.interval)
        if floored is not None:
            found, data = floored
            if found is not None and (floor is None or found < floor):
                floor, guard = found, producer
            value = data
        elif fact.value_preserving and producer.inputs and producer.inputs[0] is not None:
            value = producer.inputs[0]
        else:
            return (producer, floor, guard) if floor is not None and guard is not None else None
    return None


def _floor_of(node: ir.Node, interval: str | None) -> tuple[float | None, ir.Value] | None:
    """(the smallest positive constant that floors the node's output, or None; its one
    non-constant input) for a floor op with one non-constant input; None for other nodes."""
    if interval not in _FLOOR_INPUTS:
        return None
    positions = _FLOOR_INPUTS[interval]
    data = [v for v in node.inputs if v is not None and not is_constant(v)]
    if len(data) != 1:
        return None
    floors = [
        float(array.min())
        for index, v in enumerate(node.inputs)
        if v is not None and v is not data[0] and (positions is None or index in positions)
        and (array := small_constant_array(v)) is not None and array.size and np.isfinite(array).all() and array.min() > 0
    ]
    if node.op_type == "Clip" and "min" in node.attributes:  # before opset 11: an attribute
        low = node.attributes["min"].as_float()
        if low > 0:
            floors.append(low)
    return (min(floors) if floors else None), data[0]

