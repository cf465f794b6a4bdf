"""Op facts: what ONNX ops do with their values, read by every analysis.

The facts are package data (`tables/opfacts.toml`), parsed strictly once. They say what an op
*is* (it moves values without arithmetic, it draws random numbers, its ``dtype`` attribute sets
its output type, its FLOPs follow the matrix-product formula ...); what to *do* with it is the
policy (:mod:`mixprec.policy.table`) or the analysis reading the fact. Named rules (interval
rules, FLOPs formulas) are implemented in Python next to their use, keyed by the name.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from mixprec.errors import PolicyError
from mixprec.policy.toml_tables import shipped_table
from mixprec.graphs import normalize_domain, parse_op_name

_SOURCE = "opfacts.toml"


class Carrier(str, enum.Enum):
    """How integer values go through an op (see `tables/opfacts.toml`)."""

    ARITHMETIC = "arithmetic"
    MOVEMENT = "movement"
    OUTER_PRODUCT = "outer_product"
    GENERATOR = "generator"
    REDUCTION = "reduction"


# Carriers whose float outputs carry the integers of float inputs.
FLOAT_CARRIERS = frozenset({Carrier.ARITHMETIC, Carrier.MOVEMENT, Carrier.OUTER_PRODUCT})

# Names the `interval` and `flops` keys may take (implemented in
# mixprec.analysis.integer_semantics and mixprec.tune.flops).
INTERVAL_RULES = frozenset({
    "same", "whole", "gather", "slice", "concat", "cast", "neg", "abs", "floor", "ceil", "round",
    "relu", "add", "sub", "mul", "div", "max", "min", "mod", "where", "clip", "range", "shape",
    "size",
})  # fmt: skip
FLOPS_FORMULAS = frozenset({"matmul", "gemm", "conv", "conv_transpose", "recurrent"})
# Roles of the two ends of a QDQ pair (`quantization`).
QUANTIZATION_ROLES = frozenset({"dequantize", "quantize"})
# Input sets (`additive_inputs`, `scaling_inputs`): indices, or every input of a variadic op.
ALL_INPUTS = "all"
InputSet = tuple[int, ...] | Literal["all"]


@dataclass(frozen=True)
class OpFacts:
    """The facts about one op; an op not in the table has none (all false / None)."""

    carrier: Carrier | None = None
    interval: str | None = None
    shape_only: bool = False
    comparison: bool = False
    exact_use: bool = False
    random: bool = False
    integer_inputs: tuple[tuple[int, str], ...] = ()  # (input index, role), by index
    value_preserving: bool = False
    reshapes: bool = False
    integer_kernel: bool = False
    gathers: bool = False
    bounded: bool = False
    dtype_attribute: str | None = None
    flops: str | None = None
    quantization: str | None = None
    scale_input: int | None = None
    output_type_from: int | None = None
    norm_scale: int | None = None
    norm_bias: int | None = None
    additive_inputs: InputSet = ()
    scaling_inputs: InputSet = ()
    singular_inputs: InputSet = ()
    keeps_zero: bool = False
    normalizes: str | None = None
    quantizes_input: str | None = None

    @property
    def carries_floats(self) -> bool:
        """Whether float outputs carry the integers of the op's float inputs."""
        return self.carrier in FLOAT_CARRIERS

    def adds(self, index: int) -> bool:
        """Whether input `index` is a term added to the output (see `additive_inputs`)."""
        return _selects(self.additive_inputs, index)

    def scales(self, index: int) -> bool:
        """Whether the output is proportional to input `index` (see `scaling_inputs`)."""
        return _selects(self.scaling_inputs, index)

    def singular(self, index: int) -> bool:
        """Whether zero at input `index` is a singularity (see `singular_inputs`)."""
        return _selects(self.singular_inputs, index)


def _selects(inputs: InputSet, index: int) -> bool:
    return inputs == ALL_INPUTS or index in inputs


NO_FACTS = OpFacts()

_FLAGS = (
    "shape_only", "comparison", "exact_use", "random", "value_preserving", "reshapes", "gathers", "bounded",
    "keeps_zero", "integer_kernel",
)
_NAMES = {
    "interval": INTERVAL_RULES, "flops": FLOPS_FORMULAS, "quantization": QUANTIZATION_ROLES,
    "normalizes": frozenset({"from_axis", "spatial", "groups"}),
    "quantizes_input": frozenset({"always", "int8_accuracy"}),
}
_INDICES = ("scale_input", "output_type_from", "norm_scale", "norm_bias")
_INPUT_SETS = ("additive_inputs", "scaling_inputs", "singular_inputs")
_KEYS = frozenset({*_FLAGS, *_NAMES, *_INDICES, *_INPUT_SETS, "carrier", "integer_inputs", "dtype_attribute"})


def op_facts(domain: str, op_type: str) -> OpFacts:
    """The facts about `op_type` of `domain` ("" or "ai.onnx": the default domain)."""
    key = (domain, op_type)
    found = _LOOKUPS.get(key)  # read per node by several steps: one dict lookup
    if found is None:
        found = _LOOKUPS[key] = _shipped().get((normalize_domain(domain), op_type), NO_FACTS)
    return found


# (domain as written, op type) -> facts, filled on first lookup (the table is immutable).
_LOOKUPS: dict[tuple[str, str], OpFacts] = {}


def all_op_facts() -> Mapping[tuple[str, str], OpFacts]:
    """(domain, op_type) -> facts for every op in the shipped table."""
    return _shipped()


@functools.lru_cache(maxsize=1)
def _shipped() -> Mapping[tuple[str, str], OpFacts]:
    return parse_op_facts(shipped_table(_SOURCE), _SOURCE)


def parse_op_facts(document: Mapping[str, Any], source: str) -> Mapping[tuple[str, str], OpFacts]:
    """Build the fact table from a parsed document; `source` names it in errors."""
    table: dict[tuple[str, str], OpFacts] = {}
    for name, entry in document.items():
        where = f"{source}: [{name}]"
        if not isinstance(entry, Mapping):
            raise PolicyError(f"{where}: expected a table of facts, got {entry!r}")
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise PolicyError(f"{where}: unknown key {unknown[0]!r}")
        table[parse_op_name(name)] = _parse_entry(entry, where)
    return MappingProxyType(table)


def _parse_entry(entry: Mapping[str, Any], where: str) -> OpFacts:
    """One op's facts from its table (keys checked in the order of `_PARSERS`)."""
    return OpFacts(**{key: parse(entry[key], key, where) for key, parse in _PARSERS.items() if key in entry})


def _flag(value: Any, key: str, where: str) -> bool:
    """A true/false fact."""
    if not isinstance(value, bool):
        raise PolicyError(f"{where}: {key!r} must be true or false, got {value!r}")
    return value


def _name(value: Any, key: str, where: str) -> str:
    """A fact naming one of the rules or roles `_NAMES[key]` knows."""
    known = _NAMES[key]
    if value not in known:
        names = ", ".join(sorted(known))
        raise PolicyError(f"{where}: unknown {key} {value!r} (known: {names})")
    return value


def _index(value: Any, key: str, where: str) -> int:
    """A fact naming one input by its index."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PolicyError(f"{where}: {key!r} must be an input index, got {value!r}")
    return value


def _carrier(value: Any, key: str, where: str) -> Carrier:
    """How integer values go through the op."""
    try:
        return Carrier(value)
    except ValueError:
        known = ", ".join(c.value for c in Carrier)
        raise PolicyError(f"{where}: unknown carrier {value!r} (known: {known})") from None


def _attribute_name(value: Any, key: str, where: str) -> str:
    """The attribute that sets the op's output type."""
    if not isinstance(value, str) or not value:
        raise PolicyError(f"{where}: {key!r} must be an attribute name")
    return value


def _integer_inputs_of(value: Any, key: str, where: str) -> tuple[tuple[int, str], ...]:
    """(input index, role) of the inputs that hold integers."""
    return _integer_inputs(value, where)


def _input_set_of(value: Any, key: str, where: str) -> InputSet:
    """A set of input indices, or every input."""
    return _input_set(value, f"{where}: {key!r}")


# Key -> its parser (value, key, where), in the order the keys are checked.
_PARSERS: dict[str, Callable[[Any, str, str], Any]] = {
    **dict.fromkeys(_FLAGS, _flag),
    **dict.fromkeys(_NAMES, _name),
    **dict.fromkeys(_INDICES, _index),
    "carrier": _carrier,
    "dtype_attribute": _attribute_name,
    "integer_inputs": _integer_inputs_of,
    **dict.fromkeys(_INPUT_SETS, _input_set_of),
}


def _input_set(value: Any, where: str) -> InputSet:
    if value == ALL_INPUTS:
        return ALL_INPUTS
    if (
        not isinstance(value, list) or not value
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value)
    ):
        raise PolicyError(f"{where} must be a list of input indices or {ALL_INPUTS!r}, got {value!r}")
    return tuple(sorted(set(value)))


def _integer_inputs(value: Any, where: str) -> tuple[tuple[int, str], ...]:
    bad = PolicyError(f"{where}: 'integer_inputs' must map input indices to roles, got {value!r}")
    if not isinstance(value, Mapping) or not value:
        raise bad
    roles: list[tuple[int, str]] = []
    for index, role in value.items():
        if not index.isdigit() or not isinstance(role, str) or not role:
            raise bad
        roles.append((int(index), role))
    return tuple(sorted(roles))
