"""Locating the first node whose output becomes non-finite in a converted model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_calibration import attention_batch, attention_model, write_model

import mixprec
from mixprec.errors import ConversionError
from mixprec.validate.nan_origin import find_nan_origin


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The attention model and its plain (uncalibrated) float16 conversion."""
    folder = tmp_path_factory.mktemp("nan_origin")
    model = write_model(folder)
    out = folder / "plain.fp16.onnx"
    mixprec.convert(model, out, target_dtype="fp16")
    return model, out


@pytest.mark.parametrize(("emulate", "chunk"), [(True, 256), (True, 1), (False, 2)])
def test_origin_is_the_overflowing_matmul(
    plain: tuple[Path, Path], emulate: bool, chunk: int
) -> None:
    model, converted = plain
    origin = find_nan_origin(
        model,
        converted,
        attention_batch(1),
        target="fp16",
        emulate=emulate,
        max_outputs_per_run=chunk,
    )
    assert origin is not None
    assert (origin.node, origin.op_type, origin.output) == ("attn/scores", "MatMul", "scores")
    assert origin.dtype == "float16" and not origin.via_cast
    assert origin.fp32_absmax > 65504 and origin.new_nonfinite > 0
    inputs = dict(origin.inputs)
    assert set(inputs) == {"q", "kt"} and 50 < inputs["q"] < 1000 and inputs["q"] == inputs["kt"]
    text = origin.describe()
    assert "MatMul node 'attn/scores'" in text and "65504" in text and "'q' " in text


def test_no_origin_when_outputs_stay_finite(plain: tuple[Path, Path], tmp_path: Path) -> None:
    model, converted = plain
    small = {"x": attention_batch(1)["x"] / 30}
    assert find_nan_origin(model, converted, small, target="fp16") is None
    bf16 = tmp_path / "bf16.onnx"
    mixprec.convert(model, bf16, target_dtype="bf16")
    assert find_nan_origin(model, bf16, attention_batch(1), target="bf16") is None


def _exp_model() -> onnx.ModelProto:
    """Exp stays FP32 for float16 by policy; its output overflows the Cast to the MatMul."""
    w = numpy_helper.from_array(np.full((8, 4), 0.01, np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Exp", ["x"], ["e"], name="act/exp"),
            helper.make_node("MatMul", ["e", "w"], ["y"], name="proj"),
        ],
        "exp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_origin_through_an_inserted_cast(tmp_path: Path) -> None:
    model = tmp_path / "exp.onnx"
    onnx.save(_exp_model(), str(model))
    converted = tmp_path / "exp.fp16.onnx"
    result = mixprec.convert(model, converted, target_dtype="fp16")
    assert {k.name for k in result.report.kept_fp32} == {"act/exp"}
    x = np.zeros((2, 8), np.float32)
    x[1, 3] = 12.0  # exp(12) = 1.6e5 > 65504
    origin = find_nan_origin(model, converted, {"x": x}, target="fp16")
    assert origin is not None
    assert (origin.node, origin.op_type, origin.output, origin.via_cast) == (
        "act/exp",
        "Exp",
        "e",
        True,
    )
    assert origin.dtype == "float" and dict(origin.inputs) == {"x": 12.0}
    assert "becomes non-finite when cast to float16" in origin.describe()


def test_validation_note_names_the_origin(tmp_path: Path) -> None:
    model = write_model(tmp_path)
    data = tmp_path / "batch.npz"
    np.savez(data, **attention_batch(1))
    result = mixprec.convert(model, target_dtype="fp16", data=data, calibrate=False)
    notes = result.report.validation.notes
    assert result.report.validation.outputs[0].new_nonfinite > 0
    assert any(n.startswith("non-finite values start at MatMul node 'attn/scores'") for n in notes)
    assert "non-finite values start at" in result.report.format_text()
    with pytest.raises(ConversionError, match="attn/scores"):
        mixprec.convert(
            attention_model(),
            target_dtype="fp16",
            data=data,
            calibrate=False,
            tolerance=(1e-2, 1e-2),
        )
