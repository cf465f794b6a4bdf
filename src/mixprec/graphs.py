"""Traversal of a model's graphs: the main graph, subgraphs of control-flow nodes."""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir

_GRAPH_ATTRS = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


def subgraphs_of(node: ir.Node) -> list[ir.Graph]:
    """The graph attributes of a node."""
    graphs: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs.append(attr.as_graph())
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs.extend(attr.as_graphs())
    return graphs


def walk_nodes(graph: ir.Graph | ir.Function) -> Iterator[ir.Node]:
    """Nodes of `graph` and its subgraphs; a subgraph's nodes come before the node owning it."""
    for node in graph:
        if node.attributes and any(a.type in _GRAPH_ATTRS for a in node.attributes.values()):
            for sub in subgraphs_of(node):
                yield from walk_nodes(sub)
        yield node


def all_graphs(model: ir.Model) -> list[ir.Graph]:
    """The main graph followed by every subgraph, at any depth."""
    graphs = [model.graph]
    for node in walk_nodes(model.graph):
        if node.attributes and any(a.type in _GRAPH_ATTRS for a in node.attributes.values()):
            graphs.extend(subgraphs_of(node))
    return graphs


def function_graphs(model: ir.Model) -> list[ir.Graph]:
    """The body graphs of the model-local functions."""
    return [function.graph for function in model.functions.values()]


def all_nodes(model: ir.Model) -> list[ir.Node]:
    """Every node: function bodies first, then the main graph (subgraphs before their owner)."""
    nodes: list[ir.Node] = []
    for graph in function_graphs(model):
        nodes.extend(walk_nodes(graph))
    nodes.extend(walk_nodes(model.graph))
    return nodes


def all_graphs_with_functions(model: ir.Model) -> list[ir.Graph]:
    """Every graph, function bodies and their subgraphs included."""
    graphs = all_graphs(model)
    for body in function_graphs(model):
        graphs.append(body)
        for node in walk_nodes(body):
            graphs.extend(subgraphs_of(node))
    return graphs
