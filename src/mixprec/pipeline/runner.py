"""The runner: calls the steps in order, passing each the results it needs, times every step
and checks the model's invariants after those that change it (``MIXPREC_CHECK_STEPS=1``).

    prepare: load, reference, inline, upgrade, fold, type, normalize, analyze    -> Prepared
    convert: prepare, plan, rewrite, save, validate | report, [repair, save, validate, report], publish

A runtime rejection (onnxruntime fails on the converted model where it runs the FP32 one) is a
result of `validate`, answered by the `repair` step (:mod:`mixprec.pipeline.repair`). Outputs
that gain inf/NaN on the inputs validation generated (no data) make the runner convert once more
with the FP32 ranges measured on those inputs, where they keep more values FP32. The report is
built while a child process checks the staged model, and takes the validation last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import onnx_ir as ir

from mixprec.analysis.calibrate import RangeTable
from mixprec.analysis.constants import copy_ranges
from mixprec.config import Config
from mixprec.errors import BeyondTolerance
from mixprec.graphs import node_keys
from mixprec.io import StagedModel, value_types
from mixprec.io.loading import shared_reads
from mixprec.pipeline.planning import PlanInputs, Planned, make_plan
from mixprec.pipeline.steps import (
    Analysis,
    Checked,
    Loaded,
    Normalized,
    Reference,
    Rewritten,
    Typed,
    analyze,
    fold,
    generated_overflow_ranges,
    inline,
    load,
    normalize,
    reference,
    reference_inlined,
    refuse_invalid_input,
    rewrite,
    save,
    start_checker,
    type_model,
    upgrade,
    validate,
)
from mixprec.plan.model import Category, Precision, PrecisionPlan
from mixprec.policy.profiles import RuntimeProfile
from mixprec.report import Report, build_report
from mixprec.validate.invariants import Baseline, require_invariants, steps_checked
from mixprec.validate.results import Validation

T = TypeVar("T")

# The staged file is loaded again for the check up to this size (its graph; weights stay unread).
STAGED_RELOAD_MAX_BYTES = 64 << 20


@dataclass
class ConversionResult:
    """The converted model and the report of what was done. Save `model` with
    :func:`mixprec.save_model`: it writes back the value types the IR cannot hold (a
    classifier's per-class maps), which `onnx_ir.save` leaves out."""

    model: ir.Model
    report: Report
    plan: PrecisionPlan
    output_path: Path | None
    ranges: RangeTable | None = None  # FP32 ranges measured on `data` (calibration)


class Steps:
    """Times the steps of one run (wall and this process's CPU time; a step run twice adds up)
    and checks the model's invariants after them when ``MIXPREC_CHECK_STEPS`` is on (what the
    source itself breaks, captured after `load`, is never reported)."""

    def __init__(self, config: Config) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.checked = steps_checked()
        self.baseline: Baseline | None = None
        self._keep_io_types = config.io.keep_io_types
        self._start = (time.perf_counter(), time.process_time())

    def run(self, name: str, step: Callable[..., T], *args: Any) -> T:
        """`step(*args)`, timed under `name`."""
        wall, cpu = time.perf_counter(), time.process_time()
        result = step(*args)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - wall
        self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - cpu
        return result

    def capture(self, model: ir.Model) -> None:
        """Take the baseline: the source as loaded."""
        if self.checked:
            self.baseline = Baseline.capture(model, keep_io_types=self._keep_io_types)

    def check(self, name: str, model: ir.Model, staged: StagedModel | None = None) -> None:
        """Check `model` (and the staged file, when small) after step `name`."""
        if not self.checked:
            return
        require_invariants(model, step=name, baseline=self.baseline)
        if staged is not None and staged.path.stat().st_size <= STAGED_RELOAD_MAX_BYTES:
            require_invariants(value_types.load(staged.path), step=f"{name} (staged file)", baseline=self.baseline)

    def totals(self) -> tuple[dict[str, float], dict[str, float]]:
        """Seconds and CPU seconds per step, with the run's total, rounded for the report."""
        wall, cpu = self._start
        seconds = {**self.seconds, "total": time.perf_counter() - wall}
        cpu_seconds = {**self.cpu_seconds, "total": time.process_time() - cpu}
        return {k: round(v, 4) for k, v in seconds.items()}, {k: round(v, 4) for k, v in cpu_seconds.items()}


@dataclass(frozen=True)
class Prepared:
    """A loaded, typed and analysed model, ready to be planned and rewritten any number of times
    (on copies: :meth:`replan`). `convert_model` rewrites its own preparation's model in place,
    so only a `Prepared` from :func:`prepare` stays reusable.

    Attributes:
        unchanged: The input's file while the prepared model still equals it (no IR version
            change, inlining, upgrade, fold or fusion), else None.
        notes: What the preparation steps said, in order.
    """

    loaded: Loaded
    reference: Reference
    typed: Typed
    normalized: Normalized
    analysis: Analysis
    unchanged: Path | None
    config: Config
    notes: tuple[str, ...]
    baseline: Baseline | None = None

    @property
    def model(self) -> ir.Model:
        return self.normalized.model

    @property
    def keys(self) -> dict[ir.Node, str]:
        return self.normalized.keys

    @property
    def profile(self) -> RuntimeProfile:
        return self.loaded.profile

    @property
    def target(self):  # noqa: ANN201 - LowPrecision
        return self.config.ops.target

    def plan_inputs(self, extra_fp32: Mapping[str, tuple[Category, str]] | None = None) -> PlanInputs:
        """The planner's inputs: the analyses' findings win over `extra_fp32`."""
        analysis = self.analysis
        forced = {**(extra_fp32 or {}), **analysis.forced}
        return PlanInputs(self.loaded.policy, self.loaded.profile, forced, analysis.wide, analysis.safe)

    def replan(
        self,
        extra_fp32: Mapping[str, tuple[Category, str]] | None = None,
        plan: str | Path | Mapping[str, object] | None = None,
    ) -> tuple[Planned, Rewritten]:
        """Plan a clean copy of the typed model and rewrite it: no reload, no type inference.

        Args:
            extra_fp32: Node key -> (category, reason) of more nodes to keep FP32.
            plan: A plan file (or its dict) to apply instead of the configured one.
        """
        model = value_types.carry(self.model, self.model.clone())
        copy_ranges(self.model, model)
        config = self.config if plan is None else self.config.with_options(plan=plan)
        planned = make_plan(model, node_keys(model), config, self.plan_inputs(extra_fp32))
        rewritten = rewrite(model, planned.plan, config)
        if self.baseline is not None:
            require_invariants(model, step="rewrite", baseline=self.baseline)
        return planned, rewritten

    def rewrite(
        self,
        extra_fp32: Mapping[str, tuple[Category, str]] | None = None,
        plan: str | Path | Mapping[str, object] | None = None,
    ) -> tuple[ir.Model, PrecisionPlan]:
        """:meth:`replan`'s model and plan."""
        planned, rewritten = self.replan(extra_fp32, plan)
        return rewritten.model, planned.plan


def _prepare(steps: Steps, source: object, config: Config, cleanup: contextlib.ExitStack) -> Prepared:
    """load -> reference -> inline -> upgrade -> fold -> type -> normalize -> analyze."""
    loaded = steps.run("load", load, source, config)
    if loaded.checks is not None:
        cleanup.callback(loaded.checks.close)
    steps.capture(loaded.model)
    # The FP32 model as given (an in-memory one is written before the upgrade changes its opset,
    # as a file input is read from its own): onnxruntime may lack kernels at a newer opset.
    ref = steps.run("reference", reference, loaded, loaded.model, config, cleanup)
    inlined = steps.run("inline", inline, loaded, config)
    steps.check("inline", inlined.model)
    if inlined.changed:
        ref = reference_inlined(ref, inlined.model, config, cleanup)
    upgraded = steps.run("upgrade", upgrade, loaded, config)
    model = upgraded.model
    steps.check("upgrade", model)
    folded = steps.run("fold", fold, model, loaded.profile, config)
    steps.check("fold", model)
    changed = loaded.changed or inlined.changed or upgraded.changed or folded.changed
    unchanged = None if changed else loaded.path
    if unchanged is None and loaded.checks is not None:
        loaded.checks.close()  # its inference is of the file, no longer of the model
    strict_failure = refuse_invalid_input(loaded) if loaded.checked else None
    checks = loaded.checks if unchanged is not None else None
    typed = steps.run("type", type_model, model, unchanged, loaded.policy, strict_failure, checks)
    steps.check("type", model)
    normalized = steps.run("normalize", normalize, typed, loaded.profile, loaded.policy, config)
    steps.check("normalize", normalized.model)
    analysis = steps.run("analyze", analyze, normalized, ref, config)
    steps.check("analyze", normalized.model)
    notes = (
        *loaded.notes, *inlined.notes, *upgraded.notes, *folded.notes, *typed.notes, *normalized.notes,
        *analysis.notes,
    )
    return Prepared(
        loaded, ref, typed, normalized, analysis, None if normalized.changed else unchanged, config, notes,
        steps.baseline,
    )


def prepare(source: object, config: Config) -> Prepared:
    """Run the preparation steps (no validation, no output)."""
    config = config.with_options(validate="none")
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(shared_reads())
        return _prepare(Steps(config), source, config, cleanup)


def convert_model(source: object, output: Path | None, config: Config) -> ConversionResult:
    """Convert `source` by `config`; publish to `output` only when every check passed."""
    steps = Steps(config)
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(shared_reads())  # one open file per data file for the weights read
        prepared = _prepare(steps, source, config, cleanup)
        model = prepared.model
        planned = steps.run("plan", make_plan, model, prepared.keys, config, prepared.plan_inputs())
        steps.check("plan", model)
        rewritten = steps.run("rewrite", rewrite, model, planned.plan, config)
        steps.check("rewrite", model)

        def report(extra: tuple[str, ...] = ()) -> Report:
            notes = (*prepared.notes, *planned.notes, *rewritten.notes, *extra)
            return steps.run("report", _report, prepared, planned, rewritten, output, notes)

        # The report is built while a child checks the staged model (its validation is added last).
        try:
            staged, checked, built = _save_and_validate(steps, prepared, rewritten, output, cleanup, report)
        except BeyondTolerance as failure:  # on generated inputs, perhaps for values out of range
            ranges = steps.run("validate", generated_overflow_ranges, failure.validation, prepared.reference, config)
            if ranges is None or not _keeps_more_fp32(ranges, planned.plan, config):
                raise
            return _plan_again_with_ranges(prepared, failure.validation, output, config, ranges, steps)
        if checked.rejection is not None:
            from mixprec.pipeline.repair import repair  # noqa: PLC0415

            if staged is not None:
                staged.discard()
            repaired = steps.run("repair", repair, checked.rejection, prepared, planned.plan)
            planned, rewritten = repaired.planned, repaired.rewritten
            staged, checked, _ = _save_and_validate(steps, prepared, rewritten, output, cleanup)
            if checked.rejection is not None:
                raise checked.rejection
            built = report((repaired.note,))
        assert checked.validation is not None and built is not None
        built.validation = checked.validation
        ranges = steps.run("validate", generated_overflow_ranges, checked.validation, prepared.reference, config)
        if ranges is not None and _keeps_more_fp32(ranges, planned.plan, config):
            return _plan_again_with_ranges(prepared, checked.validation, output, config, ranges, steps)
        if staged is not None and output is not None:  # last: nothing is written when a step fails
            steps.run("publish", staged.publish)
    built.seconds, built.cpu_seconds = steps.totals()
    return ConversionResult(rewritten.model, built, planned.plan, output, ranges=prepared.analysis.ranges)


def _plan_again_with_ranges(
    prepared: Prepared, first: Validation, output: Path | None, config: Config, ranges: RangeTable, steps: Steps
) -> ConversionResult:
    """Convert the FP32 model again with `ranges`, measured on the generated inputs the first
    conversion gained non-finite outputs on: what leaves the 16-bit range there stays FP32. The
    first conversion is not written; the report says why the second was made."""
    assert prepared.reference.path is not None  # the generated inputs ran it
    origin = next((n for n in first.notes if n.startswith("non-finite values start at ")), None)
    where = f" ({origin})" if origin else ""
    first_seconds, first_cpu = steps.totals()
    result = convert_model(prepared.reference.path, output, config.with_options(ranges=ranges))
    report = result.report
    report.source = str(prepared.loaded.path) if prepared.loaded.path is not None else "(in memory)"
    said = set(report.notes)
    report.notes = [
        *(note for note in prepared.loaded.notes if note not in said),  # what loading the input changed
        *report.notes,
        f"planned twice: the first plan gained non-finite outputs on the generated inputs{where}; the "
        f"values measured beyond the {config.ops.target.value} range on those inputs stay FP32 (--data "
        "measures the ranges of real inputs)",
    ]
    report.seconds = _added(first_seconds, report.seconds)
    report.cpu_seconds = _added(first_cpu, report.cpu_seconds)
    return dataclasses.replace(result, ranges=None)  # not measured on data


def _keeps_more_fp32(ranges: RangeTable, plan: PrecisionPlan, config: Config) -> bool:
    """Whether `ranges` put beyond the 16-bit range a value a node of `plan` computes or reads in
    16 bits (else a second plan would be the same)."""
    from mixprec.analysis.calibrate import range_evidence  # noqa: PLC0415

    target = config.ops.target
    wide = {name for name, rng in ranges.items() if rng.count and range_evidence(rng, target) is not None}
    return any(
        value is not None and value.name in wide
        for node in plan.order
        if plan.decisions[node].precision is Precision.LOW
        for value in (*node.inputs, *node.outputs)
    )


def _added(first: Mapping[str, float], second: Mapping[str, float]) -> dict[str, float]:
    """Per-step seconds of two runs, one after the other, added up (their totals too)."""
    return {k: round(first.get(k, 0.0) + second.get(k, 0.0), 4) for k in {**first, **second}}


def _save_and_validate(
    steps: Steps,
    prepared: Prepared,
    rewritten: Rewritten,
    output: Path | None,
    cleanup: contextlib.ExitStack,
    meanwhile: Callable[[], T] | None = None,
) -> tuple[StagedModel | None, Checked, T | None]:
    """save -> validate, with `meanwhile` run while a child checks the staged model; the
    staged file is removed when the run ends without publishing it."""
    config, ref, model = prepared.config, prepared.reference, rewritten.model
    checks = steps.run("validate", start_checker, model, ref)
    if checks is not None:
        cleanup.callback(checks.close)
    staged = steps.run("save", save, rewritten, output, ref, prepared.typed.declared, config, cleanup)
    if staged is not None:
        cleanup.callback(staged.discard)  # unless published by then
        if checks is not None:
            cleanup.callback(checks.close)  # before the staged file goes
        steps.check("save", model, staged)
        if checks is not None:
            checks.check_file(staged.path)
    done = meanwhile() if meanwhile is not None else None
    return staged, steps.run("validate", validate, staged, model, prepared.loaded, ref, config, checks), done


def _report(
    prepared: Prepared, planned: Planned, rewritten: Rewritten, output: Path | None, notes: tuple[str, ...]
) -> Report:
    """The report, from the results (its validation is added once the checks end)."""
    path = prepared.loaded.path
    return build_report(
        model=rewritten.model,
        plan=planned.plan,
        stats=rewritten.stats,
        source=str(path) if path is not None else "(in memory)",
        output=str(output) if output is not None else None,
        weight_bytes_before=prepared.reference.weights_before,
        weight_bytes_after=rewritten.weight_bytes,
        type_inference_warning=prepared.normalized.typeinfo.warning,
        profile=prepared.profile,
        notes=notes,
    )
