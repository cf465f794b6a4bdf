"""Values floored below the 16-bit normal range before a logarithm or divisor compute in FP32
(`mixprec.analysis.small_floors`): a log-mel front end's mel energies, an epsilon-guarded
norm. Golden graphs, then a log-mel spectrogram (STFT, power, mel matrix, floor, log) run by
onnxruntime on speech with quiet frames."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from helpers import FLOAT, convert, run
from onnx import numpy_helper

from mixprec.plan.model import Category, Precision
from mixprec.validate.emulate import emulate_low_precision

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7: Kaldi's floor, below float16's 6.1e-5


def _model(nodes: list[onnx.NodeProto], inits: dict[str, np.ndarray], opset: int = 17) -> onnx.ModelProto:
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", FLOAT, [3, 16])], [oh.make_tensor_value_info("y", FLOAT, ["a", "b"])],
        [numpy_helper.from_array(np.asarray(a, np.float32), name) for name, a in inits.items()],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _weights() -> np.ndarray:
    return np.abs(np.random.default_rng(0).normal(size=(16, 8)))


def _decision(result, op_type: str):  # noqa: ANN001, ANN202
    return next(d for n, d in result.plan.decisions.items() if n.op_type == op_type)


def _floored_log(floor_op: str, floor: float, mover: bool = False) -> onnx.ModelProto:
    """x @ w, floored by `floor_op` at `floor` (through a Transpose pair where `mover`), then Log."""
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"])]
    inits: dict[str, np.ndarray] = {"w": _weights(), "floor": np.array(floor)}
    source = "h"
    if mover:
        nodes += [oh.make_node("Transpose", ["h"], ["t"], perm=[1, 0])]
        source = "t"
    if floor_op == "Clip":
        nodes.append(oh.make_node("Clip", [source, "floor"], ["f"]))
    else:
        nodes.append(oh.make_node(floor_op, [source, "floor"], ["f"]))
    nodes.append(oh.make_node("Log", ["f"], ["y"]))
    return _model(nodes, inits)


@pytest.mark.parametrize(("floor_op", "mover"), [("Clip", False), ("Max", True), ("Add", False)])
def test_a_value_floored_below_the_float16_normal_range_before_a_log_is_computed_in_fp32(floor_op: str, mover: bool) -> None:
    model = _floored_log(floor_op, EPS32 if floor_op != "Add" else 1e-10, mover)
    result, out = convert(model, target_dtype="float16")
    matmul = _decision(result, "MatMul")
    assert matmul.precision is Precision.FP32 and matmul.category is Category.CONSTANT_RANGE, matmul
    assert f"by {floor_op}" in matmul.reason and "normal range" in matmul.reason
    # Quiet inputs: the energies lie around 1e-6, subnormal in float16.
    x = np.random.default_rng(1).uniform(0, 1e-7, size=(3, 16)).astype(np.float32)
    np.testing.assert_allclose(run(emulate_low_precision(out), {"x": x})[0], run(model, {"x": x})[0], atol=1e-2)


def test_the_same_graph_in_16_bits_loses_the_quiet_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the rule the MatMul computes in float16 and the log of its quiet outputs is far
    off: what the test above checks is the rule's doing."""
    model = _floored_log("Clip", EPS32)
    monkeypatch.setattr("mixprec.pipeline.steps.small_floors", lambda model, target: {})
    result, out = convert(model, target_dtype="float16")
    assert _decision(result, "MatMul").precision is Precision.LOW
    x = np.random.default_rng(1).uniform(0, 1e-7, size=(3, 16)).astype(np.float32)
    error = np.abs(run(emulate_low_precision(out), {"x": x})[0] - run(model, {"x": x})[0]).max()
    assert error > 0.05


@pytest.mark.parametrize("case", ["bfloat16", "large floor", "no singular reader"])
def test_floors_within_the_normal_range_or_without_a_singular_reader_change_nothing(case: str) -> None:
    if case == "no singular reader":
        model = _model(
            [oh.make_node("MatMul", ["x", "w"], ["h"]), oh.make_node("Clip", ["h", "floor"], ["f"]),
             oh.make_node("Sqrt", ["f"], ["y"])],
            {"w": _weights(), "floor": np.array(EPS32)},
        )
    else:
        model = _floored_log("Clip", 1e-3 if case == "large floor" else EPS32)
    result, _ = convert(model, target_dtype="bfloat16" if case == "bfloat16" else "float16")
    assert _decision(result, "MatMul").precision is Precision.LOW


def test_a_divisor_and_an_attribute_floor_are_found() -> None:
    """`x / clip(x @ w, min=eps)` at opset 6, where Clip's bounds are attributes."""
    model = _model(
        [oh.make_node("MatMul", ["x", "w"], ["h"]), oh.make_node("Clip", ["h"], ["f"], min=EPS32, max=1e9),
         oh.make_node("ReduceSum", ["f"], ["s"], axes=[1], keepdims=1), oh.make_node("Div", ["x", "f"], ["y"])],
        {"w": np.abs(np.random.default_rng(0).normal(size=(16, 16)))}, opset=10,
    )
    result, _ = convert(model, target_dtype="float16")
    matmul = _decision(result, "MatMul")
    assert matmul.precision is Precision.FP32 and "Div" in matmul.reason and "1.19e-07" in matmul.reason


def _log_mel() -> onnx.ModelProto:
    """A log-mel spectrogram as onnx-asr's front ends write it: STFT (400-point Hann window,
    hop 160), power, a mel matrix, a floor of float32's epsilon, log."""
    rng = np.random.default_rng(2)
    window = np.hanning(400)
    mel = np.maximum(rng.uniform(-0.5, 1.0, size=(201, 40)), 0.0)
    nodes = [
        oh.make_node("Unsqueeze", ["x", "last"], ["signal"]),
        oh.make_node("STFT", ["signal", "hop", "window"], ["spectrum"], onesided=1),
        oh.make_node("ReduceSumSquare", ["spectrum"], ["power"], axes=[-1], keepdims=0),
        oh.make_node("MatMul", ["power", "mel"], ["energy"]),
        oh.make_node("Clip", ["energy", "floor"], ["floored"]),
        oh.make_node("Log", ["floored"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes, "log_mel", [oh.make_tensor_value_info("x", FLOAT, [1, 4000])],
        [oh.make_tensor_value_info("y", FLOAT, ["batch", "frames", 40])],
        [numpy_helper.from_array(np.asarray(window, np.float32), "window"),
         numpy_helper.from_array(np.asarray(mel, np.float32), "mel"),
         numpy_helper.from_array(np.array(EPS32, np.float32), "floor"),
         numpy_helper.from_array(np.array(160, np.int64), "hop"),
         numpy_helper.from_array(np.array([-1], np.int64), "last")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_log_mel_front_end_keeps_its_quiet_frames() -> None:
    model = _log_mel()
    result, out = convert(model, target_dtype="float16", runtime="ort-cuda")
    assert _decision(result, "MatMul").category is Category.CONSTANT_RANGE
    t = np.arange(4000) / 16000
    speech = 0.3 * np.sin(2 * np.pi * 220 * t) * (t > 0.125)  # a tone after 125 ms of near-silence
    speech += 1e-4 * np.random.default_rng(3).normal(size=t.size)
    x = speech.astype(np.float32)[None]
    got, expected = run(out, {"x": x})[0], run(model, {"x": x})[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, atol=1e-3)


@pytest.mark.parametrize(
    ("case", "forced"),
    [
        ("gem pooling", False),  # clamp(h, 1e-6) ** 3: a positive power is no singularity
        ("negative power", True),  # (h + 1e-6) ** -0.5
        ("selected", True),  # log(clip(where(h > lo, h, 0), lo)): the Where's data, not its condition
        ("scaled", True),  # log(2 * h + 1e-10): through a product with a constant
    ],
)
def test_the_walk_finds_the_node_that_computes_the_floored_value(case: str, forced: bool) -> None:
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"])]
    inits: dict[str, np.ndarray] = {"w": _weights()}
    if case == "gem pooling":
        nodes += [oh.make_node("Clip", ["h", "lo"], ["c"]), oh.make_node("Pow", ["c", "p"], ["y"])]
        inits |= {"lo": np.array(1e-6), "p": np.array(3.0)}
    elif case == "negative power":
        nodes += [oh.make_node("Add", ["h", "lo"], ["c"]), oh.make_node("Pow", ["c", "p"], ["y"])]
        inits |= {"lo": np.array(1e-6), "p": np.array(-0.5)}
    elif case == "selected":
        nodes += [oh.make_node("Greater", ["h", "lo"], ["m"]), oh.make_node("Where", ["m", "h", "zero"], ["s"]),
                  oh.make_node("Clip", ["s", "lo"], ["c"]), oh.make_node("Log", ["c"], ["y"])]
        inits |= {"lo": np.array(EPS32), "zero": np.array(0.0)}
    else:
        nodes += [oh.make_node("Mul", ["h", "two"], ["s"]), oh.make_node("Add", ["s", "lo"], ["c"]),
                  oh.make_node("Log", ["c"], ["y"])]
        inits |= {"lo": np.array(1e-10), "two": np.array(2.0)}
    result, _ = convert(_model(nodes, inits), target_dtype="float16")
    matmul = _decision(result, "MatMul")
    assert (matmul.precision is Precision.FP32) == forced, matmul
    if forced:
        assert matmul.category is Category.CONSTANT_RANGE
    else:  # the bound guards nothing singular either: the Clip converts with its flushed bound
        assert _decision(result, "Clip").precision is Precision.LOW
