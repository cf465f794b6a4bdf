"""The steps of a conversion, each a function from what earlier steps made to what it makes.

    load -> reference -> upgrade -> fold -> type -> normalize -> analyze    (the preparation)
    plan -> rewrite -> save -> validate                                        (per plan)

A step takes the results it needs and returns its own (a frozen record, or the plan / staged
file); steps that edit the model edit it in place and say whether they changed it. The runner
(:mod:`mixprec.pipeline.runner`) calls them in order, times them and checks the invariants.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from mixprec.analysis.calibrate import RangeTable, measured_values
from mixprec.analysis.integer_semantics import integer_semantics
from mixprec.analysis.qdq import has_qdq
from mixprec.analysis.small_floors import small_floors
from mixprec.analysis.typeinfo import TypeInfo, assume_float_outputs, infer_types, retype_after_upgrade, untyped_values
from mixprec.config import Config
from mixprec.errors import InputError, ModelLoadError, RunError
from mixprec.graphs import all_graphs, graph_reads_ahead, main_values, node_keys, walk_nodes
from mixprec.io import StagedModel, load_model, typed_values, uses_external_data, value_types, wants_external_data, weight_bytes
from mixprec.io.onnx_file import FileChecks
from mixprec.io.onnx_file import checker_error as onnx_checker_error
from mixprec.passes.fold_dequantize import fold_constant_dequantizations
from mixprec.passes.functions import inline_as_asked
from mixprec.passes.integer_groups import write_groups_on_integers
from mixprec.passes.norm_blocks import FusedKernels, fuse_norm_blocks, opset_for_fusion
from mixprec.passes.norm_scales import FoldedScales, fold_norm_scales
from mixprec.passes.opset import stranded_ops, stranding_note, upgrade_for_target, upgrade_opset
from mixprec.passes.rewrite import RewriteStats, apply_plan
from mixprec.passes.split_dequantize import split_shared_dequantizations
from mixprec.plan.file import plan_keeps_functions
from mixprec.plan.model import Category, PrecisionPlan
from mixprec.policy.profiles import RuntimeProfile, load_runtime
from mixprec.policy.schemas import op_exists
from mixprec.policy.table import Policy, load_policy, parse_op_name
from mixprec.runtime.batches import BatchSource
from mixprec.validate.checker import checker_error, input_problem, judged_again
from mixprec.validate.results import Validation
from mixprec.validate.staged import RuntimeRejection, generated_batches, start_output_checker, validate_staged

Findings = dict[str, tuple[Category, str]]  # node key -> (category, reason) of a node kept FP32

# Automatic validation runs the models only below these sizes (session creation and weight
# loading dominate otherwise); above them it runs the checker only.
RUN_MAX_WEIGHT_BYTES = 1 << 30
RUN_MAX_NODES = 5000
# Up to this many nodes auto validation at least creates an onnxruntime session to prove the
# model loads.
LOAD_MAX_NODES = 50000


# -- load ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """The model as read, and the policy and runtime it is converted for.

    Attributes:
        path: The input's file (None: given in memory).
        original: The input ModelProto, when one was given (the checker compares with it).
        changed: Whether loading changed the model (an IR version below 4 raised to 4, the main
            graph sorted).
        checked: Whether the input is checked (the structural checker passed; strict type
            inference is the type step's).
        checks: The child process checking and inferring the input's file beside the load
            (its inference is the type step's while the model still equals the file).
        node_order: Where the load sorted the main graph: the input's index of each node in
            the new order (the checker judges the input so ordered).
    """

    model: ir.Model
    path: Path | None
    original: onnx.ModelProto | None
    profile: RuntimeProfile
    policy: Policy
    notes: tuple[str, ...]
    changed: bool = False
    checked: bool = False
    checks: FileChecks | None = None
    node_order: tuple[int, ...] | None = None


def load(source: object, config: Config) -> Loaded:
    """Read the model, check it, resolve the policy and the runtime. A model file is checked,
    and its graph inferred, by a child process while the IR reads it."""
    checks = None
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        strict = not config.io.allow_invalid
        checks = FileChecks.start(source, checker="structural" if strict else None, infer=True, strict=strict)
    try:
        return _load(source, config, checks)
    except BaseException:
        if checks is not None:
            checks.close()
        raise


def _load(source: object, config: Config, checks: FileChecks | None) -> Loaded:
    model, path = load_model(source)
    notes = _normalize_ir_version(model)
    changed = bool(notes)
    profile = load_runtime(config.runtime)
    original = source if isinstance(source, onnx.ModelProto) else None
    checked = not config.io.allow_invalid and (path is not None or original is not None)
    order = None
    if checked:
        # The structural checker now; the type step's inference runs strict, as the checker's
        # full check would (one inference, not two), and refuses the input where it objects.
        judged = path if path is not None else original

        def structural() -> str | None:
            return onnx_checker_error(judged, full_check=False)  # type: ignore[arg-type]

        problem = checks.checker_problem(structural) if checks is not None and path is not None else structural()
        if problem is not None:  # judged again: the main graph sorted, onnxruntime's own ops apart
            order = _sorted_main_graph(model)
            judgement = judged_again(judged, problem, full_check=False, order=order)  # type: ignore[arg-type]
            if judgement.error is not None:
                raise _invalid_input(path, judgement.error)
            notes.extend(_judged_apart(judgement.apart))
    else:
        order = _sorted_main_graph(model)
    if order is not None:
        notes.append(_SORTED_NOTE)
    ops = config.ops
    _check_user_ops(model, [*ops.low_precision_ops, *ops.fp32_ops, *ops.follow_ops])
    policy = load_policy(ops.target, ops.policy_file).with_overrides(
        low_precision_ops=ops.low_precision_ops, fp32_ops=ops.fp32_ops, follow_ops=ops.follow_ops
    )
    return Loaded(
        model, path, original, profile, policy, tuple(notes), changed=changed or order is not None, checked=checked,
        checks=checks, node_order=None if order is None else tuple(order),
    )


def _judged_apart(ops: tuple[str, ...]) -> list[str]:
    """A note naming onnxruntime's own ONNX-domain ops the checker judged the model without."""
    if not ops:
        return []
    return [
        f"{', '.join(ops)}: onnxruntime's own op(s) in the ONNX domain; ONNX does not define them at "
        "the model's opset, so the ONNX checker judged the model without them, and runtimes other "
        "than onnxruntime may not run them"
    ]


_SORTED_NOTE = (
    "the input's nodes were not in topological order (the ONNX checker refuses that; onnxruntime "
    "sorts a main graph as it loads it): sorted them first"
)


def _sorted_main_graph(model: ir.Model) -> list[int] | None:
    """Sort the main graph in place where its nodes are out of topological order and every
    subgraph's are in order (onnxruntime sorts a main graph as it loads it, not a subgraph):
    the old index of each node in the new order; None where nothing was sorted (a cycle
    included: the checker's objection stands)."""
    graph = model.graph
    if not graph_reads_ahead(graph) or any(graph_reads_ahead(sub) for sub in all_graphs(model)[1:]):
        return None
    index = {node: i for i, node in enumerate(graph)}
    try:
        graph.sort()
    except ValueError:  # a cycle
        return None
    return [index[node] for node in graph]


def _invalid_input(path: Path | None, problem: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path or 'the given ModelProto'}: not a valid ONNX model: {problem} (fix it, or "
        "convert it anyway with --allow-invalid / allow_invalid=True)"
    )


def refuse_invalid_input(loaded: Loaded) -> Callable[[str], None]:
    """What the type step's strict inference calls when it objects: the input is refused if the
    checker's full check fails on it and onnxruntime cannot load it either
    (:func:`mixprec.validate.checker.input_problem`; the objection may come from a step's edit)."""

    def refuse(_: str) -> None:
        problem = input_problem(loaded.path if loaded.path is not None else loaded.original, loaded.node_order)  # type: ignore[arg-type]
        if problem is not None:
            raise _invalid_input(loaded.path, problem)

    return refuse


# -- upgrade, fold: steps that may edit the model --------------------------------------------------


@dataclass(frozen=True)
class Edited:
    """The model after a step that may change it (`changed`), and what the step says of it."""

    model: ir.Model
    changed: bool
    notes: tuple[str, ...] = ()


def op_named(profile: RuntimeProfile) -> Callable[[str, str], bool]:
    """Whether (domain, name) names an op: of the ONNX standard, or one the runtime has a kernel
    for (a local function so named does not run: the op does)."""
    return lambda domain, name: op_exists(name, domain) or profile.knows(domain, name)


def inline(loaded: Loaded, config: Config) -> Edited:
    """Inline the model's local functions (in place) as `--inline-functions` / `--keep-functions`
    ask, by default where nothing stands in the way (:func:`inline_as_asked`) and unless the
    plan file given was made with them kept."""
    model, mode = loaded.model, config.io.inline_functions
    if mode is None and model.functions and config.nodes.plan is not None and plan_keeps_functions(config.nodes.plan):
        mode = False  # the plan names nodes of the functions' bodies and their calls
    before = len(model.functions)
    note = inline_as_asked(model, mode, op_named(loaded.profile))
    return Edited(model, len(model.functions) != before, (note,) if note else ())


def upgrade(loaded: Loaded, config: Config) -> Edited:
    """Move to a newer opset where the target type needs it (or `--opset` asks for it)."""
    notes: list[str] = []
    upgraded = upgrade_for_target(loaded.model, config.io.opset, loaded.policy, config.ops.target, loaded.profile, notes)
    if upgraded is None:
        return Edited(loaded.model, False, tuple(notes))
    return Edited(upgraded, True, tuple(notes))


def fold(model: ir.Model, profile: RuntimeProfile, config: Config) -> Edited:
    """Quantized (QDQ) models: fold the constant dequantizations the runtime computes in float,
    write on integers the data-movement groups that cannot load in 16 bits, and give a
    DequantizeLinear read by more than one kind of op a twin per further kind."""
    if config.ops.weights_only or not any(has_qdq(graph) for graph in all_graphs(model)):
        return Edited(model, False)  # one walk instead of one per pass
    target = config.ops.target
    notes = []
    folded = fold_constant_dequantizations(model, profile, target)
    if folded.nodes:
        notes.append(folded.note(profile.name, target))
    on_integers = write_groups_on_integers(model, profile, target)
    if on_integers.nodes:
        notes.append(on_integers.note(profile.name, target))
    split = split_shared_dequantizations(model, profile, target)
    if split.nodes:
        notes.append(split.note(profile.name))
    return Edited(model, bool(folded.nodes or on_integers.nodes or split.nodes), tuple(notes))


# -- reference: what the checks and the calibration run --------------------------------------------


@dataclass(frozen=True)
class Reference:
    """The FP32 model the checks and the calibration run, and how much will be checked.

    Attributes:
        path: The FP32 model's file: the input's, or a temporary copy of an in-memory input
            (None when nothing runs it).
        level: The validation level, `auto` resolved by the model's size.
        data: The user's input batches, if any.
        weights_before: The FP32 model's weight bytes.
        external: The input kept its weights in external data.
        calibrated: The FP32 model the calibration runs where it is not `path`'s: the model
            with its functions inlined, whose bodies' values only it names (validation traces
            non-finite values in it too).
    """

    path: Path | None
    level: str
    data: BatchSource | None
    weights_before: int
    external: bool
    calibrated: Path | None = None

    @property
    def weights_large(self) -> bool:
        return self.weights_before > RUN_MAX_WEIGHT_BYTES


def reference(loaded: Loaded, model: ir.Model, config: Config, cleanup: contextlib.ExitStack) -> Reference:
    """Resolve the validation level and the data, and put an in-memory input on disk (in a
    folder `cleanup` removes) where a run needs it."""
    weights = weight_bytes(model)
    level = _resolve_validation(config.validation.level, model, weights)
    calibration = config.calibration
    data = None
    if calibration.data is not None:
        inputs = [v.name for v in model.graph.inputs if v.name not in model.graph.initializers]
        data = BatchSource(calibration.data, inputs, calibration.max_batches)
    calibrating = data is not None and calibration.calibrate and calibration.ranges is None
    path = loaded.path
    if (level in ("run", "load") or calibrating) and path is None:
        folder = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="mixprec-ref-"))
        path = Path(folder) / "reference.onnx"
        value_types.save(model, path, external_data="reference.onnx.data" if weights > RUN_MAX_WEIGHT_BYTES else None)
    return Reference(path, level, data, weights, uses_external_data(model))


def reference_inlined(ref: Reference, model: ir.Model, config: Config, cleanup: contextlib.ExitStack) -> Reference:
    """`ref` with the model whose functions were just inlined on disk for the calibration to run
    (in a folder `cleanup` removes), where it may run: on the data, or on the generated inputs
    of a run check (:func:`generated_overflow_ranges`)."""
    calibration = config.calibration
    if not calibration.calibrate or calibration.ranges is not None:
        return ref
    if ref.data is None and ref.level != "run":  # no data, nor generated inputs to plan again on
        return ref
    folder = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="mixprec-inlined-"))
    path = Path(folder) / "inlined.onnx"
    value_types.save(model, path, external_data="inlined.onnx.data" if ref.weights_large else None)
    return dataclasses.replace(ref, calibrated=path)


# -- type, normalize ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Typed:
    """The model with every value typed (one ONNX shape inference).

    Attributes:
        declared: The values whose type the input declared (saved with their types again).
    """

    model: ir.Model
    typeinfo: TypeInfo
    declared: set[str]
    notes: tuple[str, ...]


def type_model(
    model: ir.Model,
    unchanged: Path | None,
    policy: Policy,
    strict_failure: Callable[[str], None] | None = None,
    checks: FileChecks | None = None,
) -> Typed:
    """Infer every value's type once (`unchanged`: the file `model` still equals, parsed faster;
    `strict_failure`: infer strictly, as the input check, see :func:`refuse_invalid_input`;
    `checks`: the child inferring `unchanged`)."""
    declared = typed_values(model)
    typeinfo = infer_types(model, source=unchanged, strict_failure=strict_failure, checks=checks)
    notes = []
    if typeinfo.corrected:
        notes.append(
            "declared output shape(s) contradict what the model computes; the output keeps the "
            f"computed shape: {_first(list(typeinfo.corrected))}"
        )
    assume_float_outputs(model, policy.user_custom_ops())
    return Typed(model, typeinfo, declared, tuple(notes))


@dataclass(frozen=True)
class Normalized:
    """The typed model with its decomposed normalizations fused, and its nodes keyed.

    Attributes:
        keys: Node -> stable key (:func:`mixprec.graphs.node_keys`).
        kept: The blocks that could not fuse, by node key: they stay FP32 as one block.
        changed: Whether the model changed (an opset upgrade, a fusion).
    """

    model: ir.Model
    typeinfo: TypeInfo
    keys: dict[ir.Node, str]
    kept: Findings
    changed: bool
    notes: tuple[str, ...]


def normalize(typed: Typed, profile: RuntimeProfile, policy: Policy, config: Config) -> Normalized:
    """Fuse decomposed normalizations; where they fuse only at a newer opset, upgrade and type
    again rather than keep each block FP32 with casts."""
    model, typeinfo, notes = typed.model, typed.typeinfo, []
    kernels = FusedKernels(profile, config.ops.target)
    blocks = fuse_norm_blocks(model, kernels=kernels)
    changed = bool(blocks.fused)
    version = opset_for_fusion(blocks, profile, config.ops.target) if config.io.opset is None else None
    stranded = stranded_ops(model, version, profile) if version is not None else []
    if stranded:
        notes.append(
            f"normalizations stay FP32 blocks: fusing them needs opset {version}, but "
            f"{stranding_note(stranded, version, profile)}"
        )
        version = None
    if version is not None:
        try:
            # Where only the blocks would change (they fuse), the upgrade just declares the opset.
            skip = frozenset(blocks.waiting) if blocks.waiting is not None else frozenset()
            upgraded = upgrade_opset(model, version, skip)
        except InputError as e:
            notes.append(f"normalizations stay FP32 blocks: upgrading to opset {version} failed ({e})")
        else:
            notes.append(
                f"opset upgraded to {version} so that decomposed normalizations fuse into "
                f"{' and '.join(sorted(blocks.needs_opset))} (pin a version with --opset)"
            )
            # An upgrade that only declared the opset left every value's type as it was; one that
            # rebuilt the model (the old one is left as it was) is retyped where it lost types.
            # Where only the opset changed in a model the search left as it was, a search would
            # find the same blocks again.
            if upgraded is not model:
                retyped = retype_after_upgrade(upgraded, untyped_values(model), typeinfo)
            else:
                retyped = typeinfo
            same = upgraded is model and not blocks.fused
            model, changed, typeinfo = upgraded, True, retyped
            assume_float_outputs(model, policy.user_custom_ops())
            blocks = fuse_norm_blocks(model, blocks.found if same else None, kernels)
    keys = node_keys(model)
    if blocks.fused:
        notes.append(
            f"fused {len(blocks.fused)} decomposed normalization(s) into single ops with FP32 "
            f"accumulation (stash_type=1): {_first(blocks.fused)}"
        )
    kept = {keys[n]: (Category.NORM_BLOCK, r) for n, r in blocks.kept.items()}
    return Normalized(model, typeinfo, keys, kept, changed, tuple(notes))


# -- analyze -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Analysis:
    """What the analyses found before planning.

    Attributes:
        forced: Nodes to keep FP32, by key: integer semantics, then the unfused normalization
            blocks and the nodes computing values floored below the normal range
            (`analysis.small_floors`).
        wide: Values measured (or given) beyond the 16-bit range -> evidence.
        safe: Values measured within it -> evidence.
        ranges: The FP32 ranges used, when any.
    """

    forced: Findings
    wide: dict[str, str]
    safe: dict[str, str]
    ranges: RangeTable | None
    notes: tuple[str, ...]


def analyze(normalized: Normalized, reference: Reference, config: Config) -> Analysis:
    """Ranges (measured on data or given), integer semantics, and values floored below the
    16-bit normal range before a logarithm or divisor."""
    model, target, notes = normalized.model, config.ops.target, []
    calibration = config.calibration
    ranges = calibration.ranges
    if ranges is None and reference.data is not None and calibration.calibrate:
        ranges = _calibrate(model, reference, config, notes)
    wide: dict[str, str] = {}
    safe: dict[str, str] = {}
    if ranges is not None:
        measured_wide, measured_safe = measured_values(model, ranges, target)
        wide = {value.name: evidence for value, evidence in measured_wide.items() if value.name}
        safe = {value.name: evidence for value, evidence in measured_safe.items() if value.name}
        if calibration.ranges is not None:
            notes.append(f"{len(measured_wide)} value(s) measured beyond the {target.value} range stay FP32")
        else:
            notes.append(
                f"calibration: {len(ranges)} FP32 values measured on {ranges.batches} batch(es) in "
                f"{ranges.runs} run(s); {len(measured_wide)} leave the {target.value} range and stay FP32"
            )
    integer = integer_semantics(model, target)
    floored = small_floors(model, target)
    # Integer semantics wins over the normalization blocks, and those over the small floors.
    forced = {
        **{normalized.keys[n]: (Category.CONSTANT_RANGE, why) for n, why in floored.items()},
        **normalized.kept,
        **{normalized.keys[n]: (Category.INTEGER, why) for n, why in integer.items()},
    }
    return Analysis(forced, wide, safe, ranges, tuple(notes))


# -- rewrite -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rewritten:
    """The model rewritten by its plan: what was inserted and removed, its weight bytes, and the
    notes."""

    model: ir.Model
    plan: PrecisionPlan
    stats: RewriteStats
    notes: tuple[str, ...]
    weight_bytes: int


def rewrite(model: ir.Model, plan: PrecisionPlan, config: Config) -> Rewritten:
    """Apply the plan: fold normalization scales, retype nodes, insert the shared Casts, cast
    the weights."""
    folded = fold_norm_scales(model, plan) if config.ops.fold_norm_scales else FoldedScales()
    stats = apply_plan(model, plan)
    notes = []
    if folded.norms:
        notes.append(
            f"folded the scales of {len(folded.norms)} normalization(s) into the weights of "
            f"{len(folded.weights)} matrix product(s) (multiplied in FP32; the scales became ones, "
            f"exact in {plan.target.value}; --keep-norm-scales to leave them): {_first(folded.norms)}"
        )
    return Rewritten(model, plan, stats, tuple(notes), weight_bytes(model))


# -- save, validate ------------------------------------------------------------------------------


def save(
    rewritten: Rewritten, output: Path | None, reference: Reference, declared: set[str], config: Config,
    cleanup: contextlib.ExitStack,
) -> StagedModel | None:
    """Write the model into a staging folder beside the output (a temporary one without); None
    when nothing is written or checked."""
    if output is None and reference.level == "none":
        return None
    model = rewritten.model
    external = config.io.external_data
    if external is None:
        external = reference.external or wants_external_data(model, rewritten.weight_bytes)
    destination = output
    if destination is None:
        folder = cleanup.enter_context(tempfile.TemporaryDirectory(prefix="mixprec-out-"))
        destination = Path(folder) / "model.onnx"
    progress = config.output.progress if output is not None else False
    return StagedModel(model, destination, external_data=external, progress=progress, declared=declared)


@dataclass(frozen=True)
class Checked:
    """What validation found: the checks' outcome, or the runtime's rejection of a model whose
    FP32 form it runs (the repair's starting point)."""

    validation: Validation | None
    rejection: RuntimeRejection | None = None


def generated_overflow_ranges(validation: Validation, reference: Reference, config: Config) -> RangeTable | None:
    """Where the converted model gains non-finite outputs on the inputs validation generated (no
    data given, ranges not given, calibration on), the FP32 ranges measured on those inputs, for
    a plan that keeps FP32 what leaves the 16-bit range there; else None."""
    calibration = config.calibration
    if calibration.data is not None or calibration.ranges is not None or not calibration.calibrate:
        return None
    if reference.path is None or not any(o.new_nonfinite for o in (*validation.outputs, *validation.real_outputs)):
        return None
    batches = generated_batches(reference.path)
    if not batches:
        return None
    from mixprec.analysis.calibrate import calibrate  # noqa: PLC0415

    try:
        return calibrate(reference.calibrated or reference.path, batches)  # its own types: the model is rewritten
    except RunError:
        return None


def start_checker(model: ir.Model, reference: Reference) -> FileChecks | None:
    """Start the checker of the model about to be saved in a child (it starts while the model
    is written and checks the staged file once named): :func:`validate` takes its answer, and
    what runs in between (the report) runs beside it."""
    return start_output_checker(reference.level, sum(len(graph) for graph in all_graphs(model)))


def validate(
    staged: StagedModel | None,
    model: ir.Model,
    loaded: Loaded,
    reference: Reference,
    config: Config,
    checks: FileChecks | None = None,
) -> Checked:
    """Check the staged model: the checker (`checks`: already running in a child), the runtime
    as users run it, the numerics."""
    if staged is None:
        return Checked(Validation())
    validation = config.validation
    tolerance = validation.tolerance.allclose if validation.tolerance is not None else None
    source_path, original = loaded.path, loaded.original

    def original_checker_error() -> str | None:
        source = source_path if source_path is not None else original
        return checker_error(source, order=loaded.node_order) if source is not None else None

    # From the check's start: in a child, it overlaps the report's build.
    start = checks.started if checks is not None else time.perf_counter()
    try:
        result = validate_staged(
            staged.path, reference.path, config.ops.target, reference.level, reference.data,
            config.calibration.max_batches, tolerance, original_checker_error,
            weights_large=reference.weights_large, runtime=loaded.profile.name, model=model, checks=checks,
            traced=reference.calibrated,
        )
    except RuntimeRejection as rejection:
        return Checked(None, rejection)
    result.seconds = time.perf_counter() - start
    return Checked(result)


# -- helpers -------------------------------------------------------------------------------------


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
    # Function bodies count once per function: runtimes (and emulation) inline them.
    nodes = len(walk_nodes(model.graph)) + sum(len(walk_nodes(f)) for f in model.functions.values())
    if nodes <= RUN_MAX_NODES and weights <= RUN_MAX_WEIGHT_BYTES:
        return "run"
    return "load" if nodes <= LOAD_MAX_NODES else "checker"


def _elem_types(model: ir.Model) -> dict[str, int]:
    """ONNX element type of every typed main-graph value (0 for non-tensors)."""
    types: dict[str, int] = {}
    for value in main_values(model):
        if value.name and value.type is not None:
            types[value.name] = int(value.type.dtype) if isinstance(value.type, ir.TensorType) else 0
    return types


def _calibrate(model: ir.Model, reference: Reference, config: Config, notes: list[str]) -> RangeTable | None:
    """Measure FP32 ranges on the data."""
    from mixprec.analysis.calibrate import calibrate  # noqa: PLC0415

    assert reference.path is not None and reference.data is not None
    try:
        path = reference.calibrated or reference.path
        return calibrate(path, reference.data, progress=config.output.progress, elem_types=_elem_types(model))
    except RunError as e:
        notes.append(f"calibration skipped: the FP32 model does not run in onnxruntime: {e}")
        return None
