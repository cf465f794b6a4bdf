"""The public conversion API: orchestration of load, analysis, rewrite, save and validation."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.analysis.integer_semantics import integer_semantics
from mixprec.analysis.calibrate import BatchSource, RangeTable, wide_values_from_ranges
from mixprec.analysis.plan import NodeMatcher, PrecisionPlan, plan_precision
from mixprec.graphs import walk_nodes
from mixprec.analysis.typeinfo import infer_types
from mixprec.dtypes import LowPrecision, parse_low_precision
from mixprec.errors import ConversionError, InputError, ValidationError
from mixprec.io import (
    graph_only_proto,
    load_model,
    save_model,
    uses_external_data,
    wants_external_data,
    weight_bytes,
)
from mixprec.passes.rewrite import apply_plan
from mixprec.policy.schemas import op_exists
from mixprec.policy.table import Policy, load_policy, parse_op_name
from mixprec.report import OutputError, Report, Validation, build_report
from mixprec.validate.checker import check_model_file, checker_error

logger = logging.getLogger(__name__)

# Automatic validation runs the models only below these sizes (session creation and weight
# loading dominate otherwise); above them it runs the checker only.
_RUN_MAX_WEIGHT_BYTES = 1 << 30
_RUN_MAX_NODES = 5000
# Up to this many nodes auto validation at least creates an onnxruntime session (graph
# optimizations off: about 0.2 ms per node here) to prove the model loads.
_LOAD_MAX_NODES = 50000

Batch = Mapping[str, np.ndarray]


@dataclass
class ConversionResult:
    """The converted model and the report of what was done."""

    model: ir.Model
    report: Report
    plan: PrecisionPlan
    output_path: Path | None
    ranges: RangeTable | None = None  # FP32 ranges measured on `data` (calibration)


def build_policy(
    target: LowPrecision,
    *,
    policy_file: str | os.PathLike | None = None,
    low_precision_ops: Iterable[str] = (),
    fp32_ops: Iterable[str] = (),
    follow_ops: Iterable[str] = (),
) -> Policy:
    """Load the op policy for `target` and apply the user's class overrides."""
    return load_policy(target, policy_file).with_overrides(
        low_precision_ops=low_precision_ops, fp32_ops=fp32_ops, follow_ops=follow_ops
    )


def _check_user_ops(model: ir.Model, names: Iterable[str]) -> None:
    names = list(names)
    if not names:
        return
    in_model = {(n.domain if n.domain != "ai.onnx" else "", n.op_type) for n in walk_nodes(model.graph)}
    for function in model.functions.values():
        in_model.update((n.domain, n.op_type) for n in function)
    for name in names:
        domain, op_type = parse_op_name(name)
        if (domain, op_type) not in in_model and not op_exists(op_type, domain):
            raise InputError(
                f"unknown op {name!r} in an op list: it is neither an ONNX op nor used in the model"
            )


def _upgrade_opset(model: ir.Model, opset: int) -> tuple[ir.Model, str | None]:
    """Upgrade the default-domain opset with the ONNX version converter."""
    import onnx.version_converter  # noqa: PLC0415

    current = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if current is None or current >= opset:
        return model, None
    if uses_external_data(model):
        raise InputError(
            "opset upgrade of a model with external data is not supported; upgrade it first "
            "with onnx.version_converter"
        )
    try:
        upgraded = onnx.version_converter.convert_version(ir.to_proto(model), opset)
    except Exception as e:  # noqa: BLE001
        raise InputError(f"cannot upgrade the model from opset {current} to {opset}: {e}") from e
    return ir.from_proto(upgraded), f"opset upgraded from {current} to {opset}"


def _normalize_ir_version(model: ir.Model) -> list[str]:
    """IR < 4 lists every initializer as a graph input; treat them as constants (IR 4)."""
    if model.ir_version >= 4:
        return []
    initializers = set(model.graph.initializers.values())
    inputs = [v for v in model.graph.inputs if v not in initializers]
    removed = len(model.graph.inputs) - len(inputs)
    model.graph.inputs.clear()
    model.graph.inputs.extend(inputs)
    old = model.ir_version
    model.ir_version = 4
    return [f"IR version {old} -> 4: {removed} initializer(s) no longer listed as graph inputs"]


def _resolve_validation(validate: bool | str, model: ir.Model, weights: int) -> str:
    if validate is False or validate == "none":
        return "none"
    if validate is True or validate == "auto":
        nodes = len(walk_nodes(model.graph))
        if nodes <= _RUN_MAX_NODES and weights <= _RUN_MAX_WEIGHT_BYTES:
            return "run"
        return "load" if nodes <= _LOAD_MAX_NODES else "checker"
    if validate in ("checker", "load", "run"):
        return str(validate)
    raise InputError(f"unknown validation level {validate!r}: use auto, run, load, checker or none")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: graph passes allocate millions of small objects, and
    full collections over a 100k-node graph would otherwise dominate (reference counting still
    frees everything; cycles are collected once the collector is back on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def convert(
    model: str | os.PathLike | onnx.ModelProto | ir.Model,
    output: str | os.PathLike | None = None,
    *,
    target_dtype: str | LowPrecision = "float16",
    low_precision_ops: Iterable[str] = (),
    fp32_ops: Iterable[str] = (),
    follow_ops: Iterable[str] = (),
    exclude_nodes: Sequence[str] = (),
    keep_io_types: bool = True,
    policy_file: str | os.PathLike | None = None,
    validate: bool | str = True,
    data: str | os.PathLike | Iterable[Batch] | None = None,
    max_batches: int = 8,
    calibrate: bool = True,
    tolerance: tuple[float, float] | None = None,
    external_data: bool | None = None,
    opset: int | None = None,
    progress: bool | None = False,
    plan: str | os.PathLike | Mapping[str, object] | None = None,
    ranges: RangeTable | None = None,
) -> ConversionResult:
    """Convert an FP32 ONNX model to mixed precision.

    Args:
        model: Path to an .onnx file, an `onnx.ModelProto`, or an `onnx_ir.Model` (converted in
            place).
        output: Where to save the result; nothing is written when the conversion or its
            validation fails.
        target_dtype: "float16"/"fp16" or "bfloat16"/"bf16".
        low_precision_ops: Ops (`Op` or `domain::Op`) put in the low-precision class.
        fp32_ops: Ops kept in FP32.
        follow_ops: Ops that follow the widest type of their inputs.
        exclude_nodes: Node names or regular expressions (`re.search`) of nodes kept in FP32.
        keep_io_types: Keep FP32 model inputs and outputs in FP32.
        policy_file: A TOML policy table to use instead of the shipped one.
        validate: "auto"/True: the ONNX checker always; for models with at most 1 GiB of
            weights, onnxruntime runs and compares both models (up to 5,000 nodes) or creates
            a session to prove the model loads (up to 50,000 nodes). Or force "run", "load",
            "checker", or "none"/False.
        data: Input batches for calibration and the numeric check: a `.npz` file, a folder of
            them or of ONNX `test_data_set_N`, a list of such paths, or an iterable of dicts
            (or a callable returning one). Default: generated inputs, no calibration.
        max_batches: At most this many batches are used for calibration and the numeric check.
        calibrate: With `data`, first measure the range of every FP32 value on it (one FP32
            run, see `mixprec.analysis.calibrate`); values that leave the 16-bit range keep
            their producers in FP32 (category "range measured on data").
        tolerance: (atol, rtol) that every output must meet, else `ConversionError`.
        external_data: Force (True) or forbid (False) external data for the output; default:
            when weights exceed 1 GiB or the input used external data.
        progress: Show progress lines for long steps on stderr (None: when it is a terminal).
        opset: Upgrade the model to this default-domain opset first (with the ONNX version
            converter), e.g. 22 so that Conv and pooling admit bfloat16.
        ranges: FP32 ranges measured before (`mixprec.analysis.calibrate.calibrate`): used
            instead of calibrating on `data`.
        plan: A plan file (`mixprec.plan_file.save_plan`) or its dict: its `fp32` nodes are
            kept FP32 ("set by plan"), its `low` nodes are left to the planner (a note lists
            those it keeps FP32). A node name absent from the model is an `InputError`.

    Returns:
        The converted model, the plan and the report.

    Raises:
        MixprecError: A bad argument or model, or a converted model that fails validation.
    """
    with _gc_paused():
        return _convert(
            model, output, target_dtype=target_dtype, low_precision_ops=low_precision_ops,
            fp32_ops=fp32_ops, follow_ops=follow_ops, exclude_nodes=exclude_nodes,
            keep_io_types=keep_io_types, policy_file=policy_file, validate=validate, data=data,
            max_batches=max_batches, tolerance=tolerance, external_data=external_data,
            opset=opset, progress=progress, calibrate=calibrate, plan_source=plan, ranges=ranges,
        )


def _convert(
    model: str | os.PathLike | onnx.ModelProto | ir.Model,
    output: str | os.PathLike | None,
    *,
    target_dtype: str | LowPrecision,
    low_precision_ops: Iterable[str],
    fp32_ops: Iterable[str],
    follow_ops: Iterable[str],
    exclude_nodes: Sequence[str],
    keep_io_types: bool,
    policy_file: str | os.PathLike | None,
    validate: bool | str,
    data: str | os.PathLike | Iterable[Batch] | None,
    max_batches: int,
    tolerance: tuple[float, float] | None,
    external_data: bool | None,
    opset: int | None,
    progress: bool | None,
    calibrate: bool = True,
    plan_source: str | os.PathLike | Mapping[str, object] | None = None,
    ranges: RangeTable | None = None,
) -> ConversionResult:
    times: dict[str, float] = {}
    start = time.perf_counter()
    target = parse_low_precision(target_dtype)
    level_requested = validate
    ir_model, source_path = load_model(model)
    original_proto = model if isinstance(model, onnx.ModelProto) else None
    notes = _normalize_ir_version(ir_model)
    unchanged_source = source_path
    if opset is not None:
        ir_model, upgrade_note = _upgrade_opset(ir_model, opset)
        if upgrade_note:
            notes.append(upgrade_note)
            unchanged_source = None

    def original_checker_error() -> str | None:
        if source_path is not None:
            return checker_error(source_path)
        return checker_error(original_proto) if original_proto is not None else None

    times["load"] = time.perf_counter() - start
    low_precision_ops, fp32_ops, follow_ops = list(low_precision_ops), list(fp32_ops), list(follow_ops)
    _check_user_ops(ir_model, [*low_precision_ops, *fp32_ops, *follow_ops])
    policy = build_policy(
        target,
        policy_file=policy_file,
        low_precision_ops=low_precision_ops,
        fp32_ops=fp32_ops,
        follow_ops=follow_ops,
    )
    matcher = NodeMatcher(exclude_nodes)

    reference_dir: tempfile.TemporaryDirectory[str] | None = None
    reference_path = source_path
    weights_before = weight_bytes(ir_model)
    level = _resolve_validation(level_requested, ir_model, weights_before)
    calibrating = data is not None and calibrate and ranges is None
    if data is not None:
        # One re-iterable source for calibration and validation (paths are re-read per pass).
        inputs = [v.name for v in ir_model.graph.inputs if v.name not in ir_model.graph.initializers]
        data = BatchSource(data, inputs, max_batches)
    if (level == "run" or calibrating) and reference_path is None:
        # In-memory input: keep an FP32 copy on disk for the reference run.
        reference_dir = tempfile.TemporaryDirectory(prefix="mixprec-ref-")
        reference_path = Path(reference_dir.name) / "reference.onnx"
        big = weights_before > _RUN_MAX_WEIGHT_BYTES  # calibration runs at any size
        ir.save(ir_model, reference_path, external_data="reference.onnx.data" if big else None)

    try:
        t = time.perf_counter()
        typeinfo = infer_types(ir_model, source=unchanged_source)
        times["types"] = time.perf_counter() - t
        wide_values = None
        if ranges is not None:
            wide_values = wide_values_from_ranges(ir_model, ranges, target)
            notes.append(f"{len(wide_values)} value(s) measured beyond the {target.value} range stay FP32")
        elif calibrating:
            t = time.perf_counter()
            ranges, wide_values = _calibrate(reference_path, data, ir_model, target, progress, notes)
            times["calibrate"] = time.perf_counter() - t
        t = time.perf_counter()
        forced = integer_semantics(ir_model, target)

        def make_plan(extra: Mapping[ir.Node, tuple] | None = None) -> PrecisionPlan:
            # Analyses' reasons (integer semantics) win over a plan's.
            return plan_precision(
                ir_model, policy, exclude_nodes=matcher, keep_io_types=keep_io_types,
                forced_fp32={**(extra or {}), **forced}, wide_values=wide_values,
            )

        requested = None
        if plan_source is not None:
            from mixprec.plan_file import load_plan  # noqa: PLC0415

            requested = load_plan(plan_source)
            plan = requested.apply(ir_model, make_plan)
        else:
            plan = make_plan()
        unused = matcher.unused()
        if unused:
            raise InputError(f"--exclude-node pattern {unused[0]!r} matches no node in the model")
        if requested is not None:
            for note in requested.notes(ir_model, plan):
                logger.warning("%s", note)
                notes.append(note)
        times["plan"] = time.perf_counter() - t
        t = time.perf_counter()
        stats = apply_plan(ir_model, plan)
        times["rewrite"] = time.perf_counter() - t
        weights_after = weight_bytes(ir_model)
        report = build_report(
            model=ir_model,
            plan=plan,
            stats=stats,
            source=str(source_path) if source_path else "(in memory)",
            output=str(output) if output is not None else None,
            weight_bytes_before=weights_before,
            weight_bytes_after=weights_after,
            type_inference_warning=typeinfo.warning,
        )

        report.notes.extend(notes)

        def check(staged: Path) -> None:
            t0 = time.perf_counter()
            report.validation = _validate(
                staged, reference_path, target, level, data, max_batches, tolerance,
                original_checker_error, weights_large=weights_before > _RUN_MAX_WEIGHT_BYTES,
            )
            report.validation.seconds = time.perf_counter() - t0

        t = time.perf_counter()
        if external_data is None and (output is not None or level != "none"):
            # save_model's default, from the weights already counted for the report.
            external_data = wants_external_data(ir_model, weights_after)
        if output is not None:
            save_model(ir_model, output, external_data=external_data, check=check, progress=progress)
        elif level != "none":
            with tempfile.TemporaryDirectory(prefix="mixprec-out-") as tmp:
                save_model(ir_model, Path(tmp) / "model.onnx", external_data=external_data, check=check)
        times["save_and_validate"] = time.perf_counter() - t
    finally:
        if reference_dir is not None:
            reference_dir.cleanup()
    times["total"] = time.perf_counter() - start
    report.seconds = {k: round(v, 4) for k, v in times.items()}
    return ConversionResult(
        ir_model, report, plan, Path(output) if output is not None else None, ranges=ranges
    )


def _validate(
    path: Path,
    reference: Path | None,
    target: LowPrecision,
    level: str,
    data: str | os.PathLike | Iterable[Batch] | None,
    max_batches: int,
    tolerance: tuple[float, float] | None,
    original_checker_error: Callable[[], str | None] | None = None,
    *,
    weights_large: bool = False,
) -> Validation:
    """Check a staged converted model; raise ConversionError to stop it being published."""
    from mixprec.validate import compare, data as data_mod, runner  # noqa: PLC0415

    result = Validation()
    if level == "none":
        return result
    inherited = check_model_file(path, original_checker_error)
    if inherited is None:
        result.checker = "passed"
    else:
        result.checker = "fails as the FP32 model does"
        result.notes.append(f"the FP32 model fails the ONNX checker the same way: {inherited}")
    if level == "checker":
        result.notes.append(
            "onnxruntime load check not run at validation level 'checker' (auto picks it above 50,000 nodes)"
        )
        return result
    if level == "load":
        if target is LowPrecision.BFLOAT16:
            result.notes.append("no load check for bfloat16: onnxruntime's CPU provider lacks bf16 kernels")
            return result
        load_path = path
        if weights_large:
            # Prove the graph loads without reading gigabytes of weights: they become inputs.
            load_path = path.with_name("graph_only.onnx")
            onnx.save(graph_only_proto(path), str(load_path))
            result.notes.append("onnxruntime load check on the graph with weights as inputs")
        try:
            runner.make_session(load_path, graph_optimization="disable")
        except ValidationError as e:
            _blame_reference(reference, e, result)
            return result
        result.runtime = "loaded"
        return result
    from mixprec.validate.emulate import emulate_low_precision  # noqa: PLC0415

    # Numerics are measured on the emulated model (each 16-bit value computed in FP32 and
    # rounded): onnxruntime's CPU provider has no bfloat16 kernels, and runs most float16 ops
    # in FP32 internally, which would hide float16 overflow. A float16 model also runs for real.
    real_session = None
    if target is LowPrecision.FLOAT16:
        try:
            real_session = runner.make_session(path, graph_optimization="disable")
        except ValidationError as e:
            _blame_reference(reference, e, result)
            return result
    candidate_path = path.with_name("emulated.onnx")
    onnx.save(emulate_low_precision(onnx.load(str(path))), str(candidate_path))
    result.runtime = "emulated"
    result.notes.append(
        f"{target.value} numerics measured on an emulated model (FP32 compute, {target.short_name} rounding)"
    )
    try:
        candidate = runner.make_session(candidate_path, graph_optimization="disable")
    except ValidationError as e:
        _blame_reference(reference, e, result)
        return result
    reference_session = None
    if reference is not None:
        try:
            reference_session = runner.make_session(reference, graph_optimization="disable")
        except ValidationError as e:
            result.runtime = "reference-fails"
            result.notes.append(f"the FP32 model does not load in onnxruntime: {e}")
    if reference_session is None:
        result.runtime = "loaded" if result.runtime == "skipped" else result.runtime
        return result
    merged: list | None = None
    nonfinite_feeds = None  # the first batch with new non-finite outputs
    batches = _batches(data, reference, reference_session, data_mod, max_batches)
    for feeds in batches:
        try:
            expected = runner.run_session(reference_session, feeds)
        except ValidationError as e:
            result.runtime = "reference-fails"
            result.notes.append(f"the FP32 model fails to run: {e}")
            return result
        try:
            if real_session is not None and result.batches == 0:
                runner.run_session(real_session, feeds)
                result.runtime = "ran and emulated"
            actual = runner.run_session(candidate, feeds)
        except ValidationError as e:
            raise ConversionError(f"the converted model fails to run in onnxruntime: {e}") from e
        comparison = compare.compare_outputs(expected, actual)
        if nonfinite_feeds is None and any(c.new_nonfinite for c in comparison):
            nonfinite_feeds = feeds
        merged = comparison if merged is None else compare.merge(merged, comparison)
        result.batches += 1
    if result.runtime == "skipped":
        result.runtime = "ran"
    for c in merged or []:
        within = c.within(*tolerance) if tolerance is not None else None
        result.outputs.append(
            OutputError(c.name, float(c.max_abs_error), float(c.max_rel_error), int(c.nan_count), int(c.inf_count), int(c.new_nonfinite), within)
        )
        if c.new_nonfinite:
            result.notes.append(
                f"output {c.name!r} has {c.new_nonfinite} non-finite value(s) where the FP32 model has none"
            )
    origin = None
    if nonfinite_feeds is not None and reference is not None:
        origin = _nan_origin_note(reference, path, nonfinite_feeds, target)
        result.notes.append(origin)
    if tolerance is not None:
        failing = [o.name for o in result.outputs if o.within_tolerance is False]
        if failing:
            raise ConversionError(
                f"output {failing[0]!r} differs from the FP32 model beyond atol={tolerance[0]}, "
                f"rtol={tolerance[1]}" + (f"; {origin}" if origin else "")
            )
    return result


def _batches(data, reference: Path, session, data_mod, max_batches: int):  # type: ignore[no-untyped-def]
    names = [i.name for i in session.get_inputs()]
    if data is None:
        specs = data_mod.input_specs(onnx.load(str(reference), load_external_data=False))
        yield data_mod.generate_inputs(specs, seed=0)
        return
    iterator = data_mod.load_batches(data, names) if isinstance(data, (str, os.PathLike)) else iter(data)
    for index, batch in enumerate(iterator):
        if index >= max_batches:
            return
        yield batch


def _blame_reference(reference: Path | None, error: ValidationError, result: Validation) -> None:
    from mixprec.validate import runner  # noqa: PLC0415

    if reference is not None:
        try:
            runner.make_session(reference, graph_optimization="disable")
        except ValidationError:
            result.runtime = "reference-fails"
            result.notes.append("neither the FP32 nor the converted model loads in onnxruntime")
            return
    raise ConversionError(f"the converted model does not load in onnxruntime: {error}") from error


def _calibrate(
    reference: Path,
    data: BatchSource,
    model: ir.Model,
    target: LowPrecision,
    progress: bool | None,
    notes: list[str],
) -> tuple[RangeTable | None, dict[ir.Value, str] | None]:
    """Measure FP32 ranges on `data`; the values that leave the 16-bit range, with evidence."""
    from mixprec.analysis.calibrate import calibrate  # noqa: PLC0415

    try:
        table = calibrate(reference, data, progress=progress)
    except ValidationError as e:
        notes.append(f"calibration skipped: the FP32 model does not run in onnxruntime: {e}")
        return None, None
    wide = wide_values_from_ranges(model, table, target)
    notes.append(
        f"calibration: {len(table)} FP32 values measured on {table.batches} batch(es) in "
        f"{table.runs} run(s); {len(wide)} leave the {target.value} range and stay FP32"
    )
    return table, wide


def _nan_origin_note(reference: Path, converted: Path, feeds: Batch, target: LowPrecision) -> str:
    """A note naming the node where new non-finite values start (see `find_nan_origin`)."""
    from mixprec.errors import MixprecError  # noqa: PLC0415
    from mixprec.validate.nan_origin import find_nan_origin  # noqa: PLC0415

    try:
        origin = find_nan_origin(reference, converted, feeds, target=target)
    except MixprecError as e:
        return f"could not locate where the non-finite values start: {e}"
    if origin is None:
        return "the non-finite values could not be traced to a main-graph node"
    return f"non-finite values start at {origin.describe()}"
