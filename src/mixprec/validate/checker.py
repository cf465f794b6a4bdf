"""The ONNX checker, run on a file path (so models with external data beyond 2 GB work)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx
import onnx.checker

from mixprec.errors import ValidationFailure
from mixprec.graphs import graph_protos
from mixprec.io.onnx_file import FileChecks, graph_only_proto
from mixprec.io.onnx_file import checker_error as onnx_checker_error
from mixprec.policy.profiles import onnxruntime_onnx_domain_ops

__all__ = ["RUNTIME_OPS_DOMAIN", "check_model_file", "checker_error", "input_problem"]

# The domain onnxruntime's own ONNX-domain ops are moved to for the checker (see `checker_error`).
RUNTIME_OPS_DOMAIN = "mixprec.onnxruntime_onnx_domain"


def checker_error(model: str | Path | onnx.ModelProto, *, full_check: bool = True) -> str | None:
    """The ONNX checker's first error line (`full_check`: with strict type inference), or None.

    Ops onnxruntime registers in the ONNX domain that ONNX does not define
    (:func:`mixprec.policy.profiles.onnxruntime_onnx_domain_ops`) are not the checker's to
    judge: where the model fails and has such ops, a copy of its graph with those ops in a
    domain of their own is judged instead (the rest of the model as the checker would)."""
    error = onnx_checker_error(model, full_check=full_check)
    return error if error is None else _without_runtime_ops(model, error, full_check)


def _without_runtime_ops(model: str | Path | onnx.ModelProto, error: str, full_check: bool) -> str | None:
    """The checker's verdict on the model with onnxruntime's own ONNX-domain ops set apart;
    `error` where it has none."""
    relabeled = _runtime_ops_relabeled(model)
    return error if relabeled is None else onnx_checker_error(relabeled, full_check=full_check)


def _runtime_ops_relabeled(model: str | Path | onnx.ModelProto) -> onnx.ModelProto | None:
    """The model's graph (large weights as typed inputs, for a file) with onnxruntime's own
    ONNX-domain ops moved to :data:`RUNTIME_OPS_DOMAIN`; None when it has none."""
    own = onnxruntime_onnx_domain_ops()
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    else:
        model = graph_only_proto(model)
    nodes = [node for graph in graph_protos(model.graph) for node in graph.node]
    nodes += [node for function in model.functions for node in function.node]
    found = [node for node in nodes if node.domain in ("", "ai.onnx") and node.op_type in own]
    if not found:
        return None
    for node in found:
        node.domain = RUNTIME_OPS_DOMAIN
    model.opset_import.append(onnx.helper.make_opsetid(RUNTIME_OPS_DOMAIN, 1))
    return model


def input_problem(model: str | Path | onnx.ModelProto) -> str | None:
    """Why an input model is not valid ONNX, or None.

    The structural checker decides (cycles, undefined inputs, unknown ops, opsets, IR
    version). Strict type inference also runs; when only it objects, the model counts as
    valid if onnxruntime loads it with default options (ONNX's own inference of some function
    ops, MeanVarianceNormalization for one, rejects models onnx ships as tests).
    """
    strict = checker_error(model, full_check=True)
    if strict is None:
        return None  # the common case: one pass
    problem = checker_error(model, full_check=False)
    if problem is not None:
        return problem
    from mixprec.runtime.isolated import run_isolated  # noqa: PLC0415

    if isinstance(model, onnx.ModelProto):
        with tempfile.TemporaryDirectory(prefix="mixprec-input-") as tmp:
            path = Path(tmp) / "input.onnx"
            onnx.save(model, str(path))
            outcome = run_isolated(path)
    else:
        outcome = run_isolated(model)
    return None if outcome.ok else strict


def check_model_file(
    path: str | Path, original: Callable[[], str | None] | None = None, checks: FileChecks | None = None
) -> str | None:
    """Run the full ONNX checker on a saved converted model.

    Args:
        path: The converted model.
        original: Returns the checker's error for the FP32 model, or None if it passes; asked
            only when the converted model fails.
        checks: A child already running the full checker on `path`: its answer is taken.

    Returns:
        None when the model passes; the error when the FP32 model fails the same way (the
        conversion did not cause it).

    Raises:
        ValidationFailure: The converted model is invalid and the FP32 model is not.
    """
    error = checks.checker_problem(lambda: onnx_checker_error(path)) if checks is not None else onnx_checker_error(path)
    if error is not None:
        error = _without_runtime_ops(path, error, full_check=True)
    if error is None:
        return None
    if original is not None:
        original_error = original()
        if original_error is not None and original_error == error:
            return error
    raise ValidationFailure(f"the converted model fails the ONNX checker: {error}")
