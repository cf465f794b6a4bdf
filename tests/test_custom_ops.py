"""Ops of other domains keep their types, unless the user puts them in a class."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import mixprec


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(size=4).astype(np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="fc1"),
            helper.make_node("FastGelu", ["m", "b"], ["g"], domain="com.microsoft", name="gelu"),
            helper.make_node("MatMul", ["g", "w"], ["y"], name="fc2"),
        ],
        "custom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [w, b],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_custom_op_keeps_its_types_by_default(tmp_path: Path) -> None:
    model = _model()
    # Without a runtime kernel table a com.microsoft op is unknown: its types stay.
    result = mixprec.convert(model, tmp_path / "out.onnx", validate="run", runtime="onnx")
    kept = {k.name: k.category for k in result.report.kept_fp32}
    assert kept["gelu"] == "unknown op"
    converted = onnx.load(str(tmp_path / "out.onnx"))
    gelu = next(n for n in converted.graph.node if n.op_type == "FastGelu")
    initializers = {t.name: t.data_type for t in converted.graph.initializer}
    assert initializers[gelu.input[1]] == TensorProto.FLOAT  # its bias stays FP32
    # FastGelu's output type is known from ONNX Runtime's kernel binding (output = input type),
    # so fc2 after it still converts.
    assert result.report.low_by_op == {"MatMul": 2}
    x = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)
    onnx.save(model, str(tmp_path / "in.onnx"))
    np.testing.assert_allclose(_run(tmp_path / "out.onnx", x), _run(tmp_path / "in.onnx", x), atol=1e-2, rtol=1e-2)


def test_user_classified_custom_op_converts_with_its_float_tensors(tmp_path: Path) -> None:
    model = _model()
    out = tmp_path / "out.onnx"
    result = mixprec.convert(model, out, validate="run", low_precision_ops=["com.microsoft::FastGelu"])
    assert result.report.low_by_op == {"MatMul": 2, "FastGelu": 1}
    assert result.report.casts_runtime == 2  # model input down, model output up
    assert result.report.validation.runtime == "ran and emulated"
    converted = onnx.load(str(out))
    gelu = next(n for n in converted.graph.node if n.op_type == "FastGelu")
    initializers = {t.name: t.data_type for t in converted.graph.initializer}
    assert initializers[gelu.input[1]] == TensorProto.FLOAT16
    x = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)
    onnx.save(model, str(tmp_path / "in.onnx"))
    np.testing.assert_allclose(_run(out, x), _run(tmp_path / "in.onnx", x), atol=1e-2, rtol=1e-2)


def test_contrib_op_converts_where_the_runtime_has_its_16bit_kernel(tmp_path: Path) -> None:
    # ORT CUDA registers FastGelu for float16: the kernel table binds its inputs and output to
    # one type variable, so it converts like a schema op and its bias is stored in 16 bits.
    model = _model()
    result = mixprec.convert(model, tmp_path / "out.onnx", validate="run", runtime="ort-cuda")
    assert result.report.low_by_op.get("FastGelu") == 1
    assert result.report.low_by_op.get("MatMul") == 2  # fc2's input is typed through FastGelu
    converted = onnx.load(str(tmp_path / "out.onnx"))
    gelu = next(n for n in converted.graph.node if n.op_type == "FastGelu")
    initializers = {t.name: t.data_type for t in converted.graph.initializer}
    assert initializers[gelu.input[1]] == TensorProto.FLOAT16
    x = np.random.default_rng(1).normal(size=(2, 4)).astype(np.float32)
    onnx.save(model, str(tmp_path / "in.onnx"))
    np.testing.assert_allclose(_run(tmp_path / "out.onnx", x), _run(tmp_path / "in.onnx", x), atol=1e-2, rtol=1e-2)
    # The CPU provider has no float16 FastGelu: there it stays FP32, and says why.
    cpu = mixprec.convert(model, tmp_path / "cpu.onnx", validate="run", runtime="ort-cpu")
    kept = {k.name: k.reason for k in cpu.report.kept_fp32}
    assert "no float16 kernel for com.microsoft::FastGelu(1) on CPUExecutionProvider" in kept["gelu"]
