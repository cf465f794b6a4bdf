"""QDQ-quantized models: INT8 where the quantizer put it, 16-bit float elsewhere.

Golden graphs (built here) pin each rule: a DequantizeLinear -> op -> QuantizeLinear chain
converts whole, with its scales, when the runtime has the 16-bit kernels; it stays FP32 whole,
scales included, when the runtime or the scale's values forbid it; no Cast ever separates a
Q/DQ node from the op beside it; zero points and integer tensors are untouched. Real models are
quantized here with onnxruntime's `quantize_static` (QDQ format, calibration on generated data):
a light CNN and a transformer exported from PyTorch.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx.version_converter
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

import mixprec
from helpers import (
    BFLOAT16, FLOAT, FLOAT16, QDQ_K, QDQ_M, QDQ_N, check_full, convert, initializer_types, iter_graphs, qdq_matmul, run,
    run_low,
)
from mixprec.passes.split_dequantize import SUFFIX
from mixprec.report.html import render_html_report
from mixprec.validate.emulate import emulate_low_precision

K, N, M = QDQ_K, QDQ_N, QDQ_M


def _feeds(seed: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).uniform(-2, 2, (2, K)).astype(np.float32)}


def assert_pairs_adjacent(
    source: onnx.ModelProto, converted: onnx.ModelProto, folded: Iterable[str] = (),
    on_integers: Mapping[str, Iterable[str]] | None = None,
) -> None:
    """Every Q/DQ node of `source` is still there but the `folded` ones (DequantizeLinear nodes
    of constants, folded into float constants) and those of groups written on integers
    (`on_integers`: op -> the Q/DQ nodes it replaced; `mixprec.passes.integer_groups`, whose
    requantizations are named `<op>_<DequantizeLinear>_requantized`), besides twins of shared DequantizeLinear nodes
    (`mixprec.passes.split_dequantize`), and no Cast reads a DequantizeLinear's output
    or feeds a QuantizeLinear (in any graph)."""
    def nodes(graph: onnx.GraphProto):  # noqa: ANN202
        for node in graph.node:
            yield node
            for attr in node.attribute:
                for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                    yield from nodes(sub)

    qdq = ("QuantizeLinear", "DequantizeLinear")
    constants = {t.name for graph in iter_graphs(source.graph) for t in graph.initializer}
    gone = set(folded)
    for node in nodes(source.graph):
        if node.name in gone:
            assert node.op_type == "DequantizeLinear" and all(not i or i in constants for i in node.input), node.name
    rewritten = dict(on_integers or {})
    gone.update(name for replaced in rewritten.values() for name in replaced)
    before = sorted(n.name for n in nodes(source.graph) if n.op_type in qdq and n.name not in gone)
    after = list(nodes(converted.graph))
    twins = [n.name for n in after if n.op_type == "DequantizeLinear" and SUFFIX in n.name]  # split_dequantize
    assert all(name.split(SUFFIX)[0] in before for name in twins), twins
    added = [  # the FP32 requantizations of their inputs
        n.name for n in after if n.op_type in qdq and n.name.endswith(("_requantized", "_dequantized"))
        and any(n.name.startswith(f"{op}_") for op in rewritten)
    ]
    assert sorted(n.name for n in after if n.op_type in qdq and n.name not in twins and n.name not in added) == before
    cast_inputs = {n.input[0]: n.name for n in after if n.op_type == "Cast"}
    cast_outputs = {n.output[0]: n.name for n in after if n.op_type == "Cast"}
    for node in after:
        if node.op_type == "DequantizeLinear":
            assert node.output[0] not in cast_inputs, (node.name, cast_inputs[node.output[0]])
        if node.op_type == "QuantizeLinear":
            assert node.input[0] not in cast_outputs, (node.name, cast_outputs[node.input[0]])


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def _decisions(result: mixprec.ConversionResult) -> dict[str, tuple[str, str]]:
    return {k.name: (k.category, k.reason) for k in result.report.kept_fp32}


# -- golden rules --------------------------------------------------------------------------------


def test_dq_op_q_converts_whole_with_its_scales() -> None:
    # TensorRT reads int8 weights in its integer kernels: the weight's DequantizeLinear stays.
    source = qdq_matmul()
    result, out = convert(source, target_dtype="fp16", runtime="tensorrt")
    check_full(out)
    assert_pairs_adjacent(source, out)
    types = initializer_types(out)
    # The dequantized tensors, the quantized MatMul and what its Q reads are float16 ...
    assert types["x_scale_fp16"] == FLOAT16 and types["h_scale"] == FLOAT16
    assert _node(out, "dq_x").input[1] == "x_scale_fp16" and _node(out, "q_h").input[1] == "h_scale"
    # ... the per-channel weight scale rounds element by element, the int8 side is untouched ...
    scale = nh.to_array(next(t for t in out.graph.initializer if t.name == _node(out, "dq_w").input[1]))
    expected = nh.to_array(next(t for t in source.graph.initializer if t.name == "w_scale"))
    assert scale.dtype == np.float16 and scale.shape == (N,)
    np.testing.assert_array_equal(scale, expected.astype(np.float16))
    for name in ("w_q", "w_zp", "x_zp", "h_zp"):
        original = next(t for t in source.graph.initializer if t.name == name)
        assert next(t for t in out.graph.initializer if t.name == name) == original
    # ... the graph input keeps FP32 into its QuantizeLinear (no Cast before it) ...
    assert _node(out, "q_x").input == ["x", "x_scale", "x_zp"]
    assert types["x_scale"] == FLOAT
    # ... and the only casts bring the outputs back to FP32 and feed the float branch.
    assert result.report.casts_runtime == 3
    quantization = result.report.quantization
    assert quantization is not None
    assert quantization.qdq_nodes == {"DequantizeLinear": 3, "QuantizeLinear": 2}
    assert quantization.quantized_ops == {"MatMul": 1} and quantization.quantized_low == 1
    assert quantization.float_low == 2 and quantization.float_low_share == 1.0
    assert "quantized: 3 DequantizeLinear, 2 QuantizeLinear" in result.report.format_text()
    page = render_html_report(result.report)
    assert 'id="quantization"' in page and "100.0%" in page
    assert result.report.to_dict()["quantization"]["float_low_share"] == 1.0
    feeds = _feeds()
    expected_out = run(source, feeds)
    got = run(out, feeds)  # onnxruntime CPU, default graph optimizations
    for g, e in zip(got, expected_out):
        np.testing.assert_allclose(g, e, atol=0.05 * np.abs(e).max())


def test_scale_stays_fp32_where_the_runtime_has_no_16bit_dequantize() -> None:
    # ONNX Runtime's CUDA provider has no bfloat16 DequantizeLinear/QuantizeLinear: the pairs,
    # their scales and the ops between them stay FP32 (no Cast inside a pair); the float branch
    # outside converts.
    source = qdq_matmul()
    result, out = convert(source, target_dtype="bf16", runtime="ort-cuda")
    check_full(out)
    assert_pairs_adjacent(source, out)
    kept = _decisions(result)
    assert kept["dq_x"][0] == "runtime has no 16-bit kernel"
    assert "DequantizeLinear(21) on CUDAExecutionProvider" in kept["dq_x"][1]
    assert kept["matmul_q"][0] == "quantized pair"
    assert "DequantizeLinear 'dq_x'" in kept["matmul_q"][1] or "DequantizeLinear 'dq_w'" in kept["matmul_q"][1]
    assert kept["matmul_float"][0] == "quantized pair"
    assert "matmul_other" not in kept
    types = initializer_types(out)
    assert types["x_scale"] == types["w_scale"] == types["h_scale"] == FLOAT
    assert result.report.quantization.float_low == 1  # matmul_other
    # The same model on a runtime with bfloat16 Q/DQ (TensorRT's strongly typed networks)
    # converts the pairs with bfloat16 scales.
    trt, trt_out = convert(source, target_dtype="bf16", runtime="tensorrt")
    assert_pairs_adjacent(source, trt_out)
    assert "matmul_q" not in _decisions(trt)
    assert initializer_types(trt_out)["h_scale"] == BFLOAT16
    feeds = _feeds()
    expected = run(source, feeds)
    for g, e in zip(run(emulate_low_precision(trt_out), feeds), expected):
        np.testing.assert_allclose(g, e, atol=0.05 * np.abs(e).max())


def test_scale_below_the_16bit_normal_range_keeps_its_pair_fp32() -> None:
    source = qdq_matmul(w_scale=2e-6)  # float16's smallest normal is 6.1e-5
    result, out = convert(source, target_dtype="fp16", runtime="tensorrt")
    assert_pairs_adjacent(source, out)
    kept = _decisions(result)
    assert kept["dq_w"][0] == "out-of-range constant"
    assert "scale 'w_scale' holds 2e-06, below the smallest normal fp16" in kept["dq_w"][1]
    assert kept["matmul_q"][0] == "quantized pair" and "'dq_w'" in kept["matmul_q"][1]
    assert initializer_types(out)["w_scale"] == FLOAT
    # bfloat16 has FP32's exponent range: the same scale converts.
    bf16, bf16_out = convert(source, target_dtype="bf16")
    assert "dq_w" not in _decisions(bf16)
    assert_pairs_adjacent(source, bf16_out)


def test_dequantize_shared_by_a_16bit_and_an_fp32_reader_keeps_both_fp32() -> None:
    # The quantizer shares one DequantizeLinear among its readers: a MatMul (16-bit) and a
    # Softmax (FP32 by policy). No Cast may follow the DQ, so the MatMul stays FP32 with it.
    source = qdq_matmul()
    graph = source.graph
    graph.node.append(oh.make_node("Softmax", ["h_dq"], ["p"], name="softmax", axis=-1))
    graph.output.append(oh.make_tensor_value_info("p", FLOAT, [2, N]))
    onnx.checker.check_model(source, full_check=True)
    result, out = convert(source, target_dtype="fp16", runtime="tensorrt")
    check_full(out)
    assert_pairs_adjacent(source, out)
    kept = _decisions(result)
    assert kept["dq_h"][1] == "DequantizeLinear: some consumers compute in FP32"
    assert kept["matmul_float"][0] == "quantized pair" and "'dq_h'" in kept["matmul_float"][1]
    assert "matmul_q" not in kept  # the first pair still converts


def test_old_opset_upgrades_to_16bit_quantization() -> None:
    source = qdq_matmul(opset=13)  # DequantizeLinear-13 returns float only
    result, out = convert(source, target_dtype="fp16", runtime="tensorrt")
    assert any("opset upgraded from 13 to 19" in n and "DequantizeLinear" in n for n in result.report.notes)
    assert out.opset_import[0].version == 19
    assert_pairs_adjacent(source, out)
    assert "matmul_q" not in _decisions(result)
    pinned, pinned_out = convert(source, target_dtype="fp16", runtime="tensorrt", opset=13)
    assert_pairs_adjacent(source, pinned_out)
    assert _decisions(pinned)["matmul_q"][0] == "quantized pair"


def test_dequantize_23_output_follows_its_scale_unless_output_dtype_says_otherwise() -> None:
    source = qdq_matmul(opset=23)
    result, out = convert(source, target_dtype="fp16", runtime="ort-cpu")
    check_full(out)
    assert_pairs_adjacent(source, out)
    unset = copy.deepcopy(source)  # output_dtype = 0 means "the scale's type"
    next(n for n in unset.graph.node if n.name == "dq_h").attribute.append(oh.make_attribute("output_dtype", 0))
    result, out = convert(unset, target_dtype="fp16")
    check_full(out)
    assert "dq_h" not in _decisions(result)
    pinned = copy.deepcopy(source)
    dq = next(n for n in pinned.graph.node if n.name == "dq_h")
    dq.attribute.append(oh.make_attribute("output_dtype", TensorProto.FLOAT))
    result, out = convert(pinned, target_dtype="fp16")
    check_full(out)
    assert "output_dtype attribute fixes its output type" in _decisions(result)["dq_h"][1]
    assert_pairs_adjacent(pinned, out)


def test_quantized_pair_inside_an_if_branch() -> None:
    body = qdq_matmul().graph
    branch = oh.make_graph(
        [n for n in body.node if n.name != "matmul_other"], "then", [],
        [oh.make_tensor_value_info("y", FLOAT, [2, M])], list(body.initializer),
    )
    other = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w3"], ["y_else"], name="else_matmul")], "else", [],
        [oh.make_tensor_value_info("y_else", FLOAT, [2, M])],
        [next(t for t in body.initializer if t.name == "w3")],
    )
    graph = oh.make_graph(
        [oh.make_node("If", ["cond"], ["out"], name="if", then_branch=branch, else_branch=other)], "if_qdq",
        [oh.make_tensor_value_info("cond", TensorProto.BOOL, []), oh.make_tensor_value_info("x", FLOAT, [2, K])],
        [oh.make_tensor_value_info("out", FLOAT, [2, M])],
    )
    source = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    onnx.checker.check_model(source, full_check=True)
    result, out = convert(source, target_dtype="fp16", runtime="ort-cuda")
    check_full(out)
    assert result.report.quantization.folded == ["dq_w"]  # the branch's weight: ort-cuda dequantizes it in float
    assert_pairs_adjacent(source, out, ["dq_w"])
    assert result.report.quantization.quantized_low == 1
    feeds = {"cond": np.array(True), **_feeds()}
    np.testing.assert_allclose(run(out, feeds)[0], run(source, feeds)[0], atol=0.05 * np.abs(run(source, feeds)[0]).max())


# -- weight-only quantized matrix multiplies -------------------------------------------------------


def _pack_int4(q: np.ndarray) -> np.ndarray:
    """[N, K] values in 0..15 -> [N, K/32, 16] bytes, low nibble first (MatMulNBits' layout)."""
    pairs = q.reshape(q.shape[0], -1, 2).astype(np.uint8)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(q.shape[0], -1, 16)


def test_matmul_nbits_keeps_packed_weights_and_runs_16bit() -> None:
    rng = np.random.default_rng(0)
    k, n, block = 64, 16, 32
    q = rng.integers(0, 16, (n, k))
    scales = rng.uniform(0.01, 0.05, (n, k // block)).astype(np.float32)
    packed = _pack_int4(q)
    node = oh.make_node(
        "MatMulNBits", ["a", "b", "scales"], ["y"], name="mmnb", domain="com.microsoft",
        K=k, N=n, bits=4, block_size=block,
    )
    graph = oh.make_graph(
        [node], "nbits", [oh.make_tensor_value_info("a", FLOAT, [3, k])], [oh.make_tensor_value_info("y", FLOAT, [3, n])],
        [nh.from_array(packed, "b"), nh.from_array(scales.reshape(-1), "scales")],
    )
    source = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21), oh.make_opsetid("com.microsoft", 1)])
    result, out = convert(source, target_dtype="fp16", runtime="ort-cpu")
    assert result.report.low_by_op.get("MatMulNBits") == 1
    types = initializer_types(out)
    assert types["b"] == TensorProto.UINT8 and nh.to_array(next(t for t in out.graph.initializer if t.name == "b")).tobytes() == packed.tobytes()
    assert types[_node(out, "mmnb").input[2]] == FLOAT16
    a = rng.uniform(-1, 1, (3, k)).astype(np.float32)
    weights = (q - 8) * np.repeat(scales, block, axis=1)
    expected = a @ weights.T.astype(np.float32)
    np.testing.assert_allclose(run(source, {"a": a})[0], expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(run(out, {"a": a})[0], expected, atol=0.01 * np.abs(expected).max())


def test_blocked_int4_dequantize_feeds_a_16bit_matmul() -> None:
    rng = np.random.default_rng(0)
    k, n, block = 64, 16, 32
    q = rng.integers(-8, 8, (k, n)).astype(ml_dtypes.int4)
    scales = rng.uniform(0.01, 0.05, (k // block, n)).astype(np.float32)
    nodes = [
        oh.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], name="dq_w4", axis=0, block_size=block),
        oh.make_node("MatMul", ["a", "w"], ["y"], name="matmul"),
    ]
    graph = oh.make_graph(
        nodes, "int4", [oh.make_tensor_value_info("a", FLOAT, [3, k])], [oh.make_tensor_value_info("y", FLOAT, [3, n])],
        [nh.from_array(q, "w_q"), nh.from_array(scales, "w_scale")],
    )
    source = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    onnx.checker.check_model(source, full_check=True)
    result, out = convert(source, target_dtype="fp16", runtime="ort-cuda")
    check_full(out)
    assert_pairs_adjacent(source, out)
    assert result.report.low_by_op == {"DequantizeLinear": 1, "MatMul": 1}
    assert initializer_types(out)["w_q"] == TensorProto.INT4
    a = rng.uniform(-1, 1, (3, k)).astype(np.float32)
    expected = run(source, {"a": a})[0]
    np.testing.assert_allclose(run(out, {"a": a})[0], expected, atol=0.01 * np.abs(expected).max())


def test_block_quantized_embedding_lookup_yields_16bit_rows() -> None:
    rng = np.random.default_rng(0)
    vocab, dim, block = 10, 64, 32
    q = rng.integers(-8, 8, (vocab, dim)).astype(ml_dtypes.int4)
    scales = rng.uniform(0.01, 0.05, (vocab, dim // block)).astype(np.float32)
    w = rng.normal(0, 1, (dim, 8)).astype(np.float32)
    nodes = [
        oh.make_node("GatherBlockQuantized", ["data", "ids", "scales"], ["rows"], name="lookup",
                     domain="com.microsoft", block_size=block, gather_axis=0, quantize_axis=1),
        oh.make_node("MatMul", ["rows", "w"], ["y"], name="matmul"),
    ]
    graph = oh.make_graph(
        nodes, "lookup", [oh.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
        [oh.make_tensor_value_info("y", FLOAT, [2, 3, 8])],
        [nh.from_array(q, "data"), nh.from_array(scales, "scales"), nh.from_array(w, "w")],
    )
    source = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21), oh.make_opsetid("com.microsoft", 1)])
    result, out = convert(source, target_dtype="fp16", runtime="ort-cuda")
    assert result.report.low_by_op == {"GatherBlockQuantized": 1, "MatMul": 1}
    types = initializer_types(out)
    assert types["data"] == TensorProto.INT4 and types["scales"] == FLOAT16
    ids = np.array([[1, 2, 3], [4, 5, 9]], np.int64)
    expected = (q.astype(np.float32) * np.repeat(scales, block, axis=1))[ids] @ w
    np.testing.assert_allclose(run(source, {"ids": ids})[0], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(out, {"ids": ids})[0], expected, atol=0.01 * np.abs(expected).max())


# -- real models, quantized with onnxruntime ----------------------------------------------------------


def _quantize(
    source: Path, target: Path, feeds: list[dict[str, np.ndarray]], operators: bool = False, **options  # noqa: ANN003
) -> onnx.ModelProto:
    """`quantize_static` in the QDQ format (`operators`: the QOperator one, QLinearConv, ...)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static  # noqa: PLC0415

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    quant_format = QuantFormat.QOperator if operators else QuantFormat.QDQ
    quantize_static(str(source), str(target), Reader(), quant_format=quant_format, **options)
    return onnx.load(str(target))


@pytest.fixture(scope="module")
def quantized_squeezenet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """SqueezeNet with seeded weights at opset 13, quantized per channel: once with int32 biases
    (the quantizer's default), once with float biases (as TensorRT deployments quantize)."""
    from test_real_cnns import LIGHT, realistic_weights  # noqa: PLC0415

    folder = tmp_path_factory.mktemp("qdq_cnn")
    model = onnx.version_converter.convert_version(realistic_weights(onnx.load(str(LIGHT / "light_squeezenet.onnx"))), 13)
    weights = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in weights]  # IR 3 listed weights as inputs
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    fp32 = folder / "fp32.onnx"
    onnx.save(model, str(fp32))
    rng = np.random.default_rng(0)
    feeds = [{"data_0": rng.uniform(0, 1, (1, 3, 224, 224)).astype(np.float32)} for _ in range(2)]
    ops = ["Conv", "MaxPool", "Concat", "GlobalAveragePool"]
    _quantize(fp32, folder / "qdq.onnx", feeds, op_types_to_quantize=ops, per_channel=True)
    _quantize(fp32, folder / "qdq_float_bias.onnx", feeds, op_types_to_quantize=ops, per_channel=True,
              extra_options={"QuantizeBias": False})
    _quantize(fp32, folder / "qoperator.onnx", feeds, operators=True, op_types_to_quantize=ops, per_channel=True)
    return folder / "qdq.onnx", folder / "qdq_float_bias.onnx"


def _images(count: int = 2) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"data_0": rng.uniform(0, 1, (1, 3, 224, 224)).astype(np.float32)} for _ in range(count)]


def test_quantized_cnn_fp16_keeps_top1_and_pairs(quantized_squeezenet: tuple[Path, Path], tmp_path: Path) -> None:
    int32_bias, float_bias = quantized_squeezenet
    source = onnx.load(str(float_bias))
    out_path = tmp_path / "fp16.onnx"
    result = mixprec.convert(float_bias, out_path, target_dtype="fp16", validate="run")
    out = onnx.load(str(out_path))
    check_full(out)
    # ONNX Runtime CUDA dequantizes the int8 weights in float: they are folded (26 Conv groups).
    assert len(result.report.quantization.folded) == 26
    assert_pairs_adjacent(source, out, result.report.quantization.folded, result.report.quantization.on_integers)
    report = result.report
    assert report.validation.runtime.startswith("ran")  # onnxruntime CPU, default options, child process
    # Every group converts; the 8 Concat ones are written on integers (onnxruntime's CPU provider
    # fuses their 16-bit form into QLinearConcat, which takes FP32 scales only).
    wrapped = report.quantization.quantized_ops
    assert wrapped["Conv"] == 26 and report.quantization.quantized_low == sum(wrapped.values())
    assert len(report.quantization.on_integers) == 8
    assert report.low_by_op["Conv"] == 26
    for feeds in _images():
        expected, got = run(source, feeds)[0], run(out, feeds)[0]
        assert np.isfinite(got).all()
        assert got.argmax() == expected.argmax()

    # With int32 biases the bias scale (input scale x weight scale, ~1e-5) is below float16's
    # normal range: rounding it alone moves the outputs as far as quantization itself does, so
    # where the bias stays a DequantizeLinear (a runtime without a statement: nothing is folded)
    # those Conv groups keep FP32, and the report says which scale.
    kept = mixprec.convert(int32_bias, None, target_dtype="fp16", runtime="onnx", validate="none")
    assert kept.report.fp32_by_category.get("quantized pair") == 26
    assert any("below the smallest normal fp16" in k.reason for k in kept.report.kept_fp32)
    assert_pairs_adjacent(onnx.load(str(int32_bias)), ir_proto(kept))


def ir_proto(result: mixprec.ConversionResult) -> onnx.ModelProto:
    import onnx_ir as ir  # noqa: PLC0415

    return ir.to_proto(result.model)


def test_quantized_cnn_bf16_emulated_keeps_top1(quantized_squeezenet: tuple[Path, Path], tmp_path: Path) -> None:
    int32_bias, _ = quantized_squeezenet
    source = onnx.load(str(int32_bias))
    out_path = tmp_path / "bf16.onnx"
    result = mixprec.convert(int32_bias, out_path, target_dtype="bf16", runtime="onnx", validate="run")
    out = onnx.load(str(out_path))
    check_full(out)
    assert_pairs_adjacent(source, out)
    assert result.report.quantization.quantized_low == 26
    emulated = emulate_low_precision(out)
    for feeds in _images():
        expected, got = run(source, feeds)[0], run(emulated, feeds)[0]
        assert got.argmax() == expected.argmax()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_quantized_transformer_from_pytorch(target: str, tmp_path: Path) -> None:
    torch_models = pytest.importorskip("torch_models")
    fp32 = torch_models.export(torch_models.make_model(), tmp_path / "encoder.onnx", dynamo=False)
    rng = np.random.default_rng(0)

    def batch() -> dict[str, np.ndarray]:
        return {
            "input_ids": rng.integers(0, torch_models.VOCAB, (2, 6)).astype(np.int64),
            "attention_mask": np.ones((2, 6), np.int64),
        }

    source = _quantize(fp32, tmp_path / "qdq.onnx", [batch() for _ in range(4)], op_types_to_quantize=["MatMul", "Gemm"])
    result = mixprec.convert(tmp_path / "qdq.onnx", tmp_path / "out.onnx", target_dtype=target, runtime="onnx" if target == "bf16" else None, validate="run")
    out = onnx.load(str(tmp_path / "out.onnx"))
    check_full(out)
    assert_pairs_adjacent(source, out, result.report.quantization.folded)
    quantization = result.report.quantization
    assert quantization.quantized_ops.get("MatMul", 0) > 0
    assert quantization.quantized_low == sum(quantization.quantized_ops.values())
    assert quantization.float_low_share is not None and quantization.float_low_share > 0.5
    for _ in range(2):
        feeds = batch()
        expected = run(source, feeds)[0]
        got = run_low(out, feeds, "bfloat16" if target == "bf16" else "float16")[0]
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))  # top-1 per token


def test_ops_computing_on_integers_are_no_float_nodes(quantized_squeezenet: tuple[Path, Path], tmp_path: Path) -> None:
    """The QOperator format (QLinearConv, com.microsoft QLinearConcat, ...) computes on integers and
    reads FP32 only as quantization scales: such ops are counted apart, not as FP32 nodes of an
    unknown op, their scales stay FP32, and the model runs as before."""
    source_path = quantized_squeezenet[0].parent / "qoperator.onnx"
    source = onnx.load(str(source_path))
    integer_ops = [n for n in source.graph.node if n.op_type.startswith("QLinear")]
    assert {n.op_type for n in integer_ops} >= {"QLinearConv", "QLinearConcat"}
    result = mixprec.convert(source_path, tmp_path / "fp16.onnx", target_dtype="fp16", validate="run")
    report = result.report
    assert report.fp32_by_category.get("integer kernel") == len(integer_ops)
    assert "unknown op" not in report.fp32_by_category
    assert not [k for k in report.kept_fp32 if k.op_type.startswith("QLinear")]
    assert f", {len(integer_ops)} computing on integers (FP32 scales only)" in report.format_text()
    assert report.quantization.float_fp32 + report.quantization.float_low < len(integer_ops)
    out = onnx.load(str(tmp_path / "fp16.onnx"))
    check_full(out)
    floats = {t.name for t in out.graph.initializer if t.data_type == TensorProto.FLOAT}
    for node in (n for n in out.graph.node if n.op_type == "QLinearConv"):
        assert {node.input[1], node.input[4], node.input[6]} <= floats  # x, w and y scales
    for feeds in _images():
        expected, got = run(source, feeds)[0], run(out, feeds)[0]
        assert got.argmax() == expected.argmax()
        np.testing.assert_allclose(got, expected, atol=0.02 * np.abs(expected).max())
