"""What the planner knows of an op before looking at a node's values, and of a node before
deciding it.

An op's template (shared by all its nodes with the same opset and arity) binds the node's inputs
and outputs to the type variables of its schema, or of the runtime's kernel binding for contrib
ops, or of a user-classified custom op, and lists the type variables the node never lowers: those
the schema does not allow in the 16-bit type, those the policy pins to FP32 and those the runtime
has no 16-bit kernel for. A node's facts then say which of its type variables hold FP32 values
and which it would lower.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, replace

import onnx_ir as ir

from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.graphs import is_default_domain
from mixprec.plan.model import NodeFacts
from mixprec.policy.opfacts import op_facts
from mixprec.policy.profiles import RuntimeProfile, rule_on_runtime
from mixprec.policy.schemas import Signature, signature
from mixprec.policy.table import OpRule, Policy, format_op_name

__all__ = ["OpTemplate", "node_facts", "op_template"]

_ANY_FLOAT = frozenset({"tensor(float)", "tensor(float16)", "tensor(bfloat16)"})
# ONNX's other domains, whose schemas onnx has as it has the default domain's (classical ML ops).
_ONNX_DOMAINS = frozenset({"ai.onnx.ml", "ai.onnx.preview.training"})


@dataclass(frozen=True)
class OpTemplate:
    """What the planner knows of an op before looking at a node's values (shared by its nodes).

    Attributes:
        rule: The policy rule (None for ops the policy does not know).
        sig: The schema binding of the node's inputs and outputs (None without a schema).
        excluded: Type variables the node never lowers (schema, policy pins or runtime).
        runtime_blocked: Type variables the schema would lower but the runtime has no 16-bit
            kernel for.
        runtime_reason: Why, naming the kernel and provider.
    """

    rule: OpRule | None
    sig: Signature | None
    excluded: frozenset[str]
    runtime_blocked: frozenset[str] = frozenset()
    runtime_reason: str | None = None


def _user_op_signature(n_inputs: int, n_outputs: int) -> Signature:
    """A binding for a custom op the user classified: every FP32 input and output share one
    type variable (its non-FP32 tensors are never touched)."""
    return Signature(
        since_version=1,
        input_vars=("T",) * n_inputs,
        output_vars=("T",) * n_outputs,
        allowed={"T": _ANY_FLOAT},
    )


def _binding(
    node: ir.Node, opset: int | None, rule: OpRule | None, runtime: RuntimeProfile, target: LowPrecision
) -> tuple[Signature | None, frozenset[str], str | None]:
    """The node's signature, and the type variables a runtime kernel binding blocks, with why."""
    n_in, n_out = len(node.inputs), len(node.outputs)
    sig = None
    if (is_default_domain(node.domain) or node.domain in _ONNX_DOMAINS) and opset is not None:
        sig = signature(node.op_type, node.domain, opset, n_in, n_out)
    blocked: frozenset[str] = frozenset()
    reason = None
    if sig is None and runtime.has_table and opset is not None:
        sig, blocked, reason = _kernel_binding(node, opset, runtime, target)
    if sig is None and rule is not None and rule.source == "user" and not is_default_domain(node.domain):
        sig = _user_op_signature(n_in, n_out)
    tied = op_facts(node.domain, node.op_type).output_type_from
    if sig is not None and tied is not None and tied < len(sig.input_vars) and sig.output_vars:
        # The output takes that input's type (DequantizeLinear-23: the scale's) unless an
        # attribute says otherwise (such nodes keep their types, see `rules.fixed_type`).
        sig = replace(sig, output_vars=(sig.input_vars[tied], *sig.output_vars[1:]))
    return sig, blocked, reason


def _kernel_binding(
    node: ir.Node, opset: int, runtime: RuntimeProfile, target: LowPrecision
) -> tuple[Signature | None, frozenset[str], str | None]:
    """Contrib ops (and runtime-internal ones such as SimplifiedLayerNormalization) have no ONNX
    schema: the runtime's kernel binding is their signature."""
    sig = runtime.signature(node.domain, node.op_type, opset, len(node.inputs), len(node.outputs))
    if sig is None:
        return None, frozenset(), None
    blocked = frozenset(v for v, allowed in sig.allowed.items() if target.type_str not in allowed)
    reason = (
        f"no {target.value} kernel for {format_op_name(node.domain, node.op_type)}"
        f"({sig.since_version}) on {runtime.provider}"
    )
    return sig, blocked, reason


def _pinned_vars(sig: Signature, rule: OpRule | None, target_type: str) -> set[str]:
    """Type variables the schema does not allow in the 16-bit type or the policy pins."""
    excluded = {v for v, allowed in sig.allowed.items() if target_type not in allowed}
    if rule is None:
        return excluded
    for index in rule.fp32_inputs:
        if index < len(sig.input_vars) and sig.input_vars[index] is not None:
            excluded.add(sig.input_vars[index])  # type: ignore[arg-type]
    for index in rule.flexible_inputs:
        # A flexible input's own type variable is never lowered by the node.
        if index < len(sig.input_vars):
            var = sig.input_vars[index]
            others = {sig.input_vars[i] for i in range(len(sig.input_vars)) if i != index}
            if var is not None and var not in others | set(sig.output_vars):
                excluded.add(var)
    return excluded


def op_template(
    node: ir.Node, opset: int | None, policy: Policy, runtime: RuntimeProfile
) -> OpTemplate:
    """Rule, schema binding and never-lowered type variables of the op of `node`."""
    target = policy.target
    rule = rule_on_runtime(policy.rule_for(node.domain, node.op_type), node.domain, node.op_type, runtime)
    sig, blocked, runtime_reason = _binding(node, opset, rule, runtime, target)
    excluded: set[str] = set()
    if sig is not None:
        excluded = _pinned_vars(sig, rule, target.type_str)
    if sig is not None and runtime.has_table and not blocked:
        candidates = frozenset(v for v, allowed in sig.allowed.items() if target.type_str in allowed)
        version = sig.since_version if is_default_domain(node.domain) else (opset or 1)
        blocked, runtime_reason = runtime.blocked_vars(
            node.domain, node.op_type, version, sig, target.type_str, candidates - excluded
        )
        excluded |= blocked
    return OpTemplate(rule, sig, frozenset(excluded), blocked, runtime_reason)


def node_facts(
    node: ir.Node,
    template: OpTemplate,
    fp32: Container[ir.Value] | None = None,
    known: dict[tuple, NodeFacts] | None = None,
) -> NodeFacts:
    """The facts of `node`: its template, and which of its type variables hold FP32 values and
    which it would lower. `fp32`: the model's FP32 tensor values, when known (else each value's
    type is read); `known`: facts already made from templates alive as long as it is, reused
    for nodes whose type variables bind the same way (facts are immutable)."""
    is_fp32 = fp32.__contains__ if fp32 is not None else is_fp32_tensor
    rule, sig = template.rule, template.sig
    flexible = rule.flexible_inputs if rule is not None else frozenset()
    if sig is None:
        return NodeFacts(
            rule=rule, sig=sig, flexible=flexible,
            runtime_blocked=template.runtime_blocked, runtime_reason=template.runtime_reason,
        )
    float_vars: set[str] = set()
    # Type variables bound only to outputs (e.g. LayerNormalization's U, set by stash_type)
    # are the op's own choice: they keep their types.
    input_vars: set[str] = set()
    for value, var in zip(node.inputs, sig.input_vars):
        if value is not None and var is not None:
            input_vars.add(var)
            if is_fp32(value):
                float_vars.add(var)
    for value, var in zip(node.outputs, sig.output_vars):
        if var is not None and is_fp32(value):
            float_vars.add(var)
    key = (id(template), frozenset(float_vars), frozenset(input_vars))
    facts = known.get(key) if known is not None else None
    if facts is None:
        facts = NodeFacts(
            rule=rule,
            sig=sig,
            float_vars=key[1],
            lowerable=frozenset((float_vars & input_vars) - template.excluded),
            flexible=flexible,
            runtime_blocked=template.runtime_blocked,
            runtime_reason=template.runtime_reason,
        )
        if known is not None:
            known[key] = facts
    return facts
