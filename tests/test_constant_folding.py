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
from mixprec.report.html import render_html_report
from mixprec.tune.flops import fp32_share


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
    assert "(1 of constants, folded when the model loads)" in render_html_report(report)
    # The accuracy search's FP32 share counts what runs: the MatMul and the Add, in float16.
    assert fp32_share(result.plan, {})[0] == 0.0
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
    assert folding.folds_only_in_fp32("", "Mul", 17, "tensor(float16)")
    assert not folding.folds_only_in_fp32("", "Reshape", 17, "tensor(float16)")  # the CPU has it in float16
    # Max has a float16 CPU kernel from opset 12 only: at opset 11 it folds in FP32 alone.
    assert folding.folds_only_in_fp32("", "Max", 11, "tensor(float16)")
    assert not folding.folds_only_in_fp32("", "Max", 13, "tensor(float16)")
    assert not folding.folds("", "DequantizeLinear") and not folding.folds("", "Dropout")
    assert not folding.folds("com.microsoft", "FastGelu")  # other domains stay as they are
    assert constant_folding(load_runtime("tensorrt")) is None and constant_folding(load_runtime("onnx")) is None


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_a_constant_that_flushes_to_zero_still_keeps_its_divisor_fp32() -> None:
    """Where(c, 1e-9, 1) computes from constants alone, but 1e-9 flushes to zero in float16:
    the divisor it feeds keeps FP32 as before, and nothing divides by zero."""
    graph = helper.make_graph(
        [helper.make_node("Where", ["c", "tiny", "one"], ["w"], name="where"),
         helper.make_node("Div", ["x", "w"], ["d"], name="div"),
         helper.make_node("MatMul", ["d", "W"], ["y"], name="mm")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.array([True, True, False, True]), "c"),
         numpy_helper.from_array(np.full(4, 1e-9, np.float32), "tiny"),
         numpy_helper.from_array(np.ones(4, np.float32), "one"),
         numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.array([[1e-6, 2e-6, 3.0, 4e-6]], np.float32)}
    result, out = convert(model, target_dtype="float16", runtime="ort-cuda")
    decisions = {node.name: decision for node, decision in result.plan.decisions.items()}
    assert decisions["div"].precision is Precision.FP32 and decisions["where"].category is not Category.FOLDED
    got = _run(out, feeds)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _run(model, feeds), rtol=1e-3)


def test_a_value_other_rules_hold_fp32_is_no_foldable_constant() -> None:
    """Exp of constants stays FP32 by policy (its values may leave the float16 range): the Mul
    that scales it, and the Add that reads that, follow it in FP32 as before; the values up to
    2e5 are not cast to float16."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Exp", ["e"], ["r"], name="exp"),
         helper.make_node("Mul", ["r", "k"], ["rk"], name="mul"),
         helper.make_node("MatMul", ["x", "W"], ["xw"], name="mm"),
         helper.make_node("Add", ["xw", "rk"], ["y"], name="add")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])],
        [numpy_helper.from_array(np.linspace(0, 11, 16).astype(np.float32), "e"),
         numpy_helper.from_array(np.array(5000, np.float32), "k"),
         numpy_helper.from_array(rng.normal(size=(16, 16)).astype(np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result, out = convert(model, target_dtype="float16", runtime="ort-cuda")
    decisions = {node.name: decision for node, decision in result.plan.decisions.items()}
    assert decisions["mul"].category is Category.FOLLOW and decisions["add"].precision is Precision.FP32
    feeds = {"x": rng.normal(size=(2, 16)).astype(np.float32)}
    got = _run(out, feeds)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _run(model, feeds), rtol=1e-3)


def test_a_mask_fill_moved_by_constant_ops_still_saturates_into_a_16bit_attention() -> None:
    """Where(causal, 0, float32's lowest) -> Tile into MultiHeadAttention's attention bias: the
    fill saturates, the ops moving it follow the attention, which computes in float16 — as
    before; the fill, beyond the range, is no constant that fits."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Where", ["cond", "zero", "fill"], ["wm"], name="where"),
         helper.make_node("Tile", ["wm", "rep"], ["bias"], name="tile"),
         helper.make_node("MatMul", ["x", "Wq"], ["q"], name="mq"),
         helper.make_node("MultiHeadAttention", ["q", "q", "q", "", "", "bias"], ["a"], domain="com.microsoft",
                          num_heads=2, name="mha"),
         helper.make_node("MatMul", ["a", "Wo"], ["y"], name="mo")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
        [numpy_helper.from_array(np.tril(np.ones((1, 1, 4, 4), bool)), "cond"),
         numpy_helper.from_array(np.zeros(1, np.float32), "zero"),
         numpy_helper.from_array(np.array([np.finfo(np.float32).min], np.float32), "fill"),
         numpy_helper.from_array(np.ones(4, np.int64), "rep"),
         numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "Wq"),
         numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "Wo")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    result, _ = convert(model, target_dtype="float16", runtime="ort-cuda")
    decisions = {node.name: decision for node, decision in result.plan.decisions.items()}
    assert decisions["mha"].precision is Precision.LOW
    assert decisions["tile"].precision is Precision.LOW and decisions["where"].category is not Category.FOLDED
    assert result.report.casts_runtime == 2  # the model's input and output only


def test_an_op_whose_cpu_kernel_lacks_float16_at_the_models_opset_folds_in_fp32() -> None:
    """Max has a float16 CPU kernel from opset 12 on: Max of constants at opset 11 stays FP32
    to fold; at opset 13 it folds in float16 and follows its reader."""
    def model(opset: int) -> onnx.ModelProto:
        rng = np.random.default_rng(0)
        graph = helper.make_graph(
            [helper.make_node("Max", ["a", "b"], ["m"], name="max"),
             helper.make_node("MatMul", ["x", "m"], ["y"], name="mm")],
            "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
            [numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "a"),
             numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "b")],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])

    old, _ = convert(model(11), target_dtype="float16", runtime="ort-cuda", opset=11)
    new, _ = convert(model(13), target_dtype="float16", runtime="ort-cuda", opset=13)
    assert next(d for n, d in old.plan.decisions.items() if n.name == "max").category is Category.FOLDED
    assert next(d for n, d in new.plan.decisions.items() if n.name == "max").precision is Precision.LOW
    assert new.report.fp32_folded_at_load == 0  # lowered, and folded in float16: not counted as FP32


def test_a_scale_in_a_constant_node_folds_like_an_initializer() -> None:
    """The scale as a Constant node (as function bodies must write it): the dequantizing Mul
    and the Cast of its result count as folded, as with an initializer."""
    model, _ = _weight_only_int8()
    scale = next(t for t in model.graph.initializer if t.name == "w_scale")
    model.graph.node.insert(0, helper.make_node("Constant", [], ["w_scale"], value=scale, name="scale"))
    model.graph.initializer.remove(scale)
    result, _ = convert(model, target_dtype="float16", runtime="ort-cuda")
    names = {node.name for node in result.plan.folded_nodes}
    assert {"dequant_cast", "dequant_mul", "scale"} <= names
    assert result.report.casts_runtime == 2 and result.report.casts_folded == 1


def test_a_16bit_node_of_constants_the_cpu_cannot_run_is_not_counted_as_folded() -> None:
    """A float16 Mul of float16 constants already in the model: the CPU provider has no float16
    Mul, so onnxruntime leaves it, and what reads it, to run at every inference."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["a", "b"], ["m"], name="mul16"),
         helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT, name="cast"),
         helper.make_node("Add", ["x", "mf"], ["y"], name="add")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.full(4, 0.5, np.float16), "a"), numpy_helper.from_array(np.full(4, 3, np.float16), "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result, _ = convert(model, target_dtype="float16", runtime="ort-cuda")
    assert not {node.name for node in result.plan.folded_nodes} & {"mul16", "cast"}

