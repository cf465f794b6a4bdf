"""The public conversion API: orchestration of load, analysis, rewrite, save and validation."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.analysis.integer_semantics import integer_semantics
from mixprec.analysis.calibrate import BatchSource, RangeTable, wide_values_from_ranges
from mixprec.analysis.plan import Category, NodeMatcher, Precision, PrecisionPlan, plan_precision
from mixprec.analysis.plan import weights_only as weights_only_plan
from mixprec.graphs import walk_nodes
from mixprec.analysis.typeinfo import infer_types
from mixprec.dtypes import LowPrecision, parse_low_precision
from mixprec.errors import ConversionError, InputError, ModelLoadError, ValidationError
from mixprec.io import (
    check_output_path,
    load_model,
    save_model,
    uses_external_data,
    wants_external_data,
    weight_bytes,
)
from mixprec.passes.norm_blocks import fuse_norm_blocks
from mixprec.passes.opset import upgrade_for_target
from mixprec.passes.rewrite import apply_plan
from mixprec.policy.runtime import RuntimeProfile, load_runtime
from mixprec.policy.schemas import op_exists
from mixprec.policy.table import Policy, load_policy, parse_op_name
from mixprec.report import Report, build_report
from mixprec.validate.check import RuntimeRejection, validate_staged
from mixprec.validate.checker import checker_error, input_problem
from mixprec.validate.isolated import run_isolated
from mixprec.validate.repair import find_culprits

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
    runtime: str | None = None,
    weights_only: bool = False,
    allow_invalid: bool = False,
    overwrite: bool = False,
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
            converter). Default: upgrade only when the model's compute-bound ops admit the
            target type at a newer opset (bfloat16 Conv and pooling: 22).
        runtime: The runtime the model is deployed to (`mixprec.policy.runtime.RUNTIMES`,
            default `ort-cuda`): a node converts only where the runtime has a 16-bit kernel
            for it; `onnx` lets the ONNX schema alone decide.
        weights_only: Store the weights in the 16-bit type and compute everything in FP32 (for
            runtimes without 16-bit compute for the model's heavy ops: half the file, FP32
            speed).
        allow_invalid: Convert a model the ONNX checker rejects (by default that is a
            `ModelLoadError` naming the checker's first problem).
        overwrite: Allow `output` to be the input model's own file (replaced only once the new
            model is complete and checked).
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
    options = dict(
        target_dtype=target_dtype, low_precision_ops=list(low_precision_ops), fp32_ops=list(fp32_ops),
        follow_ops=list(follow_ops), exclude_nodes=list(exclude_nodes), keep_io_types=keep_io_types,
        policy_file=policy_file, validate=validate, data=data, max_batches=max_batches,
        tolerance=tolerance, external_data=external_data, opset=opset, progress=progress,
        calibrate=calibrate, plan_source=plan, ranges=ranges, runtime=runtime,
        weights_only=weights_only, allow_invalid=allow_invalid,
    )
    if output is not None:
        _check_output(model, output, overwrite)
    with _gc_paused():
        try:
            return _convert(model, output, **options)
        except RuntimeRejection as rejection:
            try:
                return _repair(rejection, output, options)
            finally:
                rejection.cleanup()


def _check_output(model: object, output: str | os.PathLike, overwrite: bool) -> None:
    """Refuse an unwritable output, and the input's own file unless `overwrite`."""
    destination = check_output_path(output)
    if isinstance(model, (str, os.PathLike)) and destination.exists() and Path(model).exists():
        if os.path.samefile(destination, model) and not overwrite:
            raise InputError(
                f"{destination} is the input model: choose another output, or pass --overwrite "
                "(the input is replaced only once the new model is complete)"
            )


def _repair(rejection: RuntimeRejection, output: str | os.PathLike | None, options: dict) -> ConversionResult:
    """Keep FP32 the fewest converted nodes that make onnxruntime load (and run) the model."""
    source, outcome = rejection.reference, rejection.outcome
    if source is None or not rejection.converted:
        raise rejection
    # The input passed its checks already; trials only convert.
    trial_options = {**options, "validate": "none", "ranges": rejection.ranges, "progress": False, "allow_invalid": True}
    what = "crashes on" if outcome.crashed else "fails on"
    reason = f"onnxruntime (CPU provider, default options) {what} the model with this node in 16 bits: {outcome.error}"

    def fails(kept: frozenset[str]) -> bool:
        trial = _convert(source, None, **trial_options, runtime_fp32=dict.fromkeys(kept, reason))
        with tempfile.TemporaryDirectory(prefix="mixprec-repair-") as tmp:
            path = Path(tmp) / "trial.onnx"
            save_model(trial.model, path, external_data=wants_external_data(trial.model))
            return not run_isolated(path, rejection.feeds).ok

    logger.warning("%s; searching for the nodes to keep FP32", rejection)
    culprits = find_culprits(rejection.converted, fails)
    if culprits.names is None:
        raise ConversionError(f"{rejection}; it fails even with every converted node FP32") from rejection
    result = _convert(
        source, output, **{**options, "ranges": rejection.ranges}, runtime_fp32=dict.fromkeys(culprits.names, reason)
    )
    result.report.notes.append(
        f"onnxruntime {what} the first conversion ({outcome.error}); kept {len(culprits.names)} node(s) "
        f"FP32 after {culprits.trials} trial conversion(s): {', '.join(culprits.names[:5])}"
        + (" ..." if len(culprits.names) > 5 else "")
    )
    return result


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
    runtime: str | None = None,
    runtime_fp32: Mapping[str, str] | None = None,
    weights_only: bool = False,
    allow_invalid: bool = False,
) -> ConversionResult:
    """One conversion; `runtime_fp32`: plan keys of nodes kept FP32 because the runtime fails
    on them in 16 bits, with the reason (see `_repair`)."""
    times: dict[str, float] = {}
    start = time.perf_counter()
    target = parse_low_precision(target_dtype)
    level_requested = validate
    ir_model, source_path = load_model(model)
    original_proto = model if isinstance(model, onnx.ModelProto) else None
    notes = _normalize_ir_version(ir_model)
    profile = load_runtime(runtime)

    def original_checker_error() -> str | None:
        if source_path is not None:
            return checker_error(source_path)
        return checker_error(original_proto) if original_proto is not None else None

    if not allow_invalid and (source_path is not None or original_proto is not None):
        problem = input_problem(source_path if source_path is not None else original_proto)  # type: ignore[arg-type]
        if problem is not None:
            where = source_path or "the given ModelProto"
            raise ModelLoadError(
                f"{where}: not a valid ONNX model: {problem} (fix it, or convert it anyway with "
                "--allow-invalid / allow_invalid=True)"
            )
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
    unchanged_source = source_path
    upgraded = upgrade_for_target(ir_model, opset, policy, target, profile, notes)
    if upgraded is not None:
        ir_model, unchanged_source = upgraded, None

    reference_dir: tempfile.TemporaryDirectory[str] | None = None
    reference_path = source_path
    weights_before = weight_bytes(ir_model)
    input_external = uses_external_data(ir_model)
    level = _resolve_validation(level_requested, ir_model, weights_before)
    calibrating = data is not None and calibrate and ranges is None
    if data is not None:
        # One re-iterable source for calibration and validation (paths are re-read per pass).
        inputs = [v.name for v in ir_model.graph.inputs if v.name not in ir_model.graph.initializers]
        data = BatchSource(data, inputs, max_batches)
    if (level in ("run", "load") or calibrating) and reference_path is None:
        # In-memory input: keep an FP32 copy on disk for the reference run.
        reference_dir = tempfile.TemporaryDirectory(prefix="mixprec-ref-")
        reference_path = Path(reference_dir.name) / "reference.onnx"
        big = weights_before > _RUN_MAX_WEIGHT_BYTES  # calibration runs at any size
        ir.save(ir_model, reference_path, external_data="reference.onnx.data" if big else None)

    try:
        t = time.perf_counter()
        typeinfo = infer_types(ir_model, source=unchanged_source)
        blocks = fuse_norm_blocks(ir_model)
        if blocks.fused:
            notes.append(
                f"fused {len(blocks.fused)} decomposed normalization(s) into single ops with FP32 "
                f"accumulation (stash_type=1): {', '.join(blocks.fused[:5])}" + (" ..." if len(blocks.fused) > 5 else "")
            )
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
        forced = {**{n: (Category.NORM_BLOCK, r) for n, r in blocks.kept.items()}, **forced}
        if runtime_fp32:
            from mixprec.plan_file import model_node_names  # noqa: PLC0415

            by_name = model_node_names(ir_model)
            forced = {
                **{by_name[n]: (Category.RUNTIME_FAILURE, r) for n, r in runtime_fp32.items() if n in by_name},
                **forced,
            }

        def make_plan(extra: Mapping[ir.Node, tuple] | None = None) -> PrecisionPlan:
            # Analyses' reasons (integer semantics) win over a plan's.
            return plan_precision(
                ir_model, policy, exclude_nodes=matcher, keep_io_types=keep_io_types,
                forced_fp32={**(extra or {}), **forced}, wide_values=wide_values, runtime=profile,
            )

        requested = None
        if plan_source is not None:
            from mixprec.plan_file import load_plan  # noqa: PLC0415

            requested = load_plan(plan_source)
            plan = requested.apply(ir_model, make_plan)
        else:
            plan = make_plan()
        if weights_only:
            plan = weights_only_plan(plan)
        else:
            notes.extend(_nothing_worth_converting(plan, policy, profile))
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
            profile=profile,
        )
        report.notes.extend(notes)

        def check(staged: Path) -> None:
            t0 = time.perf_counter()
            try:
                report.validation = validate_staged(
                    staged, reference_path, target, level, data, max_batches, tolerance,
                    original_checker_error, weights_large=weights_before > _RUN_MAX_WEIGHT_BYTES,
                    runtime=profile.name,
                )
            except RuntimeRejection as rejection:
                # Hand what a repair needs to `convert`, which owns the search.
                rejection.reference, rejection.ranges = reference_path, ranges
                rejection.converted = _converted_names(plan)
                rejection.keep(reference_dir)
                raise
            report.validation.seconds = time.perf_counter() - t0

        t = time.perf_counter()
        if external_data is None and (output is not None or level != "none"):
            # save_model's default, from the weights already counted for the report; the input
            # used external data if it did before its weights were rewritten.
            external_data = input_external or wants_external_data(ir_model, weights_after)
        if output is not None:
            save_model(ir_model, output, external_data=external_data, check=check, progress=progress)
        elif level != "none":
            with tempfile.TemporaryDirectory(prefix="mixprec-out-") as tmp:
                save_model(ir_model, Path(tmp) / "model.onnx", external_data=external_data, check=check)
        times["save_and_validate"] = time.perf_counter() - t
    except RuntimeRejection:
        reference_dir = None  # the rejection owns it now
        raise
    finally:
        if reference_dir is not None:
            reference_dir.cleanup()
    times["total"] = time.perf_counter() - start
    report.seconds = {k: round(v, 4) for k, v in times.items()}
    return ConversionResult(
        ir_model, report, plan, Path(output) if output is not None else None, ranges=ranges
    )


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


def _converted_names(plan: PrecisionPlan) -> list[str]:
    """Plan keys of the nodes computing in 16 bits, in topological order."""
    from mixprec.plan_file import node_names  # noqa: PLC0415

    names = node_names(plan.order)
    return [names[n] for n in plan.order if plan.decisions[n].precision is Precision.LOW]


def _nothing_worth_converting(plan: PrecisionPlan, policy: Policy, profile: RuntimeProfile) -> list[str]:
    """A note when the runtime left every compute-bound op FP32: suggest weights-only."""
    heavy = [
        node for node, d in plan.decisions.items()
        if (rule := policy.rule_for(node.domain, node.op_type)) is not None and rule.compute_bound
        and d.precision is not Precision.NONE
    ]
    if not heavy or any(plan.decisions[n].precision is Precision.LOW for n in heavy):
        return []
    blocked = sorted({
        n.op_type for n in heavy
        if plan.decisions[n].category is Category.RUNTIME or not profile.runs_in(n.domain, n.op_type, plan.target.type_str)
    })
    if not blocked:
        return []
    return [
        f"nothing worth converting on {profile.name}: it has no {plan.target.value} kernel for "
        f"{', '.join(blocked)}; --weights-only stores the weights in {plan.target.value} (half the "
        "file) and computes in FP32"
    ]
