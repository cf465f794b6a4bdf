"""`mixprec.passes.norm_blocks` alone: which decomposed LayerNorm/RMSNorm blocks are found in a
typed model (and which near-misses are not), and what `fuse_norm_blocks` makes of them at
opsets 17 and 23, checked against the unfused model in onnxruntime."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import run
from onnx import TensorProto, numpy_helper

from mixprec.analysis.typeinfo import infer_types
from mixprec.dtypes import LowPrecision
from mixprec.passes.norm_blocks import (
    FusedKernels,
    NormBlocks,
    find_norm_blocks,
    fuse_norm_blocks,
    opset_for_fusion,
)
from mixprec.policy.profiles import load_runtime

F32 = TensorProto.FLOAT
SHAPE = (2, 3, 8)
EPS = 1e-5
# Reduced intermediates keep a last axis of 1.
_OUT_SHAPES = {name: [*SHAPE[:-1], 1] for name in ("mean", "var", "ve", "std")}


def _const(name: str, value: float | np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _mean(prefix: str, x: str, out: str, axes: Sequence[int], opset: int) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """ReduceMean(keepdims=1) over `axes`: an attribute below opset 18, an input from 18."""
    if opset < 18:
        return oh.make_node("ReduceMean", [x], [out], name=f"{prefix}/{out}", axes=list(axes), keepdims=1), []
    axes_name = f"{out}_axes"
    tensor = numpy_helper.from_array(np.asarray(axes, np.int64), axes_name)
    return oh.make_node("ReduceMean", [x, axes_name], [out], name=f"{prefix}/{out}", keepdims=1), [tensor]


def _model(
    nodes: list[onnx.NodeProto],
    initializers: list[onnx.TensorProto],
    outputs: Sequence[str],
    opset: int,
    tail: bool = False,
) -> onnx.ModelProto:
    """The graph; with `tail`, y is read by a Neg whose result is the output instead."""
    if tail:
        nodes = [*nodes, oh.make_node("Neg", ["y"], ["out"], name="tail/neg")]
        outputs = ["out" if o == "y" else o for o in outputs]
    graph = oh.make_graph(
        nodes, "norm", [oh.make_tensor_value_info("x", F32, list(SHAPE))],
        [oh.make_tensor_value_info(o, F32, _OUT_SHAPES.get(o, list(SHAPE))) for o in outputs], initializers,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 11 if opset >= 23 else 9
    return model


def _layer_norm_tail() -> list[onnx.NodeProto]:
    """var + eps -> Sqrt -> d / std -> * gamma -> + beta -> y."""
    return [
        oh.make_node("Add", ["var", "eps"], ["ve"], name="ln/add_eps"),
        oh.make_node("Sqrt", ["ve"], ["std"], name="ln/sqrt"),
        oh.make_node("Div", ["d", "std"], ["n"], name="ln/div"),
        oh.make_node("Mul", ["n", "gamma"], ["s"], name="ln/mul"),
        oh.make_node("Add", ["s", "beta"], ["y"], name="ln/add_beta"),
    ]


def _layer_norm_constants(rng: np.random.Generator) -> list[onnx.TensorProto]:
    """eps, gamma and beta of :func:`_layer_norm_tail`."""
    return [
        _const("eps", EPS),
        _const("gamma", rng.uniform(0.5, 1.5, SHAPE[-1])), _const("beta", rng.uniform(-0.5, 0.5, SHAPE[-1])),
    ]


def layer_norm(
    opset: int = 17,
    *,
    mean_axes: Sequence[int] = (-1,),
    var_axes: Sequence[int] = (-1,),
    extra_output: str | None = None,
    tail: bool = False,
) -> onnx.ModelProto:
    """x -> ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul(gamma)/Add(beta) -> y."""
    rng = np.random.default_rng(1)
    mean, mean_init = _mean("ln", "x", "mean", mean_axes, opset)
    var, var_init = _mean("ln", "sq", "var", var_axes, opset)
    nodes = [
        mean,
        oh.make_node("Sub", ["x", "mean"], ["d"], name="ln/sub"),
        oh.make_node("Pow", ["d", "two"], ["sq"], name="ln/pow"),
        var,
        *_layer_norm_tail(),
    ]
    inits = [_const("two", 2.0), *_layer_norm_constants(rng), *mean_init, *var_init]
    outputs = ["y"] + ([extra_output] if extra_output else [])
    return _model(nodes, inits, outputs, opset, tail)


def rms_norm(
    opset: int = 17, *, reciprocal: bool = False, axes: Sequence[int] = (-1,), tail: bool = False
) -> onnx.ModelProto:
    """x -> Pow/ReduceMean/Add/Sqrt/Div (or Reciprocal + Mul)/Mul(gamma) -> y."""
    rng = np.random.default_rng(2)
    var, var_init = _mean("rms", "sq", "var", axes, opset)
    if reciprocal:
        divide = [
            oh.make_node("Reciprocal", ["std"], ["inv"], name="rms/reciprocal"),
            oh.make_node("Mul", ["x", "inv"], ["n"], name="rms/mul_inv"),
        ]
    else:
        divide = [oh.make_node("Div", ["x", "std"], ["n"], name="rms/div")]
    nodes = [
        oh.make_node("Pow", ["x", "two"], ["sq"], name="rms/pow"),
        var,
        oh.make_node("Add", ["var", "eps"], ["ve"], name="rms/add_eps"),
        oh.make_node("Sqrt", ["ve"], ["std"], name="rms/sqrt"),
        *divide,
        oh.make_node("Mul", ["n", "gamma"], ["y"], name="rms/mul"),
    ]
    inits = [_const("two", 2.0), _const("eps", EPS), _const("gamma", rng.uniform(0.5, 1.5, SHAPE[-1])), *var_init]
    return _model(nodes, inits, ["y"], opset, tail)


def second_moment_layer_norm(opset: int = 17, *, clamp: bool = True, mean_read_elsewhere: bool = False) -> onnx.ModelProto:
    """Flax's LayerNorm as jax2onnx writes it: the variance is mean(x*x) - mean(x)**2, clamped
    at 0 (`clamp`), and x - mean(x) is divided by sqrt(variance + eps), then gamma and beta.
    With `mean_read_elsewhere` the mean is also a graph output."""
    rng = np.random.default_rng(3)
    mean, mean_init = _mean("ln", "x", "mean", (-1,), opset)
    second, second_init = _mean("ln", "sq", "m2", (-1,), opset)
    nodes = [
        mean,
        oh.make_node("Sub", ["x", "mean"], ["d"], name="ln/center"),
        oh.make_node("Mul", ["x", "x"], ["sq"], name="ln/square"),
        second,
        oh.make_node("Mul", ["mean", "mean"], ["mean_sq"], name="ln/mean_square"),
        oh.make_node("Sub", ["m2", "mean_sq"], ["var_raw" if clamp else "var"], name="ln/variance"),
        *([oh.make_node("Max", ["var_raw", "zero"], ["var"], name="ln/clamp")] if clamp else []),
        *_layer_norm_tail(),
    ]
    inits = [_const("zero", 0.0), *_layer_norm_constants(rng), *mean_init, *second_init]
    return _model(nodes, inits, ["y", "mean"] if mean_read_elsewhere else ["y"], opset)


def scale_shift_layer_norm(shift: str = "neg", affine: bool = True) -> onnx.ModelProto:
    """Keras's LayerNormalization as tf2onnx writes it (TensorFlow's batch_normalization): means
    by GlobalAveragePool over the last axis, g = gamma / sqrt(var + eps) with gamma of shape
    [1, 1, C], and y = x * g + shift, the shift Add(Mul(Neg(mean), g), beta) (`neg`) or
    Sub(beta, Mul(mean, g)) (`sub`); without `affine` no gamma and no beta."""
    rng = np.random.default_rng(4)
    factor = "g" if affine else "inv"
    nodes = [
        oh.make_node("GlobalAveragePool", ["x"], ["mean"], name="ln/mean"),
        oh.make_node("Sub", ["x", "mean"], ["d"], name="ln/difference"),
        oh.make_node("Mul", ["d", "d"], ["sq"], name="ln/squared_difference"),
        oh.make_node("GlobalAveragePool", ["sq"], ["var"], name="ln/variance"),
        oh.make_node("Add", ["var", "eps"], ["ve"], name="ln/add_eps"),
        oh.make_node("Sqrt", ["ve"], ["std"], name="ln/sqrt"),
        oh.make_node("Reciprocal", ["std"], ["inv"], name="ln/rsqrt"),
        *([oh.make_node("Mul", ["inv", "gamma"], ["g"], name="ln/scale")] if affine else []),
        oh.make_node("Mul", ["x", factor], ["xg"], name="ln/mul_x"),
    ]
    if shift == "neg":
        nodes += [
            oh.make_node("Neg", ["mean"], ["neg_mean"], name="ln/neg"),
            oh.make_node("Mul", ["neg_mean", factor], ["mg"], name="ln/mul_mean"),
            *([oh.make_node("Add", ["mg", "beta"], ["b"], name="ln/add_beta")] if affine else []),
            oh.make_node("Add", ["xg", "b" if affine else "mg"], ["y"], name="ln/add"),
        ]
    else:
        nodes += [
            oh.make_node("Mul", ["mean", factor], ["mg"], name="ln/mul_mean"),
            *([oh.make_node("Sub", ["beta", "mg"], ["b"], name="ln/sub_beta")] if affine else []),
            oh.make_node("Add", ["xg", "b"], ["y"], name="ln/add") if affine
            else oh.make_node("Sub", ["xg", "mg"], ["y"], name="ln/sub"),
        ]
    inits = [_const("eps", EPS)]
    if affine:
        inits += [
            _const("gamma", rng.uniform(0.5, 1.5, (1, 1, SHAPE[-1]))),
            _const("beta", rng.uniform(-0.5, 0.5, (1, 1, SHAPE[-1]))),
        ]
    return _model(nodes, inits, ["y"], 17)


def _typed(model: onnx.ModelProto) -> ir.Model:
    onnx.checker.check_model(model, full_check=True)
    typed = ir.from_proto(model)
    infer_types(typed)
    return typed


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32) * 3 + 1}


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


# -- find_norm_blocks ----------------------------------------------------------------------------


def test_finds_layer_norm_with_its_affine_tail() -> None:
    """All nine nodes form one "layer" block over the last axis, with epsilon, gamma and beta."""
    model = _typed(layer_norm())
    [block] = find_norm_blocks(model.graph)
    assert block.kind == "layer"
    assert [n.name for n in block.nodes] == [n.name for n in model.graph]
    assert block.input.name == "x" and block.output.name == "y"
    assert block.axes == [2]
    assert block.epsilon == pytest.approx(EPS)
    assert block.scale is not None and block.scale.name == "gamma"
    assert block.bias is not None and block.bias.name == "beta"
    assert block.name == "ln/LayerNormalization"


@pytest.mark.parametrize("reciprocal", [False, True], ids=["div", "mul-reciprocal"])
def test_finds_rms_norm(reciprocal: bool) -> None:
    """Pow/ReduceMean/Add/Sqrt then Div (or Reciprocal and Mul) and the gamma Mul: an "rms" block
    without bias."""
    model = _typed(rms_norm(reciprocal=reciprocal))
    [block] = find_norm_blocks(model.graph)
    assert block.kind == "rms"
    assert len(block.nodes) == (7 if reciprocal else 6) == len(list(model.graph))
    assert block.input.name == "x" and block.output.name == "y"
    assert block.axes == [2]
    assert block.scale is not None and block.scale.name == "gamma"
    assert block.bias is None
    assert block.name == "rms/RMSNormalization"


def test_reduction_over_a_non_trailing_axis_is_no_block() -> None:
    """Normalizing over axis 1 of a rank-3 tensor is not what the fused ops compute."""
    assert find_norm_blocks(_typed(rms_norm(axes=(1,))).graph) == []
    assert find_norm_blocks(_typed(layer_norm(mean_axes=(1,), var_axes=(1,))).graph) == []


def test_layer_norm_mean_and_variance_over_different_axes_is_no_block() -> None:
    """Mean over the last two axes, variance over the last: no block at all."""
    assert find_norm_blocks(_typed(layer_norm(mean_axes=(-2, -1), var_axes=(-1,))).graph) == []


@pytest.mark.parametrize("intermediate", ["sq", "var", "std"])
def test_statistics_read_elsewhere_is_no_block(intermediate: str) -> None:
    """A statistic that is also a graph output cannot vanish into a fused op."""
    assert find_norm_blocks(_typed(layer_norm(extra_output=intermediate)).graph) == []


@pytest.mark.parametrize("intermediate", ["mean", "d"])
def test_centering_read_elsewhere_leaves_an_rms_norm_of_the_centred_value(intermediate: str) -> None:
    """With the mean or x - mean read elsewhere the centring stays; what follows is an RMSNorm
    of x - mean (its variance is the mean of squares), without the bias Add."""
    [block] = find_norm_blocks(_typed(layer_norm(extra_output=intermediate)).graph)
    assert (block.kind, block.input.name, block.output.name, block.bias) == ("rms", "d", "s", None)
    assert [n.op_type for n in block.nodes] == ["Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul"]


def test_normalized_value_read_elsewhere_ends_the_block_there() -> None:
    """With Div's result also a graph output, the affine Mul/Add stay outside the block."""
    [block] = find_norm_blocks(_typed(layer_norm(extra_output="n")).graph)
    assert (block.kind, block.output.name, block.scale, block.bias) == ("layer", "n", None, None)
    assert len(block.nodes) == 7


def test_square_with_another_exponent_is_no_block() -> None:
    """Pow(x, 3) is no variance."""
    proto = rms_norm()
    proto.graph.initializer[0].CopyFrom(_const("two", 3.0))
    assert find_norm_blocks(_typed(proto).graph) == []


# -- fuse_norm_blocks ----------------------------------------------------------------------------


# A block whose result is read by a node, and one whose result is itself a graph output (a final
# LayerNorm: last_hidden_state).
TAILS = [
    pytest.param(True, id="read-by-a-node"),
    pytest.param(False, id="graph-output"),
]


def _output_name(tail: bool) -> str:
    return "out" if tail else "y"


@pytest.mark.parametrize("tail", TAILS)
def test_layer_norm_fuses_at_opset_17_and_computes_the_same(tail: bool) -> None:
    """One LayerNormalization(axis=2, epsilon, stash_type=1) replaces the block; its output
    keeps the name y, the old gamma/beta go, and onnxruntime gives the same values."""
    proto = layer_norm(17, tail=tail)
    model = _typed(proto)
    result = fuse_norm_blocks(model)
    assert result.fused == ["ln/LayerNormalization"]
    assert result.kept == {} and result.needs_opset == {}
    assert _ops(model) == ["LayerNormalization"] + (["Neg"] if tail else [])
    node = next(iter(model.graph))
    assert node.attributes.get_int("stash_type") == 1
    assert node.attributes.get_int("axis") == 2
    assert node.attributes.get_float("epsilon") == pytest.approx(EPS)
    assert node.outputs[0].name == "y"
    assert [o.name for o in model.graph.outputs] == [_output_name(tail)]
    assert {"gamma", "beta", "two", "eps"}.isdisjoint(model.graph.initializers)
    fused = ir.to_proto(model)
    onnx.checker.check_model(fused, full_check=True)
    np.testing.assert_allclose(run(fused, _feeds())[0], run(proto, _feeds())[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("clamp", [True, False], ids=["clamped", "unclamped"])
def test_a_layer_norm_of_the_second_moment_fuses_and_computes_the_same(clamp: bool) -> None:
    """mean(x*x) - mean(x)**2 as the variance (jax2onnx's Flax LayerNorm): the whole block is one
    LayerNormalization, and onnxruntime gives the same values."""
    proto = second_moment_layer_norm(17, clamp=clamp)
    model = _typed(proto)
    [block] = find_norm_blocks(model.graph)
    assert block.kind == "layer" and block.input.name == "x" and block.output.name == "y"
    assert len(block.nodes) == len(proto.graph.node)
    result = fuse_norm_blocks(model)
    assert result.fused == ["ln/LayerNormalization"]
    assert _ops(model) == ["LayerNormalization"]
    fused = ir.to_proto(model)
    onnx.checker.check_model(fused, full_check=True)
    np.testing.assert_allclose(run(fused, _feeds())[0], run(proto, _feeds())[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cast", ["CastLike", "Cast"])
def test_an_epsilon_cast_like_the_input_belongs_to_the_block(cast: str) -> None:
    """jax2onnx casts epsilon like the input (CastLike(eps, x)) before adding it: the cast is
    part of the RMSNorm, which fuses at opset 23 and computes the same."""
    proto = rms_norm(23)
    add = next(n for n in proto.graph.node if n.op_type == "Add")
    add.input[1] = "eps_cast"
    inputs = ["eps", "x"] if cast == "CastLike" else ["eps"]
    attributes = {} if cast == "CastLike" else {"to": TensorProto.FLOAT}
    proto.graph.node.insert(0, oh.make_node(cast, inputs, ["eps_cast"], name="rms/eps_cast", **attributes))
    model = _typed(proto)
    [block] = find_norm_blocks(model.graph)
    assert block.kind == "rms" and block.epsilon == pytest.approx(EPS)
    assert "rms/eps_cast" in [n.name for n in block.nodes]
    if _rms_normalization_missing() is None:
        fuse_norm_blocks(model)
        assert _ops(model) == ["RMSNormalization"]
        fused = ir.to_proto(model)
        np.testing.assert_allclose(run(fused, _feeds())[0], run(proto, _feeds())[0], rtol=1e-4, atol=1e-4)


def test_a_block_whose_fused_op_the_runtime_lacks_stays_as_it_is() -> None:
    """TensorRT's table has no RMSNormalization: at opset 23 the RMSNorm stays decomposed, kept
    FP32 as one block with that reason, and the LayerNorm, which it runs, fuses."""
    tensorrt = FusedKernels(load_runtime("tensorrt"), LowPrecision.FLOAT16)
    model = _typed(rms_norm(23))
    result = fuse_norm_blocks(model, kernels=tensorrt)
    assert result.fused == [] and result.needs_opset == {}
    assert set(result.kept) == set(model.graph)
    assert all("tensorrt has no float16 kernel of RMSNormalization" in r for r in result.kept.values())
    layer = _typed(layer_norm(23))
    assert fuse_norm_blocks(layer, kernels=tensorrt).fused == ["ln/LayerNormalization"]
    cuda = FusedKernels(load_runtime("ort-cuda"), LowPrecision.FLOAT16)
    assert fuse_norm_blocks(_typed(rms_norm(23)), kernels=cuda).fused == ["rms/RMSNormalization"]


@pytest.mark.parametrize(("shift", "affine"), [("neg", True), ("sub", True), ("neg", False), ("sub", False)])
def test_a_keras_layer_norm_through_tf2onnx_fuses_and_computes_the_same(shift: str, affine: bool) -> None:
    """x * g + (beta - mean * g), g = gamma / sqrt(var + eps), means by GlobalAveragePool: one
    LayerNormalization over the last axis, gamma and beta of shape [1, 1, C] taken as [C]."""
    proto = scale_shift_layer_norm(shift, affine)
    model = _typed(proto)
    [block] = find_norm_blocks(model.graph)
    assert block.kind == "layer" and block.axes == [2] and block.output.name == "y"
    assert len(block.nodes) == len(proto.graph.node)
    fuse_norm_blocks(model)
    assert _ops(model) == ["LayerNormalization"]
    fused = ir.to_proto(model)
    onnx.checker.check_model(fused, full_check=True)
    np.testing.assert_allclose(run(fused, _feeds())[0], run(proto, _feeds())[0], rtol=1e-4, atol=1e-4)


def test_a_scale_shift_whose_factor_is_read_elsewhere_is_no_block() -> None:
    proto = scale_shift_layer_norm()
    proto.graph.output.append(oh.make_tensor_value_info("g", F32, list(SHAPE)))
    assert find_norm_blocks(_typed(proto).graph) == []


def test_a_second_moment_whose_mean_is_read_elsewhere_is_no_block() -> None:
    model = _typed(second_moment_layer_norm(17, mean_read_elsewhere=True))
    assert find_norm_blocks(model.graph) == []


def test_rms_norm_waits_for_opset_23() -> None:
    """At opset 17 the RMSNorm stays, every node kept FP32 with a reason naming opset 23, and
    waits (fusable after an upgrade)."""
    model = _typed(rms_norm(17))
    nodes = list(model.graph)
    result = fuse_norm_blocks(model)
    assert result.fused == []
    assert list(model.graph) == nodes
    assert set(result.kept) == set(nodes)
    assert all("RMSNormalization needs opset 23" in reason for reason in result.kept.values())
    assert result.needs_opset == {"RMSNormalization": 23}
    assert result.waiting == set(nodes)


def test_opset_17_fuses_the_layer_norm_and_keeps_the_rms_norm() -> None:
    """Both kinds in one graph: only the LayerNorm fuses."""
    ln = layer_norm(17)
    rms = rms_norm(17)
    for node in rms.graph.node:  # RMSNorm of y, renamed apart
        node.input[:] = ["y" if i == "x" else f"r_{i}" for i in node.input]
        node.output[:] = [f"r_{o}" for o in node.output]
    for tensor in rms.graph.initializer:
        tensor.name = f"r_{tensor.name}"
    ln.graph.node.extend(rms.graph.node)
    ln.graph.initializer.extend(rms.graph.initializer)
    ln.graph.output[0].name = "r_y"
    model = _typed(ln)
    result = fuse_norm_blocks(model)
    assert result.fused == ["ln/LayerNormalization"]
    assert {n.op_type for n in result.kept} == {"Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul"}
    assert len(result.kept) == 6
    assert _ops(model)[0] == "LayerNormalization" and "RMSNormalization" not in _ops(model)


def _rms_normalization_missing() -> str | None:
    """Why onnxruntime cannot run RMSNormalization (opset 23) here, or None."""
    major, minor = (int(p) for p in ort.__version__.split(".")[:2])
    if (major, minor) < (1, 22):
        return f"onnxruntime {ort.__version__} has no RMSNormalization (opset 23) kernel; needs >= 1.22"
    return None


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("reciprocal", [False, True], ids=["div", "mul-reciprocal"])
def test_rms_norm_fuses_at_opset_23_and_computes_the_same(reciprocal: bool, tail: bool) -> None:
    """At opset 23 one RMSNormalization(stash_type=1) replaces the block, same values."""
    proto = rms_norm(23, reciprocal=reciprocal, tail=tail)
    model = _typed(proto)
    result = fuse_norm_blocks(model)
    assert result.fused == ["rms/RMSNormalization"]
    assert result.kept == {} and result.needs_opset == {}
    assert _ops(model) == ["RMSNormalization"] + (["Neg"] if tail else [])
    node = next(iter(model.graph))
    assert node.attributes.get_int("stash_type") == 1
    assert node.attributes.get_int("axis") == 2
    assert node.attributes.get_float("epsilon") == pytest.approx(EPS)
    assert {"gamma", "two", "eps"}.isdisjoint(model.graph.initializers)
    fused = ir.to_proto(model)
    onnx.checker.check_model(fused, full_check=True)
    reason = _rms_normalization_missing()
    if reason is not None:
        pytest.skip(reason)
    np.testing.assert_allclose(run(fused, _feeds())[0], run(proto, _feeds())[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tail", TAILS)
def test_layer_norm_fuses_at_opset_23_too(tail: bool) -> None:
    """At opset 23 (ReduceMean axes as an input) the LayerNorm still fuses, same values."""
    proto = layer_norm(23, tail=tail)
    model = _typed(proto)
    assert fuse_norm_blocks(model).fused == ["ln/LayerNormalization"]
    assert "ReduceMean" not in _ops(model)
    fused = ir.to_proto(model)
    np.testing.assert_allclose(run(fused, _feeds())[0], run(proto, _feeds())[0], rtol=1e-5, atol=1e-5)


def test_opset_for_fusion_none_without_waiting_blocks() -> None:
    """No block waiting for a newer opset: no upgrade."""
    blocks = NormBlocks(fused=["a"], kept={})
    assert opset_for_fusion(blocks, load_runtime("onnx"), LowPrecision.FLOAT16) is None


def test_opset_for_fusion_is_the_newest_needed_when_the_runtime_runs_the_ops() -> None:
    """The schema-only profile runs both fused ops: the newest opset the waiting blocks need."""
    onnx_profile = load_runtime("onnx")
    both = NormBlocks(fused=[], kept={}, needs_opset={"LayerNormalization": 17, "RMSNormalization": 23})
    assert opset_for_fusion(both, onnx_profile, LowPrecision.FLOAT16) == 23
    layer = NormBlocks(fused=[], kept={}, needs_opset={"LayerNormalization": 17})
    assert opset_for_fusion(layer, onnx_profile, LowPrecision.BFLOAT16) == 17


def test_opset_for_fusion_none_past_the_runtime_opset_range_or_without_a_kernel() -> None:
    """TensorRT's table stops at opset 20 (no upgrade to 23); onnxruntime's CPU provider has no
    bfloat16 normalization kernel."""
    rms = NormBlocks(fused=[], kept={}, needs_opset={"RMSNormalization": 23})
    tensorrt = load_runtime("tensorrt")
    assert tensorrt.opset_range is not None and tensorrt.opset_range[1] < 23
    assert opset_for_fusion(rms, tensorrt, LowPrecision.FLOAT16) is None
    assert opset_for_fusion(rms, load_runtime("ort-cpu"), LowPrecision.BFLOAT16) is None
    assert opset_for_fusion(rms, load_runtime("ort-cpu"), LowPrecision.FLOAT16) == 23


@pytest.mark.parametrize("make", [layer_norm, rms_norm], ids=["layer", "rms"])
def test_a_final_normalization_converts_end_to_end(make) -> None:  # noqa: ANN001
    """A model that ends in a decomposed normalization (last_hidden_state) converts (the rms one
    after an upgrade to opset 23): the graph output keeps its name, and the float16 model agrees
    with FP32 in onnxruntime."""
    import mixprec  # noqa: PLC0415

    source = make(17)
    result = mixprec.convert(source, target_dtype="float16", runtime="onnx", validate="none")
    converted = ir.to_proto(result.model)
    assert [o.name for o in converted.graph.output] == ["y"]
    fused = {"LayerNormalization", "RMSNormalization"} & {n.op_type for n in converted.graph.node}
    assert len(fused) == 1
    x = np.random.default_rng(5).normal(size=SHAPE).astype(np.float32)
    (expected,) = run(source, {"x": x})
    (actual,) = run(converted, {"x": x})
    np.testing.assert_allclose(actual, expected, atol=2e-2, rtol=2e-2)


def _without_ranks(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model with x first reshaped to a shape given as an input of unknown length: shape
    inference then knows no rank in the block (as past a Reshape to a computed shape in an
    exported attention)."""
    for node in proto.graph.node:
        for index, name in enumerate(node.input):
            if name == "x":
                node.input[index] = "x_any_rank"
    proto.graph.node.insert(0, oh.make_node("Reshape", ["x", "target"], ["x_any_rank"], name="reshape"))
    proto.graph.input.append(oh.make_tensor_value_info("target", onnx.TensorProto.INT64, ["k"]))
    return proto


def _rank_feeds() -> dict[str, np.ndarray]:
    return {**_feeds(), "target": np.asarray(SHAPE, np.int64)}


def test_a_layer_norm_over_the_last_axis_fuses_without_the_rank() -> None:
    """ReduceMean over axes [-1] normalizes the last axis whatever the rank: the block fuses into
    LayerNormalization(axis=-1), its normalized shape taken from gamma."""
    proto = _without_ranks(layer_norm(17))
    model = _typed(proto)
    assert next(iter(model.graph)).outputs[0].shape is None
    result = fuse_norm_blocks(model)
    assert result.fused == ["ln/LayerNormalization"]
    assert _ops(model) == ["Reshape", "LayerNormalization"]
    node = list(model.graph)[1]
    assert node.attributes.get_int("axis") == -1
    fused = ir.to_proto(model)
    onnx.checker.check_model(fused, full_check=True)
    np.testing.assert_allclose(run(fused, _rank_feeds())[0], run(proto, _rank_feeds())[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axes", [(2,), (-2,)], ids=["positive axis", "not the last axis"])
def test_a_mean_whose_place_the_missing_rank_hides_is_no_block(axes: tuple[int, ...]) -> None:
    """Without the rank, a positive axis may or may not be the last one, and -2 is not trailing."""
    model = _typed(_without_ranks(layer_norm(17, mean_axes=axes, var_axes=axes)))
    assert find_norm_blocks(model.graph) == []


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_a_layer_norm_of_unknown_rank_fuses_in_a_conversion(target: str) -> None:
    """Through the pipeline, from opset 12 (the opset upgrade to 17 then only declares the
    opset, and the blocks found before it are fused)."""
    import mixprec  # noqa: PLC0415

    proto = _without_ranks(layer_norm(12))
    result = mixprec.convert(proto, None, target_dtype=target, runtime="ort-cuda", validate="checker")
    assert "LayerNormalization" in [n.op_type for n in result.model.graph], result.report.notes
    assert any(n.startswith("fused 1 decomposed normalization") for n in result.report.notes)


def test_a_gamma_written_as_a_reshaped_constant_gives_the_normalized_shape() -> None:
    """Paddle2ONNX writes gamma and beta as Reshape(Constant, [-1]): without the input's rank the
    fused op's size and affine tensors come from them, through the Reshape."""
    proto = _without_ranks(layer_norm(17))
    for name in ("gamma", "beta"):
        init = next(i for i in proto.graph.initializer if i.name == name)
        init.name = f"{name}_raw"
        proto.graph.node.insert(0, oh.make_node("Reshape", [f"{name}_raw", "flat"], [name], name=f"{name}/reshape"))
    proto.graph.initializer.append(numpy_helper.from_array(np.asarray([-1], np.int64), "flat"))
    model = _typed(proto)
    result = fuse_norm_blocks(model)
    assert result.fused == ["ln/LayerNormalization"], result.kept
    assert _ops(model) == ["Reshape", "LayerNormalization"]  # the reshapes of gamma and beta went with them
    assert {"gamma_raw", "beta_raw", "flat"}.isdisjoint(model.graph.initializers)
    fused = ir.to_proto(model)
    onnx.checker.check_model(fused, full_check=True)
    np.testing.assert_allclose(run(fused, _rank_feeds())[0], run(proto, _rank_feeds())[0], rtol=1e-5, atol=1e-5)
