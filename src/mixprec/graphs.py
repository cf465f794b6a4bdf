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
