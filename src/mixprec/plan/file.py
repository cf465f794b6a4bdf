"""The precision plan as an artifact: save it as JSON, edit it, apply it again.

A plan file lists every node of the model with the precision mixprec chose for it and why::

    {
      "format": "mixprec.plan/1",
      "keep_io_types": true,
      "mixprec_version": "0.1.0",
      "nodes": {
        "/layer.0/attn/MatMul": {"category": "policy", "op_type": "MatMul", "precision": "low", "reason": "..."},
        ...
      },
      "target": "float16"
    }

Keys are sorted and each node takes one line, so two plans diff line by line. Nodes are keyed by
name; a node without a name, or whose name an earlier node already took, gets a generated key
``<op_type>#<index>`` (index: position among all nodes, function bodies first, then the main graph
with subgraph nodes before their owner; see :func:`mixprec.graphs.all_nodes`). The order is that of
the model file, so generated keys are the same on every run over the same model.

Applying a plan (``convert(..., plan=...)``): nodes marked ``fp32`` are kept FP32 (category
"set by plan", unless the planner keeps them FP32 anyway: they keep their own reason, so a saved
plan applies to itself); nodes marked ``low`` are left to the planner, which converts them when the op
policy, the schema and value ranges allow (any it keeps FP32 is reported in a note); ``none``
entries and model nodes missing from the plan are left to the planner. An entry naming no node
of the model is an error. A plan made with the model's local functions kept (its entries decide
their calls) keeps them when applied; conversion inlines them otherwise.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir

from mixprec.dtypes import LowPrecision, parse_low_precision
from mixprec.errors import InputError
from mixprec.graphs import node_keys
from mixprec.io import write_text_atomic
from mixprec.plan.model import Category, Precision, PrecisionPlan
from mixprec.version import __version__

logger = logging.getLogger(__name__)

PLAN_FORMAT = "mixprec.plan/1"
PLAN_REASON = "set by plan"
# Categories of nodes whose precision follows their neighbours' (not asked for on their own).
FOLLOWING = frozenset({Category.FOLLOW, Category.CONSUMERS, Category.CAST_COST, Category.QDQ})
_PRECISIONS = {p.value: p for p in Precision}
# Notes list at most this many nodes by name.
_NOTE_NODES = 5

PlanLike = str | os.PathLike | Mapping[str, Any]


def model_node_names(model: ir.Model) -> dict[str, ir.Node]:
    """Plan-file key -> node for every node of `model` (see :func:`mixprec.graphs.node_keys`)."""
    return {name: node for node, name in node_keys(model).items()}


def plan_to_dict(plan: PrecisionPlan) -> dict[str, Any]:
    """The JSON-ready form of a plan: per node precision, category, reason and op type."""
    names = plan.keys
    nodes: dict[str, dict[str, str]] = {}
    for node in plan.order:
        decision = plan.decisions.get(node)
        if decision is None:
            continue
        nodes[names[node]] = {"op_type": node.op_type, **decision.to_dict()}
    return {
        "format": PLAN_FORMAT,
        "mixprec_version": __version__,
        "target": plan.target.value,
        "keep_io_types": plan.keep_io_types,
        "nodes": dict(sorted(nodes.items())),
    }


def dumps_plan(plan: PrecisionPlan | Mapping[str, Any]) -> str:
    """JSON text of a plan (or of its dict form): sorted keys, one line per node."""
    data = plan_to_dict(plan) if isinstance(plan, PrecisionPlan) else dict(plan)
    lines = ["{"]
    keys = sorted(data)
    for i, key in enumerate(keys):
        comma = "," if i < len(keys) - 1 else ""
        value = data[key]
        if key == "nodes" and isinstance(value, Mapping):
            if not value:
                lines.append(f'  "nodes": {{}}{comma}')
                continue
            lines.append('  "nodes": {')
            entries = sorted(value.items())
            for j, (name, entry) in enumerate(entries):
                end = "," if j < len(entries) - 1 else ""
                lines.append(f"    {json.dumps(name)}: {json.dumps(entry, sort_keys=True)}{end}")
            lines.append(f"  }}{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, sort_keys=True)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def save_plan(plan: PrecisionPlan | Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write a plan as JSON (atomically: a temporary file renamed into place).

    Args:
        plan: A `PrecisionPlan` (e.g. `ConversionResult.plan`) or its dict form.
        path: Destination file.

    Returns:
        The path written.

    Raises:
        InputError: The destination folder does not exist.
    """
    target = write_text_atomic(path, dumps_plan(plan))
    logger.info("wrote plan %s", target)
    return target


@dataclass(frozen=True)
class PlanEntry:
    """One node of a plan file."""

    precision: Precision
    op_type: str | None = None
    category: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class PlanFile:
    """A loaded plan: node key -> entry, and the settings it was made with."""

    source: str
    nodes: Mapping[str, PlanEntry]
    target: LowPrecision | None = None
    keep_io_types: bool | None = None

    def names(self, precision: Precision) -> list[str]:
        """Keys of the entries with this precision, sorted."""
        return sorted(name for name, entry in self.nodes.items() if entry.precision is precision)

    def resolve(self, model: ir.Model) -> dict[str, ir.Node]:
        """Map every entry to its node in `model`.

        Raises:
            InputError: An entry names no node of the model, or a node of another op type.
        """
        by_name = model_node_names(model)
        resolved: dict[str, ir.Node] = {}
        for name in sorted(self.nodes):
            entry = self.nodes[name]
            node = by_name.get(name)
            if node is None:
                hint = ""
                if model.functions and not plan_keeps_functions(self):
                    hint = " (the plan was made with the model's local functions inlined: apply it without --keep-functions)"
                raise InputError(f"plan {self.source}: node {name!r} is not in the model{hint}")
            if entry.op_type is not None and entry.op_type != node.op_type:
                raise InputError(
                    f"plan {self.source}: node {name!r} is a {entry.op_type} in the plan but a "
                    f"{node.op_type} in the model"
                )
            resolved[name] = node
        return resolved

    def forced_fp32(self, model: ir.Model) -> dict[ir.Node, tuple[Category, str]]:
        """Every node the plan marks `fp32`, as the planner's `forced_fp32` argument."""
        resolved = self.resolve(model)
        return {resolved[name]: (Category.PLAN, PLAN_REASON) for name in self.names(Precision.FP32)}

    def apply(
        self,
        model: ir.Model,
        make_plan: Callable[[Mapping[ir.Node, tuple[Category, str]]], PrecisionPlan],
    ) -> PrecisionPlan:
        """Plan `model` with the plan's `fp32` nodes kept FP32.

        Only nodes the planner would not keep FP32 by itself are forced, so a node FP32 by
        policy keeps its own reason and a saved plan applies to the same plan (the round trip is
        stable). Entries recorded as following their neighbours ("follows inputs", "decided by
        consumers") are forced only if they still compute in 16 bits once the others are.

        Args:
            model: The model (typed, as the planner needs it).
            make_plan: Runs the planner with extra forced nodes.

        Returns:
            The plan.

        Raises:
            InputError: An entry names no node of the model.
        """
        resolved = self.resolve(model)
        wanted = [resolved[name] for name in self.names(Precision.FP32)]
        plan = make_plan({})
        if not wanted:
            return plan
        following = {c.value for c in FOLLOWING}
        forced: dict[ir.Node, tuple[Category, str]] = {}
        for name, node in zip(self.names(Precision.FP32), wanted):
            if plan.decisions[node].precision is Precision.LOW and self.nodes[name].category not in following:
                forced[node] = (Category.PLAN, PLAN_REASON)
        if forced:
            plan = make_plan(forced)
        more = [node for node in wanted if plan.decisions[node].precision is Precision.LOW]
        if more:
            forced.update((node, (Category.PLAN, PLAN_REASON)) for node in more)
            plan = make_plan(forced)
        return plan

    def notes(self, model: ir.Model, plan: PrecisionPlan) -> list[str]:
        """Warnings about a plan made from this file: settings that differ, `low` nodes kept FP32."""
        notes: list[str] = []
        if self.target is not None and self.target is not plan.target:
            notes.append(
                f"plan {self.source} was made for {self.target.value}, applied for {plan.target.value}"
            )
        if self.keep_io_types is not None and self.keep_io_types != plan.keep_io_types:
            notes.append(
                f"plan {self.source} was made with keep_io_types={self.keep_io_types}, applied with "
                f"keep_io_types={plan.keep_io_types}"
            )
        resolved = self.resolve(model)
        unmet: list[str] = []
        following: list[str] = []
        for name in self.names(Precision.LOW):
            decision = plan.decisions.get(resolved[name])
            if decision is None or decision.precision is not Precision.FP32:
                continue
            if decision.category in FOLLOWING:
                following.append(name)
            else:
                unmet.append(f"{name} ({decision.category.value}: {decision.reason})")
        target = plan.target.short_name
        if unmet:
            notes.append(
                f"plan {self.source} asks for {target} in {len(unmet)} node(s) that stay FP32: "
                f"{_shorten(unmet, '; ')}"
            )
        if following:
            notes.append(
                f"plan {self.source} asks for {target} in {len(following)} node(s) that follow FP32 "
                f"neighbours and stay FP32: {_shorten(following, ', ')}"
            )
        return notes


def _shorten(items: Sequence[str], sep: str) -> str:
    more = f"{sep}and {len(items) - _NOTE_NODES} more" if len(items) > _NOTE_NODES else ""
    return sep.join(items[:_NOTE_NODES]) + more


def plan_keeps_functions(source: PlanLike | PlanFile) -> bool:
    """Whether the plan was made with the model's local functions kept: it decides their calls."""
    return any(entry.category == Category.FUNCTION.value for entry in load_plan(source).nodes.values())


def load_plan(source: PlanLike | PlanFile) -> PlanFile:
    """Read and check a plan file (or a plan dict, e.g. from `plan_to_dict`).

    Only ``nodes`` is required; an entry is a dict with ``precision`` (``low``, ``fp32`` or
    ``none``) and optionally ``op_type``, ``category``, ``reason``, or just the precision string.

    Raises:
        InputError: The file is missing or not JSON, or an entry is malformed (naming the file
            and the node).
    """
    if isinstance(source, PlanFile):
        return source
    if isinstance(source, Mapping):
        return _parse(source, "(dict)")
    path = Path(source)
    if not path.is_file():
        raise InputError(f"plan file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"plan file {path} is not readable JSON: {e}") from e
    return _parse(data, str(path))


def _parse(data: Any, source: str) -> PlanFile:
    if not isinstance(data, Mapping):
        raise InputError(f"plan {source}: expected a JSON object at the top level")
    fmt = data.get("format", PLAN_FORMAT)
    if fmt != PLAN_FORMAT:
        raise InputError(f"plan {source}: unsupported format {fmt!r} (expected {PLAN_FORMAT!r})")
    nodes = data.get("nodes")
    if not isinstance(nodes, Mapping):
        raise InputError(f"plan {source}: 'nodes' must be an object mapping node names to entries")
    entries: dict[str, PlanEntry] = {}
    for name, raw in nodes.items():
        entries[str(name)] = _parse_entry(raw, str(name), source)
    target = data.get("target")
    keep_io = data.get("keep_io_types")
    if keep_io is not None and not isinstance(keep_io, bool):
        raise InputError(f"plan {source}: 'keep_io_types' must be true or false")
    try:
        parsed_target = parse_low_precision(target) if target is not None else None
    except InputError as e:
        raise InputError(f"plan {source}: {e}") from e
    return PlanFile(source=source, nodes=entries, target=parsed_target, keep_io_types=keep_io)


def _parse_entry(raw: Any, name: str, source: str) -> PlanEntry:
    if isinstance(raw, str):
        raw = {"precision": raw}
    if not isinstance(raw, Mapping):
        raise InputError(f"plan {source}: node {name!r}: expected an object or a precision string")
    precision = _PRECISIONS.get(str(raw.get("precision", "")).lower())
    if precision is None:
        raise InputError(
            f"plan {source}: node {name!r}: precision must be one of low, fp32, none; "
            f"got {raw.get('precision')!r}"
        )
    fields = {}
    for key in ("op_type", "category", "reason"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise InputError(f"plan {source}: node {name!r}: {key!r} must be a string")
        fields[key] = value
    return PlanEntry(precision=precision, **fields)


def fp32_plan(names: Sequence[str], base: PlanFile | None = None) -> dict[str, Any]:
    """A plan dict keeping `names` FP32, on top of the entries of `base` (if any)."""
    nodes: dict[str, Any] = {}
    if base is not None:
        for name, entry in base.nodes.items():
            nodes[name] = {"precision": entry.precision.value}
            if entry.op_type is not None:
                nodes[name]["op_type"] = entry.op_type
    for name in names:
        nodes[name] = {"precision": Precision.FP32.value}
    return {"format": PLAN_FORMAT, "nodes": nodes}
