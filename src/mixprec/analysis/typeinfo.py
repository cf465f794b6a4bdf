"""Full type information: fill in the element type (and shape) of every value.

Runs ONNX shape inference once on a weight-free copy of the model (never a >2 GB protobuf)
and copies the inferred types back onto the IR values, main graph and subgraphs alike.
Values whose type inference cannot tell keep `dtype is None`; the planner leaves the nodes
that touch them at their original types.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx.shape_inference
import onnx_ir as ir

from mixprec.analysis.constants import constant_node_tensor
from mixprec.errors import MixprecError
from mixprec.graphs import all_graphs, all_nodes, shapes_contradict, static_shape, subgraph_owners, walk_nodes
from mixprec.io import weight_free_proto
from mixprec.io.onnx_file import FileChecks, Inferred, file_inference, first_line, forget_output_shapes, inferred_graph
from mixprec.policy.profiles import binding_signature
from mixprec.policy.schemas import Signature, signature
from mixprec.policy.table import normalize_domain

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class TypeInfo:
    """Outcome of type inference.

    Attributes:
        inferred: Number of values whose type was filled in.
        unknown: Number of node outputs whose element type is still unknown.
        warning: Shape inference's error message when it could not run, else None.
        corrected: Graph outputs whose declared shape contradicted what the model computes,
            as "name: declared -> inferred"; their values now carry the inferred shape.
    """

    inferred: int
    unknown: int
    warning: str | None
    corrected: tuple[str, ...] = ()


class _TypeCache:
    """Parsed inferred types, one entry per distinct TypeProto (most values share a few).

    Values of equal shape share one frozen ir.Shape, and shapes share one ir.SymbolicDim per
    dimension name (inference names each unknown dimension once and passes the name on).
    """

    def __init__(self) -> None:
        self._types: dict[bytes, tuple[int, ir.Shape | None]] = {}
        self._shapes: dict[tuple, ir.Shape] = {}
        self._symbols: dict[str | None, ir.SymbolicDim] = {}

    def _shape(self, dims: tuple) -> ir.Shape:
        symbols = self._symbols
        shared = []
        for dim in dims:
            if not isinstance(dim, int):
                symbol = symbols.get(dim)
                if symbol is None:
                    symbol = symbols[dim] = ir.SymbolicDim(dim)
                dim = symbol
            shared.append(dim)
        return ir.Shape(shared, frozen=True)

    def get(self, type_proto: onnx.TypeProto) -> tuple[int, ir.Shape | None]:
        """The element type (0 when unknown) and shape (None when unknown) of a TypeProto."""
        key = type_proto.SerializeToString()
        parsed = self._types.get(key)
        if parsed is None:
            elem_type, dims = _dtype_and_dims(type_proto)
            shape = None
            if dims is not None:
                shape = self._shapes.get(dims)
                if shape is None:
                    shape = self._shapes[dims] = self._shape(dims)
            parsed = (elem_type, shape)
            self._types[key] = parsed
        return parsed


def _dtype_and_dims(type_proto: onnx.TypeProto) -> tuple[int, tuple | None]:
    if not type_proto.HasField("tensor_type"):
        return 0, None
    tensor_type = type_proto.tensor_type
    if not tensor_type.HasField("shape"):
        return tensor_type.elem_type, None
    dims = tuple([
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
        for d in tensor_type.shape.dim
    ])
    return tensor_type.elem_type, dims


def _graph_pairs(
    graph: ir.Graph, proto: onnx.GraphProto
) -> Iterator[tuple[ir.Graph, onnx.GraphProto]]:
    """Pair each IR graph with its inferred protobuf graph, subgraphs included."""
    yield graph, proto
    if len(proto.node) != len(graph):
        return
    owners = subgraph_owners(graph)
    if not owners:
        return  # no graph attributes: nothing to read from the protobuf nodes
    last = max(i for i, node in enumerate(graph) if node in owners)
    for node, node_proto in zip(graph, proto.node[: last + 1]):
        if node.op_type != node_proto.op_type:
            return
        if node not in owners:
            continue  # no graph attributes: nothing to read from the protobuf node
        graph_attrs = {a.name: a for a in node_proto.attribute if a.type in (5, 10)}
        for attr in node.attributes.values():
            attr_proto = graph_attrs.get(attr.name)
            if attr_proto is None:
                continue
            if attr.type == ir.AttributeType.GRAPH:
                yield from _graph_pairs(attr.as_graph(), attr_proto.g)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub, sub_proto in zip(attr.as_graphs(), attr_proto.graphs):
                    yield from _graph_pairs(sub, sub_proto)


def _inferred_types(proto: onnx.GraphProto, names: set[str | None]) -> dict[str, onnx.TypeProto]:
    """The inferred types of the values of `proto` called one of `names` (the last entry of a
    name wins: inputs, then value_info, then outputs)."""
    return {
        info.name: info.type for info in (*proto.input, *proto.value_info, *proto.output) if info.name in names
    }


# Element type numbers to the IR's enum (the enum's own lookup is slow at 100k values).
_DATA_TYPES: dict[int, ir.DataType] = {int(d): d for d in ir.DataType}


def _apply(graph: ir.Graph, proto: onnx.GraphProto, types: _TypeCache) -> int:
    """Copy inferred types onto the values of `graph` that lack a dtype or shape."""
    values: list[ir.Value] = [*graph.inputs, *graph.initializers.values()]
    for node in graph:
        values.extend(node.outputs)
    untyped = [v for v in values if v.dtype is None or v.shape is None]
    if not untyped:
        return 0
    inferred = _inferred_types(proto, {v.name for v in untyped})
    count = 0
    get = types.get
    for value in untyped:
        type_proto = inferred.get(value.name)
        if type_proto is None:
            continue
        elem_type, shape = get(type_proto)
        if value.dtype is None and elem_type:
            value.dtype = _DATA_TYPES.get(elem_type) or ir.DataType(elem_type)
            count += 1
        if value.shape is None and shape is not None:
            value.shape = shape
    return count


def _infer_graph_types(
    model: ir.Model,
    source: Path | None,
    strict_failure: Callable[[str], None] | None = None,
    checks: FileChecks | None = None,
) -> tuple[int, list[str], str | None]:
    """Run ONNX shape inference on the graph and copy its types onto the IR.

    Returns the number of values typed, the corrected output shapes, and the warning when
    inference failed (then nothing is typed). With `strict_failure`, inference first runs
    strict (the checker's full check: types checked, the first error raised); on an error it
    is told the error's first line (it may raise) before the lenient inference runs. `checks`:
    a child already inferring `source`.
    """
    strict = strict_failure is not None
    if source is None:
        try:
            proto = weight_free_proto(model)
            forget_output_shapes(proto.graph, nested=len(all_graphs(model)) > 1)
            # Inference reads bytes: the parsed copy need not live beside onnx's own and its result.
            graph_bytes = proto.SerializeToString()
            del proto
        except MixprecError:
            raise
        except Exception as e:  # noqa: BLE001 - inference is best effort; the planner copes
            inferred = Inferred(None, None, first_line(e))
        else:
            inferred = inferred_graph(graph_bytes, strict=strict, objected=strict_failure)
    elif checks is not None:
        inferred = checks.inference(
            lambda objected: file_inference(source, strict=strict, objected=objected), strict_failure
        )
    else:
        inferred = file_inference(source, strict=strict, objected=strict_failure)
    if inferred.model is None:
        logger.warning("type inference failed, unknown types stay unconverted: %s", inferred.failure)
        return 0, [], inferred.failure
    count = 0
    corrected: list[str] = []
    types = _TypeCache()
    for graph, graph_proto in _graph_pairs(model.graph, inferred.model.graph):
        count += _apply(graph, graph_proto, types)
        corrected.extend(_correct_output_shapes(graph, graph_proto, types))
    return count, corrected, None


def _fill_function_constant_types(function: ir.Function) -> None:
    """Give the untyped Constant outputs of a typed function body their tensors' types."""
    for node in walk_nodes(function.graph):
        if node.op_type == "Constant" and node.outputs and node.outputs[0].dtype is None:
            tensor = constant_node_tensor(node)
            if tensor is not None:
                node.outputs[0].dtype = tensor.dtype


def infer_types(
    model: ir.Model,
    source: Path | None = None,
    strict_failure: Callable[[str], None] | None = None,
    checks: FileChecks | None = None,
) -> TypeInfo:
    """Fill in element types and shapes of all values of `model` in place.

    Args:
        model: The model.
        source: The file `model` was loaded from, unchanged since: parsing it again is much
            faster than serializing the IR for large graphs.
        strict_failure: Run inference strictly first, as the checker's full check does, and
            tell this the first error (it may raise; else lenient inference follows).
        checks: A child process already inferring `source` (:class:`FileChecks`): its answer
            is taken instead of inferring here.
    """
    for value in model.graph.initializers.values():
        if value.const_value is not None and value.dtype is None:
            value.dtype = value.const_value.dtype
        shape = value.shape  # deserialized: one frozen Shape per weight; shared by dims here
        if shape is not None and shape.frozen and all(isinstance(d, int) for d in shape.dims):
            value.shape = static_shape(tuple(shape.dims))
    inferred, corrected, warning = _infer_graph_types(model, source, strict_failure, checks)
    main_nodes = walk_nodes(model.graph)
    _fill_constant_types(model, main_nodes)
    for function in infer_function_types(model):
        _fill_function_constant_types(function)
    propagate_by_signature(model, main_nodes)
    unknown = sum(
        1 for node in main_nodes for out in node.outputs if out.dtype is None and out.uses()
    )
    return TypeInfo(inferred=inferred, unknown=unknown, warning=warning, corrected=tuple(corrected))


def untyped_values(model: ir.Model) -> set[str]:
    """Names of the node outputs (main graph and subgraphs) whose type or shape is unknown."""
    return {
        out.name for node in walk_nodes(model.graph) for out in node.outputs
        if out.name and (out.dtype is None or out.shape is None)
    }


def retype_after_upgrade(model: ir.Model, untyped_before: set[str], previous: TypeInfo) -> TypeInfo:
    """Types for a model the opset upgrade rebuilt from a typed one: the values keep theirs
    (the converted file carries them), so only the constants the converter added (attributes
    that became inputs) need one, from their tensors; full inference only when anything else
    lost its type."""
    nodes = walk_nodes(model.graph)
    _fill_constant_types(model, nodes)
    for node in nodes:
        if node.op_type == "Constant" and node.outputs and node.outputs[0].shape is None:
            tensor = constant_node_tensor(node)
            if tensor is not None:
                node.outputs[0].shape = ir.Shape(tensor.shape)
    lost = any(
        (out.dtype is None or out.shape is None) and out.name not in untyped_before
        for node in nodes for out in node.outputs
    )
    return infer_types(model) if lost else previous


def _correct_output_shapes(graph: ir.Graph, proto: onnx.GraphProto, types: _TypeCache) -> list[str]:
    """Give the outputs of `graph` whose declared shape contradicts inference the inferred
    shape (a declared shape that agrees stays: its dimension names say more)."""
    inferred = {info.name: info.type for info in proto.output}
    corrected = []
    for value in graph.outputs:
        type_proto = inferred.get(value.name)
        if value.shape is None or type_proto is None:
            continue
        _, shape = types.get(type_proto)
        if shape is not None and shapes_contradict(value.shape.dims, shape.dims):
            corrected.append(f"{value.name}: {list(value.shape.dims)} -> {list(shape.dims)}")
            value.shape = shape
    return corrected


def assume_float_outputs(model: ir.Model, ops: frozenset[tuple[str, str]]) -> None:
    """Custom ops the user classified: ONNX cannot infer their outputs; untyped outputs of such a
    node with a float32 input are taken to be float32."""
    if not ops:
        return
    for node in all_nodes(model):
        if (normalize_domain(node.domain), node.op_type) not in ops:
            continue
        if any(v is not None and v.dtype == ir.DataType.FLOAT for v in node.inputs):
            for out in node.outputs:
                if out.dtype is None:
                    out.dtype = ir.DataType.FLOAT


def _signature_of(node: ir.Node, opsets: dict[str, int]) -> Signature | None:
    domain = normalize_domain(node.domain)
    version = node.version if node.version is not None else (opsets.get(domain) if domain else opsets.get("", opsets.get("ai.onnx")))
    if version is None:
        return None
    n_in, n_out = len(node.inputs), len(node.outputs)
    sig = signature(node.op_type, domain, version, n_in, n_out) if domain == "" else None
    return sig or binding_signature(domain, node.op_type, version, n_in, n_out)


def _element_type(type_str: str) -> ir.DataType | None:
    name = type_str.removeprefix("tensor(").removesuffix(")")
    elem = _TENSOR_TYPES.get(name)
    return None if elem is None else ir.DataType(elem)


_TENSOR_TYPES = {
    onnx.helper.tensor_dtype_to_string(t).removeprefix("TensorProto.").lower(): t
    for t in onnx.TensorProto.DataType.values()
    if t != onnx.TensorProto.UNDEFINED
}
_TENSOR_TYPES.update(float=onnx.TensorProto.FLOAT, double=onnx.TensorProto.DOUBLE, bool=onnx.TensorProto.BOOL)


def propagate_by_signature(model: ir.Model, nodes: list[ir.Node]) -> int:
    """Fill element types ONNX inference left unknown from each node's type binding.

    Ops without an ONNX schema (contrib ops such as `com.microsoft::Attention`) stop ONNX
    inference, and everything downstream of them stays untyped. Their kernel binding (from the
    ONNX Runtime tables) and the schemas of standard ops say which input an output takes its
    type from; one walk in graph order fills those. Shapes stay unknown. Returns the number of
    values typed.
    """
    opsets = dict(model.opset_imports)
    filled = 0
    for node in nodes:
        if all(out.dtype is not None for out in node.outputs):
            continue
        sig = _signature_of(node, opsets)
        if sig is None:
            continue
        known: dict[str, ir.DataType] = {}
        for value, var in zip(node.inputs, sig.input_vars):
            if value is not None and var is not None and value.dtype is not None:
                known.setdefault(var, value.dtype)
        for out, var in zip(node.outputs, sig.output_vars):
            if out.dtype is not None or var is None:
                continue
            dtype = known.get(var)
            allowed = sig.allowed.get(var, frozenset())
            if dtype is None and len(allowed) == 1:
                dtype = _element_type(next(iter(allowed)))
            if dtype is not None:
                out.dtype = dtype
                filled += 1
    return filled


def _fill_constant_types(model: ir.Model, main_nodes: list[ir.Node]) -> None:
    """Constant nodes and subgraph initializers carry their type in their tensors.

    `main_nodes`: the nodes of the main graph and its subgraphs (`walk_nodes(model.graph)`).
    """
    for graph in all_graphs(model):
        for value in graph.initializers.values():
            if value.dtype is None and value.const_value is not None:
                value.dtype = value.const_value.dtype
                value.shape = ir.Shape(value.const_value.shape)
    for node in main_nodes:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.outputs:
            out = node.outputs[0]
            if out.dtype is None:
                tensor = constant_node_tensor(node)
                if tensor is not None:
                    out.dtype = tensor.dtype


def _call_sites(model: ir.Model) -> dict[tuple[str, str, str], list[ir.Node]]:
    calls: dict[tuple[str, str, str], list[ir.Node]] = {}
    nodes = list(walk_nodes(model.graph))
    for function in model.functions.values():
        nodes.extend(walk_nodes(function.graph))
    for node in nodes:
        key = (node.domain, node.op_type, node.overload)
        if key in model.functions:
            calls.setdefault(key, []).append(node)
    return calls


def _has_attribute_refs(function: ir.Function) -> bool:
    return any(
        attr.is_ref() for node in walk_nodes(function.graph) for attr in node.attributes.values()
    )


def _call_signature(function: ir.Function, sites: list[ir.Node]) -> tuple[ir.DataType, ...] | None:
    """The input element types every call site passes; None when they differ or are unknown."""
    signatures = {tuple(v.dtype if v is not None else None for v in site.inputs) for site in sites}
    if len(signatures) != 1:
        return None
    dtypes = signatures.pop()
    if len(dtypes) != len(function.inputs) or any(d is None for d in dtypes):
        return None
    return dtypes  # type: ignore[return-value]


def _body_model(
    model: ir.Model,
    function: ir.Function,
    dtypes: tuple[ir.DataType, ...],
    function_proto: onnx.FunctionProto,
    other_functions: list[onnx.FunctionProto],
) -> onnx.ModelProto:
    """A model whose graph is the function's body (`function_proto`), its inputs of the call
    sites' types, with the functions it calls (`other_functions`)."""
    graph = onnx.helper.make_graph(
        list(function_proto.node),
        f"{function.name}_body",
        [
            onnx.helper.make_tensor_value_info(name, int(dtype), None)  # type: ignore[arg-type]
            for name, dtype in zip(function_proto.input, dtypes)
        ],
        [onnx.helper.make_empty_tensor_value_info(name) for name in function_proto.output],
    )
    opsets = dict(model.opset_imports)
    opsets.update(function.opset_imports)
    return onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
        functions=other_functions,
        ir_version=max(model.ir_version, 8),
    )


# Float Constant tensors above this many bytes stand in a function body inferred for its types by
# their type and shape alone (weights; integer tensors, which inference may read as shapes, sizes
# or indices, keep their values).
_STAND_IN_BYTES = 1024
_STAND_IN_TYPES = frozenset({
    onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE,
})


def _shape_only(function: onnx.FunctionProto) -> onnx.FunctionProto:
    """`function` with each large float Constant tensor of its body made a stand-in: its type
    and dimensions, its data marked external (type inference reads no float values; no byte is
    copied)."""
    for node in function.node:
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        for attr in node.attribute:
            tensor = attr.t
            if attr.name != "value" or tensor.data_type not in _STAND_IN_TYPES or tensor.ByteSize() <= _STAND_IN_BYTES:
                continue
            stand_in = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
            stand_in.data_location = onnx.TensorProto.EXTERNAL
            stand_in.external_data.add(key="location", value="stand-in")
            attr.t.CopyFrom(stand_in)
    return function


def _callees(model: ir.Model) -> dict[tuple[str, str, str], set[tuple[str, str, str]]]:
    """Function -> the functions its body (subgraphs included) calls directly."""
    return {
        key: {k for node in walk_nodes(function.graph) if (k := (node.domain, node.op_type, node.overload)) in model.functions}
        for key, function in model.functions.items()
    }


def _reachable(key: tuple[str, str, str], callees: dict[tuple[str, str, str], set[tuple[str, str, str]]]) -> list:
    """The functions `key` calls, directly or through others (itself aside)."""
    found: dict[tuple[str, str, str], None] = {}
    pending = list(callees.get(key, ()))
    while pending:
        callee = pending.pop()
        if callee not in found and callee != key:
            found[callee] = None
            pending.extend(callees.get(callee, ()))
    return list(found)


def infer_function_types(model: ir.Model) -> list[ir.Function]:
    """Type the bodies of model-local functions from their call sites.

    A function is typed when every call site passes inputs of the same known element types and
    its body uses no attribute references; the body is then inferred like a graph whose inputs
    have those types. Returns the functions that were typed (the others keep unknown types, so
    the planner leaves their bodies unchanged).
    """
    typed: list[ir.Function] = []
    if not model.functions:
        return typed
    calls = _call_sites(model)
    # Each body serialized once, its large constants as stand-ins of their type and shape
    # (inference reads no more of them); each body inferred with the functions it calls alone.
    protos = {key: _shape_only(ir.to_proto(function)) for key, function in model.functions.items()}
    callees = _callees(model)
    types = _TypeCache()
    for key, function in model.functions.items():
        sites = calls.get(key, [])
        if not sites or _has_attribute_refs(function):
            continue
        dtypes = _call_signature(function, sites)
        if dtypes is None:
            continue
        body = _body_model(model, function, dtypes, protos[key], [protos[k] for k in _reachable(key, callees)])
        try:
            body = onnx.shape_inference.infer_shapes(body, check_type=False, strict_mode=False)
        except Exception as e:  # noqa: BLE001 - a body we cannot type stays as it is
            logger.info("cannot type function %s: %s", function.name, e)
            continue
        for value, dtype in zip(function.inputs, dtypes):
            if value.dtype is None:
                value.dtype = dtype
        for graph, graph_proto in _graph_pairs(function.graph, body.graph):
            _apply(graph, graph_proto, types)
        typed.append(function)
    return typed
