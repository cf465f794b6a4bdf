"""What mixprec says about the machine it runs on: the CPU's 16-bit arithmetic (detected, or
masked with MIXPREC_CPU_FLAGS), the speed estimate on CPU runtimes, and what OpenVINO really
executed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from mixprec.cli import main
from mixprec.demo_models import DEMO_MODELS
from mixprec.host import OVERRIDE_VARIABLE, host_cpu
from mixprec.policy.costs import runtime_cost
from mixprec.runtime.openvino import openvino_available


@pytest.fixture
def cpu_flags(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Set the CPU's flags as mixprec sees them (None: detect), for one test."""

    def set_flags(flags: str | None) -> None:
        if flags is None:
            monkeypatch.delenv(OVERRIDE_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(OVERRIDE_VARIABLE, flags)
        host_cpu.cache_clear()

    yield set_flags
    monkeypatch.delenv(OVERRIDE_VARIABLE, raising=False)
    host_cpu.cache_clear()


def test_detected_flags_come_from_the_cpu(cpu_flags) -> None:  # type: ignore[no-untyped-def]
    cpu_flags(None)
    cpu = host_cpu()
    assert cpu.cores >= 1 and cpu.name
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        flags = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split()
        assert cpu.computes("bfloat16") == ("avx512_bf16" in flags or "amx_bf16" in flags)
        assert cpu.computes("float16") == ("avx512_fp16" in flags or "amx_fp16" in flags)


def test_cpu_without_bf16_prices_bf16_as_fp32(cpu_flags) -> None:  # type: ignore[no-untyped-def]
    cpu_flags("")
    cost = runtime_cost("openvino", "bfloat16")
    assert cost.fp32_flop_cost == 1.0
    assert cost.device.startswith("this machine's CPU") and "no 16-bit matrix arithmetic" in cost.device
    assert "no AVX512-BF16 or AMX-BF16 on this CPU" in (cost.limitation or "")
    # A GPU runtime's figures describe its GPU, not this machine.
    assert runtime_cost("ort-cuda", "bfloat16").device == "NVIDIA H100 SXM"
    assert runtime_cost("ort-cuda", "bfloat16").limitation is None


def test_cpu_with_bf16_keeps_the_measured_figures(cpu_flags) -> None:  # type: ignore[no-untyped-def]
    cpu_flags("amx_bf16")
    table = runtime_cost("openvino")
    cost = runtime_cost("openvino", "bfloat16")
    assert cost.fp32_flop_cost == table.fp32_flop_cost > 1
    assert cost.limitation is None and "AMX-BF16" in cost.device
    # float16 needs AVX512-FP16 / AMX-FP16: absent here.
    assert runtime_cost("openvino", "float16").fp32_flop_cost == 1.0


def test_report_speed_line_is_honest_on_a_cpu_without_bf16(cpu_flags) -> None:  # type: ignore[no-untyped-def]
    cpu_flags("")
    slow = mixprec.convert(DEMO_MODELS["transformer"](), target_dtype="bf16", runtime="openvino", validate="none")
    cpu_flags("avx512_bf16,amx_bf16")
    fast = mixprec.convert(DEMO_MODELS["transformer"](), target_dtype="bf16", runtime="openvino", validate="none")
    text = slow.report.format_text()
    speed = next(line for line in text.splitlines() if "speed:" in line)
    assert "this machine's CPU" in speed and "bfloat16 matrix products run as FP32" in speed
    assert "AVX512-BF16 / AMX (2 cores of a Xeon)" not in text
    assert slow.report.estimated_speedup < fast.report.estimated_speedup
    assert fast.report.cost_limitation is None


def _pooling_model(path: Path) -> None:
    """A Conv and two 2x2 poolings on symbolic image sizes: onnxruntime runs the FP32 model on
    2x2 images, OpenVINO refuses them (the kernel is larger than the pooled data)."""
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(4, 3, 1, 1)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"]),
            helper.make_node("MaxPool", ["c"], ["a"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("AveragePool", ["a"], ["y"], kernel_shape=[2, 2], strides=[2, 2]),
        ],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, "h", "w"])], [weight],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))


def _rank2_if_model(path: Path) -> None:
    """An If on a [1, 1] condition, as PyTorch 1.12 exported openWakeWord's classifiers:
    onnxruntime runs it, OpenVINO cannot read it (its If takes a condition of rank 0 or 1)."""
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32), "w")
    branch = lambda name, op: helper.make_graph(  # noqa: E731
        [helper.make_node(op, ["m"], [f"{name}_out"])], name, [],
        [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [1, 4])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"]),
            helper.make_node("ReduceMax", ["m"], ["peak"], keepdims=1),
            helper.make_node("Greater", ["peak", "zero"], ["cond"]),
            helper.make_node("If", ["cond"], ["y"], then_branch=branch("then", "Relu"), else_branch=branch("else", "Neg")),
        ],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [weight, numpy_helper.from_array(np.zeros((), np.float32), "zero")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))


@pytest.mark.skipif(not openvino_available(), reason="openvino is not installed")
def test_reference_openvino_cannot_load_is_unchecked_without_asking_for_data(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    source, out = tmp_path / "if.onnx", tmp_path / "out.onnx"
    _rank2_if_model(source)
    assert main(["convert", str(source), str(out), "--to", "bf16", "--runtime", "openvino"]) == 5
    err = capsys.readouterr().err
    assert "not on OpenVINO: OpenVINO cannot load the FP32 model" in err
    assert "If" in err and "pass --data" not in err  # data would not help


@pytest.mark.skipif(not openvino_available(), reason="openvino is not installed")
def test_reference_openvino_cannot_run_is_unchecked_not_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source, out = tmp_path / "pool.onnx", tmp_path / "out.onnx"
    _pooling_model(source)
    assert main(["convert", str(source), str(out), "--to", "bf16", "--runtime", "openvino"]) == 5
    assert out.exists()
    err = capsys.readouterr().err
    assert "not on OpenVINO: OpenVINO cannot run the FP32 model on generated inputs" in err
    assert "pass --data" in err
    # With data the FP32 model runs there, and so does the converted one.
    data = tmp_path / "images.npz"
    np.savez(data, x=np.random.default_rng(1).normal(size=(1, 3, 8, 8)).astype(np.float32))
    assert main(["convert", str(source), str(out), "--to", "bf16", "--runtime", "openvino", "--data", str(data), "--overwrite"]) == 0


@pytest.mark.skipif(not openvino_available(), reason="openvino is not installed")
def test_validation_names_the_precision_openvino_executed(monkeypatch: pytest.MonkeyPatch, cpu_flags, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Where OpenVINO computes the bfloat16 graph in f32 (as on CPUs without bf16), the report
    says so instead of claiming a real bfloat16 check."""
    from mixprec.runtime import openvino as openvino_runner  # noqa: PLC0415

    cpu_flags("")
    monkeypatch.setattr(
        openvino_runner.OpenVinoSession, "executed_precisions",
        lambda self: Counter({("Convolution", "f32"): 2, ("FullyConnected", "f32"): 1, ("Softmax", "f32"): 1}),
    )
    result = mixprec.convert(DEMO_MODELS["cnn"](), tmp_path / "o.onnx", target_dtype="bf16", runtime="openvino")
    v = result.report.validation
    assert v.real_runtime == "OpenVINO CPU (model types)"
    assert v.real_executed == "matrix/convolution layers ran in f32: 3"
    assert "for real on OpenVINO CPU (model types); matrix/convolution layers ran in f32: 3" in v.numerics
    note = next(n for n in v.notes if n.startswith("OpenVINO computed"))
    assert "not bf16 (this CPU has no AVX512-BF16 or AMX-BF16)" in note
    assert "not bfloat16 arithmetic" in note
