"""A PyTorch module exported for conversion: at the newest opset the runtime takes, again at an
older one when onnxruntime cannot run that export in FP32, and the converted model compared with
the module itself on the same inputs (`mixprec.convert_module`)."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.config import Config
from mixprec.frontends.torch_module import ExportedModule, export_module, run_module
from mixprec.io import wants_external_data
from mixprec.policy.profiles import load_runtime
from mixprec.runtime import sessions
from mixprec.runtime.batches import BatchSource
from mixprec.runtime.isolated import run_isolated
from mixprec.validate import compare
from mixprec.validate.emulate import emulate_low_precision
from mixprec.validate.results import Validation
from mixprec.validate.staged import output_errors


def export_for_conversion(
    module: object,
    example_inputs: object,
    config: Config,
    *,
    dynamic_shapes: object = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> ExportedModule:
    """Export `module` at `config`'s opset, or at the newest the runtime takes (again at
    `FALLBACK_OPSET` when onnxruntime cannot run that export in FP32; a note says so)."""
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
        exported = export(FALLBACK_OPSET)
        exported.notes.append(
            f"the opset {opset} export does not run in onnxruntime ({_shorten(problem)}); exported at opset {FALLBACK_OPSET}"
        )
    return exported


# Where a module is exported again when its opset-23 export does not run (bfloat16 Conv needs 22).
FALLBACK_OPSET = 22


def _fp32_run_problem(exported: ExportedModule) -> str | None:
    """Why onnxruntime (default options, child process) cannot run the FP32 export on its
    example inputs, or None."""
    model, feeds = exported.model, exported.feeds
    if model.opset_imports.get("", 0) <= FALLBACK_OPSET:
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


def module_batches(model: ir.Model, feeds: dict[str, np.ndarray], config: Config) -> list[dict[str, np.ndarray]]:
    """The example inputs, then the batches of `data` (up to `max_batches` in all)."""
    batches = [feeds]
    data = config.calibration.data
    if data is not None:
        names = [v.name for v in model.graph.inputs if v.name not in model.graph.initializers]
        for batch in BatchSource(data, names, config.calibration.max_batches - 1):
            batches.append({k: np.asarray(v) for k, v in batch.items()})
    return batches


def compare_with_module(
    model: ir.Model, validation: Validation, module: object, example_inputs: object,
    batches: list[dict[str, np.ndarray]], config: Config,
) -> None:
    """Run the module in FP32 and the converted `model` (emulated 16-bit) on the same inputs;
    record the errors of export and conversion together in `validation`."""
    try:
        with tempfile.TemporaryDirectory(prefix="mixprec-module-") as tmp:
            path = Path(tmp) / "emulated.onnx"
            onnx.save(emulate_low_precision(model), str(path))
            session = sessions.make_session(path, graph_optimization="disable")
            names = [o.name for o in model.graph.outputs]
            inputs = [v.name for v in model.graph.inputs if v.name not in model.graph.initializers]
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
