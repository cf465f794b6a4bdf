"""Integer semantics: float index arithmetic (sequence lengths, frame counts) stays exact.

Conversions here use the `onnx` runtime profile (the schema alone): the analysis is under test,
not which kernels one runtime lacks.
"""

from __future__ import annotations

import copy

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
import mixprec.pipeline.steps
from mixprec.analysis.integer_semantics import integer_semantics
from mixprec.analysis.typeinfo import infer_types
from mixprec.dtypes import LowPrecision
from mixprec.plan.model import Category, Precision
from mixprec.validate.emulate import emulate_low_precision

FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
TARGETS = [LowPrecision.FLOAT16, LowPrecision.BFLOAT16]
# Sample counts around 12,000-240,000 (about 75-1,500 frames), including exact frame edges.
SAMPLES = sorted({*range(12_000, 240_001, 7_919), 240_000, 240_400, 239_999, 160_400, 160_399})
LENGTHS = np.array([*range(12_000, 240_001, 1_237), 240_000, 159_999, 160_000], dtype=np.int64)


def _const(name: str, value: float | list[int], dtype: int = FLOAT) -> onnx.TensorProto:
    array = np.array(value, dtype=np.float32 if dtype == FLOAT else np.int64)
    return numpy_helper.from_array(array, name)


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _audio_model() -> onnx.ModelProto:
    """Whisper/wav2vec-style length arithmetic, whose float values also scale 16-bit features."""
    rng = np.random.default_rng(0)
    nodes = [
        # frames = floor((N - 400) / 160) + 1 from the dynamic audio length.
        helper.make_node("Shape", ["audio"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "one_i"], ["n"], name="gather_n", axis=0),
        helper.make_node("Cast", ["n"], ["n_f"], name="cast_n", to=FLOAT),
        helper.make_node("Sub", ["n_f", "win"], ["n_sub"], name="sub_win"),
        helper.make_node("Div", ["n_sub", "hop"], ["n_div"], name="div_hop"),
        helper.make_node("Floor", ["n_div"], ["n_floor"], name="floor_n"),
        helper.make_node("Add", ["n_floor", "one_f"], ["frames_f"], name="add_one"),
        helper.make_node("Cast", ["frames_f"], ["frames"], name="cast_frames", to=INT64),
        # The float frame count also normalises 16-bit features (a LOW consumer).
        helper.make_node("MatMul", ["x", "w"], ["feat"], name="matmul"),
        helper.make_node("Div", ["feat", "frames_f"], ["feat_norm"], name="normalise"),
        # Per-utterance lengths: floor(len / 160).
        helper.make_node("Cast", ["lengths"], ["len_f"], name="cast_len", to=FLOAT),
        helper.make_node("Div", ["len_f", "hop"], ["len_div"], name="div_len"),
        helper.make_node("Floor", ["len_div"], ["len_floor"], name="floor_len"),
        helper.make_node("Cast", ["len_floor"], ["out_lengths"], name="cast_out_len", to=INT64),
        helper.make_node("Unsqueeze", ["len_floor", "axis1"], ["len_col"], name="unsqueeze_len"),
        helper.make_node("MatMul", ["xb", "w"], ["feat_b"], name="matmul_b"),
        helper.make_node("Mul", ["feat_b", "len_col"], ["feat_b_scaled"], name="scale_b"),
    ]
    initializers = [
        _const("one_i", 1, INT64),
        _const("axis1", [1], INT64),
        _const("win", 400.0),
        _const("hop", 160.0),
        _const("one_f", 1.0),
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 4)).astype(np.float32), "w"),
    ]
    inputs = [
        helper.make_tensor_value_info("audio", FLOAT, [1, "N"]),
        helper.make_tensor_value_info("lengths", INT64, ["B"]),
        helper.make_tensor_value_info("x", FLOAT, [1, 8]),
        helper.make_tensor_value_info("xb", FLOAT, ["B", 8]),
    ]
    outputs = [
        helper.make_tensor_value_info("frames", INT64, []),
        helper.make_tensor_value_info("out_lengths", INT64, ["B"]),
        helper.make_tensor_value_info("feat_norm", FLOAT, [1, 4]),
        helper.make_tensor_value_info("feat_b_scaled", FLOAT, ["B", 4]),
    ]
    return _model(nodes, inputs, outputs, initializers)


_LENGTH_NODES = {
    "cast_n",
    "sub_win",
    "div_hop",
    "floor_n",
    "add_one",
    "cast_len",
    "div_len",
    "floor_len",
}


def _typed(model: onnx.ModelProto) -> ir.Model:
    ir_model = ir.from_proto(copy.deepcopy(model))
    infer_types(ir_model)
    return ir_model


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _run_lengths(session: ort.InferenceSession) -> tuple[list[int], np.ndarray]:
    x = np.ones((1, 8), np.float32)
    xb = np.ones((len(LENGTHS), 8), np.float32)
    frames = []
    out_lengths = None
    for n in SAMPLES:
        feeds = {"audio": np.zeros((1, n), np.float32), "lengths": LENGTHS, "x": x, "xb": xb}
        got_frames, got_lengths, _, _ = session.run(None, feeds)
        frames.append(int(got_frames))
        out_lengths = got_lengths
    return frames, out_lengths  # type: ignore[return-value]


@pytest.fixture(scope="module")
def audio() -> onnx.ModelProto:
    return _audio_model()


@pytest.fixture(scope="module")
def reference(audio: onnx.ModelProto) -> tuple[list[int], np.ndarray]:
    frames, lengths = _run_lengths(_session(audio))
    assert frames == [(n - 400) // 160 + 1 for n in SAMPLES]
    assert (lengths == LENGTHS // 160).all()
    assert max(frames) >= 1_500 and max(lengths) >= 1_500
    return frames, lengths


def _converted_results(
    model: onnx.ModelProto, target: LowPrecision
) -> tuple[mixprec.ConversionResult, list[tuple[list[int], np.ndarray]]]:
    """Convert, then run the emulated model (and, for float16, the real one)."""
    result = mixprec.convert(copy.deepcopy(model), target_dtype=target, validate="none", runtime="onnx")
    converted = ir.to_proto(result.model)
    # onnxruntime's CPU provider runs float16 elementwise ops in float32 behind inserted casts,
    # so only the emulation (16-bit rounding after every op) shows the 16-bit numerics.
    models = [emulate_low_precision(converted)]
    if target is LowPrecision.FLOAT16:
        models.append(converted)
    return result, [_run_lengths(_session(m)) for m in models]


def test_hazard_without_the_analysis(audio, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """A naive conversion lowers the length arithmetic, and 16 bits get the lengths wrong."""
    monkeypatch.setattr(mixprec.pipeline.steps, "integer_semantics", lambda model, target: {})
    for target in TARGETS:
        result, runs = _converted_results(audio, target)
        lowered = {n.name for n, d in result.plan.decisions.items() if d.precision is Precision.LOW}
        assert _LENGTH_NODES <= lowered, target
        frames, lengths = runs[0]
        assert sum(a != b for a, b in zip(frames, reference[0])) > len(SAMPLES) // 2, target
        assert (lengths != reference[1]).sum() > len(LENGTHS) // 2, target
    # The same arithmetic in NumPy with bfloat16 rounding after each op: 1500 reads as 1504.
    bf16 = ml_dtypes.bfloat16
    assert float(bf16(1500.0)) == 1504.0

    def naive(n: int, dtype: type) -> int:
        value = np.array(n, np.float32).astype(dtype)
        value = ((value - dtype(400)) / dtype(160)).astype(dtype)
        return int(np.floor(value.astype(np.float32)).astype(dtype).astype(np.float32) + 1)

    assert sum(naive(n, bf16) != (n - 400) // 160 + 1 for n in SAMPLES) > len(SAMPLES) // 2
    assert naive(240_400, bf16) != 1_501


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.short_name)
def test_length_arithmetic_is_exact(audio, reference, target: LowPrecision) -> None:
    result, runs = _converted_results(audio, target)
    decisions = {n.name: d for n, d in result.plan.decisions.items()}
    for name in _LENGTH_NODES:
        assert decisions[name].precision is Precision.FP32, name
        assert decisions[name].category is Category.INTEGER, name
    # The compute-heavy part still converts.
    for name in ("matmul", "matmul_b"):
        assert decisions[name].precision is Precision.LOW, name
    for frames, lengths in runs:
        assert frames == reference[0]
        np.testing.assert_array_equal(lengths, reference[1])


def test_report_names_integer_semantics(audio: onnx.ModelProto) -> None:
    result = mixprec.convert(copy.deepcopy(audio), target_dtype="bf16", validate="none", runtime="onnx")
    kept = {k.name: k for k in result.report.kept_fp32}
    assert result.report.fp32_by_category["integer semantics"] == len(_LENGTH_NODES)
    for name in _LENGTH_NODES:
        assert kept[name].category == "integer semantics"
    assert "Shape of 'audio'" in kept["sub_win"].reason
    assert "Cast to int64" in kept["floor_n"].reason
    assert "int64 input 'lengths'" in kept["div_len"].reason
    assert "integers exact only to 256 in bfloat16" in kept["cast_n"].reason
    fp16 = mixprec.convert(copy.deepcopy(audio), target_dtype="fp16", validate="none", runtime="onnx")
    reasons = [k.reason for k in fp16.report.kept_fp32 if k.category == "integer semantics"]
    assert reasons and all("exact only to 2048 in float16" in r for r in reasons)


def _static_dim_model(dim: int | str) -> onnx.ModelProto:
    """Shape(x)[1] / 2 scales 16-bit features and gives an int64 count."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "one_i"], ["n"], name="gather", axis=0),
        helper.make_node("Cast", ["n"], ["n_f"], name="cast", to=FLOAT),
        helper.make_node("Div", ["n_f", "two"], ["half"], name="half"),
        helper.make_node("Cast", ["half"], ["count"], name="count", to=INT64),
        helper.make_node("MatMul", ["z", "w"], ["h"], name="matmul"),
        helper.make_node("Mul", ["h", "half"], ["y"], name="scale"),
    ]
    initializers = [
        _const("one_i", 1, INT64),
        _const("two", 2.0),
        numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", FLOAT, [1, dim]),
        helper.make_tensor_value_info("z", FLOAT, [1, 4]),
    ]
    outputs = [
        helper.make_tensor_value_info("count", INT64, []),
        helper.make_tensor_value_info("y", FLOAT, [1, 4]),
    ]
    return _model(nodes, inputs, outputs, initializers)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.short_name)
def test_small_static_shape_is_proven_exact(target: LowPrecision) -> None:
    assert integer_semantics(_typed(_static_dim_model(64)), target) == {}
    result = mixprec.convert(_static_dim_model(64), target_dtype=target, validate="none", runtime="onnx")
    decisions = {n.name: d for n, d in result.plan.decisions.items()}
    assert decisions["half"].precision is Precision.LOW
    # A dimension too large for exact integers, or a dynamic one, keeps the arithmetic FP32.
    for dim in (3001, "T"):
        forced = integer_semantics(_typed(_static_dim_model(dim)), target)
        assert {n.name for n in forced} == {"cast", "half"}, dim


def _transformer_like() -> onnx.ModelProto:
    """Attention block with dynamic sequence length, shape plumbing, masks and quantised outputs."""
    rng = np.random.default_rng(1)
    d = 16

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, 0.2, shape).astype(np.float32), name)

    nodes = [
        # Integer shape plumbing: reshape to [B, T, d] with dims read from the input.
        helper.make_node("Shape", ["x"], ["xs"], name="shape"),
        helper.make_node("Slice", ["xs", "s0", "s2"], ["bt"], name="bt"),
        helper.make_node("Concat", ["bt", "dd"], ["new_shape"], name="new_shape", axis=0),
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
        helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
        helper.make_node("Div", ["s", "sqrt_d"], ["ss"], name="scale"),
        # A -10000 fill from a bool mask: a large integer constant meeting activations.
        helper.make_node("Where", ["mask", "zero", "neg"], ["bias"], name="mask_bias"),
        helper.make_node("Add", ["ss", "bias"], ["sm"], name="masked"),
        helper.make_node("Add", ["sm", "float_mask"], ["sm2"], name="float_masked"),
        helper.make_node("Softmax", ["sm2"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["a"], name="attn"),
        helper.make_node("Reshape", ["a", "new_shape"], ["ar"], name="reshape"),
        helper.make_node("Add", ["ar", "x"], ["r"], name="residual"),
        helper.make_node("LayerNormalization", ["r", "g", "b"], ["n"], name="ln", axis=-1),
        helper.make_node("MatMul", ["n", "w1"], ["h"], name="fc1"),
        helper.make_node("Div", ["h", "sqrt2"], ["hd"], name="gelu_div"),
        helper.make_node("Erf", ["hd"], ["he"], name="gelu_erf"),
        helper.make_node("Add", ["he", "one"], ["h1"], name="gelu_add"),
        helper.make_node("Mul", ["h", "h1"], ["h2"], name="gelu_mul"),
        helper.make_node("Mul", ["h2", "half"], ["h3"], name="gelu_half"),
        helper.make_node("MatMul", ["h3", "w2"], ["y"], name="fc2"),
        # Argmax-like and quantised outputs: activations meeting a Cast at the end.
        helper.make_node("ArgMax", ["y"], ["pred"], name="argmax", axis=-1, keepdims=0),
        helper.make_node("Sigmoid", ["y"], ["sig"], name="sigmoid"),
        helper.make_node("Mul", ["sig", "q255"], ["sig255"], name="q_scale"),
        helper.make_node("Round", ["sig255"], ["rounded"], name="q_round"),
        helper.make_node("Cast", ["rounded"], ["quant"], name="q_cast", to=TensorProto.UINT8),
        helper.make_node("Mul", ["y", "big"], ["ybig"], name="big_scale"),
        helper.make_node("Floor", ["ybig"], ["yfloor"], name="big_floor"),
        helper.make_node("Cast", ["yfloor"], ["ybins"], name="big_cast", to=INT64),
    ]
    initializers = [
        weight("wq", d, d),
        weight("wk", d, d),
        weight("wv", d, d),
        weight("w1", d, 4 * d),
        weight("w2", 4 * d, d),
        numpy_helper.from_array(np.ones(d, np.float32), "g"),
        numpy_helper.from_array(np.zeros(d, np.float32), "b"),
        _const("sqrt_d", 4.0),
        _const("zero", 0.0),
        _const("neg", -10000.0),
        _const("sqrt2", 1.4142135),
        _const("one", 1.0),
        _const("half", 0.5),
        _const("q255", 255.0),
        _const("big", 4096.0),
        _const("s0", [0], INT64),
        _const("s2", [2], INT64),
        _const("dd", [d], INT64),
    ]
    inputs = [
        helper.make_tensor_value_info("x", FLOAT, ["B", "T", d]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["B", "T", "T"]),
        helper.make_tensor_value_info("float_mask", FLOAT, ["B", "T", "T"]),
    ]
    outputs = [
        helper.make_tensor_value_info("pred", INT64, ["B", "T"]),
        helper.make_tensor_value_info("quant", TensorProto.UINT8, ["B", "T", d]),
        helper.make_tensor_value_info("ybins", INT64, ["B", "T", d]),
    ]
    return _model(nodes, inputs, outputs, initializers)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.short_name)
def test_no_overreach_on_ordinary_networks(target: LowPrecision) -> None:
    model = _transformer_like()
    assert integer_semantics(_typed(model), target) == {}
    result = mixprec.convert(model, target_dtype=target, validate="none", runtime="onnx")
    assert "integer semantics" not in result.report.fp32_by_category
    decisions = {n.name: d for n, d in result.plan.decisions.items()}
    for name in ("q", "scores", "attn", "fc1", "fc2", "q_scale", "big_scale", "big_floor"):
        assert decisions[name].precision is Precision.LOW, name


def test_positions_through_matmul_stay_fp32() -> None:
    """RoPE-style positions: Range over a dynamic length, cast to float, outer product."""
    nodes = [
        helper.make_node("Shape", ["x"], ["xs"], name="shape"),
        helper.make_node("Gather", ["xs", "one_i"], ["t"], name="t"),
        helper.make_node("Range", ["zero_i", "t", "one_i"], ["pos"], name="range"),
        helper.make_node("Cast", ["pos"], ["pos_f"], name="pos_f", to=FLOAT),
        helper.make_node("Unsqueeze", ["pos_f", "ax1"], ["pos_col"], name="pos_col"),
        helper.make_node("MatMul", ["pos_col", "inv_freq"], ["freqs"], name="freqs"),
        helper.make_node("Cos", ["freqs"], ["cos"], name="cos"),
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Mul", ["h", "cos"], ["y"], name="rotate"),
    ]
    inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32).reshape(1, 4)
    initializers = [
        _const("zero_i", 0, INT64),
        _const("one_i", 1, INT64),
        _const("ax1", [1], INT64),
        numpy_helper.from_array(inv_freq, "inv_freq"),
        numpy_helper.from_array(np.ones((8, 4), np.float32), "w"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", FLOAT, [1, "T", 8])],
        [helper.make_tensor_value_info("y", FLOAT, [1, "T", 4])],
        initializers,
    )
    forced = integer_semantics(_typed(model), LowPrecision.BFLOAT16)
    assert {n.name for n in forced} == {"pos_f", "pos_col", "freqs"}
    assert all("Shape of 'x'" in why for why in forced.values())


def test_scale_only_uses_convert() -> None:
    """A dynamic head size or length that only scales activations is left to 16 bits."""
    nodes = [
        helper.make_node("Shape", ["x"], ["head"], name="head_size", start=-1),
        helper.make_node("Cast", ["head"], ["head_f"], name="head_f", to=FLOAT),
        helper.make_node("Sqrt", ["head_f"], ["root"], name="root"),
        helper.make_node("Div", ["one", "root"], ["scale"], name="inv_root"),
        helper.make_node("Shape", ["x"], ["seq"], name="seq_len", start=1, end=2),
        helper.make_node("Cast", ["seq"], ["seq_f"], name="seq_f", to=FLOAT),
        helper.make_node("Transpose", ["x"], ["xt"], name="xt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["x", "xt"], ["s"], name="scores"),
        helper.make_node("Mul", ["s", "scale"], ["ss"], name="scale_scores"),
        helper.make_node("Div", ["ss", "seq_f"], ["sn"], name="per_length"),
        helper.make_node("Softmax", ["sn"], ["y"], name="softmax", axis=-1),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", FLOAT, [1, "T", "D"])],
        [helper.make_tensor_value_info("y", FLOAT, [1, "T", "T"])],
        [_const("one", 1.0)],
    )
    for target in TARGETS:
        assert integer_semantics(_typed(model), target) == {}
        result = mixprec.convert(model, target_dtype=target, validate="none", runtime="onnx")
        decisions = {n.name: d for n, d in result.plan.decisions.items()}
        assert decisions["scale_scores"].precision is Precision.LOW
        assert decisions["per_length"].precision is Precision.LOW


@pytest.mark.parametrize(
    ("dtype", "forced"), [(TensorProto.INT8, False), (TensorProto.INT16, True)]
)
def test_integer_type_ranges_bound_casts(dtype: int, forced: bool) -> None:
    """int8 values (at most 128 in magnitude, 256 after doubling) are exact even in bfloat16."""
    nodes = [
        helper.make_node("Cast", ["q"], ["q_f"], name="q_f", to=FLOAT),
        helper.make_node("Mul", ["q_f", "two"], ["q2"], name="double"),
        helper.make_node("Cast", ["q2"], ["y"], name="y", to=INT64),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("q", dtype, ["n"])],
        [helper.make_tensor_value_info("y", INT64, ["n"])],
        [_const("two", 2.0)],
    )
    names = {n.name for n in integer_semantics(_typed(model), LowPrecision.BFLOAT16)}
    assert names == ({"q_f", "double"} if forced else set())


def test_subgraph_arithmetic_on_outer_lengths() -> None:
    """A branch computing frames from an outer length stays FP32, like the main graph would."""
    then_branch = helper.make_graph(
        [
            helper.make_node("Div", ["n_f", "hop"], ["d"], name="then_div"),
            helper.make_node("Floor", ["d"], ["frames_then"], name="then_floor"),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("frames_then", FLOAT, [])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["n_f"], ["frames_else"], name="else_identity")],
        "else",
        [],
        [helper.make_tensor_value_info("frames_else", FLOAT, [])],
    )
    nodes = [
        helper.make_node("Shape", ["audio"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "one_i"], ["n"], name="gather", axis=0),
        helper.make_node("Cast", ["n"], ["n_f"], name="cast_n", to=FLOAT),
        helper.make_node(
            "If",
            ["flag"],
            ["frames_f"],
            name="branch",
            then_branch=then_branch,
            else_branch=else_branch,
        ),
        helper.make_node("Cast", ["frames_f"], ["frames"], name="cast_frames", to=INT64),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("audio", FLOAT, [1, "N"]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("frames", INT64, [])],
        [_const("one_i", 1, INT64), _const("hop", 160.0)],
    )
    forced = integer_semantics(_typed(model), LowPrecision.BFLOAT16)
    assert {n.name for n in forced} == {"cast_n", "then_div", "then_floor", "else_identity"}
    session_ref = _session(model)
    result = mixprec.convert(model, target_dtype="bf16", validate="none", runtime="onnx")
    emulated = _session(emulate_low_precision(ir.to_proto(result.model)))
    for n in (24_000, 240_000, 240_159):
        for flag in (True, False):
            feeds = {"audio": np.zeros((1, n), np.float32), "flag": np.array(flag)}
            assert emulated.run(None, feeds)[0] == session_ref.run(None, feeds)[0]


@pytest.mark.parametrize("target", [LowPrecision.FLOAT16, LowPrecision.BFLOAT16])
def test_a_constant_beyond_the_16_bit_range_is_not_exact_and_warns_nothing(target: LowPrecision) -> None:
    """A value fixed at a constant the 16-bit type cannot hold (an attention mask's -3.4e38,
    a 1e6 scale) is not exact there; asking says so without a NumPy overflow warning."""
    import warnings

    from mixprec.analysis.value_bounds import ValueBounds

    value = ir.Value(name="big", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1]))
    value.const_value = ir.Tensor(np.array([-3.0e38], np.float32), name="big")
    bounds = ValueBounds({}, target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not bounds.exact(value)
