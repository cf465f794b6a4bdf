"""The cost model (`mixprec.analysis.cost_model`) on the per-runtime figures of `policy/tables/costs.toml`:
the table is checked strictly, an op costs the larger of its traffic and its arithmetic, and the
report and the accuracy search price with the runtime's figures."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from helpers import convert
from mixprec.analysis.cost_model import cast_time, node_time
from mixprec.errors import PolicyError
from mixprec.policy.costs import parse_costs, runtime_cost
from mixprec.policy.profiles import RUNTIMES
from mixprec.report.html import render_html_report
from mixprec.tune.flops import node_costs

GOOD = {"flops_per_byte": 100.0, "fp32_flop_cost": 2.0, "launch_bytes": 10.0, "device": "d", "source": "s"}


def test_every_runtime_has_figures_and_unlisted_ones_take_the_default() -> None:
    default = runtime_cost(None)
    assert default.runtime == "default"
    for name in RUNTIMES:
        cost = runtime_cost(name)
        assert cost.flops_per_byte > 0 and cost.fp32_flop_cost >= 1 and cost.launch_bytes > 0
        assert cost.device and cost.source
    # onnxruntime's CPU provider has no 16-bit MatMul: FP32 arithmetic costs the same there.
    assert runtime_cost("ort-cpu").fp32_flop_cost == 1.0
    assert runtime_cost("openvino").measured == "python bench/bench_costs.py"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"flops_per_byte": -1.0}, "'flops_per_byte' must be a positive finite number"),
        ({"fp32_flop_cost": float("nan")}, "'fp32_flop_cost' must be a positive finite number"),
        ({"flops_per_byte": float("inf")}, "'flops_per_byte' must be a positive finite number"),
        ({"launch_bytes": True}, "'launch_bytes' must be a positive finite number"),
        ({"speed": 3.0}, "unknown key 'speed'"),
        ({"device": ""}, "'device' must be a non-empty string"),
    ],
)
def test_bad_tables_are_refused_with_the_table_named(change: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message) as info:
        parse_costs({"default": GOOD, "ort-cuda": {**GOOD, **change}}, "costs.toml")
    assert "[ort-cuda]" in str(info.value)
    missing = {k: v for k, v in GOOD.items() if k != "source"}
    with pytest.raises(PolicyError, match="missing key 'source'"):
        parse_costs({"default": missing}, "costs.toml")
    with pytest.raises(PolicyError, match="a \\[default\\] table is required"):
        parse_costs({"gpu": GOOD}, "costs.toml")
    # A misspelled runtime would silently take the default figures: refused.
    with pytest.raises(PolicyError, match=r"\[ort_cuda\]: not a runtime profile"):
        parse_costs({"default": GOOD, "ort_cuda": GOOD}, "costs.toml")


def test_an_op_costs_its_traffic_or_its_arithmetic_whichever_is_larger() -> None:
    gpu = runtime_cost("ort-cuda")
    # A large square MatMul is compute-bound: FP32 costs fp32_flop_cost times the arithmetic.
    n = 4096
    elements, flops = 3 * n * n, 2.0 * n**3
    low, fp32 = node_time(elements, flops, True, gpu), node_time(elements, flops, False, gpu)
    assert low == pytest.approx(flops / gpu.flops_per_byte + gpu.launch_bytes)
    assert fp32 - gpu.launch_bytes == pytest.approx(gpu.fp32_flop_cost * (low - gpu.launch_bytes))
    # An element-wise op is memory-bound: FP32 moves twice the bytes.
    assert node_time(1 << 20, None, False, gpu) - gpu.launch_bytes == 2 * (node_time(1 << 20, None, True, gpu) - gpu.launch_bytes)
    # A Cast reads 4 and writes 2 bytes per element, plus a launch.
    assert cast_time(1000, gpu) == 6000 + gpu.launch_bytes


def _matmul_chain(layers: int = 4, width: int = 256) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, weights, previous = [], [], "x"
    for i in range(layers):
        weights.append(numpy_helper.from_array((rng.standard_normal((width, width)) * 0.05).astype(np.float32), f"w{i}"))
        nodes.append(onnx.helper.make_node("MatMul", [previous, f"w{i}"], [f"m{i}"]))
        nodes.append(onnx.helper.make_node("Relu", [f"m{i}"], [f"r{i}"]))
        previous = f"r{i}"
    nodes.append(onnx.helper.make_node("Identity", [previous], ["y"]))
    graph = onnx.helper.make_graph(
        nodes, "chain",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [512, width])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [512, width])],
        weights,
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_report_estimates_the_speed_against_fp32_on_the_runtime() -> None:
    model = _matmul_chain()
    gpu, _ = convert(model, runtime="ort-cuda")
    cpu, _ = convert(model, runtime="ort-cpu")
    kept, _ = convert(model, runtime="ort-cuda", fp32_ops=["MatMul", "Relu", "Identity"])
    assert kept.report.estimated_speedup == pytest.approx(1.0)
    # Every MatMul in float16 on the GPU: close to the FP32 / 16-bit cost ratio of the arithmetic.
    assert 1.5 < gpu.report.estimated_speedup <= runtime_cost("ort-cuda").fp32_flop_cost + 0.01
    # Weights stored in 16 bits, compute in FP32: the weights' Casts fold when the model loads.
    weights_only, _ = convert(model, runtime="ort-cuda", weights_only=True)
    assert weights_only.report.casts_runtime == 0 and weights_only.report.casts_folded > 0
    assert "of constants folded when the model loads" in weights_only.report.format_text()
    assert weights_only.report.estimated_speedup == pytest.approx(1.0)
    # The CPU provider runs no 16-bit MatMul: the MatMuls stay FP32 and only casts are added.
    assert cpu.report.estimated_speedup < gpu.report.estimated_speedup
    assert cpu.report.cost_device == runtime_cost("ort-cpu").device
    text = gpu.report.format_text()
    assert f"speed: about {gpu.report.estimated_speedup:.2f}x the FP32 model's speed on NVIDIA H100 SXM" in text
    assert gpu.report.to_dict()["estimated_speedup"] == gpu.report.estimated_speedup
    page = render_html_report(gpu.report)
    assert f'id="estimated-speedup">estimated speed {gpu.report.estimated_speedup:.2f}' in page


def test_search_costs_come_from_the_batch_shapes_and_the_runtime() -> None:
    model = _matmul_chain(layers=2, width=64)
    batch = {"x": np.zeros((512, 64), np.float32)}
    gpu = node_costs(model, batch, runtime_cost("ort-cuda"))
    cpu = node_costs(model, batch, runtime_cost("ort-cpu"))
    matmul = next(k for k in gpu.fp32_penalty if "MatMul" in k)
    relu = next(k for k in gpu.fp32_penalty if "Relu" in k)
    assert gpu.flops[matmul] == 2.0 * 512 * 64 * 64
    # Both memory-bound at this size on the GPU: FP32 costs the extra 2 bytes per element.
    assert gpu.fp32_penalty[relu] == pytest.approx(2 * 2 * 512 * 64)
    assert gpu.fp32_penalty[matmul] == pytest.approx(2 * (2 * 512 * 64 + 64 * 64))
    # A bigger batch costs more to keep FP32.
    bigger = node_costs(model, {"x": np.zeros((4096, 64), np.float32)}, runtime_cost("ort-cuda"))
    assert bigger.fp32_penalty[relu] == pytest.approx(8 * gpu.fp32_penalty[relu])
    # On the CPU the MatMul is compute-bound and FP32 arithmetic costs the same: nothing to gain;
    # the CPU provider's float16 Relu converts each element, so FP32 is the faster there.
    assert cpu.fp32_penalty[matmul] == 0.0 and cpu.fp32_penalty[relu] < 0


def test_float16_elementwise_ops_cost_more_than_fp32_where_the_runtime_converts_each_element() -> None:
    # onnxruntime's CPU provider computes float16 elementwise ops through FP32 (costs.toml:
    # low_arithmetic_bytes, measured by bench/bench_costs.py); moving values still halves.
    from mixprec.analysis.cost_model import node_time  # noqa: PLC0415

    from mixprec.analysis.cost_model import computes_elementwise  # noqa: PLC0415

    cpu, gpu, elements = runtime_cost("ort-cpu"), runtime_cost("ort-cuda"), 1 << 20
    assert node_time(elements, None, True, cpu, elementwise=True) > node_time(elements, None, False, cpu)
    assert node_time(elements, None, True, cpu) < node_time(elements, None, False, cpu)  # Transpose
    assert node_time(elements, None, True, gpu, elementwise=True) < node_time(elements, None, False, gpu)
    assert computes_elementwise("", "Relu") and computes_elementwise("", "Add")
    assert not any(computes_elementwise("", op) for op in ("Transpose", "Gather", "MaxPool", "Conv", "MatMul"))
    matmul = 2.0 * 512**3
    assert node_time(3 * 512**2, matmul, True, cpu) == node_time(3 * 512**2, matmul, False, cpu)


def _cache_model(width: int) -> onnx.ModelProto:
    """A cache projected and handed back (present = past @ w) beside a projection of the new
    rows, both in 16 bits: the casts of the model's inputs and outputs cost as much as its
    arithmetic."""
    from onnx import TensorProto, helper  # noqa: PLC0415

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["past", "w"], ["present"], name="append"),
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Relu", ["h"], ["y"], name="act"),
    ]
    graph = helper.make_graph(
        nodes, "cache",
        [helper.make_tensor_value_info("past", TensorProto.FLOAT, ["batch", "past_len", width]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", width]),
         helper.make_tensor_value_info("present", TensorProto.FLOAT, ["batch", "past_len", width])],
        [numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32) / 16, "w")],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def _interface_note(report) -> list[str]:  # noqa: ANN001
    return [n for n in report.notes if "run-time casts only convert the model's FP32 inputs and outputs" in n]


def test_casts_at_the_inputs_and_outputs_that_cost_the_estimate_are_pointed_out(tmp_path) -> None:
    import mixprec  # noqa: PLC0415

    kept = mixprec.convert(_cache_model(64), tmp_path / "kept.onnx", validate="checker").report
    (note,) = _interface_note(kept)
    assert "4 of the 4 run-time casts" in note and "(past, x, y and 1 more)" in note and "--io-16bit" in note
    share = int(note.split(" and take ")[1].split("%")[0])
    assert share >= 20
    # 16-bit inputs and outputs drop those casts: a faster estimate, and no note.
    low_io = mixprec.convert(_cache_model(64), tmp_path / "low.onnx", validate="checker", keep_io_types=False).report
    assert low_io.casts_runtime == 0 and low_io.estimated_speedup > kept.estimated_speedup
    assert _interface_note(low_io) == []
    # An input that an FP32 node also reads would only see its cast change direction: not counted.
    model = _cache_model(64)
    model.graph.node.append(onnx.helper.make_node("Exp", ["x"], ["z"], name="exp"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["batch", "seq", 64]))
    read = mixprec.convert(model, tmp_path / "read.onnx", validate="checker", exclude_nodes=["exp"]).report
    assert read.casts_runtime == 4 and "3 of the 4 run-time casts" in _interface_note(read)[0], read.notes
    # A model whose arithmetic dwarfs its inputs and outputs: its casts are not worth a note.
    rng = np.random.default_rng(1)
    nodes = [
        onnx.helper.make_node("MatMul", ["x", "w1"], ["h"]),
        onnx.helper.make_node("Relu", ["h"], ["r"]),
        onnx.helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    weights = [numpy_helper.from_array(rng.standard_normal((4096, 4096)).astype(np.float32) / 64, n) for n in ("w1", "w2")]
    graph = onnx.helper.make_graph(
        nodes, "mlp", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "seq", 4096])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", "seq", 4096])], weights,
    )
    mlp = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    heavy = mixprec.convert(mlp, tmp_path / "mlp.onnx", validate="checker").report
    assert heavy.casts_runtime == 2 and _interface_note(heavy) == [], heavy.notes
