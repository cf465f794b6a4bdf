"""What the search returns: the result, per-output metrics and evaluations, as text or JSON."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir

from mixprec.dtypes import LowPrecision
from mixprec.plan.file import plan_to_dict, save_plan
from mixprec.plan.model import PrecisionPlan
from mixprec.report import Report
from mixprec.tolerance import Tolerance


@dataclass(frozen=True)
class OutputMetrics:
    """How one output of a candidate compares with the FP32 reference over all batches."""

    name: str
    max_abs_error: float
    max_rel_error: float
    cosine: float
    topk_agreement: float | None
    new_nonfinite: int
    passed: bool
    checked: bool = True

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Evaluation:
    """One full evaluation: the top-k candidates kept FP32, converted and run on the data."""

    fp32_candidates: int
    met: bool
    seconds: float
    note: str | None = None


@dataclass(frozen=True)
class TuneResult:
    """Outcome of :func:`tune`.

    Attributes:
        met: Whether the chosen plan meets the tolerance (and metric).
        target: The 16-bit type.
        plan: The final plan (save it with `save_plan` or `mixprec.plan.file.save_plan`):
            the smallest passing one, or when none passes the most accurate one tried.
        model: The converted model of that plan.
        output_path: Where it was written (only when `met` and an output was given).
        fp32_nodes: Candidates the search keeps FP32 (the top-k of the ranking).
        outputs: Per-output metrics of the final plan.
        evaluations: Full evaluations run (conversion + run on the data).
        max_evaluations: The bound ``2 + ceil(log2 candidates)``.
        candidates: Nodes the default plan computes in 16 bits.
        contributions: (node, op type, normalised own error) per candidate, ranked; NaN where
            the node could not be probed.
        fp32_share_nodes: FP32 nodes / nodes with float compute (16-bit or FP32) in the final plan.
        fp32_share_flops: The same weighted by FLOPs of MatMul/Gemm/Conv/ConvTranspose where
            shapes are known (None when none is).
        default_fp32_share_nodes: `fp32_share_nodes` of the default plan.
        default_fp32_share_flops: `fp32_share_flops` of the default plan.
        estimated_speedup: The final model's speed against FP32 on the runtime by the cost
            model (`Report.estimated_speedup`), None without a report.
        history: Every evaluation, in order.
        notes: Warnings (probe fallbacks, failed runs).
        seconds: Wall time.
        report: The conversion report of the final plan.
    """

    met: bool
    target: LowPrecision
    tolerance: Tolerance | None
    plan: PrecisionPlan
    model: ir.Model
    output_path: Path | None
    fp32_nodes: tuple[str, ...]
    outputs: tuple[OutputMetrics, ...]
    evaluations: int
    max_evaluations: int
    candidates: int
    contributions: tuple[tuple[str, str, float], ...]
    fp32_share_nodes: float
    fp32_share_flops: float | None
    default_fp32_share_nodes: float
    default_fp32_share_flops: float | None
    history: tuple[Evaluation, ...]
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    report: Report | None = None

    @property
    def estimated_speedup(self) -> float | None:
        return self.report.estimated_speedup if self.report is not None else None

    def save_plan(self, path: str | os.PathLike) -> Path:
        """Write the final plan as a plan file."""
        return save_plan(self.plan, path)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (without the model); non-finite numbers become strings."""
        return _json_safe({
            "met": self.met,
            "target": self.target.value,
            "tolerance": self.tolerance.describe() if self.tolerance else None,
            "fp32_nodes": list(self.fp32_nodes),
            "outputs": [o.to_dict() for o in self.outputs],
            "evaluations": self.evaluations,
            "max_evaluations": self.max_evaluations,
            "candidates": self.candidates,
            "contributions": [list(c) for c in self.contributions],
            "fp32_share_nodes": self.fp32_share_nodes,
            "fp32_share_flops": self.fp32_share_flops,
            "default_fp32_share_nodes": self.default_fp32_share_nodes,
            "default_fp32_share_flops": self.default_fp32_share_flops,
            "estimated_speedup": self.estimated_speedup,
            "history": [e.__dict__ for e in self.history],
            "notes": list(self.notes),
            "seconds": self.seconds,
            "plan": plan_to_dict(self.plan),
        })

    def format_text(self, top: int = 10) -> str:
        """A readable summary."""
        lines = [self._verdict_line(), self._share_line()]
        if self.estimated_speedup is not None and self.report is not None:
            lines.append(self._speed_line(self.estimated_speedup, self.report))
        if self.fp32_nodes:
            lines.append("kept FP32: " + ", ".join(self.fp32_nodes[:top]) + (" ..." if len(self.fp32_nodes) > top else ""))
        lines.append("largest own errors (normalised):")
        for name, op_type, error in self.contributions[:top]:
            lines.append(f"  {error:10.3g}  {op_type:<18} {name}")
        lines.append("outputs:")
        lines.extend(_output_line(o) for o in self.outputs)
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _verdict_line(self) -> str:
        """Whether the tolerance was met, with how many nodes kept FP32 and evaluations."""
        verdict = "met" if self.met else "NOT met"
        tol = self.tolerance.describe() if self.tolerance else "metric"
        return (
            f"tolerance ({tol}) {verdict} with {len(self.fp32_nodes)} of {self.candidates} "
            f"candidate node(s) kept FP32; {self.evaluations} evaluation(s) "
            f"(bound {self.max_evaluations})"
        )

    def _share_line(self) -> str:
        """The FP32 share of nodes (and FLOPs where known), final plan and default plan."""
        return (
            f"FP32 share: {_pct(self.fp32_share_nodes)} of nodes"
            + _optional_pct(", {} of FLOPs", self.fp32_share_flops)
            + f" (default plan: {_pct(self.default_fp32_share_nodes)}"
            + _optional_pct(", {}", self.default_fp32_share_flops)
            + ")"
        )

    @staticmethod
    def _speed_line(speedup: float, report: Report) -> str:
        """The cost model's speed estimate of the final model from its `report`."""
        return (
            f"estimated speed: about {speedup:.2f}x FP32 on {report.cost_device} "
            "(cost model, not measured)"
            + (f"; {report.cost_limitation}" if report.cost_limitation else "")
        )


def _output_line(o: OutputMetrics) -> str:
    """One output's metrics and whether it passes, for :meth:`TuneResult.format_text`."""
    agree = f", top-1 agreement {o.topk_agreement:.4f}" if o.topk_agreement is not None else ""
    status = ("ok" if o.passed else "FAILS") if o.checked else "not checked"
    return (
        f"  {o.name}: max abs {o.max_abs_error:.3g}, max rel {o.max_rel_error:.3g}, "
        f"cosine {o.cosine:.6f}{agree}: {status}"
    )


def _optional_pct(template: str, share: float | None) -> str:
    """`template` with `share` as a percentage filled in; empty when `share` is None."""
    return "" if share is None else template.format(_pct(share))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{100.0 * share:.1f}%"
