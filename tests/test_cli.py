"""The command line: conversions, inspection, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mixprec.cli import main


def _mlp(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(0, 0.3, (8, 16)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.3, (16, 4)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="/encoder/fc1"),
            helper.make_node("Relu", ["h"], ["r"], name="/encoder/relu"),
            helper.make_node("MatMul", ["r", "w2"], ["l"], name="/decoder/fc2"),
            helper.make_node("Sigmoid", ["l"], ["y"], name="/decoder/sigmoid"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, str(path))
    return path


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_convert_writes_a_model_and_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _mlp(tmp_path / "m.onnx")
    out = tmp_path / "m.fp16.onnx"
    report = tmp_path / "r.json"
    code = main(["convert", str(source), str(out), "--to", "fp16", "--report", str(report),
                 "--exclude-node", "/decoder/.*", "--fp32-op", "Sigmoid"])
    assert code == 0
    text = capsys.readouterr().out
    assert "excluded by user" in text
    data = json.loads(report.read_text())
    kept = {k["name"]: k["category"] for k in data["kept_fp32"]}
    assert kept["/decoder/fc2"] == "excluded by user"
    assert data["low_by_op"] == {"MatMul": 1, "Relu": 1}
    x = np.random.default_rng(1).normal(size=(3, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _run(source, x), atol=1e-2, rtol=1e-2)
    assert data["validation"]["checker"] == "passed"


def test_inspect_shows_precisions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _mlp(tmp_path / "m.onnx")
    out = tmp_path / "m.fp16.onnx"
    assert main(["convert", str(source), str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["nodes_by_precision"] == {"fp16": 4}
    assert summary["casts"] == {"fp32->fp16": 1, "fp16->fp32": 1}


@pytest.mark.parametrize(
    ("make", "args", "code", "message"),
    [
        (None, ["missing.onnx"], 4, "no such file"),
        ("garbage", [], 4, "not an ONNX model"),
        ("truncated", [], 4, "m.onnx"),
        ("empty", [], 4, "empty"),
        ("model", ["--to", "fp8"], 2, "unknown target type"),
        ("model", ["--exclude-node", "/nothing/.*"], 2, "matches no node"),
        ("model", ["--fp32-op", "NotAnOp"], 2, "NotAnOp"),
        ("external", [], 4, "external data"),
    ],
)
def test_bad_input_gives_one_line_and_writes_nothing(
    tmp_path: Path, make: str | None, args: list[str], code: int, message: str
) -> None:
    source = tmp_path / "m.onnx"
    if make == "model":
        _mlp(source)
    elif make == "garbage":
        source.write_bytes(b"\x07this is not protobuf\xff" * 10)
    elif make == "truncated":
        _mlp(source)
        source.write_bytes(source.read_bytes()[:200])
    elif make == "empty":
        source.write_bytes(b"")
    elif make == "external":
        model = onnx.load(str(_mlp(source)))
        onnx.save(model, str(source), save_as_external_data=True, location="m.data", size_threshold=0)
        (tmp_path / "m.data").unlink()
    target = source if make else tmp_path / "missing.onnx"
    out = tmp_path / "out.onnx"
    cmd = [sys.executable, "-m", "mixprec", "convert", str(target), str(out), *[a for a in args if a != "missing.onnx"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_failed_validation_writes_nothing(tmp_path: Path) -> None:
    source = _mlp(tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec", "convert", str(source), str(out), "--tolerance", "0,0",
         "--validate", "run"],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 3, proc.stderr
    assert "differs from the FP32 model" in proc.stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_policy_show_lists_classes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "--to", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "MatMul" in text and "Softmax" in text and "conditional" in text


def test_policy_show_says_where_an_fp32_ops_condition_lets_it_follow(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "--to", "fp16", "--runtime", "ort-cuda"]) == 0
    lines = capsys.readouterr().out.splitlines()
    softmax = next(line for line in lines if line.strip().startswith("Softmax "))
    assert "[follows its inputs where between_quantizers" in softmax
    reduce_mean = next(line for line in lines if line.strip().startswith("ReduceMean "))
    assert "[reduced_size_at_most" in reduce_mean  # a conditional op converts where it holds
    mul = next(line for line in lines if line.strip().startswith("Mul "))
    assert "square" in mul and "[FP32 unless distinct_inputs" in mul  # a follow op, but not a square


def test_report_rewrite_keeps_the_file_mode(tmp_path: Path) -> None:
    """Writing a report again replaces it atomically without widening its permissions."""
    from mixprec.io import write_text_atomic  # noqa: PLC0415

    report = tmp_path / "report.json"
    report.write_text("{}")
    os.chmod(report, 0o600)
    write_text_atomic(report, '{"a": 1}')
    assert report.read_text() == '{"a": 1}' and (report.stat().st_mode & 0o777) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name != "report.json"]


@pytest.mark.parametrize("position", ["before", "after"])
def test_verbose_goes_before_or_after_the_command(tmp_path: Path, position: str, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The one-line error for an unexpected failure points at --verbose; the flag works after
    the command too, and then shows the traceback."""
    import mixprec.api  # noqa: PLC0415

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ZeroDivisionError("deep inside")

    monkeypatch.setattr(mixprec.api, "convert_with_config", broken)
    args = ["convert", str(_mlp(tmp_path / "m.onnx")), str(tmp_path / "o.onnx")]
    assert main(args) == 4
    assert "--verbose shows where" in capsys.readouterr().err
    assert main(["--verbose", *args] if position == "before" else [*args, "--verbose"]) == 4
    assert "Traceback" in capsys.readouterr().err
