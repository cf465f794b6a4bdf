"""One conversion as a pipeline of named steps, each timed in the report.

    load -> upgrade -> fold -> type -> analyze -> plan -> rewrite -> report -> save -> validate -> publish

Data flows one way: every step reads what earlier steps left in the :class:`Conversion` and adds
its own part. The model is typed once (one ONNX shape inference) and every later step works on
that typed model. Analyses record their findings by stable node key and value name (see
:func:`mixprec.graphs.node_keys`), so a plan can be made and applied again on a clean copy of
the typed model (:meth:`Prepared.rewrite`, used by the accuracy search) without reloading or
re-inferring anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir

from mixprec.analysis.calibrate import RangeTable, measured_values
from mixprec.analysis.integer_semantics import integer_semantics
from mixprec.plan.qdq_pairs import keep_pairs as keep_qdq_pairs
from mixprec.analysis.typeinfo import TypeInfo, assume_float_outputs, infer_types, retype_after_upgrade, untyped_values
from mixprec.config import Config
from mixprec.errors import InputError, ModelLoadError, RunError
from mixprec.graphs import main_values, node_keys, walk_nodes
from mixprec.io import load_model, staged_save, typed_values, uses_external_data, wants_external_data, weight_bytes
from mixprec.passes.fold_dequantize import fold_constant_dequantizations
from mixprec.passes.norm_blocks import fuse_norm_blocks, opset_for_fusion
from mixprec.passes.norm_scales import FoldedScales, fold_norm_scales
from mixprec.passes.opset import upgrade_for_target, upgrade_opset
from mixprec.passes.rewrite import RewriteStats, apply_plan
from mixprec.passes.split_dequantize import split_shared_dequantizations
from mixprec.plan.model import Category, NodeMatcher, Precision, PrecisionPlan
from mixprec.plan.planner import plan_precision
from mixprec.plan.planner import weights_only as weights_only_plan
from mixprec.policy.profiles import RuntimeProfile, load_runtime
from mixprec.policy.schemas import op_exists
from mixprec.policy.table import Policy, load_policy, parse_op_name
from mixprec.report import Report, build_report
from mixprec.runtime.batches import BatchSource
from mixprec.validate.staged import RuntimeRejection, validate_staged
from mixprec.validate.checker import checker_error, input_problem
from mixprec.validate.invariants import Baseline, require_invariants, steps_checked

logger = logging.getLogger(__name__)

# Automatic validation runs the models only below these sizes (session creation and weight
# loading dominate otherwise); above them it runs the checker only.
RUN_MAX_WEIGHT_BYTES = 1 << 30
RUN_MAX_NODES = 5000
# Up to this many nodes auto validation at least creates an onnxruntime session to prove the
# model loads.
LOAD_MAX_NODES = 50000

@dataclass
class Conversion:
    """What one conversion carries from step to step."""

    source: object  # a path, an onnx.ModelProto or an ir.Model
    output: Path | None
    config: Config
    runtime_fp32: Mapping[str, str] = field(default_factory=dict)  # node key -> reason
    stop_after: str | None = None
    # load
    model: ir.Model = None  # type: ignore[assignment]
    source_path: Path | None = None
    unchanged_source: Path | None = None  # the file `model` still equals (parsed faster)
    notes: list[str] = field(default_factory=list)
    profile: RuntimeProfile = None  # type: ignore[assignment]
    policy: Policy = None  # type: ignore[assignment]
    weights_before: int = 0
    input_external: bool = False
    level: str = "none"
    data: BatchSource | None = None
    reference_path: Path | None = None
    reference_dir: tempfile.TemporaryDirectory[str] | None = None
    # type
    typeinfo: TypeInfo | None = None
    declared: set[str] | None = None  # names of the values whose type the input declared
    keys: dict[ir.Node, str] = field(default_factory=dict)
    # analyze: findings by node key / value name
    forced: dict[str, tuple[Category, str]] = field(default_factory=dict)
    wide: dict[str, str] = field(default_factory=dict)
    safe: dict[str, str] = field(default_factory=dict)  # value name -> evidence it fits 16 bits
    ranges: RangeTable | None = None
    # plan, rewrite, report, save
    plan: PrecisionPlan | None = None
    stats: RewriteStats | None = None
    report: Report | None = None
    staged: Path | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # this process's CPU time per step
    cleanup: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    baseline: Baseline | None = None  # the source as loaded, when the steps are checked

    @property
    def target(self):  # noqa: ANN201 - LowPrecision
        return self.config.ops.target


# -- steps -------------------------------------------------------------------------------------


def load(c: Conversion) -> None:
    """Read the model, check it, resolve the policy, the runtime and the validation level."""
    config = c.config
    c.model, c.source_path = load_model(c.source)
    c.unchanged_source = c.source_path
    c.notes.extend(_normalize_ir_version(c.model))
    c.profile = load_runtime(config.runtime)
    original = c.source if isinstance(c.source, onnx.ModelProto) else None
    if not config.io.allow_invalid and (c.source_path is not None or original is not None):
        problem = input_problem(c.source_path if c.source_path is not None else original)  # type: ignore[arg-type]
        if problem is not None:
            where = c.source_path or "the given ModelProto"
            raise ModelLoadError(
                f"{where}: not a valid ONNX model: {problem} (fix it, or convert it anyway with "
                "--allow-invalid / allow_invalid=True)"
            )
    ops = config.ops
    _check_user_ops(c.model, [*ops.low_precision_ops, *ops.fp32_ops, *ops.follow_ops])
    c.policy = load_policy(ops.target, ops.policy_file).with_overrides(
        low_precision_ops=ops.low_precision_ops, fp32_ops=ops.fp32_ops, follow_ops=ops.follow_ops
    )


def upgrade(c: Conversion) -> None:
    """Move to a newer opset where the target type needs it (or `--opset` asks for it)."""
    upgraded = upgrade_for_target(c.model, c.config.io.opset, c.policy, c.target, c.profile, c.notes)
    if upgraded is not None:
        c.model, c.unchanged_source = upgraded, None
    c.weights_before = weight_bytes(c.model)
    c.input_external = uses_external_data(c.model)
    c.level = _resolve_validation(c.config.validation.level, c.model, c.weights_before)
    calibration = c.config.calibration
    if calibration.data is not None:
        inputs = [v.name for v in c.model.graph.inputs if v.name not in c.model.graph.initializers]
        c.data = BatchSource(calibration.data, inputs, calibration.max_batches)
    calibrating = c.data is not None and calibration.calibrate and calibration.ranges is None
    c.reference_path = c.source_path
    if (c.level in ("run", "load") or calibrating) and c.reference_path is None:
        # In-memory input: an FP32 copy on disk for the reference run.
        c.reference_dir = tempfile.TemporaryDirectory(prefix="mixprec-ref-")
        c.reference_path = Path(c.reference_dir.name) / "reference.onnx"
        big = c.weights_before > RUN_MAX_WEIGHT_BYTES
        ir.save(c.model, c.reference_path, external_data="reference.onnx.data" if big else None)


def fold(c: Conversion) -> None:
    """Fold the constant dequantizations the runtime computes in float and give a
    DequantizeLinear shared by a group the runtime keeps FP32 and other ops a twin for the
    others (QDQ models)."""
    if c.config.ops.weights_only:
        return
    folded = fold_constant_dequantizations(c.model, c.profile, c.target)
    if folded.nodes:
        c.unchanged_source = None
        c.notes.append(folded.note(c.profile.name, c.target))
    split = split_shared_dequantizations(c.model, c.profile, c.target)
    if split.nodes:
        c.unchanged_source = None
        c.notes.append(split.note(c.profile.name))


def type_model(c: Conversion) -> None:
    """Infer every value's type once; fuse decomposed normalizations; key the nodes."""
    c.declared = typed_values(c.model)
    c.typeinfo = infer_types(c.model, source=c.unchanged_source)
    if c.typeinfo.corrected:
        c.notes.append(
            "declared output shape(s) contradict what the model computes; the output keeps the "
            f"computed shape: {_first(list(c.typeinfo.corrected))}"
        )
    assume_float_outputs(c.model, c.policy.user_custom_ops())
    blocks = fuse_norm_blocks(c.model)
    version = opset_for_fusion(blocks, c.profile, c.target) if c.config.io.opset is None else None
    if version is not None:
        # Decomposed normalizations fuse (and compute in 16 bits with FP32 accumulation) only at
        # a newer opset: upgrade and type again, rather than keep each block FP32 with casts.
        untyped = untyped_values(c.model)
        try:
            # Where only the blocks would change (they fuse), the upgrade just declares the opset.
            skip = frozenset(blocks.waiting) if blocks.waiting is not None else frozenset()
            upgraded = upgrade_opset(c.model, version, skip)
        except InputError as e:
            c.notes.append(f"normalizations stay FP32 blocks: upgrading to opset {version} failed ({e})")
        else:
            c.notes.append(
                f"opset upgraded to {version} so that decomposed normalizations fuse into "
                f"{' and '.join(sorted(blocks.needs_opset))} (pin a version with --opset)"
            )
            c.model, c.unchanged_source = upgraded, None
            c.typeinfo = retype_after_upgrade(c.model, untyped, c.typeinfo)
            assume_float_outputs(c.model, c.policy.user_custom_ops())
            blocks = fuse_norm_blocks(c.model)
    c.keys = node_keys(c.model)
    if blocks.fused:
        c.notes.append(
            f"fused {len(blocks.fused)} decomposed normalization(s) into single ops with FP32 "
            f"accumulation (stash_type=1): {_first(blocks.fused)}"
        )
    c.forced.update({c.keys[n]: (Category.NORM_BLOCK, r) for n, r in blocks.kept.items()})


def analyze(c: Conversion) -> None:
    """Ranges (measured on data or given), integer semantics, runtime failures."""
    calibration = c.config.calibration
    ranges = calibration.ranges
    if ranges is None and c.data is not None and calibration.calibrate:
        ranges = _calibrate(c)
    if ranges is not None:
        c.ranges = ranges
        wide, safe = measured_values(c.model, ranges, c.target)
        c.wide = {value.name: evidence for value, evidence in wide.items() if value.name}
        c.safe = {value.name: evidence for value, evidence in safe.items() if value.name}
        if calibration.ranges is not None:
            c.notes.append(f"{len(wide)} value(s) measured beyond the {c.target.value} range stay FP32")
        else:
            c.notes.append(
                f"calibration: {len(ranges)} FP32 values measured on {ranges.batches} batch(es) in "
                f"{ranges.runs} run(s); {len(wide)} leave the {c.target.value} range and stay FP32"
            )
    integer = integer_semantics(c.model, c.target)
    # Integer semantics wins over the normalization blocks and runtime failures.
    c.forced.update({c.keys[n]: (Category.INTEGER, why) for n, why in integer.items()})
    for key, reason in c.runtime_fp32.items():
        c.forced.setdefault(key, (Category.RUNTIME_FAILURE, reason))


def plan(c: Conversion) -> None:
    """Decide every node's precision."""
    c.plan = make_plan(c.model, c.keys, c.config, c.policy, c.profile, c.forced, c.wide, c.notes, c.safe)


def rewrite(c: Conversion) -> None:
    """Apply the plan: fold normalization scales, retype nodes, insert the shared Casts, cast
    the weights."""
    assert c.plan is not None
    c.stats, folded = _apply(c.model, c.plan, c.config)
    if folded.norms:
        c.notes.append(
            f"folded the scales of {len(folded.norms)} normalization(s) into the weights of "
            f"{len(folded.weights)} matrix product(s) (multiplied in FP32; the scales became ones, "
            f"exact in {c.target.value}; --keep-norm-scales to leave them): {_first(folded.norms)}"
        )


def report(c: Conversion) -> None:
    """Count and explain what was done."""
    assert c.plan is not None and c.stats is not None and c.typeinfo is not None
    c.report = build_report(
        model=c.model,
        plan=c.plan,
        stats=c.stats,
        source=str(c.source_path) if c.source_path else "(in memory)",
        output=str(c.output) if c.output is not None else None,
        weight_bytes_before=c.weights_before,
        weight_bytes_after=weight_bytes(c.model),
        type_inference_warning=c.typeinfo.warning,
        profile=c.profile,
    )
    c.report.notes.extend(c.notes)


def save(c: Conversion) -> None:
    """Write the model into a staging folder beside the output (a temporary one without)."""
    if c.output is None and c.level == "none":
        return
    assert c.report is not None
    external = c.config.io.external_data
    if external is None:
        external = c.input_external or wants_external_data(c.model, c.report.weight_bytes_after)
    destination = c.output
    if destination is None:
        folder = c.cleanup.enter_context(tempfile.TemporaryDirectory(prefix="mixprec-out-"))
        destination = Path(folder) / "model.onnx"
    progress = c.config.output.progress if c.output is not None else False
    # The staging context publishes on a clean exit of the pipeline and discards otherwise.
    c.staged = c.cleanup.enter_context(
        staged_save(c.model, destination, external_data=external, progress=progress, declared=c.declared)
    )


def validate(c: Conversion) -> None:
    """Check the staged model: the checker, the runtime as users run it, the numerics."""
    if c.staged is None:
        return
    assert c.report is not None and c.plan is not None
    validation = c.config.validation
    tolerance = validation.tolerance.allclose if validation.tolerance is not None else None
    source_path, original = c.source_path, c.source if isinstance(c.source, onnx.ModelProto) else None

    def original_checker_error() -> str | None:
        if source_path is not None:
            return checker_error(source_path)
        return checker_error(original) if original is not None else None

    start = time.perf_counter()
    try:
        c.report.validation = validate_staged(
            c.staged, c.reference_path, c.target, c.level, c.data, c.config.calibration.max_batches,
            tolerance, original_checker_error, weights_large=c.weights_before > RUN_MAX_WEIGHT_BYTES,
            runtime=c.profile.name, model=c.model,
        )
    except RuntimeRejection as rejection:
        # Hand what a repair needs to `convert`, which owns the search.
        rejection.reference, rejection.ranges = c.reference_path, c.ranges
        rejection.converted = [c.keys[n] for n in c.plan.order if c.plan.decisions[n].precision is Precision.LOW]
        rejection.keep(c.reference_dir)
        c.reference_dir = None  # the rejection owns it now
        raise
    c.report.validation.seconds = time.perf_counter() - start


STEPS: tuple[tuple[str, Callable[[Conversion], None]], ...] = (
    ("load", load),
    ("upgrade", upgrade),
    ("fold", fold),
    ("type", type_model),
    ("analyze", analyze),
    ("plan", plan),
    ("rewrite", rewrite),
    ("report", report),
    ("save", save),
    ("validate", validate),
)


def run(c: Conversion) -> Conversion:
    """Run the steps in order (up to `c.stop_after`), timing each; publish the staged output on
    success (step `publish`), discard it on failure."""
    start, cpu_start = time.perf_counter(), time.process_time()
    checked = steps_checked()
    try:
        with c.cleanup:  # on success publishes the staged model; on failure discards it
            for name, step in STEPS:
                t, cpu = time.perf_counter(), time.process_time()
                step(c)
                c.seconds[name] = time.perf_counter() - t
                c.cpu_seconds[name] = time.process_time() - cpu
                if checked:
                    _check_step(c, name)
                if name == c.stop_after:
                    break
            t = time.perf_counter()
        if c.staged is not None:
            c.seconds["publish"] = time.perf_counter() - t
    finally:
        if c.reference_dir is not None:  # unless a runtime rejection took it for its repair
            c.reference_dir.cleanup()
    c.seconds["total"] = time.perf_counter() - start
    c.cpu_seconds["total"] = time.process_time() - cpu_start
    if c.report is not None:
        c.report.seconds = {k: round(v, 4) for k, v in c.seconds.items()}
        c.report.cpu_seconds = {k: round(v, 4) for k, v in c.cpu_seconds.items()}
    return c


# -- planning, also on a copy of the typed model -------------------------------------------------


def make_plan(
    model: ir.Model,
    keys: Mapping[ir.Node, str],
    config: Config,
    policy: Policy,
    profile: RuntimeProfile,
    forced: Mapping[str, tuple[Category, str]],
    wide: Mapping[str, str],
    notes: list[str],
    safe: Mapping[str, str] | None = None,
) -> PrecisionPlan:
    """Plan `model` (typed) with the analyses' findings, the plan file and the node choices."""
    by_key = {key: node for node, key in keys.items()}
    forced_nodes = {by_key[k]: finding for k, finding in forced.items() if k in by_key}
    values = {v.name: v for v in main_values(model)}
    wide_values = {values[name]: evidence for name, evidence in wide.items() if name in values} or None
    safe_values = {values[name]: evidence for name, evidence in (safe or {}).items() if name in values} or None
    matcher = NodeMatcher(config.nodes.exclude)

    def plan_once(extra: Mapping[ir.Node, tuple[Category, str]]) -> PrecisionPlan:
        return plan_precision(
            model, policy, exclude_nodes=matcher, keep_io_types=config.io.keep_io_types,
            forced_fp32=extra, wide_values=wide_values, runtime=profile, keys=keys, safe_values=safe_values,
        )

    def planned(extra: Mapping[ir.Node, tuple[Category, str]] | None = None) -> PrecisionPlan:
        # Analyses' reasons (integer semantics) win over a plan file's; QDQ pairs stay cast-free.
        return keep_qdq_pairs(plan_once, list(keys), policy.target, {**(extra or {}), **forced_nodes}, profile.name)

    requested = None
    if config.nodes.plan is not None:
        from mixprec.plan.file import load_plan  # noqa: PLC0415

        requested = load_plan(config.nodes.plan)
        result = requested.apply(model, planned)
    else:
        result = planned()
    if config.ops.weights_only:
        result = weights_only_plan(result)
    else:
        notes.extend(_nothing_worth_converting(result, policy, profile))
    unused = matcher.unused()
    if unused:
        raise InputError(f"--exclude-node pattern {unused[0]!r} matches no node in the model")
    if requested is not None:
        for note in requested.notes(model, result):
            logger.warning("%s", note)
            notes.append(note)
    return result


@dataclass
class Prepared:
    """A loaded, typed and analysed model, ready to be planned and rewritten any number of times."""

    conversion: Conversion

    def rewrite(
        self,
        extra_fp32: Mapping[str, tuple[Category, str]] | None = None,
        plan: str | os.PathLike | Mapping[str, object] | None = None,
    ) -> tuple[ir.Model, PrecisionPlan]:
        """Plan a clean copy of the typed model and rewrite it: no reload, no type inference.

        Args:
            extra_fp32: Node key -> (category, reason) of more nodes to keep FP32.
            plan: A plan file (or its dict) to apply instead of the configured one.
        """
        c = self.conversion
        model = c.model.clone()
        keys = node_keys(model)
        forced = {**(extra_fp32 or {}), **c.forced}
        config = c.config if plan is None else c.config.with_options(plan=plan)
        result = make_plan(model, keys, config, c.policy, c.profile, forced, c.wide, [], c.safe)
        _apply(model, result, config)
        if c.baseline is not None:
            require_invariants(model, step="rewrite", baseline=c.baseline)
        return model, result


def prepare(source: object, config: Config) -> Prepared:
    """Run the steps up to `analyze` (no validation, no output)."""
    conversion = Conversion(source, None, config.with_options(validate="none"), stop_after="analyze")
    return Prepared(run(conversion))


# -- helpers -----------------------------------------------------------------------------------

# The steps that change the model; `report` and `validate` only read it.
_CHECKED_STEPS = frozenset({"upgrade", "fold", "type", "analyze", "plan", "rewrite", "save"})
# The staged file is loaded again for the check up to this size (its graph; weights stay unread).
STAGED_RELOAD_MAX_BYTES = 64 << 20


def _check_step(c: Conversion, step: str) -> None:
    """Check the model's invariants after `step` (``MIXPREC_CHECK_STEPS=1``): after `load` the
    baseline is taken (what the source itself breaks is never reported); after `save` the
    staged file too, when it is small."""
    if step == "load":
        c.baseline = Baseline.capture(c.model, keep_io_types=c.config.io.keep_io_types)
        return
    if step not in _CHECKED_STEPS:
        return
    require_invariants(c.model, step=step, baseline=c.baseline)
    if step == "save" and c.staged is not None and c.staged.stat().st_size <= STAGED_RELOAD_MAX_BYTES:
        require_invariants(ir.load(c.staged), step="save (staged file)", baseline=c.baseline)


def _apply(model: ir.Model, plan: PrecisionPlan, config: Config) -> tuple[RewriteStats, FoldedScales]:
    """Rewrite `model` by `plan`, its normalization scales folded first (unless asked not to)."""
    folded = fold_norm_scales(plan) if config.ops.fold_norm_scales else FoldedScales()
    return apply_plan(model, plan), folded


def _elem_types(model: ir.Model) -> dict[str, int]:
    """ONNX element type of every typed main-graph value (0 for non-tensors)."""
    types: dict[str, int] = {}
    for value in main_values(model):
        if value.name and value.type is not None:
            types[value.name] = int(value.type.dtype) if isinstance(value.type, ir.TensorType) else 0
    return types


def _first(items: list[str], count: int = 5) -> str:
    return ", ".join(items[:count]) + (" ..." if len(items) > count else "")


def _check_user_ops(model: ir.Model, names: list[str]) -> None:
    if not names:
        return
    in_model = {(n.domain if n.domain != "ai.onnx" else "", n.op_type) for n in walk_nodes(model.graph)}
    for function in model.functions.values():
        in_model.update((n.domain, n.op_type) for n in function)
    for name in names:
        domain, op_type = parse_op_name(name)
        if (domain, op_type) not in in_model and not op_exists(op_type, domain):
            raise InputError(f"unknown op {name!r} in an op list: it is neither an ONNX op nor used in the model")


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


def _resolve_validation(level: str, model: ir.Model, weights: int) -> str:
    if level != "auto":
        return level
    nodes = len(walk_nodes(model.graph))
    if nodes <= RUN_MAX_NODES and weights <= RUN_MAX_WEIGHT_BYTES:
        return "run"
    return "load" if nodes <= LOAD_MAX_NODES else "checker"


def _calibrate(c: Conversion) -> RangeTable | None:
    """Measure FP32 ranges on the data."""
    from mixprec.analysis.calibrate import calibrate  # noqa: PLC0415

    assert c.reference_path is not None and c.data is not None
    try:
        table = calibrate(c.reference_path, c.data, progress=c.config.output.progress, elem_types=_elem_types(c.model))
    except RunError as e:
        c.notes.append(f"calibration skipped: the FP32 model does not run in onnxruntime: {e}")
        return None
    return table


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
