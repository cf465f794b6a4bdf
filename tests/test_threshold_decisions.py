"""Comparisons deciding at thresholds on the model's inputs (tree ensembles written as tensor
ops, as hummingbird's GEMM form writes them): the selection and the comparison stay FP32 where
the 16-bit type would move the thresholds, and every decision matches the FP32 model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from mixprec.analysis.threshold_decisions import threshold_decisions
from mixprec.dtypes import parse_low_precision
from mixprec.io import load_model
from mixprec.pipeline import steps

FEATURES, SPLITS, CLASSES = 6, 16, 3
THRESHOLD = "decides at thresholds"


def _trees(selector_scale: float = 1.0, threshold_shift: float = 0.0) -> onnx.ModelProto:
    """Decision nodes: each selects one feature of x (a one-hot row of `select`), compares it
    with its threshold (features near 1000, thresholds between them, as a tree learns), and
    the leaves' scores add up per class (a product by the 0/1 decisions)."""
    rng = np.random.default_rng(0)
    select = np.zeros((SPLITS, FEATURES), np.float32)
    select[np.arange(SPLITS), rng.integers(0, FEATURES, SPLITS)] = selector_scale
    thresholds = (1000 + rng.uniform(-3, 3, (SPLITS, 1)) + threshold_shift).astype(np.float32)
    leaves = rng.normal(0, 1, (CLASSES, SPLITS)).astype(np.float32)
    nodes = [
        helper.make_node("Gemm", ["select", "x"], ["picked"], transB=1),  # [SPLITS, n]
        helper.make_node("LessOrEqual", ["picked", "thresholds"], ["left"]),
        helper.make_node("Cast", ["left"], ["decisions"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["leaves", "decisions"], ["scores_t"]),  # [CLASSES, n]
        helper.make_node("Transpose", ["scores_t"], ["scores"], perm=[1, 0]),
        helper.make_node("ArgMax", ["scores"], ["label"], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "trees", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", FEATURES])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", CLASSES]),
         helper.make_tensor_value_info("label", TensorProto.INT64, ["n"])],
        [numpy_helper.from_array(select, "select"), numpy_helper.from_array(thresholds, "thresholds"),
         numpy_helper.from_array(leaves, "leaves")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _features(model: onnx.ModelProto) -> np.ndarray:
    """Features within a float16 step of the thresholds, where decisions are fine."""
    thresholds = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "thresholds"))
    rng = np.random.default_rng(1)
    return (np.repeat(thresholds.T, 40, axis=0)[:, :FEATURES] + rng.uniform(-0.4, 0.4, (40, FEATURES))).astype(np.float32)


def _run(path: Path | onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    data = path.SerializeToString() if isinstance(path, onnx.ModelProto) else str(path)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_decisions_at_thresholds_on_the_inputs_stay_exact(tmp_path: Path, target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gemm that selects the features and the comparison stay FP32; the leaves' product
    converts; every label matches FP32 on features within a step of the thresholds. Without the
    analysis the float16 conversion flips decisions there."""
    from mixprec.validate.emulate import emulate_low_precision  # noqa: PLC0415

    model = _trees()
    x = _features(model)
    expected_scores, expected_labels = _run(model, x)
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype=target, runtime="ort-cuda")
    kept = {k.op_type: k.category for k in result.report.kept_fp32}
    assert kept.get("Gemm") == THRESHOLD and kept.get("LessOrEqual") == THRESHOLD, kept
    assert result.report.low_by_op.get("MatMul") == 1
    scores, labels = _run(emulate_low_precision(onnx.load(str(tmp_path / "out.onnx"))), x)
    np.testing.assert_array_equal(labels, expected_labels)
    np.testing.assert_allclose(scores, expected_scores, atol=0.02 * np.abs(expected_scores).max())
    if target == "float16":
        monkeypatch.setattr(steps, "threshold_decisions", lambda model, target: {})
        mixprec.convert(model, tmp_path / "plain.onnx", target_dtype=target, runtime="ort-cuda")
        _, plain_labels = _run(emulate_low_precision(onnx.load(str(tmp_path / "plain.onnx"))), x)
        assert (plain_labels != expected_labels).any()


def test_only_selections_of_inputs_against_rounded_thresholds_are_kept() -> None:
    """A threshold the 16-bit type holds, or a product that scales rather than selects, is left
    to the other rules."""
    low = parse_low_precision("float16")

    def kept(model: onnx.ModelProto) -> list[str]:
        ir_model, _ = load_model(model)
        return sorted(node.op_type for node in threshold_decisions(ir_model, low))

    assert kept(_trees()) == ["Gemm", "LessOrEqual"]
    assert kept(_trees(selector_scale=2.0)) == []  # a scaled selection is arithmetic
    exact = _trees()
    for init in exact.graph.initializer:
        if init.name == "thresholds":
            init.CopyFrom(numpy_helper.from_array(np.round(numpy_helper.to_array(init)), "thresholds"))
    assert kept(exact) == []  # integers near 1000 are float16 values
