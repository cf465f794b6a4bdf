"""The candidates of the search (the default plan's 16-bit nodes) and their ranking."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import onnx_ir as ir

from mixprec.plan.model import Precision, PrecisionPlan
from mixprec.policy.opfacts import op_facts

_FLOAT_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})
_EXACT_DTYPES = frozenset(
    {
        ir.DataType.BOOL, ir.DataType.INT8, ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64,
        ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64,
    }
)  # fmt: skip
# A candidate whose own error exceeds this many times the median is an outlier (see `tune`).
_OUTLIER_FACTOR = 10.0


@dataclass(frozen=True)
class Candidate:
    """A node of the default plan computed in 16 bits, and how to probe it."""

    name: str
    op_type: str
    index: int  # position in all_nodes order
    lowered_inputs: frozenset[int]
    outputs: tuple[tuple[int, str], ...]  # (output index, "round" | "float" | "exact")
    # Its 16-bit outputs only copy values of its 16-bit inputs (Reshape, Transpose, Concat...),
    # each made by another candidate: it rounds nothing itself. What the probe measures there is
    # its producers' rounding, which keeping them FP32 removes, and the node then follows them.
    moves_values: bool = False


def candidates_of(plan: PrecisionPlan) -> list[Candidate]:
    """The default plan's 16-bit nodes and what the plan lowers in each."""
    names = plan.keys
    candidates = []
    for index, node in enumerate(plan.order):
        decision = plan.decisions.get(node)
        if decision is None or decision.precision is not Precision.LOW:
            continue
        lowered = frozenset(i for i in range(len(node.inputs)) if plan.input_is_lowered(node, i))
        outputs: list[tuple[int, str]] = []
        for i, value in enumerate(node.outputs):
            if value is None or not value.name:
                continue
            if plan.output_is_lowered(node, i):
                outputs.append((i, "round"))
            elif isinstance(value.type, ir.TensorType) and value.dtype in _FLOAT_DTYPES:
                outputs.append((i, "float"))
            elif isinstance(value.type, ir.TensorType) and value.dtype in _EXACT_DTYPES:
                outputs.append((i, "exact"))
        moves = op_facts(node.domain, node.op_type).value_preserving and bool(lowered) and all(
            (producer := node.inputs[i].producer()) is not None  # type: ignore[union-attr]
            and (made := plan.decisions.get(producer)) is not None and made.precision is Precision.LOW
            for i in lowered
        )
        candidates.append(Candidate(names[node], node.op_type, index, lowered, tuple(outputs), moves))
    return candidates


def outlier_count(errors: Sequence[float | None]) -> int:
    """How many of the (ranked) errors stand out: above `_OUTLIER_FACTOR` times their median.

    Ordinary rounding gives every node an own error of the order of the type's epsilon; nodes
    far above that are where the tolerance is lost. 0 when there is no clear outlier.
    """
    known = [e for e in errors if e is not None]
    positive = sorted(e for e in known if 0 < e < math.inf)
    if not positive:
        return 0
    median = positive[len(positive) // 2]
    count = sum(1 for e in known if e > _OUTLIER_FACTOR * median)
    return count if 0 < count < len(errors) else 0


def evaluation_bound(candidates: int, guess: int) -> int:
    """Most evaluations the search runs: k=0, k=n, bisection, one more for a first split at
    the outliers (`guess`) instead of the middle."""
    if candidates == 0:
        return 1
    steps = math.ceil(math.log2(candidates)) if candidates > 1 else 0
    return 2 + steps + (1 if guess else 0)


def own_error(candidate: Candidate, probed: float | None) -> float | None:
    """The candidate's own error: the probe's, except 0 for a node that only moves values made
    by other candidates (their rounding is theirs to remove)."""
    return 0.0 if candidate.moves_values and probed is not None else probed


def rank_error(error: float | None) -> float:
    """Sort key: larger errors first, unknown last."""
    return 1.0 if error is None else -error
