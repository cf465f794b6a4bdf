"""A candidate's outputs against the FP32 reference: per-output metrics and the tolerance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mixprec.tolerance import Tolerance
from mixprec.tune.results import OutputMetrics


def output_metrics(
    reference: Sequence[Mapping[str, np.ndarray]],
    candidate: Sequence[Mapping[str, np.ndarray]],
    tolerance: Tolerance | None,
) -> tuple[OutputMetrics, ...]:
    """Compare a candidate's outputs with the reference (per batch) and judge each output."""
    from mixprec.validate import compare  # noqa: PLC0415

    merged = None
    for ref, cand in zip(reference, candidate):
        comparison = compare.compare_outputs(ref, cand)
        merged = comparison if merged is None else compare.merge(merged, comparison)
    agreement = topk_agreement(reference, candidate)
    checked = set(tolerance.outputs) if tolerance and tolerance.outputs else None
    metrics = []
    for c in merged or []:
        metrics.append(
            OutputMetrics(
                c.name, float(c.max_abs_error), float(c.max_rel_error), float(c.cosine),
                agreement.get(c.name), int(c.new_nonfinite),
                passed=passes(tolerance, c, agreement.get(c.name)),
                checked=checked is None or c.name in checked,
            )
        )
    return tuple(metrics)


def passes(tolerance: Tolerance | None, c: Any, agreement: float | None) -> bool:
    if not c.shapes_match or c.new_nonfinite or c.nonfinite_mismatches:
        return False
    if c.exact:
        return c.mismatches == 0
    if tolerance is None:
        return True
    if tolerance.allclose is not None and not c.within(*tolerance.allclose):
        return False
    if tolerance.min_cosine is not None and not c.cosine >= tolerance.min_cosine:
        return False
    if tolerance.topk_agreement is not None and agreement is not None:
        return agreement >= tolerance.topk_agreement
    return True


def topk_agreement(
    reference: Sequence[Mapping[str, np.ndarray]], candidate: Sequence[Mapping[str, np.ndarray]]
) -> dict[str, float]:
    """Per float output with a last axis >= 2: share of samples whose argmax agrees."""
    agree: dict[str, int] = {}
    total: dict[str, int] = {}
    for ref, cand in zip(reference, candidate):
        for name, r in ref.items():
            r = np.asarray(r)
            c = np.asarray(cand.get(name))
            if r.dtype.kind != "f" or r.ndim < 1 or r.shape[-1] < 2 or r.shape != c.shape:
                continue
            r2 = r.reshape(-1, r.shape[-1]).astype(np.float64)
            c2 = c.reshape(-1, c.shape[-1]).astype(np.float64)
            agree[name] = agree.get(name, 0) + int(np.count_nonzero(r2.argmax(-1) == c2.argmax(-1)))
            total[name] = total.get(name, 0) + r2.shape[0]
    return {name: agree[name] / total[name] for name in agree if total[name]}
