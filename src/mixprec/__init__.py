"""mixprec: convert FP32 ONNX models to mixed precision (float16 / bfloat16)."""

from __future__ import annotations

__version__ = "0.1.0"
