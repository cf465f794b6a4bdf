"""The public conversion API: `convert` checks its options into a `Config`, runs the
conversion pipeline (`mixprec.pipeline`), and, when onnxruntime rejects the result, keeps the
responsible nodes FP32 and converts again."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.analysis.calibrate import RangeTable
from mixprec.config import Config
from mixprec.dtypes import LowPrecision
from mixprec.errors import InputError, ValidationFailure
from mixprec.io import check_output_path, save_model, wants_external_data, without_staging
from mixprec.pipeline import Conversion, run
from mixprec.plan.model import PrecisionPlan
from mixprec.policy.table import Policy, load_policy
from mixprec.report import Report
from mixprec.runtime.isolated import run_isolated
from mixprec.tolerance import Tolerance
from mixprec.validate.staged import RuntimeRejection, loads_as_validated, output_errors
from mixprec.validate.repair import find_culprits

if TYPE_CHECKING:
    from mixprec.frontends.torch_module import ExportedModule

logger = logging.getLogger(__name__)

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
    tolerance: Tolerance | tuple[float, float] | None = None,
    external_data: bool | None = None,
    opset: int | None = None,
    progress: bool | None = False,
    plan: str | os.PathLike | Mapping[str, object] | None = None,
    ranges: RangeTable | None = None,
    runtime: str | None = None,
    weights_only: bool = False,
    fold_norm_scales: bool = True,
    allow_invalid: bool = False,
    overwrite: bool = False,
) -> ConversionResult:
    """Convert an FP32 ONNX model to mixed precision.

    Args:
        model: Path to an .onnx file, an `onnx.ModelProto`, or an `onnx_ir.Model` (converted in
            place; when onnxruntime rejects that conversion and nodes are kept FP32 for it, the
            result's `model` is a new object converted from a copy of the input).
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
        tolerance: What every output must meet, else `ValidationFailure`: a `Tolerance` (its
            allclose rule) or an (atol, rtol) pair.
        external_data: Force (True) or forbid (False) external data for the output; default:
            when weights exceed 1 GiB or the input used external data.
        progress: Show progress lines for long steps on stderr (None: when it is a terminal).
        opset: Upgrade the model to this default-domain opset first (with the ONNX version
            converter). Default: upgrade only when the model's compute-bound ops admit the
            target type at a newer opset (bfloat16 Conv and pooling: 22).
        runtime: The runtime the model is deployed to (`mixprec.policy.profiles.RUNTIMES`,
            default `ort-cuda`): a node converts only where the runtime has a 16-bit kernel
            for it; `onnx` lets the ONNX schema alone decide.
        weights_only: Store the weights in the 16-bit type and compute everything in FP32 (for
            runtimes without 16-bit compute for the model's heavy ops: half the file, FP32
            speed).
        fold_norm_scales: Where a normalization's output only feeds matrix products with
            constant weights of their own, multiply its scale into those weights (in FP32) and
            make the scale ones, so that it is not rounded to 16 bits on its own
            (`mixprec.passes.norm_scales`). False keeps the scales where they are.
        allow_invalid: Convert a model the ONNX checker rejects (by default that is a
            `ModelLoadError` naming the checker's first problem).
        overwrite: Allow `output` to be the input model's own file (replaced only once the new
            model is complete and checked).
        ranges: FP32 ranges measured before (`mixprec.analysis.calibrate.calibrate`): used
            instead of calibrating on `data`.
        plan: A plan file (`mixprec.plan.file.save_plan`) or its dict: its `fp32` nodes are
            kept FP32 ("set by plan"), its `low` nodes are left to the planner (a note lists
            those it keeps FP32). A node name absent from the model is an `InputError`.

    Returns:
        The converted model, the plan and the report.

    Raises:
        MixprecError: A bad argument or model, or a converted model that fails validation.
    """
    config = Config.from_options(
        target_dtype=target_dtype, low_precision_ops=low_precision_ops, fp32_ops=fp32_ops,
        follow_ops=follow_ops, exclude_nodes=exclude_nodes, keep_io_types=keep_io_types,
        policy_file=policy_file, validate=validate, data=data, max_batches=max_batches,
        tolerance=tolerance, external_data=external_data, opset=opset, progress=progress,
        calibrate=calibrate, plan=plan, ranges=ranges, runtime=runtime,
        weights_only=weights_only, fold_norm_scales=fold_norm_scales, allow_invalid=allow_invalid,
        overwrite=overwrite,
    )
    return convert_with_config(model, output, config)


def convert_with_config(
    model: str | os.PathLike | onnx.ModelProto | ir.Model,
    output: str | os.PathLike | None,
    config: Config,
) -> ConversionResult:
    """`convert` with its options given as one `Config`."""
    tolerance = config.validation.tolerance
    if tolerance is not None and (
        tolerance.min_cosine is not None or tolerance.topk_agreement is not None or tolerance.outputs is not None
    ):
        raise InputError(
            "convert checks the allclose rule (atol, rtol) on every output; min_cosine, "
            "topk_agreement and outputs are criteria of mixprec.tune.tune"
        )
    if tolerance is not None and tolerance.allclose is None:
        raise InputError("the tolerance sets neither atol nor rtol")
    if output is not None:
        _check_output(model, output, config.io.overwrite)
    with _gc_paused():
        try:
            return _run(model, output, config)
        except RuntimeRejection as rejection:
            try:
                result = _repair(rejection, output, config)
                if not isinstance(model, (str, os.PathLike)):  # converted again from a temporary copy
                    result.report.source = "(in memory)"
                return result
            finally:
                rejection.cleanup()


def _run(
    model: object, output: str | os.PathLike | None, config: Config, runtime_fp32: Mapping[str, str] | None = None
) -> ConversionResult:
    c = run(Conversion(model, Path(output) if output is not None else None, config, dict(runtime_fp32 or {})))
    assert c.report is not None and c.plan is not None
    return ConversionResult(c.model, c.report, c.plan, c.output, ranges=c.ranges)


def _check_output(model: object, output: str | os.PathLike, overwrite: bool) -> None:
    """Refuse an unwritable output, and the input's own file unless `overwrite`."""
    destination = check_output_path(output)
    if isinstance(model, (str, os.PathLike)) and destination.exists() and Path(model).exists():
        if os.path.samefile(destination, model) and not overwrite:
            raise InputError(
                f"{destination} is the input model: choose another output, or pass --overwrite "
                "(the input is replaced only once the new model is complete)"
            )


def _repair(rejection: RuntimeRejection, output: str | os.PathLike | None, config: Config) -> ConversionResult:
    """Keep FP32 the fewest converted nodes that make onnxruntime load (and run) the model."""
    from mixprec.plan.model import Category  # noqa: PLC0415
    from mixprec.pipeline import prepare  # noqa: PLC0415

    source, outcome = rejection.reference, rejection.outcome
    if source is None or not rejection.converted:
        raise rejection
    config = config.with_options(ranges=rejection.ranges)
    # The input passed its checks already; trials only plan and rewrite the typed model.
    prepared = prepare(source, config.with_options(progress=False, allow_invalid=True))
    what = "crashes on" if outcome.crashed else "fails on"
    error = without_staging(outcome.error or "")
    reason = f"onnxruntime (CPU provider, default options) {what} the model with this node in 16 bits: {error}"

    def fails(kept: frozenset[str]) -> bool:
        model, _ = prepared.rewrite(dict.fromkeys(kept, (Category.RUNTIME_FAILURE, reason)))
        with tempfile.TemporaryDirectory(prefix="mixprec-repair-") as tmp:
            path = Path(tmp) / "trial.onnx"
            save_model(model, path, external_data=wants_external_data(model))
            return not loads_as_validated(run_isolated(path, rejection.feeds), config.ops.target)

    logger.warning("%s; searching for the nodes to keep FP32", rejection)
    near = _near_named_nodes(prepared.conversion.model, prepared.conversion.keys, outcome.error or "", rejection.converted)
    if near and not fails(frozenset(near)):
        # The runtime's error names a node: its neighbourhood held FP32 loads, so the culprits
        # are among those few (the rest stays converted).
        culprits = find_culprits(near, fails)
    else:
        culprits = find_culprits(rejection.converted, fails)
    if culprits.names is None:
        raise ValidationFailure(f"{rejection}; it fails even with every converted node FP32") from rejection
    result = _run(source, output, config, runtime_fp32=dict.fromkeys(culprits.names, reason))
    result.report.notes.append(
        f"onnxruntime {what} the first conversion ({error}); kept {len(culprits.names)} node(s) "
        f"FP32 after {culprits.trials} trial conversion(s): {', '.join(culprits.names[:5])}"
        + (" ..." if len(culprits.names) > 5 else "")
    )
    return result


# Hops around a node the runtime's error names within which its culprits are looked for first.
_NEAR_HOPS = 4


def _names(name: str, text: str) -> bool:
    """Whether `text` mentions the node `name` as a whole name (`Conv_1` is not in `Conv_12`)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None


def _near_named_nodes(model: ir.Model, keys: Mapping[ir.Node, str], error: str, converted: Sequence[str]) -> list[str]:
    """The converted nodes (keys, in `converted`'s order) within a few edges of a main-graph
    node whose name the runtime's error mentions (a failing fused node is named after the node
    its pattern starts from); [] when it names none."""
    named = [node for node in model.graph if len(node.name) >= 3 and _names(node.name, error)]
    if not named:
        return []
    near: set[ir.Node] = set(named)
    frontier = list(named)
    for _ in range(_NEAR_HOPS):
        reached = []
        for node in frontier:
            neighbours = [v.producer() for v in node.inputs if v is not None]
            neighbours += [use.node for out in node.outputs for use in out.uses()]
            for other in neighbours:
                if other is not None and other not in near:
                    near.add(other)
                    reached.append(other)
        frontier = reached
    wanted = {keys[node] for node in near if node in keys}
    return [key for key in converted if key in wanted]


def convert_module(
    module: object,
    example_inputs: object,
    output: str | os.PathLike | None = None,
    *,
    dynamic_shapes: object = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    config: Config | None = None,
    **options: object,
) -> ConversionResult:
    """Export a PyTorch module to ONNX and convert it, in one call.

    The module is exported with `torch.onnx.export(..., dynamo=True)` (the TorchScript exporter
    only when that fails; the report says so) at opset 23 (bfloat16 Conv needs 22; at 23 the
    exporter writes fused RMSNormalization), or the runtime's highest when lower, or `opset`; its
    `onnx_ir` model goes to the conversion in memory. `example_inputs` (plus `data`, when given)
    are the calibration data and the inputs of the numeric check, and the module itself runs in
    FP32 on them: `report.validation.module_outputs` is the error of export and conversion
    together (on the emulated 16-bit model).

    Args:
        module: A `torch.nn.Module` (put in eval mode).
        example_inputs: One tensor, a tuple of positional inputs, or a dict of keyword inputs
            (nested lists and tuples of tensors are flattened, as the exporter does).
        output: Where to save the converted model (optional).
        dynamic_shapes: As `torch.export` takes it (e.g. `{"x": {0: torch.export.Dim("batch")}}`).
        input_names, output_names: Names for the ONNX graph's inputs and outputs.
        config: The conversion options as a `Config`; `**options` (`convert`'s keyword
            options) apply on top.

    Raises:
        ExportError: The module cannot be exported (one line; the exporters' traces are in the
            log at debug level).
        MixprecError: As `convert`.
    """
    from mixprec.frontends.torch_module import ExportedModule, export_module  # noqa: PLC0415

    from mixprec.policy.profiles import load_runtime  # noqa: PLC0415

    config = (config or Config()).with_options(**options)
    supported = load_runtime(config.runtime).opset_range

    def export(opset: int | None) -> ExportedModule:
        return export_module(
            module, example_inputs, config.ops.target, dynamic_shapes=dynamic_shapes, opset=opset,
            max_opset=supported[1] if supported else None, input_names=input_names, output_names=output_names,
        )

    exported = export(config.io.opset)
    if config.io.opset is None and (problem := _fp32_run_problem(exported)) is not None:
        # The newest opset's forms (e.g. Attention-23 with a padding mask) may not run where the
        # older decomposition does.
        opset = exported.model.opset_imports.get("", 0)
        exported = export(_FALLBACK_OPSET)
        exported.notes.append(
            f"the opset {opset} export does not run in onnxruntime ({_shorten(problem)}); exported at opset {_FALLBACK_OPSET}"
        )
    batches = _module_batches(exported.model, exported.feeds, config)
    result = convert_with_config(exported.model, output, config.with_options(data=batches))
    result.report.notes[:0] = exported.notes
    seconds = {"export": round(exported.seconds, 4), **result.report.seconds}
    seconds["total"] = round(seconds.get("total", 0.0) + exported.seconds, 4)
    result.report.seconds = seconds
    if result.report.validation.numerics.startswith("checked"):  # the numeric check ran: compare too
        _compare_with_module(result, module, example_inputs, batches, config)
    return result


# Where a module is exported again when its opset-23 export does not run (bfloat16 Conv needs 22).
_FALLBACK_OPSET = 22


def _fp32_run_problem(exported: ExportedModule) -> str | None:
    """Why onnxruntime (default options, child process) cannot run the FP32 export on its
    example inputs, or None."""
    model, feeds = exported.model, exported.feeds
    if model.opset_imports.get("", 0) <= _FALLBACK_OPSET:
        return None
    with tempfile.TemporaryDirectory(prefix="mixprec-export-") as tmp:
        path = Path(tmp) / "fp32.onnx"
        ir.save(model, path, external_data="fp32.onnx.data" if wants_external_data(model) else None)
        outcome = run_isolated(path, feeds)
    return None if outcome.ok else outcome.error


def _shorten(text: str, limit: int = 200) -> str:
    """The message without onnxruntime's source locations and C++ signatures, at most `limit` long."""
    head, found, status = text.partition("Status Message: ")
    if found:  # drop the source location and the C++ signature before the condition
        text = head + found + status.rsplit(") ", 1)[-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _module_batches(model: ir.Model, feeds: dict[str, np.ndarray], config: Config) -> list[dict[str, np.ndarray]]:
    """The example inputs, then the batches of `data` (up to `max_batches` in all)."""
    from mixprec.runtime.batches import BatchSource  # noqa: PLC0415

    batches = [feeds]
    data = config.calibration.data
    if data is not None:
        names = [v.name for v in model.graph.inputs if v.name not in model.graph.initializers]
        for batch in BatchSource(data, names, config.calibration.max_batches - 1):
            batches.append({k: np.asarray(v) for k, v in batch.items()})
    return batches


def _compare_with_module(
    result: ConversionResult, module: object, example_inputs: object, batches: list[dict[str, np.ndarray]], config: Config
) -> None:
    """Run the module in FP32 and the converted model (emulated 16-bit) on the same inputs;
    record the errors of export and conversion together."""
    from mixprec.frontends.torch_module import run_module  # noqa: PLC0415
    from mixprec.runtime import sessions  # noqa: PLC0415
    from mixprec.validate import compare  # noqa: PLC0415
    from mixprec.validate.emulate import emulate_low_precision  # noqa: PLC0415

    validation = result.report.validation
    try:
        with tempfile.TemporaryDirectory(prefix="mixprec-module-") as tmp:
            path = Path(tmp) / "emulated.onnx"
            onnx.save(emulate_low_precision(result.model), str(path))
            session = sessions.make_session(path, graph_optimization="disable")
            names = [o.name for o in result.model.graph.outputs]
            inputs = [v.name for v in result.model.graph.inputs if v.name not in result.model.graph.initializers]
            merged = None
            for feeds in batches:
                expected = dict(zip(names, run_module(module, feeds, example_inputs, inputs)))
                actual = sessions.run_session(session, feeds)
                comparison = compare.compare_outputs(expected, {k: actual[k] for k in expected})
                merged = comparison if merged is None else compare.merge(merged, comparison)
    except Exception as e:  # noqa: BLE001 - the module's own errors on a data batch: a note, not a crash
        validation.notes.append(f"not compared with the PyTorch module: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return
    tolerance = config.validation.tolerance.allclose if config.validation.tolerance is not None else None
    validation.module_batches = len(batches)
    validation.module_outputs = output_errors(merged or [], tolerance)
