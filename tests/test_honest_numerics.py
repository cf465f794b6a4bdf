"""Numerics are checked on inputs the FP32 model accepts, or the report says they were not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import mixprec
from mixprec.cli import EXIT_UNCHECKED, main


def _save(graph: onnx.GraphProto, path: Path, opset: int = 17) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _windowed_model(path: Path) -> Path:
    """An audio-like front end: a 100-sample convolution window over a symbolic length, and a
    second input sharing the batch dimension."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(0, 0.1, (4, 1, 100)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["audio", "w"], ["frames"], strides=[10]),
        helper.make_node("ReduceMean", ["frames"], ["pooled"], axes=[2], keepdims=0),
        helper.make_node("MatMul", ["pooled", "proj"], ["y"]),
    ]
    proj = numpy_helper.from_array(rng.normal(0, 0.5, (4, 3)).astype(np.float32), "proj")
    graph = helper.make_graph(
        nodes, "windowed",
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", 1, "samples"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [weight, proj],
    )
    return _save(graph, path)


def _fixed_size_model(path: Path) -> Path:
    """A model that only runs on 35 samples: no generated size fits."""
    shape = numpy_helper.from_array(np.array([7, 5], dtype=np.int64), "shape")
    weight = numpy_helper.from_array(np.ones((5, 2), dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [7, 2])],
        [shape, weight],
    )
    return _save(graph, path)


def test_generated_inputs_grow_until_the_fp32_model_runs(tmp_path: Path) -> None:
    result = mixprec.convert(_windowed_model(tmp_path / "m.onnx"), tmp_path / "o.onnx", target_dtype="fp16")
    validation = result.report.validation
    assert validation.numerics.startswith("checked") and not validation.numerics_unchecked
    assert any("use 128 for symbolic dimensions" in n for n in validation.notes), validation.notes
    assert validation.outputs and validation.outputs[0].max_abs_error < 1e-2


def test_unchecked_numerics_are_said_in_text_json_and_exit_status(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    source = _fixed_size_model(tmp_path / "m.onnx")
    report = tmp_path / "r.json"
    code = main(["convert", str(source), str(tmp_path / "o.onnx"), "--report", str(report)])
    assert code == EXIT_UNCHECKED
    captured = capsys.readouterr()
    assert "numerics: not checked: the FP32 model fails on generated inputs" in captured.out
    assert captured.err.strip().endswith("pass --data")
    assert len(captured.err.strip().splitlines()) == 1
    data = json.loads(report.read_text())
    assert data["validation"]["numerics_unchecked"] is True
    assert (tmp_path / "o.onnx").is_file()  # the model itself is fine: written

    # With data the model fits, the check runs and the exit status is 0.
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(1).normal(size=35).astype(np.float32))
    assert main(["convert", str(source), str(tmp_path / "o2.onnx"), "--data", str(tmp_path / "d.npz")]) == 0
