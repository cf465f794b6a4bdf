"""mixprec: convert FP32 ONNX models to mixed precision (float16 / bfloat16)."""

from __future__ import annotations

from mixprec.analysis.typeinfo import infer_types
from mixprec.api import ConversionResult, build_policy, convert, convert_module, convert_with_config
from mixprec.config import Config
from mixprec.dtypes import LowPrecision
from mixprec.errors import (
    ConversionError,
    ExportError,
    InputError,
    InvariantError,
    MixprecError,
    ModelLoadError,
    PolicyError,
    RunError,
    ValidationError,
    ValidationFailure,
)
from mixprec.io import load_model, save_model
from mixprec.passes.rewrite import apply_plan
from mixprec.plan.file import load_plan, save_plan
from mixprec.plan.model import Decision, Precision, PrecisionPlan
from mixprec.plan.planner import plan_precision
from mixprec.policy.table import OpClass, Policy, load_policy
from mixprec.report import Report
from mixprec.tolerance import Tolerance
from mixprec.tune import TuneResult  # the search itself: mixprec.tune.tune
from mixprec.version import __version__

__all__ = [
    "Config",
    "ConversionError",
    "ConversionResult",
    "ExportError",
    "Decision",
    "InputError",
    "InvariantError",
    "LowPrecision",
    "MixprecError",
    "ModelLoadError",
    "OpClass",
    "Policy",
    "PolicyError",
    "Precision",
    "PrecisionPlan",
    "Report",
    "RunError",
    "Tolerance",
    "TuneResult",
    "ValidationError",
    "ValidationFailure",
    "__version__",
    "apply_plan",
    "build_policy",
    "convert",
    "convert_module",
    "convert_with_config",
    "infer_types",
    "load_model",
    "load_plan",
    "load_policy",
    "plan_precision",
    "save_model",
    "save_plan",
]
