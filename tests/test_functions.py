"""Model-local functions: bodies are typed from their call sites and converted inside."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest

import mixprec
from mixprec.validate.emulate import emulate_low_precision

MODEL = """
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
agraph (float[2,3] x) => (float[2,4] y, float[2,4] z) {
  w = Constant<value = float[3,4] {0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2}>()
  h = local.Linear(x, w)
  y = Softmax(h)
  z = local.Linear(x, w)
}
<domain: "local", opset_import: ["" : 18]>
Linear (a, b) => (c) {
  m = MatMul(a, b)
  c = Relu(m)
}
"""

POLYMORPHIC = """
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
agraph (float[2,2] x, double[2,2] d) => (float[2,2] y, double[2,2] e) {
  y = local.Square(x)
  e = local.Square(d)
}
<domain: "local", opset_import: ["" : 18]>
Square (a) => (c) {
  c = MatMul(a, a)
}
"""


def _run(path_or_proto, feeds):  # type: ignore[no-untyped-def]
    data = path_or_proto.SerializeToString() if isinstance(path_or_proto, onnx.ModelProto) else str(path_or_proto)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_function_body_converts_and_signature_stays(tmp_path: Path, target: str) -> None:
    model = onnx.parser.parse_model(MODEL)
    out = tmp_path / "out.onnx"
    result = mixprec.convert(model, out, target_dtype=target, validate="checker")
    converted = onnx.load(str(out))
    onnx.checker.check_model(converted, full_check=True)
    body = converted.functions[0]
    ops = [n.op_type for n in body.node]
    assert ops.count("Cast") == 3 and "MatMul" in ops
    assert result.report.low_by_op == {"MatMul": 1, "Relu": 1}
    kept = {k.op_type: k.category for k in result.report.kept_fp32}
    assert kept["Linear"] == "function call"
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    expected = _run(model, {"x": x})
    candidate = converted if target == "float16" else emulate_low_precision(converted)
    actual = _run(candidate, {"x": x})
    tol = 1e-2 if target == "float16" else 5e-2
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


def test_function_called_with_different_types_is_left_alone(tmp_path: Path) -> None:
    model = onnx.parser.parse_model(POLYMORPHIC)
    out = tmp_path / "out.onnx"
    result = mixprec.convert(model, out, validate="checker")
    converted = onnx.load(str(out))
    assert [n.op_type for n in converted.functions[0].node] == ["MatMul"]
    assert result.report.nodes_by_precision.get("low", 0) == 0
    x = np.eye(2, dtype=np.float32) * 3
    d = np.eye(2, dtype=np.float64) * 2
    y, e = _run(converted, {"x": x, "d": d})
    np.testing.assert_allclose(y, x @ x)
    np.testing.assert_allclose(e, d @ d)


ATTRIBUTED = """
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
agraph (float[2,3] x) => (float[2,4] y) {
  w = Constant<value = float[3,4] {0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2}>()
  y = local.Leaky(x, w)
}
<domain: "local", opset_import: ["" : 18]>
Leaky (a, b) => (c) {
  m = MatMul(a, b)
  c = LeakyRelu<alpha = 0.1>(m)
}
"""


def test_a_function_whose_body_has_attributes_is_typed_and_converted(tmp_path: Path) -> None:
    """Attributes in a body (not references to the caller's) leave the function typable."""
    model = onnx.parser.parse_model(ATTRIBUTED)
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda")
    converted = onnx.load(tmp_path / "out.onnx")
    body = [node.op_type for node in converted.functions[0].node]
    assert body == ["Cast", "Cast", "MatMul", "LeakyRelu", "Cast"], body  # MatMul, LeakyRelu in float16
    assert result.report.nodes_by_precision["low"] == 2
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}
    np.testing.assert_allclose(_run(converted, feeds)[0], _run(model, feeds)[0], rtol=1e-2, atol=1e-2)
