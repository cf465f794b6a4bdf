"""What this machine's CPU computes in 16 bits, for the cost model and the checks on CPU runtimes.

A CPU runtime (OpenVINO's CPU plugin, onnxruntime's CPU provider) runs the model on the machine
that converts it, so what the report says about speed must describe that machine. x86-64 CPUs
compute bfloat16 matrix products only with AVX512-BF16 or AMX-BF16, and float16 ones only with
AVX512-FP16 or AMX-FP16; elsewhere a 16-bit graph is computed in FP32 (OpenVINO converts it
when compiling), so 16 bits save storage and traffic, not arithmetic.

The features come from ``/proc/cpuinfo`` (Linux), else from OpenVINO's
``OPTIMIZATION_CAPABILITIES`` when it is installed. ``MIXPREC_CPU_FLAGS`` (a comma-separated
list of cpuinfo flags, empty for none) replaces what was detected: a way to see what mixprec
says and does on a CPU without these features.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# cpuinfo flags that give 16-bit matrix arithmetic, per 16-bit type.
ARITHMETIC_FLAGS: dict[str, tuple[str, ...]] = {
    "bfloat16": ("avx512_bf16", "amx_bf16"),
    "float16": ("avx512_fp16", "amx_fp16"),
}
_FLAG_NAMES = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16", "avx512_fp16": "AVX512-FP16", "amx_fp16": "AMX-FP16"}
# OpenVINO's capability names for the same facts.
_OPENVINO_CAPABILITIES = {"BF16": ("avx512_bf16",), "FP16": ("avx512_fp16",)}
OVERRIDE_VARIABLE = "MIXPREC_CPU_FLAGS"


@dataclass(frozen=True)
class HostCpu:
    """This machine's CPU as far as 16-bit arithmetic goes.

    Attributes:
        name: The model name the system reports.
        cores: Logical cores available to this process.
        flags: The 16-bit arithmetic features found (cpuinfo names).
        source: Where the features come from (cpuinfo, OpenVINO, the override variable).
    """

    name: str
    cores: int
    flags: frozenset[str]
    source: str

    def computes(self, type_name: str) -> bool:
        """Whether matrix products in `type_name` ("bfloat16", "float16") run in that type."""
        return any(flag in self.flags for flag in ARITHMETIC_FLAGS.get(type_name, ()))

    def describe(self) -> str:
        """E.g. "this machine's CPU (Intel Xeon, 2 cores; AVX512-BF16, AMX-BF16)"."""
        features = ", ".join(_FLAG_NAMES[f] for f in sorted(self.flags) if f in _FLAG_NAMES)
        return f"this machine's CPU ({self.name}, {self.cores} cores; {features or 'no 16-bit matrix arithmetic'})"

    def missing(self, type_name: str) -> str:
        """Why `type_name` arithmetic is absent, e.g. "no AVX512-BF16 or AMX-BF16"."""
        return "no " + " or ".join(_FLAG_NAMES[f] for f in ARITHMETIC_FLAGS.get(type_name, ()))


@functools.cache
def host_cpu() -> HostCpu:
    """The CPU this process runs on (detected once)."""
    name, flags, source = _cpuinfo()
    if flags is None:
        flags, source = _openvino_flags()
    override = os.environ.get(OVERRIDE_VARIABLE)
    if override is not None:
        flags = frozenset(f.strip().lower() for f in override.split(",") if f.strip())
        source = f"{OVERRIDE_VARIABLE}={override!r}"
    known = {f for flags_of_type in ARITHMETIC_FLAGS.values() for f in flags_of_type}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return HostCpu(name=name, cores=cores, flags=frozenset(flags or ()) & known, source=source)


def _cpuinfo() -> tuple[str, frozenset[str] | None, str]:
    path = Path("/proc/cpuinfo")
    name = platform.processor() or platform.machine() or "unknown CPU"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return name, None, "none"
    flags: frozenset[str] | None = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            name = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = frozenset(value.split())
        if flags is not None and key == "model name":
            break
    return name, flags, str(path)


def _openvino_flags() -> tuple[frozenset[str] | None, str]:
    try:
        import openvino  # noqa: PLC0415

        capabilities = openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    except Exception:  # noqa: BLE001 - absent or broken: nothing known
        return None, "none"
    flags = {flag for cap, names in _OPENVINO_CAPABILITIES.items() if cap in capabilities for flag in names}
    return frozenset(flags), "OpenVINO OPTIMIZATION_CAPABILITIES"
