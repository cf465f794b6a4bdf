"""Graph traversal: subgraph owners are remembered per graph without keeping models alive, and
copies and structural changes are noticed; inferred shapes share their dimension symbols."""

from __future__ import annotations

import gc
import weakref

import onnx_ir as ir
from onnx import TensorProto
from onnx import helper as oh

from helpers import matmul_chain

from mixprec.graphs import all_graphs, all_nodes, forget_structure, graph_reads_ahead


def _model_with_if() -> ir.Model:
    then = oh.make_graph([oh.make_node("Identity", ["x"], ["t"])], "then", [], [oh.make_tensor_value_info("t", TensorProto.FLOAT, [1])])
    other = oh.make_graph([oh.make_node("Identity", ["x"], ["e"])], "else", [], [oh.make_tensor_value_info("e", TensorProto.FLOAT, [1])])
    graph = oh.make_graph(
        [oh.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1]), oh.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    return ir.serde.deserialize_model(oh.make_model(graph))


def test_remembered_owners_do_not_keep_a_model_alive() -> None:
    model = _model_with_if()
    assert len(all_graphs(model)) == 3
    ref = weakref.ref(model.graph)
    del model
    gc.collect()
    assert ref() is None


def test_a_clone_walks_its_own_subgraphs() -> None:
    model = _model_with_if()
    assert len(all_nodes(model)) == 3
    clone = model.clone()
    nodes = all_nodes(clone)
    assert len(nodes) == 3 and all(n.graph is not None and n not in all_nodes(model) for n in nodes)


def test_forget_structure_sees_control_flow_added_in_place() -> None:
    model = _model_with_if()
    plain = ir.serde.deserialize_model(oh.make_model(oh.make_graph(
        [oh.make_node("Identity", ["x"], ["y"], name="id")], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1]), oh.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )))
    assert len(all_nodes(plain)) == 1
    # Swap the Identity for the If: the node count stays 1.
    node = next(iter(model.graph))
    model.graph.remove(node)
    old = next(iter(plain.graph))
    plain.graph.insert_after(old, node)
    plain.graph.remove(old)
    forget_structure(plain)
    assert len(all_nodes(plain)) == 3


def test_weights_of_equal_dims_share_one_frozen_shape(tmp_path) -> None:  # noqa: ANN001 - pytest's tmp_path
    """A transformer's weights come in few shapes: the converted model's weights (their values
    and their lazy 16-bit tensors) share one frozen Shape per dims, and still save and run."""
    import numpy as np
    import onnxruntime as ort

    import mixprec

    rng = np.random.default_rng(0)
    source = matmul_chain(6, seed=0)
    result = mixprec.convert(source, tmp_path / "out.onnx", validate="checker")
    weights = list(result.model.graph.initializers.values())
    assert len(weights) == 6 and all(w.dtype == ir.DataType.FLOAT16 for w in weights)
    shapes = {id(w.shape) for w in weights} | {id(w.const_value.shape) for w in weights}
    assert len(shapes) == 1 and weights[0].shape.frozen and list(weights[0].shape) == [8, 8]
    feed = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
    expected = ort.InferenceSession(source.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


def test_inferred_shapes_share_their_dimension_symbols() -> None:
    """Inference names an unknown dimension once and passes the name on: the values that carry
    it share one SymbolicDim (not one per value), and equal shapes share one Shape."""
    from mixprec.analysis.typeinfo import infer_types

    graph = oh.make_graph(
        [
            oh.make_node("NonZero", ["x"], ["nz"]),
            oh.make_node("Transpose", ["nz"], ["t"], perm=[1, 0]),
            oh.make_node("Identity", ["t"], ["u"]),
            oh.make_node("Identity", ["u"], ["v"]),
        ],
        "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [oh.make_tensor_value_info("v", TensorProto.INT64, None)],
    )
    model = ir.serde.deserialize_model(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))
    infer_types(model)
    values = {v.name: v for node in model.graph for v in node.outputs}
    nz, t, u = values["nz"].shape, values["t"].shape, values["u"].shape
    assert nz is not None and t is not None and u is not None
    assert not isinstance(nz[1], int) and nz[1] is t[0]
    assert t is u


def _reshape_by_computed_shape() -> ir.Model:
    """x[batch, seq, 8] -> Reshape to [batch, seq, 2, 4], the target computed from x's Shape (as
    exporters write attention heads): only data propagation keeps batch and seq."""
    graph = oh.make_graph(
        [
            oh.make_node("Shape", ["x"], ["s"]),
            oh.make_node("Slice", ["s", "zero", "two"], ["lead"]),
            oh.make_node("Concat", ["lead", "heads"], ["target"], axis=0),
            oh.make_node("Reshape", ["x", "target"], ["y"]),
            oh.make_node("Relu", ["y"], ["z"]),
        ],
        "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8])],
        [oh.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [
            oh.make_tensor("zero", TensorProto.INT64, [1], [0]),
            oh.make_tensor("two", TensorProto.INT64, [1], [2]),
            oh.make_tensor("heads", TensorProto.INT64, [2], [2, 4]),
        ],
    )
    return ir.serde.deserialize_model(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))


def _dims(value: ir.Value) -> list[object]:
    assert value.shape is not None
    return [d if isinstance(d, int) else d.value for d in value.shape]


def test_shapes_computed_in_the_graph_keep_their_dimensions() -> None:
    """A Reshape whose target the graph computes from a Shape gets the named and static
    dimensions it computes, not a new unknown dimension per value."""
    from mixprec.analysis.typeinfo import infer_types

    model = _reshape_by_computed_shape()
    info = infer_types(model, strict_failure=lambda line: None)
    values = {v.name: v for node in model.graph for v in node.outputs}
    assert info.warning is None
    assert _dims(values["y"]) == ["batch", "seq", 2, 4]
    assert values["z"].shape is values["y"].shape  # equal shapes: one Shape


def test_inference_without_propagation_where_propagation_objects(monkeypatch) -> None:  # noqa: ANN001
    """Where data propagation raises, inference runs again without it (as the checker runs it):
    the types are still filled in and the strict check is not failed for it."""
    import onnx

    from mixprec.analysis import typeinfo

    real = onnx.shape_inference.infer_shapes
    calls: list[bool] = []

    def propagation_fails(model, check_type=False, strict_mode=False, data_prop=False):  # noqa: ANN001, ANN202, FBT002
        calls.append(data_prop)
        if data_prop:
            raise onnx.shape_inference.InferenceError("[ShapeInferenceError] propagation objects")
        return real(model, check_type=check_type, strict_mode=strict_mode, data_prop=False)

    monkeypatch.setattr(typeinfo.onnx.shape_inference, "infer_shapes", propagation_fails)
    failures: list[str] = []
    model = _reshape_by_computed_shape()
    info = typeinfo.infer_types(model, strict_failure=failures.append)
    values = {v.name: v for node in model.graph for v in node.outputs}
    assert calls == [True, False] and failures == [] and info.warning is None
    assert values["z"].dtype == ir.DataType.FLOAT
    assert len(_dims(values["y"])) == 4  # the rank only: nothing was propagated


def test_a_graph_reads_ahead_where_it_or_its_subgraphs_read_a_later_value() -> None:
    def model(main_order: list[int], branch_order: list[int]) -> ir.Model:
        branch_nodes = [oh.make_node("Mul", ["h", "h"], ["t"]), oh.make_node("Neg", ["t"], ["b"])]
        branch = oh.make_graph([branch_nodes[i] for i in branch_order], "then", [], [oh.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
        other = oh.make_graph([oh.make_node("Identity", ["x"], ["e"])], "else", [], [oh.make_tensor_value_info("e", TensorProto.FLOAT, [1])])
        nodes = [
            oh.make_node("Relu", ["x"], ["h"]),
            oh.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other),
        ]
        graph = oh.make_graph(
            [nodes[i] for i in main_order], "g",
            [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1]), oh.make_tensor_value_info("c", TensorProto.BOOL, [])],
            [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        )
        return ir.serde.deserialize_model(oh.make_model(graph))

    def ahead(m: ir.Model) -> tuple[bool, bool]:
        return graph_reads_ahead(m.graph), any(graph_reads_ahead(g) for g in all_graphs(m)[1:])

    assert ahead(model([0, 1], [0, 1])) == (False, False)
    assert ahead(model([1, 0], [0, 1])) == (True, False), "the branch reads h, produced after its If"
    assert ahead(model([0, 1], [1, 0])) == (False, True), "the branch's own nodes"
    unsorted = model([1, 0], [1, 0])
    unsorted.graph.sort()
    assert ahead(unsorted) == (False, False)
