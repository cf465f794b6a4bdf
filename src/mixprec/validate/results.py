"""What validation found, as data: each output's agreement with the FP32 model and the
checks that ran (the report's `validation` field)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OutputError", "Validation"]


@dataclass
class OutputError:
    """Numeric agreement of one model output with the FP32 model."""

    name: str
    max_abs_error: float
    max_rel_error: float
    nan_count: int
    inf_count: int
    new_nonfinite: int
    within_tolerance: bool | None = None
    scaled_error: float | None = None  # max |diff| / max |reference|


@dataclass
class Validation:
    """What was checked after conversion, and the outcome."""

    checker: str = "skipped"  # passed | skipped
    runtime: str = "skipped"  # ran | loaded | skipped | emulated | reference-fails | no cpu kernels
    seconds: float = 0.0
    batches: int = 0
    outputs: list[OutputError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    real_runtime: str | None = None  # the runtime that ran the 16-bit model for real, if any
    real_executed: str | None = None  # what that runtime says it executed (precision per layer kind)
    real_outputs: list[OutputError] = field(default_factory=list)
    speed_ratio: float | None = None  # converted / FP32 latency on the real runtime
    numerics: str = "not checked"  # "checked ..." or "not checked: <why>"
    numerics_unchecked: bool = False  # the check was due (level run) but could not run
    # A PyTorch module converted with `convert_module`: the converted model against the module
    # itself (export and conversion together), on the example inputs and data.
    module_outputs: list[OutputError] = field(default_factory=list)
    module_batches: int = 0
