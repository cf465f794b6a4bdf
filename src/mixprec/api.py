"""The public conversion API: `convert` checks its options into a `Config` and runs the
conversion pipeline (`mixprec.pipeline`); `convert_module` exports a PyTorch module first
(`mixprec.frontends.torch_conversion`)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.analysis.calibrate import RangeTable
from mixprec.config import Config
from mixprec.dtypes import LowPrecision
from mixprec.errors import InputError
from mixprec.io import check_output_path
from mixprec.pipeline import ConversionResult, convert_model
from mixprec.policy.table import Policy, load_policy
from mixprec.tolerance import Tolerance

Batch = Mapping[str, np.ndarray]


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
    inline_functions: bool | None = None,
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
            place; when onnxruntime rejects that conversion and nodes are kept FP32 for it, or
            it is planned again for values that leave the 16-bit range on generated inputs, the
            result's `model` is a new object converted from a copy of the input).
        output: Where to save the result; nothing is written when the conversion or its
            validation fails.
        target_dtype: "float16"/"fp16" or "bfloat16"/"bf16".
        low_precision_ops: Ops (`Op` or `domain::Op`) put in the low-precision class.
        fp32_ops: Ops kept in FP32.
        follow_ops: Ops that follow the widest type of their inputs.
        exclude_nodes: Node names or regular expressions (`re.search`) of nodes kept in FP32.
        keep_io_types: Keep FP32 model inputs and outputs in FP32.
        inline_functions: Inline the model's local functions first, as runtimes do when they
            load a model, so that their bodies convert with the rest of the graph. None (the
            default): where nothing stands in the way and inlining copies at most 64 MiB of
            constants; True: always (an InputError says why it cannot); False: each function
            keeps its FP32 signature and converts inside its body.
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
        inline_functions=inline_functions,
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
        return convert_model(model, Path(output) if output is not None else None, config)


def _check_output(model: object, output: str | os.PathLike, overwrite: bool) -> None:
    """Refuse an unwritable output, and the input's own file unless `overwrite`."""
    destination = check_output_path(output)
    if isinstance(model, (str, os.PathLike)) and destination.exists() and Path(model).exists():
        if os.path.samefile(destination, model) and not overwrite:
            raise InputError(
                f"{destination} is the input model: choose another output, or pass --overwrite "
                "(the input is replaced only once the new model is complete)"
            )


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
    from mixprec.frontends.torch_conversion import compare_with_module, export_for_conversion, module_batches  # noqa: PLC0415

    config = (config or Config()).with_options(**options)
    exported = export_for_conversion(
        module, example_inputs, config, dynamic_shapes=dynamic_shapes, input_names=input_names,
        output_names=output_names,
    )
    batches = module_batches(exported.model, exported.feeds, config)
    result = convert_with_config(exported.model, output, config.with_options(data=batches))
    result.report.notes[:0] = exported.notes
    seconds = {"export": round(exported.seconds, 4), **result.report.seconds}
    seconds["total"] = round(seconds.get("total", 0.0) + exported.seconds, 4)
    result.report.seconds = seconds
    if result.report.validation.numerics.startswith("checked"):  # the numeric check ran: compare too
        compare_with_module(result.model, result.report.validation, module, example_inputs, batches, config)
    return result
