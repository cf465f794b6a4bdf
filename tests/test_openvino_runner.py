"""OpenVINO's CPU plugin runs mixprec's bfloat16 models with real bfloat16 arithmetic.

Tolerance: bfloat16 keeps 8 significant bits (unit roundoff 2**-9, about 0.2%). The demo
CNN rounds through bfloat16 after each of about ten ops, with fp32 accumulation inside
Conv/Gemm, so its logits are expected within a few tenths of a percent of their scale;
the tests allow 3% of the largest FP32 logit (observed: about 0.6%) and 0.01 absolute on
the softmax probabilities. A bit-exact match would mean no bfloat16 math happened.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest

import mixprec
from helpers import bf16_arithmetic_missing
from mixprec.demo_models import DEMO_MODELS
from mixprec.runtime.openvino import OpenVinoSession, openvino_available

if not openvino_available():
    pytest.skip("openvino is not installed", allow_module_level=True)

# Tests that assert real bfloat16 arithmetic (results that differ from FP32, bf16 kernels).
_BF16_MISSING = bf16_arithmetic_missing()
real_bf16 = pytest.mark.skipif(_BF16_MISSING is not None, reason=_BF16_MISSING or "")

LOGIT_RTOL = 0.03  # of the largest |FP32 logit|
PROB_ATOL = 0.01


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ov")
    fp32 = root / "cnn_fp32.onnx"
    onnx.save(DEMO_MODELS["cnn"](), str(fp32))
    paths = {"fp32": fp32, "bf16": root / "cnn_bf16.onnx", "bf16_io": root / "cnn_bf16_io.onnx"}
    # The OpenVINO profile runs every schema type; bfloat16 Conv upgrades the CNN to opset 22.
    mixprec.convert(fp32, paths["bf16"], target_dtype="bf16", validate="none", runtime="openvino")
    mixprec.convert(
        fp32, paths["bf16_io"], target_dtype="bf16", validate="none", runtime="openvino", keep_io_types=False
    )
    return paths


@pytest.fixture(scope="module")
def images() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"image": rng.uniform(0.0, 1.0, (8, 3, 32, 32)).astype(np.float32)}


def _assert_close_not_equal(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> None:
    assert list(got) == ["logits", "probs"]
    assert all(v.dtype == np.float32 for v in got.values())
    scale = float(np.abs(ref["logits"]).max())
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=LOGIT_RTOL * scale)
    np.testing.assert_allclose(got["probs"], ref["probs"], rtol=0, atol=PROB_ATOL)
    assert np.abs(got["logits"] - ref["logits"]).max() > 0, "bf16 run is bit-identical to FP32"


@real_bf16
def test_bf16_model_runs_in_bf16_and_stays_close(models: dict[str, Path], images: dict) -> None:
    fp32 = OpenVinoSession(models["fp32"], precision="f32")
    assert fp32.inference_precision == "f32"
    assert all(prec == "f32" for _, prec in fp32.executed_precisions())
    ref = fp32.run(images)

    bf16 = OpenVinoSession(models["bf16"], precision="model")
    executed = bf16.executed_precisions()
    assert executed[("Convolution", "bf16")] == 2, executed
    assert executed[("FullyConnected", "bf16")] == 1, executed
    _assert_close_not_equal(bf16.run(images), ref)


@real_bf16
def test_f32_hint_matters_for_fp32_model(models: dict[str, Path], images: dict) -> None:
    ref = OpenVinoSession(models["fp32"], precision="f32").run(images)
    auto = OpenVinoSession(models["fp32"], precision="bf16")
    if auto.inference_precision != "bf16":
        pytest.skip("this CPU has no bfloat16 support")
    assert ("Convolution", "bf16") in auto.executed_precisions()
    _assert_close_not_equal(auto.run(images), ref)


@real_bf16
def test_bf16_inputs_take_float32_data(models: dict[str, Path], images: dict) -> None:
    # OpenVINO's own numpy path would read float32 data as float16 bit patterns.
    ref = OpenVinoSession(models["fp32"], precision="f32").run(images)
    session = OpenVinoSession(models["bf16_io"], precision="model")
    _assert_close_not_equal(session.run(images), ref)
    assert session.latency(images, warmup=1, repeat=3) > 0


def test_unreadable_model_raises_validation_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not an onnx model")
    with pytest.raises(mixprec.ValidationError, match="junk.onnx") as info:
        OpenVinoSession(junk)
    assert "\n" not in str(info.value)


def test_unsupported_op_raises_validation_error(tmp_path: Path) -> None:
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Frobnicate", ["x"], ["y"], domain="example.custom")],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])],
    )
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("example.custom", 1)]
    path = tmp_path / "custom.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=opsets), str(path))
    with pytest.raises(mixprec.ValidationError, match="custom.onnx.*Frobnicate"):
        OpenVinoSession(path)


def test_bad_precision_is_an_input_error(models: dict[str, Path]) -> None:
    with pytest.raises(mixprec.InputError, match="precision"):
        OpenVinoSession(models["fp32"], precision="fp8")


def test_validation_runs_the_model_on_openvino_and_says_what_it_executed(models: dict[str, Path], tmp_path: Path) -> None:
    result = mixprec.convert(models["fp32"], tmp_path / "o.onnx", target_dtype="bf16", runtime="openvino")
    v = result.report.validation
    assert v.real_runtime is not None and v.real_runtime.startswith("OpenVINO CPU")
    assert [o.name for o in v.real_outputs] == ["logits", "probs"]
    assert all(o.new_nonfinite == 0 for o in v.real_outputs)
    assert v.real_outputs[0].max_abs_error < 0.1
    if _BF16_MISSING is None:  # real bfloat16 arithmetic, close to FP32
        assert v.real_executed == "matrix/convolution layers ran in bf16: 3"
        assert v.real_outputs[0].max_abs_error > 0
    else:  # where OpenVINO computed in f32, the report says the real run did not check bfloat16
        assert "ran in bf16" in (v.real_executed or "") or any("not bfloat16 arithmetic" in note for note in v.notes)
    assert v.speed_ratio is not None and v.speed_ratio > 0
    assert "for real on OpenVINO" in v.numerics
    assert "latency on OpenVINO" in result.report.format_text()


def test_tune_evaluates_candidates_on_openvino(models: dict[str, Path], images: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from mixprec.tune import Tolerance, tune  # noqa: PLC0415
    from mixprec.runtime import openvino as openvino_runner  # noqa: PLC0415

    built: list[str] = []
    original = openvino_runner.OpenVinoSession.__init__

    def counting(self, path, **kwargs):  # type: ignore[no-untyped-def]
        built.append(kwargs.get("precision", "model"))
        original(self, path, **kwargs)

    monkeypatch.setattr(openvino_runner.OpenVinoSession, "__init__", counting)
    result = tune(
        models["fp32"], [images], target_dtype="bf16", tolerance=Tolerance(min_cosine=0.999), runtime="openvino"
    )
    assert result.met
    assert len(built) == result.evaluations and set(built) == {"model"}


def test_openvino_profile_keeps_batchnorm_types_uniform(models: dict[str, Path], tmp_path: Path) -> None:
    # The demo CNN's 1e8 running variance stays FP32 in float16; OpenVINO rejects a
    # BatchNormalization with mixed input types, so on its profile the whole node stays FP32.
    result = mixprec.convert(models["fp32"], tmp_path / "fp16.onnx", target_dtype="fp16", runtime="openvino")
    kept = {k.name: k.reason for k in result.report.kept_fp32}
    assert kept["block1/BatchNormalization"].startswith("openvino needs one element type")
    assert [o.name for o in result.report.validation.real_outputs] == ["logits", "probs"]
    # The schema alone would mix them (legal ONNX since opset 15) and OpenVINO could not read it.
    mixed = mixprec.convert(models["fp32"], tmp_path / "mixed.onnx", target_dtype="fp16", runtime="onnx", validate="none")
    assert "block1/BatchNormalization" not in {k.name for k in mixed.report.kept_fp32}
    with pytest.raises(mixprec.ValidationError, match="element types do not match"):
        OpenVinoSession(tmp_path / "mixed.onnx", precision="model")


def test_a_quantized_model_only_the_accuracy_mode_cannot_compile_is_checked_with_default_options(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # OpenVINO 2026.4 fails to compile some float16 QDQ models in their own element types
    # (EXECUTION_MODE_HINT=ACCURACY: its FakeQuantize decomposition mixes f32 and f16 constants,
    # seen on pipecat's INT8 Smart Turn) and compiles them with its default options, as users
    # do. A failing compilation in that mode stands in here for the one of that model.
    from mixprec.errors import RunError, ValidationFailure
    from mixprec.runtime import openvino as runner
    from test_qdq_fold import qdq_conv

    real = runner.OpenVinoSession.__init__

    def accuracy_mode_fails(self, model_path, *, precision="model", num_threads=None):  # type: ignore[no-untyped-def]
        if precision == "model":  # only the converted model is compiled so; the FP32 one at f32
            raise RunError(f"OpenVINO cannot compile {model_path}: Arguments do not have the same element type.")
        real(self, model_path, precision=precision, num_threads=num_threads)

    monkeypatch.setattr(runner.OpenVinoSession, "__init__", accuracy_mode_fails)
    source = tmp_path / "qdq.onnx"
    onnx.save(qdq_conv(), str(source))
    result = mixprec.convert(source, tmp_path / "converted.onnx", target_dtype="fp16", runtime="openvino")
    v = result.report.validation
    assert v.real_runtime == "OpenVINO CPU (default options)" and [o.name for o in v.real_outputs] == ["y"]
    note = next(n for n in v.notes if "EXECUTION_MODE_HINT=ACCURACY" in n)
    assert "compiles the converted model with its default options" in note and "same element type)" in note
    # A model without Q/DQ nodes gets no such second try: the repair searches for the nodes to
    # keep FP32, and the failure stands when even all of them FP32 fail.
    with pytest.raises(ValidationFailure, match="fails on OpenVINO's CPU plugin.*even with every converted node FP32"):
        mixprec.convert(models["fp32"], tmp_path / "cnn.onnx", target_dtype="bf16", runtime="openvino")


def test_a_model_that_crashes_openvino_is_a_one_line_error_not_a_crash(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenVINO's ONNX frontend can kill the process reading a graph it mishandles (onnx-asr's
    WeSpeaker front end). Each model is read and compiled in a child process first: a child
    that dies from a signal is a RunError naming the file and the signal, in the converter's
    own validation too. The stand-in child dies from SIGSEGV on its first request."""
    from mixprec.runtime import openvino as openvino_module
    from mixprec.runtime.isolated import Worker

    (tmp_path / "segfaulting_child.py").write_text(
        "import os, signal, sys\nsys.stdin.readline()\nos.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setattr(openvino_module, "_PROBE", Worker("segfaulting_child", "OpenVINO"))
    with pytest.raises(mixprec.ValidationError, match=r"cnn_fp32\.onnx: OpenVINO crashed \(SIGSEGV\)") as info:
        OpenVinoSession(models["fp32"])
    assert "\n" not in str(info.value)
    result = mixprec.convert(models["fp32"], tmp_path / "o.onnx", target_dtype="bf16", runtime="openvino")
    assert "OpenVINO crashed (SIGSEGV)" in result.report.validation.numerics
    assert result.report.validation.numerics.startswith("checked")  # the emulation still checked it


def test_models_are_read_in_a_child_before_this_process_reads_them(models: dict[str, Path]) -> None:
    from mixprec.runtime import openvino as openvino_module

    OpenVinoSession(models["bf16"])
    child = openvino_module._PROBE.process
    assert child is not None and child.poll() is None  # alive, and kept for the next session
    OpenVinoSession(models["fp32"])
    assert openvino_module._PROBE.process is child


def test_a_scalar_input_runs_and_a_refused_input_is_a_run_error(tmp_path: Path) -> None:
    """A rank-0 input takes a 0-d array (not one of shape [1]); an input OpenVINO refuses is a
    RunError naming it, which the conversion's check reports instead of failing."""
    from mixprec.errors import RunError  # noqa: PLC0415

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [])
    two = onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two")
    graph = onnx.helper.make_graph([onnx.helper.make_node("Mul", ["x", "two"], ["y"])], "g", [x], [y], [two])
    path = tmp_path / "scalar.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), str(path))
    session = OpenVinoSession(path, precision="f32")
    np.testing.assert_array_equal(session.run({"x": np.array(1.5, np.float32)})["y"], np.array(3.0, np.float32))
    with pytest.raises(RunError, match="^OpenVINO refused input 'x' of "):
        session.run({"x": np.ones((2, 2), np.float32)})
    result = mixprec.convert(path, tmp_path / "out.onnx", target_dtype="bf16", runtime="openvino")
    assert "OpenVINO CPU" in result.report.validation.numerics, result.report.validation.numerics

