"""Tests for mixprec.validate.emulate and mixprec.runtime.sessions."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mixprec.errors import InputError, ModelLoadError, ValidationError
from mixprec.validate.compare import compare_outputs
from mixprec.validate.emulate import emulate_low_precision, emulate_low_precision_file
from mixprec.runtime.sessions import make_session, run_session

FP16 = TensorProto.FLOAT16
BF16 = TensorProto.BFLOAT16
FLOAT = TensorProto.FLOAT
NP_TYPES = {FP16: np.dtype(np.float16), BF16: np.dtype(ml_dtypes.bfloat16)}
OPSET = 21


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto] = (),
    functions: list[onnx.FunctionProto] = (),
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("local", 1)],
        functions=list(functions),
    )
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def _round(array: np.ndarray, low: int) -> np.ndarray:
    """Round float32 values through the 16-bit type, back to float32."""
    return np.asarray(array, np.float32).astype(NP_TYPES[low]).astype(np.float32)


def _run(model: onnx.ModelProto, tmp_path: Path, feeds: dict, name: str = "m.onnx") -> dict:
    path = tmp_path / name
    onnx.save(model, path)
    return run_session(make_session(path), feeds)


def _assert_ulps(actual: np.ndarray, expected: np.ndarray, low: int, ulps: int = 1) -> None:
    """Values agree within ``ulps`` units in the last place of the 16-bit type."""
    assert actual.shape == expected.shape
    spacing = np.abs(np.spacing(expected.astype(NP_TYPES[low]))).astype(np.float32)
    np.testing.assert_array_less(np.abs(actual - expected), ulps * spacing + 1e-30)


def _assert_only_casts_touch_16bit(model: onnx.ModelProto) -> None:
    """Every 16-bit value in the emulation model is a Cast output consumed by a Cast."""
    low_names: set[str] = set()
    for graph in _all_graphs(model.graph):
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            if vi.type.tensor_type.elem_type in NP_TYPES:
                low_names.add(vi.name)
        for init in graph.initializer:
            assert init.data_type not in NP_TYPES, init.name
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    assert attr.t.data_type not in NP_TYPES, node.name
    for graph in _all_graphs(model.graph):
        for node in graph.node:
            if node.op_type != "Cast":
                assert not low_names & set(node.input), (node.op_type, node.input)
                assert not low_names & set(node.output), (node.op_type, node.output)
            else:
                to = next(a.i for a in node.attribute if a.name == "to")
                assert to in (FLOAT, *NP_TYPES), to
    main = model.graph
    for vi in [*main.input, *main.output]:
        assert vi.type.tensor_type.elem_type not in NP_TYPES, vi.name


def _all_graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    found = [graph]
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found.extend(_all_graphs(attr.g))
            for sub in attr.graphs:
                found.extend(_all_graphs(sub))
    return found


def _dense_model(low: int, rng: np.random.Generator, scale: float = 1.0) -> tuple:
    """x(float) -> Cast(low) -> MatMul W -> Add B -> Relu -> If(sum(x)>0: r*r, else r+0.3)."""
    np_low = NP_TYPES[low]
    weight = (rng.standard_normal((8, 8)) * scale).astype(np_low)
    bias = (rng.standard_normal(8) * scale).astype(np_low)
    then_graph = helper.make_graph(
        [helper.make_node("Mul", ["r", "r"], ["t_out"])],
        "then",
        [],
        [helper.make_tensor_value_info("t_out", low, None)],
    )
    else_graph = helper.make_graph(
        [
            helper.make_node(
                "Constant", [], ["k"], value=numpy_helper.from_array(np.array(0.3, np_low))
            ),
            helper.make_node("Add", ["r", "k"], ["e_out"]),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("e_out", low, None)],
    )
    model = _model(
        [
            helper.make_node("Cast", ["x"], ["xl"], to=low),
            helper.make_node("MatMul", ["xl", "W"], ["mm"]),
            helper.make_node("Add", ["mm", "B"], ["a"]),
            helper.make_node("Relu", ["a"], ["r"]),
            helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
            helper.make_node("Greater", ["s", "zero"], ["c"]),
            helper.make_node("If", ["c"], ["yi"], then_branch=then_graph, else_branch=else_graph),
            helper.make_node("Cast", ["yi"], ["y"], to=FLOAT),
        ],
        [helper.make_tensor_value_info("x", FLOAT, [4, 8])],
        [
            helper.make_tensor_value_info("y", FLOAT, [4, 8]),
            helper.make_tensor_value_info("r", low, [4, 8]),
        ],
        [
            numpy_helper.from_array(weight, "W"),
            numpy_helper.from_array(bias, "B"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
        ],
    )
    return model, weight.astype(np.float32), bias.astype(np.float32)


def _dense_reference(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, low: int) -> tuple:
    """Numpy: each 16-bit op computed in float32 and rounded."""
    mm = _round(_round(x, low) @ weight, low)
    relu = np.maximum(_round(mm + bias, low), 0)
    if x.sum() > 0:
        y = _round(relu * relu, low)
    else:
        y = _round(relu + _round(np.float32(0.3), low), low)
    return y, relu


@pytest.mark.parametrize("low", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["then", "else"])
def test_dense_model_matches_rounded_numpy(tmp_path: Path, low: int, sign: float) -> None:
    rng = np.random.default_rng(1)
    model, weight, bias = _dense_model(low, rng)
    emulated = emulate_low_precision(model)
    onnx.checker.check_model(emulated, full_check=True)
    _assert_only_casts_touch_16bit(emulated)

    x = rng.standard_normal((4, 8)).astype(np.float32)
    x = np.abs(x) * sign
    out = _run(emulated, tmp_path, {"x": x})
    y_ref, r_ref = _dense_reference(x, weight, bias, low)
    assert out["y"].dtype == np.float32 and out["r"].dtype == np.float32
    # Values are 16-bit representable, and equal the reference up to 1 ulp (the
    # float32 MatMul accumulation order may differ from numpy's).
    np.testing.assert_array_equal(out["r"], _round(out["r"], low))
    _assert_ulps(out["r"], r_ref, low)
    _assert_ulps(out["y"], y_ref, low)
    # Rounding is really there: without it the results would differ.
    unrounded = np.maximum(x @ weight + bias, 0)
    assert np.abs(out["r"] - unrounded).max() > 0
    # A model whose value types are all declared gives the same rewrite.
    typed = emulate_low_precision(onnx.shape_inference.infer_shapes(model))
    assert [n.op_type for n in typed.graph.node] == [n.op_type for n in emulated.graph.node]


def test_onnxruntime_optimizations_keep_the_rounding(tmp_path: Path) -> None:
    """No ORT optimization level may fuse away the Cast pairs."""
    rng = np.random.default_rng(6)
    model, weight, bias = _dense_model(BF16, rng)
    path = tmp_path / "emu.onnx"
    onnx.save(emulate_low_precision(model), path)
    x = np.abs(rng.standard_normal((4, 8))).astype(np.float32)
    y_ref, _ = _dense_reference(x, weight, bias, BF16)
    results = [
        run_session(make_session(path, graph_optimization=level), {"x": x})["y"]
        for level in ("disable", "basic", "extended", "all")
    ]
    for result in results:
        np.testing.assert_array_equal(result, results[0])
        _assert_ulps(result, y_ref, BF16)


def test_bf16_matmul_is_rounded_float32_matmul(tmp_path: Path) -> None:
    """bf16 in, bf16 out: inputs rounded on entry, MatMul computed in fp32 then rounded."""
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((16, 5)).astype(ml_dtypes.bfloat16)
    model = _model(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        [helper.make_tensor_value_info("x", BF16, ["batch", 16])],
        [helper.make_tensor_value_info("y", BF16, ["batch", 5])],
        [numpy_helper.from_array(weight, "W")],
    )
    emulated = emulate_low_precision(model)
    onnx.checker.check_model(emulated, full_check=True)
    assert emulated.graph.input[0].type.tensor_type.elem_type == FLOAT
    assert [o.name for o in emulated.graph.output] == ["y"]
    assert emulated.graph.output[0].type.tensor_type.elem_type == FLOAT
    _assert_only_casts_touch_16bit(emulated)

    x = rng.standard_normal((3, 16)).astype(np.float32)  # not bf16-representable
    y = _run(emulated, tmp_path, {"x": x})["y"]
    expected = _round(_round(x, BF16) @ weight.astype(np.float32), BF16)
    _assert_ulps(y, expected, BF16)
    assert np.count_nonzero(y != expected) <= 1  # nearly always bit-exact
    # Without input rounding the result would differ for this data.
    assert not np.array_equal(_round(x @ weight.astype(np.float32), BF16), expected)


def test_fp16_emulation_close_to_onnxruntime_fp16(tmp_path: Path) -> None:
    """ORT CPU runs fp16 ops by upcasting to fp32 (and drops some roundings): close, not equal."""
    rng = np.random.default_rng(3)
    model, _, _ = _dense_model(FP16, rng, scale=0.25)
    x = (rng.standard_normal((4, 8)) * 0.25).astype(np.float32)
    real = _run(model, tmp_path, {"x": x}, "real.onnx")
    emulated = _run(emulate_low_precision(model), tmp_path, {"x": x}, "emu.onnx")
    assert real["r"].dtype == np.float16
    comparisons = compare_outputs(emulated, real)
    assert [c.name for c in comparisons] == ["y", "r"]
    for comparison in comparisons:
        assert comparison.within(atol=1e-3, rtol=1e-3), comparison
        assert comparison.cosine > 0.9999


def test_input_models_are_not_modified() -> None:
    rng = np.random.default_rng(4)
    model, _, _ = _dense_model(BF16, rng)
    before = model.SerializeToString()
    emulate_low_precision(model)
    assert model.SerializeToString() == before

    ir_model = ir.from_proto(model)
    ir_before = ir.to_proto(ir_model).SerializeToString()
    emulated = emulate_low_precision(ir_model)
    assert ir.to_proto(ir_model).SerializeToString() == ir_before
    assert ir_model.graph.initializers["W"].const_value.dtype == ir.DataType.BFLOAT16
    assert emulated.graph.initializer[0].data_type == FLOAT


def test_initializers_and_constants_convert_exactly(tmp_path: Path) -> None:
    values = np.array([1.0, 0.1, -3.3e4, 6.0e-8, 65504.0], np.float16)
    model = _model(
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node(
                "ConstantOfShape",
                ["shape"],
                ["fill"],
                value=numpy_helper.from_array(np.array([0.1], ml_dtypes.bfloat16)),
            ),
            helper.make_node("Cast", ["fill"], ["fill_out"], to=FLOAT),
            helper.make_node("Identity", ["C"], ["c_out"]),
        ],
        [helper.make_tensor_value_info("x", FLOAT, [5])],
        [
            helper.make_tensor_value_info("fill_out", FLOAT, [5]),
            helper.make_tensor_value_info("c_out", FP16, [5]),
        ],
        [numpy_helper.from_array(values, "C")],
    )
    emulated = emulate_low_precision(model)
    onnx.checker.check_model(emulated, full_check=True)
    init = numpy_helper.to_array(emulated.graph.initializer[0])
    assert init.dtype == np.float32
    np.testing.assert_array_equal(init, values.astype(np.float32))
    out = _run(emulated, tmp_path, {"x": np.zeros(5, np.float32)})
    np.testing.assert_array_equal(out["c_out"], values.astype(np.float32))
    np.testing.assert_array_equal(out["fill_out"], np.full(5, _round(np.float32(0.1), BF16)))


def test_castlike_eyelike_random_and_sequences(tmp_path: Path) -> None:
    model = _model(
        [
            helper.make_node("CastLike", ["x", "like"], ["xl"]),
            helper.make_node("EyeLike", ["x"], ["eye"], dtype=FP16),
            helper.make_node("Add", ["xl", "eye"], ["sum"]),
            helper.make_node(
                "RandomUniform", [], ["rand"], dtype=FP16, shape=[64], low=0.0, high=1.0, seed=1.0
            ),
            helper.make_node("SplitToSequence", ["sum"], ["seq"], axis=0, keepdims=1),
            helper.make_node("SequenceAt", ["seq", "one"], ["row1"]),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3, 3]),
            helper.make_tensor_value_info("like", FP16, [1]),
        ],
        [
            helper.make_tensor_value_info("sum", FP16, [3, 3]),
            helper.make_tensor_value_info("rand", FP16, [64]),
            helper.make_tensor_value_info("row1", FP16, [1, 3]),
        ],
        [numpy_helper.from_array(np.array(1, np.int64), "one")],
    )
    emulated = emulate_low_precision(model)
    onnx.checker.check_model(emulated, full_check=True)
    _assert_only_casts_touch_16bit(emulated)
    assert "CastLike" not in {n.op_type for n in emulated.graph.node}
    dtype_attrs = [a.i for n in emulated.graph.node for a in n.attribute if a.name == "dtype"]
    assert dtype_attrs == [FLOAT, FLOAT]

    x = np.array([[1.0001, 2, 3], [4, 5, 6], [7, 8, 2049.0]], np.float64)
    out = _run(emulated, tmp_path, {"x": x, "like": np.zeros(1, np.float32)})
    x16 = x.astype(np.float16).astype(np.float32)  # direct double->fp16 cast
    expected = _round(x16 + np.eye(3, dtype=np.float32), FP16)
    np.testing.assert_array_equal(out["sum"], expected)
    np.testing.assert_array_equal(out["row1"], expected[1:2])
    rand = out["rand"]
    np.testing.assert_array_equal(rand, _round(rand, FP16))
    assert rand.min() >= 0.0 and rand.max() <= 1.0 and len(np.unique(rand)) > 10


def test_function_and_loop_values_are_rounded(tmp_path: Path) -> None:
    # local.Scale(X) = X * k + k with fp16 k: untyped function body, typed after inlining.
    function = helper.make_function(
        "local",
        "Scale",
        ["X"],
        ["Y"],
        [
            helper.make_node(
                "Constant", [], ["k"], value=numpy_helper.from_array(np.array(1.1, np.float16))
            ),
            helper.make_node("Mul", ["X", "k"], ["p"]),
            helper.make_node("Add", ["p", "k"], ["Y"]),
        ],
        [helper.make_opsetid("", OPSET)],
    )
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["acc_in", "factor"], ["scaled"]),
            helper.make_node("Add", ["scaled", "step"], ["acc_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", FP16, [3]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", FP16, [3]),
        ],
    )
    model = _model(
        [
            helper.make_node("Cast", ["x"], ["xl"], to=FP16),
            helper.make_node("Scale", ["xl"], ["scaled_x"], domain="local"),
            helper.make_node("Loop", ["trips", "", "scaled_x"], ["acc"], body=body),
            helper.make_node("Cast", ["acc"], ["y"], to=FLOAT),
        ],
        [helper.make_tensor_value_info("x", FLOAT, [3])],
        [helper.make_tensor_value_info("y", FLOAT, [3])],
        [
            numpy_helper.from_array(np.array(5, np.int64), "trips"),
            numpy_helper.from_array(np.array(1.0009766, np.float16), "factor"),
            numpy_helper.from_array(np.array(0.0999, np.float16), "step"),
        ],
        [function],
    )
    emulated = emulate_low_precision(model)
    onnx.checker.check_model(emulated, full_check=True)
    assert len(emulated.functions) == 0
    _assert_only_casts_touch_16bit(emulated)

    x = np.array([0.3333, 100.7, -7.77], np.float32)
    y = _run(emulated, tmp_path, {"x": x})["y"]
    k = _round(np.float32(1.1), FP16)
    acc = _round(_round(_round(x, FP16) * k, FP16) + k, FP16)
    factor, step = np.float32(np.float16(1.0009766)), np.float32(np.float16(0.0999))
    for _ in range(5):
        acc = _round(_round(acc * factor, FP16) + step, FP16)
    np.testing.assert_array_equal(y, acc)


def test_emulate_file_with_external_data(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((64, 64)).astype(ml_dtypes.bfloat16)
    model = _model(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        [helper.make_tensor_value_info("x", BF16, [2, 64])],
        [helper.make_tensor_value_info("y", BF16, [2, 64])],
        [numpy_helper.from_array(weight, "W")],
    )
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    onnx.save(model, src, save_as_external_data=True, location="model.data", size_threshold=0)
    dst = emulate_low_precision_file(src, tmp_path / "out" / "emulated.onnx")
    assert (dst.parent / "emulated.onnx.data").is_file()

    x = rng.standard_normal((2, 64)).astype(np.float32)
    y = run_session(make_session(dst), {"x": x})["y"]
    expected = _round(_round(x, BF16) @ weight.astype(np.float32), BF16)
    _assert_ulps(y, expected, BF16)
    # The path form of emulate_low_precision loads external data too.
    in_memory = emulate_low_precision(src)
    assert numpy_helper.to_array(in_memory.graph.initializer[0]).dtype == np.float32

    with pytest.raises(InputError, match="is the input model"):
        emulate_low_precision_file(src, src)
    with pytest.raises(ModelLoadError, match="missing.onnx"):
        emulate_low_precision_file(tmp_path / "missing.onnx", tmp_path / "o.onnx")


def test_bfloat16_model_fails_on_cpu_and_names_node(tmp_path: Path) -> None:
    """The reason emulation exists: ORT CPU has no bf16 Add kernel."""
    model = _model(
        [helper.make_node("Add", ["x", "x"], ["y"], name="the_add")],
        [helper.make_tensor_value_info("x", BF16, [2])],
        [helper.make_tensor_value_info("y", BF16, [2])],
    )
    path = tmp_path / "bf16.onnx"
    onnx.save(model, path)
    with pytest.raises(ValidationError) as info:
        make_session(path)
    message = str(info.value)
    assert str(path) in message and "the_add" in message
    assert "\n" not in message


def test_run_session_bfloat16_io_and_feed_casting(tmp_path: Path) -> None:
    model = _model(
        [
            helper.make_node("Cast", ["x"], ["y"], to=FLOAT),
            helper.make_node("Cast", ["h"], ["z"], to=BF16),
        ],
        [
            helper.make_tensor_value_info("x", BF16, [3]),
            helper.make_tensor_value_info("h", FP16, [3]),
        ],
        [
            helper.make_tensor_value_info("y", FLOAT, [3]),
            helper.make_tensor_value_info("z", BF16, [3]),
        ],
    )
    path = tmp_path / "io.onnx"
    onnx.save(model, path)
    session = make_session(path, graph_optimization="disable", intra_op_threads=1)
    data = np.array([1.5, -2.25, 3.0078125], np.float32)
    out = run_session(session, {"x": data.astype(ml_dtypes.bfloat16), "h": data, "extra": data})
    assert list(out) == ["y", "z"]
    np.testing.assert_array_equal(out["y"], _round(data, BF16))
    assert out["z"].dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out["z"].astype(np.float32), _round(_round(data, FP16), BF16))

    with pytest.raises(InputError, match="'h'"):
        run_session(session, {"x": data})


def test_make_session_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="nope.onnx"):
        make_session(tmp_path / "nope.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not a model")
    with pytest.raises(ValidationError, match="garbage.onnx"):
        make_session(garbage)
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", FLOAT, [2])],
        [helper.make_tensor_value_info("y", FLOAT, [2])],
    )
    path = tmp_path / "ok.onnx"
    onnx.save(model, path)
    with pytest.raises(InputError, match="graph_optimization"):
        make_session(path, graph_optimization="max")
    with pytest.raises(InputError, match="NoSuchExecutionProvider"):
        make_session(path, providers=["NoSuchExecutionProvider"])
    session = make_session(path, graph_optimization="all")
    with pytest.raises(ValidationError, match="onnxruntime run failed"):
        run_session(session, {"x": np.zeros(3, np.int64)})
