"""Accuracy-aware precision search: keep the fewest nodes FP32 that meet an accuracy target.

:func:`tune` localises the error instead of searching blindly:

1. **Default plan.** The model is converted once with the default plan (as `convert` would).
   Its 16-bit nodes are the *candidates*.
2. **One probe run ranks every candidate.** A copy of the FP32 model gets, beside each
   candidate, a duplicate of it fed with the candidate's FP32 inputs rounded through the 16-bit
   type (only the inputs the plan lowers: activations and weights), its outputs rounded too, and
   the normalised error ``max|dup - ref| / max|ref|`` against the original (FP32) node computed
   in-graph and exposed as a scalar output. Each duplicate sees exact FP32 inputs, so its error
   is the node's *own* contribution: error made upstream does not leak in. Subgraph candidates
   are probed inside their If/Loop/Scan bodies (an If's branches output every error, the other
   branch zeros; a loop's errors leave as scan outputs and are reduced outside). One run of this
   model over the data gives both the FP32 reference outputs and the error of every candidate,
   without storing any intermediate value: everything stays inside onnxruntime's run, whose
   memory is released value by value. Rounding is emulated with Cast pairs, so this works for
   bfloat16 on any CPU.
3. **Bisection on the ranking.** Candidates are ranked by their error (ties: fewer FLOPs, then
   graph order). Keeping the top-k candidates FP32 is one full conversion (through the plan
   mechanism) plus one full evaluation on the data. k=0 (the default plan) is evaluated first,
   then k=n (every candidate FP32) as the feasibility check, then bisection finds the smallest
   passing k: at most ``2 + ceil(log2 n)`` evaluations. When a few candidates stand out (own
   error above 10 times the median: ordinary rounding gives every node about the same), the
   first split is at their count instead of the middle: usually the answer, proved in one or
   two more evaluations, at worst one evaluation more than plain bisection. Deterministic.

Evaluations run the converted model *emulated* by default (FP32 compute, every 16-bit value
rounded, :mod:`mixprec.validate.emulate`), as `convert`'s validation does: onnxruntime's CPU
provider has no bfloat16 kernels and computes most float16 ops in FP32, which would hide
float16 rounding and overflow. ``emulate=False`` runs float16 models for real.

Limits: the ranking measures each node's local error, so error made in one node and amplified
far downstream (a sharp softmax, say) ranks the node where the amplification shows, if it is a
candidate; the bisection still finds a passing set, only a larger one. Candidates inside
model-local function bodies are not probed (they rank last).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.shape_inference
import onnx_ir as ir

from mixprec.analysis.plan import Category, Precision, PrecisionPlan
from mixprec.dtypes import LowPrecision, parse_low_precision
from mixprec.errors import InputError, MixprecError
from mixprec.graphs import all_nodes, subgraphs_of
from mixprec.plan_file import PlanFile, fp32_plan, load_plan, node_names, plan_to_dict, save_plan
from mixprec.report import Report

logger = logging.getLogger(__name__)

Batch = Mapping[str, np.ndarray]
Metric = Callable[[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]], bool]

_FLOAT = ir.DataType.FLOAT
_FLOAT_DTYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})
_EXACT_DTYPES = frozenset(
    {
        ir.DataType.BOOL, ir.DataType.INT8, ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64,
        ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64,
    }
)  # fmt: skip
_DEFAULT_DOMAINS = frozenset({"", "ai.onnx"})
# Ops whose duplicate would draw other random numbers: only their output rounding is measured.
_RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}
)
# Arguments of `convert` that tune sets itself.
_RESERVED = frozenset({"output", "validate", "data", "tolerance", "max_batches", "calibrate", "progress"})
_PREFIX = "mixprec_probe"
# A candidate whose own error exceeds this many times the median is an outlier (see tune()).
_OUTLIER_FACTOR = 10.0
# Nodes that only own subgraphs or function bodies: they compute nothing themselves.
_BOUNDARIES = frozenset({Category.CONTROL_FLOW, Category.FUNCTION})


# -- tolerance ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """What every checked output must meet (all criteria that are set).

    Attributes:
        atol: Absolute tolerance of the allclose rule ``|c - r| <= atol + rtol * |r|``.
        rtol: Relative tolerance of that rule (only one of the two set: the other is 0).
        min_cosine: Lowest cosine similarity of candidate and reference (per batch).
        topk_agreement: Lowest fraction of samples whose top-1 index over the last axis
            agrees with the reference (outputs with a last axis of at least 2).
        outputs: Output names the criteria apply to (default: all). Integer and bool outputs
            must match exactly; no output may gain NaN or Inf.
    """

    atol: float | None = None
    rtol: float | None = None
    min_cosine: float | None = None
    topk_agreement: float | None = None
    outputs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise InputError(f"tolerance {name} must be a finite number >= 0, got {value}")
        bounds = {"min_cosine": (-1.0, 1.0), "topk_agreement": (0.0, 1.0)}
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if value is not None and not (low <= value <= high):
                raise InputError(f"tolerance {name} must lie in [{low:g}, {high:g}], got {value}")
        if self.outputs is not None:
            object.__setattr__(self, "outputs", tuple(self.outputs))

    @property
    def allclose(self) -> tuple[float, float] | None:
        """(atol, rtol) of the allclose rule, or None when neither is set."""
        if self.atol is None and self.rtol is None:
            return None
        return (self.atol or 0.0, self.rtol or 0.0)

    @property
    def empty(self) -> bool:
        """Whether no criterion is set."""
        return self.allclose is None and self.min_cosine is None and self.topk_agreement is None

    def describe(self) -> str:
        """A short text form, e.g. ``atol=0.01, rtol=0.01``."""
        parts = []
        if self.allclose is not None:
            parts.append(f"atol={self.allclose[0]:g}, rtol={self.allclose[1]:g}")
        if self.min_cosine is not None:
            parts.append(f"cosine>={self.min_cosine:g}")
        if self.topk_agreement is not None:
            parts.append(f"top-1 agreement>={self.topk_agreement:g}")
        return ", ".join(parts) or "no numeric criterion"


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
        plan: The final plan (save it with `save_plan` or `mixprec.plan_file.save_plan`):
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
            "history": [e.__dict__ for e in self.history],
            "notes": list(self.notes),
            "seconds": self.seconds,
            "plan": plan_to_dict(self.plan),
        })

    def format_text(self, top: int = 10) -> str:
        """A readable summary."""
        verdict = "met" if self.met else "NOT met"
        tol = self.tolerance.describe() if self.tolerance else "metric"
        lines = [
            (
                f"tolerance ({tol}) {verdict} with {len(self.fp32_nodes)} of {self.candidates} "
                f"candidate node(s) kept FP32; {self.evaluations} evaluation(s) "
                f"(bound {self.max_evaluations})"
            ),
            f"FP32 share: {_pct(self.fp32_share_nodes)} of nodes"
            + (f", {_pct(self.fp32_share_flops)} of FLOPs" if self.fp32_share_flops is not None else "")
            + f" (default plan: {_pct(self.default_fp32_share_nodes)}"
            + (f", {_pct(self.default_fp32_share_flops)}" if self.default_fp32_share_flops is not None else "")
            + ")",
        ]
        if self.fp32_nodes:
            lines.append("kept FP32: " + ", ".join(self.fp32_nodes[:top]) + (" ..." if len(self.fp32_nodes) > top else ""))
        lines.append("largest own errors (normalised):")
        for name, op_type, error in self.contributions[:top]:
            lines.append(f"  {error:10.3g}  {op_type:<18} {name}")
        lines.append("outputs:")
        for o in self.outputs:
            agree = f", top-1 agreement {o.topk_agreement:.4f}" if o.topk_agreement is not None else ""
            status = ("ok" if o.passed else "FAILS") if o.checked else "not checked"
            lines.append(
                f"  {o.name}: max abs {o.max_abs_error:.3g}, max rel {o.max_rel_error:.3g}, "
                f"cosine {o.cosine:.6f}{agree}: {status}"
            )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


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


# -- the search --------------------------------------------------------------------------------


def tune(
    model_path: str | os.PathLike | onnx.ModelProto,
    data: str | os.PathLike | Sequence[str | os.PathLike] | Batch | Iterable[Batch] | None,
    *,
    target_dtype: str | LowPrecision = "float16",
    tolerance: Tolerance | None = None,
    metric: Metric | None = None,
    max_batches: int = 4,
    progress: bool = False,
    output: str | os.PathLike | None = None,
    emulate: bool = True,
    **convert_kwargs: Any,
) -> TuneResult:
    """Find the smallest set of nodes to keep FP32 so that the converted model meets a tolerance.

    See the module docstring for the method.

    Args:
        model_path: The FP32 model (a path, or a `ModelProto`).
        data: Input batches: a `.npz` file, a folder of them or of `test_data_set_N`, a list of
            such paths, one batch dict, or an iterable of them. None: one generated batch (a
            weak check).
        target_dtype: "float16"/"fp16" or "bfloat16"/"bf16".
        tolerance: What every output must meet.
        metric: Optional `metric(reference, candidate) -> bool` over lists (one per batch) of
            output dicts; must hold too. At least one of `tolerance` and `metric` is required.
        max_batches: Use at most this many batches.
        progress: Print one progress line per step on stderr.
        output: Write the final converted model here, only if it meets the tolerance.
        emulate: Measure float16 candidates on the emulated model (default, as validation
            does); False runs them in onnxruntime for real. bfloat16 is emulated, except with
            `runtime="openvino"` (and openvino installed), where every candidate runs on
            OpenVINO's CPU plugin for real.
        **convert_kwargs: Passed to `convert` for every conversion (e.g. `exclude_nodes`,
            `fp32_ops`, `keep_io_types`, `opset`, `policy_file`, and `plan` as a starting plan).

    Returns:
        The result; `met` tells whether the tolerance was met.

    Raises:
        InputError: Bad arguments or data.
        MixprecError: The model cannot be loaded or converted.
    """
    start = time.perf_counter()
    target = parse_low_precision(target_dtype)
    if tolerance is None and metric is None:
        raise InputError("tune needs a tolerance or a metric")
    if tolerance is not None and tolerance.empty and metric is None:
        raise InputError("the tolerance sets no criterion (atol, rtol, min_cosine or topk_agreement)")
    reserved = sorted(_RESERVED & set(convert_kwargs))
    if reserved:
        raise InputError(f"tune sets {reserved[0]!r} itself; it cannot be passed to tune")
    if max_batches < 1:
        raise InputError(f"max_batches must be >= 1, got {max_batches}")
    say = _Say(progress)
    with tempfile.TemporaryDirectory(prefix="mixprec-tune-") as tmp:
        search = _Search(
            Path(tmp), target, tolerance, metric, emulate, say, dict(convert_kwargs)
        )
        result = search.run(model_path, data, max_batches, output)
    return _replace_seconds(result, time.perf_counter() - start)


def _replace_seconds(result: TuneResult, seconds: float) -> TuneResult:
    return replace(result, seconds=round(seconds, 3))


class _Say:
    """Progress lines on stderr."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        if not self.enabled:
            logger.info("%s", message)
            return
        sys.stderr.write(f"mixprec tune: {message}\n")
        sys.stderr.flush()


@dataclass(frozen=True)
class _Candidate:
    """A node of the default plan computed in 16 bits, and how to probe it."""

    name: str
    op_type: str
    index: int  # position in all_nodes order
    lowered_inputs: frozenset[int]
    outputs: tuple[tuple[int, str], ...]  # (output index, "round" | "float" | "exact")


@dataclass
class _Outcome:
    met: bool
    outputs: tuple[OutputMetrics, ...]
    conversion: Any  # ConversionResult
    note: str | None = None


class _Search:
    def __init__(
        self,
        workdir: Path,
        target: LowPrecision,
        tolerance: Tolerance | None,
        metric: Metric | None,
        emulate: bool,
        say: _Say,
        convert_kwargs: dict[str, Any],
    ) -> None:
        self.workdir = workdir
        self.target = target
        self.tolerance = tolerance
        self.metric = metric
        self.emulate = emulate or target is LowPrecision.BFLOAT16
        self.say = say
        self.kwargs = convert_kwargs
        base = self.kwargs.pop("plan", None)
        self.base: PlanFile | None = load_plan(base) if base is not None else None
        self.notes: list[str] = []
        self.history: list[Evaluation] = []
        self.reference: list[dict[str, np.ndarray]] = []
        self.batches: list[dict[str, np.ndarray]] = []
        self._count = 0

    # -- setup ---------------------------------------------------------------------------------
    def _fp32_model(self, model: str | os.PathLike | onnx.ModelProto) -> Path:
        """The FP32 model as a file (upgraded first when `opset` is given)."""
        from mixprec.io import load_model  # noqa: PLC0415
        from mixprec.passes.opset import default_opset, upgrade_opset  # noqa: PLC0415

        opset = self.kwargs.pop("opset", None)
        if isinstance(model, ir.Model):
            raise InputError("tune takes a model path or an onnx.ModelProto, not an onnx_ir.Model")
        path = None if isinstance(model, onnx.ModelProto) else Path(model)
        if path is not None and opset is None:
            load_model(path)  # clear errors for a missing or broken file
            return path
        ir_model, _ = load_model(model)
        current = default_opset(ir_model)
        if opset is not None and current is not None and current < opset:
            ir_model = upgrade_opset(ir_model, opset)
            self.notes.append(f"opset upgraded from {current} to {opset}")
        path = self.workdir / "fp32.onnx"
        ir.save(ir_model, path)
        return path

    def _load_data(self, data: Any, model_path: Path, max_batches: int) -> list[dict[str, np.ndarray]]:
        from mixprec.validate import data as data_mod  # noqa: PLC0415

        proto = onnx.load(str(model_path), load_external_data=False)
        initializers = {t.name for t in proto.graph.initializer}
        names = [v.name for v in proto.graph.input if v.name not in initializers]
        if data is None:
            self.notes.append("no data given: one generated batch (random inputs) is used")
            return [data_mod.generate_inputs(data_mod.input_specs(proto), seed=0)]
        if isinstance(data, (str, os.PathLike)):
            iterator: Iterable[Any] = data_mod.load_batches(data, names)
        elif isinstance(data, (list, tuple)) and data and all(isinstance(d, (str, os.PathLike)) for d in data):
            streams = [data_mod.load_batches(d, names) for d in data]  # checks every path now
            iterator = itertools.chain.from_iterable(streams)
        elif isinstance(data, Mapping):
            iterator = [data]
        elif isinstance(data, Iterable):
            iterator = data
        else:
            raise InputError(f"unsupported data {type(data).__name__}: pass a path, a batch dict or batches")
        batches = []
        for index, batch in enumerate(itertools.islice(iterator, max_batches)):
            if not isinstance(batch, Mapping):
                raise InputError(f"batch #{index} is a {type(batch).__name__}, not a dict of arrays")
            missing = [n for n in names if n not in batch]
            if missing:
                raise InputError(f"batch #{index} has no data for model input {missing[0]!r}")
            batches.append({k: np.asarray(v) for k, v in batch.items()})
        if not batches:
            raise InputError("the data holds no batches")
        return batches

    # -- conversion and evaluation ---------------------------------------------------------------
    def _convert(self, model_path: Path, names: Sequence[str]) -> Any:
        from mixprec.api import convert  # noqa: PLC0415

        self._count += 1
        out = self.workdir / f"candidate-{self._count}.onnx"
        return convert(
            model_path,
            out,
            target_dtype=self.target,
            validate="none",
            plan=fp32_plan(names, self.base),
            **self.kwargs,
        )

    def _evaluate(self, conversion: Any) -> _Outcome:
        """Run a converted model (emulated unless told otherwise) and compare with the reference."""
        try:
            candidate = self._run_candidate(conversion.output_path)
        except MixprecError as e:
            return _Outcome(False, (), conversion, f"converted model failed to run: {e}")
        finally:
            for leftover in self.workdir.glob(f"{conversion.output_path.stem}.*"):
                leftover.unlink(missing_ok=True)
        from mixprec.validate import compare  # noqa: PLC0415

        merged = None
        for ref, cand in zip(self.reference, candidate):
            comparison = compare.compare_outputs(ref, cand)
            merged = comparison if merged is None else compare.merge(merged, comparison)
        agreement = _topk_agreement(self.reference, candidate)
        checked = set(self.tolerance.outputs) if self.tolerance and self.tolerance.outputs else None
        metrics = []
        for c in merged or []:
            metrics.append(
                OutputMetrics(
                    c.name, float(c.max_abs_error), float(c.max_rel_error), float(c.cosine),
                    agreement.get(c.name), int(c.new_nonfinite),
                    passed=_passes(self.tolerance, c, agreement.get(c.name)),
                    checked=checked is None or c.name in checked,
                )
            )
        met = all(m.passed for m in metrics if m.checked)
        if met and self.metric is not None:
            met = bool(self.metric(self.reference, candidate))
        return _Outcome(met, tuple(metrics), conversion)

    def _run_candidate(self, path: Path) -> list[dict[str, np.ndarray]]:
        from mixprec.validate import openvino_runner, runner  # noqa: PLC0415
        from mixprec.validate.emulate import emulate_low_precision_file  # noqa: PLC0415

        if self.kwargs.get("runtime") == "openvino" and openvino_runner.openvino_available():
            # The deployment runtime computes for real (bfloat16 on AVX512-BF16/AMX): judge
            # candidates by what it produces, not by the emulation.
            session = openvino_runner.OpenVinoSession(path, precision="model")
            return [session.run(feeds) for feeds in self.batches]
        if self.emulate:
            path = emulate_low_precision_file(path, path.with_name(path.stem + ".emulated.onnx"))
        session = runner.make_session(path, graph_optimization="disable")
        return [runner.run_session(session, feeds) for feeds in self.batches]

    def _step(self, model_path: Path, ranked: Sequence[_Candidate], k: int, bound: int,
              conversion: Any = None) -> _Outcome:
        t = time.perf_counter()
        if conversion is None:
            conversion = self._convert(model_path, [c.name for c in ranked[:k]])
        outcome = self._evaluate(conversion)
        self.history.append(Evaluation(k, outcome.met, round(time.perf_counter() - t, 3), outcome.note))
        if outcome.note:
            self.notes.append(f"{k} candidate(s) FP32: {outcome.note}")
        self.say(
            f"evaluation {len(self.history)}/{bound}: {k} of {len(ranked)} candidate(s) FP32: "
            + ("meets the tolerance" if outcome.met else "fails")
        )
        return outcome

    # -- main ----------------------------------------------------------------------------------
    def run(self, model: Any, data: Any, max_batches: int, output: str | os.PathLike | None) -> TuneResult:
        model_path = self._fp32_model(model)
        self.batches = self._load_data(data, model_path, max_batches)
        if self.tolerance is not None and self.tolerance.outputs:
            proto_outputs = {o.name for o in onnx.load(str(model_path), load_external_data=False).graph.output}
            unknown = [n for n in self.tolerance.outputs if n not in proto_outputs]
            if unknown:
                raise InputError(f"tolerance names output {unknown[0]!r}, which the model does not have")
        if self.kwargs.pop("calibrate", True):
            # Measured ranges shape every candidate plan: values that leave the 16-bit range
            # stay FP32 from the start instead of being found by the search.
            from mixprec.analysis.calibrate import calibrate  # noqa: PLC0415

            self.say("measuring FP32 ranges")
            try:
                self.kwargs["ranges"] = calibrate(model_path, self.batches)
            except MixprecError as e:
                self.notes.append(f"calibration skipped: {e}")
        self.say(f"default conversion to {self.target.value}")
        default = self._convert(model_path, [])
        candidates = _candidates(default.plan)
        self.say(f"{len(candidates)} candidate node(s); probe run over {len(self.batches)} batch(es)")
        errors, flops = self._probe(model_path, candidates)
        # Largest own error first; among equal errors the cheaper node (fewer FLOPs) is kept
        # FP32 first; unprobed nodes last, in graph order.
        ranked = sorted(
            candidates,
            key=lambda c: (
                _rank_error(errors.get(c.name)),
                (flops.get(c.name) or 0.0) if c.name in errors else 0.0,
                c.index,
            ),
        )
        n = len(ranked)
        guess = _outlier_count([errors.get(c.name) for c in ranked])
        bound = _evaluation_bound(n, guess)
        best = self._step(model_path, ranked, 0, bound, conversion=default)
        best_k = 0
        if not best.met and n:
            full = self._step(model_path, ranked, n, bound)
            best, best_k = full, n
            if full.met:
                lo, hi = 0, n
                while hi - lo > 1:
                    # The first split is at the outliers of the ranking when there are any.
                    mid = guess if lo < guess < hi else (lo + hi) // 2
                    guess = 0
                    outcome = self._step(model_path, ranked, mid, bound)
                    if outcome.met:
                        hi, best, best_k = mid, outcome, mid
                    else:
                        lo = mid
        final = best.conversion
        output_path = None
        if output is not None and best.met:
            from mixprec.api import convert  # noqa: PLC0415

            final = convert(
                model_path, output, target_dtype=self.target, validate="checker",
                plan=fp32_plan([c.name for c in ranked[:best_k]], self.base), **self.kwargs,
            )
            output_path = Path(output)
        share, share_flops = _fp32_share(final.plan, flops)
        default_share, default_share_flops = _fp32_share(default.plan, flops)
        contributions = tuple(
            (c.name, c.op_type, float(errors[c.name]) if errors.get(c.name) is not None else math.nan)
            for c in ranked
        )
        if not best.met:
            self.say("the tolerance cannot be met" + (" even with every candidate FP32" if n else ""))
        return TuneResult(
            met=best.met,
            target=self.target,
            tolerance=self.tolerance,
            plan=final.plan,
            model=final.model,
            output_path=output_path,
            fp32_nodes=tuple(c.name for c in ranked[:best_k]),
            outputs=best.outputs,
            evaluations=len(self.history),
            max_evaluations=bound,
            candidates=n,
            contributions=contributions,
            fp32_share_nodes=share,
            fp32_share_flops=share_flops,
            default_fp32_share_nodes=default_share,
            default_fp32_share_flops=default_share_flops,
            history=tuple(self.history),
            notes=tuple(self.notes),
            report=final.report,
        )

    # -- the probe -------------------------------------------------------------------------------
    def _probe(
        self, model_path: Path, candidates: Sequence[_Candidate]
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Run the probe model: keep the reference outputs; return per-candidate errors and FLOPs."""
        from mixprec.analysis.calibrate import IntermediateRunner  # noqa: PLC0415
        from mixprec.validate import runner  # noqa: PLC0415

        with IntermediateRunner(model_path) as exposer:
            flops = _node_flops(exposer.proto, self.batches[0])
            reference_names = [o.name for o in exposer.proto.graph.output]
            errors: dict[str, float] = {}
            try:
                probe = ir.from_proto(exposer.proto)
                outputs = _ProbeBuilder(probe, self.target, candidates).build()
                path = exposer.workdir / "probe.onnx"
                onnx.save(ir.to_proto(probe), str(path))
                session = runner.make_session(path, graph_optimization="disable")
                for feeds in self.batches:
                    results = runner.run_session(session, feeds)
                    self.reference.append({name: results[name] for name in reference_names})
                    for out_name, cand_name in outputs.items():
                        value = float(np.asarray(results[out_name]).reshape(-1)[0])
                        value = math.inf if math.isnan(value) else value
                        errors[cand_name] = max(errors.get(cand_name, 0.0), value)
                del session
            except Exception as e:  # noqa: BLE001 - any probe failure falls back to a plain run
                note = f"the error probe failed ({e}); candidates are ranked by graph order"
                logger.warning("%s", note)
                self.notes.append(note)
                errors = {}
                self.reference = []
                session = runner.make_session(model_path, graph_optimization="disable")
                self.reference = [runner.run_session(session, feeds) for feeds in self.batches]
        missing = [c.name for c in candidates if c.name not in errors]
        if errors and missing:
            self.notes.append(
                f"{len(missing)} candidate(s) could not be probed (e.g. {missing[0]!r}); they rank last"
            )
        return errors, flops


def _outlier_count(errors: Sequence[float | None]) -> int:
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


def _evaluation_bound(candidates: int, guess: int) -> int:
    """Most evaluations the search runs: k=0, k=n, bisection, one more for a first split at
    the outliers (`guess`) instead of the middle."""
    if candidates == 0:
        return 1
    steps = math.ceil(math.log2(candidates)) if candidates > 1 else 0
    return 2 + steps + (1 if guess else 0)


def _rank_error(error: float | None) -> float:
    """Sort key: larger errors first, unknown last."""
    return 1.0 if error is None else -error


def _candidates(plan: PrecisionPlan) -> list[_Candidate]:
    """The default plan's 16-bit nodes and what the plan lowers in each."""
    names = node_names(plan.order)
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
        candidates.append(_Candidate(names[node], node.op_type, index, lowered, tuple(outputs)))
    return candidates


def _fp32_share(plan: PrecisionPlan, flops: Mapping[str, float]) -> tuple[float, float | None]:
    """FP32 share of the nodes that compute floats (control-flow and function-call nodes aside)."""
    names = node_names(plan.order)
    low = fp32 = 0
    low_flops = fp32_flops = 0.0
    known = False
    for node in plan.order:
        decision = plan.decisions[node]
        if decision.precision is Precision.NONE or decision.category in _BOUNDARIES:
            continue
        cost = flops.get(names[node])
        if decision.precision is Precision.FP32:
            fp32 += 1
            fp32_flops += cost or 0.0
        else:
            low += 1
            low_flops += cost or 0.0
        known = known or cost is not None
    share = fp32 / (low + fp32) if low + fp32 else 0.0
    total = low_flops + fp32_flops
    return share, (fp32_flops / total if known and total > 0 else None)


def _passes(tolerance: Tolerance | None, c: Any, agreement: float | None) -> bool:
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


def _topk_agreement(
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


# -- FLOPs -----------------------------------------------------------------------------------------


def _node_flops(proto: onnx.ModelProto, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
    """FLOPs of MatMul/Gemm/Conv/ConvTranspose nodes whose shapes are known for this batch."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    for value in model.graph.input:
        array = batch.get(value.name)
        if array is None or not value.type.HasField("tensor_type"):
            continue
        shape = value.type.tensor_type.shape
        shape.ClearField("dim")
        for size in np.shape(array):
            shape.dim.add().dim_value = int(size)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
        ir_model = ir.from_proto(inferred)
    except Exception as e:  # noqa: BLE001 - shape inference raises assorted types
        logger.debug("shape inference for FLOPs failed: %s", e)
        return {}
    nodes = all_nodes(ir_model)
    names = node_names(nodes)
    flops: dict[str, float] = {}
    for node in nodes:
        cost = _flops_of(node)
        if cost is not None:
            flops[names[node]] = cost
    return flops


def _dims(value: ir.Value | None) -> list[int] | None:
    if value is None or value.shape is None:
        return None
    dims = list(value.shape.dims)
    if not all(isinstance(d, int) for d in dims):
        return None
    return [int(d) for d in dims]


def _flops_of(node: ir.Node) -> float | None:
    if node.domain not in _DEFAULT_DOMAINS or not node.outputs:
        return None
    out = _dims(node.outputs[0])
    if node.op_type == "MatMul" and len(node.inputs) >= 2:
        a = _dims(node.inputs[0])
        if a is None or out is None or not a:
            return None
        return 2.0 * math.prod(out) * a[-1]
    if node.op_type == "Gemm" and len(node.inputs) >= 2:
        a = _dims(node.inputs[0])
        if a is None or out is None or len(a) != 2:
            return None
        trans_a = node.attributes.get_int("transA", 0)
        k = a[0] if trans_a else a[1]
        return 2.0 * math.prod(out) * k
    if node.op_type == "Conv" and len(node.inputs) >= 2:
        w = _dims(node.inputs[1])
        if w is None or out is None:
            return None
        return 2.0 * math.prod(out) * math.prod(w[1:])
    if node.op_type == "ConvTranspose" and len(node.inputs) >= 2:
        x, w = _dims(node.inputs[0]), _dims(node.inputs[1])
        if x is None or w is None:
            return None
        return 2.0 * math.prod(x) * math.prod(w[1:])
    return None


# -- the probe model -------------------------------------------------------------------------------


class _ProbeBuilder:
    """Adds to an FP32 model, beside each candidate, a 16-bit emulated duplicate and its error."""

    def __init__(self, model: ir.Model, target: LowPrecision, candidates: Sequence[_Candidate]) -> None:
        self.model = model
        self.low = target.ir_dtype
        by_name = {name: node for node, name in node_names(all_nodes(model)).items()}
        self.specs: dict[ir.Node, _Candidate] = {}
        for candidate in candidates:
            node = by_name.get(candidate.name)
            if node is not None and node.op_type == candidate.op_type:
                self.specs[node] = candidate
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        # Equal on floats (opset 11) masks equal infinities and reference NaNs.
        self.masked = opset >= 11
        self.taken = _value_names(model)
        self.counter = itertools.count()
        self.rounded: dict[tuple[int, ir.Value], ir.Value] = {}
        self.zero = self._constant("zero", 0.0)
        self.inf = self._constant("inf", math.inf)
        self.tiny = self._constant("tiny", 1e-30)

    def build(self) -> dict[str, str]:
        """Add the probes; return error output name -> candidate name."""
        results = self._graph(self.model.graph)
        outputs: dict[str, str] = {}
        for name, value in results:
            self.model.graph.outputs.append(value)
            outputs[value.name] = name  # type: ignore[index]
        return outputs

    # -- helpers
    def _name(self, base: str) -> str:
        while True:
            name = f"{_PREFIX}/{next(self.counter)}/{base}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def _constant(self, base: str, number: float) -> ir.Value:
        value = ir.Value(
            name=self._name(base),
            type=ir.TensorType(_FLOAT),
            shape=ir.Shape([]),
            const_value=ir.Tensor(np.array(number, dtype=np.float32)),
        )
        value.const_value.name = value.name  # type: ignore[union-attr]
        self.model.graph.register_initializer(value)
        return value

    def _op(self, nodes: list[ir.Node], op_type: str, inputs: Sequence[ir.Value], **attrs: Any) -> ir.Value:
        node = ir.node(op_type, list(inputs), attrs or None, name=self._name(op_type))
        node.outputs[0].name = self._name(op_type.lower())
        nodes.append(node)
        return node.outputs[0]

    def _scalar(self, value: ir.Value) -> ir.Value:
        value.type = ir.TensorType(_FLOAT)
        value.shape = ir.Shape([])
        return value

    def _round(self, graph: ir.Graph, nodes: list[ir.Node], value: ir.Value) -> ir.Value:
        key = (id(graph), value)
        cached = self.rounded.get(key)
        if cached is None:
            low = self._op(nodes, "Cast", [value], to=int(self.low))
            cached = self._op(nodes, "Cast", [low], to=int(_FLOAT))
            self.rounded[key] = cached
        return cached

    # -- errors
    def _float_error(self, nodes: list[ir.Node], cand: ir.Value, ref: ir.Value) -> ir.Value:
        diff = self._op(nodes, "Abs", [self._op(nodes, "Sub", [cand, ref])])
        magnitude = self._op(nodes, "Abs", [ref])
        if self.masked:
            same = self._op(
                nodes, "Or", [self._op(nodes, "Equal", [cand, ref]), self._op(nodes, "IsNaN", [ref])]
            )
            diff = self._op(nodes, "Where", [same, self.zero, diff])
            diff = self._op(nodes, "Where", [self._op(nodes, "IsNaN", [diff]), self.inf, diff])
            bad = self._op(
                nodes, "Or", [self._op(nodes, "IsNaN", [magnitude]), self._op(nodes, "IsInf", [magnitude])]
            )
            magnitude = self._op(nodes, "Where", [bad, self.zero, magnitude])
        num = self._op(nodes, "Max", [self._op(nodes, "ReduceMax", [diff], keepdims=0), self.zero])
        den = self._op(nodes, "Max", [self._op(nodes, "ReduceMax", [magnitude], keepdims=0), self.zero])
        return self._op(nodes, "Div", [num, self._op(nodes, "Add", [den, self.tiny])])

    def _exact_error(self, nodes: list[ir.Node], cand: ir.Value, ref: ir.Value) -> ir.Value:
        differ = self._op(nodes, "Not", [self._op(nodes, "Equal", [cand, ref])])
        flags = self._op(nodes, "Cast", [differ], to=int(_FLOAT))
        return self._op(nodes, "Max", [self._op(nodes, "ReduceMax", [flags], keepdims=0), self.zero])

    def _node(self, graph: ir.Graph, node: ir.Node, spec: _Candidate) -> ir.Value | None:
        if not spec.outputs:
            return None
        nodes: list[ir.Node] = []
        if node.op_type in _RANDOM_OPS and node.domain in _DEFAULT_DOMAINS:
            outputs = {i: node.outputs[i] for i, _ in spec.outputs}
        else:
            inputs = [
                self._round(graph, nodes, v) if v is not None and i in spec.lowered_inputs else v
                for i, v in enumerate(node.inputs)
            ]
            attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
            duplicate = ir.Node(
                node.domain, node.op_type, inputs, attributes, overload=node.overload,
                num_outputs=len(node.outputs), version=node.version, name=self._name(node.op_type),
            )
            for out in duplicate.outputs:
                out.name = self._name("dup")
            nodes.append(duplicate)
            outputs = {i: duplicate.outputs[i] for i, _ in spec.outputs}
        errors = []
        for i, kind in spec.outputs:
            ref = node.outputs[i]
            if kind == "exact":
                if not self.masked:
                    continue
                errors.append(self._exact_error(nodes, outputs[i], ref))
                continue
            cand = self._round(graph, nodes, outputs[i]) if kind == "round" else outputs[i]
            errors.append(self._float_error(nodes, cand, ref))
        if not errors:
            return None
        error = errors[0] if len(errors) == 1 else self._op(nodes, "Max", errors)
        graph.insert_after(node, nodes)
        return self._scalar(error)

    # -- graphs
    def _graph(self, graph: ir.Graph) -> list[tuple[str, ir.Value]]:
        results: list[tuple[str, ir.Value]] = []
        for node in list(graph):
            if node.attributes and subgraphs_of(node):
                results.extend(self._control_flow(graph, node))
                continue
            spec = self.specs.get(node)
            if spec is not None:
                error = self._node(graph, node, spec)
                if error is not None:
                    results.append((spec.name, error))
        return results

    def _control_flow(self, graph: ir.Graph, node: ir.Node) -> list[tuple[str, ir.Value]]:
        if node.domain not in _DEFAULT_DOMAINS:
            return []
        if node.op_type == "If":
            branches = [node.attributes["then_branch"].as_graph(), node.attributes["else_branch"].as_graph()]
            found = [self._graph(branch) for branch in branches]
            names = list(dict.fromkeys(name for result in found for name, _ in result))
            if not names:
                return []
            for branch, result in zip(branches, found):
                have = dict(result)
                for name in names:
                    value = have.get(name)
                    if value is None:
                        nodes: list[ir.Node] = []
                        value = self._scalar(self._op(nodes, "Identity", [self.zero]))
                        branch.extend(nodes)
                    branch.outputs.append(value)
            return self._add_outputs(graph, node, names, reduce=False)
        if node.op_type in ("Loop", "Scan"):
            body = node.attributes["body"].as_graph()
            result = self._graph(body)
            if not result:
                return []
            for _, value in result:
                body.outputs.append(value)
            if node.op_type == "Scan":
                for key in ("scan_output_axes", "scan_output_directions"):
                    attr = node.attributes.get(key)
                    if attr is not None:
                        node.attributes[key] = ir.AttrInt64s(key, [*attr.as_ints(), *([0] * len(result))])
            return self._add_outputs(graph, node, [name for name, _ in result], reduce=True)
        return []

    def _add_outputs(
        self, graph: ir.Graph, node: ir.Node, names: Sequence[str], *, reduce: bool
    ) -> list[tuple[str, ir.Value]]:
        first = len(node.outputs)
        node.resize_outputs(first + len(names))
        nodes: list[ir.Node] = []
        results = []
        for offset, name in enumerate(names):
            out = node.outputs[first + offset]
            out.name = self._name("cf_error")
            out.type = ir.TensorType(_FLOAT)
            if reduce:
                # Per-iteration errors: the largest (0 when the loop ran no iteration).
                out = self._op(nodes, "Max", [self._op(nodes, "ReduceMax", [out], keepdims=0), self.zero])
                results.append((name, self._scalar(out)))
            else:
                out.shape = ir.Shape([])
                results.append((name, out))
        if nodes:
            graph.insert_after(node, nodes)
        return results


def _value_names(model: ir.Model) -> set[str]:
    names: set[str] = set()
    for graph in model.graphs():
        names.update(v.name for v in graph.inputs if v.name)
        names.update(graph.initializers)
        for node in graph:
            names.update(v.name for v in node.outputs if v is not None and v.name)
    return names


__all__ = ["Evaluation", "OutputMetrics", "Tolerance", "TuneResult", "tune"]

