"""The kernels the installed onnxruntime registers on its CPU provider, read from its own
registry, and the rule by which it gives a node one.

onnxruntime gives a node the kernel registered from the node's own schema version, or one
registered over a closed version range that covers it: a kernel registered open-ended from an
older version does not serve a newer schema (onnxruntime 1.32 has no DequantizeLinear for the
schema of opset 28, though its kernel for opset 25 is registered open-ended).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from mixprec.graphs import normalize_domain

__all__ = ["cpu_has_kernel"]

_PROVIDER = "CPUExecutionProvider"
_OPEN_END = 2**31 - 1


@dataclass(frozen=True)
class _Kernel:
    since: int
    until: int
    types: Mapping[str, frozenset[str]]

    def serves(self, version: int) -> bool:
        return self.since == version or (self.since < version <= self.until and self.until != _OPEN_END)

    def admits(self, bindings: Mapping[str, str]) -> bool:
        return all(t in self.types[var] for var, t in bindings.items() if var in self.types)


def cpu_has_kernel(domain: str, op_type: str, since_version: int, bindings: Mapping[str, str]) -> bool:
    """Whether the CPU provider has a kernel for a node of this op whose schema version is
    `since_version`, with its type variables bound as `bindings` (variable -> type string)."""
    kernels = _cpu_kernels().get((normalize_domain(domain), op_type), ())
    return any(k.serves(since_version) and k.admits(bindings) for k in kernels)


@functools.lru_cache(maxsize=1)
def _cpu_kernels() -> dict[tuple[str, str], tuple[_Kernel, ...]]:
    from onnxruntime.capi import onnxruntime_pybind11_state as state  # noqa: PLC0415

    kernels: dict[tuple[str, str], list[_Kernel]] = {}
    for kernel in state.get_all_opkernel_def():
        if kernel.provider != _PROVIDER:
            continue
        since, until = kernel.version_range
        types = {var: frozenset(listed) for var, listed in kernel.type_constraints.items()}
        kernels.setdefault((normalize_domain(kernel.domain), kernel.op_name), []).append(_Kernel(since, until, types))
    return {key: tuple(found) for key, found in kernels.items()}
