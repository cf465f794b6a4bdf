"""Nodes computed from constants alone, which onnxruntime folds into constants when it loads a
model with its CPU provider's kernels (whatever provider runs the rest): where those have no
16-bit kernel for the node, it stays FP32, so that it still folds, instead of running at every
inference (a weight dequantized from int8 as Cast -> Mul by its scale)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from helpers import convert
from mixprec.plan.model import Category, Precision


def _weight_only_int8(rows: int = 64, cols: int = 32) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x @ (Cast(W_int8) * scale) + b, as weight-only int8 exports write it; and its input."""
    rng = np.random.default_rng(0)
    weight = rng.integers(-127, 128, (rows, cols)).astype(np.int8)
    scale = (rng.random((1, cols)) * 0.01 + 0.001).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["w_q"], ["w_f"], to=TensorProto.FLOAT, name="dequant_cast"),
            helper.make_node("Mul", ["w_f", "w_scale"], ["w"], name="dequant_mul"),
            helper.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"),
            helper.make_node("Add", ["xw", "b"], ["y"], name="bias"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", rows])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", cols])],
        [
            numpy_helper.from_array(weight, "w_q"),
            numpy_helper.from_array(scale, "w_scale"),
            numpy_helper.from_array(rng.normal(0, 0.1, cols).astype(np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, {"x": rng.normal(0, 1, (4, rows)).astype(np.float32)}


def _ops_left_after_loading(model: onnx.ModelProto, tmp_path) -> list[str]:  # noqa: ANN001
    """The ops of `model` as onnxruntime holds it once loaded (its default graph
    optimizations, CPU provider)."""
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "loaded.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [node.op_type for node in onnx.load(str(tmp_path / "loaded.onnx")).graph.node]


def test_a_weight_dequantized_from_int8_folds_when_the_model_loads(tmp_path) -> None:  # noqa: ANN001
    """On ort-cuda float16 the dequantizing Mul stays FP32, its result reaches the float16
    MatMul through a Cast, and onnxruntime folds all three into a float16 weight when it loads
    the model; the report counts them apart from the FP32 compute."""
    model, feeds = _weight_only_int8()
    result, out = convert(model, target_dtype="float16", runtime="ort-cuda")
    decisions = {node.name: decision for node, decision in result.plan.decisions.items()}
    assert decisions["dequant_mul"].precision is Precision.FP32
    assert decisions["dequant_mul"].category is Category.FOLDED
    assert "ort-cpu kernels, which have no float16 Mul" in decisions["dequant_mul"].reason
    assert decisions["matmul"].precision is Precision.LOW and decisions["bias"].precision is Precision.LOW

    report = result.report
    assert report.fp32_folded_at_load == 2  # the Cast from int8 and the Mul
    assert report.casts_runtime == 2 and report.casts_folded == 1  # x in, y out; the weight's Cast
    assert "2 computed from constants when the model loads" in report.format_text()
    assert not any(k.name.startswith("dequant") for k in report.kept_fp32)

    # Loaded, nothing of the weight's chain is left to run: it is one float16 constant.
    left = _ops_left_after_loading(out, tmp_path)
    assert "Mul" not in left, left
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, expected, rtol=0, atol=0.02 * np.abs(expected).max())


def test_a_runtime_that_folds_with_its_own_kernels_lowers_the_chain() -> None:
    """TensorRT folds constants itself, in any precision: the dequantizing Mul follows its
    float16 consumer there, as before."""
    model, _ = _weight_only_int8()
    result, _ = convert(model, target_dtype="float16", runtime="tensorrt")
    decisions = {node.name: decision for node, decision in result.plan.decisions.items()}
    assert decisions["dequant_mul"].precision is Precision.LOW
    assert result.report.fp32_folded_at_load == 0


def test_a_constant_chain_beyond_the_16bit_range_is_the_range_rules_to_decide() -> None:
    """A Mul of constants one of which overflows float16 stays FP32 for its range, not as a
    folded node: the range rules come first and say why."""
    model, _ = _weight_only_int8()
    big = numpy_helper.from_array(np.full((1, 32), 1e6, np.float32), "w_scale")
    model.graph.initializer[1].CopyFrom(big)
    result, _ = convert(model, target_dtype="float16", runtime="ort-cuda")
    decision = next(d for n, d in result.plan.decisions.items() if n.name == "dequant_mul")
    assert decision.precision is Precision.FP32 and decision.category is Category.CONSTANT_RANGE


def test_the_folding_table_names_the_kernels_of_each_engine() -> None:
    """onnxruntime folds with its CPU provider's kernels on every provider, and leaves
    DequantizeLinear unfolded; engines the table does not name fold nothing here."""
    from mixprec.policy.profiles import constant_folding, load_runtime

    cuda, cpu = load_runtime("ort-cuda"), load_runtime("ort-cpu")
    folding = constant_folding(cuda)
    assert folding is not None and folding.kernels.name == "ort-cpu" and constant_folding(cpu) == folding
    assert folding.folds_only_in_fp32(cuda, "", "Mul", "tensor(float16)")
    assert not folding.folds_only_in_fp32(cuda, "", "Reshape", "tensor(float16)")  # the CPU has it in float16
    assert not folding.folds(cuda, "", "DequantizeLinear")
    assert not folding.folds(cuda, "com.microsoft", "Gelu") and folding.folds(cpu, "com.microsoft", "Gelu")
    assert constant_folding(load_runtime("tensorrt")) is None and constant_folding(load_runtime("onnx")) is None
