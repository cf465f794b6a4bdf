"""bfloat16 upgrades the opset by itself where the compute-bound ops need it, weights untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from mixprec.passes.opset import required_opset, upgrade_opset
from mixprec.validate.emulate import emulate_low_precision


def _cnn(path: Path, opset: int = 13) -> Path:
    """Conv (bf16 only from opset 22) -> Relu -> MaxPool -> Gemm, weights in external data."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.2, (16, 3, 3, 3)).astype(np.float32), "w")
    fc = numpy_helper.from_array(rng.normal(0, 0.1, (16 * 4 * 4, 10)).astype(np.float32), "fc")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
            helper.make_node("Relu", ["c"], ["r"], name="relu"),
            helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
            helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
            helper.make_node("Gemm", ["f", "fc"], ["y"], name="fc"),
        ],
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 10])],
        [w, fc],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.save(model, str(path), save_as_external_data=True, location=f"{path.name}.data", size_threshold=256)
    return path


def _run(model: onnx.ModelProto | Path, x: np.ndarray) -> np.ndarray:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_upgrade_keeps_external_weights_unread(tmp_path: Path) -> None:
    model = ir.load(_cnn(tmp_path / "m.onnx"))
    policy = mixprec.build_policy(mixprec.LowPrecision.BFLOAT16)
    assert required_opset(model, policy, mixprec.LowPrecision.BFLOAT16) == (22, ["Conv"])
    assert required_opset(model, policy, mixprec.LowPrecision.FLOAT16) is None
    upgraded = upgrade_opset(model, 22)
    assert upgraded.opset_imports[""] == 22
    assert [v.name for v in upgraded.graph.inputs] == ["x"]
    for name in ("w", "fc"):
        assert isinstance(upgraded.graph.initializers[name].const_value, ir.ExternalTensor), name


def test_bf16_alone_converts_the_heavy_ops_of_an_old_opset_model(tmp_path: Path) -> None:
    source = _cnn(tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    result = mixprec.convert(source, out, target_dtype="bf16", runtime="onnx")
    assert any(n.startswith("opset upgraded from 13 to 22: Conv") for n in result.report.notes)
    assert result.report.low_by_op.get("Conv") == 1 and result.report.low_by_op.get("Gemm") == 1
    # External data in, external data out (one data file, named per save).
    (data,) = [p.name for p in tmp_path.glob("o.onnx.*.data")]
    graph = onnx.load(str(out), load_external_data=False).graph
    assert {e.value for t in graph.initializer for e in t.external_data if e.key == "location"} == {data}
    converted = onnx.load(str(out))
    assert converted.opset_import[0].version == 22
    x = np.random.default_rng(1).normal(size=(2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(emulate_low_precision(converted), x), _run(source, x), atol=5e-2, rtol=5e-2)


def test_pinned_opset_is_kept(tmp_path: Path) -> None:
    source = _cnn(tmp_path / "m.onnx")
    result = mixprec.convert(source, tmp_path / "o.onnx", target_dtype="bf16", opset=21, runtime="onnx")
    assert "Conv" not in result.report.low_by_op  # opset 21 has no bfloat16 Conv
    assert result.report.low_by_op.get("Gemm") == 1
    assert any("opset 22 admits them" in n for n in result.report.notes)


def test_weight_free_copy_keeps_the_model_when_external_data_is_gone(tmp_path: Path) -> None:
    """A small external tensor is read into the weight-free copy; when its file is missing that
    is a one-line ModelLoadError and the model is left as it was (no detached initializers)."""
    from mixprec.errors import ModelLoadError  # noqa: PLC0415
    from mixprec.io import weight_free_proto  # noqa: PLC0415

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])
    w = onnx.numpy_helper.from_array(np.arange(4, dtype=np.float32), "w")
    graph = onnx.helper.make_graph([onnx.helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], [w])
    path = tmp_path / "m.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    model = ir.load(path)
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(ModelLoadError, match="initializer 'w'"):
        weight_free_proto(model)
    assert list(model.graph.initializers) == ["w"] and [v.name for v in model.graph.inputs] == ["x"]


def _hard_swish_cnn(path: Path, opset: int = 11) -> Path:
    """Conv -> hard-swish written with Clip (x * Clip(x + 3, 0, 6) / 6), as opset-11 exports of
    MobileNetV3-style networks write it -> pooling -> Gemm."""
    rng = np.random.default_rng(0)
    consts = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 4)).astype(np.float32), "fc"),
        *(numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("three", 3), ("zero", 0), ("six", 6))),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
            helper.make_node("Add", ["c", "three"], ["shifted"], name="shift"),
            helper.make_node("Clip", ["shifted", "zero", "six"], ["gate"], name="relu6"),
            helper.make_node("Mul", ["c", "gate"], ["gated"], name="gated"),
            helper.make_node("Div", ["gated", "six"], ["hs"], name="hswish"),
            helper.make_node("GlobalAveragePool", ["hs"], ["p"], name="pool"),
            helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
            helper.make_node("Gemm", ["f", "fc"], ["y"], name="fc"),
        ],
        "hswish",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        consts,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def test_an_op_whose_runtime_kernel_takes_float16_only_at_a_newer_opset_upgrades_the_model(tmp_path: Path) -> None:
    """ONNX Runtime CUDA registers Clip-11 for float only and Clip-12 for float16 too: an opset-11
    hard-swish network goes to opset 12 for ort-cuda, so its Clips convert; pinned at 11 they stay
    FP32 for that reason, and a runtime without that gap keeps opset 11."""
    source = _hard_swish_cnn(tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    result = mixprec.convert(source, out, target_dtype="fp16", runtime="ort-cuda")
    assert "opset upgraded from 11 to 12: CUDAExecutionProvider runs Clip in float16 from opset 12" in "\n".join(
        result.report.notes
    ), result.report.notes
    assert result.report.low_by_op.get("Clip") == 1 and not result.report.kept_fp32
    converted = onnx.load(str(out))
    assert converted.opset_import[0].version == 12
    x = np.random.default_rng(1).normal(size=(2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(converted, x), _run(source, x), atol=1e-2, rtol=1e-2)

    pinned = mixprec.convert(source, tmp_path / "p.onnx", target_dtype="fp16", runtime="ort-cuda", opset=11)
    reasons = {k.name: k.reason for k in pinned.report.kept_fp32}
    assert "no float16 kernel for Clip(11)" in reasons["relu6"], reasons

    other = mixprec.convert(source, tmp_path / "t.onnx", target_dtype="fp16", runtime="tensorrt")
    assert not any(n.startswith("opset upgraded") for n in other.report.notes)
    assert other.report.low_by_op.get("Clip") == 1


def test_no_upgrade_for_ops_around_nothing_worth_converting(tmp_path: Path) -> None:
    """ONNX Runtime's CPU provider has float16 Clip from opset 12 but no float16 Conv or Gemm:
    the hard-swish network stays at opset 11 there, its Clips FP32 with the rest."""
    result = mixprec.convert(_hard_swish_cnn(tmp_path / "m.onnx"), tmp_path / "o.onnx", runtime="ort-cpu")
    assert not any(n.startswith("opset upgraded") for n in result.report.notes), result.report.notes
    assert result.report.casts_inserted == 0 and "Clip" not in result.report.low_by_op


def test_an_op_whose_schema_takes_float16_only_later_does_not_raise_the_opset(tmp_path: Path) -> None:
    """IsInf admits float16 only from opset 20 in its schema: beside a float16 MatMul of an
    opset-13 model it stays FP32 instead of taking the whole model through the version converter."""
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
            helper.make_node("IsInf", ["m"], ["inf"], name="isinf"),
            helper.make_node("Where", ["inf", "x", "m"], ["y"], name="pick"),
        ],
        "isinf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [weight],
    )
    source = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(source))
    result = mixprec.convert(source, tmp_path / "o.onnx", target_dtype="fp16", runtime="ort-cuda")
    assert not any(n.startswith("opset upgraded") for n in result.report.notes), result.report.notes
    assert result.report.low_by_op.get("MatMul") == 1
    assert onnx.load(str(tmp_path / "o.onnx")).opset_import[0].version == 13


@pytest.mark.parametrize("pooled", [False, True])
def test_an_upgrade_to_fuse_a_normalization_keeps_every_type(tmp_path: Path, pooled: bool) -> None:
    """A decomposed RMSNorm at opset 17 fuses once the model is upgraded to 23. Where the version
    converter leaves every other node as it is, only the opset is declared; where it rewrites one
    (a ReduceMean's `axes` attribute becomes an input at 18: mean pooling outside the block), the
    rebuilt model is typed again. Either way no node stays FP32 for an unknown type, and the
    converted model runs close to the FP32 one."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Pow", ["h", "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1, name="mean"),
        helper.make_node("Add", ["ms", "eps"], ["mse"], name="add_eps"),
        helper.make_node("Sqrt", ["mse"], ["rms"], name="sqrt"),
        helper.make_node("Div", ["h", "rms"], ["n"], name="div"),
        helper.make_node("Mul", ["n", "g"], ["ng"], name="scale"),
        helper.make_node("MatMul", ["ng", "w2"], ["y0"], name="out"),
    ]
    if pooled:
        nodes.append(helper.make_node("ReduceMean", ["y0"], ["y"], axes=[1], keepdims=0, name="pool"))
    else:
        nodes.append(helper.make_node("Relu", ["y0"], ["y"], name="relu"))
    graph = helper.make_graph(
        nodes, "rms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8] if pooled else ["n", 4, 8])],
        [
            numpy_helper.from_array(rng.normal(0, 0.3, (16, 16)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.normal(0, 0.3, (16, 8)).astype(np.float32), "w2"),
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
            numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "g"),
        ],
    )
    source = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(source))
    out = tmp_path / "out.onnx"
    result = mixprec.convert(source, out, target_dtype="float16", validate="checker")
    assert any("opset upgraded to 23" in n for n in result.report.notes), result.report.notes
    converted = onnx.load(str(out))
    assert converted.opset_import[0].version == 23
    ops = [n.op_type for n in converted.graph.node]
    assert ops.count("RMSNormalization") == 1 and "Sqrt" not in ops
    if pooled:  # the converter rewrote the pooling ReduceMean: its axes are an input now
        (pool,) = [n for n in converted.graph.node if n.op_type == "ReduceMean"]
        assert len(pool.input) == 2 and not pool.attribute[0].name == "axes"
    assert "unknown type" not in result.report.fp32_by_category, result.report.fp32_by_category
    assert result.report.low_by_op.get("MatMul") == 2
    x = rng.normal(size=(2, 4, 16)).astype(np.float32)
    np.testing.assert_allclose(_run(converted, x), _run(onnx.load(str(source)), x), atol=2e-2, rtol=2e-2)


def _computed_reshape_norm(opset: int) -> onnx.ModelProto:
    """x [n, 8, 1, w] -> Reshape to Concat(Shape(x)[:2], [-1]) -> Transpose -> a LayerNorm with no
    affine tail (Paddle2ONNX's SVTR neck): the normalized size, 8, is known only where shape
    inference propagates the computed shape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Slice", ["shape", "zero", "two_i", "zero"], ["lead"], name="lead"),
        helper.make_node("Concat", ["lead", "minus_one"], ["target"], axis=0, name="target"),
        helper.make_node("Reshape", ["x", "target"], ["flat"], name="flatten"),
        helper.make_node("Transpose", ["flat"], ["t"], perm=[0, 2, 1], name="transpose"),
        helper.make_node("ReduceMean", ["t"], ["mean"], axes=[-1], keepdims=1, name="mean"),
        helper.make_node("Sub", ["t", "mean"], ["d"], name="sub"),
        helper.make_node("Pow", ["d", "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1], keepdims=1, name="var"),
        helper.make_node("Add", ["var", "eps"], ["ve"], name="add_eps"),
        helper.make_node("Sqrt", ["ve"], ["std"], name="sqrt"),
        helper.make_node("Div", ["d", "std"], ["y"], name="div"),
    ]
    graph = helper.make_graph(
        nodes, "neck",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 1, "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "w", "c"])],
        [
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array([2], np.int64), "two_i"),
            numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_an_upgrade_leaves_untyped_values_to_the_full_inference() -> None:
    """The version converter types every value by its own inference, without data propagation:
    the Reshape to a computed shape got three unknown dimensions, which then stood in the way
    of the inference that knows the last one. The upgrade keeps only the types the model had."""
    from mixprec.analysis.typeinfo import infer_types  # noqa: PLC0415

    model = ir.serde.deserialize_model(_computed_reshape_norm(14))
    upgraded = upgrade_opset(model, 18)
    assert upgraded is not model  # rebuilt by the converter: the ReduceMeans take axes as inputs
    assert all(out.shape is None for node in upgraded.graph for out in node.outputs if out.name == "t")
    infer_types(upgraded)
    (t,) = [out for node in upgraded.graph for out in node.outputs if out.name == "t"]
    assert t.shape is not None and t.shape[2] == 8, t.shape


def test_a_pinned_opset_fuses_a_normalization_whose_size_a_computed_shape_gives() -> None:
    """Through the pipeline with --opset 18: the block fuses (its size from the propagated
    shape) as it does at the model's own opset, and computes the same."""
    source = _computed_reshape_norm(14)
    result = mixprec.convert(source, None, target_dtype="float16", opset=18, validate="checker")
    converted = ir.to_proto(result.model)
    assert [n.op_type for n in converted.graph.node].count("LayerNormalization") == 1, result.report.notes
    x = np.random.default_rng(4).normal(size=(2, 8, 1, 5)).astype(np.float32)
    np.testing.assert_allclose(_run(converted, x), _run(source, x), atol=2e-2, rtol=2e-2)
