"""The graph picture's layout: constants folded into their consumers, layers top to bottom with
few crossings, Graphviz dot when it is there and the built-in layout when it is not."""

from __future__ import annotations

import dataclasses
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from mixprec.report import NodeGraph, render_html_report
from mixprec.report import layout as layout_module
from mixprec.report.layout import (
    BUILT_IN,
    DOT,
    FoldedGraph,
    GraphLayout,
    fold_constants,
    layout_graph,
)
from mixprec.report.layer_order import count_crossings

_HAS_DOT = shutil.which("dot") is not None
_NO_DOT = "no Graphviz dot (Debian: apt-get install -y graphviz)"
# The built-in layout, and Graphviz dot where it is installed.
_ENGINES = [False, pytest.param(True, marks=pytest.mark.skipif(not _HAS_DOT, reason=_NO_DOT))]


def _listing(
    op_types: list[str], inputs: list[list[int]], precision: str | None = None, **extra: object
) -> NodeGraph:
    n = len(op_types)
    return NodeGraph(
        [f"node{i}" for i in range(n)],
        op_types,
        precision or "l" * n,
        [0] * n,
        [0] * n,
        inputs,
        ["policy"],
        ["a reason"],
        **extra,  # type: ignore[arg-type]
    )


def _weights_model():
    """x @ reshape(Constant, Constant) + bias initializer, then Softmax (FP32 by policy)."""
    rng = np.random.default_rng(0)
    weights = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "w_flat_value")
    shape = numpy_helper.from_array(np.array([8, 8], np.int64), "w_shape_value")
    nodes = [
        helper.make_node("Constant", [], ["w_flat"], name="w_flat", value=weights),
        helper.make_node("Constant", [], ["w_shape"], name="w_shape", value=shape),
        helper.make_node("Reshape", ["w_flat", "w_shape"], ["w"], name="w_reshape"),
        helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
        helper.make_node("Add", ["h", "bias"], ["z"], name="add"),
        helper.make_node("Softmax", ["z"], ["y"], name="softmax", axis=-1),
    ]
    bias = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "bias")
    graph = helper.make_graph(
        nodes,
        "weights_in_constants",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        initializer=[bias],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _random_dag(n: int, seed: int = 0, back: int = 12) -> NodeGraph:
    rng = random.Random(seed)
    inputs = [
        sorted({rng.randrange(max(0, i - back), i) for _ in range(rng.randrange(1, 3))})
        if i
        else []
        for i in range(n)
    ]
    letters = "".join(rng.choice("llllfn") for _ in range(n))
    return _listing(["Add"] * n, inputs, letters)


def _crossings_drawn(layout: GraphLayout, folded: FoldedGraph) -> int:
    """Crossings between edges joining adjacent rows, read off the positions (one column)."""
    assert set(layout.column.values()) == {0}
    rows: dict[int, list[int]] = {}
    for i in folded.nodes:
        rows.setdefault(layout.rank[i], []).append(i)
    order = [sorted(rows[r], key=layout.x.__getitem__) for r in sorted(rows)]
    return count_crossings(order, folded.edges())


def test_node_graph_flags_constants_and_casts() -> None:
    result = mixprec.convert(_weights_model(), validate="none")
    graph = result.report.graph
    assert graph is not None
    index = {name: i for i, name in enumerate(graph.names)}
    # Constant nodes and the Reshape fed only by them compute only from constants.
    flagged = {name for name, c in zip(graph.names, graph.constant) if c == "1"}
    assert flagged == {"w_flat", "w_shape", "w_reshape"}
    assert graph.constant_inputs[index["matmul"]] == 1  # the reshaped weights
    assert graph.constant_inputs[index["add"]] == 1  # the bias initializer
    # The FP32 model input is cast into the 16-bit MatMul; a Cast sits before FP32 Softmax.
    assert graph.precision[index["matmul"]] == "l" and graph.precision[index["softmax"]] == "f"
    assert graph.cast_inputs[index["matmul"]] == [-1]
    assert graph.cast_inputs[index["softmax"]] == [index["add"]]
    # The JSON listing keeps its first fields and adds the new ones at the end.
    fields = [f.name for f in dataclasses.fields(NodeGraph)]
    assert fields[:8] == [
        "names", "op_types", "precision", "category", "reason", "inputs", "categories", "reasons"
    ]
    assert list(result.report.to_dict(include_graph=True)["graph"]) == fields


def test_constants_are_folded_into_their_consumers() -> None:
    constants = 40
    # 40 Constant nodes feeding a chain of 5 ops; one Reshape fed only by constants.
    ops = ["Constant"] * constants + ["Reshape"] + ["MatMul", "Add", "Softmax", "MatMul", "Add"]
    inputs: list[list[int]] = [[] for _ in range(constants)] + [[0, 1]]
    first = constants + 1
    for k in range(5):
        inputs.append([first + k - 1, 2 + k] if k else [constants, 2])
    flags = "1" * (constants + 1) + "0" * 5
    graph = _listing(ops, inputs, "n" * constants + "l" + "llfll", constant=flags)
    folded = fold_constants(graph)
    assert folded.nodes == list(range(first, first + 5))
    assert folded.constants == constants + 1
    assert folded.preds[first] == [] and folded.preds[first + 1] == [first]
    assert folded.folded[first] == 2  # Reshape and Constant 2, counted from the listing
    for use_dot in (False, True):
        layout = layout_graph(folded, use_dot=use_dot)
        assert set(layout.x) == set(folded.nodes)
    # The page draws five boxes, none a Constant, and says what was folded.
    report = mixprec.convert(_weights_model(), validate="none").report
    report.graph = graph
    page = render_html_report(report)
    svg = page[page.index('aria-label="graph nodes by precision"') :]
    svg = svg[: svg.index("</svg>")]
    assert len(re.findall(r'<rect [^>]*class="p[lfn]', svg)) == 5
    assert ">Constant<" not in svg
    assert "2 constant inputs (weights, shapes), not drawn" in svg
    assert f"{constants + 1} nodes that compute only from constants" in page


def test_listing_without_constant_flags_folds_constant_ops() -> None:
    graph = _listing(["Constant", "Constant", "MatMul", "Relu"], [[], [], [0, 1], [2]])
    folded = fold_constants(graph)
    assert folded.nodes == [2, 3] and folded.folded[2] == 2
    # Nothing but constants: drawn anyway.
    only = fold_constants(_listing(["Constant", "Identity"], [[], [0]], constant="11"))
    assert only.nodes == [0, 1] and only.preds[1] == [0]


@pytest.mark.parametrize("use_dot", _ENGINES)
@pytest.mark.parametrize("n", [30, 600])
def test_no_edge_goes_upward(use_dot: bool, n: int) -> None:
    folded = fold_constants(_random_dag(n, seed=n))
    layout = layout_graph(folded, use_dot=use_dot)
    assert layout.engine == (DOT if use_dot else BUILT_IN)
    assert layout.labelled == (n <= layout_module.LABELLED_MAX_NODES)
    assert len(layout.edges) == len(folded.edges())
    for p, i in folded.edges():
        assert layout.rank[p] < layout.rank[i]
        assert layout.column[p] <= layout.column[i]
        if layout.column[p] == layout.column[i]:
            assert layout.y[p] + layout.box_h <= layout.y[i]
    for i in folded.nodes:
        assert 0 <= layout.x[i] and layout.x[i] + layout.box_w <= layout.width + 1
        assert 0 <= layout.y[i] and layout.y[i] + layout.box_h <= layout.height + 1


def _ladders() -> NodeGraph:
    """Four chains of three whose middle and bottom layers are listed in shuffled order: drawn
    with each chain straight down, no edge crosses another."""
    ops = ["Relu"] * 12
    inputs: list[list[int]] = [[], [], [], []]
    inputs += [[3], [1], [0], [2]]  # layer 1: 4..7
    inputs += [[6], [4], [7], [5]]  # layer 2: 8..11
    return _listing(ops, inputs)


@pytest.mark.parametrize("use_dot", _ENGINES)
def test_crossings_on_a_known_graph(use_dot: bool) -> None:
    folded = fold_constants(_ladders())
    as_listed = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert count_crossings(as_listed, folded.edges()) == 7
    layout = layout_graph(folded, use_dot=use_dot)
    assert _crossings_drawn(layout, folded) == 0
    # A complete bipartite 2 x 2 graph cannot be drawn without one crossing.
    k22 = fold_constants(_listing(["Relu"] * 4, [[], [], [0, 1], [0, 1]]))
    assert _crossings_drawn(layout_graph(k22, use_dot=use_dot), k22) == 1


def test_builtin_ordering_reduces_crossings() -> None:
    folded = fold_constants(_random_dag(400, seed=3, back=4))
    layer = layout_module.longest_path_layers(folded)
    layers: list[list[int]] = [[] for _ in range(max(layer.values()) + 1)]
    for i in folded.nodes:
        layers[layer[i]].append(i)
    edges = folded.edges()
    before = count_crossings(layers, edges)
    after = count_crossings(layout_module.order_layers(layers, edges), edges)
    assert after < 0.7 * before, (before, after)


def test_builtin_layout_when_dot_is_not_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    folded = fold_constants(_ladders())
    layout = layout_graph(folded)
    assert layout.engine == BUILT_IN and layout.note == "graphviz dot not found"
    report = mixprec.convert(_weights_model(), validate="none").report
    assert "layout: built-in (graphviz dot not found)" in render_html_report(report)


@pytest.mark.skipif(not _HAS_DOT, reason=_NO_DOT)
def test_dot_layout_when_dot_is_on_path() -> None:
    report = mixprec.convert(_weights_model(), validate="none").report
    page = render_html_report(report)
    assert '<span id="graph-layout">layout: graphviz dot</span>' in page
    assert "graphviz" not in report.to_json() and "graphviz" not in report.format_text()


def _fake_dot(folder: Path, script: str) -> None:
    path = folder / "dot"
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)


@pytest.mark.parametrize(
    ("script", "note"),
    [
        ("echo 'Error: syntax error in line 1' >&2; exit 3", "graphviz dot failed: Error: syntax"),
        ("cat >/dev/null; echo 'graph 1 2'; echo stop", "graphviz dot gave unreadable output"),
        ("exec sleep 5", "graphviz dot took over 0.3 s"),
    ],
)
def test_builtin_layout_when_dot_fails(
    script: str, note: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_dot(tmp_path, script)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(layout_module, "DOT_TIMEOUT_S", 0.3)
    layout = layout_graph(fold_constants(_ladders()))
    assert layout.engine == BUILT_IN and layout.note.startswith(note), layout.note


def test_large_graphs_skip_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("dot must not run")

    monkeypatch.setattr(layout_module.subprocess, "run", refuse)
    monkeypatch.setattr(layout_module, "DOT_MAX_NODES", 10)
    layout = layout_graph(fold_constants(_ladders()))
    assert layout.engine == BUILT_IN and layout.note == "over 10 nodes for graphviz dot"
