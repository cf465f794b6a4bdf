"""Opset upgrades: bring a model to the opset its 16-bit form needs (bfloat16 Conv: 22).

The ONNX version converter works on the weight-free graph (large initializers become typed
graph inputs for the duration), so models with external data upgrade without their weights
being read; the original, still lazy, tensors are put back afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import onnx
import onnx.defs
import onnx.numpy_helper
import onnx.version_converter
import onnx_ir as ir

from mixprec.dtypes import LowPrecision
from mixprec.errors import InputError
from mixprec.graphs import all_nodes, has_subgraphs
from mixprec.io import value_types
from mixprec.io import weight_free_proto
from mixprec.policy.opfacts import op_facts
from mixprec.policy.profiles import RuntimeProfile, load_runtime
from mixprec.policy.schemas import get_schema
from mixprec.policy.table import OpClass, Policy, normalize_domain


def default_opset(model: ir.Model) -> int | None:
    """The model's default-domain opset."""
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx"))


def admits(op_type: str, opset: int, type_str: str) -> bool:
    """Whether the default-domain `op_type` at `opset` admits `type_str` anywhere."""
    schema = get_schema(op_type, "", opset)
    return schema is not None and any(type_str in c.allowed_type_strs for c in schema.type_constraints)


def first_opset_admitting(op_type: str, after: int, type_str: str) -> int | None:
    """The first default-domain opset above `after` at which `op_type` admits `type_str`."""
    newest = onnx.defs.onnx_opset_version()
    return next((v for v in range(after + 1, newest + 1) if admits(op_type, v, type_str)), None)


def required_opset(
    model: ir.Model, policy: Policy, target: LowPrecision, runtime: RuntimeProfile | None = None,
    *, kernel_gaps: bool = True,
) -> tuple[int, list[str]] | None:
    """The lowest default-domain opset at which the model's compute-bound ops admit `target`
    (in their schema and the runtime's kernel) and, with `kernel_gaps`, at which the runtime has
    a 16-bit kernel of the ops around them whose schema already admits it; when that is above
    the model's own, with the ops that need it. None: no upgrade would convert more (ops the
    runtime has no 16-bit kernel for at any opset do not count)."""
    current = default_opset(model)
    if current is None:
        return None
    kinds = list({(node.domain, node.op_type): node for node in all_nodes(model)}.values())  # one node per kind
    ops = _heavy_ops(kinds, policy, target.type_str, runtime)
    if ops and kernel_gaps:  # something worth converting: the ops around it count too
        ops |= _kernel_gap_ops(kinds, policy, target.type_str, runtime, current)
    needed, ops_needing = _first_opsets(ops, current, target.type_str, runtime)
    return (needed, ops_needing) if needed > current else None


def _runs(runtime: RuntimeProfile | None, op_type: str, type_str: str) -> bool:
    """Whether the runtime (any, when None) has a `type_str` kernel for the default-domain op."""
    return runtime is None or runtime.runs_in("", op_type, type_str)


def _is_heavy(node: ir.Node, policy: Policy, type_str: str, runtime: RuntimeProfile | None) -> bool:
    """Whether `node` is a default-domain compute-bound op of class LOW the runtime runs in
    `type_str`."""
    if normalize_domain(node.domain) != "":
        return False
    rule = policy.rule_for("", node.op_type)
    return bool(
        rule is not None and rule.op_class is OpClass.LOW and rule.compute_bound
        and _runs(runtime, node.op_type, type_str)
    )


def _is_quantization_end(node: ir.Node, type_str: str, runtime: RuntimeProfile | None) -> bool:
    """Whether `node` is a default-domain quantization end the runtime runs in `type_str`."""
    return (
        normalize_domain(node.domain) == ""
        and op_facts("", node.op_type).quantization is not None
        and _runs(runtime, node.op_type, type_str)
    )


def _heavy_ops(kinds: list[ir.Node], policy: Policy, type_str: str, runtime: RuntimeProfile | None) -> set[str]:
    """The compute-bound op types whose opset decides the upgrade and, where there are any, the
    quantization ends (`kinds`: one node of each kind of the model)."""
    heavy = {node.op_type for node in kinds if _is_heavy(node, policy, type_str, runtime)}
    if heavy:
        # A QDQ model's compute ops convert only with their DequantizeLinear/QuantizeLinear
        # (16-bit from opset 19): those count like the compute ops they wrap.
        heavy |= {node.op_type for node in kinds if _is_quantization_end(node, type_str, runtime)}
    return heavy


def _kernel_gap_ops(
    kinds: list[ir.Node], policy: Policy, type_str: str, runtime: RuntimeProfile | None, current: int
) -> set[str]:
    """Default-domain ops the policy would run in `type_str` (low or follow; quantization ends
    aside) whose schema admits it at the model's opset but whose runtime kernel there does not,
    while a newer kernel does (ONNX Runtime CUDA's float16 Clip from opset 12: Clip-11 is float
    only there, so ReLU6 and hard-swish of opset-11 exports would stay FP32). An op whose
    schema itself admits the type only later (IsInf: 20) does not raise the opset."""
    if runtime is None or not runtime.has_table:
        return set()
    gaps = set()
    for op_type in {node.op_type for node in kinds if normalize_domain(node.domain) == ""}:
        rule = policy.rule_for("", op_type)
        if rule is None or rule.op_class not in (OpClass.LOW, OpClass.FOLLOW):
            continue
        if op_facts("", op_type).quantization is not None:
            continue  # quantization ends count with the compute ops they wrap (`_heavy_ops`)
        if (
            admits(op_type, current, type_str)
            and not _kernel_admits(runtime, op_type, current, type_str)
            and runtime.runs_in("", op_type, type_str)
        ):
            gaps.add(op_type)
    return gaps


def _kernel_admits(runtime: RuntimeProfile | None, op_type: str, version: int, type_str: str) -> bool:
    """Whether the runtime's kernel of the default-domain op at opset `version` admits
    `type_str` (no table, or a table that does not list the op: the schema decides)."""
    if runtime is None or not runtime.knows("", op_type):
        return True
    kernel = runtime.kernel("", op_type, version)
    return kernel is not None and any(type_str in types for types in kernel.types.values())


def _first_opsets(
    ops: set[str], current: int, type_str: str, runtime: RuntimeProfile | None = None
) -> tuple[int, list[str]]:
    """The lowest opset at which every op of `ops` admits `type_str`, in its schema and in the
    runtime's kernel (those that never do aside), with the ops that need more than `current`."""
    needed, needing = current, []
    newest = onnx.defs.onnx_opset_version()
    for op_type in sorted(ops):
        if admits(op_type, current, type_str) and _kernel_admits(runtime, op_type, current, type_str):
            continue
        first = next(
            (v for v in range(current + 1, newest + 1)
             if admits(op_type, v, type_str) and _kernel_admits(runtime, op_type, v, type_str)),
            None,
        )
        if first is not None:
            needed = max(needed, first)
            needing.append(op_type)
    return needed, needing


def upgrade_opset(model: ir.Model, opset: int, skip: frozenset[ir.Node] = frozenset()) -> ir.Model:
    """Upgrade the default-domain opset with the ONNX version converter, weights untouched.

    When the converter leaves every kind of node the model has as it is (the versions in
    between only add types or optional attributes), only the opset import changes: the model
    is not serialized, converted and read back (:func:`converter_keeps_every_node`). Nodes in
    `skip` do not count (they are about to go: normalization blocks that fuse once upgraded).

    Raises:
        InputError: The converter cannot upgrade the model (naming the versions and its error),
            or the model has local functions (the converter drops them, leaving the nodes that
            call them undefined).
    """
    if converter_keeps_every_node(model, opset, skip):
        set_default_opset(model, opset)
        return model
    current = default_opset(model)
    if model.functions:
        raise InputError(
            f"cannot upgrade the model from opset {current} to {opset}: the ONNX version converter "
            f"drops its {len(model.functions)} local function(s) (--inline-functions inlines them first)"
        )
    graph = model.graph
    inputs = {v.name for v in graph.inputs}
    proto = weight_free_proto(model)
    kept = {t.name for t in proto.graph.initializer}
    detached = {
        name: value.const_value
        for name, value in graph.initializers.items()
        if name not in kept and value.const_value is not None
    }
    untyped = _untyped_outputs(model)
    result = value_types.carry(model, value_types.deserialize(_convert_version(proto, current, opset)))
    _restore_weights(result.graph, detached, inputs)
    _forget_converter_types(result, untyped)
    return result


def _untyped_outputs(model: ir.Model) -> tuple[set[str], set[str]]:
    """Names of the node outputs without an element type, and without a shape."""
    outputs = [out for node in all_nodes(model) for out in node.outputs if out.name]
    return {v.name for v in outputs if v.dtype is None}, {v.name for v in outputs if v.shape is None}


def _forget_converter_types(model: ir.Model, untyped: tuple[set[str], set[str]]) -> None:
    """Drop the types the converter's own shape inference wrote on values that had none: it
    infers without data propagation, so a shape computed in the graph (Shape -> Slice -> Concat ->
    Reshape) gets unknown dimensions that would stand in the way of the full inference, and
    would be saved as if the model had declared them."""
    no_dtype, no_shape = untyped
    for node in all_nodes(model):
        for out in node.outputs:
            if out.name in no_shape:
                out.shape = None
            if out.name in no_dtype:
                out.type = None


def _convert_version(proto: onnx.ModelProto, current: int | None, opset: int) -> onnx.ModelProto:
    """The ONNX version converter's upgrade of `proto` to `opset`.

    Raises:
        InputError: The converter fails (naming the versions and its error's first line).
    """
    try:
        return onnx.version_converter.convert_version(proto, opset)
    except Exception as e:  # noqa: BLE001 - the converter raises several exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"cannot upgrade the model from opset {current} to {opset}: {first}") from e


def _restore_weights(new_graph: ir.Graph, detached: dict[str, ir.TensorProtocol], inputs: set[str]) -> None:
    """Put the detached weights back as initializers of the upgraded graph, and drop the graph
    inputs that stood for them (those that were graph inputs before stay)."""
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


# A constant attribute tensor larger than this stands in the sample model as one element of
# its type and rank (adapters read attributes' presence and types, not large values).
_SAMPLE_TENSOR_BYTES = 1 << 16


_LIST_ATTRIBUTES = frozenset({ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS})


def _attribute_key(attr: ir.Attr) -> tuple:
    """An attribute as the adapters see it: its value (a tensor by type and shape)."""
    kind = attr.type
    if kind == ir.AttributeType.TENSOR:
        tensor = attr.as_tensor()
        return (attr.name, "tensor", tensor.dtype, tuple(tensor.shape))
    if kind in _LIST_ATTRIBUTES:
        return (attr.name, kind, tuple(attr.value))
    if kind in (ir.AttributeType.INT, ir.AttributeType.FLOAT, ir.AttributeType.STRING):
        return (attr.name, kind, attr.value)
    return (attr.name, kind, repr(attr.value))


_SUBGRAPH_ATTRIBUTES = frozenset({ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS})


def _signature(values: Sequence[ir.Value | None]) -> tuple | None:
    """Element type and rank of each value (None where absent); None when a value's element
    type is unknown."""
    signature = []
    for value in values:
        if value is None:
            signature.append(None)
            continue
        dtype, shape = value.dtype, value.shape
        if dtype is None:
            return None
        signature.append((dtype, None if shape is None else len(shape)))
    return tuple(signature)


def _kind(node: ir.Node) -> tuple | None:
    """What the version converter's adapters can depend on: the op, its attributes (tensors by
    type and shape), its inputs' and outputs' arity, element types and ranks. None when the node
    has a subgraph or a value of unknown element type (no sample can stand for it)."""
    attributes: tuple = ()
    if node.attributes:
        keys = []
        for attr in node.attributes.values():
            if attr.type in _SUBGRAPH_ATTRIBUTES:
                return None
            keys.append(_attribute_key(attr))
        attributes = tuple(sorted(keys))
    inputs = _signature(node.inputs)
    outputs = _signature(node.outputs) if inputs is not None else None
    if outputs is None:
        return None
    return (node.domain, node.op_type, node.version, attributes, inputs, outputs)


def _sample_value(value: ir.Value, name: str) -> onnx.ValueInfoProto:
    dims = None if value.shape is None else [d if isinstance(d, int) else None for d in value.shape]
    return onnx.helper.make_tensor_value_info(name, int(value.dtype) if value.dtype is not None else 0, dims)


def set_default_opset(model: ir.Model, opset: int) -> None:
    """Declare another default-domain opset (nothing else changes)."""
    model.opset_imports["" if "" in model.opset_imports or "ai.onnx" not in model.opset_imports else "ai.onnx"] = opset


def _sample_node(node: ir.Node) -> onnx.NodeProto:
    """The node as a protobuf, a large tensor attribute standing as one element of its type and
    rank (its bytes are never read or copied)."""
    large = {
        name for name, attr in node.attributes.items()
        if attr.type == ir.AttributeType.TENSOR and attr.as_tensor().nbytes > _SAMPLE_TENSOR_BYTES
    }
    if not large:
        return ir.serde.serialize_node(node)
    kept = [attr for name, attr in node.attributes.items() if name not in large]
    # Inputs left out: a stand-in must not become a reader of the model's values.
    proto = ir.serde.serialize_node(ir.Node(node.domain, node.op_type, [], kept, num_outputs=0, version=node.version))
    proto.input.extend([""] * len(node.inputs))
    proto.output.extend([""] * len(node.outputs))
    for name in sorted(large):
        tensor = node.attributes[name].as_tensor()
        stand_in = onnx.helper.make_tensor(name, int(tensor.dtype), [1] * len(tensor.shape), [0])
        proto.attribute.append(onnx.helper.make_attribute(name, stand_in))
    return proto


def converter_keeps_every_node(model: ir.Model, opset: int, skip: frozenset[ir.Node] = frozenset()) -> bool:
    """Whether the ONNX version converter, from the model's opset to `opset`, leaves each kind of
    node of the model (see :func:`_kind`; nodes in `skip` aside) exactly as it is: it converts a
    sample model with one node of each kind, with the same attributes and input types. Models
    with subgraphs or functions, and nodes of unknown types, take the converter's own way."""
    current = default_opset(model)
    if current is None or model.functions:
        return False
    if current == opset:
        return True
    samples = _samples(model, skip, _schema_changes(current, opset))
    if samples is None:
        return False
    nodes, sample = _sample_model(list(samples.values()), current, model.ir_version)
    try:
        converted = onnx.version_converter.convert_version(sample, opset)
    except Exception:  # noqa: BLE001 - the full conversion reports the converter's errors
        return False
    return _same_nodes(nodes, list(converted.graph.node))


def _samples(
    model: ir.Model, skip: frozenset[ir.Node], changes: Callable[[str], bool]
) -> dict[tuple, ir.Node] | None:
    """One default-domain node of each kind of the main graph whose op the converter may touch
    (`changes`; nodes in `skip` aside); None when such a node has a subgraph or a value of unknown
    type."""
    samples: dict[tuple, ir.Node] = {}
    for node in model.graph:
        if normalize_domain(node.domain) != "" or node in skip:
            continue
        if not changes(node.op_type) and not (node.attributes and has_subgraphs(node)):
            continue  # the same schema at both opsets: the converter leaves the node as it is
        kind = _kind(node)
        if kind is None:
            return None
        samples.setdefault(kind, node)
    return samples


def _schema_changes(current: int, opset: int) -> Callable[[str], bool]:
    """Whether a default-domain op's schema changes between the two opsets (an op without one at
    the higher opset counts as changing): only such ops have version adapters."""
    low, high = sorted((current, opset))
    known: dict[str, bool] = {}

    def changes(op_type: str) -> bool:
        found = known.get(op_type)
        if found is None:
            schema = get_schema(op_type, "", high)
            found = known[op_type] = schema is None or schema.since_version > low
        return found

    return changes


def _sample_model(
    samples: list[ir.Node], current: int, ir_version: int
) -> tuple[list[onnx.NodeProto], onnx.ModelProto]:
    """The sample model at opset `current` with one node per sample (each with inputs and outputs
    of its own), and its nodes."""
    nodes, inputs, outputs = [], [], []
    for index, node in enumerate(samples):
        proto = _sample_node(node)
        proto.name = f"n{index}"
        for position, value in enumerate(node.inputs):
            if value is not None:
                proto.input[position] = f"i{index}_{position}"
                inputs.append(_sample_value(value, proto.input[position]))
        for position, value in enumerate(node.outputs):
            proto.output[position] = f"o{index}_{position}"
            outputs.append(_sample_value(value, proto.output[position]))
        nodes.append(proto)
    graph = onnx.helper.make_graph(nodes, "sample", inputs, outputs)
    sample = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", current)])
    sample.ir_version = ir_version
    return nodes, sample


def _same_nodes(nodes: list[onnx.NodeProto], converted: list[onnx.NodeProto]) -> bool:
    """Whether the converter's nodes are the sample's, one for one (ops, names, attributes)."""
    if len(converted) != len(nodes):
        return False
    return all(
        (a.op_type, a.domain, list(a.input), list(a.output)) == (b.op_type, b.domain, list(b.input), list(b.output))
        and sorted(x.SerializeToString() for x in a.attribute) == sorted(x.SerializeToString() for x in b.attribute)
        for a, b in zip(nodes, converted)
    )


def _kernel_ops(node: ir.Node, version: int, lists: Callable[[str], bool]) -> list[str]:
    """The default-domain ops a runtime runs for `node` at opset `version`: its own op where the
    runtime's table `lists` it, else the ops of its ONNX function body (onnxruntime runs
    Bernoulli as RandomUniformLike, Greater and Cast)."""
    if lists(node.op_type):
        return [node.op_type]
    schema = get_schema(node.op_type, "", version)
    try:
        if schema is not None and schema.has_function:
            body = schema.function_body
        elif schema is not None and schema.has_context_dependent_function:
            # The body's ops, not its types, are asked: an input of unknown type stands as float.
            types = [
                onnx.helper.make_tensor_type_proto(
                    int(v.dtype) if v is not None and v.dtype is not None else onnx.TensorProto.FLOAT, None
                ).SerializeToString()
                for v in node.inputs
            ]
            body = onnx.FunctionProto()
            body.ParseFromString(
                schema.get_context_dependent_function(ir.serde.serialize_node(node).SerializeToString(), types)
            )
        else:
            return []
    except Exception:  # noqa: BLE001 - a body the schema cannot build for this node: nothing to check
        return []
    return [n.op_type for n in body.node if normalize_domain(n.domain) == ""]


def _op_samples(model: ir.Model) -> dict[str, ir.Node]:
    """One node of each default-domain op of the model."""
    samples: dict[str, ir.Node] = {}
    for node in all_nodes(model):
        if normalize_domain(node.domain) == "":
            samples.setdefault(node.op_type, node)
    return samples


def stranded_ops(model: ir.Model, opset: int, profile: RuntimeProfile) -> list[str]:
    """Default-domain ops of the model that the runtime runs at the model's opset but not at
    `opset` (onnxruntime's random-number ops end at 21; Bernoulli, run as its function body,
    with them): upgrading would make the model fail to load there."""
    current = default_opset(model)
    if profile.kernels is None or current is None or opset <= current:
        return []
    cpu = load_runtime("ort-cpu") if profile.engine == "onnxruntime" else None

    def lists(op: str) -> bool:
        return profile.knows("", op) or (cpu is not None and cpu.knows("", op))

    return sorted(
        op for op, node in _op_samples(model).items()
        if any(profile.runs_at("", k, current) and not profile.runs_at("", k, opset) for k in _kernel_ops(node, opset, lists))
    )


def cpu_runnable_opset(model: ir.Model) -> int | None:
    """An older opset to declare for onnxruntime's CPU provider, where it has no kernel of some
    op at the model's but one of each at the older (its random-number ops end at 21, where a
    bfloat16 conversion declares 22), and the version converter leaves every node of the model
    as it is between the two; None where the model's own opset runs or no such opset exists.
    For models run in FP32 (an emulation): they need nothing of the newer one."""
    current = default_opset(model)
    if current is None:
        return None
    cpu = load_runtime("ort-cpu")
    ops = {k for node in _op_samples(model).values() for k in _kernel_ops(node, current, partial(cpu.knows, ""))}
    lacking = [op for op in ops if cpu.knows("", op) and cpu.kernel("", op, current) is None]
    if not lacking:
        return None
    version = next(
        (v for v in range(current - 1, 0, -1) if all(cpu.kernel("", op, v) is not None for op in lacking)), None
    )
    return version if version is not None and converter_keeps_every_node(model, version) else None


def stranding_note(ops: Sequence[str], opset: int, profile: RuntimeProfile) -> str:
    """Why an upgrade to `opset` was not made (see :func:`stranded_ops`)."""
    return f"{profile.provider or profile.name} has no kernel of {', '.join(ops)} at opset {opset}"


def upgrade_for_target(
    model: ir.Model,
    opset: int | None,
    policy: Policy,
    target: LowPrecision,
    profile: RuntimeProfile,
    notes: list[str],
) -> ir.Model | None:
    """Upgrade the model's opset when asked (`opset`), or when its compute-bound ops admit the
    target type only at a newer opset, or the runtime has 16-bit kernels of the ops around them
    only there (`required_opset`); None when the model stays as it is."""
    current = default_opset(model)
    if opset is not None:
        if current is None or current >= opset:
            return None
        notes.append(f"opset upgraded from {current} to {opset} (--opset)")
        stranded = stranded_ops(model, opset, profile)
        if stranded:
            notes.append(f"{stranding_note(stranded, opset, profile)}: the model may not load there")
        return upgrade_opset(model, opset)
    needed = required_opset(model, policy, target, profile)
    if needed is None:
        return None
    version, ops = needed
    stranded = stranded_ops(model, version, profile)
    if stranded:
        lower = required_opset(model, policy, target, profile, kernel_gaps=False)
        if lower is None or lower[0] >= version or stranded_ops(model, lower[0], profile):
            notes.append(
                f"{', '.join(ops)} need opset {version} for {target.value}, but "
                f"{stranding_note(stranded, version, profile)}: the model stays at opset {current}"
            )
            return None
        version, ops = lower
    try:
        upgraded = upgrade_opset(model, version)
    except InputError as e:
        # The ops around the compute-bound ones may have asked for more than those need.
        lower = required_opset(model, policy, target, profile, kernel_gaps=False)
        if lower is None or lower[0] >= version:
            notes.append(f"{', '.join(ops)} need opset {version} for {target.value} but {e}; they stay FP32")
            return None
        notes.append(f"{', '.join(op for op in ops if op not in lower[1])} stay FP32: opset {version} {e}")
        version, ops = lower
        try:
            upgraded = upgrade_opset(model, version)
        except InputError as again:
            notes.append(f"{', '.join(ops)} need opset {version} for {target.value} but {again}; they stay FP32")
            return None
    by_schema = [op for op in ops if not admits(op, current, target.type_str)]
    by_kernel = [op for op in ops if op not in by_schema]
    reasons = []
    if by_schema:
        reasons.append(f"{', '.join(by_schema)} {'admits' if len(by_schema) == 1 else 'admit'} {target.value}")
    if by_kernel:
        reasons.append(f"{profile.provider or profile.name} runs {', '.join(by_kernel)} in {target.value}")
    notes.append(
        f"opset upgraded from {current} to {version}: {' and '.join(reasons)} from "
        f"opset {version} (pin a version with --opset)"
    )
    if profile.opset_range is not None and version > profile.opset_range[1]:
        notes.append(
            f"the {profile.name} table covers opsets {profile.opset_range[0]}-{profile.opset_range[1]}; "
            f"check that your {profile.name} version parses opset {version}"
        )
    return upgraded
