"""Real CNN topologies shipped with onnx (`backend/test/data/light`) convert and agree with FP32.

The shipped models carry placeholder weights (every weight tensor is one repeated value), which
makes every class score equal; the fixture swaps them for seeded random weights of the same
shapes, scaled by 1/sqrt(fan-in) with near-identity BatchNormalization statistics so that
activations keep a trained network's scale (random weights that let activations grow past
65504 would test the weights, not the converter), and top-1 agreement means something.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import pytest

import mixprec
from mixprec.validate.emulate import emulate_low_precision

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
# The two large ones (60M+ parameters) take 15-20 s each here, the next three 4-7 s: only in
# the full run. The fast subset keeps squeezenet, shufflenet and inception_v1. VGG-19 (550 MB,
# 45 s) is left out: it is the plain conv/fully-connected stack AlexNet and ZFNet already cover.
_LARGE = {"light_zfnet512.onnx", "light_bvlc_alexnet.onnx"}
_SLOW = _LARGE | {"light_resnet50.onnx", "light_densenet121.onnx", "light_inception_v2.onnx"}
_LEFT_OUT = {"light_vgg19.onnx"}
MODELS = [
    pytest.param(name, marks=pytest.mark.slow) if name in _SLOW else name
    for name in sorted(p.name for p in LIGHT.glob("light_*.onnx"))
    if name not in _LEFT_OUT
]


def _weight_for(shape: list[int], consumer: onnx.NodeProto | None, index: int, rng: np.random.Generator) -> np.ndarray:
    op = consumer.op_type if consumer is not None else ""
    if op == "BatchNormalization":
        if index in (1, 4):  # scale, variance
            return rng.uniform(0.8, 1.2, shape).astype(np.float32)
        return rng.normal(0.0, 0.05, shape).astype(np.float32)
    if len(shape) >= 2:
        fan_in = int(np.prod(shape[1:])) if op in ("Conv", "ConvTranspose") else shape[0] if op == "MatMul" else shape[-1]
        return rng.normal(0.0, np.sqrt(1.0 / max(fan_in, 1)), shape).astype(np.float32)
    return rng.normal(0.0, 0.01, shape).astype(np.float32)


def realistic_weights(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """Replace ConstantOfShape-generated placeholder weights by seeded random initializers."""
    rng = np.random.default_rng(seed)
    graph = model.graph
    consumers: dict[str, tuple[onnx.NodeProto, int]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, (node, i))
    shapes = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    kept = []
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in shapes:
            shape = [int(d) for d in shapes[node.input[0]]]
            consumer, index = consumers.get(node.output[0], (None, 0))
            array = _weight_for(shape, consumer, index, rng)
            graph.initializer.append(onnx.numpy_helper.from_array(array, node.output[0]))
        else:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    # The new initializers are not graph inputs, which IR 3 (these models' version) requires.
    model.ir_version = max(model.ir_version, 4)
    return model


def _image(model: onnx.ModelProto, seed: int) -> tuple[str, np.ndarray]:
    initializers = {t.name for t in model.graph.initializer}
    inp = next(i for i in model.graph.input if i.name not in initializers)
    dims = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    rng = np.random.default_rng(seed)
    return inp.name, rng.uniform(0.0, 1.0, dims).astype(np.float32)


def _top1(model_or_path, model: onnx.ModelProto) -> np.ndarray:  # type: ignore[no-untyped-def]
    results = []
    for seed in (1, 2):
        name, image = _image(model, seed)
        out = _run(model_or_path, {name: image}).reshape(-1)
        assert np.isfinite(out).all()
        results.append(out)
    return np.stack(results)


def _run(model_or_path, feeds: dict) -> np.ndarray:  # type: ignore[no-untyped-def]
    data = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _assert_compute_converted(report: mixprec.Report, model: onnx.ModelProto, *, most_nodes: bool = True) -> None:
    for op in ("Conv", "Gemm", "MatMul"):
        count = sum(1 for n in model.graph.node if n.op_type == op)
        assert report.low_by_op.get(op, 0) == count, (op, report.low_by_op)
    if most_nodes:
        assert report.nodes_by_precision["low"] > 2 * report.nodes_by_precision.get("fp32", 0)


@pytest.mark.parametrize("name", MODELS)
def test_light_cnn_converts_and_keeps_top1(name: str, tmp_path: Path) -> None:
    model = realistic_weights(onnx.load(str(LIGHT / name)))
    source = tmp_path / "fp32.onnx"
    onnx.save(model, str(source))
    expected = _top1(source, model)

    fp16 = mixprec.convert(source, tmp_path / "fp16.onnx", target_dtype="fp16", validate="checker")
    _assert_compute_converted(fp16.report, model)
    got16 = _top1(tmp_path / "fp16.onnx", model)
    np.testing.assert_array_equal(got16.argmax(-1), expected.argmax(-1))

    # The models are below opset 22, where bfloat16 Conv/pooling first exist: `--to bf16`
    # alone upgrades them. On a runtime that runs every schema type (TensorRT, OpenVINO) nearly
    # everything converts; on ORT CUDA, whose bfloat16 kernels stop at Conv/Gemm/MatMul and a few
    # elementwise ops, the heavy ops still do.
    out = tmp_path / "bf16.onnx"
    bf16 = mixprec.convert(source, out, target_dtype="bf16", validate="checker", runtime="onnx")
    assert any("opset upgraded" in n for n in bf16.report.notes), bf16.report.notes
    _assert_compute_converted(bf16.report, model)
    got_bf16 = _top1(emulate_low_precision(onnx.load(str(out))), model)
    np.testing.assert_array_equal(got_bf16.argmax(-1), expected.argmax(-1))
    if name not in _LARGE:  # the same topology rules; spare the 100M-parameter models a pass
        cuda = mixprec.convert(source, None, target_dtype="bf16", validate="none", runtime="ort-cuda")
        _assert_compute_converted(cuda.report, model, most_nodes=False)
