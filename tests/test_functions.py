"""Model-local functions: bodies are typed from their call sites and converted inside."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnxruntime as ort
import pytest

import mixprec
from mixprec.cli import main
from mixprec.report.html import render_html_report
from mixprec.validate.emulate import emulate_low_precision

MODEL = """
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
agraph (float[2,3] x) => (float[2,4] y, float[2,4] z) {
  w = Constant<value = float[3,4] {0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2}>()
  h = local.Linear(x, w)
  y = Softmax(h)
  z = local.Linear(x, w)
}
<domain: "local", opset_import: ["" : 18]>
Linear (a, b) => (c) {
  m = MatMul(a, b)
  c = Relu(m)
}
"""

POLYMORPHIC = """
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
agraph (float[2,2] x, double[2,2] d) => (float[2,2] y, double[2,2] e) {
  y = local.Square(x)
  e = local.Square(d)
}
<domain: "local", opset_import: ["" : 18]>
Square (a) => (c) {
  c = MatMul(a, a)
}
"""


def _run(path_or_proto, feeds):  # type: ignore[no-untyped-def]
    data = path_or_proto.SerializeToString() if isinstance(path_or_proto, onnx.ModelProto) else str(path_or_proto)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_function_body_converts_and_signature_stays(tmp_path: Path, target: str) -> None:
    model = onnx.parser.parse_model(MODEL)
    out = tmp_path / "out.onnx"
    result = mixprec.convert(model, out, target_dtype=target, validate="checker")
    converted = onnx.load(str(out))
    onnx.checker.check_model(converted, full_check=True)
    body = converted.functions[0]
    ops = [n.op_type for n in body.node]
    assert ops.count("Cast") == 3 and "MatMul" in ops
    assert result.report.low_by_op == {"MatMul": 1, "Relu": 1}
    kept = {k.op_type: k.category for k in result.report.kept_fp32}
    assert kept["Linear"] == "function call"
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    expected = _run(model, {"x": x})
    candidate = converted if target == "float16" else emulate_low_precision(converted)
    actual = _run(candidate, {"x": x})
    tol = 1e-2 if target == "float16" else 5e-2
    for e, a in zip(expected, actual):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


def test_function_called_with_different_types_is_left_alone(tmp_path: Path) -> None:
    model = onnx.parser.parse_model(POLYMORPHIC)
    out = tmp_path / "out.onnx"
    result = mixprec.convert(model, out, validate="checker")
    converted = onnx.load(str(out))
    assert [n.op_type for n in converted.functions[0].node] == ["MatMul"]
    assert result.report.nodes_by_precision.get("low", 0) == 0
    x = np.eye(2, dtype=np.float32) * 3
    d = np.eye(2, dtype=np.float64) * 2
    y, e = _run(converted, {"x": x, "d": d})
    np.testing.assert_allclose(y, x @ x)
    np.testing.assert_allclose(e, d @ d)


ATTRIBUTED = """
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
agraph (float[2,3] x) => (float[2,4] y) {
  w = Constant<value = float[3,4] {0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2}>()
  y = local.Leaky(x, w)
}
<domain: "local", opset_import: ["" : 18]>
Leaky (a, b) => (c) {
  m = MatMul(a, b)
  c = LeakyRelu<alpha = 0.1>(m)
}
"""


def test_a_function_whose_body_has_attributes_is_typed_and_converted(tmp_path: Path) -> None:
    """Attributes in a body (not references to the caller's) leave the function typable."""
    model = onnx.parser.parse_model(ATTRIBUTED)
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda")
    converted = onnx.load(tmp_path / "out.onnx")
    body = [node.op_type for node in converted.functions[0].node]
    assert body == ["Cast", "Cast", "MatMul", "LeakyRelu", "Cast"], body  # MatMul, LeakyRelu in float16
    assert result.report.nodes_by_precision["low"] == 2
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)}
    np.testing.assert_allclose(_run(converted, feeds)[0], _run(model, feeds)[0], rtol=1e-2, atol=1e-2)


# As jax2onnx writes them: each function imports the domains of the functions it calls at the
# standard opset's version, while the model imports them at 1 (runtimes find a function by
# domain and name; an inliner that compares versions refuses).
NESTED = """
<ir_version: 10, opset_import: ["" : 21, "outer" : 1, "inner" : 1]>
agraph (float[2,3,8,8] x) => (float[2,4] y) {
  y = outer.Block(x)
}
<domain: "outer", opset_import: ["" : 21, "outer" : 21, "inner" : 21]>
Block (a) => (b) {
  w = Constant<value = float[4,3,3,3] {%s}>()
  c = Conv<pads = [1, 1, 1, 1]>(a, w)
  axes = Constant<value = int64[2] {2, 3}>()
  p = ReduceMean<keepdims = 0>(c, axes)
  b = inner.Act(p)
}
<domain: "inner", opset_import: ["" : 21, "inner" : 21]>
Act (u) => (v) {
  v = Relu(u)
}
""" % ", ".join(f"{v:.3f}" for v in np.random.default_rng(7).normal(0, 0.3, 108))


def _nested() -> onnx.ModelProto:
    model = onnx.parser.parse_model(NESTED)
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_functions_that_import_called_domains_at_other_versions_convert(tmp_path: Path, target: str) -> None:
    """Emulation inlines the functions after giving each function domain one version; the
    converted model keeps its functions, loads in onnxruntime and stays close to FP32. The
    bfloat16 Conv needs opset 22, and the version converter drops local functions: the model
    stays at 21, its Conv FP32, and the report says why."""
    model = _nested()
    out = tmp_path / "out.onnx"
    result = mixprec.convert(model, out, target_dtype=target)
    converted = onnx.load(str(out))
    assert {f.name for f in converted.functions} == {"Block", "Act"}
    assert [(o.domain, o.version) for o in converted.opset_import] == [("", 21), ("outer", 1), ("inner", 1)]
    assert "emulated" in result.report.validation.numerics, result.report.validation.numerics
    # The weights live in Constants of a function body: 108 floats (stored in 16 bits where the
    # Conv converts) and two int64 axes.
    assert result.report.weight_bytes_before == 108 * 4 + 16
    assert result.report.weight_bytes_after == 108 * (2 if target == "float16" else 4) + 16
    x = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32)
    candidate = converted if target == "float16" else emulate_low_precision(converted)
    np.testing.assert_allclose(_run(candidate, {"x": x})[0], _run(model, {"x": x})[0], rtol=3e-2, atol=3e-2)
    if target == "float16":
        assert result.report.low_by_op.get("Conv") == 1
    else:
        assert "Conv" not in result.report.low_by_op
        notes = " ".join(result.report.notes)
        assert "the ONNX version converter drops its 2 local function(s) (--inline-functions inlines them first)" in notes, notes
        assert "opset 22 admits them (convert with --inline-functions" in notes, notes
        assert "--opset 22" not in notes


# A function whose body declares a newer standard opset than the model: onnxruntime runs it,
# and no inliner can put its nodes into the model's graph.
NEWER_BODY = MODEL.replace('opset_import: ["" : 18, "local" : 1]', 'opset_import: ["" : 17, "local" : 1]', 1)


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_a_model_that_cannot_be_emulated_is_judged_by_its_real_run(tmp_path: Path, target: str) -> None:
    """Where the emulated model cannot be built, the conversion still completes: the real run
    on onnxruntime's CPU provider judges float16 (and the report says emulation was not
    possible); bfloat16, which that provider cannot compute, is reported as not checked."""
    model = onnx.parser.parse_model(NEWER_BODY)
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    assert _run(model, {"x": x})  # the runtime runs the FP32 model as written
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype=target)
    validation = result.report.validation
    assert result.report.low_by_op.get("MatMul") == 1
    (note,) = [n for n in result.report.notes if "local function" in n]
    assert note.endswith(
        "they cannot be inlined here (function 'Linear' imports the default domain at version 18, the model at 17)"
    )
    if target == "float16":
        assert validation.numerics.startswith("checked on 1 batch(es) for real on onnxruntime CPU"), validation.numerics
        assert "not emulated: the emulated float16 model could not be built (cannot inline" in validation.numerics
        assert not validation.numerics_unchecked and validation.real_outputs and not validation.outputs
        assert "No numeric comparison" not in render_html_report(result.report)  # the real run's rows
        converted = onnx.load(str(tmp_path / "out.onnx"))
        np.testing.assert_allclose(_run(converted, {"x": x})[0], _run(model, {"x": x})[0], rtol=1e-2, atol=1e-2)
    else:
        assert validation.numerics_unchecked
        assert validation.numerics.startswith("not checked: the emulated bfloat16 model could not be built")
    with pytest.raises(mixprec.InputError, match="^cannot inline the model's local functions: function 'Linear'"):
        mixprec.convert(model, tmp_path / "inlined.onnx", target_dtype=target, inline_functions=True)


def test_inlined_functions_convert_with_the_rest_of_the_graph(tmp_path: Path) -> None:
    """Kept, the calls of `Linear` hold FP32 signatures and the report says what inlining would
    change; inlined (as runtimes do when they load the model), the graph has no function left,
    fewer Casts, and the same numbers."""
    model = onnx.parser.parse_model(MODEL)
    kept = mixprec.convert(model, tmp_path / "kept.onnx", target_dtype="float16")
    (note,) = [n for n in kept.report.notes if "local function" in n]
    assert note.startswith("2 call(s) of 1 local function(s) keep FP32 signatures: their bodies (2 nodes in float16)")
    out = tmp_path / "inlined.onnx"
    inlined = mixprec.convert(model, out, target_dtype="float16", inline_functions=True)
    converted = onnx.load(str(out))
    assert not converted.functions and "local" not in {o.domain for o in converted.opset_import}
    assert "inlined 1 local function(s) into the graphs that call them (--inline-functions)" in inlined.report.notes
    assert not [n for n in inlined.report.notes if "keep FP32 signatures" in n]
    assert inlined.report.low_by_op == {"Constant": 1, "MatMul": 2, "Relu": 2}  # the weight stored in float16
    kept_model = onnx.load(str(tmp_path / "kept.onnx"))
    assert _casts_run(converted) == 3 < _casts_run(kept_model) == 6  # x once; a, b, c per call
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    for e, a in zip(_run(model, {"x": x}), _run(converted, {"x": x})):
        np.testing.assert_allclose(a, e, rtol=1e-2, atol=1e-2)


def test_inlined_functions_let_the_opset_upgrade_convert_a_bfloat16_conv(tmp_path: Path) -> None:
    """The bfloat16 Conv inside a function needs opset 22: with the functions inlined, the
    version converter upgrades the model and the Conv converts (see the kept case above)."""
    out = tmp_path / "out.onnx"
    assert main(["convert", str(_saved(tmp_path)), str(out), "--to", "bf16", "--inline-functions", "--validate", "checker"]) == 0
    converted = onnx.load(str(out))
    assert not converted.functions and converted.opset_import[0].version == 22
    (conv,) = [n for n in converted.graph.node if n.op_type == "Conv"]
    types = {v.name: v.type.tensor_type.elem_type for v in onnx.shape_inference.infer_shapes(converted).graph.value_info}
    assert types[conv.output[0]] == onnx.TensorProto.BFLOAT16
    x = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(
        _run(emulate_low_precision(converted), {"x": x})[0], _run(_nested(), {"x": x})[0], rtol=5e-2, atol=5e-2
    )


def _saved(folder: Path) -> Path:
    path = folder / "nested.onnx"
    onnx.save(_nested(), str(path))
    return path


def _casts_run(model: onnx.ModelProto) -> int:
    """The Casts one inference runs: the main graph's, and each function's once per call."""
    bodies = {(f.domain, f.name): sum(n.op_type == "Cast" for n in f.node) for f in model.functions}
    return sum(1 if n.op_type == "Cast" else bodies.get((n.domain, n.op_type), 0) for n in model.graph.node)


def test_tune_inlines_functions_before_the_opset_it_is_given(tmp_path: Path) -> None:
    """With `opset`, tune upgrades its FP32 reference first: a model with local functions is
    inlined before (the version converter drops them), and every candidate is converted so."""
    from mixprec.tune import tune  # noqa: PLC0415

    x = np.random.default_rng(1).normal(size=(2, 3, 8, 8)).astype(np.float32)
    result = tune(
        str(_saved(tmp_path)), {"x": x}, target_dtype="bfloat16", tolerance=mixprec.Tolerance(atol=0.05, rtol=0.05),
        opset=22, inline_functions=True, output=tmp_path / "tuned.onnx",
    )
    assert result.met
    converted = onnx.load(str(tmp_path / "tuned.onnx"))
    assert not converted.functions and converted.opset_import[0].version == 22


def _large_weight_functions() -> onnx.ModelProto:
    """Two functions each holding a 256 KB weight in a Constant (as jax2onnx writes them), the
    first calling a third."""
    rng = np.random.default_rng(5)

    def weight(name: str) -> onnx.NodeProto:
        array = rng.normal(0, 0.05, (256, 256)).astype(np.float32)
        return onnx.helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(array, name))

    first = onnx.helper.make_function(
        "local", "First", ["a"], ["b"],
        [weight("w1"), onnx.helper.make_node("MatMul", ["a", "w1"], ["m"]), onnx.helper.make_node("Act", ["m"], ["b"], domain="local")],
        [onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("local", 1)],
    )
    second = onnx.helper.make_function(
        "local", "Second", ["a"], ["b"], [weight("w2"), onnx.helper.make_node("MatMul", ["a", "w2"], ["b"])],
        [onnx.helper.make_opsetid("", 18)],
    )
    act = onnx.helper.make_function(
        "local", "Act", ["u"], ["v"], [onnx.helper.make_node("Relu", ["u"], ["v"])], [onnx.helper.make_opsetid("", 18)]
    )
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("First", ["x"], ["h"], domain="local"), onnx.helper.make_node("Second", ["h"], ["y"], domain="local")],
        "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 256])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 256])],
    )
    return onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("local", 1)],
        functions=[first, second, act],
    )


def test_function_bodies_are_typed_without_their_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each body is inferred with the functions it calls alone and its large constants as
    stand-ins of their type and shape: no inference reads a weight (a model whose weights live
    in many functions types in time linear in its size), and the bodies convert as before."""
    seen: dict[str, tuple[int, list[str]]] = {}  # body -> (bytes handed to inference, its functions)
    infer = onnx.shape_inference.infer_shapes

    def recording(model: onnx.ModelProto | bytes, *args: object, **kwargs: object) -> onnx.ModelProto:
        if isinstance(model, onnx.ModelProto) and model.graph.name.endswith("_body"):
            seen[model.graph.name] = (model.ByteSize(), [f.name for f in model.functions])
        return infer(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", recording)
    model = _large_weight_functions()
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16")
    assert sorted(seen) == ["Act_body", "First_body", "Second_body"]
    assert max(size for size, _ in seen.values()) < 4096, seen  # each weight is 262,144 bytes
    assert {body: functions for body, (_, functions) in seen.items()} == {
        "First_body": ["Act"], "Second_body": [], "Act_body": [],
    }
    assert result.report.low_by_op.get("MatMul") == 2
    x = np.random.default_rng(0).normal(size=(4, 256)).astype(np.float32)
    converted = onnx.load(str(tmp_path / "out.onnx"))
    np.testing.assert_allclose(_run(converted, {"x": x})[0], _run(model, {"x": x})[0], rtol=2e-2, atol=2e-2)
