"""What validation found, as data: each output's agreement with the FP32 model and the
checks that ran (the report's `validation` field)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["InputScale", "OutputError", "Validation"]


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
    shapes: tuple[tuple[int | None, ...], tuple[int | None, ...]] | None = None  # (FP32, converted) where they differ


@dataclass
class InputScale:
    """The converted model on generated inputs scaled up to a magnitude that real, unnormalized
    inputs have (pixel values, audio samples): whether it stays finite where the FP32 model does."""

    magnitude: float  # largest |x| of every float input
    meaning: str  # what inputs have that magnitude, e.g. "8-bit pixel values"
    finite: bool | None  # None: not judged (the FP32 model overflows there too, or does not run)
    origin: str | None = None  # where non-finite values start (or why it did not run), when not finite
    inputs: tuple[str, ...] = ()  # the inputs scaled
    ran: bool = True  # False: the emulated converted model failed to run there (FP32 ran)


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
    # Generated inputs only: the converted model at larger input magnitudes (see `InputScale`).
    input_scales: list[InputScale] = field(default_factory=list)


def shape_text(shapes: tuple[tuple[int | None, ...], tuple[int | None, ...]]) -> str:
    """An output whose shape the conversion changed (a length computed from rounded values)."""

    def dims(shape: tuple[int | None, ...]) -> str:
        return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"

    return f"shape {dims(shapes[1])} where the FP32 model's is {dims(shapes[0])}"
