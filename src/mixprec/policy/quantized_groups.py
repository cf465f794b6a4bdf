"""How each runtime runs quantized groups (`tables/quantized_groups.toml`): the constant
dequantizations it computes in float at run time, and the scale types of its one-op groups."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir

from mixprec.dtypes import LowPrecision
from mixprec.errors import PolicyError
from mixprec.graphs import normalize_domain, parse_op_name
from mixprec.policy.toml_tables import runtime_sections, shipped_table

__all__ = ["QuantizedGroups", "parse_quantized_groups", "quantized_groups"]

_SOURCE = "quantized_groups.toml"
_KEYS = ("float_dequantize", "group_scales", "fp32_groups", "integer_groups", "qdq_scales", "fp32_readers", "source")
_FLOAT_NAMES = {"float": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16"}


@dataclass(frozen=True)
class QuantizedGroups:
    """One runtime's way with quantized groups.

    Attributes:
        runtime: The profile the facts are for ("default" for unlisted ones).
        float_dequantize: Integer types of constant DequantizeLinear inputs the runtime
            dequantizes to float at run time inside a quantized group.
        group_scales: Float types the runtime runs a one-op group in.
        fp32_groups: (domain, op) of the one-op groups that stay FP32 all the same.
        integer_groups: (domain, op) of the data-movement ones among those the converter
            writes on integers where the runtime runs the op on the integer type.
        qdq_scales: Float types the runtime compiles Q/DQ scales in.
        fp32_readers: (domain, op) of the ops the runtime runs only with an FP32
            DequantizeLinear input.
        source: Where the facts come from.
    """

    runtime: str
    float_dequantize: frozenset[ir.DataType]
    group_scales: frozenset[ir.DataType]
    fp32_groups: frozenset[tuple[str, str]]
    integer_groups: frozenset[tuple[str, str]]
    qdq_scales: frozenset[ir.DataType]
    fp32_readers: frozenset[tuple[str, str]]
    source: str

    def dequantizes_in_float(self, dtype: ir.DataType | None) -> bool:
        """Whether a constant DequantizeLinear of `dtype` runs as a float computation."""
        return dtype in self.float_dequantize

    def runs_group_in(self, target: LowPrecision, domain: str, op_type: str) -> bool:
        """Whether a one-op group (DQ -> op -> Q) of this op runs in `target` on this runtime."""
        return target.ir_dtype in self.group_scales and (normalize_domain(domain), op_type) not in self.fp32_groups

    def compiles_scales_in(self, target: LowPrecision) -> bool:
        """Whether the runtime compiles Q/DQ nodes with `target` scales."""
        return target.ir_dtype in self.qdq_scales

    def reads_dequantized_in_fp32(self, domain: str, op_type: str) -> bool:
        """Whether the op runs on this runtime only with an FP32 DequantizeLinear input."""
        return (normalize_domain(domain), op_type) in self.fp32_readers


def quantized_groups(runtime: str | None) -> QuantizedGroups:
    """The facts of `runtime` (a profile name; None or unlisted: the default ones)."""
    table = _shipped()
    return table.get(runtime or "default", table["default"])


@functools.lru_cache(maxsize=1)
def _shipped() -> Mapping[str, QuantizedGroups]:
    return parse_quantized_groups(shipped_table(_SOURCE), _SOURCE)


def parse_quantized_groups(document: Mapping[str, Any], source: str) -> dict[str, QuantizedGroups]:
    """Build the table from a parsed document; `source` names it in errors."""
    table: dict[str, QuantizedGroups] = {}
    for runtime, entry, where in runtime_sections(document, source, _KEYS):
        if not isinstance(entry["source"], str) or not entry["source"].strip():
            raise PolicyError(f"{where}: 'source' must be a non-empty string")
        integers = _types(entry["float_dequantize"], f"{where}: 'float_dequantize'")
        if any(t.is_floating_point() for t in integers):
            raise PolicyError(f"{where}: 'float_dequantize' lists integer types only")
        scales = _types(entry["group_scales"], f"{where}: 'group_scales'", _FLOAT_NAMES)
        qdq_scales = _types(entry["qdq_scales"], f"{where}: 'qdq_scales'", _FLOAT_NAMES)
        groups, on_integers, readers = (
            _ops(entry[key], f"{where}: {key!r}") for key in ("fp32_groups", "integer_groups", "fp32_readers")
        )
        if not on_integers <= groups:
            raise PolicyError(f"{where}: 'integer_groups' lists ops of 'fp32_groups' only")
        table[runtime] = QuantizedGroups(
            runtime, integers, scales, groups, on_integers, qdq_scales, readers, entry["source"]
        )
    return table


def _types(listed: object, where: str, names: Mapping[str, str] | None = None) -> frozenset[ir.DataType]:
    """ONNX element type names (`int8`, `float16`) as data types; `names` restricts and maps them."""
    if not isinstance(listed, list) or not all(isinstance(name, str) for name in listed):
        raise PolicyError(f"{where} must be a list of type names, got {listed!r}")
    types = set()
    for name in listed:
        key = names.get(name) if names is not None else name.upper()
        dtype = getattr(ir.DataType, key, None) if key is not None else None
        if not isinstance(dtype, ir.DataType):
            raise PolicyError(f"{where}: unknown type {name!r}")
        types.add(dtype)
    return frozenset(types)


def _ops(listed: object, where: str) -> frozenset[tuple[str, str]]:
    """Op names (`Op`, `domain::Op`) as (domain, op) pairs."""
    if not isinstance(listed, list) or not all(isinstance(op, str) and op for op in listed):
        raise PolicyError(f"{where} must be a list of op names, got {listed!r}")
    return frozenset(parse_op_name(op) for op in listed)
