"""Numerics are checked on inputs the FP32 model accepts, or the report says they were not."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run
from mixprec.report.html import render_html_report
from mixprec.validate.emulate import emulate_low_precision
from mixprec.cli import EXIT_UNCHECKED, main


def _save(graph: onnx.GraphProto, path: Path, opset: int = 17) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _windowed_model(path: Path) -> Path:
    """An audio-like front end: a 100-sample convolution window over a symbolic length, and a
    second input sharing the batch dimension."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.normal(0, 0.1, (4, 1, 100)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["audio", "w"], ["frames"], strides=[10]),
        helper.make_node("ReduceMean", ["frames"], ["pooled"], axes=[2], keepdims=0),
        helper.make_node("MatMul", ["pooled", "proj"], ["y"]),
    ]
    proj = numpy_helper.from_array(rng.normal(0, 0.5, (4, 3)).astype(np.float32), "proj")
    graph = helper.make_graph(
        nodes, "windowed",
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", 1, "samples"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [weight, proj],
    )
    return _save(graph, path)


def _fixed_size_model(path: Path) -> Path:
    """A model that only runs on 35 samples: no generated size fits."""
    shape = numpy_helper.from_array(np.array([7, 5], dtype=np.int64), "shape")
    weight = numpy_helper.from_array(np.ones((5, 2), dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("MatMul", ["r", "w"], ["y"])],
        "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [7, 2])],
        [shape, weight],
    )
    return _save(graph, path)


def test_generated_inputs_grow_until_the_fp32_model_runs(tmp_path: Path) -> None:
    result = mixprec.convert(_windowed_model(tmp_path / "m.onnx"), tmp_path / "o.onnx", target_dtype="fp16")
    validation = result.report.validation
    assert validation.numerics.startswith("checked") and not validation.numerics_unchecked
    assert any("use 128 for symbolic dimensions" in n for n in validation.notes), validation.notes
    assert validation.outputs and validation.outputs[0].max_abs_error < 1e-2


def test_unchecked_numerics_are_said_in_text_json_and_exit_status(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    source = _fixed_size_model(tmp_path / "m.onnx")
    report = tmp_path / "r.json"
    code = main(["convert", str(source), str(tmp_path / "o.onnx"), "--report", str(report)])
    assert code == EXIT_UNCHECKED
    captured = capsys.readouterr()
    assert "numerics: not checked: the FP32 model fails on generated inputs" in captured.out
    assert captured.err.strip().endswith("pass --data")
    assert len(captured.err.strip().splitlines()) == 1
    data = json.loads(report.read_text())
    assert data["validation"]["numerics_unchecked"] is True
    assert (tmp_path / "o.onnx").is_file()  # the model itself is fine: written

    # With data the model fits, the check runs and the exit status is 0.
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(1).normal(size=35).astype(np.float32))
    assert main(["convert", str(source), str(tmp_path / "o2.onnx"), "--data", str(tmp_path / "d.npz")]) == 0


def _summing_model(path: Path, width: int = 64, op: str = "MatMul") -> Path:
    """y = x @ ones: the sum of `width` inputs, so y grows with the inputs' magnitude."""
    ones = numpy_helper.from_array(np.ones((width, 4), dtype=np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["s"], name="sum"), helper.make_node(op, ["s"], ["y"], name="act")]
    graph = helper.make_graph(
        nodes, "summing",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [ones],
    )
    return _save(graph, path)


def test_generated_inputs_are_scaled_up_to_show_where_the_converted_model_overflows(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A sum of 64 inputs stays within float16 for pixel-sized inputs and overflows for audio-
    sized ones: the report says so and names the node; with data of that size the node stays
    FP32 and no scaled run is made."""
    source = _summing_model(tmp_path / "m.onnx", op="Relu")
    report, page = tmp_path / "r.json", tmp_path / "r.html"
    assert main(["convert", str(source), str(tmp_path / "o.onnx"), "--report", str(report), "--html", str(page)]) == 0
    html = page.read_text()
    assert '<p class="warn" id="input-scale">Input scale: generated inputs (x) set to 0 (silence, a black image, padding): finite; scaled to |x| up to 255' in html
    scales = json.loads(report.read_text())["validation"]["input_scales"]
    assert [(s["magnitude"], s["finite"]) for s in scales] == [(0.0, True), (255.0, True), (32767.0, False)]
    assert "'sum'" in scales[2]["origin"], scales[2]["origin"]
    text = capsys.readouterr().out
    assert "to 32767 (16-bit audio samples): inf/NaN where FP32 is finite" in text
    assert "pass --data" in text.split("input scale:")[1]

    # The converted model does overflow there (emulated: a float16 runtime rounds each value),
    # where the sum passes float16's 65504.
    loud = np.full((2, 64), 32767 / 64 * 4, dtype=np.float32)  # sums to 131068
    assert not np.isfinite(run(emulate_low_precision(onnx.load(str(tmp_path / "o.onnx"))), {"x": loud})[0]).all()

    # With data that large, the sum stays FP32 and the data are the check: no scaled runs.
    np.savez(tmp_path / "d.npz", x=loud)
    result = mixprec.convert(source, tmp_path / "o2.onnx", target_dtype="fp16", data=tmp_path / "d.npz")
    assert result.report.validation.input_scales == []
    assert np.isfinite(run(emulate_low_precision(onnx.load(str(tmp_path / "o2.onnx"))), {"x": loud})[0]).all()


def test_a_model_finite_at_every_scale_or_without_float_inputs_says_so(tmp_path: Path) -> None:
    # Sigmoid of one input (width 1: no sum): finite at both magnitudes (65504 is not reached).
    result = mixprec.convert(_summing_model(tmp_path / "m.onnx", width=1, op="Sigmoid"), tmp_path / "o.onnx")
    scales = result.report.validation.input_scales
    assert [(s.magnitude, s.finite) for s in scales] == [(0.0, True), (255.0, True), (32767.0, True)]
    assert (
        "input scale: generated inputs (x) set to 0 (silence, a black image, padding): finite; "
        "scaled to |x| up to 255 (8-bit pixel values): finite; to 32767"
    ) in result.report.format_text()
    assert "inf/NaN" not in result.report.format_text()

    # Exp of the inputs: FP32 itself overflows at 255, so nothing is judged beyond it.
    graph = helper.make_graph(
        [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("MatMul", ["e", "w"], ["y"])], "exp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")],
    )
    result = mixprec.convert(_save(graph, tmp_path / "e.onnx"), tmp_path / "eo.onnx")
    assert [(s.magnitude, s.finite) for s in result.report.validation.input_scales] == [(0.0, True), (255.0, None)]

    # An output that holds -inf by design (a masked logit) is judged by its other positions.
    bias = np.zeros(3, np.float32)
    bias[1] = -np.inf
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "mask"], ["y"])], "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.eye(3, dtype=np.float32), "w"), numpy_helper.from_array(bias, "mask")],
    )
    result = mixprec.convert(_save(graph, tmp_path / "k.onnx"), tmp_path / "ko.onnx")
    assert [(s.magnitude, s.finite) for s in result.report.validation.input_scales] == [
        (0.0, True), (255.0, True), (32767.0, True),
    ]

    # Integer inputs only (token ids): nothing to scale.
    table = numpy_helper.from_array(np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["g"]), helper.make_node("Relu", ["g"], ["y"])], "ids",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])],
        [table],
    )
    result = mixprec.convert(_save(graph, tmp_path / "i.onnx"), tmp_path / "io.onnx")
    assert result.report.validation.numerics.startswith("checked")
    assert result.report.validation.input_scales == []


def test_generated_inputs_set_to_zero_show_where_a_guard_no_longer_holds(tmp_path: Path) -> None:
    """10 / (|x @ w| + 1e-4): finite on random inputs and on large ones, but all-zero inputs
    (silence, a black image) give 1e5, beyond float16's 65504. The probe at 0 says so and names
    where inf starts, and the larger magnitudes are still probed."""
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Abs", ["h"], ["a"]),
         helper.make_node("Add", ["a", "eps"], ["d"]), helper.make_node("Div", ["ten", "d"], ["y"], name="inverse")],
        "inverse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [weight, numpy_helper.from_array(np.array(1e-4, np.float32), "eps"),
         numpy_helper.from_array(np.array(10.0, np.float32), "ten")],
    )
    result = mixprec.convert(_save(graph, tmp_path / "m.onnx"), tmp_path / "o.onnx", target_dtype="fp16")
    scales = result.report.validation.input_scales
    assert [(s.magnitude, s.finite) for s in scales] == [(0.0, False), (255.0, True), (32767.0, True)]
    assert scales[0].origin is not None and "non-finite values start" in scales[0].origin
    text = result.report.format_text()
    assert "set to 0 (silence, a black image, padding): inf/NaN where FP32 is finite" in text
    assert "if real inputs can be all zero" in text and "pass --data" not in text
    zeros = {"x": np.zeros((2, 4), np.float32)}
    assert np.isfinite(run(onnx.load(str(tmp_path / "m.onnx")), zeros)[0]).all()
    assert not np.isfinite(run(emulate_low_precision(onnx.load(str(tmp_path / "o.onnx"))), zeros)[0]).all()


def test_a_batch_tied_to_a_fixed_size_is_generated_as_1(tmp_path: Path) -> None:
    """A symbolic batch joined with a state of batch 1 (as a recurrent model's initial state is)
    runs only at batch 1: the generated inputs fall back to it, and the numerics are checked."""
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Concat", ["x", "state"], ["joined"], axis=1), helper.make_node("MatMul", ["joined", "w"], ["y"])],
        "tied",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [weight],
    )
    result = mixprec.convert(_save(graph, tmp_path / "m.onnx"), tmp_path / "o.onnx")
    validation = result.report.validation
    assert validation.numerics.startswith("checked"), validation.numerics
    assert any("(1 for leading ones; with 2 the FP32 model fails)" in n for n in validation.notes), validation.notes
    assert validation.outputs[0].max_abs_error < 1e-2


def test_the_overflow_origin_is_located_only_in_small_graphs(tmp_path: Path) -> None:
    """Locating where non-finite values start runs the model once per chunk of intermediate
    values: beyond 200 nodes the probe says at which magnitude the model overflows, not where."""
    ones = numpy_helper.from_array(np.ones((64, 4), dtype=np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["r0"], name="sum")]
    nodes += [helper.make_node("Relu", [f"r{i}"], [f"r{i + 1}"], name=f"relu{i}") for i in range(210)]
    graph = helper.make_graph(
        nodes, "long",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("r210", TensorProto.FLOAT, [2, 4])], [ones],
    )
    result = mixprec.convert(_save(graph, tmp_path / "m.onnx"), tmp_path / "o.onnx")
    scales = result.report.validation.input_scales
    assert [(s.magnitude, s.finite, s.origin) for s in scales] == [(0.0, True, None), (255.0, True, None), (32767.0, False, None)]
    assert "to 32767 (16-bit audio samples): inf/NaN where FP32 is finite" in result.report.format_text()


def test_a_string_input_is_generated_and_checked_through_the_child_process(tmp_path: Path) -> None:
    """The child process that first tries each generated size reads string inputs (object
    arrays) too, so a model with one is checked as before."""
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Identity", ["tag"], ["tag_out"])],
        "tagged",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("tag", TensorProto.STRING, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("tag_out", TensorProto.STRING, [2])],
        [weight],
    )
    result = mixprec.convert(_save(graph, tmp_path / "m.onnx"), tmp_path / "o.onnx")
    assert result.report.validation.numerics.startswith("checked"), result.report.validation.numerics
    assert result.report.low_by_op.get("MatMul") == 1


def test_a_child_process_that_cannot_start_leaves_the_check_in_process(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Where no child process can be started (an embedded interpreter), the generated sizes run
    in this process as before; the report says the runtime load was not checked there."""
    from mixprec.runtime import isolated  # noqa: PLC0415

    monkeypatch.setattr(isolated.sys, "executable", str(tmp_path / "no-python-here"))
    isolated._WORKER.stop()
    try:
        result = mixprec.convert(_summing_model(tmp_path / "m.onnx", op="Relu"), tmp_path / "o.onnx")
    finally:
        isolated._WORKER.stop()
    validation = result.report.validation
    assert validation.numerics.startswith("checked"), validation.numerics
    assert validation.outputs and validation.outputs[0].nan_count == 0
    assert any("cannot be started" in n and "was not checked" in n for n in validation.notes), validation.notes


def _length_from_ceil() -> onnx.ModelProto:
    """y = Range(0, sum(Ceil(x @ I))) as floats: the output's length is computed from values
    that a 16-bit MatMul rounds (16.02 is 16.0 in bfloat16, so its Ceil is 16, not 17)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        helper.make_node("Ceil", ["m"], ["c"], name="ceil"),
        helper.make_node("ReduceSum", ["c"], ["s"], name="sum", keepdims=0),
        helper.make_node("Cast", ["s"], ["n"], name="count", to=TensorProto.INT64),
        helper.make_node("Range", ["zero", "n", "one"], ["r"], name="range"),
        helper.make_node("Cast", ["r"], ["y"], name="out", to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "length", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"),
         numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def test_an_output_whose_shape_the_conversion_changes_is_reported_as_such(tmp_path: Path) -> None:
    x = np.array([[16.02, 3.3, 2.5, 7.01]], np.float32)  # ceilings 17 + 4 + 3 + 8 = 32; in bfloat16 30
    result = mixprec.convert(_length_from_ceil(), tmp_path / "out.onnx", target_dtype="bf16", runtime="onnx", data=[{"x": x}])
    (out,) = result.report.validation.outputs
    assert out.shapes == ((32,), (30,))
    text = result.report.format_text()
    assert "y: shape [30] where the FP32 model's is [32]" in text and "inf%" not in text
    assert any("comes out in another shape than the FP32 model's" in n for n in result.report.validation.notes)
    assert not any("differs from the FP32 model by up to" in n for n in result.report.validation.notes)
    page = render_html_report(result.report)
    assert "shape [30] where the FP32 model&#x27;s is [32]" in page or "shape [30] where the FP32 model's is [32]" in page


def _branching_model(constant_condition: bool = False) -> onnx.ModelProto:
    """y = If(sum(x) > 0, x @ A, relu(x @ B)): each branch computes in 16 bits."""
    rng = np.random.default_rng(0)

    def branch(name: str, weight: str, relu: bool) -> onnx.GraphProto:
        nodes = [helper.make_node("MatMul", ["x", weight], [f"{name}_m"])]
        if relu:
            nodes.append(helper.make_node("Relu", [f"{name}_m"], [f"{name}_out"]))
        out = f"{name}_out" if relu else f"{name}_m"
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, [4, 8])])

    condition = (
        [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True)))]
        if constant_condition else
        [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0), helper.make_node("Greater", ["s", "zero"], ["c"])]
    )
    graph = helper.make_graph(
        [*condition, helper.make_node("If", ["c"], ["y"], name="sign_switch", then_branch=branch("then", "a", False),
                                      else_branch=branch("else", "b", True))],
        "branching", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "a"),
         numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "b"),
         numpy_helper.from_array(np.array(0.0, np.float32), "zero")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_branch_no_batch_took_is_said_to_be_unchecked(tmp_path: Path) -> None:
    """The numeric check compares outputs: an If branch that no batch took never ran in 16 bits,
    and the report names it; data that takes both branches checks both, and a constant
    condition's other branch never runs anywhere."""
    positive = {"x": np.abs(np.random.default_rng(1).standard_normal((4, 8))).astype(np.float32)}
    negative = {"x": -positive["x"]}

    def notes(model: onnx.ModelProto, data: list) -> list[str]:
        result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", data=data, overwrite=True)
        assert not result.report.validation.numerics_unchecked
        return [n for n in result.report.validation.notes if n.startswith("If ")]

    only_then = notes(_branching_model(), [positive])
    assert len(only_then) == 1 and "'sign_switch' took only its then branch on the 1 batch(es)" in only_then[0]
    assert "its else branch (2 node(s) in 16 bits) did not run" in only_then[0]
    assert "its then branch (1 node(s)" in notes(_branching_model(), [negative])[0]
    assert notes(_branching_model(), [positive, negative]) == []
    assert notes(_branching_model(constant_condition=True), [positive]) == []


def _switched_model() -> onnx.ModelProto:
    """y = If(use_cache_branch, x @ A, relu(x @ B)), the condition a boolean graph input: the
    switch of a merged decoder as optimum exports it."""
    model = _branching_model()
    graph = model.graph
    del graph.node[:2]  # the computed condition
    graph.node[0].input[0] = "use_cache_branch"
    graph.input.append(helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1]))
    return model


def test_generated_inputs_take_both_branches_of_a_switch_input(tmp_path: Path) -> None:
    result = mixprec.convert(_switched_model(), tmp_path / "out.onnx", target_dtype="float16")
    assert result.report.nodes_by_precision["low"] >= 3  # both branches' MatMuls
    validation = result.report.validation
    assert validation.numerics.startswith("checked on 2 batch(es)"), validation.numerics
    assert not [n for n in validation.notes if n.startswith("If ")], validation.notes
    # Data of the user's own is taken as it comes: one value of the switch, one branch checked.
    data = [{"x": np.ones((4, 8), np.float32), "use_cache_branch": np.array([True])}]
    result = mixprec.convert(_switched_model(), tmp_path / "out.onnx", target_dtype="float16", data=data, overwrite=True)
    (note,) = [n for n in result.report.validation.notes if n.startswith("If ")]
    assert "took only its then branch" in note
    # A switch with a default (an initializer of the same name) is not generated: left as it is.
    defaulted = _switched_model()
    defaulted.graph.initializer.append(numpy_helper.from_array(np.array([True]), "use_cache_branch"))
    result = mixprec.convert(defaulted, tmp_path / "out.onnx", target_dtype="float16", overwrite=True)
    assert result.report.validation.numerics.startswith("checked on 1 batch(es)"), result.report.validation.numerics


def test_every_if_on_an_untaken_condition_is_named_and_a_fixed_one_is_not(tmp_path: Path) -> None:
    """Two Ifs reading one condition get a note each; a condition no input reaches
    (Identity of a Constant) never takes its other branch anywhere: no note."""
    positive = {"x": np.abs(np.random.default_rng(1).standard_normal((4, 8))).astype(np.float32)}
    shared = _branching_model()
    second = onnx.NodeProto()
    second.CopyFrom(shared.graph.node[-1])
    second.name, second.output[0] = "second_switch", "y2"
    shared.graph.node.append(second)
    shared.graph.output.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [4, 8]))
    result = mixprec.convert(shared, tmp_path / "shared.onnx", target_dtype="float16", data=[positive])
    named = [n.split("'")[1] for n in result.report.validation.notes if n.startswith("If ")]
    assert named == ["sign_switch", "second_switch"]

    fixed = _branching_model(constant_condition=True)
    fixed.graph.node[0].output[0] = "c_const"
    fixed.graph.node.insert(1, helper.make_node("Identity", ["c_const"], ["c"]))
    result = mixprec.convert(fixed, tmp_path / "fixed.onnx", target_dtype="float16", data=[positive])
    assert not [n for n in result.report.validation.notes if n.startswith("If ")]


def test_an_output_below_the_normal_range_is_named_as_the_cause(tmp_path: Path) -> None:
    """x @ w with weights around 3e-7 (subnormal in float16, not flushed): every FP32 output
    lies below float16's smallest normal (6.1e-5), where float16 keeps a few bits. The note on
    the large error says so."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.uniform(1.0, 5.0, (8, 4)) * 1e-7).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [weight],
    )
    result = mixprec.convert(_save(graph, tmp_path / "m.onnx"), tmp_path / "o.onnx", target_dtype="fp16")
    note = next(n for n in result.report.validation.notes if n.startswith("output 'y' differs"))
    assert "below the float16 normal range (6.1e-05)" in note and "its FP32 values are at most" in note
    # In bfloat16 the same values are normal numbers: no such note.
    result = mixprec.convert(tmp_path / "m.onnx", tmp_path / "b.onnx", target_dtype="bf16")
    assert not any("normal range" in n for n in result.report.validation.notes)


def _dynamically_quantized_layers(path: Path) -> Path:
    """Four layers x -> MatMul(x, W) -> MatMul(., mix) / 8 -> Tanh, the weight products
    quantized dynamically by onnxruntime's `quantize_dynamic` (DynamicQuantizeLinear +
    MatMulInteger: each layer's input is quantized to int8 as the model runs); the products with
    the `mix` input stay float."""
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415

    rng = np.random.default_rng(0)
    width = 64
    nodes, weights, x = [], [numpy_helper.from_array(np.array(1 / 8, np.float32), "k")], "x"
    for i in range(4):
        weights.append(numpy_helper.from_array((rng.standard_normal((width, width)) / 8).astype(np.float32), f"w{i}"))
        nodes += [
            helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
            helper.make_node("MatMul", [f"m{i}", "mix"], [f"g{i}"]),
            helper.make_node("Mul", [f"g{i}", "k"], [f"a{i}"]),
            helper.make_node("Tanh", [f"a{i}"], [f"h{i}"]),
        ]
        x = f"h{i}"
    graph = helper.make_graph(
        nodes, "layers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, width]),
         helper.make_tensor_value_info("mix", TensorProto.FLOAT, [width, width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [16, width])], weights,
    )
    plain = path.with_name("plain.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), plain)
    quantize_dynamic(str(plain), str(path), weight_type=QuantType.QInt8)
    return path


def test_dynamic_quantization_explains_a_larger_difference(tmp_path: Path) -> None:
    """A 16-bit rounding before a DynamicQuantizeLinear can move a value to the next int8 step:
    the report says so rather than leaving the difference unexplained."""
    model = _dynamically_quantized_layers(tmp_path / "dynamic.onnx")
    assert {n.op_type for n in onnx.load(model).graph.node} >= {"DynamicQuantizeLinear", "MatMulInteger"}
    assert not {"DequantizeLinear", "QuantizeLinear"} & {n.op_type for n in onnx.load(model).graph.node}
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16")
    assert result.report.nodes_by_precision["low"] > 0
    (note,) = [n for n in result.report.validation.notes if "differs from the FP32 model" in n]
    assert "in a quantized model one float16 rounding can move a value to the next quantization step" in note
    # The same layers unquantized stay within rounding: no note.
    plain = mixprec.convert(tmp_path / "plain.onnx", tmp_path / "plain16.onnx", target_dtype="float16")
    assert not [n for n in plain.report.validation.notes if "differs from the FP32 model" in n]
