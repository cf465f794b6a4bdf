"""Per-runtime cost figures (`tables/costs.toml`): what a byte of traffic, a matrix FLOP in 16
bits or FP32, and a kernel launch cost on the device class each runtime targets. The formulas
that use them live in :mod:`mixprec.analysis.cost_model`."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixprec.errors import PolicyError
from mixprec.host import host_cpu
from mixprec.policy.toml_tables import runtime_sections, shipped_table

_SOURCE = "costs.toml"
_NUMBERS = ("flops_per_byte", "fp32_flop_cost", "launch_bytes")
_TEXTS = ("device", "source")
_OPTIONAL_NUMBERS = ("low_arithmetic_bytes",)
_OPTIONAL_TEXTS = ("measured",)
_OPTIONAL_FLAGS = ("host_cpu",)


@dataclass(frozen=True)
class RuntimeCost:
    """One runtime's cost figures, in units of the time to move one byte (see the table).

    Attributes:
        runtime: The profile the figures are for ("default" for unlisted ones).
        flops_per_byte: 16-bit matrix FLOPs per byte of traffic (machine balance).
        fp32_flop_cost: Time of an FP32 matrix FLOP relative to a 16-bit one.
        launch_bytes: Fixed cost of one kernel launch, in bytes of traffic.
        device: The device class described.
        source: Where the figures come from.
        measured: The command that measured them, if they were measured.
        host_cpu: The runtime runs on the converting machine's CPU: the figures are taken to
            describe it (see :func:`runtime_cost`).
        limitation: What the host lacks that the figures assumed, if anything.
        low_arithmetic_bytes: Time, in bytes of traffic, per element an op reads and writes
            when it computes (not only moves values) in 16 bits: its 16-bit traffic (2) unless
            the runtime's 16-bit kernels are slower than that.
    """

    runtime: str
    flops_per_byte: float
    fp32_flop_cost: float
    launch_bytes: float
    device: str
    source: str
    measured: str | None = None
    host_cpu: bool = False
    limitation: str | None = None
    low_arithmetic_bytes: float = 2.0


def runtime_cost(runtime: str | None, target: str | None = None) -> RuntimeCost:
    """The cost figures of `runtime` (a profile name; None or unlisted: the default ones).

    For a runtime on the host's CPU the device is this machine's CPU, and where it has no
    matrix arithmetic in `target` ("bfloat16", "float16") a 16-bit matrix FLOP costs what an
    FP32 one does (the runtime computes the graph in FP32 there).
    """
    table = _shipped()
    cost = table.get(runtime or "default", table["default"])
    if not cost.host_cpu:
        return cost
    cpu = host_cpu()
    cost = dataclasses.replace(cost, device=cpu.describe())
    if target is None or cpu.computes(target) or cost.fp32_flop_cost == 1.0:
        return cost
    return dataclasses.replace(
        cost,
        flops_per_byte=cost.flops_per_byte / cost.fp32_flop_cost,
        fp32_flop_cost=1.0,
        limitation=(
            f"{cpu.missing(target)} on this CPU: {target} matrix products run as FP32, so 16 bits save "
            "traffic and file size, not arithmetic (--weights-only keeps FP32 compute with 16-bit weights)"
        ),
    )


@functools.lru_cache(maxsize=1)
def _shipped() -> Mapping[str, RuntimeCost]:
    return parse_costs(shipped_table(_SOURCE), _SOURCE)


def parse_costs(document: Mapping[str, Any], source: str) -> dict[str, RuntimeCost]:
    """Build the cost table from a parsed document; `source` names it in errors."""
    table: dict[str, RuntimeCost] = {}
    optional = (*_OPTIONAL_NUMBERS, *_OPTIONAL_TEXTS, *_OPTIONAL_FLAGS)
    for runtime, entry, where in runtime_sections(document, source, (*_NUMBERS, *_TEXTS), optional):
        values: dict[str, Any] = {}
        for key in (*_NUMBERS, *(k for k in _OPTIONAL_NUMBERS if k in entry)):
            number = entry[key]
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 < number < math.inf:
                raise PolicyError(f"{where}: {key!r} must be a positive finite number, got {number!r}")
            values[key] = float(number)
        for key in (*_TEXTS, *_OPTIONAL_TEXTS):
            if key in entry:
                if not isinstance(entry[key], str) or not entry[key].strip():
                    raise PolicyError(f"{where}: {key!r} must be a non-empty string")
                values[key] = entry[key]
        for key in _OPTIONAL_FLAGS:
            if key in entry:
                if not isinstance(entry[key], bool):
                    raise PolicyError(f"{where}: {key!r} must be true or false")
                values[key] = entry[key]
        table[runtime] = RuntimeCost(runtime=runtime, **values)
    return table
