"""Traversal of a model's graphs (the main graph, subgraphs of control-flow nodes, functions),
the stable node keys that plan files, reports and the accuracy search share, and op names (the
default ONNX domain, ``domain::Op``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

_GRAPH = ir.AttributeType.GRAPH
_GRAPHS = ir.AttributeType.GRAPHS


def _attributes(node: ir.Node):  # noqa: ANN202 - a dict view of ir.Attr
    """The node's attributes (the plain dict under the IR's mapping: traversals of 100k-node
    graphs spend most of their time in the mapping's generic iteration otherwise)."""
    attributes = node.attributes
    return attributes.data.values() if hasattr(attributes, "data") else attributes.values()


def subgraphs_of(node: ir.Node) -> list[ir.Graph]:
    """The graph attributes of a node."""
    graphs: list[ir.Graph] = []
    for attr in _attributes(node):
        kind = attr.type
        if kind is _GRAPH:
            graphs.append(attr.as_graph())
        elif kind is _GRAPHS:
            graphs.extend(attr.as_graphs())
    return graphs


def has_subgraphs(node: ir.Node) -> bool:
    """Whether a node has graph attributes (control flow, ...)."""
    for attr in _attributes(node):
        kind = attr.type
        if kind is _GRAPH or kind is _GRAPHS:
            return True
    return False


# Per graph (in its `meta`, so it lives and dies with the graph): its node count when last
# scanned and its nodes that own subgraphs. Traversals run many times per conversion and a
# node's attribute scan is most of their cost; the passes add and remove plain nodes (Casts,
# fused normalizations) but never control flow, so a graph is rescanned only when its node
# count changed (and after `forget_structure`).
_OWNERS_KEY = "mixprec.subgraph_owners"


def subgraph_owners(graph: ir.Graph | ir.Function) -> frozenset[ir.Node]:
    """The nodes of `graph` (not of its subgraphs) that own subgraphs."""
    size = len(graph)
    meta = graph.meta
    cached = meta.get(_OWNERS_KEY)
    # A copied graph (Model.clone copies `meta`) holds other nodes: those must be its own.
    if cached is not None and cached[0] == size and all(owner.graph is graph for owner in cached[1]):
        return cached[1]
    owners = frozenset(node for node in graph if node.attributes and has_subgraphs(node))
    meta[_OWNERS_KEY] = (size, owners)
    return owners


def keep_structure(graph: ir.Graph | ir.Function) -> None:
    """Let the subgraph owners of `graph` that its last traversal remembered stand although its
    node count changed: call after a pass that traversed it (:func:`all_graphs`,
    :func:`walk_nodes`, ...) and since then only added or removed nodes without subgraphs (the
    next traversal does not scan it again)."""
    cached = graph.meta.get(_OWNERS_KEY)
    if cached is not None:
        graph.meta[_OWNERS_KEY] = (len(graph), cached[1])


def forget_structure(model: ir.Model) -> None:
    """Forget the remembered subgraph owners of every graph of `model`: call after a pass that
    may add control flow while keeping a graph's node count (inlining a one-node function body,
    say)."""
    functions = list(model.functions.values())
    graphs: list[ir.Graph | ir.Function] = [model.graph, *functions, *(f.graph for f in functions)]
    while graphs:
        graph = graphs.pop()
        graph.meta.pop(_OWNERS_KEY, None)
        for node in graph:
            if node.attributes:
                graphs.extend(subgraphs_of(node))


def walk_nodes(graph: ir.Graph | ir.Function) -> list[ir.Node]:
    """Nodes of `graph` and its subgraphs; a subgraph's nodes come before the node owning it."""
    nodes: list[ir.Node] = []
    _collect(graph, nodes)
    return nodes


def _collect(graph: ir.Graph | ir.Function, nodes: list[ir.Node]) -> None:
    owners = subgraph_owners(graph)
    if not owners:
        nodes.extend(graph)
        return
    for node in graph:
        if node in owners:
            for sub in subgraphs_of(node):
                _collect(sub, nodes)
        nodes.append(node)


def all_graphs(model: ir.Model) -> list[ir.Graph]:
    """The main graph followed by every subgraph, at any depth."""
    graphs = [model.graph]
    index = 0
    while index < len(graphs):
        graph = graphs[index]
        owners = subgraph_owners(graph)
        if owners:
            graphs.extend(sub for node in graph if node in owners for sub in subgraphs_of(node))
        index += 1
    return graphs


def graph_reads_ahead(graph: ir.Graph) -> bool:
    """Whether a node of `graph`, or a node inside one of its subgraphs, reads a value a later
    node of `graph` produces (the nodes are not in topological order)."""
    pending = set(graph)  # the graph's nodes that have not run yet
    for node in graph:
        inner = [n for sub in subgraphs_of(node) for n in walk_nodes(sub)] if node.attributes else []
        for reader in (node, *inner):
            for value in reader.inputs:
                producer = value.producer() if value is not None else None
                if producer is not None and producer in pending:
                    return True
        pending.discard(node)
    return False


def main_values(model: ir.Model) -> Iterator[ir.Value]:
    """The main graph's inputs, then every main-graph node's outputs."""
    graph = model.graph
    yield from graph.inputs
    for node in graph:
        yield from node.outputs


def function_graphs(model: ir.Model) -> list[ir.Graph]:
    """The body graphs of the model-local functions."""
    return [function.graph for function in model.functions.values()]


def all_nodes(model: ir.Model) -> list[ir.Node]:
    """Every node: function bodies first, then the main graph (subgraphs before their owner)."""
    nodes: list[ir.Node] = []
    for graph in function_graphs(model):
        _collect(graph, nodes)
    _collect(model.graph, nodes)
    return nodes


def unique_names(nodes: Iterable[ir.Node]) -> dict[ir.Node, str]:
    """Unique, deterministic names of `nodes`, in the order given.

    A node keeps its own name when no earlier node has it; otherwise (unnamed or duplicate) it
    gets ``<op_type>#<index>`` (plus ``_<n>`` in the unlikely case that is taken too).
    """
    nodes = list(nodes)
    own = {node.name for node in nodes if node.name}
    taken: set[str] = set()
    names: dict[ir.Node, str] = {}
    for index, node in enumerate(nodes):
        name = node.name or ""
        if not name or name in taken:
            base = f"{node.op_type}#{index}"
            name, counter = base, 1
            while name in taken or name in own:
                name = f"{base}_{counter}"
                counter += 1
        taken.add(name)
        names[node] = name
    return names


def node_keys(model: ir.Model) -> dict[ir.Node, str]:
    """The stable key of every node of `model` (in :func:`all_nodes` order): its name, or
    ``<op_type>#<index>`` when it has none or an earlier node took it. A copy of the model
    (``model.clone()``) and the same file loaded again give every node the same key."""
    return unique_names(all_nodes(model))


# -- op names --------------------------------------------------------------------------------

# The default ONNX domain is written "" or "ai.onnx"; mixprec names it "".
DEFAULT_DOMAIN = ""
_DEFAULT_DOMAIN_NAMES = frozenset({"", "ai.onnx"})


def is_default_domain(domain: str) -> bool:
    """Whether `domain` names the default ONNX domain ("" or "ai.onnx")."""
    return domain in _DEFAULT_DOMAIN_NAMES


def normalize_domain(domain: str) -> str:
    """Map `ai.onnx` to the empty default domain."""
    return DEFAULT_DOMAIN if domain in _DEFAULT_DOMAIN_NAMES else domain


def default_domain_version(opset_imports: Mapping[str, int]) -> int | None:
    """The default domain's version in an opset import table (under either name), else None."""
    version = opset_imports.get(DEFAULT_DOMAIN)
    return opset_imports.get("ai.onnx") if version is None else version


def parse_op_name(name: str) -> tuple[str, str]:
    """Split `Op` or `domain::Op` into (domain, op_type)."""
    if "::" in name:
        domain, op_type = name.rsplit("::", 1)
        return normalize_domain(domain), op_type
    return DEFAULT_DOMAIN, name


def format_op_name(domain: str, op_type: str) -> str:
    """Inverse of :func:`parse_op_name`."""
    return op_type if is_default_domain(domain) else f"{domain}::{op_type}"


@functools.lru_cache(maxsize=1 << 14)
def static_shape(dims: tuple[int, ...]) -> ir.Shape:
    """One frozen Shape per static dims, shared: a graph's weights come in few shapes (a
    Shape is ~0.26 kB, and a transformer of 100k nodes holds 43k weights of 5 shapes)."""
    return ir.Shape(dims, frozen=True)


def shapes_contradict(a: Sequence[object], b: Sequence[object]) -> bool:
    """Whether two shapes (their dimensions) cannot describe the same tensor: another rank, or
    two different fixed sizes of one dimension (symbolic and unknown ones agree with anything)."""
    if len(a) != len(b):
        return True
    return any(isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(a, b))


class FreshNames:
    """Names not taken yet in one namespace (value names or node names of a model): `base` when
    it is free, else `base_1`, `base_2`, ... Every name it gives is taken from then on."""

    def __init__(self, taken: Iterable[str] = ()) -> None:
        self.taken = set(taken)
        self._next: dict[str, int] = {}  # base -> the first suffix that may be free

    def __call__(self, base: str) -> str:
        name, counter = base, self._next.get(base, 1)
        if name in self.taken:
            name = f"{base}_{counter}"
            while name in self.taken:
                counter += 1
                name = f"{base}_{counter}"
            self._next[base] = counter + 1
        self.taken.add(name)
        return name

    def __contains__(self, name: str) -> bool:
        return name in self.taken


def model_names(model: ir.Model) -> tuple[FreshNames, FreshNames]:
    """Fresh value names and fresh node names for `model` (all graphs and function bodies)."""
    values: set[str | None] = set()
    nodes: set[str | None] = set()
    for graph in (*all_graphs(model), *function_graphs(model)):
        values.update([v.name for v in (*graph.inputs, *graph.outputs) if v is not None])
        values.update(graph.initializers)
        graph_nodes = list(graph)
        nodes.update([node.name for node in graph_nodes])
        values.update([v.name for node in graph_nodes for v in node.outputs])
    return FreshNames(filter(None, values)), FreshNames(filter(None, nodes))  # unnamed ones aside


def reduction_axes(node: ir.Node, constant: Callable[[ir.Value], np.ndarray | None]) -> list[int] | None:
    """The axes of a Reduce* node: its `axes` attribute (before opset 18) or its constant input
    (read by `constant`); [] when it names none; None when the input is not a constant."""
    attr = node.attributes.get("axes")
    if attr is not None:
        return list(attr.as_ints())
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return []
    array = constant(node.inputs[1])
    return None if array is None else [int(a) for a in np.asarray(array).reshape(-1)]


def graph_protos(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """A protobuf graph and its subgraphs, at any depth."""
    graphs = [graph]
    for current in graphs:
        for node in current.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    graphs.append(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    graphs.extend(attr.graphs)
    return graphs
