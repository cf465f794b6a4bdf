"""The ONNX checker, run on a file path (so models with external data beyond 2 GB work)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import onnx.checker

from mixprec.errors import ConversionError


def checker_error(model: str | Path | onnx.ModelProto) -> str | None:
    """The full ONNX checker's (strict type inference included) first error line, or None."""
    try:
        onnx.checker.check_model(model if isinstance(model, onnx.ModelProto) else str(model), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        lines = str(e).strip().splitlines()
        return lines[0] if lines else type(e).__name__
    return None


def check_model_file(path: str | Path, original: Callable[[], str | None] | None = None) -> str | None:
    """Run the full ONNX checker on a saved converted model.

    Args:
        path: The converted model.
        original: Returns the checker's error for the FP32 model, or None if it passes; asked
            only when the converted model fails.

    Returns:
        None when the model passes; the error when the FP32 model fails the same way (the
        conversion did not cause it).

    Raises:
        ConversionError: The converted model is invalid and the FP32 model is not.
    """
    error = checker_error(path)
    if error is None:
        return None
    if original is not None:
        original_error = original()
        if original_error is not None and original_error == error:
            return error
    raise ConversionError(f"the converted model fails the ONNX checker: {error}")
