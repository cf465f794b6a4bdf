"""Traversal of a model's graphs: the main graph, subgraphs of control-flow nodes, functions."""

from __future__ import annotations

import onnx_ir as ir

_GRAPH = ir.AttributeType.GRAPH
_GRAPHS = ir.AttributeType.GRAPHS


def subgraphs_of(node: ir.Node) -> list[ir.Graph]:
    """The graph attributes of a node."""
    graphs: list[ir.Graph] = []
    for attr in node.attributes.values():
        kind = attr.type
        if kind is _GRAPH:
            graphs.append(attr.as_graph())
        elif kind is _GRAPHS:
            graphs.extend(attr.as_graphs())
    return graphs


def has_subgraphs(node: ir.Node) -> bool:
    """Whether a node has graph attributes (control flow, ...)."""
    for attr in node.attributes.values():
        kind = attr.type
        if kind is _GRAPH or kind is _GRAPHS:
            return True
    return False


def walk_nodes(graph: ir.Graph | ir.Function) -> list[ir.Node]:
    """Nodes of `graph` and its subgraphs; a subgraph's nodes come before the node owning it."""
    nodes: list[ir.Node] = []
    _collect(graph, nodes)
    return nodes


def _collect(graph: ir.Graph | ir.Function, nodes: list[ir.Node]) -> None:
    for node in graph:
        if node.attributes and has_subgraphs(node):
            for sub in subgraphs_of(node):
                _collect(sub, nodes)
        nodes.append(node)


def all_graphs(model: ir.Model) -> list[ir.Graph]:
    """The main graph followed by every subgraph, at any depth."""
    graphs = [model.graph]
    index = 0
    while index < len(graphs):
        for node in graphs[index]:
            if node.attributes and has_subgraphs(node):
                graphs.extend(subgraphs_of(node))
        index += 1
    return graphs


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
