"""Op policy tables: which ops run in the 16-bit type, which stay FP32, which follow.

The shipped table is package data (`tables/default.toml`); this module parses it strictly into
frozen rules and applies user overrides. It holds no conversion logic.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mixprec.dtypes import LowPrecision
from mixprec.errors import PolicyError
from mixprec.policy.toml_tables import parse_toml, shipped_table
from mixprec.graphs import DEFAULT_DOMAIN, format_op_name, normalize_domain, parse_op_name
from mixprec.policy.opfacts import op_facts

__all__ = [
    "DEFAULT_DOMAIN", "OpClass", "OpRule", "Policy", "format_op_name", "load_policy",
    "normalize_domain", "parse_op_name", "parse_policy",
]  # fmt: skip


class OpClass(str, enum.Enum):
    """How an op's precision is decided."""

    LOW = "low"
    FP32 = "fp32"
    FOLLOW = "follow"
    CONDITIONAL = "conditional"


@dataclass(frozen=True)
class OpRule:
    """The policy for one op type under one target type."""

    op_type: str
    domain: str
    op_class: OpClass
    reason: str
    fp32_inputs: frozenset[int] = frozenset()
    flexible_inputs: frozenset[int] = frozenset()
    saturate_inputs: frozenset[int] = frozenset()
    mask_inputs: frozenset[int] = frozenset()
    dtype_attribute: str | None = None  # with `retarget_dtype`: the attribute (opfacts.toml)
    condition: str | None = None
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    source: str = "default"
    compute_bound: bool = False
    kernel_accumulation: bool = False


_RULE_KEYS = {
    "class",
    "ops",
    "reason",
    "types",
    "fp32_inputs",
    "flexible_inputs",
    "saturate_inputs",
    "mask_inputs",
    "retarget_dtype",
    "dtype_attribute",  # older spelling of retarget_dtype: the attribute's name
    "condition",
    "params",
    "compute_bound",
    "kernel_accumulation",
}


@dataclass(frozen=True)
class Policy:
    """The resolved op policy for one target type."""

    target: LowPrecision
    rules: Mapping[tuple[str, str], OpRule]

    def rule_for(self, domain: str, op_type: str) -> OpRule | None:
        """The rule for an op, or None for ops the policy does not know."""
        return self.rules.get((normalize_domain(domain), op_type))

    def user_custom_ops(self) -> frozenset[tuple[str, str]]:
        """(domain, op) of the non-ONNX ops the user put in a class."""
        return frozenset(key for key, rule in self.rules.items() if rule.source == "user" and key[0] != "")

    def ops_in(self, op_class: OpClass) -> list[str]:
        """Names of the ops in one class, sorted."""
        return sorted(format_op_name(d, o) for (d, o), r in self.rules.items() if r.op_class is op_class)

    def with_overrides(
        self,
        *,
        low_precision_ops: Iterable[str] = (),
        fp32_ops: Iterable[str] = (),
        follow_ops: Iterable[str] = (),
    ) -> Policy:
        """Return a policy with ops moved into the given classes.

        An op named in a list is put in that class (leaving any other class); its per-input
        settings (pins, flexible inputs) are kept. Names are `Op` or `domain::Op`.
        """
        rules = dict(self.rules)
        seen: dict[str, str] = {}
        for op_class, names in (
            (OpClass.LOW, low_precision_ops),
            (OpClass.FP32, fp32_ops),
            (OpClass.FOLLOW, follow_ops),
        ):
            for name in names:
                if name in seen and seen[name] != op_class.value:
                    raise PolicyError(
                        f"op {name!r} is named in both the {seen[name]} and the "
                        f"{op_class.value} lists"
                    )
                seen[name] = op_class.value
                domain, op_type = parse_op_name(name)
                old = rules.get((domain, op_type))
                if old is None:
                    rules[(domain, op_type)] = OpRule(
                        op_type, domain, op_class, "set by user", source="user"
                    )
                else:
                    rules[(domain, op_type)] = replace(
                        old, op_class=op_class, reason="set by user", condition=None, source="user"
                    )
        return Policy(self.target, MappingProxyType(rules))


def _flag(value: Any, where: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(f"{where}: {key!r} must be true or false, got {value!r}")
    return value


def _int_set(value: Any, where: str, key: str) -> frozenset[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise PolicyError(f"{where}: {key!r} must be a list of input indices, got {value!r}")
    return frozenset(value)


def _dtype_attribute(
    entry: Mapping[str, Any], domain: str, op_type: str, where: str
) -> str | None:
    """The attribute a `retarget_dtype` rule retargets: the op's fact, never the table's."""
    legacy = entry.get("dtype_attribute")
    if not _flag(entry.get("retarget_dtype", legacy is not None), where, "retarget_dtype"):
        return None
    name = op_facts(domain, op_type).dtype_attribute
    if name is None:
        raise PolicyError(
            f"{where}: {format_op_name(domain, op_type)} has no attribute that sets its output "
            "type (opfacts.toml); it cannot be retargeted"
        )
    if legacy is not None and legacy != name:
        raise PolicyError(
            f"{where}: the output type of {format_op_name(domain, op_type)} is set by "
            f"{name!r}, not {legacy!r}"
        )
    return name


def parse_policy(document: Mapping[str, Any], target: LowPrecision, source: str) -> Policy:
    """Build a :class:`Policy` for `target` from a parsed table document."""
    unknown_top = set(document) - {"rule"}
    if unknown_top:
        raise PolicyError(f"{source}: unknown top-level keys {sorted(unknown_top)}")
    rules: dict[tuple[str, str], OpRule] = {}
    for index, entry in enumerate(document.get("rule", [])):
        where = f"{source}: rule {index}"
        op_class = _rule_class(entry, where)
        if not _rule_applies(entry, target, where):
            continue
        condition = _rule_condition(entry, op_class, where)
        ops = entry.get("ops")
        if not isinstance(ops, list) or not ops:
            raise PolicyError(f"{where}: 'ops' must be a non-empty list")
        for name in ops:
            domain, op_type = parse_op_name(name)
            rules[(domain, op_type)] = _op_rule(entry, domain, op_type, op_class, condition, where, source)
    return Policy(target, MappingProxyType(rules))


def _rule_class(entry: Mapping[str, Any], where: str) -> OpClass:
    """The class of a rule entry, whose keys must all be known."""
    unknown = set(entry) - _RULE_KEYS
    if unknown:
        raise PolicyError(f"{where}: unknown keys {sorted(unknown)}")
    try:
        return OpClass(entry["class"])
    except (KeyError, ValueError) as e:
        raise PolicyError(
            f"{where}: 'class' must be one of {[c.value for c in OpClass]}"
        ) from e


def _rule_applies(entry: Mapping[str, Any], target: LowPrecision, where: str) -> bool:
    """Whether a rule entry's `types` (all of them by default) include `target`."""
    types = entry.get("types", [t.value for t in LowPrecision])
    if any(t not in {x.value for x in LowPrecision} for t in types):
        raise PolicyError(f"{where}: unknown entry in 'types': {types}")
    return target.value in types


def _rule_condition(entry: Mapping[str, Any], op_class: OpClass, where: str) -> str | None:
    """The named condition of a rule entry: required for class conditional, optional for classes
    fp32 and follow (where it holds the op follows its inputs, else it stays FP32 for the rule's
    reason), known, and allowed for no other class."""
    condition = entry.get("condition")
    if op_class is OpClass.CONDITIONAL and condition is None:
        raise PolicyError(f"{where}: 'condition' is required for class conditional")
    if condition is not None and op_class not in (OpClass.CONDITIONAL, OpClass.FP32, OpClass.FOLLOW):
        raise PolicyError(f"{where}: 'condition' is allowed for classes conditional, fp32 and follow only")
    if condition is not None:
        from mixprec.policy.conditions import CONDITIONS  # noqa: PLC0415 - conditions read IR

        if condition not in CONDITIONS:
            raise PolicyError(
                f"{where}: unknown condition {condition!r} (known: {', '.join(sorted(CONDITIONS))})"
            )
    return condition


def _op_rule(
    entry: Mapping[str, Any], domain: str, op_type: str, op_class: OpClass, condition: str | None, where: str,
    source: str,
) -> OpRule:
    """The rule a rule entry makes for one of its ops."""
    return OpRule(
        op_type=op_type,
        domain=domain,
        op_class=op_class,
        reason=str(entry.get("reason", op_class.value)),
        fp32_inputs=_int_set(entry.get("fp32_inputs", []), where, "fp32_inputs"),
        flexible_inputs=_int_set(entry.get("flexible_inputs", []), where, "flexible_inputs"),
        saturate_inputs=_int_set(entry.get("saturate_inputs", []), where, "saturate_inputs"),
        mask_inputs=_int_set(entry.get("mask_inputs", []), where, "mask_inputs"),
        dtype_attribute=_dtype_attribute(entry, domain, op_type, where),
        condition=condition,
        params=MappingProxyType(dict(entry.get("params", {}))),
        source=source,
        compute_bound=_flag(entry.get("compute_bound", False), where, "compute_bound"),
        kernel_accumulation=_flag(entry.get("kernel_accumulation", False), where, "kernel_accumulation"),
    )


def load_policy(target: LowPrecision, path: str | Path | None = None) -> Policy:
    """Load the shipped policy table (or the TOML file at `path`) for `target`."""
    if path is None:
        return _default_policy(target)
    return _read_policy(target, path)


@functools.lru_cache(maxsize=None)
def _default_policy(target: LowPrecision) -> Policy:
    """The shipped table, parsed once per target (a Policy is immutable)."""
    return _read_policy(target, None)


def _read_policy(target: LowPrecision, path: str | Path | None) -> Policy:
    if path is None:
        return parse_policy(shipped_table("default.toml"), target, "default.toml")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise PolicyError(f"cannot read policy file {path}: {e.strerror}") from e
    return parse_policy(parse_toml(text, str(path)), target, str(path))
