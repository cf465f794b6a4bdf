"""The ONNX checker, run on a file path (so models with external data beyond 2 GB work)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx
import onnx.checker

from mixprec.errors import ValidationFailure
from mixprec.io.onnx_file import FileChecks, checker_error

__all__ = ["check_model_file", "checker_error", "input_problem"]


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
    error = checks.checker_problem(lambda: checker_error(path)) if checks is not None else checker_error(path)
    if error is None:
        return None
    if original is not None:
        original_error = original()
        if original_error is not None and original_error == error:
            return error
    raise ValidationFailure(f"the converted model fails the ONNX checker: {error}")
