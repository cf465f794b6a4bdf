"""Opset upgrades: bring a model to the opset its 16-bit form needs (bfloat16 Conv: 22).

The ONNX version converter works on the weight-free graph (large initializers become typed
graph inputs for the duration), so models with external data upgrade without their weights
being read; the original, still lazy, tensors are put back afterwards.
"""

from __future__ import annotations

import onnx
import onnx.defs
import onnx.version_converter
import onnx_ir as ir

from mixprec.dtypes import LowPrecision
from mixprec.errors import InputError
from mixprec.graphs import all_nodes
from mixprec.io import weight_free_proto
from mixprec.policy.opfacts import op_facts
from mixprec.policy.runtime import RuntimeProfile
from mixprec.policy.schemas import get_schema
from mixprec.policy.table import OpClass, Policy, normalize_domain


def default_opset(model: ir.Model) -> int | None:
    """The model's default-domain opset."""
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx"))


def _admits(op_type: str, opset: int, type_str: str) -> bool:
    schema = get_schema(op_type, "", opset)
    return schema is not None and any(type_str in c.allowed_type_strs for c in schema.type_constraints)


def first_opset_admitting(op_type: str, after: int, type_str: str) -> int | None:
    """The first default-domain opset above `after` at which `op_type` admits `type_str`."""
    newest = onnx.defs.onnx_opset_version()
    return next((v for v in range(after + 1, newest + 1) if _admits(op_type, v, type_str)), None)


def required_opset(
    model: ir.Model, policy: Policy, target: LowPrecision, runtime: RuntimeProfile | None = None
) -> tuple[int, list[str]] | None:
    """The lowest default-domain opset at which the model's compute-bound ops admit `target`,
    when that is above the model's own; with the ops that need it. None: no upgrade would
    convert more (ops the runtime has no 16-bit kernel for do not count)."""
    current = default_opset(model)
    if current is None:
        return None
    type_str = target.type_str
    needed, ops = current, []
    heavy = {
        node.op_type
        for node in all_nodes(model)
        if normalize_domain(node.domain) == ""
        and (rule := policy.rule_for("", node.op_type)) is not None
        and rule.op_class is OpClass.LOW and rule.compute_bound
        and (runtime is None or runtime.runs_in("", node.op_type, type_str))
    }
    if heavy:
        # A QDQ model's compute ops convert only with their DequantizeLinear/QuantizeLinear
        # (16-bit from opset 19): those count like the compute ops they wrap.
        heavy |= {
            node.op_type
            for node in all_nodes(model)
            if normalize_domain(node.domain) == ""
            and op_facts("", node.op_type).quantization is not None
            and (runtime is None or runtime.runs_in("", node.op_type, type_str))
        }
    for op_type in sorted(heavy):
        if _admits(op_type, current, type_str):
            continue
        first = first_opset_admitting(op_type, current, type_str)
        if first is not None:
            needed = max(needed, first)
            ops.append(op_type)
    return (needed, ops) if needed > current else None


def upgrade_opset(model: ir.Model, opset: int) -> ir.Model:
    """Upgrade the default-domain opset with the ONNX version converter, weights untouched.

    Raises:
        InputError: The converter cannot upgrade the model (naming the versions and its error).
    """
    current = default_opset(model)
    graph = model.graph
    inputs = {v.name for v in graph.inputs}
    proto = weight_free_proto(model)
    kept = {t.name for t in proto.graph.initializer}
    detached = {
        name: value.const_value
        for name, value in graph.initializers.items()
        if name not in kept and value.const_value is not None
    }
    try:
        upgraded = onnx.version_converter.convert_version(proto, opset)
    except Exception as e:  # noqa: BLE001 - the converter raises several exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"cannot upgrade the model from opset {current} to {opset}: {first}") from e
    result = ir.serde.deserialize_model(upgraded)
    new_graph = result.graph
    by_name = {v.name: v for v in new_graph.inputs}
    for name, tensor in detached.items():
        value = by_name.get(name)
        if value is None:
            continue  # the converter dropped an unused weight
        value.const_value = tensor
        new_graph.initializers.add(value)
    if detached:
        remaining = [v for v in new_graph.inputs if v.name not in detached or v.name in inputs]
        new_graph.inputs.clear()
        new_graph.inputs.extend(remaining)
    return result


def upgrade_for_target(
    model: ir.Model,
    opset: int | None,
    policy: Policy,
    target: LowPrecision,
    profile: RuntimeProfile,
    notes: list[str],
) -> ir.Model | None:
    """Upgrade the model's opset when asked (`opset`), or when its compute-bound ops admit the
    target type only at a newer opset; None when the model stays as it is."""
    current = default_opset(model)
    if opset is not None:
        if current is None or current >= opset:
            return None
        notes.append(f"opset upgraded from {current} to {opset} (--opset)")
        return upgrade_opset(model, opset)
    needed = required_opset(model, policy, target, profile)
    if needed is None:
        return None
    version, ops = needed
    try:
        upgraded = upgrade_opset(model, version)
    except InputError as e:
        notes.append(f"{', '.join(ops)} need opset {version} for {target.value} but {e}; they stay FP32")
        return None
    notes.append(
        f"opset upgraded from {current} to {version}: {', '.join(ops)} "
        f"{'admits' if len(ops) == 1 else 'admit'} {target.value} from "
        f"opset {version} (pin a version with --opset)"
    )
    if profile.opset_range is not None and version > profile.opset_range[1]:
        notes.append(
            f"the {profile.name} table covers opsets {profile.opset_range[0]}-{profile.opset_range[1]}; "
            f"check that your {profile.name} version parses opset {version}"
        )
    return upgraded
