"""Values of types the IR cannot hold (maps) and classical-ML ops, as scikit-learn's, LightGBM's
and XGBoost's exporters write them: a classifier's probabilities as a sequence of per-class maps
(ZipMap), a dictionary input (DictVectorizer). They come out as they went in, the model loads
and runs, and validation compares them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest
from onnx import TensorProto

import mixprec
from mixprec.io import value_types
from mixprec.runtime.sessions import as_array

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
_CLASSES = [3, 5, 7]


def _classifier(opset: int = 17) -> onnx.ModelProto:
    """A scikit-learn MLPClassifier as skl2onnx writes it: MatMul/Add/Relu layers, Softmax,
    ArgMax -> label through ArrayFeatureExtractor, ZipMap of the probabilities by class."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 32)).astype(np.float32) * 0.5
    w2 = rng.standard_normal((32, 3)).astype(np.float32) * 0.5
    inits = [
        onnx.numpy_helper.from_array(w1, "w1"), onnx.numpy_helper.from_array(np.zeros(32, np.float32), "b1"),
        onnx.numpy_helper.from_array(w2, "w2"), onnx.numpy_helper.from_array(np.full(3, 0.1, np.float32), "b2"),
        onnx.numpy_helper.from_array(np.array(_CLASSES, np.int64), "classes"),
    ]
    nodes = [
        oh.make_node("MatMul", ["X", "w1"], ["h0"]), oh.make_node("Add", ["h0", "b1"], ["h1"]),
        oh.make_node("Relu", ["h1"], ["h2"]), oh.make_node("MatMul", ["h2", "w2"], ["z0"]),
        oh.make_node("Add", ["z0", "b2"], ["z"]), oh.make_node("Softmax", ["z"], ["probabilities"], axis=1),
        oh.make_node("ArgMax", ["probabilities"], ["index"], axis=1),
        oh.make_node("ArrayFeatureExtractor", ["classes", "index"], ["picked"], domain="ai.onnx.ml"),
        oh.make_node("Reshape", ["picked", "flat"], ["output_label"]),
        oh.make_node("ZipMap", ["probabilities"], ["output_probability"], domain="ai.onnx.ml", classlabels_int64s=_CLASSES),
    ]
    inits.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "flat"))
    probability = onnx.ValueInfoProto(name="output_probability")
    probability.type.sequence_type.elem_type.map_type.key_type = I64
    probability.type.sequence_type.elem_type.map_type.value_type.tensor_type.elem_type = F32
    graph = oh.make_graph(
        nodes, "mlp", [oh.make_tensor_value_info("X", F32, ["N", 16])],
        [oh.make_tensor_value_info("output_label", I64, ["N"]), probability], inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset), oh.make_opsetid("ai.onnx.ml", 1)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _run(path: Path, x: np.ndarray) -> list:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"X": x})


@pytest.mark.parametrize(("target", "runtime"), [("float16", "ort-cuda"), ("bfloat16", "tensorrt"), ("float16", "onnx")])
def test_a_zipmap_classifier_converts_keeps_its_output_types_and_is_validated(
    tmp_path: Path, target: str, runtime: str
) -> None:
    source, out = tmp_path / "mlp.onnx", tmp_path / "out.onnx"
    onnx.save(_classifier(), str(source))
    result = mixprec.convert(source, out, target_dtype=target, runtime=runtime)
    converted = onnx.load(str(out))
    onnx.checker.check_model(converted, full_check=True)
    assert [o.SerializeToString() for o in converted.graph.output] == [o.SerializeToString() for o in _classifier().graph.output]
    assert result.report.low_by_op.get("MatMul") == 2
    assert {"ZipMap", "ArrayFeatureExtractor"} <= {n.op_type for n in converted.graph.node}
    validation = result.report.validation
    # onnxruntime's CPU provider runs the float16 model; a bfloat16 one is emulated
    assert validation.runtime == ("ran and emulated" if target == "float16" else "emulated")
    errors = {o.name: o for o in validation.outputs}
    assert errors["output_label"].max_abs_error == 0
    assert errors["output_probability"].max_abs_error < 0.02  # per-class probabilities compared
    x = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
    if target == "float16":  # onnxruntime's CPU provider runs float16 MatMul, not bfloat16
        labels, probabilities = _run(out, x)
        ref_labels, ref_probabilities = _run(source, x)
        assert np.mean(labels == ref_labels) >= 0.95
        assert [sorted(p) for p in probabilities] == [sorted(p) for p in ref_probabilities]
        assert max(abs(p[k] - r[k]) for p, r in zip(probabilities, ref_probabilities) for k in p) < 0.02


def test_a_modelproto_with_map_types_is_converted_without_being_changed(tmp_path: Path) -> None:
    model = _classifier()
    before = model.SerializeToString()
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda")
    assert model.SerializeToString() == before
    assert result.report.low_by_op.get("MatMul") == 2
    onnx.checker.check_model(str(tmp_path / "out.onnx"), full_check=True)


def test_a_map_input_is_kept_and_the_unchecked_numerics_are_said(tmp_path: Path) -> None:
    """DictVectorizer's map input: the model converts and loads; random data cannot be made
    for a map, and the report says the numerics were not checked."""
    feats = oh.make_tensor_value_info("feats", F32, None)
    feats.type.ClearField("tensor_type")
    feats.type.map_type.key_type = I64
    feats.type.map_type.value_type.tensor_type.elem_type = F32
    graph = oh.make_graph(
        [
            oh.make_node("DictVectorizer", ["feats"], ["dense"], domain="ai.onnx.ml", int64_vocabulary=[0, 1, 2, 3]),
            oh.make_node("MatMul", ["dense", "w"], ["y"]),
        ],
        "dv", [feats], [oh.make_tensor_value_info("y", F32, [1, 2])],
        [onnx.numpy_helper.from_array(np.ones((4, 2), np.float32), "w")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.ml", 1)])
    model.ir_version = 8
    source, out = tmp_path / "dv.onnx", tmp_path / "out.onnx"
    onnx.save(model, str(source))
    result = mixprec.convert(source, out, target_dtype="float16", runtime="ort-cuda")
    converted = onnx.load(str(out))
    assert converted.graph.input[0].SerializeToString() == model.graph.input[0].SerializeToString()
    onnx.checker.check_model(converted, full_check=True)
    assert "map" in str(result.report.validation.numerics) and "not checked" in str(result.report.validation.numerics)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"feats": {0: 1.0, 2: 3.0}})
    np.testing.assert_allclose(np.asarray(y, np.float32), [[4.0, 4.0]], rtol=1e-3)


def test_classical_ml_ops_are_bound_to_their_schemas(tmp_path: Path) -> None:
    """ai.onnx.ml ops are read through onnx's schemas: one a user lists as low precision still
    stays FP32 where its schema has no 16-bit type (Scaler), and the report names the schema."""
    graph = oh.make_graph(
        [oh.make_node("Scaler", ["x"], ["s"], domain="ai.onnx.ml", offset=[0.5], scale=[2.0]),
         oh.make_node("Relu", ["s"], ["y"])],
        "sc", [oh.make_tensor_value_info("x", F32, [2, 3])], [oh.make_tensor_value_info("y", F32, [2, 3])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("ai.onnx.ml", 1)])
    model.ir_version = 8
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", low_precision_ops=["ai.onnx.ml::Scaler"])
    kept = {k.op_type: k.reason for k in result.report.kept_fp32}
    assert "Scaler" in kept and "float16" in kept["Scaler"]
    onnx.checker.check_model(str(tmp_path / "out.onnx"), full_check=True)


def test_set_aside_types_come_back_by_name() -> None:
    proto = _classifier()
    original = proto.graph.output[1].type.SerializeToString()
    found = value_types.set_aside(proto)
    assert list(found) == ["output_probability"] and not proto.graph.output[1].HasField("type")
    assert not value_types.readable(onnx.TypeProto.FromString(original))
    assert value_types.restore(proto.graph, found)
    assert proto.graph.output[1].type.SerializeToString() == original
    assert not value_types.restore(proto.graph, found)  # typed already: left as it is


def test_outputs_of_every_type_become_arrays_that_compare() -> None:
    maps = [{7: 0.25, 3: 0.75}, {3: 0.5, 7: 0.5}]
    np.testing.assert_array_equal(as_array("p", maps), [[0.75, 0.25], [0.5, 0.5]])  # keys in order
    np.testing.assert_array_equal(as_array("s", [np.ones(2), np.zeros(2)]), [[1, 1], [0, 0]])
    np.testing.assert_array_equal(as_array("r", [np.ones(2), np.zeros(3)]), [1, 1, 0, 0, 0])
    assert as_array("e", []).size == 0 and as_array("o", None).size == 0
