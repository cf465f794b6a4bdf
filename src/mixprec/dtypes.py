"""The 16-bit float types mixprec targets, and their numeric limits."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from mixprec.errors import InputError


class LowPrecision(enum.Enum):
    """A 16-bit floating-point target type."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @property
    def ir_dtype(self) -> ir.DataType:
        """The onnx_ir data type."""
        return ir.DataType.FLOAT16 if self is LowPrecision.FLOAT16 else ir.DataType.BFLOAT16

    @property
    def numpy_dtype(self) -> np.dtype:
        """The NumPy dtype (bfloat16 comes from ml_dtypes)."""
        return np.dtype(np.float16) if self is LowPrecision.FLOAT16 else np.dtype(ml_dtypes.bfloat16)

    @property
    def short_name(self) -> str:
        """`fp16` or `bf16`."""
        return "fp16" if self is LowPrecision.FLOAT16 else "bf16"

    @property
    def type_str(self) -> str:
        """The type string used by ONNX operator schemas, e.g. `tensor(float16)`."""
        return f"tensor({self.value})"

    @property
    def limits(self) -> FloatLimits:
        """Range limits of this type."""
        return _LIMITS[self]


@dataclass(frozen=True)
class FloatLimits:
    """Numeric limits of a float type.

    Attributes:
        max: Largest finite value.
        tiny: Smallest positive normal value.
        smallest_subnormal: Smallest positive value; anything below half of it rounds to zero.
        eps: Machine epsilon (relative spacing at 1.0).
        exact_int_max: Largest integer N such that every integer in [0, N] is exact.
    """

    max: float
    tiny: float
    smallest_subnormal: float
    eps: float
    exact_int_max: int

    @property
    def overflow_from(self) -> float:
        """The smallest magnitude that rounds to infinity (half a step past `max`: rounding
        to nearest, ties to even, goes up from `max`, whose significand is odd)."""
        return self.max + self.eps * 2.0 ** math.floor(math.log2(self.max)) / 2


def _limits(dtype: type) -> FloatLimits:
    info = ml_dtypes.finfo(dtype)
    return FloatLimits(
        max=float(info.max),
        tiny=float(info.tiny),
        smallest_subnormal=float(info.smallest_subnormal),
        eps=float(info.eps),
        exact_int_max=2 ** (info.nmant + 1),
    )


_LIMITS = {
    LowPrecision.FLOAT16: _limits(np.float16),
    LowPrecision.BFLOAT16: _limits(ml_dtypes.bfloat16),
}

_ALIASES = {
    "float16": LowPrecision.FLOAT16,
    "fp16": LowPrecision.FLOAT16,
    "half": LowPrecision.FLOAT16,
    "bfloat16": LowPrecision.BFLOAT16,
    "bf16": LowPrecision.BFLOAT16,
}


def parse_low_precision(value: str | LowPrecision) -> LowPrecision:
    """Parse a user-facing type name (`fp16`, `float16`, `bf16`, `bfloat16`)."""
    if isinstance(value, LowPrecision):
        return value
    key = str(value).strip().lower()
    if key not in _ALIASES:
        raise InputError(
            f"unknown target type {value!r}: use one of float16 (fp16) or bfloat16 (bf16)"
        )
    return _ALIASES[key]


_FLOAT = ir.DataType.FLOAT

FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
)


def is_fp32_tensor(value: ir.Value | None) -> bool:
    """Whether a value is a float32 tensor (sequences and optionals are not tensors)."""
    if value is None:
        return False
    value_type = value.type
    # Untyped values are common and `isinstance(None, ir.TensorType)` is slow (a Protocol check).
    if value_type is None:
        return False
    return isinstance(value_type, ir.TensorType) and value_type.dtype == _FLOAT


def is_float_dtype(dtype: np.dtype) -> bool:
    """Whether a NumPy dtype is a floating-point type (ml_dtypes' bfloat16 and float8 included)."""
    if np.issubdtype(dtype, np.floating):
        return True
    try:
        ml_dtypes.finfo(dtype)
    except (ValueError, TypeError):
        return False
    return True
