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
from mixprec.plan.file import plan_to_dict
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
    result = mixprec.convert(model, out, target_dtype=target, validate="checker", inline_functions=False)
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
    result = mixprec.convert(model, out, validate="checker", inline_functions=False)
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
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda", inline_functions=False)
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
    result = mixprec.convert(model, out, target_dtype=target, inline_functions=False)
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
    """Kept (asked for), the calls of `Linear` hold FP32 signatures and the report says what
    inlining would change; inlined by default (as runtimes do when they load the model), the
    graph has no function left, fewer Casts, and the same numbers."""
    model = onnx.parser.parse_model(MODEL)
    kept = mixprec.convert(model, tmp_path / "kept.onnx", target_dtype="float16", inline_functions=False)
    (note,) = [n for n in kept.report.notes if "local function" in n]
    assert note.startswith("2 call(s) of 1 local function(s) keep FP32 signatures: their bodies (2 nodes in float16)")
    out = tmp_path / "inlined.onnx"
    inlined = mixprec.convert(model, out, target_dtype="float16")  # the default
    converted = onnx.load(str(out))
    assert not converted.functions and "local" not in {o.domain for o in converted.opset_import}
    assert (
        "inlined 1 local function(s) into the graphs that call them, as runtimes do when they load the model "
        "(--keep-functions keeps them)"
    ) in inlined.report.notes
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
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", inline_functions=False)
    assert sorted(seen) == ["Act_body", "First_body", "Second_body"]
    assert max(size for size, _ in seen.values()) < 4096, seen  # each weight is 262,144 bytes
    assert {body: functions for body, (_, functions) in seen.items()} == {
        "First_body": ["Act"], "Second_body": [], "Act_body": [],
    }
    assert result.report.low_by_op.get("MatMul") == 2
    x = np.random.default_rng(0).normal(size=(4, 256)).astype(np.float32)
    converted = onnx.load(str(tmp_path / "out.onnx"))
    np.testing.assert_allclose(_run(converted, {"x": x})[0], _run(model, {"x": x})[0], rtol=2e-2, atol=2e-2)


def test_jax2onnx_style_functions_are_inlined_by_default_and_the_bfloat16_conv_converts(tmp_path: Path) -> None:
    """By default the nested functions (their domains aligned first) are inlined, so the opset
    upgrade that bfloat16's Conv needs runs and the Conv converts, as with --inline-functions;
    --keep-functions keeps them and the Conv stays FP32 behind the function's signature."""
    source = _saved(tmp_path)
    out = tmp_path / "default.onnx"
    assert main(["convert", str(source), str(out), "--to", "bf16", "--validate", "checker"]) == 0
    converted = onnx.load(str(out))
    assert not converted.functions and converted.opset_import[0].version == 22
    (conv,) = [n for n in converted.graph.node if n.op_type == "Conv"]
    inferred = onnx.shape_inference.infer_shapes(converted).graph.value_info
    assert {v.name: v.type.tensor_type.elem_type for v in inferred}[conv.output[0]] == onnx.TensorProto.BFLOAT16
    kept = tmp_path / "kept.onnx"
    assert main(["convert", str(source), str(kept), "--to", "bf16", "--validate", "checker", "--keep-functions"]) == 0
    kept_model = onnx.load(str(kept))
    assert {f.name for f in kept_model.functions} == {"Block", "Act"}
    assert kept_model.opset_import[0].version == 21
    with pytest.raises(SystemExit):  # one or the other
        main(["convert", str(source), str(tmp_path / "x.onnx"), "--inline-functions", "--keep-functions"])


def _called_many_times(weight_elements: int) -> onnx.ModelProto:
    """The main graph calls `Outer` three times; `Outer` calls `Inner` twice; `Inner` holds a
    Constant of `weight_elements` floats: once inlined, Inner's body runs 6 times."""
    ones = onnx.numpy_helper.from_array(np.full((weight_elements,), 0.5, np.float32), "c")
    inner = onnx.helper.make_function(
        "local", "Inner", ["a"], ["b"],
        [onnx.helper.make_node("Constant", [], ["c"], value=ones), onnx.helper.make_node("Mul", ["a", "c"], ["b"])],
        [onnx.helper.make_opsetid("", 18)],
    )
    outer = onnx.helper.make_function(
        "local", "Outer", ["a"], ["b"],
        [onnx.helper.make_node("Inner", ["a"], ["h"], domain="local"), onnx.helper.make_node("Inner", ["h"], ["b"], domain="local")],
        [onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("local", 1)],
    )
    nodes = [
        onnx.helper.make_node("Outer", [src], [dst], domain="local")
        for src, dst in (("x", "h1"), ("h1", "h2"), ("h2", "y"))
    ]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [weight_elements])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [weight_elements])],
    )
    return onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("local", 1)],
        functions=[inner, outer],
    )


def test_functions_whose_inlining_would_copy_many_constants_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inner's 1 MiB constant runs 6 times once inlined (3 calls of Outer, 2 of Inner in each):
    5 MiB of copies. Above the limit the functions are kept and the report says why; below it,
    and with --inline-functions whatever the limit, they are inlined; the numbers agree."""
    import onnx_ir as ir  # noqa: PLC0415

    from mixprec.passes import functions  # noqa: PLC0415

    model = _called_many_times(1 << 18)  # 262,144 floats: 1 MiB
    monkeypatch.setattr(functions, "COPY_LIMIT", 4 << 20)
    assert functions.inlining_growth(ir.from_proto(model)) == (
        "inlining would copy 5.0 MiB of constants held in bodies that several calls run"
    )
    kept = mixprec.convert(model, tmp_path / "kept.onnx", target_dtype="float16", validate="checker")
    assert (
        "local functions kept, each converting inside its FP32 signature: inlining would copy 5.0 MiB of "
        "constants held in bodies that several calls run"
    ) in kept.report.notes
    assert {f.name for f in onnx.load(str(tmp_path / "kept.onnx")).functions} == {"Inner", "Outer"}
    mixprec.convert(model, tmp_path / "forced.onnx", target_dtype="float16", validate="checker", inline_functions=True)
    forced = onnx.load(str(tmp_path / "forced.onnx"))
    assert not forced.functions and [n.op_type for n in forced.graph.node].count("Mul") == 6
    monkeypatch.setattr(functions, "COPY_LIMIT", 5 << 20)
    assert functions.inlining_growth(ir.from_proto(model)) is None
    x = np.random.default_rng(0).normal(size=(1 << 18,)).astype(np.float32)
    expected = _run(model, {"x": x})[0]
    for name in ("kept.onnx", "forced.onnx"):
        np.testing.assert_allclose(_run(tmp_path / name, {"x": x})[0], expected, rtol=1e-3)


def test_functions_calling_each_other_in_a_cycle_are_an_obstacle_named() -> None:
    import onnx_ir as ir  # noqa: PLC0415

    from mixprec.passes.functions import inlining_obstacle  # noqa: PLC0415

    def calling(name: str, callee: str) -> onnx.FunctionProto:
        return onnx.helper.make_function(
            "local", name, ["a"], ["b"], [onnx.helper.make_node(callee, ["a"], ["b"], domain="local")],
            [onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("local", 1)],
        )

    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Ping", ["x"], ["y"], domain="local")], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
    )
    model = onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", 18), onnx.helper.make_opsetid("local", 1)],
        functions=[calling("Ping", "Pong"), calling("Pong", "Ping")],
    )
    assert inlining_obstacle(ir.from_proto(model)) == "functions call each other in a cycle: local::Ping -> local::Pong -> local::Ping"
    assert inlining_obstacle(ir.from_proto(onnx.parser.parse_model(MODEL))) is None


# A body value named like one a later If branch defines: inlined, the two must not share a name.
CLASHING = """
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
agraph (float[4,8] x, bool c) => (float[4,8] y) {
  a = local.F(x)
  y = If (c) <
    then_branch = g1 () => (float[4,8] t) { m = Neg(a)  t = Relu(m) },
    else_branch = g2 () => (float[4,8] e) { m2 = Sigmoid(a)  e = Relu(m2) }
  >
}
<domain: "local", opset_import: ["" : 18]>
F (a) => (b) {
  w = Transpose <perm = [1, 0]> (a)
  m = MatMul(a, w)
  b = MatMul(m, a)
}
"""


def test_inlined_bodies_take_no_name_a_subgraph_defines(tmp_path: Path) -> None:
    model = onnx.parser.parse_model(CLASHING)
    out = tmp_path / "out.onnx"
    mixprec.convert(model, out, target_dtype="float16", runtime="ort-cuda", validate="checker")
    converted = onnx.load(str(out))
    assert not converted.functions
    onnx.checker.check_model(converted, full_check=True)  # single static assignment across the If
    x = np.random.default_rng(0).normal(0, 0.5, size=(4, 8)).astype(np.float32)
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        np.testing.assert_allclose(_run(converted, feeds)[0], _run(model, feeds)[0], rtol=2e-2, atol=2e-2)


def test_a_body_that_returns_its_input_keeps_the_graph_inputs_and_outputs_named() -> None:
    """`F` returns its input as its second output: inlined, the graph input keeps its name and
    the output its own, through an Identity."""
    import onnx_ir as ir  # noqa: PLC0415

    from mixprec.passes.functions import inline_functions  # noqa: PLC0415

    model = onnx.parser.parse_model("""
    <ir_version: 10, opset_import: ["" : 18, "local" : 1]>
    agraph (float[4,8] x) => (float[4,8] y, float[4,8] z) {
      y, z = local.F(x)
    }
    <domain: "local", opset_import: ["" : 18]>
    F (a) => (b, a) {
      b = Relu(a)
    }
    """)
    ir_model = ir.from_proto(model)
    inline_functions(ir_model)
    assert [v.name for v in ir_model.graph.inputs] == ["x"]
    assert [v.name for v in ir_model.graph.outputs] == ["y", "z"]
    proto = ir.to_proto(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    y, z = _run(proto, {"x": x})
    np.testing.assert_array_equal(z, x)
    np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_what_the_inliner_refuses_keeps_the_functions_by_default(tmp_path: Path) -> None:
    """Two functions importing a domain the model does not, at different versions: the default
    keeps them (the conversion completes); --inline-functions says why it cannot."""
    import onnx_ir as ir  # noqa: PLC0415

    from mixprec.passes.functions import inlining_obstacle  # noqa: PLC0415

    model = onnx.parser.parse_model("""
    <ir_version: 10, opset_import: ["" : 18, "local" : 1]>
    agraph (float[2,3] x) => (float[2,3] y) {
      h = local.F(x)
      y = local.G(h)
    }
    <domain: "local", opset_import: ["" : 18, "ai.onnx.ml" : 3]>
    F (a) => (b) { b = Relu(a) }
    <domain: "local", opset_import: ["" : 18, "ai.onnx.ml" : 4]>
    G (a) => (b) { b = Neg(a) }
    """)
    assert inlining_obstacle(ir.from_proto(model)) == "functions 'F' and 'G' import domain 'ai.onnx.ml' at versions 3 and 4"
    mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", validate="checker")
    assert {f.name for f in onnx.load(str(tmp_path / "out.onnx")).functions} == {"F", "G"}
    with pytest.raises(mixprec.InputError, match="^cannot inline the model's local functions: functions 'F' and 'G'"):
        mixprec.convert(model, tmp_path / "forced.onnx", target_dtype="float16", inline_functions=True)


def test_a_function_named_like_an_op_the_runtime_runs_is_kept(tmp_path: Path) -> None:
    """onnxruntime runs its own com.microsoft::Gelu kernel in place of a local function of that
    name: inlining the body would change what runs, so the default keeps it and says why."""
    model = onnx.parser.parse_model("""
    <ir_version: 10, opset_import: ["" : 18, "com.microsoft" : 1]>
    agraph (float[4,8] x) => (float[4,8] y) {
      y = com.microsoft.Gelu(x)
    }
    <domain: "com.microsoft", opset_import: ["" : 18]>
    Gelu (a) => (b) { b = Neg(a) }
    """)
    out = tmp_path / "out.onnx"
    result = mixprec.convert(model, out, target_dtype="float16", runtime="ort-cuda", validate="checker")
    assert (
        "local functions kept, each converting inside its FP32 signature: function com.microsoft::Gelu has the "
        "name of an op, which the runtime runs in its place"
    ) in result.report.notes
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    expected = _run(model, {"x": x})[0]
    assert not np.allclose(expected, -x)  # the kernel, not the body
    np.testing.assert_allclose(_run(out, {"x": x})[0], expected, rtol=1e-2, atol=1e-2)


def test_a_plan_made_with_functions_kept_applies_to_the_same_nodes(tmp_path: Path) -> None:
    """A plan saved from a conversion that kept the functions names their calls and bodies: it
    applies by default (the functions stay), and a plan made by default applies as it is."""
    model = onnx.parser.parse_model(MODEL)
    kept = mixprec.convert(model, tmp_path / "kept.onnx", target_dtype="float16", runtime="ort-cuda", inline_functions=False)
    again = mixprec.convert(model, tmp_path / "again.onnx", target_dtype="float16", runtime="ort-cuda", plan=plan_to_dict(kept.plan))
    assert {f.name for f in onnx.load(str(tmp_path / "again.onnx")).functions} == {"Linear"}
    assert again.report.nodes_by_precision == kept.report.nodes_by_precision
    inlined = mixprec.convert(model, tmp_path / "inlined.onnx", target_dtype="float16", runtime="ort-cuda")
    replayed = mixprec.convert(model, tmp_path / "replayed.onnx", target_dtype="float16", runtime="ort-cuda", plan=plan_to_dict(inlined.plan))
    assert not onnx.load(str(tmp_path / "replayed.onnx")).functions
    assert replayed.report.nodes_by_precision == inlined.report.nodes_by_precision
    with pytest.raises(mixprec.InputError, match=r"made with the model's local functions inlined: apply it without --keep-functions\)$"):
        mixprec.convert(model, tmp_path / "x.onnx", target_dtype="float16", runtime="ort-cuda", plan=plan_to_dict(inlined.plan), inline_functions=False)


def test_calibration_measures_the_values_of_inlined_bodies(tmp_path: Path) -> None:
    """The MatMul inside `F` leaves float16's range on the data (the function's output, scaled
    down, does not): with the function inlined, the calibration runs the inlined model, which
    alone names the MatMul's output, measures it, and keeps the MatMul FP32."""
    model = onnx.parser.parse_model("""
    <ir_version: 10, opset_import: ["" : 18, "local" : 1]>
    agraph (float[4,8] x, float[8,8] w) => (float[4,8] y) {
      h = local.F(x, w)
      y = Mul(h, h)
    }
    <domain: "local", opset_import: ["" : 18]>
    F (a, b) => (c) {
      m = MatMul(a, b)
      s = Constant <value = float {0.001}> ()
      c = Mul(m, s)
    }
    """)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(0, 100, (4, 8)).astype(np.float32), "w": rng.normal(0, 100, (8, 8)).astype(np.float32)} for _ in range(2)]
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda", data=batches)
    kept = {k.op_type: k.category for k in result.report.kept_fp32}
    assert kept.get("MatMul") == "range measured on data", kept
    assert any(n.startswith("calibration: 5 FP32 values measured") for n in result.report.notes), result.report.notes


def test_functions_no_node_calls_are_dropped_and_the_upgrade_runs(tmp_path: Path) -> None:
    """A model that carries a function nothing calls: the default drops it, so the opset upgrade
    that bfloat16's Conv needs (which drops local functions) runs and the Conv converts."""
    nested = _nested()
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 8, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4, 8, 8])],
        [onnx.numpy_helper.from_array(np.random.default_rng(3).normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "w")],
    )
    model = onnx.helper.make_model(graph, opset_imports=list(nested.opset_import), functions=list(nested.functions))
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="bfloat16", validate="checker")
    assert "dropped 2 local function(s) that no node of the graph calls" in result.report.notes
    converted = onnx.load(str(tmp_path / "out.onnx"))
    assert not converted.functions and converted.opset_import[0].version == 22
    assert {o.domain for o in converted.opset_import} == {""}
    assert result.report.low_by_op.get("Conv") == 1


def test_dropping_an_uncalled_function_of_the_standard_domain_keeps_its_import(tmp_path: Path) -> None:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    unused = onnx.helper.make_function("", "F", ["a"], ["b"], [onnx.helper.make_node("Relu", ["a"], ["b"])], [onnx.helper.make_opsetid("", 17)])
    model = onnx.helper.make_model(
        onnx.helper.make_graph([], "g", [x], [x]), opset_imports=[onnx.helper.make_opsetid("", 17)], functions=[unused]
    )
    mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", validate="checker")
    converted = onnx.load(str(tmp_path / "out.onnx"))
    assert not converted.functions and [(o.domain, o.version) for o in converted.opset_import] == [("", 17)]
