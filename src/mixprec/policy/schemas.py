"""What the ONNX operator schemas allow: the type variable of each input and output, and the
element types each type variable admits at a given opset."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx.defs

from mixprec.policy.table import normalize_domain


@dataclass(frozen=True)
class Signature:
    """Type binding of one node's actual inputs and outputs under its schema.

    Attributes:
        since_version: Opset version of the schema in force.
        input_vars: For each actual input, its type variable (None: a fixed type).
        output_vars: For each actual output, its type variable (None: a fixed type).
        allowed: For each type variable, the admitted type strings (e.g. `tensor(float16)`).
        fixed_inputs: For inputs with a fixed type, the type string.
    """

    since_version: int
    input_vars: tuple[str | None, ...]
    output_vars: tuple[str | None, ...]
    allowed: dict[str, frozenset[str]]


@functools.lru_cache(maxsize=4096)
def get_schema(op_type: str, domain: str, opset: int) -> onnx.defs.OpSchema | None:
    """The schema of an op at an opset, or None if ONNX does not define it there."""
    try:
        return onnx.defs.get_schema(op_type, opset, normalize_domain(domain))
    except onnx.defs.SchemaError:
        return None


def op_exists(op_type: str, domain: str) -> bool:
    """Whether ONNX defines this op at any opset."""
    return onnx.defs.has(op_type, normalize_domain(domain))


def _bind(formals: list, count: int) -> tuple[str | None, ...]:
    bound: list[str | None] = []
    for index in range(count):
        if not formals:
            bound.append(None)
            continue
        formal = formals[min(index, len(formals) - 1)]
        if index >= len(formals) and formal.option != onnx.defs.OpSchema.FormalParameterOption.Variadic:
            bound.append(None)
            continue
        type_str = formal.type_str
        bound.append(None if type_str.startswith(("tensor(", "seq(", "optional(")) else type_str)
    return tuple(bound)


@functools.lru_cache(maxsize=65536)
def signature(
    op_type: str, domain: str, opset: int, n_inputs: int, n_outputs: int
) -> Signature | None:
    """Bind a node's actual inputs/outputs to its schema's type variables."""
    schema = get_schema(op_type, domain, opset)
    if schema is None:
        return None
    allowed = {
        c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints
    }
    return Signature(
        since_version=schema.since_version,
        input_vars=_bind(list(schema.inputs), n_inputs),
        output_vars=_bind(list(schema.outputs), n_outputs),
        allowed=allowed,
    )
