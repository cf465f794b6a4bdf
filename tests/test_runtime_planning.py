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
