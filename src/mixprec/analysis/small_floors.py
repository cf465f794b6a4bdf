"""Values whose small magnitudes a logarithm or divisor reads: a floor below the 16-bit normal range.

`log(clip(mel, 1e-7))`, `log(x + 1e-10)`, `y / max(norm, 1e-12)`: a constant floor in front of a
singular input (the op fact `singular_inputs`: a logarithm's argument, a divisor) says that the
floored value is meaningful down to that constant. Where the floor lies below the target type's
smallest normal number (6.1e-5 in float16; never in bfloat16), a 16-bit copy of those values is
subnormal or zero: a few bits of them are left, and the logarithm or quotient turns that into
large absolute errors (the quiet frames of a log-mel spectrogram). The node that computes the
floored value (the first one behind the floors, the ops that only move values and the products
with constants) therefore computes in FP32; what follows it then follows FP32 inputs. A power
reads its base singularly only under a negative exponent (`clamp(x, 1e-6) ** 3`, GeM pooling,
is no logarithm).

Floors are the constant operands of the ops whose interval rule (op fact `interval`) bounds the
output below by them: Clip's lower bound, Max's operands, Add's operands (an epsilon added to a
value that is not negative).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import is_constant, small_constant_array
from mixprec.dtypes import LowPrecision
from mixprec.graphs import all_nodes, format_op_name, is_default_domain
from mixprec.policy.opfacts import all_op_facts, op_facts

__all__ = ["reads_singularly", "small_floors"]

# Interval rule -> the inputs that floor the output where they are constant (None: any input).
_FLOOR_INPUTS: dict[str, tuple[int, ...] | None] = {"clip": (1,), "max": None, "add": None}
# Interval rule -> the attribute that floors the output where set (Clip's bounds before opset 11).
_FLOOR_ATTRIBUTES: dict[str, str] = {"clip": "min"}
# Producers looked through (floors, movers, scalings by constants) before the node that
# computes the value.
_MAX_HOPS = 8
# Interval rules of elementwise products (a value times or over constants is looked through;
# a matrix product with constant weights computes the value).
_PRODUCTS = frozenset({"mul", "div"})
# Ops whose singular input is singular only under a negative exponent: the exponent's input.
_EXPONENTS: dict[str, int] = {"Pow": 1}


def reads_singularly(node: ir.Node, index: int) -> bool:
    """Whether zero at input `index` of `node` is a singularity (the op fact `singular_inputs`),
    for a power only where its exponent may be negative (`x ** 2` is not singular at 0,
    `x ** -0.5` is)."""
    fact = op_facts(node.domain, node.op_type)
    if not fact.singular(index):
        return False
    position = _EXPONENTS.get(node.op_type) if is_default_domain(node.domain) else None
    if position is None or position >= len(node.inputs) or node.inputs[position] is None:
        return True
    exponent = small_constant_array(node.inputs[position])  # type: ignore[arg-type]
    return exponent is None or bool((np.asarray(exponent) < 0).any())


def small_floors(model: ir.Model, target: LowPrecision) -> dict[ir.Node, str]:
    """Nodes that compute a value floored below the target's normal range before a singular
    input -> the evidence (see the module docstring)."""
    tiny = target.limits.tiny
    found: dict[ir.Node, str] = {}
    singular_ops = _singular_ops()
    for reader in all_nodes(model):
        if reader.op_type not in singular_ops or not is_default_domain(reader.domain):
            continue
        for index, value in enumerate(reader.inputs):
            if value is None or not reads_singularly(reader, index):
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


@functools.cache
def _singular_ops() -> frozenset[str]:
    """The default-domain ops with a singular input (op fact `singular_inputs`)."""
    return frozenset(op for (domain, op), fact in all_op_facts().items() if is_default_domain(domain) and fact.singular_inputs)


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
        data = _data_input(producer)
        if data is None:
            break  # computed from constants alone, or from several values
        index, source = data
        if fact.interval in _FLOOR_INPUTS:
            found = _floor_of(producer, fact.interval, index)
            if found is not None and (floor is None or found < floor):
                floor, guard = found, producer
        elif not (fact.value_preserving or (fact.interval in _PRODUCTS and fact.scales(index))):
            break  # it computes the value
        value = source  # floored, moved, or multiplied by constants elementwise: small values stay small
    else:
        return None
    return (producer, floor, guard) if floor is not None and guard is not None else None


def _data_input(node: ir.Node) -> tuple[int, ir.Value] | None:
    """(index, value) of the node's one input that is not a constant and not known to hold
    something other than floats; None where it has none or several (a Where's condition, a
    Concat's constant part are not data)."""
    found = [
        (index, v) for index, v in enumerate(node.inputs)
        if v is not None and (v.dtype is None or v.dtype.is_floating_point()) and not is_constant(v)
    ]
    return found[0] if len(found) == 1 else None


def _floor_of(node: ir.Node, interval: str, data: int) -> float | None:
    """The smallest positive constant that floors the output of a floor op whose one data input
    is input `data`; None where no constant does."""
    positions = _FLOOR_INPUTS[interval]
    floors = [
        float(array.min())
        for index, v in enumerate(node.inputs)
        if v is not None and index != data and (positions is None or index in positions)
        and (array := small_constant_array(v)) is not None and array.size and np.isfinite(array).all() and array.min() > 0
    ]
    attribute = _FLOOR_ATTRIBUTES.get(interval)
    if attribute is not None and attribute in node.attributes:  # Clip before opset 11
        low = node.attributes[attribute].as_float()
        if low > 0:
            floors.append(low)
    return min(floors) if floors else None
