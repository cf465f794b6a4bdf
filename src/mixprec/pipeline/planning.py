"""The `plan` step: the planner on the typed model with the analyses' findings, the plan file,
the node choices and the Q/DQ pair rule (also run on copies, by the search and the repair)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx_ir as ir

from mixprec.config import Config
from mixprec.errors import InputError
from mixprec.graphs import format_op_name, main_values, walk_nodes
from mixprec.passes.functions import inlining_obstacle
from mixprec.plan.model import Category, NodeMatcher, Precision, PrecisionPlan
from mixprec.plan.planner import plan_precision
from mixprec.plan.weights_only import weights_only as weights_only_plan
from mixprec.plan.qdq_pairs import keep_pairs as keep_qdq_pairs
from mixprec.policy.profiles import RuntimeProfile
from mixprec.policy.table import Policy

if TYPE_CHECKING:
    from mixprec.plan.file import RequestedPlan

logger = logging.getLogger(__name__)

Forced = Mapping[ir.Node, tuple[Category, str]]


@dataclass(frozen=True)
class Planned:
    """The plan and what planning says of it."""

    plan: PrecisionPlan
    notes: tuple[str, ...]


@dataclass(frozen=True)
class PlanInputs:
    """What the planner reads besides the model: the analyses' findings by node key and value
    name, the policy and the runtime."""

    policy: Policy
    profile: RuntimeProfile
    forced: Mapping[str, tuple[Category, str]]
    wide: Mapping[str, str]
    safe: Mapping[str, str]


def make_plan(model: ir.Model, keys: Mapping[ir.Node, str], config: Config, inputs: PlanInputs) -> Planned:
    """Plan `model` (typed) with the analyses' findings, the plan file and the node choices."""
    by_key = {key: node for node, key in keys.items()}
    forced_nodes = {by_key[k]: finding for k, finding in inputs.forced.items() if k in by_key}
    values = {v.name: v for v in main_values(model)} if inputs.wide or inputs.safe else {}
    wide_values = {values[name]: evidence for name, evidence in inputs.wide.items() if name in values} or None
    safe_values = {values[name]: evidence for name, evidence in inputs.safe.items() if name in values} or None
    matcher = NodeMatcher(config.nodes.exclude)
    policy, profile = inputs.policy, inputs.profile

    def plan_once(extra: Forced) -> PrecisionPlan:
        return plan_precision(
            model, policy, exclude_nodes=matcher, keep_io_types=config.io.keep_io_types,
            forced_fp32=extra, wide_values=wide_values, runtime=profile, keys=keys, safe_values=safe_values,
        )

    def planned(extra: Forced | None = None) -> PrecisionPlan:
        # Analyses' reasons (integer semantics) win over a plan file's; QDQ pairs stay cast-free.
        return keep_qdq_pairs(plan_once, list(keys), policy.target, {**(extra or {}), **forced_nodes}, profile.name)

    result, requested = _plan_by_file(model, config, planned)
    notes: list[str] = []
    if config.ops.weights_only:
        result = weights_only_plan(result)
    else:
        notes.extend(_nothing_worth_converting(result, policy, profile))
    notes.extend(_already_16_bit(model, result))
    notes.extend(_kept_functions(model, result))
    notes.extend(_ops_the_runtime_refuses(model, keys, profile))
    unused = matcher.unused()
    if unused:
        raise InputError(f"--exclude-node pattern {unused[0]!r} matches no node in the model")
    if requested is not None:
        for note in requested.notes(model, result):
            logger.warning("%s", note)
            notes.append(note)
    return Planned(result, tuple(notes))


def _plan_by_file(
    model: ir.Model, config: Config, planned: Callable[[], PrecisionPlan]
) -> tuple[PrecisionPlan, RequestedPlan | None]:
    """The plan, through the plan file when one is given (and that file, for its notes)."""
    if config.nodes.plan is None:
        return planned(), None
    from mixprec.plan.file import load_plan  # noqa: PLC0415

    requested = load_plan(config.nodes.plan)
    return requested.apply(model, planned), requested


def _nothing_worth_converting(plan: PrecisionPlan, policy: Policy, profile: RuntimeProfile) -> list[str]:
    """A note when the runtime left every compute-bound op FP32: suggest weights-only."""
    bound: dict[tuple[str, str], bool] = {}  # op -> its policy rule is compute-bound
    heavy = []
    for node, decision in plan.decisions.items():
        op = (node.domain, node.op_type)
        compute_bound = bound.get(op)
        if compute_bound is None:
            rule = policy.rule_for(*op)
            compute_bound = bound[op] = rule is not None and rule.compute_bound
        if not compute_bound or decision.precision is Precision.NONE:
            continue
        if decision.precision is Precision.LOW:
            return []
        heavy.append(node)
    if not heavy:
        return []
    blocked = sorted({
        n.op_type for n in heavy
        if plan.decisions[n].category is Category.RUNTIME or not profile.runs_in(n.domain, n.op_type, plan.target.type_str)
    })
    if not blocked:
        return []
    return [
        f"nothing worth converting on {profile.name}: it has no {plan.target.value} kernel for "
        f"{', '.join(blocked)}; --weights-only stores the weights in {plan.target.value} (half the "
        "file) and computes in FP32"
    ]


def _already_16_bit(model: ir.Model, plan: PrecisionPlan) -> list[str]:
    """A note when no node computes in FP32 and nodes compute 16-bit float values: the model is
    a 16-bit one already, and nothing is converted."""
    if any(d.precision is not Precision.NONE for d in plan.decisions.values()):
        return []
    kinds = sorted({
        v.dtype.name.lower() for node in model.graph for v in node.outputs
        if v.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    })
    if not kinds:
        return []
    return [f"the model computes in {' and '.join(kinds)} already (no node computes in FP32): nothing to convert"]


def _kept_functions(model: ir.Model, plan: PrecisionPlan) -> list[str]:
    """A note when calls of model-local functions keep their FP32 signatures while their
    bodies compute in 16 bits: Casts at their inputs and outputs, and bodies the analyses see
    without their callers' shapes. Runtimes inline the functions when they load the model."""
    if not model.functions:
        return []
    calls = [n for n, d in plan.decisions.items() if d.category is Category.FUNCTION]
    called = {(n.domain, n.op_type, n.overload) for n in calls}
    decisions = plan.decisions
    low = sum(
        1 for key in called for node in walk_nodes(model.functions[key])
        if (decision := decisions.get(node)) is not None and decision.precision is Precision.LOW
    )
    if not low:
        return []
    obstacle = inlining_obstacle(model)
    remedy = (
        f"they cannot be inlined here ({obstacle})" if obstacle is not None
        else "--inline-functions converts them with the rest of the graph"
    )
    return [
        f"{len(calls)} call(s) of {len(called)} local function(s) keep FP32 signatures: their bodies "
        f"({low} nodes in {plan.target.value}) convert inside, behind Casts at their inputs and outputs; "
        f"runtimes inline the functions when they load the model, and {remedy}"
    ]


def _ops_the_runtime_refuses(model: ir.Model, nodes: Iterable[ir.Node], profile: RuntimeProfile) -> list[str]:
    """A note naming the ops of the model that the runtime cannot run at all (see
    `RuntimeProfile.refuses`): the model does not run there as it is, FP32 or converted."""
    if not profile.refuses_any:
        return []
    functions = model.functions
    kinds = {(node.domain, node.op_type, node.overload) for node in nodes}
    refused = sorted({
        format_op_name(domain, op_type) for domain, op_type, overload in kinds
        if (domain, op_type, overload) not in functions and profile.refuses(domain, op_type)
    })
    if not refused:
        return []
    custom = any("::" in op for op in refused)
    return [
        f"{profile.name} cannot run {', '.join(refused)} (its table, {profile.source}, has no such op"
        + ("; an op of another domain needs a plugin registered under its name" if custom else "")
        + "): the model does not run there as it is, FP32 or converted"
    ]
