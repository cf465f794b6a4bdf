"""A normalization kept FP32 bounds its output by its group size and constant scale and bias
(`mixprec.analysis.norm_bounds`): the ops after it (a GroupNorm's affine, SiLU) compute in 16
bits from a cast of it, as PyTorch's exporters write GroupNorm (Reshape -> InstanceNormalization
-> Reshape -> Mul -> Add) in every diffusion UNet and VAE. Converted for the schema-only `onnx`
profile, where InstanceNormalization stays FP32 for its accumulation (on ONNX Runtime CUDA, whose
kernel accumulates in FP32, it converts: see test_exporter_quirks)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
from onnx import TensorProto

from mixprec.analysis.norm_bounds import MAX_GROUP_ELEMENTS, group_size, output_bound
from mixprec.policy.opfacts import _NAMES, op_facts

from helpers import convert, run, sigs_of

F32 = TensorProto.FLOAT
_C, _G, _HW = 16, 4, 8


def _group_norm_block(
    gamma: float = 1.0, beta: float = 0.1, batch: int | str = 1, tail: list[onnx.NodeProto] | None = None,
    opset: int = 18,
) -> onnx.ModelProto:
    """Conv -> GroupNorm as exported (Reshape, InstanceNormalization of unit scale and zero bias,
    Reshape, Mul gamma, Add beta) -> SiLU -> Conv; `tail` replaces what follows the
    normalization's Reshape back (reading "r2", writing "y")."""
    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((_C, _C, 3, 3)).astype(np.float32) * 0.2, "w1"),
        onnx.numpy_helper.from_array(rng.standard_normal((_C, _C, 3, 3)).astype(np.float32) * 0.2, "w2"),
        onnx.numpy_helper.from_array(np.array([0, _G, -1], np.int64), "grouped"),
        onnx.numpy_helper.from_array(np.array([-1, _C, _HW, _HW], np.int64), "back"),
        onnx.numpy_helper.from_array(np.ones(_G, np.float32), "ones"),
        onnx.numpy_helper.from_array(np.zeros(_G, np.float32), "zeros"),
        onnx.numpy_helper.from_array(np.full((_C, 1, 1), gamma, np.float32), "gamma"),
        onnx.numpy_helper.from_array(np.full((_C, 1, 1), beta, np.float32), "beta"),
        onnx.numpy_helper.from_array(np.array(1e-4, np.float32), "small"),
        onnx.numpy_helper.from_array(np.array(6e4, np.float32), "large"),
        onnx.numpy_helper.from_array(np.array(2.0, np.float32), "two"),
    ]
    nodes = [
        oh.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        oh.make_node("Reshape", ["c1", "grouped"], ["r1"], name="group"),
        oh.make_node("InstanceNormalization", ["r1", "ones", "zeros"], ["n"], epsilon=1e-5, name="norm"),
        oh.make_node("Reshape", ["n", "back"], ["r2"], name="ungroup"),
    ]
    nodes += tail if tail is not None else [
        oh.make_node("Mul", ["r2", "gamma"], ["scaled"], name="scale"),
        oh.make_node("Add", ["scaled", "beta"], ["shifted"], name="shift"),
        oh.make_node("Sigmoid", ["shifted"], ["gate"], name="gate"),
        oh.make_node("Mul", ["shifted", "gate"], ["silu"], name="silu"),
        oh.make_node("Conv", ["silu", "w2"], ["y"], pads=[1, 1, 1, 1], name="conv2"),
    ]
    graph = oh.make_graph(
        nodes, "gn", [oh.make_tensor_value_info("x", F32, [batch, _C, _HW, _HW])],
        [oh.make_tensor_value_info("y", F32, [batch, _C, _HW, _HW])], inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_a_group_norms_affine_and_silu_compute_in_16_bits_after_its_fp32_instance_norm(target: str) -> None:
    result, converted = convert(_group_norm_block(), target_dtype=target, runtime="onnx")
    low = TensorProto.FLOAT16 if target == "float16" else TensorProto.BFLOAT16
    kept = {k.name: k for k in result.report.kept_fp32}
    assert set(kept) == {"norm"}
    assert [s.inputs[0] for s in sigs_of(converted, "InstanceNormalization")] == ["float"]
    assert result.report.low_by_op == {"Conv": 2, "Reshape": 2, "Mul": 2, "Add": 1, "Sigmoid": 1}
    assert {s.outputs[0] for op in ("Conv", "Sigmoid", "Mul", "Add") for s in sigs_of(converted, op)} == {
        "float16" if low == TensorProto.FLOAT16 else "bfloat16"
    }
    x = np.random.default_rng(1).standard_normal((1, _C, _HW, _HW)).astype(np.float32) * 1000  # large activations
    if target == "float16":
        got = run(converted, {"x": x})[0].astype(np.float32)
        want = run(_group_norm_block(), {"x": x})[0]
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


def test_a_scale_that_could_overflow_keeps_what_follows_fp32() -> None:
    """A group of 4 channels * 64 = 256 elements: |normalized| <= 16. Times gamma 2000: 32,000,
    within float16, so the affine and SiLU convert; times gamma 5000: 80,000, beyond it, so they
    stay FP32 (bfloat16 has the range)."""
    result, _ = convert(_group_norm_block(gamma=2000.0), target_dtype="float16", runtime="onnx")
    assert {k.name for k in result.report.kept_fp32} == {"norm"}
    result, _ = convert(_group_norm_block(gamma=5000.0), target_dtype="float16", runtime="onnx")
    assert {"norm", "ungroup", "scale"} <= {k.name for k in result.report.kept_fp32}
    result, _ = convert(_group_norm_block(gamma=5000.0), target_dtype="bfloat16", runtime="onnx")
    assert {k.name for k in result.report.kept_fp32} == {"norm"}


def test_a_symbolic_batch_leaves_the_group_size_known() -> None:
    result, _ = convert(_group_norm_block(gamma=100.0, batch="N"), target_dtype="float16", runtime="onnx")
    assert {k.name for k in result.report.kept_fp32} == {"norm"}


def test_the_shift_after_the_scale_counts() -> None:
    """16 * 4000 = 64,000 fits float16; plus a beta of 2000 it does not."""
    result, _ = convert(_group_norm_block(gamma=4000.0, beta=10.0), target_dtype="float16", runtime="onnx")
    assert {k.name for k in result.report.kept_fp32} == {"norm"}
    result, _ = convert(_group_norm_block(gamma=4000.0, beta=2000.0), target_dtype="float16", runtime="onnx")
    assert "scale" in {k.name for k in result.report.kept_fp32}


@pytest.mark.parametrize(
    "tail",
    [
        # a division by a small constant: nothing is known of the quotient
        [oh.make_node("Div", ["r2", "small"], ["q"], name="divide"), oh.make_node("Relu", ["q"], ["y"], name="after")],
        # a selection (by a mask the model is given) beside a large constant, then doubled: 120,000
        [
            oh.make_node("Where", ["mask", "r2", "large"], ["w"], name="select"),
            oh.make_node("Mul", ["w", "two"], ["y"], name="double"),
        ],
    ],
    ids=["div", "where"],
)
def test_what_the_chain_cannot_bound_keeps_the_normalization_unmarked(tail: list[onnx.NodeProto]) -> None:
    model = _group_norm_block(tail=tail)
    model.graph.input.append(oh.make_tensor_value_info("mask", TensorProto.BOOL, [1, _C, _HW, _HW]))
    result, _ = convert(model, target_dtype="float16", runtime="onnx")
    reasons = {k.name: k.reason for k in result.report.kept_fp32}
    assert reasons["ungroup"] == "follows FP32 input 'n'"


def _node(op: str, shape: list[int | str] | None, **attributes: object) -> ir.Node:
    x = ir.Value(name="x", shape=ir.Shape(shape) if shape is not None else None, type=ir.TensorType(ir.DataType.FLOAT))
    scale = ir.Value(name="scale", type=ir.TensorType(ir.DataType.FLOAT))
    bias = ir.Value(name="bias", type=ir.TensorType(ir.DataType.FLOAT))
    attrs = [ir.AttrInt64(k, v) for k, v in attributes.items()]  # type: ignore[arg-type]
    return ir.Node("", op, [x, scale, bias], attrs)


def test_group_sizes_follow_each_normalization() -> None:
    facts = lambda op: op_facts("", op)  # noqa: E731
    assert group_size(_node("LayerNormalization", [2, 7, 64]), facts("LayerNormalization")) == 64
    assert group_size(_node("LayerNormalization", [2, 7, 64], axis=1), facts("LayerNormalization")) == 7 * 64
    assert group_size(_node("InstanceNormalization", [2, 8, 5, 6]), facts("InstanceNormalization")) == 30
    assert group_size(_node("GroupNormalization", [2, 8, 5, 6], num_groups=4), facts("GroupNormalization")) == 60
    assert group_size(_node("RMSNormalization", [3, 10]), facts("RMSNormalization")) == 10
    assert group_size(_node("InstanceNormalization", ["N", 8, "H", 6]), facts("InstanceNormalization")) == MAX_GROUP_ELEMENTS
    assert group_size(_node("LayerNormalization", None), facts("LayerNormalization")) == MAX_GROUP_ELEMENTS
    assert _NAMES["normalizes"] == {"from_axis", "spatial", "groups"}


def test_the_bound_holds_on_the_worst_input() -> None:
    """One element far from the others is the worst case: it reaches sqrt(N) (nearly)."""
    n = 256
    x = np.zeros(n, np.float64)
    x[0] = 1e6
    y = (x - x.mean()) / np.sqrt(x.var() + 1e-5)
    assert math.sqrt(n) * 0.99 < np.abs(y).max() <= math.sqrt(n)
    node = _node("LayerNormalization", [1, n])
    magnitudes = {"scale": 3.0, "bias": 0.5}
    bound = output_bound(node, op_facts("", "LayerNormalization"), lambda v: magnitudes.get(v.name))
    assert bound == pytest.approx(math.sqrt(n) * 3.0 + 0.5)
    assert output_bound(node, op_facts("", "LayerNormalization"), lambda v: None) is None  # a scale not constant
    assert output_bound(node, op_facts("", "Relu"), lambda v: 1.0) is None


def _timestep_embedding() -> onnx.ModelProto:
    """A diffusion UNet's time projection as torch.onnx writes it: t * frequencies -> Sin, Cos
    -> Concat -> Linear -> SiLU -> Linear."""
    rng = np.random.default_rng(0)
    half = 16
    freqs = np.exp(-np.log(10000.0) * np.arange(half, dtype=np.float32) / half)[None, :]
    inits = [
        onnx.numpy_helper.from_array(freqs.astype(np.float32), "freqs"),
        onnx.numpy_helper.from_array(rng.standard_normal((2 * half, 32)).astype(np.float32) * 0.2, "w1"),
        onnx.numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32) * 0.2, "w2"),
        onnx.numpy_helper.from_array(np.array([1], np.int64), "axis1"),
    ]
    nodes = [
        oh.make_node("Unsqueeze", ["t", "axis1"], ["t2"]),
        oh.make_node("Mul", ["t2", "freqs"], ["angles"], name="angles"),
        oh.make_node("Sin", ["angles"], ["s"], name="sin"),
        oh.make_node("Cos", ["angles"], ["c"], name="cos"),
        oh.make_node("Concat", ["c", "s"], ["emb"], axis=1),
        oh.make_node("MatMul", ["emb", "w1"], ["h"], name="linear1"),
        oh.make_node("Sigmoid", ["h"], ["g"]), oh.make_node("Mul", ["h", "g"], ["a"]),
        oh.make_node("MatMul", ["a", "w2"], ["y"], name="linear2"),
    ]
    graph = oh.make_graph(
        nodes, "time", [oh.make_tensor_value_info("t", F32, [1])], [oh.make_tensor_value_info("y", F32, [1, 32])], inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def test_sin_and_cos_of_a_timestep_stay_fp32() -> None:
    """At t = 981 float16 keeps the argument to 0.5: Sin and Cos of it would be off by up to a
    quarter; they stay FP32 and the projection after them converts."""
    result, converted = convert(_timestep_embedding(), target_dtype="float16", runtime="onnx")
    assert {"sin", "cos"} <= {k.name for k in result.report.kept_fp32}
    assert result.report.low_by_op.get("MatMul") == 2
    t = np.array([981.0], np.float32)
    got, want = run(converted, {"t": t})[0].astype(np.float32), run(_timestep_embedding(), {"t": t})[0]
    assert np.abs(got - want).max() <= 0.01 * np.abs(want).max()


def test_on_a_runtime_that_accumulates_in_fp32_the_normalization_converts_where_its_scaled_output_fits() -> None:
    """On ONNX Runtime CUDA (float statistics) the InstanceNormalization converts with the affine
    after it, unless that output could leave float16's range (a gamma of 5000 over groups of 256
    elements: up to 16 x 5000 = 80,000); a user keeping the op FP32 keeps it FP32."""
    result, _ = convert(_group_norm_block(), target_dtype="float16", runtime="ort-cuda")
    assert result.report.low_by_op.get("InstanceNormalization") == 1 and not result.report.kept_fp32
    result, _ = convert(_group_norm_block(gamma=5000.0), target_dtype="float16", runtime="ort-cuda")
    kept = {k.name: k.reason for k in result.report.kept_fp32}
    assert "not bounded within the float16 range" in kept["norm"] and "scale" in kept
    result, _ = convert(_group_norm_block(), target_dtype="float16", runtime="ort-cuda", fp32_ops=["InstanceNormalization"])
    assert {k.name for k in result.report.kept_fp32} == {"norm"}


@pytest.mark.parametrize("runtime", ["ort-cuda", "tensorrt", "onnx"])
def test_instance_normalization_follows_where_its_kernel_accumulates_in_fp32(runtime: str) -> None:
    """ONNX Runtime's CUDA kernel takes InstanceNormalization's statistics in float whatever its
    tensors' type, so there the op converts with its neighbours (no Casts around it); where no
    such kernel is shown it stays FP32 for its accumulation. Either way the block agrees with FP32."""
    from mixprec.validate.emulate import emulate_low_precision  # noqa: PLC0415

    source = _group_norm_block()
    result, converted = convert(source, target_dtype="float16", runtime=runtime)
    report = result.report
    if runtime == "ort-cuda":
        assert report.low_by_op.get("InstanceNormalization") == 1, report.format_text()
        assert report.casts_runtime == 2  # the model's input and output only
    else:
        assert report.fp32_by_op.get("InstanceNormalization") == 1
        assert report.casts_runtime > 2
    x = np.random.default_rng(2).normal(size=(1, _C, _HW, _HW)).astype(np.float32)
    expected, got = run(source, {"x": x})[0], run(emulate_low_precision(converted), {"x": x})[0]
    np.testing.assert_allclose(got, expected, atol=0.02 * np.abs(expected).max())
