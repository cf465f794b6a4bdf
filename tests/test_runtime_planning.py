"""A node converts only where the policy and the runtime profile both allow it."""

from __future__ import annotations

from pathlib import Path

import pytest

import mixprec
from test_opset_upgrade import _cnn  # tests/ is on sys.path via conftest.py


def _kept(result: mixprec.ConversionResult) -> dict[str, str]:
    return {k.name: k.reason for k in result.report.kept_fp32}


def test_cuda_profile_names_the_missing_kernel(tmp_path: Path) -> None:
    result = mixprec.convert(_cnn(tmp_path / "m.onnx"), None, target_dtype="bf16", validate="none", runtime="ort-cuda")
    assert result.report.low_by_op.get("Conv") == 1 and result.report.low_by_op.get("Gemm") == 1
    assert _kept(result)["pool"] == "no bfloat16 kernel for MaxPool(22) on CUDAExecutionProvider"
    assert result.report.fp32_by_category["runtime has no 16-bit kernel"] >= 1
    # The schema alone (or a runtime running every schema type) converts the pooling too.
    schema = mixprec.convert(_cnn(tmp_path / "m2.onnx"), None, target_dtype="bf16", validate="none", runtime="onnx")
    assert "pool" not in _kept(schema)


@pytest.mark.parametrize("opset", [11, 13])
def test_tensorrt_matrix_applies_at_every_opset_it_parses(tmp_path: Path, opset: int) -> None:
    result = mixprec.convert(_cnn(tmp_path / "m.onnx", opset), None, target_dtype="fp16", validate="none", runtime="tensorrt")
    assert result.report.low_by_op.get("Conv") == 1 and result.report.low_by_op.get("Gemm") == 1
    assert result.report.nodes_by_precision.get("fp32", 0) == 0


def test_cpu_profile_leaves_nothing_worth_converting_and_says_so(tmp_path: Path) -> None:
    result = mixprec.convert(_cnn(tmp_path / "m.onnx"), None, target_dtype="fp16", validate="none", runtime="ort-cpu")
    assert result.report.nodes_by_precision.get("low", 0) == 0
    assert _kept(result)["conv"] == "no float16 kernel for Conv(11) on CPUExecutionProvider"
    (note,) = [n for n in result.report.notes if "nothing worth converting" in n]
    assert "Conv, Gemm" in note and "--weights-only" in note


def test_unknown_runtime_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(mixprec.InputError, match="unknown runtime 'cuda'.*ort-cuda"):
        mixprec.convert(_cnn(tmp_path / "m.onnx"), None, runtime="cuda")


def test_a_model_in_16_bits_already_is_said_to_have_nothing_to_convert(tmp_path: Path) -> None:
    """A float16 model (as a converter or exporter writes it) is left as it is, and the report
    says why nothing converted; an FP32 model does not get that note."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    def model(elem: int, dtype: type) -> object:
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
            "g", [helper.make_tensor_value_info("x", elem, [2, 8])], [helper.make_tensor_value_info("y", elem, [2, 4])],
            [numpy_helper.from_array(np.ones((8, 4), dtype), "w")],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    half = model(TensorProto.FLOAT16, np.float16)
    result = mixprec.convert(half, tmp_path / "half.onnx", target_dtype="bfloat16", runtime="ort-cuda")
    assert result.report.nodes_by_precision == {"none": 2}
    assert any("computes in float16 already" in note and "nothing to convert" in note for note in result.report.notes)
    x = np.linspace(-1, 1, 16, dtype=np.float16).reshape(2, 8)
    ours = ort.InferenceSession(str(tmp_path / "half.onnx")).run(None, {"x": x})[0]
    theirs = ort.InferenceSession(half.SerializeToString()).run(None, {"x": x})[0]
    assert ours.dtype == np.float16 and np.array_equal(ours, theirs)

    full = mixprec.convert(model(TensorProto.FLOAT, np.float32), tmp_path / "full.onnx", target_dtype="float16")
    assert not any("already" in note for note in full.report.notes)
