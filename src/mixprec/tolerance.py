"""What converted outputs must meet: one tolerance type for the numeric check and the search."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mixprec.errors import InputError


@dataclass(frozen=True)
class Tolerance:
    """What every checked output must meet (all criteria that are set): used by the numeric
    check of `convert` and by the accuracy search of `tune`.

    Attributes:
        atol: Absolute tolerance of the allclose rule ``|c - r| <= atol + rtol * |r|``.
        rtol: Relative tolerance of that rule (only one of the two set: the other is 0).
        min_cosine: Lowest cosine similarity of candidate and reference (per batch).
        topk_agreement: Lowest fraction of samples whose top-1 index over the last axis
            agrees with the reference (outputs with a last axis of at least 2).
        outputs: Output names the criteria apply to (default: all). Integer and bool outputs
            must match exactly; no output may gain NaN or Inf.
    """

    atol: float | None = None
    rtol: float | None = None
    min_cosine: float | None = None
    topk_agreement: float | None = None
    outputs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise InputError(f"tolerance {name} must be a finite number >= 0, got {value}")
        bounds = {"min_cosine": (-1.0, 1.0), "topk_agreement": (0.0, 1.0)}
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if value is not None and not (low <= value <= high):
                raise InputError(f"tolerance {name} must lie in [{low:g}, {high:g}], got {value}")
        if self.outputs is not None:
            object.__setattr__(self, "outputs", tuple(self.outputs))

    @property
    def allclose(self) -> tuple[float, float] | None:
        """(atol, rtol) of the allclose rule, or None when neither is set."""
        if self.atol is None and self.rtol is None:
            return None
        return (self.atol or 0.0, self.rtol or 0.0)

    @property
    def empty(self) -> bool:
        """Whether no criterion is set."""
        return self.allclose is None and self.min_cosine is None and self.topk_agreement is None

    def describe(self) -> str:
        """A short text form, e.g. ``atol=0.01, rtol=0.01``."""
        parts = []
        if self.allclose is not None:
            parts.append(f"atol={self.allclose[0]:g}, rtol={self.allclose[1]:g}")
        if self.min_cosine is not None:
            parts.append(f"cosine>={self.min_cosine:g}")
        if self.topk_agreement is not None:
            parts.append(f"top-1 agreement>={self.topk_agreement:g}")
        return ", ".join(parts) or "no numeric criterion"


def as_tolerance(value: Tolerance | tuple[float, float] | None) -> Tolerance | None:
    """A `Tolerance` from a `Tolerance`, an (atol, rtol) pair, or None."""
    if value is None or isinstance(value, Tolerance):
        return value
    try:
        atol, rtol = (float(v) for v in value)
    except (TypeError, ValueError):
        raise InputError(f"tolerance must be a Tolerance or an (atol, rtol) pair of numbers, got {value!r}") from None
    return Tolerance(atol=atol, rtol=rtol)
