"""INT8 + 16-bit where the runtime runs quantized groups in float: constant dequantizations folded,
one-op groups converted, activation scales judged pair by pair, and the emulation of every Q/DQ
form the converter writes.

Golden graphs pin each rule on a quantized Conv (int8 per-channel weights, an int32 bias whose
scale is input scale x weight scale, below float16's normal range); real models are quantized
with onnxruntime's `quantize_static` and checked against the INT8 + FP32 model run unfused
(onnxruntime with graph optimizations off: the form a 16-bit runtime runs).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

import mixprec
from helpers import BFLOAT16, FLOAT, FLOAT16, check_full, convert, initializer_types, qdq_conv_group, run
from mixprec.errors import PolicyError
from mixprec.passes.fold_dequantize import dequantize
from mixprec.policy.quantized_groups import parse_quantized_groups, quantized_groups
from mixprec.policy.profiles import load_runtime
from mixprec.runtime.kernels import cpu_has_kernel
from mixprec.runtime.openvino import openvino_available
from mixprec.validate.emulate import emulate_low_precision
from test_qdq import _quantize, assert_pairs_adjacent, quantized_squeezenet  # noqa: F401 - a fixture

C_IN, C_OUT, SIZE = 4, 6, 8
X_SCALE, Y_SCALE = 0.005, 0.05  # the bias scale, X_SCALE x weight scale, is ~2e-5
LOW = {"fp16": (FLOAT16, np.float16), "bf16": (BFLOAT16, ml_dtypes.bfloat16)}


def qdq_conv(opset: int = 21, *, x_scale: float = X_SCALE, int4_block: bool = False, seed: int = 0) -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv(DQ(int8 W, per channel), DQ(int32 bias)) -> Q -> DQ -> MaxPool -> Q -> DQ
    -> Conv(DQ(int8 W2), float bias) -> Q -> DQ -> y; with `int4_block` also a MatMul on a
    block-quantized int4 weight (opset 21+)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.2, (C_OUT, C_IN, 3, 3)).astype(np.float32)
    w_scale = (np.abs(w).reshape(C_OUT, -1).max(1) / 127).astype(np.float32)
    w_q = np.clip(np.round(w / w_scale[:, None, None, None]), -127, 127).astype(np.int8)
    bias = rng.normal(0, 0.3, C_OUT).astype(np.float32)
    b_scale = (np.float32(x_scale) * w_scale).astype(np.float32)
    b_q = np.round(bias / b_scale).astype(np.int32)
    w2 = rng.normal(0, 0.2, (C_OUT, C_OUT, 1, 1)).astype(np.float32)
    w2_scale = (np.abs(w2).reshape(C_OUT, -1).max(1) / 127).astype(np.float32)
    w2_q = np.clip(np.round(w2 / w2_scale[:, None, None, None]), -127, 127).astype(np.int8)
    initializers = [
        nh.from_array(np.array(x_scale, np.float32), "x_scale"), nh.from_array(np.array(0, np.int8), "x_zp"),
        nh.from_array(w_q, "w_q"), nh.from_array(w_scale, "w_scale"), nh.from_array(np.zeros(C_OUT, np.int8), "w_zp"),
        nh.from_array(b_q, "b_q"), nh.from_array(b_scale, "b_scale"), nh.from_array(np.zeros(C_OUT, np.int32), "b_zp"),
        nh.from_array(np.array(Y_SCALE, np.float32), "y_scale"), nh.from_array(np.array(0, np.int8), "y_zp"),
        nh.from_array(w2_q, "w2_q"), nh.from_array(w2_scale, "w2_scale"), nh.from_array(np.zeros(C_OUT, np.int8), "w2_zp"),
        nh.from_array(rng.normal(0, 0.1, C_OUT).astype(np.float32), "b2"),
    ]
    nodes = [
        oh.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["x_q"], name="q_x"),
        oh.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x_dq"], name="dq_x"),
        oh.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w_dq"], name="dq_w", axis=0),
        oh.make_node("DequantizeLinear", ["b_q", "b_scale", "b_zp"], ["b_dq"], name="dq_b", axis=0),
        oh.make_node("Conv", ["x_dq", "w_dq", "b_dq"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        oh.make_node("QuantizeLinear", ["c", "y_scale", "y_zp"], ["c_q"], name="q_c"),
        oh.make_node("DequantizeLinear", ["c_q", "y_scale", "y_zp"], ["c_dq"], name="dq_c"),
        oh.make_node("MaxPool", ["c_dq"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        oh.make_node("QuantizeLinear", ["p", "y_scale", "y_zp"], ["p_q"], name="q_p"),
        oh.make_node("DequantizeLinear", ["p_q", "y_scale", "y_zp"], ["p_dq"], name="dq_p"),
        oh.make_node("DequantizeLinear", ["w2_q", "w2_scale", "w2_zp"], ["w2_dq"], name="dq_w2", axis=0),
        oh.make_node("Conv", ["p_dq", "w2_dq", "b2"], ["d"], name="conv2"),
        oh.make_node("QuantizeLinear", ["d", "y_scale", "y_zp"], ["d_q"], name="q_d"),
        oh.make_node("DequantizeLinear", ["d_q", "y_scale", "y_zp"], ["y"], name="dq_y"),
    ]
    half = SIZE // 2
    outputs = [oh.make_tensor_value_info("y", FLOAT, [1, C_OUT, half, half])]
    if int4_block:
        k, n, block = C_OUT * half * half, 8, 16
        q4 = rng.integers(-8, 8, (k, n)).astype(ml_dtypes.int4)
        initializers += [
            nh.from_array(q4, "w4_q"),
            nh.from_array(rng.uniform(0.005, 0.02, (k // block, n)).astype(np.float32), "w4_scale"),
            nh.from_array(np.array([1, k], np.int64), "flat"),
        ]
        nodes += [
            oh.make_node("DequantizeLinear", ["w4_q", "w4_scale"], ["w4"], name="dq_w4", axis=0, block_size=block),
            oh.make_node("Reshape", ["y", "flat"], ["y_flat"], name="flatten"),
            oh.make_node("MatMul", ["y_flat", "w4"], ["z"], name="matmul_int4"),
        ]
        outputs.append(oh.make_tensor_value_info("z", FLOAT, [1, n]))
    graph = oh.make_graph(
        nodes, "qdq_conv", [oh.make_tensor_value_info("x", FLOAT, [1, C_IN, SIZE, SIZE])], outputs, initializers
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def _feeds(seed: int = 1, scale: float = 0.6) -> dict[str, np.ndarray]:
    return {"x": (np.random.default_rng(seed).uniform(-1, 1, (1, C_IN, SIZE, SIZE)) * scale).astype(np.float32)}


def run_unfused(model: onnx.ModelProto | str | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run with every graph optimization off: Q, DQ and the ops between them as written."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return [np.asarray(o, np.float32) for o in session.run(None, {k: v for k, v in feeds.items() if k in names})]


def _initializer(model: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in model.graph.initializer if t.name == name)


def _decisions(result: mixprec.ConversionResult) -> dict[str, tuple[str, str]]:
    return {k.name: (k.category, k.reason) for k in result.report.kept_fp32}


# -- constant dequantizations --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "runtime", "folded"),
    [("fp16", "ort-cuda", ["dq_b", "dq_w", "dq_w2"]), ("fp16", "tensorrt", ["dq_b"]), ("bf16", "tensorrt", ["dq_b"])],
)
def test_int32_bias_folds_where_the_runtime_dequantizes_it_in_float(target: str, runtime: str, folded: list[str]) -> None:
    source = qdq_conv()
    result, out = convert(source, target_dtype=target, runtime=runtime)
    check_full(out)
    report = result.report
    assert sorted(report.quantization.folded) == folded
    assert_pairs_adjacent(source, out, folded)
    assert any(n.startswith(f"folded {len(folded)} constant DequantizeLinear") and runtime in n for n in report.notes)
    # Both Conv groups, the MaxPool group between them, and their Q/DQ nodes convert: no scale
    # below the 16-bit normal range is left.
    assert report.quantization.quantized_low == 3 and report.low_by_op["Conv"] == 2
    assert report.casts_runtime == 0  # the graph input enters a QuantizeLinear, the output leaves one
    # The bias is computed once in FP32 (int32 x FP32 scale) and rounded once.
    low_type, low_numpy = LOW[target]
    b_q, b_scale = (nh.to_array(_initializer(source, n)) for n in ("b_q", "b_scale"))
    bias = nh.to_array(_initializer(out, "b_dq"))
    assert initializer_types(out)["b_dq"] == low_type
    np.testing.assert_array_equal(bias, (b_q.astype(np.float32) * b_scale).astype(low_numpy))
    # Integer tensors that stay are byte-identical; the folded ones left the model.
    kept = {t.name: t for t in out.graph.initializer}
    for t in source.graph.initializer:
        if t.data_type in (TensorProto.INT8, TensorProto.INT32) and t.name in kept:
            assert kept[t.name] == t
    assert ("w_q" in kept) == ("dq_w" not in folded) and "b_q" not in kept
    # The plan says why the Conv converts with a constant bias.
    reasons = {node.name: d.reason for node, d in result.plan.decisions.items()}
    assert "'b_dq' (DequantizeLinear 'dq_b')" in reasons["conv"] and "computed once in FP32" in reasons["conv"]
    # Where the bias stays a DequantizeLinear (no statement for the runtime), its scale keeps
    # the group FP32.
    unfolded, _ = convert(source, target_dtype=target, runtime="onnx")
    if target == "fp16":
        assert "below the smallest normal fp16" in _decisions(unfolded)["dq_b"][1]
        assert _decisions(unfolded)["conv"][0] == "quantized pair"
    emulated = emulate_low_precision(out)
    for seed in range(3):
        feeds = _feeds(seed)
        expected = run_unfused(source, feeds)[0]
        np.testing.assert_allclose(run(emulated, feeds)[0], expected, atol=2 * Y_SCALE)


@pytest.mark.parametrize("runtime", ["ort-cpu", "ort-dml", "onnx"])
def test_integer_form_kept_where_the_runtime_reads_it(runtime: str) -> None:
    # ONNX Runtime's CPU and DirectML providers fuse the group into QLinearConv, which reads the
    # int8 weights and the int32 bias; a runtime without a statement keeps them too.
    source = qdq_conv()
    result, out = convert(source, target_dtype="fp16", runtime=runtime)
    assert result.report.quantization.folded == []
    assert not any("folded" in n for n in result.report.notes)
    assert_pairs_adjacent(source, out)
    kept = {t.name: t for t in out.graph.initializer}
    for name in ("w_q", "b_q", "w2_q", "w_zp", "b_zp"):
        assert kept[name] == _initializer(source, name)
    assert "conv" in _decisions(result)  # FP32: no 16-bit kernel, or the bias scale


def test_weight_only_dequantization_keeps_its_integers() -> None:
    # A DequantizeLinear of int8 weights read by an op with a float activation is weight-only
    # quantization (memory): it is no quantized group, and stays.
    rng = np.random.default_rng(0)
    w_q = rng.integers(-127, 127, (16, 8)).astype(np.int8)
    graph = oh.make_graph(
        [
            oh.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], name="dq_w", axis=1),
            oh.make_node("MatMul", ["a", "w"], ["y"], name="matmul"),
        ],
        "weight_only", [oh.make_tensor_value_info("a", FLOAT, [2, 16])], [oh.make_tensor_value_info("y", FLOAT, [2, 8])],
        [nh.from_array(w_q, "w_q"), nh.from_array(np.full(8, 0.01, np.float32), "w_scale")],
    )
    source = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    result, out = convert(source, target_dtype="fp16", runtime="ort-cuda")
    assert result.report.quantization.folded == []
    assert _initializer(out, "w_q") == _initializer(source, "w_q")
    assert result.report.low_by_op == {"DequantizeLinear": 1, "MatMul": 1}


def test_small_weight_scale_no_longer_blocks_a_group_once_folded() -> None:
    # A per-channel weight scale below float16's normal range keeps its pair FP32 where the
    # DequantizeLinear stays (TensorRT reads int8 weights); folded, it never exists at run time.
    source = qdq_conv()
    tiny = next(t for t in source.graph.initializer if t.name == "w2_scale")
    tiny.CopyFrom(nh.from_array(np.full(C_OUT, 2e-6, np.float32), "w2_scale"))
    trt, _ = convert(source, target_dtype="fp16", runtime="tensorrt")
    assert "below the smallest normal fp16" in _decisions(trt)["dq_w2"][1]
    assert _decisions(trt)["conv2"][0] == "quantized pair"
    cuda, out = convert(source, target_dtype="fp16", runtime="ort-cuda")
    assert "conv2" not in _decisions(cuda) and "dq_w2" in cuda.report.quantization.folded
    check_full(out)


# -- activation scales ----------------------------------------------------------------------------


def test_activation_scale_below_the_normal_range_keeps_only_its_pair_fp32() -> None:
    # The input's per-tensor scale (3e-5) is below float16's smallest normal (6.1e-5): the first
    # group stays FP32; the next ones, with scales in the normal range, convert.
    source = qdq_conv(x_scale=3e-5)
    result, out = convert(source, target_dtype="fp16", runtime="ort-cuda")
    check_full(out)
    assert_pairs_adjacent(source, out, result.report.quantization.folded)
    kept = _decisions(result)
    assert "scale 'x_scale' holds 3e-05, below the smallest normal fp16" in kept["dq_x"][1]
    assert kept["conv"][0] == "quantized pair" and "q_c" in kept
    assert not {"dq_c", "pool", "q_p", "dq_p", "conv2", "q_d"} & set(kept)
    feeds = _feeds(scale=3e-3)
    np.testing.assert_allclose(run(emulate_low_precision(out), feeds)[0], run_unfused(source, feeds)[0], atol=2 * Y_SCALE)


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_qdq_nodes_stay_fp32_where_the_runtime_compiles_no_16bit_scales(target: str) -> None:
    # OpenVINO's low-precision transformations fail on bfloat16 Q/DQ scales (`qdq_scales`): every
    # Q/DQ node stays FP32 for it, and the ops between them with it; float16 scales compile.
    result, out = convert(qdq_conv(), target_dtype=target, runtime="openvino")
    kept = _decisions(result)
    qdq = [n.name for n in out.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    if target == "bf16":
        assert all("openvino compiles QuantizeLinear/DequantizeLinear with FP32 scales only" in kept[name][1] for name in qdq)
        assert result.report.quantization.quantized_low == 0
        assert all(t != BFLOAT16 for t in initializer_types(out).values())
    else:
        assert "conv2" not in kept and "dq_p" not in kept and result.report.quantization.quantized_low > 0
    check_full(out)


# -- one-op groups --------------------------------------------------------------------------------


@pytest.mark.parametrize(("runtime", "converts"), [("ort-cuda", True), ("tensorrt", True), ("ort-cpu", False), ("onnx", False)])
def test_one_op_group_converts_where_the_runtime_runs_it_in_16_bits(runtime: str, converts: bool) -> None:
    result, out = convert(qdq_conv(), target_dtype="fp16", runtime=runtime)
    kept = _decisions(result)
    assert ("pool" not in kept) == converts and ("dq_c" not in kept) == converts and ("q_p" not in kept) == converts
    check_full(out)


def _concat_group() -> list[onnx.NodeProto]:
    """a and b quantized, dequantized, concatenated and quantized again (scale s, zero point z):
    a DQ -> Concat -> Q group with its input pairs."""
    return [
        oh.make_node("QuantizeLinear", ["a", "s", "z"], ["a_q"], name="q_a"),
        oh.make_node("DequantizeLinear", ["a_q", "s", "z"], ["a_dq"], name="dq_a"),
        oh.make_node("QuantizeLinear", ["b", "s", "z"], ["b_q"], name="q_b"),
        oh.make_node("DequantizeLinear", ["b_q", "s", "z"], ["b_dq"], name="dq_b"),
        oh.make_node("Concat", ["a_dq", "b_dq"], ["c"], name="concat", axis=1),
        oh.make_node("QuantizeLinear", ["c", "s", "z"], ["c_q"], name="q_c"),
        oh.make_node("DequantizeLinear", ["c_q", "s", "z"], ["c_dq"], name="dq_c"),
    ]


def _concat_model(*, a_scale: float = 0.02) -> onnx.ModelProto:
    """The Concat group of :func:`_concat_group` (input a at scale `a_scale`, b and the output at
    0.02) read by a MatMul."""
    rng = np.random.default_rng(0)
    nodes = [*_concat_group(), oh.make_node("MatMul", ["c_dq", "w"], ["y"], name="matmul")]
    nodes[0].input[1] = nodes[1].input[1] = "s_a"
    graph = oh.make_graph(
        nodes, "concat", [oh.make_tensor_value_info(n, FLOAT, [2, 4]) for n in ("a", "b")],
        [oh.make_tensor_value_info("y", FLOAT, [2, 3])],
        [nh.from_array(np.array(0.02, np.float32), "s"), nh.from_array(np.array(a_scale, np.float32), "s_a"),
         nh.from_array(np.array(0, np.int8), "z"), nh.from_array(rng.normal(0, 0.3, (8, 3)).astype(np.float32), "w")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _concat_feeds() -> dict[str, np.ndarray]:
    return {"a": np.linspace(-1.3, 1.3, 8, dtype=np.float32).reshape(2, 4), "b": np.full((2, 4), 0.5, np.float32)}


@pytest.mark.parametrize("a_scale", [0.02, 0.013])
def test_concat_group_is_written_on_integers_where_its_16bit_form_cannot_load(a_scale: float) -> None:
    # onnxruntime's CPU provider fuses DQ -> Concat -> Q into QLinearConcat whatever the scale
    # type, and QLinearConcat takes FP32 scales only. ONNX Runtime CUDA concatenates int8: the
    # group becomes Concat(QuantizeLinear(DequantizeLinear(x_i), s, z)), the same integers, with
    # no QuantizeLinear where input and output share scale and zero point. Nothing stays FP32 but
    # the quantizers of the FP32 graph inputs and the requantization (FP32: exact).
    source = _concat_model(a_scale=a_scale)
    result, out = convert(source, target_dtype="fp16", runtime="ort-cuda", validate="run")
    nodes = {n.name: n for n in out.graph.node}
    concat = nodes["concat"]
    assert "q_c" not in nodes and concat.output[0] == "c_q"
    if a_scale == 0.02:  # the same scale and zero point: the integers themselves
        assert set(_decisions(result)) == {"q_a", "q_b"}
        assert list(concat.input) == ["a_q", "b_q"] and "dq_a" not in nodes and "dq_b" not in nodes
    else:  # a is requantized to the output's scale in FP32, b moves as it is
        kept = _decisions(result)
        assert set(kept) == {"q_a", "q_b", "dq_a", "concat_dq_a_requantized"}
        assert "in FP32 the integers stay exact" in kept["concat_dq_a_requantized"][1]
        requantize = nodes["concat_dq_a_requantized"]
        assert concat.input[0] == requantize.output[0] and requantize.input[0] == "a_dq" and concat.input[1] == "b_q"
        assert initializer_types(out)[requantize.input[1]] == FLOAT
    assert result.report.quantization.on_integers == {"concat": ("q_c", *(("dq_a", "dq_b") if a_scale == 0.02 else ("dq_b",)))}
    assert_pairs_adjacent(source, out, (), result.report.quantization.on_integers)
    assert "1 data-movement group(s) written on integers" in result.report.format_text()
    assert any("wrote 1 quantized data-movement group(s) on integers" in note for note in result.report.notes)
    assert result.report.validation.runtime.startswith("ran")
    assert not any("onnxruntime fails" in n for n in result.report.notes)  # no repair was needed
    feeds = _concat_feeds()
    np.testing.assert_allclose(run(out, feeds)[0], run_unfused(source, feeds)[0], rtol=2e-3, atol=1e-3)
    # The concatenated integers are those of the FP32 group, requantized by the CPU provider's
    # QLinearConcat or unfused: the converted model, on the CPU provider with default options.
    integers = [run(_with_output(out, "c_q"), feeds)[1], run(_with_output(source, "c_q"), feeds)[1],
                run_unfused(_with_output(source, "c_q"), feeds)[1]]
    assert integers[0].dtype == np.int8 and all((i == integers[0]).all() for i in integers)
    assert (integers[0][:, :4] == np.round(feeds["a"] / a_scale)).all() == (a_scale == 0.02)  # a's own, or requantized


def _with_output(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """A copy of `model` that also yields the int8 value `name`."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.graph.output.append(oh.make_tensor_value_info(name, TensorProto.INT8, [2, 8]))
    return copy


def _concat_variant(nodes: list[onnx.NodeProto], inputs: list[str], outputs: dict[str, tuple[int, list[int]]]) -> onnx.ModelProto:
    """A graph of `nodes` over float inputs `inputs` [2, 4] (scales s = 0.02 and s_a = 0.013, zero
    point z) with `outputs` of the given element types and shapes."""
    graph = oh.make_graph(
        nodes, "variant", [oh.make_tensor_value_info(n, FLOAT, [2, 4]) for n in inputs],
        [oh.make_tensor_value_info(name, dtype, shape) for name, (dtype, shape) in outputs.items()],
        [nh.from_array(np.array(0.02, np.float32), "s"), nh.from_array(np.array(0.013, np.float32), "s_a"),
         nh.from_array(np.array(0, np.int8), "z")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_concat_group_on_integers_handles_repeated_inputs_and_default_zero_points() -> None:
    # One DequantizeLinear read twice gets one requantization; a QuantizeLinear without a zero
    # point yields uint8 (the schema's default) and its group is rewritten all the same.
    repeated = _concat_variant([
        oh.make_node("QuantizeLinear", ["a", "s_a", "z"], ["a_q"], name="q_a"),
        oh.make_node("DequantizeLinear", ["a_q", "s_a", "z"], ["a_dq"], name="dq_a"),
        oh.make_node("Concat", ["a_dq", "a_dq"], ["c"], name="concat", axis=1),
        oh.make_node("QuantizeLinear", ["c", "s", "z"], ["c_q"], name="q_c"),
        oh.make_node("DequantizeLinear", ["c_q", "s", "z"], ["y"], name="dq_c"),
    ], ["a"], {"y": (FLOAT, [2, 8])})
    result, out = convert(repeated, target_dtype="fp16", runtime="ort-cuda", validate="run")
    concat = next(n for n in out.graph.node if n.name == "concat")
    assert concat.input[0] == concat.input[1] and result.report.quantization.on_integers == {"concat": ("q_c",)}
    assert sum(n.op_type == "QuantizeLinear" for n in out.graph.node) == 2  # q_a and one requantization
    feeds = {"a": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)}
    np.testing.assert_array_equal(run(out, feeds)[0], run_unfused(repeated, feeds)[0])

    unsigned = _concat_variant([
        oh.make_node("QuantizeLinear", ["a", "s"], ["a_q"], name="q_a"),
        oh.make_node("DequantizeLinear", ["a_q", "s"], ["a_dq"], name="dq_a"),
        oh.make_node("QuantizeLinear", ["b", "s_a"], ["b_q"], name="q_b"),
        oh.make_node("DequantizeLinear", ["b_q", "s_a"], ["b_dq"], name="dq_b"),
        oh.make_node("Concat", ["a_dq", "b_dq"], ["c"], name="concat", axis=1),
        oh.make_node("QuantizeLinear", ["c", "s"], ["y"], name="q_c"),
    ], ["a", "b"], {"y": (TensorProto.UINT8, [2, 8])})
    result, out = convert(unsigned, target_dtype="fp16", runtime="ort-cuda", validate="run")
    assert result.report.quantization.on_integers == {"concat": ("q_c", "dq_a")}
    feeds = {"a": np.linspace(0, 1, 8, dtype=np.float32).reshape(2, 4), "b": np.full((2, 4), 0.7, np.float32)}
    np.testing.assert_array_equal(run(out, feeds)[0], run_unfused(unsigned, feeds)[0])


def test_concat_group_reading_an_outer_dequantization_is_left_alone() -> None:
    # The DequantizeLinear lives in the main graph, the Concat group in an If branch: the group
    # stays as it is (FP32), and the conversion neither fails nor leaves a dangling value.
    branch = oh.make_graph(
        [oh.make_node("Concat", ["a_dq", "a_dq"], ["c"], name="concat", axis=1),
         oh.make_node("QuantizeLinear", ["c", "s", "z"], ["c_q"], name="q_c"),
         oh.make_node("DequantizeLinear", ["c_q", "s", "z"], ["c_dq"], name="dq_c")],
        "then", [], [oh.make_tensor_value_info("c_dq", FLOAT, [2, 8])],
    )
    other = oh.make_graph(
        [oh.make_node("Concat", ["a", "a"], ["d"], name="plain", axis=1)], "else", [],
        [oh.make_tensor_value_info("d", FLOAT, [2, 8])],
    )
    model = _concat_variant([
        oh.make_node("QuantizeLinear", ["a", "s", "z"], ["a_q"], name="q_a"),
        oh.make_node("DequantizeLinear", ["a_q", "s", "z"], ["a_dq"], name="dq_a"),
        oh.make_node("ReduceMax", ["a"], ["m"], keepdims=0),
        oh.make_node("Greater", ["m", "zero"], ["cond"]),
        oh.make_node("If", ["cond"], ["y"], name="if", then_branch=branch, else_branch=other),
    ], ["a"], {"y": (FLOAT, [2, 8])})
    model.graph.initializer.append(nh.from_array(np.array(0, np.float32), "zero"))
    result, out = convert(model, target_dtype="fp16", runtime="ort-cuda", validate="run")
    check_full(out)
    assert not result.report.quantization.on_integers
    feeds = {"a": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)}
    np.testing.assert_allclose(run(out, feeds)[0], run_unfused(model, feeds)[0], atol=1e-6)


def test_concat_group_stays_fp32_where_the_runtime_moves_no_integers() -> None:
    # TensorRT's Concat reads no int8 (its profile): the group stays FP32, the model loads on
    # onnxruntime's CPU provider, and the MatMul after it converts.
    source = _concat_model()
    result, _ = convert(source, target_dtype="fp16", runtime="tensorrt", validate="run")
    assert "concat" in _decisions(result) and "matmul" not in _decisions(result)
    assert not result.report.quantization.on_integers
    assert result.report.validation.runtime.startswith("ran")
    assert not any("onnxruntime fails" in n for n in result.report.notes)


def _attention_probabilities() -> onnx.ModelProto:
    """Scores dequantized from uint8, a Softmax quantized back to uint8 (ONNX Runtime's quantizer
    writes attention so), beside a Softmax on plain floats."""
    graph = oh.make_graph(
        [
            oh.make_node("QuantizeLinear", ["scores", "s", "z"], ["q"], name="q_scores"),
            oh.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"], name="dq_scores"),
            oh.make_node("Softmax", ["dq"], ["p"], name="softmax", axis=-1),
            oh.make_node("QuantizeLinear", ["p", "p_s", "p_z"], ["p_q"], name="q_p"),
            oh.make_node("DequantizeLinear", ["p_q", "p_s", "p_z"], ["p_dq"], name="dq_p"),
            oh.make_node("MatMul", ["p_dq", "v"], ["y"], name="matmul"),
            oh.make_node("Softmax", ["y"], ["plain"], name="plain_softmax", axis=-1),
        ],
        "attention", [oh.make_tensor_value_info("scores", FLOAT, [2, 6, 6])],
        [oh.make_tensor_value_info("p_q", TensorProto.UINT8, [2, 6, 6]), oh.make_tensor_value_info("plain", FLOAT, [2, 6, 4])],
        [nh.from_array(np.array(0.05, np.float32), "s"), nh.from_array(np.array(128, np.uint8), "z"),
         nh.from_array(np.array(1 / 255, np.float32), "p_s"), nh.from_array(np.array(0, np.uint8), "p_z"),
         nh.from_array(np.random.default_rng(0).normal(0, 1, (6, 4)).astype(np.float32), "v")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_softmax_between_8bit_quantizers_converts_in_float16(target: str) -> None:
    # The policy keeps Softmax FP32; between a DequantizeLinear of uint8 and a QuantizeLinear to
    # uint8 (steps of 1/255) float16's rounding does not reach the result, so it converts there;
    # bfloat16's does, and a Softmax on plain floats stays FP32 with the policy's reason.
    source = _attention_probabilities()
    result, out = convert(source, target_dtype=target, runtime="tensorrt", validate="run")
    kept = _decisions(result)
    assert kept["plain_softmax"] == ("policy", "Softmax: softmax-like normalisation: exp and a sum over the axis")
    if target == "fp16":
        assert "softmax" not in kept and "matmul" not in kept
        softmax = next(n for n in out.graph.node if n.name == "softmax")
        assert softmax.input[0] == "dq" and result.report.quantization.quantized_low == 1
        feeds = {"scores": np.random.default_rng(1).normal(0, 2, (2, 6, 6)).astype(np.float32)}
        got, expected = run_unfused(emulate_low_precision(out), feeds)[0], run_unfused(source, feeds)[0]
        assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1  # at most one output step
    else:
        assert kept["softmax"] == ("policy", "Softmax: softmax-like normalisation: exp and a sum over the axis")
    assert_pairs_adjacent(source, out, result.report.quantization.folded)


def _with_matmul_group(nodes: list[onnx.NodeProto], inputs: list[str], outputs: dict[str, list[int]]) -> onnx.ModelProto:
    """`nodes` (over float inputs `inputs` [2, 4], scale s and zero point z, dequantizing a as
    a_dq) beside a quantized MatMul group on a_dq (int8 weight w_q) whose output m_dq is a graph
    output, as are `outputs`."""
    rng = np.random.default_rng(0)
    graph = oh.make_graph(
        [
            *nodes,
            oh.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w_dq"], name="dq_w"),
            oh.make_node("MatMul", ["a_dq", "w_dq"], ["m"], name="matmul"),
            oh.make_node("QuantizeLinear", ["m", "s", "z"], ["m_q"], name="q_m"),
            oh.make_node("DequantizeLinear", ["m_q", "s", "z"], ["m_dq"], name="dq_m"),
        ],
        "shared", [oh.make_tensor_value_info(n, FLOAT, [2, 4]) for n in inputs],
        [*(oh.make_tensor_value_info(n, FLOAT, shape) for n, shape in outputs.items()),
         oh.make_tensor_value_info("m_dq", FLOAT, [2, 3])],
        [nh.from_array(np.array(0.02, np.float32), "s"), nh.from_array(np.array(0, np.int8), "z"),
         nh.from_array(rng.integers(-127, 127, (4, 3)).astype(np.int8), "w_q"),
         nh.from_array(np.array(0.01, np.float32), "w_s"), nh.from_array(np.array(0, np.int8), "w_z")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("runtime", ["ort-cuda", "tensorrt"])
def test_dequantization_shared_with_a_concat_group_converts_for_its_other_readers(runtime: str) -> None:
    # YOLO's CSP blocks: one DequantizeLinear feeds a Concat group and a MatMul. Where the Concat
    # group stays FP32 (tensorrt), the MatMul reads a twin DequantizeLinear (same int8 input,
    # scale, zero point) in float16 and the Concat keeps the original in FP32; where it is
    # written on integers (ort-cuda), the Concat reads the integers and the MatMul the original
    # in float16. No Cast beside a Q/DQ node either way.
    source = _with_matmul_group(_concat_group(), ["a", "b"], {"c_dq": [2, 8]})
    result, out = convert(source, target_dtype="fp16", runtime=runtime, validate="run")
    kept = _decisions(result)
    nodes = {n.name: n for n in out.graph.node}
    q = result.report.quantization
    assert "matmul" not in kept and "dq_a_unshared" not in kept
    if runtime == "tensorrt":
        assert "concat" in kept and "dq_a" in kept and not q.on_integers
        twin = nodes["dq_a_unshared"]
        assert twin.input[0] == "a_q" and nodes["matmul"].input[0] == twin.output[0]
        assert any("twin" in note for note in result.report.notes)
    else:
        assert "concat" not in kept and "dq_a" not in kept and "dq_a_unshared" not in nodes
        assert list(nodes["concat"].input) == ["a_q", "b_q"] and nodes["matmul"].input[0] == "a_dq"
        assert q.on_integers == {"concat": ("q_c", "dq_b")}
    assert_pairs_adjacent(source, out, q.folded, q.on_integers)
    assert result.report.validation.runtime.startswith("ran")
    feeds = {"a": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4), "b": np.full((2, 4), 0.5, np.float32)}
    for got, expected in zip(run_unfused(emulate_low_precision(out), feeds), run_unfused(source, feeds)):
        np.testing.assert_allclose(got, expected, atol=0.02 + 1e-6)  # at most one output step


def test_dequantization_shared_with_float_ops_outside_groups_gets_a_twin() -> None:
    # A transformer's LayerNorm output, dequantized once, feeds the next layer's quantized MatMul
    # and a float pooling (Mul -> ReduceSum, which the policy keeps FP32). The pooling reads a
    # twin DequantizeLinear in FP32; the MatMul group converts with the original.
    source = _with_matmul_group([
        oh.make_node("QuantizeLinear", ["a", "s", "z"], ["a_q"], name="q_a"),
        oh.make_node("DequantizeLinear", ["a_q", "s", "z"], ["a_dq"], name="dq_a"),
        oh.make_node("Mul", ["a_dq", "a_dq"], ["sq"], name="mul"),
        oh.make_node("ReduceSum", ["sq"], ["pooled"], name="pool", keepdims=1),
    ], ["a"], {"pooled": [1, 1]})
    result, out = convert(source, target_dtype="fp16", runtime="tensorrt", validate="run")
    kept = _decisions(result)
    nodes = {n.name: n for n in out.graph.node}
    assert "matmul" not in kept and "dq_a" not in kept and {"pool", "mul", "dq_a_unshared"} <= set(kept)
    assert nodes["matmul"].input[0] == "a_dq" and nodes["mul"].input[0] == nodes["dq_a_unshared"].output[0]
    assert_pairs_adjacent(source, out, result.report.quantization.folded)
    assert result.report.validation.runtime.startswith("ran")
    feeds = {"a": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)}
    for got, expected in zip(run_unfused(emulate_low_precision(out), feeds), run_unfused(source, feeds)):
        np.testing.assert_allclose(got, expected, atol=0.02 + 1e-6)  # at most one output step


@pytest.mark.xfail(strict=True, reason=(
    "onnxruntime's WeightBiasQuantization (level 1, every provider) rewrites a float bias "
    "of DQ -> Conv(DQ weight) -> Q into an int32 DequantizeLinear whose scale is input scale x weight scale "
    "computed in the scales' type; in float16 that product is sub-normal or 0 and the bias is lost"
))
def test_folded_bias_beside_an_integer_weight_keeps_its_values_on_onnxruntime() -> None:
    # tensorrt folds the int32 bias (TensorRT takes biases in float) and keeps the int8 weight's
    # DequantizeLinear (its INT8 Conv reads it): onnxruntime re-quantizes that float16 bias with a
    # float16 scale of 0.0005 x ~0.004 = ~2e-6, sub-normal: the conv's output is off by tens of
    # its own output steps on the CPU provider with default options (bench_qdq: ddddocr_det
    # fp16 tensorrt loses every box there; the same graph runs right with optimizations off).
    _, out = convert(qdq_conv(x_scale=0.0005), target_dtype="fp16", runtime="tensorrt")
    feeds = _feeds()
    session = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in session.get_inputs()}
    got = session.run(None, {k: v.astype(np.float16) if types[k] == "tensor(float16)" else v for k, v in feeds.items()})[0]
    expected = run_unfused(out, feeds)[0]
    assert np.abs(np.asarray(got, np.float32) - expected).max() <= 2 * Y_SCALE


def test_validation_judges_a_float_dequantizing_runtime_without_the_cpu_providers_qdq_rewriting() -> None:
    # The same model through validation: the default CPU run is tens of output steps off (the
    # rewrite above); run again with the provider's QDQ rewriting off it is within float16
    # rounding, and that is what tensorrt runs, so the report takes those figures and says why.
    result, _ = convert(qdq_conv(x_scale=0.0005), target_dtype="fp16", runtime="tensorrt", validate="run")
    v = result.report.validation
    assert v.real_runtime == "onnxruntime CPU (batch 1, QDQ rewriting off)"
    assert all(o.scaled_error is not None and o.scaled_error < 10 * 2**-10 for o in v.real_outputs)
    note = next(n for n in v.notes if "session.disable_quant_qdq" in n)
    assert "with default options differs from the FP32 model by up to" in note and "tensorrt dequantizes" in note
    # Where the CPU provider's integer kernels are the runtime's own, the default run is the real one.
    cpu, _ = convert(qdq_conv(x_scale=0.0005), target_dtype="fp16", runtime="ort-cpu", validate="run")
    assert cpu.report.validation.real_runtime == "onnxruntime CPU (batch 1)"


def tie_conv() -> onnx.ModelProto:
    """DQ(x) -> Conv(DQ(w), float bias) -> Q -> DQ y, where x + bias lands just beside half an
    output step: 15.6 and 16.4 units of x scale x w scale, both 16 once the CPU provider's
    rewriting quantizes the bias with that scale, so its integer kernel rounds exact halves."""
    unit = 1 / 256
    initializers = [
        nh.from_array(np.array(1 / 16, np.float32), "xs"), nh.from_array(np.array(0, np.int8), "xz"),
        nh.from_array(np.full((2, 1, 1, 1), 16, np.int8), "wq"), nh.from_array(np.array(1 / 16, np.float32), "ws"),
        nh.from_array(np.array(0, np.int8), "wz"), nh.from_array(np.array([15.6 * unit, 16.4 * unit], np.float32), "b"),
        nh.from_array(np.array(1 / 8, np.float32), "ys"), nh.from_array(np.array(0, np.int8), "yz"),
    ]
    return qdq_conv_group(initializers, [1, 1, 4, 4], [1, 2, 4, 4], bias=True, opset=17)


def test_real_figures_compare_with_the_fp32_model_run_the_same_way() -> None:
    # On values x = k/8 every output of the FP32 model with default options is a whole step (of
    # five) from its plain run: the CPU provider's rewriting, not the conversion. On ort-cpu
    # nothing converts (no float16 Conv), so the conversion's real figure is 0, and the report
    # says how far the runtime moves the FP32 model itself instead of blaming float16.
    source = tie_conv()
    x = ((np.arange(16, dtype=np.float32) % 5) / 8).reshape(1, 1, 4, 4)
    plain = run_unfused(source, {"x": x})[0]
    optimized = ort.InferenceSession(source.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(plain - optimized).max() == pytest.approx(1 / 8)  # the premise: one output step
    result, _ = convert(source, target_dtype="fp16", runtime="ort-cpu", validate="run", data=[{"x": x}])
    v = result.report.validation
    assert v.real_runtime == "onnxruntime CPU (batch 1, against the FP32 model run the same way)"
    assert [o.max_abs_error for o in v.real_outputs] == [0.0]
    note = next(n for n in v.notes if "runs the FP32 model itself" in n)
    assert "with default options runs the FP32 model itself up to 20.00% away from its plain run" in note
    assert not any("differs from the FP32 model by up to" in n for n in v.notes)
    # A runtime that dequantizes in float is judged with the rewriting off, on both models.
    trt, _ = convert(source, target_dtype="fp16", runtime="tensorrt", validate="run", data=[{"x": x}])
    assert trt.report.validation.real_runtime == "onnxruntime CPU (batch 1, QDQ rewriting off)"
    assert [o.max_abs_error for o in trt.report.validation.real_outputs] == [0.0]


# -- the emulation of every Q/DQ form -----------------------------------------------------------------


@pytest.mark.parametrize("target", ["fp16", "bf16"])
@pytest.mark.parametrize("opset", [13, 17, 19, 21, 23, 25, 28])
def test_emulation_runs_every_qdq_form(opset: int, target: str) -> None:
    # onnxruntime's CPU provider has no DequantizeLinear/QuantizeLinear for the opset-28 schema:
    # the emulation maps those to forms it has. The reference is the same model at opset 21.
    source = qdq_conv(opset, int4_block=opset >= 21)
    reference = qdq_conv(21, int4_block=opset >= 21)
    for runtime in ("onnx", "ort-cuda", "tensorrt"):
        result, out = convert(source, target_dtype=target, runtime=runtime)
        assert_pairs_adjacent(source, out, result.report.quantization.folded)
        emulated = emulate_low_precision(out)
        if opset == 28:  # no CPU kernel for the opset-28 schema: contrib ops, folded constants
            domains = {n.domain for n in emulated.graph.node if "Quantize" in n.op_type}
            assert domains == {"com.microsoft"}, domains
        for seed in range(2):
            feeds = _feeds(seed)
            got, expected = run_unfused(emulated, feeds), run_unfused(reference, feeds)
            for g, e in zip(got, expected):
                np.testing.assert_allclose(g, e, atol=2 * Y_SCALE + 0.02 * np.abs(e).max(), err_msg=runtime)


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_model_upgraded_to_opset_28_validates_by_emulation(target: str, tmp_path: Path) -> None:
    # onnxruntime 1.32 has no CPU kernel for DequantizeLinear/QuantizeLinear of the opset-28
    # schema: a bfloat16 model at opset 28 is checked by emulation (the CPU provider runs no
    # bfloat16 anyway) against the opset-21 source; a float16 one fails the real run, and the
    # conversion says so.
    path = tmp_path / "source.onnx"
    onnx.save(qdq_conv(21), str(path))
    if target == "bf16":
        result = mixprec.convert(path, None, target_dtype=target, runtime="tensorrt", validate="run", opset=28)
        validation = result.report.validation
        assert validation.runtime == "emulated" and validation.outputs
        assert validation.outputs[0].max_abs_error < 2 * Y_SCALE
    else:
        with pytest.raises(mixprec.ValidationFailure, match=r"QuantizeLinear\(28\)"):
            mixprec.convert(path, None, target_dtype=target, runtime="tensorrt", validate="run", opset=28)


def test_cpu_kernel_registry_is_read_with_onnxruntimes_matching_rule() -> None:
    # An open-ended kernel serves its own schema version only (DequantizeLinear: 25+ in 1.32).
    assert cpu_has_kernel("", "DequantizeLinear", 25, {"T1": "tensor(int32)", "T2": "tensor(float)"})
    assert cpu_has_kernel("", "DequantizeLinear", 21, {"T1": "tensor(int32)", "T2": "tensor(float)"})
    assert not cpu_has_kernel("", "DequantizeLinear", 21, {"T1": "tensor(int8)", "T2": "tensor(bfloat16)"})
    if onnx.defs.onnx_opset_version() >= 28 and not cpu_has_kernel("", "DequantizeLinear", 28, {"T1": "tensor(int8)"}):
        with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
            run_unfused(qdq_conv(28), _feeds())


@pytest.mark.parametrize(
    ("dtype", "scale_shape", "axis", "block"),
    [(np.int8, (), 1, 0), (np.int32, (6,), 0, 0), (np.uint8, (4,), 1, 0), (ml_dtypes.int4, (2, 4), 0, 4), (np.int16, (6,), -2, 0)],
)
def test_folded_values_are_bit_identical_to_onnxruntimes_dequantize(dtype: type, scale_shape: tuple, axis: int, block: int) -> None:
    rng = np.random.default_rng(0)
    info = np.iinfo(np.int8 if dtype is ml_dtypes.int4 else dtype)
    low, high = (-8, 8) if dtype is ml_dtypes.int4 else (max(info.min, -100000), min(info.max, 100000))
    x = rng.integers(low, high, (6, 4)).astype(dtype)
    scale = rng.uniform(1e-6, 0.1, scale_shape).astype(np.float32)
    zero_point = rng.integers(0, 3, scale_shape).astype(dtype)
    attributes = {"axis": axis} | ({"block_size": block} if block else {})
    graph = oh.make_graph(
        [oh.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], **attributes)], "dq", [],
        [oh.make_tensor_value_info("y", FLOAT, [6, 4])],
        [nh.from_array(x, "x"), nh.from_array(scale, "s"), nh.from_array(zero_point, "z")],
    )
    expected = run_unfused(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)]), {})[0]
    np.testing.assert_array_equal(dequantize(x, scale, zero_point, axis, block), expected)


# -- the runtime table ---------------------------------------------------------------------------------


def test_quantized_groups_table_agrees_with_the_runtime_profiles() -> None:
    # TensorRT folds exactly the integer types its DequantizeLinear does not read; ONNX Runtime
    # CUDA folds the ones it dequantizes in float, int16/int32 which its kernel lacks included.
    trt = load_runtime("tensorrt").kernel("", "DequantizeLinear", 21)
    assert trt is not None
    read = {t for types in trt.types.values() for t in types}
    for dtype in quantized_groups("tensorrt").float_dequantize:
        assert f"tensor({dtype.name.lower()})" not in read
    assert "tensor(int8)" in read
    cuda = load_runtime("ort-cuda").kernel("", "DequantizeLinear", 21)
    assert cuda is not None and "tensor(int32)" not in cuda.types["T1"]
    assert {ir.DataType.INT32, ir.DataType.INT8} <= quantized_groups("ort-cuda").float_dequantize
    assert quantized_groups("ort-cpu").float_dequantize == frozenset()
    assert quantized_groups("onnx") is quantized_groups("no-such-runtime")  # the default


_ENTRY = {"float_dequantize": [], "group_scales": ["float"], "fp32_groups": [], "integer_groups": [], "qdq_scales": ["float"], "fp32_readers": [], "source": "x"}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({**_ENTRY, "fp32_readers": None}, "missing key 'fp32_readers'"),
        ({**_ENTRY, "qdq_scales": None}, "missing key 'qdq_scales'"),
        ({**_ENTRY, "float_dequantize": ["float"]}, "integer types only"),
        ({**_ENTRY, "group_scales": ["int8"]}, "unknown type 'int8'"),
        ({**_ENTRY, "extra": 1}, "unknown key 'extra'"),
        ({**_ENTRY, "integer_groups": ["Concat"]}, "'integer_groups' lists ops of 'fp32_groups' only"),
    ],
)
def test_quantized_groups_table_is_parsed_strictly(entry: dict, message: str) -> None:
    entry = {key: value for key, value in entry.items() if value is not None}
    with pytest.raises(PolicyError, match=message):
        parse_quantized_groups({"default": entry}, "t.toml")


# -- real models -------------------------------------------------------------------------------------


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


@pytest.mark.parametrize(("target", "runtime"), [("fp16", "ort-cuda"), ("fp16", "tensorrt"), ("bf16", "tensorrt")])
def test_quantized_cnn_groups_in_16_bits(
    quantized_squeezenet: tuple[Path, Path], target: str, runtime: str, tmp_path: Path  # noqa: F811
) -> None:
    int32_bias, _ = quantized_squeezenet
    source = onnx.load(str(int32_bias))
    out_path = tmp_path / "out.onnx"
    result = mixprec.convert(int32_bias, out_path, target_dtype=target, runtime=runtime, validate="run")
    out = onnx.load(str(out_path))
    check_full(out)
    q = result.report.quantization
    assert_pairs_adjacent(source, out, q.folded, q.on_integers)
    assert result.report.casts_runtime == 0
    # Every group converts but the 8 Concat ones, which onnxruntime's CPU provider cannot load in
    # 16 bits: on ort-cuda they are written on integers, on tensorrt (no int8 Concat) they stay
    # FP32. Every int32 bias is folded, and on ort-cuda the int8 weights too.
    if runtime == "ort-cuda":
        assert len(q.on_integers) == 8 and "Concat" not in q.quantized_ops
        assert q.quantized_low == sum(q.quantized_ops.values())
    else:
        assert not q.on_integers and q.quantized_ops["Concat"] == 8
        assert q.quantized_low == sum(q.quantized_ops.values()) - q.quantized_ops["Concat"]
    assert len(q.folded) == (52 if runtime == "ort-cuda" else 26)
    kept = {t.name: t for t in out.graph.initializer}
    for t in source.graph.initializer:
        if t.data_type in (TensorProto.INT8, TensorProto.UINT8, TensorProto.INT32) and t.name in kept:
            assert kept[t.name] == t
    emulated = emulate_low_precision(out)
    rng = np.random.default_rng(5)
    for _ in range(4):
        feeds = {"data_0": rng.uniform(0, 1, (1, 3, 224, 224)).astype(np.float32)}
        expected = run_unfused(source, feeds)[0]
        got = run_unfused(emulated, feeds)[0]
        assert got.argmax() == expected.argmax() and _cosine(got, expected) > 0.999
        if target == "fp16" and runtime == "ort-cuda":  # for real on the CPU provider, default options
            real = run(out, feeds)[0]
            assert real.argmax() == expected.argmax() and _cosine(real, expected) > 0.999


def speech_encoder_qdq(folder: Path, opset: int = 17) -> Path:
    """A Conv1d + GRU + Linear speech encoder from PyTorch (TorchScript export), quantized with
    `quantize_static` (QDQ, per channel, int32 biases)."""
    torch = pytest.importorskip("torch")
    from torch import nn  # noqa: PLC0415

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(16, 32, 3, padding=1)
            self.conv2 = nn.Conv1d(32, 32, 3, padding=1)
            self.gru = nn.GRU(32, 24, batch_first=True)
            self.out = nn.Linear(24, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.conv2(torch.relu(self.conv(x))))
            y, _ = self.gru(h.transpose(1, 2))
            return torch.sigmoid(self.out(y))

    torch.manual_seed(0)
    fp32 = folder / "speech.onnx"
    torch.onnx.export(
        Encoder().eval(), (torch.randn(1, 16, 50),), str(fp32), dynamo=False, opset_version=opset,
        input_names=["x"], output_names=["y"],
    )
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.normal(0, 1, (1, 16, 50)).astype(np.float32)} for _ in range(4)]
    _quantize(fp32, folder / "speech_qdq.onnx", feeds, per_channel=True)
    return folder / "speech_qdq.onnx"


def test_quantized_speech_encoder_validates_on_every_onnxruntime_and_tensorrt_profile(tmp_path: Path) -> None:
    path = speech_encoder_qdq(tmp_path)
    source = onnx.load(str(path))
    rng = np.random.default_rng(3)
    batches = [{"x": rng.normal(0, 1, (1, 16, 50)).astype(np.float32)} for _ in range(3)]
    for runtime in ("onnx", "ort-cpu", "ort-cuda", "ort-dml", "tensorrt"):
        for target in ("bf16", "fp16"):
            result = mixprec.convert(path, tmp_path / "out.onnx", target_dtype=target, runtime=runtime,
                                     validate="run", overwrite=True)
            out = onnx.load(str(tmp_path / "out.onnx"))
            assert_pairs_adjacent(source, out, result.report.quantization.folded)
            emulated = emulate_low_precision(out)
            for feeds in batches:
                got, expected = run_unfused(emulated, feeds)[0], run_unfused(source, feeds)[0]
                assert _cosine(got, expected) > 0.999, (runtime, target)
    for target in ("bf16", "fp16"):
        result = mixprec.convert(path, None, target_dtype=target, runtime="ort-cuda" if target == "fp16" else "tensorrt")
        q = result.report.quantization
        assert q.quantized_low == sum(q.quantized_ops.values())  # Conv, Transpose, MatMul, Add, Sigmoid
    if openvino_available():
        # OpenVINO compiles GRU only with an FP32 dequantized input: that pair stays FP32.
        result = mixprec.convert(path, None, target_dtype="fp16", runtime="openvino", validate="run")
        gru = next(k for k in result.report.kept_fp32 if k.name == "/gru/GRU")
        assert gru.category == "quantized pair" and "only with an FP32 DequantizeLinear input" in gru.reason
