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


class ConversionError(MixprecError):
    """The conversion produced a model that fails validation; nothing was written."""


class ValidationError(MixprecError):
    """Running or comparing models failed."""
