"""The options of a conversion, grouped: what `convert`, `tune` and the command line share.

    config = Config.from_options(target_dtype="bf16", fp32_ops=["Sigmoid"], runtime="openvino")
    config.ops.target            # LowPrecision.BFLOAT16
    config.replace(validation=ValidationConfig(level="none"))

Options are checked when the config is built, with a one-line `InputError` naming the option;
files an option names (policy, plan, data) are checked when the conversion reads them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mixprec.dtypes import LowPrecision, parse_low_precision
from mixprec.errors import InputError
from mixprec.tolerance import Tolerance, as_tolerance

_LEVELS = ("auto", "run", "load", "checker", "none")


@dataclass(frozen=True)
class OpsConfig:
    """Which ops convert: the target type, the policy table and the user's class overrides."""

    target: LowPrecision = LowPrecision.FLOAT16
    low_precision_ops: tuple[str, ...] = ()
    fp32_ops: tuple[str, ...] = ()
    follow_ops: tuple[str, ...] = ()
    policy_file: str | os.PathLike | None = None
    weights_only: bool = False
    fold_norm_scales: bool = True


@dataclass(frozen=True)
class NodesConfig:
    """Per-node choices: excluded node names/patterns and a plan file (or its dict)."""

    exclude: tuple[str, ...] = ()
    plan: str | os.PathLike | Mapping[str, object] | None = None


@dataclass(frozen=True)
class IOConfig:
    """The model's interface and file: I/O types, opset, external data, invalid input."""

    keep_io_types: bool = True
    inline_functions: bool | None = None  # None: inline where nothing stands in the way
    opset: int | None = None
    external_data: bool | None = None
    allow_invalid: bool = False
    overwrite: bool = False


@dataclass(frozen=True)
class CalibrationConfig:
    """Input data and the range measurement on it."""

    data: Any = None
    max_batches: int = 8
    calibrate: bool = True
    ranges: Any = None  # a mixprec.analysis.calibrate.RangeTable measured before


@dataclass(frozen=True)
class ValidationConfig:
    """How the converted model is checked, and what its outputs must meet."""

    level: str = "auto"
    tolerance: Tolerance | None = None


@dataclass(frozen=True)
class OutputConfig:
    """How the work shows itself."""

    progress: bool | None = False


@dataclass(frozen=True)
class Config:
    """All options of one conversion (see `mixprec.convert` for each one's meaning)."""

    ops: OpsConfig = field(default_factory=OpsConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    io: IOConfig = field(default_factory=IOConfig)
    runtime: str | None = None
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    @classmethod
    def from_options(cls, **options: Any) -> Config:
        """Build a config from `convert`'s keyword names (unknown names are an `InputError`)."""
        return cls().with_options(**options)

    def replace(self, **changes: Any) -> Config:
        """A copy with whole groups (or `runtime`) replaced."""
        return dataclasses.replace(self, **changes)

    def with_options(self, **options: Any) -> Config:
        """A copy with some of `convert`'s keyword options changed."""
        config = self
        for name, value in options.items():
            if name == "runtime":
                config = dataclasses.replace(config, runtime=value)
                continue
            where = OPTIONS.get(name)
            if where is None:
                raise InputError(f"unknown option {name!r}")
            group, attribute = where
            updated = dataclasses.replace(getattr(config, group), **{attribute: _normalize(name, value)})
            config = dataclasses.replace(config, **{group: updated})
        return config

    @staticmethod
    def groups_of(options: Iterable[str]) -> set[str]:
        """The groups the named options belong to."""
        return {"runtime" if name == "runtime" else OPTIONS[name][0] for name in options if name in OPTIONS or name == "runtime"}


# `convert`'s keyword name -> (group, attribute).
OPTIONS: dict[str, tuple[str, str]] = {
    "target_dtype": ("ops", "target"),
    "low_precision_ops": ("ops", "low_precision_ops"),
    "fp32_ops": ("ops", "fp32_ops"),
    "follow_ops": ("ops", "follow_ops"),
    "policy_file": ("ops", "policy_file"),
    "weights_only": ("ops", "weights_only"),
    "fold_norm_scales": ("ops", "fold_norm_scales"),
    "exclude_nodes": ("nodes", "exclude"),
    "plan": ("nodes", "plan"),
    "keep_io_types": ("io", "keep_io_types"),
    "inline_functions": ("io", "inline_functions"),
    "opset": ("io", "opset"),
    "external_data": ("io", "external_data"),
    "allow_invalid": ("io", "allow_invalid"),
    "overwrite": ("io", "overwrite"),
    "data": ("calibration", "data"),
    "max_batches": ("calibration", "max_batches"),
    "calibrate": ("calibration", "calibrate"),
    "ranges": ("calibration", "ranges"),
    "validate": ("validation", "level"),
    "tolerance": ("validation", "tolerance"),
    "progress": ("output", "progress"),
}


def _normalize(name: str, value: Any) -> Any:
    """Check one option and bring it to its stored form."""
    normalizer = _NORMALIZERS.get(name)
    return value if normalizer is None else normalizer(value)


def _names(value: str | Iterable[str]) -> tuple[str, ...]:
    """A list of op or node names (one name alone as a string)."""
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _validation_level(value: Any) -> str:
    """A validation level: one of `_LEVELS`, True for "auto" or False for "none"."""
    if value is True:
        return "auto"
    if value is False:
        return "none"
    if value not in _LEVELS:
        raise InputError(f"unknown validation level {value!r}: use auto, run, load, checker or none")
    return str(value)


def _max_batches(value: Any) -> int:
    """A number of batches: an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"max_batches must be an integer >= 1, got {value!r}")
    return value


def _opset(value: Any) -> int | None:
    """An opset: a positive integer, or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InputError(f"opset must be a positive integer, got {value!r}")
    return value


# Option name -> its check and stored form (other options are stored as they are).
_NORMALIZERS: dict[str, Callable[[Any], Any]] = {
    "target_dtype": parse_low_precision,
    "low_precision_ops": _names,
    "fp32_ops": _names,
    "follow_ops": _names,
    "exclude_nodes": _names,
    "tolerance": as_tolerance,
    "validate": _validation_level,
    "max_batches": _max_batches,
    "opset": _opset,
}
