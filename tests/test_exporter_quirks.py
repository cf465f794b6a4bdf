"""Golden tests of classes of failures met on third-party exports: each builds the smallest graph
with the exporter's quirk, converts it with default validation (checker, onnxruntime with default
options) and checks the output's numbers."""

from __future__ import annotations

from collections import Counter

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import iter_graphs, run, run_low

from mixprec.validate.emulate import emulate_low_precision

pytestmark = pytest.mark.filterwarnings("ignore")


def _layer_norm(prefix: str, x: str, out: str, index: int, width: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """A LayerNorm written out as ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add, its nodes
    named the way Paddle2ONNX names them (`p2o.<Op>.<n>`: no common path prefix)."""
    rng = np.random.default_rng(index)
    t = f"t{index}_"
    tensors = [
        numpy_helper.from_array(np.array(2.0, np.float32), f"{t}two"),
        numpy_helper.from_array(np.array(1e-5, np.float32), f"{t}eps"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, width).astype(np.float32), f"{t}gamma"),
        numpy_helper.from_array(rng.uniform(-0.1, 0.1, width).astype(np.float32), f"{t}beta"),
    ]
    n = iter(range(10 * index, 10 * index + 10))
    nodes = [
        helper.make_node("ReduceMean", [x], [f"{t}mean"], axes=[-1], name=f"{prefix}.ReduceMean.{next(n)}"),
        helper.make_node("Sub", [x, f"{t}mean"], [f"{t}centered"], name=f"{prefix}.Sub.{next(n)}"),
        helper.make_node("Pow", [f"{t}centered", f"{t}two"], [f"{t}sq"], name=f"{prefix}.Pow.{next(n)}"),
        helper.make_node("ReduceMean", [f"{t}sq"], [f"{t}var"], axes=[-1], name=f"{prefix}.ReduceMean.{next(n)}"),
        helper.make_node("Add", [f"{t}var", f"{t}eps"], [f"{t}vareps"], name=f"{prefix}.Add.{next(n)}"),
        helper.make_node("Sqrt", [f"{t}vareps"], [f"{t}std"], name=f"{prefix}.Sqrt.{next(n)}"),
        helper.make_node("Div", [f"{t}centered", f"{t}std"], [f"{t}normed"], name=f"{prefix}.Div.{next(n)}"),
        helper.make_node("Mul", [f"{t}normed", f"{t}gamma"], [f"{t}scaled"], name=f"{prefix}.Mul.{next(n)}"),
        helper.make_node("Add", [f"{t}scaled", f"{t}beta"], [out], name=f"{prefix}.Add.{next(n)}"),
    ]
    return nodes, tensors


def _two_norm_encoder(opset: int, features: int | str = 16) -> onnx.ModelProto:
    width = 16
    rng = np.random.default_rng(0)
    nodes, tensors = [], []
    for i, (x, out) in enumerate((("x", "n0"), ("h0", "n1"))):
        block, consts = _layer_norm("p2o", x, out, i, width)
        nodes += block
        tensors += consts
        w = numpy_helper.from_array(rng.normal(0, 0.3, (width, width)).astype(np.float32), f"w{i}")
        tensors.append(w)
        nodes.append(helper.make_node("MatMul", [out, f"w{i}"], [f"h{i}"], name=f"p2o.MatMul.{i}"))
    graph = helper.make_graph(
        nodes, "encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, features])],
        [helper.make_tensor_value_info("h1", TensorProto.FLOAT, [2, 5, width])], tensors,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize(("opset", "target"), [(17, "bfloat16"), (12, "bfloat16"), (17, "float16")])
def test_fused_normalizations_get_names_of_their_own(tmp_path, opset: int, target: str) -> None:
    """Paddle2ONNX names give every fused block the same readable name; the converted model
    must still have unique node names (onnxruntime refuses duplicates) and run."""
    model = _two_norm_encoder(opset)
    source = tmp_path / "encoder.onnx"
    onnx.save(model, source)
    result = mixprec.convert(str(source), str(tmp_path / "out.onnx"), target_dtype=target)
    converted = onnx.load(str(tmp_path / "out.onnx"))
    fused = [n for n in converted.graph.node if n.op_type == "LayerNormalization"]
    assert len(fused) == 2, result.report.format_text()
    names = Counter(n.name for g in iter_graphs(converted.graph) for n in g.node if n.name)
    assert not [name for name, count in names.items() if count > 1]
    read = {name for n in converted.graph.node for name in n.input}
    assert [t.name for t in converted.graph.initializer if t.name not in read] == []  # the old affine constants go
    x = np.random.default_rng(1).normal(size=(2, 5, 16)).astype(np.float32)
    expected = run(model, {"x": x})[0]
    actual = run_low(converted, {"x": x}, target)[0]
    np.testing.assert_allclose(actual, expected, atol=0.05 * np.abs(expected).max(), rtol=0)


def test_normalization_over_a_symbolic_width_fuses(tmp_path) -> None:
    """The normalized axis is symbolic (Paddle2ONNX reshapes with computed shapes): the scale's
    own shape gives the normalized shape, and the block fuses instead of staying an FP32 block
    that onnxruntime's LayerNormFusion would fuse with mixed types."""
    model = _two_norm_encoder(17, features="C")
    source = tmp_path / "encoder.onnx"
    onnx.save(model, source)
    result = mixprec.convert(str(source), str(tmp_path / "out.onnx"), target_dtype="bfloat16", runtime="tensorrt")
    assert "normalization block" not in result.report.fp32_by_category
    converted = onnx.load(str(tmp_path / "out.onnx"))
    assert [n.op_type for n in converted.graph.node].count("LayerNormalization") == 2
    # The one between the two products converts; the one reading the graph input may stay FP32
    # where that moves fewer cast bytes.
    assert result.report.low_by_op.get("LayerNormalization", 0) >= 1
    x = np.random.default_rng(1).normal(size=(2, 5, 16)).astype(np.float32)
    expected = run(model, {"x": x})[0]
    np.testing.assert_allclose(run_low(converted, {"x": x}, "bfloat16")[0], expected, atol=0.05 * np.abs(expected).max(), rtol=0)


def _wrong_output_shape() -> onnx.ModelProto:
    """A MatMul whose declared graph-output shape has the wrong rank (the model computes
    [1, 3, 4]; the file says [1, seqlen]), as some exporters write it: onnxruntime runs it."""
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seqlen"])], [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_declared_output_shape_of_the_wrong_rank(tmp_path, target: str) -> None:
    model = _wrong_output_shape()
    source = tmp_path / "crnn.onnx"
    onnx.save(model, source)
    result = mixprec.convert(str(source), str(tmp_path / "out.onnx"), target_dtype=target)
    converted = onnx.load(str(tmp_path / "out.onnx"))
    onnx.checker.check_model(converted, full_check=True)
    dims = [d.dim_value for d in converted.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 4]
    assert any("declared output shape" in note and "'seqlen'" in note for note in result.report.notes)
    x = np.random.default_rng(1).normal(size=(1, 3, 8)).astype(np.float32)
    np.testing.assert_allclose(run_low(converted, {"x": x}, target)[0], run(model, {"x": x})[0], rtol=2e-2, atol=2e-2)


def test_declared_output_shape_that_agrees_keeps_its_names(tmp_path) -> None:
    """A declared shape that says more than inference (a named dimension) stays as it is."""
    model = _wrong_output_shape()
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_param = "three"
    del model.graph.output[0].type.tensor_type.shape.dim[:]
    for dim in (1, "rows", 4):
        d = model.graph.output[0].type.tensor_type.shape.dim.add()
        if isinstance(dim, int):
            d.dim_value = dim
        else:
            d.dim_param = dim
    source = tmp_path / "m.onnx"
    onnx.save(model, source)
    result = mixprec.convert(str(source), str(tmp_path / "out.onnx"), target_dtype="float16")
    converted = onnx.load(str(tmp_path / "out.onnx"))
    dims = [d.dim_param or d.dim_value for d in converted.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, "rows", 4]
    assert not any("declared output shape" in note for note in result.report.notes)


_CULPRIT = "p2o.MatMul.0"


def _repair_with_a_fusion_failure(
    tmp_path, monkeypatch: pytest.MonkeyPatch, fails_with_shapes: bool, declared_types: list[int]  # noqa: ANN001
):  # noqa: ANN202
    """Convert the two-norm encoder to bfloat16 for TensorRT where onnxruntime (faked) fails on
    a fusion through the MatMul `_CULPRIT` in bfloat16 (with the file's intermediate shapes
    declared too, or only without them) and lacks bfloat16 kernels elsewhere; each run's
    number of declared intermediate types goes to `declared_types`."""
    import mixprec.pipeline.repair  # noqa: PLC0415
    import mixprec.validate.staged  # noqa: PLC0415
    from mixprec.runtime.isolated import RuntimeOutcome  # noqa: PLC0415

    def fake_runtime(path, feeds=None, **_options):  # type: ignore[no-untyped-def]
        converted = onnx.load(str(path), load_external_data=False)
        declared_types.append(len(converted.graph.value_info))
        weights = {i.name: i.data_type for i in converted.graph.initializer}
        if weights.get("w0") == TensorProto.BFLOAT16 and (fails_with_shapes or not converted.graph.value_info):
            error = f"Type Error: Type parameter (T) bound to different types in node ({_CULPRIT}/SomeFusion/)."
        elif TensorProto.BFLOAT16 in weights.values():
            error = "NOT_IMPLEMENTED : Could not find an implementation for MatMul(13) node with name 'x'"
        else:  # the FP32 reference
            error = None
        return RuntimeOutcome(loaded=False, ran=False, error=error, crashed=False, outputs=None, seconds=0.0)

    monkeypatch.setattr(mixprec.validate.staged, "run_isolated", fake_runtime)
    monkeypatch.setattr(mixprec.pipeline.repair, "run_isolated", fake_runtime)
    source = tmp_path / "encoder.onnx"
    onnx.save(_two_norm_encoder(17), source)
    return mixprec.convert(str(source), str(tmp_path / "out.onnx"), target_dtype="bfloat16", runtime="tensorrt")


def test_runtime_repair_of_a_bfloat16_model_keeps_only_the_culprit(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime's CPU provider has no bfloat16 kernels: a trial that only lacks them loads
    as far as the check goes, so the repair of a fusion that fails on one 16-bit node keeps
    that node FP32 and nothing else (it once counted every bfloat16 trial as failing)."""
    result = _repair_with_a_fusion_failure(tmp_path, monkeypatch, True, [])
    kept = [k.name for k in result.report.kept_fp32 if k.category == "runtime fails on it"]
    assert kept == [_CULPRIT]
    assert result.report.low_by_op.get("MatMul") == 1
    assert any("kept 1 node(s) FP32" in note and ".mixprec-" not in note for note in result.report.notes)


def test_repair_trials_are_written_as_the_output_is(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnxruntime may fail on a converted model only without the inferred shapes of its
    intermediate values (which the output leaves out): the repair's trials are written the same
    way, so they fail the same way and the culprit is found (trials that declared every shape
    all loaded, and the repair gave up)."""
    declared_types: list[int] = []
    result = _repair_with_a_fusion_failure(tmp_path, monkeypatch, False, declared_types)
    kept = [k.name for k in result.report.kept_fp32 if k.category == "runtime fails on it"]
    assert kept == [_CULPRIT]
    assert len(declared_types) > 3 and not any(declared_types)  # every run: no inferred shapes


def _flax_encoder_layer(width: int = 64) -> onnx.ModelProto:
    """What jax2onnx writes for a Flax LayerNorm below opset 20 (the variance as mean(x*x) -
    mean(x)**2 clamped at 0), then a Dense layer whose output is divided by its root mean
    square, the square written x*x (tf2onnx's Square, jax2onnx's x**2; no epsilon: no RMSNorm
    block)."""
    rng = np.random.default_rng(7)
    tensors = [
        numpy_helper.from_array(np.array([-1], np.int64), "axes"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, width).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.uniform(-0.1, 0.1, width).astype(np.float32), "beta"),
        numpy_helper.from_array((rng.standard_normal((width, width)) * 100).astype(np.float32), "w"),
    ]
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["mean"], name="ln_mean"),
        helper.make_node("Sub", ["x", "mean"], ["centered"], name="ln_centered"),
        helper.make_node("Mul", ["x", "x"], ["squared"], name="ln_squared"),
        helper.make_node("ReduceMean", ["squared", "axes"], ["moment"], name="ln_second_moment"),
        helper.make_node("Mul", ["mean", "mean"], ["mean_squared"], name="ln_mean_squared"),
        helper.make_node("Sub", ["moment", "mean_squared"], ["variance"], name="ln_variance"),
        helper.make_node("Max", ["variance", "zero"], ["clamped"], name="ln_nonnegative_variance"),
        helper.make_node("Add", ["clamped", "eps"], ["variance_eps"], name="ln_variance_eps"),
        helper.make_node("Sqrt", ["variance_eps"], ["std"], name="ln_stddev"),
        helper.make_node("Div", ["centered", "std"], ["normalized"], name="ln_normalized"),
        helper.make_node("Mul", ["normalized", "gamma"], ["scaled"], name="ln_scaled"),
        helper.make_node("Add", ["scaled", "beta"], ["normed"], name="ln_shifted"),
        helper.make_node("MatMul", ["normed", "w"], ["h"], name="dense"),
        helper.make_node("Mul", ["h", "h"], ["h2"], name="rms_square"),
        helper.make_node("ReduceMean", ["h2", "axes"], ["mean_square"], name="rms_mean"),
        helper.make_node("Sqrt", ["mean_square"], ["rms"], name="rms_root"),
        helper.make_node("Div", ["h", "rms"], ["y"], name="rms_divide"),
    ]
    graph = helper.make_graph(
        nodes, "flax_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, width])], tensors,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_flax_layer_norm_fuses_and_squares_stay_fp32_on_large_activations(tmp_path) -> None:
    """jax2onnx's LayerNorm (variance as a second moment) fuses into LayerNormalization; a square
    written x*x stays FP32 in float16 as Pow does. On activations of a few thousand (a residual
    stream) the variance's x*x would overflow float16 (> 65504) and zero the block; the Dense
    output's square overflows too, and dividing by its root mean square (inf) would zero the
    output: the converted model keeps the FP32 numbers."""
    model = _flax_encoder_layer()
    out = tmp_path / "block.fp16.onnx"
    result = mixprec.convert(model, str(out), target_dtype="float16")
    converted = onnx.load(out)
    ops = Counter(n.op_type for n in converted.graph.node)
    assert ops["LayerNormalization"] == 1 and ops["ReduceMean"] == 1  # the root mean square's
    kept = {k.name: k.reason for k in result.report.kept_fp32}
    assert "square" in kept["rms_square"] and "dense" not in kept
    feeds = {"x": (np.random.default_rng(0).standard_normal((2, 8, 64)) * 3000).astype(np.float32)}
    expected = run(model, feeds)[0]
    # onnxruntime's CPU kernels widen some float16 ops; the emulation rounds every 16-bit result,
    # as a GPU computes it.
    for actual in (run(converted, feeds)[0], run(emulate_low_precision(converted), feeds)[0]):
        assert np.isfinite(actual).all()
        np.testing.assert_allclose(actual, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


def _equinox_layer_norm(width: int = 64, variant: str = "") -> onnx.ModelProto:
    """What jax2onnx writes for an Equinox LayerNorm, on a dynamic batch: x - mean(x) set to 0 on
    rows whose values are all equal, the mean of its squares taken in double, then a Dense.
    `variant`: "extrema_dropped" reduces the extrema without keeping their axis (the guard then
    broadcasts across rows: no LayerNorm), "double_read" also outputs the squares in double."""
    rng = np.random.default_rng(3)
    tensors = [
        numpy_helper.from_array(np.array([2], np.int64), "axes"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, width).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.uniform(-0.1, 0.1, width).astype(np.float32), "beta"),
        numpy_helper.from_array((rng.standard_normal((width, width)) * 0.1).astype(np.float32), "w"),
    ]
    nodes = [
        helper.make_node("ReduceMean", ["x", "axes"], ["mean"], name="ln_mean"),
        helper.make_node("Sub", ["x", "mean"], ["centered"], name="ln_centered"),
        helper.make_node("ReduceMin", ["x", "axes"], ["row_min"], name="ln_row_min"),
        helper.make_node("ReduceMax", ["x", "axes"], ["row_max"], name="ln_row_max"),
        helper.make_node("Equal", ["row_min", "row_max"], ["equal_extrema"], name="ln_equal_extrema"),
        helper.make_node("Sub", ["mean", "mean"], ["finite_delta"], name="ln_finite_delta"),
        helper.make_node("Equal", ["finite_delta", "zero"], ["finite_row"], name="ln_finite_row"),
        helper.make_node("And", ["equal_extrema", "finite_row"], ["constant_row"], name="ln_constant_row"),
        helper.make_node("Where", ["constant_row", "zero", "centered"], ["stable"], name="ln_stable_centered"),
        helper.make_node("Mul", ["stable", "stable"], ["squared"], name="ln_squared"),
        helper.make_node("Cast", ["squared"], ["squared64"], to=TensorProto.DOUBLE, name="ln_variance_double"),
        helper.make_node("ReduceMean", ["squared64", "axes"], ["variance64"], name="ln_variance_mean"),
        helper.make_node("Cast", ["variance64"], ["variance"], to=TensorProto.FLOAT, name="ln_variance"),
        helper.make_node("Add", ["variance", "eps"], ["variance_eps"], name="ln_variance_eps"),
        helper.make_node("Sqrt", ["variance_eps"], ["std"], name="ln_stddev"),
        helper.make_node("Div", ["stable", "std"], ["normalized"], name="ln_normalized"),
        helper.make_node("Mul", ["normalized", "gamma"], ["scaled"], name="ln_scaled"),
        helper.make_node("Add", ["scaled", "beta"], ["normed"], name="ln_shifted"),
        helper.make_node("MatMul", ["normed", "w"], ["y"], name="dense"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, width])]
    if variant == "extrema_dropped":
        for node in nodes[2:4]:
            node.attribute.append(helper.make_attribute("keepdims", 0))
    if variant == "double_read":
        nodes.append(helper.make_node("ReduceSum", ["squared64", "axes"], ["energy"], name="energy"))
        outputs.append(helper.make_tensor_value_info("energy", TensorProto.DOUBLE, ["batch", 8, 1]))
    batch = width if variant == "extrema_dropped" else "batch"  # rows and columns broadcast alike
    outputs[0] = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8, width])
    graph = helper.make_graph(
        nodes, "equinox_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8, width])],
        outputs, tensors,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_an_equinox_layer_norm_fuses(target: str, tmp_path) -> None:
    """Equinox's LayerNorm as jax2onnx writes it (a guard for constant rows, the variance in
    double) fuses into LayerNormalization with FP32 statistics, on a dynamic batch: the output
    keeps the FP32 numbers, and a constant row (all equal) still normalizes to the bias."""
    model = _equinox_layer_norm()
    out = tmp_path / "block.onnx"
    result = mixprec.convert(model, str(out), target_dtype=target)
    converted = onnx.load(out)
    ops = Counter(n.op_type for n in converted.graph.node)
    assert ops["LayerNormalization"] == 1 and not ops["ReduceMean"] and not ops["Where"] and not ops["ReduceMin"]
    assert any(note.startswith("fused 1 decomposed normalization") for note in result.report.notes)
    x = np.random.default_rng(0).standard_normal((3, 8, 64)).astype(np.float32) * 3 + 2
    x[1, 2] = 0.1  # a constant row
    expected = run(model, {"x": x})[0]
    actual = run(emulate_low_precision(converted), {"x": x})[0]
    tol = 2e-2 if target == "float16" else 1e-1
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * np.abs(expected).max())
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_allclose(run(converted if target == "float16" else emulate_low_precision(converted), {"x": x})[0][1, 2],
                               weights["beta"] @ weights["w"], atol=1e-2)


@pytest.mark.parametrize("variant", ["extrema_dropped", "double_read"])
def test_what_only_looks_like_an_equinox_layer_norm_stays_as_it_is(variant: str, tmp_path) -> None:
    """No LayerNorm where the guard's extrema drop their axis (the guard then mixes rows; what
    follows it is a root mean square, and may fuse as one) and no fusion where another node
    reads the squares in double; the converted model keeps the FP32 numbers."""
    width = 8 if variant == "extrema_dropped" else 64
    model = _equinox_layer_norm(width, variant)
    out = tmp_path / "block.onnx"
    result = mixprec.convert(model, str(out), target_dtype="float16")
    converted = onnx.load(out)
    assert "LayerNormalization" not in {n.op_type for n in converted.graph.node}
    if variant == "double_read":
        assert not any(note.startswith("fused") for note in result.report.notes)
    x = np.random.default_rng(1).standard_normal((width if width == 8 else 3, 8, width)).astype(np.float32)
    x[0, 3] = 0.5  # a constant row
    for expected, actual in zip(run(model, {"x": x}), run(emulate_low_precision(converted), {"x": x})):
        np.testing.assert_allclose(actual, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


def _unsorted_model() -> onnx.ModelProto:
    """MatMul -> Relu -> MatMul, then an If whose branches read the last MatMul's output, all
    written in reverse, as a graph editor may leave a model (onnxruntime sorts a main graph
    as it loads it, not a subgraph; the ONNX checker refuses it)."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"w{i}") for i in range(2)]
    branch = helper.make_graph(
        [
            helper.make_node("Mul", ["h", "h"], ["t"], name="b_mul"),
            helper.make_node("Neg", ["t"], ["b_out"], name="b_neg"),
        ],
        "branch", [], [helper.make_tensor_value_info("b_out", TensorProto.FLOAT, [4, 8])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["h"], ["o_out"], name="o_id")],
        "other", [], [helper.make_tensor_value_info("o_out", TensorProto.FLOAT, [4, 8])],
    )
    nodes = [
        helper.make_node("If", ["flag"], ["y"], name="branching", then_branch=branch, else_branch=other),
        helper.make_node("MatMul", ["r", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("MatMul", ["x", "w0"], ["a"], name="mm0"),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]), helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("source", ["file", "proto"])
def test_nodes_out_of_topological_order_are_sorted_not_refused(tmp_path, source: str) -> None:
    model = _unsorted_model()
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(model)
    path = tmp_path / "unsorted.onnx"
    onnx.save(model, path)
    result = mixprec.convert(str(path) if source == "file" else model, tmp_path / "out.onnx", runtime="ort-cuda")
    assert any("not in topological order" in note and "sorted them" in note for note in result.report.notes)
    assert result.report.validation.runtime == "ran and emulated", result.report.validation
    converted = onnx.load(tmp_path / "out.onnx")
    onnx.checker.check_model(converted, full_check=True)
    types = {value.name: value.type.tensor_type.elem_type for value in onnx.shape_inference.infer_shapes(converted).graph.value_info}
    assert types["h"] == TensorProto.FLOAT16, "the MatMuls convert"
    feeds = {"x": np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)}
    for flag in (True, False):
        feeds["flag"] = np.array(flag)
        np.testing.assert_allclose(run(converted, feeds)[0], run(model, feeds)[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("source", ["file", "proto"])
def test_an_unsorted_model_with_another_fault_is_still_refused(tmp_path, source: str) -> None:
    model = _unsorted_model()
    model.graph.initializer.append(model.graph.initializer[0])  # a name given twice
    path = tmp_path / "twice.onnx"
    onnx.save(model, path)
    with pytest.raises(mixprec.errors.ModelLoadError, match="w0"):
        mixprec.convert(str(path) if source == "file" else model, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_an_unsorted_subgraph_is_refused_as_onnxruntime_refuses_it(tmp_path) -> None:
    model = _unsorted_model()
    branch = next(a.g for a in model.graph.node[0].attribute if a.name == "then_branch")
    nodes = list(branch.node)
    del branch.node[:]
    branch.node.extend(reversed(nodes))
    with pytest.raises(mixprec.errors.ModelLoadError, match="topologically sorted"):
        mixprec.convert(model, tmp_path / "out.onnx")


def test_allow_invalid_sorts_too(tmp_path) -> None:
    result = mixprec.convert(_unsorted_model(), tmp_path / "out.onnx", allow_invalid=True)
    assert any("sorted them" in note for note in result.report.notes)
    onnx.checker.check_model(onnx.load(tmp_path / "out.onnx"), full_check=True)


def test_a_graph_with_a_cycle_is_still_refused(tmp_path) -> None:
    model = _unsorted_model()
    model.graph.node[3].input[0] = "h"  # mm0 reads mm1's output, which reads mm0's: a cycle
    path = tmp_path / "cycle.onnx"
    onnx.save(model, path)
    with pytest.raises(mixprec.errors.ModelLoadError, match="not a valid ONNX model"):
        mixprec.convert(str(path), tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def _rms_normalized_matmuls(broken: bool = False, norm: str = "SimplifiedLayerNormalization") -> onnx.ModelProto:
    """MatMul -> `norm` -> MatMul, the norm as onnxruntime's transformer optimizer writes it in
    the ONNX domain: SimplifiedLayerNormalization (its RMSNorm) at opset 17, or
    LayerNormalization at opset 14 (onnxruntime registers it below 17, where ONNX has none)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w0"),
        numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.uniform(-0.5, 0.5, 16).astype(np.float32), "beta"),
    ]
    scales = ["a", "gamma"] if norm == "SimplifiedLayerNormalization" else ["a", "gamma", "beta"]
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["a"], name="mm0"),
        helper.make_node(norm, scales, ["n"], name="rms", axis=-1, epsilon=1e-6),
        helper.make_node("MatMul", ["n", "missing" if broken else "w1"], ["y"], name="mm1"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], inits,
    )
    opset = 17 if norm == "SimplifiedLayerNormalization" else 14
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("norm", ["SimplifiedLayerNormalization", "LayerNormalization"])
def test_onnxruntime_ops_in_the_onnx_domain_are_not_the_checkers_to_refuse(tmp_path, norm: str) -> None:
    model = _rms_normalized_matmuls(norm=norm)
    with pytest.raises(onnx.checker.ValidationError, match=f"No Op registered for {norm} "):
        onnx.checker.check_model(model)
    path = tmp_path / "rms.onnx"
    onnx.save(model, path)
    result = mixprec.convert(str(path), tmp_path / "out.onnx", runtime="ort-cuda")
    report = result.report
    assert report.validation.checker == "passed", report.validation
    assert any(f"{norm}: onnxruntime's own op" in note for note in report.notes), report.notes
    converted = onnx.load(tmp_path / "out.onnx")
    assert {n.op_type: n for n in converted.graph.node}[norm].domain == ""
    # ONNX inference cannot type its output: the file keeps it (the emulation rounds it then).
    declared = {v.name: v.type.tensor_type.elem_type for v in converted.graph.value_info}
    assert declared.get("n") == TensorProto.FLOAT16, declared
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)}
    np.testing.assert_allclose(run(converted, feeds)[0], run(model, feeds)[0], rtol=2e-2, atol=2e-2)


def _both_raw_and_float_data(model: onnx.ModelProto) -> onnx.ModelProto:
    weight = model.graph.initializer[0]
    weight.float_data.extend([0.0] * 256)  # beside its raw_data: an invalid tensor
    return model


@pytest.mark.parametrize("source", ["file", "proto"])
@pytest.mark.parametrize(
    ("fault", "message"),
    [(lambda m: _rms_normalized_matmuls(broken=True), "missing"), (_both_raw_and_float_data, "w0")],
    ids=["undefined input", "raw and float data"],
)
def test_a_model_with_such_ops_and_a_real_fault_is_still_refused(tmp_path, source: str, fault, message: str) -> None:
    model = fault(_rms_normalized_matmuls())
    path = tmp_path / "broken.onnx"
    onnx.save(model, path)
    with pytest.raises(mixprec.errors.ModelLoadError, match=message):
        mixprec.convert(str(path) if source == "file" else model, tmp_path / "out.onnx", runtime="ort-cuda")


def test_such_ops_in_a_function_body_stay_the_checkers_to_refuse(tmp_path) -> None:
    """onnxruntime crashes on SimplifiedLayerNormalization in a function body: such a model is
    refused, as the checker refuses it."""
    model = _rms_normalized_matmuls()
    rms = model.graph.node[1]
    function = helper.make_function(
        "local", "Rms", ["a", "gamma"], ["n"],
        [helper.make_node("SimplifiedLayerNormalization", ["a", "gamma"], ["n"], axis=-1, epsilon=1e-6)],
        [helper.make_opsetid("", 17)],
    )
    model.graph.node[1].CopyFrom(helper.make_node("Rms", list(rms.input), list(rms.output), name="rms_call", domain="local"))
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    with pytest.raises(mixprec.errors.ModelLoadError, match="SimplifiedLayerNormalization"):
        mixprec.convert(model, tmp_path / "out.onnx", runtime="ort-cuda")


@pytest.mark.parametrize("unsorted", [False, True])
def test_such_ops_and_sorting_with_external_data(tmp_path, unsorted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy the checker judges has no folder: external weights stand as graph inputs there
    (the load and the output check find the files, whatever the working directory)."""
    model = _rms_normalized_matmuls()
    if unsorted:
        nodes = list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(reversed(nodes))
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save_model(model, str(folder / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    monkeypatch.chdir(tmp_path)
    result = mixprec.convert(str(folder / "m.onnx"), tmp_path / "out.onnx", runtime="ort-cuda", external_data=True)
    assert result.report.validation.checker == "passed", result.report.validation
    assert result.report.validation.runtime == "ran and emulated"


_LOWEST = float(np.finfo(np.float32).min)  # the mask fill transformers writes: torch.finfo(dtype).min


def _masked_attention(kind: str, shared: str | None = None) -> onnx.ModelProto:
    """q, k, v [2, 4, 8, 16] (batch, heads, sequence, head size) and a key padding mask [2, 8]
    (bool) through attention with an additive bias filled with float32's lowest, as
    onnxscript's onnxruntime fusions leave it:

    * "where": Where(mask, 0, lowest) -> Unsqueeze -> Expand -> ONNX Attention's attn_mask (opset 23);
    * "constant": a causal bias constant -> the attn_mask (no padding mask read);
    * "mha": Where(...) -> com.microsoft MultiHeadAttention's attention_bias, on q, k, v [2, 8, 64];
    * "where-node": as "where", the fill a Constant node's.

    `shared`: the filled bias also feeds an "add" (an arithmetic reader it cannot saturate for),
    or a "cast" to float16 (where it is -inf in the model as given)."""
    rng = np.random.default_rng(7)
    causal = np.where(np.tril(np.ones((8, 8), bool)), 0.0, _LOWEST).astype(np.float32)[None, None]
    tensors = [
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(_LOWEST, np.float32), "lowest"),
        numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
        numpy_helper.from_array(np.array([2, 1, 8, 8], np.int64), "full"),
    ]
    mha = kind == "mha"
    qkv_shape = [2, 8, 64] if mha else [2, 4, 8, 16]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, qkv_shape) for n in "qkv"]
    nodes = [
        helper.make_node("Where", ["mask", "zero", "lowest"], ["fill"], name="fill"),
        helper.make_node("Unsqueeze", ["fill", "axes"], ["rows"], name="rows"),
        helper.make_node("Expand", ["rows", "full"], ["bias"], name="bias"),
    ]
    bias = "causal" if kind == "constant" else "bias"
    if kind != "constant":
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 8]))
    else:
        nodes, tensors = [], [numpy_helper.from_array(causal, "causal")]
    if mha:
        nodes.append(helper.make_node(
            "MultiHeadAttention", ["q", "k", "v", "", "", bias], ["y"], name="attention", domain="com.microsoft", num_heads=4,
        ))
    else:
        nodes.append(helper.make_node("Attention", ["q", "k", "v", bias], ["y"], name="attention"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, qkv_shape)]
    if shared == "add":
        tensors.append(numpy_helper.from_array(rng.normal(size=(2, 1, 1, 8)).astype(np.float32), "offset"))
        nodes.append(helper.make_node("Add", [bias, "offset"], ["shifted"], name="shift"))
        outputs.append(helper.make_tensor_value_info("shifted", TensorProto.FLOAT, [2, 1, 8, 8]))
    elif shared == "cast":
        nodes.append(helper.make_node("Cast", [bias], ["half"], to=TensorProto.FLOAT16, name="half"))
        outputs.append(helper.make_tensor_value_info("half", TensorProto.FLOAT16, [2, 1, 8, 8]))
    if kind == "where-node":
        lowest = next(t for t in tensors if t.name == "lowest")
        tensors.remove(lowest)
        nodes.insert(0, helper.make_node("Constant", [], ["lowest"], value=lowest, name="lowest"))
    graph = helper.make_graph(nodes, "attention", inputs, outputs, tensors)
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model


def _attention_feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if value.name == "mask":  # the second sequence padded after 5 tokens
            feeds["mask"] = np.array([[True] * 8, [True] * 5 + [False] * 3])
        else:
            feeds[value.name] = rng.normal(size=shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("kind", ["where", "constant", "mha", "where-node"])
@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_an_attention_bias_filled_with_float32s_lowest_saturates(kind: str, target: str, tmp_path) -> None:
    """An attention bias filled with float32's lowest (-3.4e38, beyond both 16-bit ranges) kept
    the whole attention FP32. Saturated to the 16-bit lowest, the masked scores still get a
    softmax weight of 0: the attention, and the ops filling and moving the bias, convert, the
    report says what was saturated, and the padded outputs agree with FP32."""
    source = _masked_attention(kind)
    out = tmp_path / "out.onnx"
    result = mixprec.convert(source, out, target_dtype=target, validate="checker")
    report = result.report
    op = "MultiHeadAttention" if kind == "mha" else "Attention"
    assert report.low_by_op.get(op) == 1, report.format_text()
    assert not report.constants_kept_for_range and not report.kept_fp32
    (note,) = [n for n in report.notes if "stored at its largest finite magnitude" in n]
    assert ("causal" if kind == "constant" else "lowest") in note
    converted = onnx.load(str(out))
    stored_tensors = [*converted.graph.initializer, *(n.attribute[0].t for n in converted.graph.node if n.op_type == "Constant")]
    lowest = next(t for t in stored_tensors if t.name in ("causal", "lowest"))
    stored = numpy_helper.to_array(lowest).astype(np.float32)
    limit = float(np.finfo(np.float16).max) if target == "float16" else float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert np.isfinite(stored).all() and stored.min() == -limit
    feeds = _attention_feeds(source)
    expected, got = run(source, feeds)[0], run_low(converted, feeds, target)[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, atol=0.05 if target == "bfloat16" else 0.01)


@pytest.mark.parametrize("shared", ["add", "cast"])
def test_a_mask_fill_also_read_elsewhere_keeps_its_value(shared: str, tmp_path) -> None:
    """Where the filled bias also reaches an Add (where -3.4e38 and -65504 differ) or a Cast to
    float16 (where the model as given makes it -inf), the fill keeps its value: it stays FP32."""
    source = _masked_attention("where", shared=shared)
    result = mixprec.convert(source, tmp_path / "out.onnx", target_dtype="float16", validate="checker")
    assert "lowest" in result.report.constants_kept_for_range
    assert not any("stored at its largest finite magnitude" in n for n in result.report.notes)


def test_a_fill_above_the_16bit_range_is_no_mask_and_keeps_its_value(tmp_path) -> None:
    """A bias filled with float32's largest marks keys that get all the weight; +65504 would keep
    the differences between their scores: it stays FP32 with the attention."""
    source = _masked_attention("mha")
    fill = next(t for t in source.graph.initializer if t.name == "lowest")
    fill.CopyFrom(numpy_helper.from_array(np.array(-_LOWEST, np.float32), "lowest"))
    result = mixprec.convert(source, tmp_path / "out.onnx", target_dtype="float16", validate="checker")
    assert "lowest" in result.report.constants_kept_for_range
    assert not any("stored at its largest finite magnitude" in n for n in result.report.notes)
    feeds = _attention_feeds(source)
    np.testing.assert_allclose(run(onnx.load(str(tmp_path / "out.onnx")), feeds)[0], run(source, feeds)[0], atol=0.01)


def test_a_clip_bound_moved_by_a_where_of_computed_values_keeps_its_value(tmp_path) -> None:
    """Clip(x * 1e6, min=Where(c, lowest, ReduceMin(a @ w))) / 1e6: the Where also moves a 16-bit
    value, so its bound would reach the FP32 Clip (kept FP32: 1e6 overflows float16) as -65504
    through a Cast. The bound keeps its value: the output is FP32's."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Mul", ["x", "big"], ["xb"], name="scale"),
        helper.make_node("MatMul", ["a", "w"], ["aw"], name="project"),
        helper.make_node("ReduceMin", ["aw"], ["lo"], keepdims=0, name="lowest_value"),
        helper.make_node("Where", ["c", "fill", "lo"], ["bound"], name="bound"),
        helper.make_node("Clip", ["xb", "bound"], ["clipped"], name="clip"),
        helper.make_node("Div", ["clipped", "big"], ["y"], name="unscale"),
    ]
    graph = helper.make_graph(
        nodes, "clip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(np.array(_LOWEST, np.float32), "fill"), numpy_helper.from_array(np.array(1e6, np.float32), "big"),
         numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "w")],
    )
    source = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = mixprec.convert(source, tmp_path / "out.onnx", target_dtype="float16", validate="checker")
    assert result.report.low_by_op.get("MatMul") == 1
    feeds = {"x": rng.normal(size=(4, 8)).astype(np.float32), "c": np.array(True), "a": rng.normal(size=(4, 8)).astype(np.float32)}
    np.testing.assert_allclose(run(onnx.load(str(tmp_path / "out.onnx")), feeds)[0], run(source, feeds)[0], rtol=1e-6, atol=1e-7)


def test_a_bound_that_flushes_is_not_called_saturated() -> None:
    """Clip(a @ w, 1e-9) stores its bound as 0 in float16 (it flushes, harmlessly): the note on
    constants stored at the largest finite magnitude does not name it."""
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["aw"], name="project"), helper.make_node("Clip", ["aw", "eps"], ["y"], name="floor")],
        "floor", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "w"), numpy_helper.from_array(np.array(1e-9, np.float32), "eps")],
    )
    result = mixprec.convert(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), None, target_dtype="float16", validate="none")
    assert result.report.low_by_op.get("Clip") == 1
    assert not any("stored at its largest finite magnitude" in n for n in result.report.notes)


def test_a_mask_fill_that_an_fp32_reader_keeps_exact_reaches_no_16bit_reader_as_minus_infinity(tmp_path) -> None:
    """One fill moved to two attentions, one of them excluded (FP32): the ops moving the fill stay
    FP32 for it, so a 16-bit attention would read a Cast of float32's lowest, -inf, whose fully
    masked rows give NaN. That attention stays FP32 too, and both read the exact fill."""
    source = _masked_attention("where")
    graph = source.graph
    graph.node.append(helper.make_node("Attention", ["k", "q", "v", "bias"], ["y2"], name="other"))
    graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [2, 4, 8, 8]))
    result = mixprec.convert(source, tmp_path / "out.onnx", target_dtype="float16", validate="checker", exclude_nodes=["other"])
    reasons = {k.name: k.reason for k in result.report.kept_fp32}
    assert "mask fill" in reasons.get("attention", ""), result.report.format_text()
    converted = onnx.load(str(tmp_path / "out.onnx"))
    assert not [n for n in converted.graph.node if n.op_type == "Cast" and "bias" in n.input[0]]
    feeds = _attention_feeds(source)
    for got, expected in zip(run(converted, feeds), run(source, feeds)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
