"""Exception hierarchy: every user-facing failure is a :class:`MixprecError`."""

from __future__ import annotations


class MixprecError(Exception):
    """Base class for errors that mixprec reports to the user without a traceback."""


class InputError(MixprecError):
    """A user-supplied argument (path, option, name pattern, data file) is invalid."""


class ModelLoadError(MixprecError):
    """A model file cannot be read: missing, not ONNX, truncated, or missing external data."""


class PolicyError(MixprecError):
    """An op policy table or a user policy override is invalid."""


class ExportError(MixprecError):
    """A framework model (a PyTorch module) could not be exported to ONNX."""


class ValidationFailure(MixprecError):
    """The converted model fails a check (the ONNX checker, the runtime as users run it, the
    tolerance); nothing was written."""


class BeyondTolerance(ValidationFailure):
    """An output of the converted model is further from the FP32 model than the tolerance;
    `validation` holds what the check found."""

    def __init__(self, message: str, validation: object) -> None:
        super().__init__(message)
        self.validation = validation


class RunError(MixprecError):
    """A model could not be run or compared (onnxruntime, OpenVINO, the emulation)."""


class InvariantError(MixprecError):
    """A conversion step left the model broken (duplicate names, a dangling edge, a type that
    disagrees with its producer, ...): a converter bug, caught where it happened
    (``MIXPREC_CHECK_STEPS=1``)."""


# The earlier names of the two, kept for code written against them.
ConversionError = ValidationFailure
ValidationError = RunError
