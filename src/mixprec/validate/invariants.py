"""Structural invariants of a model under conversion, checked after each pipeline step.

With ``MIXPREC_CHECK_STEPS=1``, :func:`mixprec.pipeline.run` captures a :class:`Baseline` of the
model right after ``load`` and checks these after every step that changes the model, so that a
broken graph is blamed on the step that broke it, not on the checker or onnxruntime at the end:

* node names are unique within each graph (onnxruntime refuses two nodes of one name);
* value names are defined once per graph, and a subgraph neither redefines an outer value that
  is visible to it nor hides an outer value that it reads;
* values carry types that agree with their producers (a Cast's output has the type ``to``;
  elementwise ops keep their float type), and every value the converter created is typed;
* after ``rewrite``, no created value has a shape that ONNX shape inference contradicts;
* the graph inputs and outputs keep their names (and types, with ``keep_io_types``);
* every node input is defined in scope before it is read, initializers are registered under
  their own names, and no initializer the converter created is left unused.

Whatever the source model already broke (as recorded in its :class:`Baseline`) is not reported.
Every check is linear in the size of the model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import onnx
import onnx.shape_inference
import onnx_ir as ir

from mixprec.errors import InvariantError
from mixprec.graphs import graph_protos, has_subgraphs, is_default_domain, shapes_contradict
from mixprec.io import uses_external_data, weight_bytes, weight_free_proto

ENV_VARIABLE = "MIXPREC_CHECK_STEPS"

# Steps after which every value the converter created must carry a type (before `type`, the
# model holds only the types the file declared); steps after which shapes are compared with
# ONNX shape inference (once: the rewrite is the step that creates most values).
TYPED_STEPS = frozenset({"type", "analyze", "plan", "rewrite", "report", "save"})
INFERRED_STEPS = frozenset({"rewrite"})
# Shape inference runs on models up to this many bytes of weights (and without external data).
INFER_MAX_WEIGHT_BYTES = 200 << 20

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})
_LOW = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
# Default-domain ops whose float inputs and outputs all share one type variable.
_SAME_FLOAT_TYPE = frozenset({
    "Abs", "Acos", "Acosh", "Add", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Celu", "Clip", "Cos",
    "Cosh", "Div", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "Identity",
    "LeakyRelu", "Log", "LogSoftmax", "Max", "Mean", "Min", "Mish", "Mul", "Neg", "PRelu",
    "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softmax", "Softplus",
    "Softsign", "Sqrt", "Sub", "Sum", "Tan", "Tanh", "ThresholdedRelu", "Where",
})


def steps_checked() -> bool:
    """Whether ``MIXPREC_CHECK_STEPS`` asks for the invariants after every pipeline step."""
    return os.environ.get(ENV_VARIABLE, "").strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Baseline:
    """What the source model looked like right after ``load``.

    Attributes:
        inputs: Graph input names and element types (None: not a tensor or unknown).
        outputs: Graph output names and element types.
        names: Every value name of the source (all graphs and function bodies).
        known: Keys of the findings the source already had (never blamed on the converter).
        keep_io_types: Whether FP32 graph inputs and outputs must stay FP32.
    """

    inputs: tuple[tuple[str, int | None], ...]
    outputs: tuple[tuple[str, int | None], ...]
    names: frozenset[str]
    known: frozenset[str] = field(default_factory=frozenset)
    keep_io_types: bool = True

    @classmethod
    def capture(cls, model: ir.Model, *, keep_io_types: bool = True) -> Baseline:
        """The baseline of `model` (the source, as loaded)."""
        scopes = _scopes(model)
        names: set[str] = set()
        for scope in scopes:
            graph = scope.graph
            names.update(v.name for v in graph.inputs if v.name)
            names.update(name for name in graph.initializers if name)
            for node in graph:
                names.update(v.name for v in node.outputs if v.name)
        known = frozenset(key for key, _ in _findings(model, scopes, None, source=None, typed=False))
        return cls(
            inputs=tuple((v.name or "", _elem(v)) for v in model.graph.inputs),
            outputs=tuple((v.name or "", _elem(v)) for v in model.graph.outputs),
            names=frozenset(names),
            known=known,
            keep_io_types=keep_io_types,
        )


def check_invariants(model: ir.Model, *, step: str, baseline: Baseline | None) -> list[str]:
    """The invariants `model` breaks after pipeline step `step`, one line each (empty: none).

    Without a baseline every value counts as created by the converter, nothing is excused, and
    the graph inputs and outputs are not compared.
    """
    source = None if baseline is None else baseline.names
    scopes = _scopes(model)
    findings = _findings(model, scopes, baseline, source=source, typed=step in TYPED_STEPS)
    if step in INFERRED_STEPS:
        findings.extend(_shape_findings(model, scopes, source))
    known = baseline.known if baseline is not None else frozenset()
    return [f"after step {step!r}: {message}" for key, message in findings if key not in known]


def require_invariants(model: ir.Model, *, step: str, baseline: Baseline | None) -> None:
    """Raise :class:`InvariantError` naming the first invariant `model` breaks after `step`."""
    problems = check_invariants(model, step=step, baseline=baseline)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InvariantError(problems[0] + more)


# -- graphs and their scopes -------------------------------------------------------------------


@dataclass
class _Scope:
    """One graph: where it sits (its enclosing scope and the owning node's position there)."""

    graph: ir.Graph
    label: str
    parent: _Scope | None = None
    owner_index: int = -1
    index: dict[ir.Node, int] = field(default_factory=dict)  # node -> position
    defined: dict[str, ir.Value] = field(default_factory=dict)  # name -> the value defining it
    position: dict[str, int] = field(default_factory=dict)  # name -> defining node's position (-1)


def _scopes(model: ir.Model) -> list[_Scope]:
    """The main graph, the function bodies and every subgraph, each after its enclosing graph."""
    main = model.graph
    scopes = [_Scope(main, f"graph {main.name!r}" if main.name else "the main graph")]
    scopes.extend(_Scope(f.graph, f"function {f.domain}::{f.name}") for f in model.functions.values())
    position = 0
    while position < len(scopes):
        scope = scopes[position]
        position += 1
        for index, node in enumerate(scope.graph):
            if not (node.attributes and has_subgraphs(node)):
                continue
            for attr in node.attributes.values():
                if attr.type is ir.AttributeType.GRAPH:
                    subs = [(attr.name, attr.as_graph())]
                elif attr.type is ir.AttributeType.GRAPHS:
                    subs = [(f"{attr.name}[{i}]", g) for i, g in enumerate(attr.as_graphs())]
                else:
                    continue
                for name, sub in subs:
                    label = f"{scope.label} > {node.op_type} {node.name!r} {name}"
                    scopes.append(_Scope(sub, label, scope, index))
    return scopes


def _elem(value: ir.Value) -> int | None:
    dtype = value.dtype
    return None if dtype is None else int(dtype)


def _type_name(dtype: ir.DataType | int | None) -> str:
    if dtype is None:
        return "unknown"
    try:
        return ir.DataType(dtype).name
    except ValueError:
        return str(dtype)


def _node(node: ir.Node) -> str:
    return f"{node.op_type} {node.name!r}"


# -- the checks ------------------------------------------------------------------------------

_Finding = tuple[str, str]  # (key identifying it across steps, message)


def _created(name: str, source: frozenset[str] | None) -> bool:
    """Whether the value `name` was created by the converter (not among the `source` names;
    None: every value counts as created)."""
    return source is None or name not in source


def _findings(
    model: ir.Model, scopes: list[_Scope], baseline: Baseline | None, *, source: frozenset[str] | None, typed: bool
) -> list[_Finding]:
    findings: list[_Finding] = []
    for scope in scopes:
        _define(scope, findings)
    for scope in scopes:
        _check_nodes(scope, findings, source, typed)
        _check_initializers(scope, findings, source)
    if baseline is not None:
        findings.extend(_io_findings(model, baseline))
    return findings


def _define(scope: _Scope, findings: list[_Finding]) -> None:
    """Record what `scope` defines; report names defined twice, node names used twice, and
    subgraph values that redefine an outer value visible to them."""
    graph, label = scope.graph, scope.label
    defined, position = scope.defined, scope.position
    for value in (*graph.inputs, *graph.initializers.values()):
        if value.name:
            defined.setdefault(value.name, value)  # an initializer may also be an input
            position[value.name] = -1
    names: dict[str, ir.Node] = {}
    for index, node in enumerate(graph):
        scope.index[node] = index
        if node.name:
            first = names.setdefault(node.name, node)
            if first is not node:
                findings.append((
                    f"node-name:{node.name}",
                    f"{label}: two nodes are named {node.name!r} ({first.op_type} and {node.op_type}); "
                    "onnxruntime refuses duplicate node names",
                ))
        for value in node.outputs:
            name = value.name
            if not name:
                continue
            other = defined.setdefault(name, value)
            if other is not value:
                findings.append((
                    f"value-name:{name}",
                    f"{label}: value {name!r} is defined twice (output of {_node(node)} and "
                    f"{_definition(other)}): the graph is not in SSA form",
                ))
                continue
            position[name] = index
            outer = _visible_outer(scope, name)
            if outer is not None:
                findings.append((
                    f"value-name:{name}",
                    f"{label}: {_node(node)} redefines {name!r}, a value of the enclosing "
                    f"{outer.label}: the graph is not in SSA form",
                ))


def _definition(value: ir.Value) -> str:
    producer = value.producer()
    if producer is not None:
        return f"output of {_node(producer)}"
    return "an initializer" if value.is_initializer() else "a graph input"


def _visible_outer(scope: _Scope, name: str) -> _Scope | None:
    """The enclosing scope whose value `name` is visible in `scope` (defined before the node
    that owns the subgraph), if any."""
    owner, outer = scope.owner_index, scope.parent
    while outer is not None:
        if outer.position.get(name, owner) < owner:
            return outer
        owner, outer = outer.owner_index, outer.parent
    return None


def _check_nodes(scope: _Scope, findings: list[_Finding], source: frozenset[str] | None, typed: bool) -> None:
    """Edges (every input defined in scope before it is read), types of node outputs."""
    label = scope.label
    for index, node in enumerate(scope.graph):
        for value in node.inputs:
            if value is not None:
                problem = _edge_problem(scope, value, index)
                if problem is not None:
                    findings.append((f"edge:{value.name}:{node.name}", f"{label}: {_node(node)} {problem}"))
        _check_types(node, label, findings)
        if typed:
            for value in node.outputs:
                name = value.name
                if name and value.type is None and _created(name, source):
                    findings.append((
                        f"untyped:{name}",
                        f"{label}: value {name!r} (output of {_node(node)}) was created by the "
                        "converter without a type",
                    ))
    for value in scope.graph.outputs:
        problem = _edge_problem(scope, value, len(scope.graph))
        if problem is not None:
            findings.append((f"edge:{value.name}:", f"{label}: graph output {problem}"))


def _edge_problem(scope: _Scope, value: ir.Value, reader: int) -> str | None:
    """What is wrong with reading `value` at position `reader` of `scope` (None: nothing): it
    must be defined in this graph before the reader, or in an enclosing graph before the node
    owning the subgraph, and no value of its name on the way may hide it."""
    name = value.name
    if not name:
        return "reads a value without a name"
    producer = value.producer()
    if producer is not None:
        home = producer.graph
        if home is None:
            return f"reads {name!r}, whose producer {_node(producer)} is no longer in any graph"
    elif value.is_graph_input() or value.is_initializer():
        home = value.graph
    else:
        constant = " (it holds a tensor but is not a registered initializer)" if value.const_value is not None else ""
        return f"reads {name!r}, which no node produces and which is no graph input or initializer{constant}"
    where: _Scope | None = scope
    while where is not None:
        if where.graph is home:
            if producer is not None and where.index.get(producer, reader) >= reader:
                return f"reads {name!r} before its producer {_node(producer)} runs"
            return None
        hiding = where.defined.get(name)
        if hiding is not None and hiding is not value:
            return f"reads the outer value {name!r}, but {where.label} defines a value of that name that hides it"
        where, reader = where.parent, where.owner_index
    return f"reads {name!r}, which is defined outside its scope (in another graph)"


def _cast_target(node: ir.Node) -> int | None:
    """The element type a Cast (its ``to``) or CastLike (its second input's type) converts to;
    None when unknown."""
    if node.op_type == "Cast":
        attr = node.attributes.get("to")
        if attr is None or not isinstance(attr.value, int):
            return None
        return attr.value
    if len(node.inputs) < 2 or node.inputs[1] is None or node.inputs[1].dtype is None:
        return None
    return int(node.inputs[1].dtype)


def _check_cast_type(node: ir.Node, label: str, findings: list[_Finding]) -> None:
    """A Cast's or CastLike's output type against the type it converts to."""
    if not node.outputs or node.outputs[0].dtype is None:
        return
    want = _cast_target(node)
    if want is None:
        return
    out = node.outputs[0]
    if int(out.dtype) != want:  # type: ignore[arg-type]
        findings.append((
            f"type:{out.name}",
            f"{label}: {_node(node)} converts to {_type_name(want)} but its output "
            f"{out.name!r} is typed {_type_name(out.dtype)}",
        ))


def _check_same_float_type(node: ir.Node, label: str, findings: list[_Finding]) -> None:
    """An elementwise op's float inputs and outputs against one another (one float type)."""
    op = node.op_type
    floats = {v.dtype for v in node.inputs if v is not None and v.dtype in _FLOATS}
    if len(floats) > 1:
        findings.append((
            f"type-in:{node.name}:{op}",
            f"{label}: {_node(node)} reads {' and '.join(sorted(_type_name(t) for t in floats))} "
            "where its schema wants one type",
        ))
        return
    if not floats:
        return
    (want_type,) = floats
    for out in node.outputs:
        if out.dtype is not None and out.dtype in _FLOATS and out.dtype != want_type:
            findings.append((
                f"type:{out.name}",
                f"{label}: {_node(node)} reads {_type_name(want_type)} but its output {out.name!r} "
                f"is typed {_type_name(out.dtype)}",
            ))


# Default-domain op -> the check of its output types.
_TYPE_CHECKS = {
    "Cast": _check_cast_type,
    "CastLike": _check_cast_type,
    **{op: _check_same_float_type for op in _SAME_FLOAT_TYPE},
}


def _check_types(node: ir.Node, label: str, findings: list[_Finding]) -> None:
    """A node's output types against the ones its op and input types fix (Cast, CastLike,
    elementwise ops); unknown types are not judged."""
    if not is_default_domain(node.domain):
        return
    check = _TYPE_CHECKS.get(node.op_type)
    if check is not None:
        check(node, label, findings)


def _check_initializers(scope: _Scope, findings: list[_Finding], source: frozenset[str] | None) -> None:
    """Initializers registered under their own names; none created and left unused."""
    label = scope.label
    for name, value in scope.graph.initializers.items():
        if value.name != name:
            findings.append((
                f"initializer:{name}",
                f"{label}: initializer registered as {name!r} is named {value.name!r}",
            ))
            continue
        if _created(name, source) and not value.is_graph_output() and not value.uses():
            findings.append((
                f"unused:{name}",
                f"{label}: initializer {name!r} was created by the converter but nothing reads it",
            ))


def _io_findings(model: ir.Model, baseline: Baseline) -> list[_Finding]:
    """Graph inputs and outputs against the baseline: names always, element types as
    `keep_io_types` says (without it, FP32 may become a 16-bit type)."""
    findings: list[_Finding] = []
    label = f"graph {model.graph.name!r}" if model.graph.name else "the main graph"
    for kind, values, before in (
        ("input", model.graph.inputs, baseline.inputs), ("output", model.graph.outputs, baseline.outputs)
    ):
        now = [(v.name or "", _elem(v)) for v in values]
        if [n for n, _ in now] != [n for n, _ in before]:
            findings.append((
                f"io-names:{kind}",
                f"{label}: the graph {kind}s are now {_names(n for n, _ in now)}, were "
                f"{_names(n for n, _ in before)}",
            ))
            continue
        for (name, elem), (_, was) in zip(now, before):
            if _io_type_changed(elem, was, baseline.keep_io_types):
                findings.append((
                    f"io-type:{name}",
                    f"{label}: graph {kind} {name!r} is now {_type_name(elem)}, was {_type_name(was)}",
                ))
    return findings


def _io_type_changed(elem: int | None, was: int | None, keep_io_types: bool) -> bool:
    """Whether a graph input's or output's element type changed in a way it must not: any change
    with `keep_io_types`, else any but FP32 to a 16-bit type (unknown types are not judged)."""
    if elem is None or was is None or elem == was:
        return False
    return keep_io_types or was != ir.DataType.FLOAT or ir.DataType(elem) not in _LOW


def _names(names: Iterable[str], count: int = 4) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:count])
    return f"[{shown}{', ...' if len(names) > count else ''}]"


# -- shapes against ONNX shape inference -----------------------------------------------------


def _shape_findings(model: ir.Model, scopes: list[_Scope], source: frozenset[str] | None) -> list[_Finding]:
    """Created values whose shape contradicts ONNX shape inference (another rank, or another
    size of a fixed dimension); skipped for models with external data or large weights."""
    shaped: dict[str, tuple[ir.Value, str]] = {}
    functions = {f.graph for f in model.functions.values()}
    for scope in scopes:
        if scope.graph in functions:
            continue
        for node in scope.graph:
            for value in node.outputs:
                if value.shape is not None and value.name and _created(value.name, source):
                    shaped[value.name] = (value, scope.label)
    if not shaped or uses_external_data(model) or weight_bytes(model) > INFER_MAX_WEIGHT_BYTES:
        return []
    inferred = _inferred_shapes(model, set(shaped))
    findings: list[_Finding] = []
    for name, dims in inferred.items():
        value, label = shaped[name]
        carried = list(value.shape.dims)  # type: ignore[union-attr]
        if shapes_contradict(carried, dims):
            producer = value.producer()
            source = f" (output of {_node(producer)})" if producer is not None else ""
            findings.append((
                f"shape:{name}",
                f"{label}: value {name!r}{source} carries shape {_dims(carried)} but ONNX shape "
                f"inference gives {_dims(dims)}",
            ))
    return findings


def _inferred_shapes(model: ir.Model, names: set[str]) -> dict[str, list[int | str | None]]:
    """The shapes ONNX shape inference gives the values named in `names` (those it infers,
    each named once in the model), from the graph alone: no declared intermediate shape."""
    try:
        proto = weight_free_proto(model)
        _forget_value_info(proto.graph)
        proto = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=False)
    except Exception:  # noqa: BLE001 - inference is best effort: nothing to compare then
        return {}
    shapes: dict[str, list[int | str | None]] = {}
    seen: set[str] = set()
    for graph in graph_protos(proto.graph):
        for info in graph.value_info:
            name = info.name
            if name not in names:
                continue
            if name in seen:
                shapes.pop(name, None)  # named in two graphs: not comparable by name
                continue
            seen.add(name)
            tensor = info.type.tensor_type if info.type.HasField("tensor_type") else None
            if tensor is not None and tensor.HasField("shape"):
                shapes[name] = [
                    d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
                ]
    return shapes


def _forget_value_info(graph: onnx.GraphProto) -> None:
    for current in graph_protos(graph):
        del current.value_info[:]


def _dims(dims: list) -> str:
    return "[" + ", ".join("?" if d is None else str(getattr(d, "value", d)) for d in dims) + "]"
