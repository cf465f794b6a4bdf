"""How large a normalization's output can be, from its group size and its constant scale and bias.

A normalization divides each element's distance from its group's mean (LayerNorm, InstanceNorm,
GroupNorm), or the element itself (RMSNorm), by the group's standard deviation or root mean
square. Over a group of N elements no element lies more than sqrt(N) of those from the mean
(its squared distance is at most the sum of all of them), so before the op's scale and bias
|y| <= sqrt(N), and the output is at most sqrt(N) * max|scale| + max|bias|. A group whose size the
shapes do not tell counts as 2^31 elements (sqrt: 46,341), more than one tensor holds in
practice. Which elements form a group is the op fact `normalizes` (policy/tables/opfacts.toml).
The bound follows the output through what moves, scales or shifts it by constants next (an
exported GroupNorm's affine: Reshape, Mul by gamma, Add of beta). It holds for exact
arithmetic: a kernel that takes the variance as E[x^2] - E[x]^2 in one pass can exceed it where
the mean dwarfs the spread.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx_ir as ir

from mixprec.analysis.value_bounds import attr_int
from mixprec.policy.opfacts import OpFacts, op_facts

__all__ = ["MAX_GROUP_ELEMENTS", "affine_bound", "group_size", "output_bound"]

MAX_GROUP_ELEMENTS = 1 << 31


def _dims(node: ir.Node) -> list[int | None] | None:
    """The dimensions of the normalized input, None for each one that is not static (None
    where its rank is unknown)."""
    x = node.inputs[0] if node.inputs else None
    shape = x.shape if x is not None else None
    if shape is None:
        return None
    return [int(d) if isinstance(d, int) else None for d in shape.dims]


def _product(dims: list[int | None]) -> int | None:
    """The product of static dimensions (None where one is not static)."""
    return None if any(d is None for d in dims) else math.prod(dims)  # type: ignore[arg-type]


def _from_axis(node: ir.Node, dims: list[int | None]) -> int | None:
    """The axes from `axis` (default -1) to the last (LayerNormalization, RMSNormalization)."""
    axis = attr_int(node, "axis", -1)
    axis = axis + len(dims) if axis < 0 else axis
    return _product(dims[axis:]) if 0 <= axis < len(dims) else None


def _spatial(node: ir.Node, dims: list[int | None]) -> int | None:
    """The axes after batch and channel (InstanceNormalization)."""
    return _product(dims[2:]) if len(dims) > 2 else None


def _groups(node: ir.Node, dims: list[int | None]) -> int | None:
    """A group of channels with the spatial axes (GroupNormalization)."""
    groups = attr_int(node, "num_groups", 0)
    size = _product(dims[1:]) if len(dims) > 1 else None
    if size is None or groups <= 0 or dims[1] % groups:  # type: ignore[operator]
        return None
    return size // groups


_GROUPS: dict[str, Callable[[ir.Node, list[int | None]], int | None]] = {
    "from_axis": _from_axis, "spatial": _spatial, "groups": _groups,
}


def group_size(node: ir.Node, facts: OpFacts) -> int:
    """The number of elements normalized together (MAX_GROUP_ELEMENTS where the shapes do not
    tell)."""
    dims = _dims(node)
    found = _GROUPS[facts.normalizes](node, dims) if dims is not None and facts.normalizes else None
    return found if found else MAX_GROUP_ELEMENTS


def output_bound(node: ir.Node, facts: OpFacts, absmax: Callable[[ir.Value], float | None]) -> float | None:
    """The largest magnitude output 0 of a normalization can hold; None for other ops and where
    a scale or bias is not a constant (`absmax`: a constant's largest magnitude, else None)."""
    if facts.normalizes is None:
        return None
    bound = math.sqrt(group_size(node, facts))
    added = 0.0
    for index, value in enumerate(node.inputs[1:], start=1):
        if value is None or not (facts.scales(index) or facts.adds(index)):
            continue
        largest = absmax(value)
        if largest is None:
            return None
        if facts.scales(index):
            bound *= largest
        else:
            added += largest
    return bound + added


def affine_bound(value: ir.Value, bound: float, absmax: Callable[[ir.Value], float | None]) -> float:
    """The largest magnitude along the chain of sole readers of `value` (at most `bound` in
    magnitude) that move it (value-preserving ops: a float constant beside it counts too),
    multiply it by a constant or add a constant to it. The chain ends at a value read more than
    once, at a product or sum with a value that is not constant, and at a matrix product or
    convolution (16-bit compute like any other); at any other op that reads a float constant
    (a Div, a Pow) nothing is known: infinity."""
    worst = bound
    while not value.is_graph_output():
        uses = value.uses()
        if len(uses) != 1:
            break
        node, index = uses[0].node, uses[0].idx
        fact = op_facts(node.domain, node.op_type)
        others = [v for i, v in enumerate(node.inputs) if i != index and v is not None and v.dtype == ir.DataType.FLOAT]
        magnitudes = [absmax(v) for v in others]
        known = all(m is not None for m in magnitudes)
        if fact.value_preserving or fact.interval in _ELEMENTWISE:
            if not known:
                break
            if fact.interval == "mul":
                bound *= math.prod(magnitudes)  # type: ignore[arg-type]
            elif fact.interval in ("add", "sub"):
                bound += sum(magnitudes)  # type: ignore[arg-type]
            else:
                bound = max([bound, *magnitudes])  # type: ignore[list-item]
        elif fact.flops is not None or not any(m is not None for m in magnitudes):
            break
        else:
            return math.inf
        if not node.outputs:
            break
        value = node.outputs[0]
        worst = max(worst, bound)
    return worst


# The interval rules (op facts) of the elementwise ops the chain goes through.
_ELEMENTWISE = frozenset({"mul", "add", "sub"})
