"""The weights-only plan: weights stored in the 16-bit type, every node computing in FP32 (for
runtimes without 16-bit compute for a model's heavy ops: half the file, FP32 speed)."""

from __future__ import annotations

from dataclasses import replace

import onnx_ir as ir

from mixprec.analysis.constants import constant_range
from mixprec.dtypes import is_fp32_tensor
from mixprec.plan.model import Category, Decision, Precision, PrecisionPlan, Storage

__all__ = ["weights_only"]

# Weights-only storage skips tensors smaller than this: a Cast node costs more than it saves.
_WEIGHTS_ONLY_MIN_ELEMENTS = 1024


def weights_only(plan: PrecisionPlan) -> PrecisionPlan:
    """The plan that stores weights in the 16-bit type and computes everything in FP32.

    Every FP32 initializer of at least 1,024 elements whose values the 16-bit type represents
    is stored in 16 bits and cast back to FP32 once where it is read (runtimes fold that Cast
    into a constant when loading): half the file, FP32 arithmetic.
    """
    keep = Decision(Precision.FP32, Category.WEIGHTS_ONLY, "weights-only conversion: computes in FP32")
    decisions = {
        node: keep if d.precision is Precision.LOW else d for node, d in plan.decisions.items()
    }
    storage: dict[ir.Value, Storage] = {}
    for graph in plan.graphs:
        for value in graph.initializers.values():
            tensor = value.const_value
            if not is_fp32_tensor(value) or value.is_graph_input() or tensor is None:
                continue
            if tensor.size < _WEIGHTS_ONLY_MIN_ELEMENTS or not value.uses():
                continue
            rng = constant_range(value, plan.target)
            storage[value] = Storage.LOW if rng is None or rng.representable else Storage.FP32
    return replace(
        plan,
        decisions=decisions,
        lowered_vars={node: frozenset() for node in plan.lowered_vars},
        storage=storage,
        saturated=set(),
    )
