"""End to end: a tiny HF-style transformer exported by torch.onnx.export, then converted.

The model (tests/torch_models.py) builds the additive attention mask exactly as Hugging Face
models do, ``(1 - mask) * torch.finfo(torch.float32).min``: a constant that is -inf in float16
and in bfloat16, which turns masked-out positions into ``0 * -inf = NaN`` if it is narrowed.
The tests check that mixprec keeps that arithmetic in FP32, says so in its report, and that the
converted models run without NaN/Inf and agree with the FP32 export.

Exporters: the dynamo exporter (default of torch 2.x, needs onnxscript) and the legacy
TorchScript exporter (``dynamo=False``) at opset 17 (LayerNormalization op) and at opset 14
(LayerNorm decomposed into ReduceMean/Sub/Pow/Add(eps)/Sqrt/Div/Mul/Add).

PyTorch is optional: the module is skipped without it.
"""

from __future__ import annotations

import inspect
import warnings
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx.shape_inference
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

torch = pytest.importorskip("torch")

import torch_models  # tests/ is on sys.path via conftest.py

import mixprec
from mixprec.validate.emulate import emulate_low_precision

FINFO_MIN = float(np.finfo(np.float32).min)
LOW = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
RANGE = "out-of-range constant"

EXPORTERS = {
    "dynamo": {"dynamo": True},
    "torchscript-opset17": {"dynamo": False, "opset": 17},
    "torchscript-opset14": {"dynamo": False, "opset": 14},
}


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_model():
    return torch_models.make_model(seed=0)


@pytest.fixture(
    scope="module",
    # The dynamo exporter's first call costs seconds of setup: with the slow tests (the module
    # tests of test_convert_module.py export with it too).
    params=[pytest.param(name, marks=pytest.mark.slow) if EXPORTERS[name]["dynamo"] else name for name in EXPORTERS],
)
def exported(request, torch_model, tmp_path_factory) -> Path:
    """The FP32 ONNX export of the tiny transformer, once per exporter path."""
    options = EXPORTERS[request.param]
    if options["dynamo"]:
        pytest.importorskip("onnxscript", reason="torch's dynamo ONNX exporter needs onnxscript")
    elif not _has_legacy_exporter():
        pytest.skip(f"torch {torch.__version__} has no legacy TorchScript ONNX exporter")
    path = tmp_path_factory.mktemp(request.param) / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter deprecation/tracer chatter, not ours
        torch_models.export(torch_model, path, dynamo=options["dynamo"], opset=options.get("opset"))
    return path


@pytest.fixture(scope="module")
def converted(exported, tmp_path_factory):
    """mixprec.convert of the export to each target: {target: (result, path)}."""
    out_dir = tmp_path_factory.mktemp(exported.parent.name + "-out")
    results = {}
    for target in LOW:
        out = out_dir / f"model.{target}.onnx"
        results[target] = (mixprec.convert(exported, out, target_dtype=target), out)
    return results


def _has_legacy_exporter() -> bool:
    return "dynamo" in inspect.signature(torch.onnx.export).parameters and hasattr(
        torch.jit, "trace"
    )


# -- inputs and running -----------------------------------------------------------------------


def _feeds(batch: int = 2, seq: int = 7, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids and a realistic padding mask: the last sequence ends in zeros."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, torch_models.VOCAB, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[-1, seq - 3 :] = 0
    if batch > 2:
        mask[0, seq - 1 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _run(model: Path | onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], feeds)
    return logits


# -- graph inspection -------------------------------------------------------------------------


def _constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attr.t)
    return values


def _consumers(model: onnx.ModelProto, name: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if name in n.input]


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value, from ONNX's own strict shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    graph = inferred.graph
    types = {i.name: i.data_type for i in graph.initializer}
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    types[node.output[0]] = attr.t.data_type
    return types


def _mask_mul(model: onnx.ModelProto) -> tuple[onnx.NodeProto, str]:
    """The Mul by finfo(float32).min (and the name of that constant)."""
    constants = _constants(model)
    found = [
        (node, name)
        for node in model.graph.node
        if node.op_type == "Mul"
        for name in node.input
        if name in constants
        and constants[name].dtype == np.float32
        and constants[name].size == 1
        and float(constants[name].reshape(-1)[0]) == FINFO_MIN
    ]
    assert len(found) == 1, f"expected one Mul by finfo.min, found {[n.name for n, _ in found]}"
    return found[0]


def _eps_adds(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Adds of the LayerNorm epsilon (a scalar 1e-12 constant) in a decomposed LayerNorm."""
    constants = _constants(model)
    return [
        node
        for node in model.graph.node
        if node.op_type == "Add"
        and any(
            name in constants
            and constants[name].size == 1
            and np.isclose(float(constants[name].reshape(-1)[0]), torch_models.LN_EPS, rtol=1e-3)
            for name in node.input
        )
    ]


def _kept(result) -> dict[str, mixprec.report.KeptNode]:
    return {k.name: k for k in result.report.kept_fp32}


# -- the FP32 export itself -------------------------------------------------------------------


def test_export_structure_and_fp32_reference(exported):
    model = onnx.load(exported)
    onnx.checker.check_model(model, full_check=True)
    ops = Counter(n.op_type for n in model.graph.node)
    # Shape arithmetic from x.view(b, s, heads, -1) with sizes read from the tensor.
    assert ops["Reshape"] >= 4 and ops["Shape"] >= 1, ops
    assert ops["Softmax"] == torch_models.LAYERS and ops["MatMul"] >= 6 * torch_models.LAYERS
    # Dynamic batch and sequence axes.
    for graph_input in model.graph.input:
        dims = graph_input.type.tensor_type.shape.dim
        assert [d.HasField("dim_param") for d in dims] == [True, True], graph_input

    # The HF mask: Cast(mask) -> Sub(1, .) -> Mul(., finfo.min) -> Add to the attention scores.
    mul, _ = _mask_mul(model)
    by_output = {o: n for n in model.graph.node for o in n.output}
    sub = next(by_output[i] for i in mul.input if i in by_output and by_output[i].op_type == "Sub")
    assert any(i in by_output and by_output[i].op_type == "Cast" for i in sub.input)
    score_adds = _consumers(model, mul.output[0])
    assert len(score_adds) == torch_models.LAYERS
    assert all(
        a.op_type == "Add" and _consumers(model, a.output[0])[0].op_type == "Softmax"
        for a in score_adds
    )

    # The FP32 model itself is finite on a padded batch, so the low-precision checks mean something.
    for feeds in (_feeds(), _feeds(batch=3, seq=11, seed=1)):
        logits = _run(exported, feeds)
        assert logits.shape == (*feeds["input_ids"].shape, torch_models.VOCAB)
        assert np.isfinite(logits).all()


def test_fp32_export_matches_torch(exported, torch_model):
    feeds = _feeds()
    with torch.no_grad():
        expected = torch_model(
            *(torch.from_numpy(feeds[k]) for k in ("input_ids", "attention_mask"))
        )
    np.testing.assert_allclose(_run(exported, feeds), expected.numpy(), atol=1e-4, rtol=1e-4)


# -- the hazard the converter must avoid -----------------------------------------------------


def test_finfo_min_is_not_representable_in_16_bit():
    """Narrowing the HF mask constant gives -inf, and an attended position 0 * -inf = NaN."""
    for dtype in (np.float16, ml_dtypes.bfloat16):
        with np.errstate(over="ignore"):
            low = np.array([FINFO_MIN], np.float32).astype(dtype).astype(np.float32)
        assert np.isneginf(low).all(), dtype
        with np.errstate(invalid="ignore"):
            attended = (np.float32(1.0) - np.float32(1.0)) * low  # mask == 1
        assert np.isnan(attended).all()
    assert np.float16(torch_models.LN_EPS) == 0  # the LayerNorm epsilon flushes to zero in fp16


# -- conversion -------------------------------------------------------------------------------


@pytest.mark.parametrize("target", list(LOW))
def test_converted_model_is_valid(converted, target):
    result, out = converted[target]
    assert out.is_file()
    onnx.checker.check_model(str(out), full_check=True)
    validation = result.report.validation
    assert validation.checker == "passed"
    assert all(o.nan_count == 0 and o.inf_count == 0 for o in validation.outputs)


@pytest.mark.parametrize("target", list(LOW))
def test_mask_arithmetic_stays_fp32(exported, converted, target):
    source = onnx.load(exported)
    result, out = converted[target]
    mul, constant = _mask_mul(source)
    kept = _kept(result)
    report = result.report

    # The report names the Mul by finfo.min and the constant, with the range category.
    assert mul.name in kept and kept[mul.name].category == RANGE, report.format_text(100)
    assert constant in kept[mul.name].reason
    assert constant in report.constants_kept_for_range
    assert mul.output[0] in report.constants_kept_for_range
    # ...and the score Adds it feeds (their other input is low precision) are FP32 too.
    for add in _consumers(source, mul.output[0]):
        assert add.name in kept and kept[add.name].category == RANGE, add.name
    assert report.fp32_by_category.get(RANGE, 0) >= 1 + torch_models.LAYERS

    # In the converted graph: the constant is still float32 finfo.min, the mask path and the
    # masked scores are float32, and the attention matmuls are in the low type.
    model = onnx.load(out)
    types = _value_types(model)
    new_mul = next(n for n in model.graph.node if n.name == mul.name)
    assert constant in new_mul.input and types[constant] == TensorProto.FLOAT
    assert float(_constants(model)[constant].reshape(-1)[0]) == FINFO_MIN
    assert types[new_mul.output[0]] == TensorProto.FLOAT
    for add in _consumers(model, new_mul.output[0]):
        assert types[add.output[0]] == TensorProto.FLOAT
    matmul_types = Counter(types[n.output[0]] for n in model.graph.node if n.op_type == "MatMul")
    assert matmul_types[LOW[target]] >= 1, matmul_types


@pytest.mark.parametrize("target", list(LOW))
def test_layernorm_eps(exported, converted, target):
    """LayerNorm(eps=1e-12): either the LayerNormalization op (converts: it computes in FP32
    inside, stash_type=1, with a float attribute epsilon), or a decomposition whose epsilon
    Add stays FP32 in float16 (1e-12 flushes to zero there; below opset 17 the whole block
    stays FP32) and may convert in bfloat16."""
    source = onnx.load(exported)
    result, out = converted[target]
    kept = _kept(result)
    model = onnx.load(out)
    types = _value_types(model)
    layer_norms = [n for n in source.graph.node if n.op_type == "LayerNormalization"]
    eps_adds = _eps_adds(source)
    n_layer_norms = 1 + 2 * torch_models.LAYERS
    if layer_norms:
        assert not eps_adds
        assert len(layer_norms) == n_layer_norms
        assert result.report.low_by_op.get("LayerNormalization") == n_layer_norms
        for node in layer_norms:
            assert node.name not in kept, kept.get(node.name)
        for node in (n for n in model.graph.node if n.op_type == "LayerNormalization"):
            assert types[node.input[0]] == LOW[target] and types[node.output[0]] == LOW[target]
            (eps,) = (a.f for a in node.attribute if a.name == "epsilon")
            assert np.isclose(eps, torch_models.LN_EPS, rtol=1e-3)
    elif (fused := [n for n in model.graph.node if n.op_type == "LayerNormalization"]):
        # A decomposition below opset 17: the model was upgraded and each block fused into
        # LayerNormalization (FP32 statistics, stash_type=1), the epsilon an exact float attribute.
        assert len(eps_adds) == len(fused) == n_layer_norms
        assert any("opset upgraded to 17" in n for n in result.report.notes), result.report.notes
        for node in fused:
            (eps,) = (a.f for a in node.attribute if a.name == "epsilon")
            assert np.isclose(eps, torch_models.LN_EPS, rtol=1e-3)
            assert next(a.i for a in node.attribute if a.name == "stash_type") == 1
    else:
        assert len(eps_adds) == n_layer_norms, [n.op_type for n in source.graph.node]
        for node in eps_adds:
            if target == "float16":
                # FP32 for the flush-to-zero epsilon, or with its whole decomposed block.
                assert node.name in kept, node.name
                category, reason = kept[node.name].category, kept[node.name].reason
                assert (category, "flush" in reason) in ((RANGE, True), ("normalization block", False)), reason
                assert types[node.output[0]] == TensorProto.FLOAT
            else:  # 1e-12 is a normal bfloat16 number: no range reason to keep it
                assert node.name not in kept or kept[node.name].category != RANGE


def test_float16_numerics(exported, converted):
    _, out = converted["float16"]
    for feeds in (_feeds(), _feeds(batch=3, seq=11, seed=1)):
        expected = _run(exported, feeds)
        got = _run(out, feeds)
        assert got.dtype == np.float32  # keep_io_types
        assert np.isfinite(got).all(), "NaN/Inf in the float16 model"
        np.testing.assert_allclose(got, expected, atol=2e-2, rtol=2e-2)
        agree = np.mean(got.argmax(-1) == expected.argmax(-1))
        assert agree >= 0.95, agree


def test_bfloat16_numerics_emulated(exported, converted):
    _, out = converted["bfloat16"]
    emulation = emulate_low_precision(onnx.load(out))
    for feeds in (_feeds(), _feeds(batch=3, seq=11, seed=1)):
        expected = _run(exported, feeds)
        got = _run(emulation, feeds)
        assert np.isfinite(got).all(), "NaN/Inf in the emulated bfloat16 model"
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(got, expected, atol=1e-1 * scale, rtol=1e-1)
        assert np.mean(got.argmax(-1) == expected.argmax(-1)) >= 0.9


def test_decomposed_layernorm_does_not_block_downstream_float16(exported, converted):
    """The epsilon Add is FP32 because 1e-12 *underflows* in float16; its output is an ordinary
    variance, so the nodes after it (Sqrt, Div, the next MatMuls) have no range reason to stay
    FP32. Known converter limitation: the planner gives that Add the same "wide" state as a node
    holding an *overflowing* constant (finfo.min), so everything downstream is kept FP32 as
    "may hold values beyond the fp16 range" (only the decomposed-LayerNorm export shows it)."""
    source = onnx.load(exported)
    if not _eps_adds(source):
        pytest.skip("LayerNorm exported as LayerNormalization: no epsilon Add")
    result, _ = converted["float16"]
    tainted = [
        k.name
        for k in result.report.kept_fp32
        if k.category == RANGE and "may hold values beyond" in k.reason and k.op_type == "MatMul"
    ]
    if tainted:
        pytest.xfail(
            f"flush-to-zero epsilon taints {len(tainted)} downstream MatMul(s) as out of range"
        )
    matmuls = sum(1 for n in source.graph.node if n.op_type == "MatMul")
    assert result.report.low_by_op.get("MatMul", 0) == matmuls
