"""The invariants checked after every pipeline step (``MIXPREC_CHECK_STEPS=1``): each broken
invariant is named in one line with the step, the graph and the node or value, what the source
model already broke is not blamed on the converter, and clean conversions pass."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import helper as oh

import mixprec
import mixprec.pipeline.runner as runner
from mixprec import cli
from mixprec.errors import InvariantError
from mixprec.validate.invariants import Baseline, check_invariants, require_invariants, steps_checked

FLOAT = TensorProto.FLOAT
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def _chain(names: tuple[str, str] = ("a", "b")) -> ir.Model:
    """x[2,3] -> Relu (a) -> Neg (b) -> y."""
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["h"], name=names[0]), oh.make_node("Neg", ["h"], ["y"], name=names[1])],
        "g", [oh.make_tensor_value_info("x", FLOAT, [2, 3])], [oh.make_tensor_value_info("y", FLOAT, [2, 3])],
    )
    return ir.serde.deserialize_model(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))


def _nodes(model: ir.Model) -> dict[str, ir.Node]:
    return {node.name: node for node in model.graph}


def _cast_after(model: ir.Model, node: ir.Node, to: ir.DataType, typed: ir.DataType, shape: list[int]) -> ir.Node:
    """Insert `Cast(to)` after `node`'s output, its output typed `typed` with `shape`."""
    source = node.outputs[0]
    cast = ir.node("Cast", [source], attributes={"to": to}, name="cast_new")
    cast.outputs[0].name = "h_cast"
    cast.outputs[0].dtype = typed
    cast.outputs[0].shape = ir.Shape(shape)
    model.graph.insert_after(node, cast)
    for usage in list(source.uses()):
        if usage.node is not cast:
            usage.node.replace_input_with(usage.idx, cast.outputs[0])
    return cast


def test_clean_model_breaks_nothing() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    assert check_invariants(model, step="rewrite", baseline=baseline) == []
    # Without a baseline every value counts as created: before `type` none needs a type.
    assert check_invariants(model, step="upgrade", baseline=None) == []


def test_duplicate_node_name_created_after_load() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    _nodes(model)["b"].name = "a"
    problems = check_invariants(model, step="type", baseline=baseline)
    assert problems == [
        "after step 'type': graph 'g': two nodes are named 'a' (Relu and Neg); onnxruntime refuses "
        "duplicate node names"
    ]


def test_a_duplicate_the_source_had_is_not_blamed() -> None:
    model = _chain(("a", "a"))
    baseline = Baseline.capture(model)
    assert check_invariants(model, step="rewrite", baseline=baseline) == []
    assert any("two nodes are named 'a'" in p for p in check_invariants(model, step="rewrite", baseline=None))


def test_cast_output_type_disagrees_with_to() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    _cast_after(model, _nodes(model)["a"], ir.DataType.FLOAT16, ir.DataType.FLOAT, [2, 3])
    problems = check_invariants(model, step="plan", baseline=baseline)
    assert problems == [
        "after step 'plan': graph 'g': Cast 'cast_new' converts to FLOAT16 but its output 'h_cast' is typed FLOAT"
    ]


def test_elementwise_output_type_follows_its_inputs() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    _cast_after(model, _nodes(model)["a"], ir.DataType.FLOAT16, ir.DataType.FLOAT16, [2, 3])
    problems = check_invariants(model, step="plan", baseline=baseline)
    assert problems == [
        "after step 'plan': graph 'g': Neg 'b' reads FLOAT16 but its output 'y' is typed FLOAT"
    ]


def test_created_value_without_a_type() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    cast = _cast_after(model, _nodes(model)["a"], ir.DataType.FLOAT, ir.DataType.FLOAT, [2, 3])
    cast.outputs[0].type = None
    assert check_invariants(model, step="upgrade", baseline=baseline) == []  # not typed yet
    assert check_invariants(model, step="rewrite", baseline=baseline) == [
        "after step 'rewrite': graph 'g': value 'h_cast' (output of Cast 'cast_new') was created by "
        "the converter without a type"
    ]


def test_created_value_with_a_wrong_rank_shape() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    _cast_after(model, _nodes(model)["a"], ir.DataType.FLOAT, ir.DataType.FLOAT, [6])
    # Shapes are compared with ONNX shape inference after the rewrite only.
    assert check_invariants(model, step="plan", baseline=baseline) == []
    assert check_invariants(model, step="rewrite", baseline=baseline) == [
        "after step 'rewrite': graph 'g': value 'h_cast' (output of Cast 'cast_new') carries shape [6] "
        "but ONNX shape inference gives [2, 3]"
    ]


def test_created_value_with_a_wrong_fixed_dimension() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    _cast_after(model, _nodes(model)["a"], ir.DataType.FLOAT, ir.DataType.FLOAT, [2, 4])
    (problem,) = check_invariants(model, step="rewrite", baseline=baseline)
    assert "carries shape [2, 4] but ONNX shape inference gives [2, 3]" in problem


def test_renamed_graph_output() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    model.graph.outputs[0].name = "y_renamed"
    assert check_invariants(model, step="rewrite", baseline=baseline) == [
        "after step 'rewrite': graph 'g': the graph outputs are now ['y_renamed'], were ['y']"
    ]


def test_graph_input_type_kept_with_keep_io_types() -> None:
    model = _chain()
    kept, free = Baseline.capture(model), Baseline.capture(model, keep_io_types=False)
    model.graph.inputs[0].dtype = ir.DataType.FLOAT16
    problems = [p for p in check_invariants(model, step="rewrite", baseline=kept) if "graph input" in p]
    assert problems == ["after step 'rewrite': graph 'g': graph input 'x' is now FLOAT16, was FLOAT"]
    assert not [p for p in check_invariants(model, step="rewrite", baseline=free) if "graph input" in p]


def test_dangling_edge() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    ghost = ir.Value(name="ghost", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3]))
    _nodes(model)["b"].replace_input_with(0, ghost)
    assert check_invariants(model, step="rewrite", baseline=baseline) == [
        "after step 'rewrite': graph 'g': Neg 'b' reads 'ghost', which no node produces and which is "
        "no graph input or initializer"
    ]


def test_constant_not_registered_as_an_initializer() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    weight = ir.Value(name="w", const_value=ir.tensor([[1.0] * 3] * 2), type=ir.TensorType(ir.DataType.FLOAT))
    _nodes(model)["b"].replace_input_with(0, weight)
    assert check_invariants(model, step="rewrite", baseline=baseline) == [
        "after step 'rewrite': graph 'g': Neg 'b' reads 'w', which no node produces and which is no "
        "graph input or initializer (it holds a tensor but is not a registered initializer)"
    ]


def test_read_of_a_removed_producer() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    model.graph.remove(_nodes(model)["a"], safe=False)
    assert check_invariants(model, step="rewrite", baseline=baseline) == [
        "after step 'rewrite': graph 'g': Neg 'b' reads 'h', whose producer Relu 'a' is no longer in any graph"
    ]


def test_read_before_the_producer_runs() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    b = _nodes(model)["b"]
    model.graph.remove(b)
    model.graph.insert_before(_nodes(model)["a"], b)
    assert check_invariants(model, step="rewrite", baseline=baseline) == [
        "after step 'rewrite': graph 'g': Neg 'b' reads 'h' before its producer Relu 'a' runs"
    ]


def test_unused_created_initializer_and_a_name_defined_twice() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    spare = ir.Value(name="spare", const_value=ir.tensor([1.0]))
    model.graph.initializers.add(spare)
    assert check_invariants(model, step="rewrite", baseline=baseline) == [
        "after step 'rewrite': graph 'g': initializer 'spare' was created by the converter but nothing reads it"
    ]
    # An initializer whose name a node output takes too: defined twice.
    _nodes(model)["a"].outputs[0].name = "spare"
    assert (
        "after step 'rewrite': graph 'g': value 'spare' is defined twice (output of Relu 'a' and an "
        "initializer): the graph is not in SSA form"
    ) in check_invariants(model, step="rewrite", baseline=baseline)


def _if_model(then_out: str) -> ir.Model:
    then = oh.make_graph(
        [oh.make_node("Neg", ["x"], [then_out], name="neg")], "then", [],
        [oh.make_tensor_value_info(then_out, FLOAT, [2])],
    )
    other = oh.make_graph(
        [oh.make_node("Abs", ["h"], ["e"], name="abs")], "else", [], [oh.make_tensor_value_info("e", FLOAT, [2])]
    )
    graph = oh.make_graph(
        [oh.make_node("Relu", ["x"], ["h"], name="relu"),
         oh.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)],
        "g", [oh.make_tensor_value_info("x", FLOAT, [2]), oh.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [oh.make_tensor_value_info("y", FLOAT, [2])],
    )
    return ir.serde.deserialize_model(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))


def test_subgraph_redefines_a_visible_outer_value() -> None:
    model = _if_model("t")
    baseline = Baseline.capture(model)
    then = model.graph.node("if").attributes["then_branch"].as_graph()
    then.node("neg").outputs[0].name = "h"  # the outer Relu's output, visible in the branch
    problems = check_invariants(model, step="rewrite", baseline=baseline)
    assert problems[0] == (
        "after step 'rewrite': graph 'g' > If 'if' then_branch: Neg 'neg' redefines 'h', a value of "
        "the enclosing graph 'g': the graph is not in SSA form"
    )


def test_subgraph_value_hiding_an_outer_read() -> None:
    model = _if_model("t")
    baseline = Baseline.capture(model)
    other = model.graph.node("if").attributes["else_branch"].as_graph()
    hidden = ir.Value(name="h", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    other.initializers.add(hidden)
    hidden.const_value = ir.tensor([1.0, 2.0], name="h")
    problems = check_invariants(model, step="rewrite", baseline=baseline)
    assert (
        "after step 'rewrite': graph 'g' > If 'if' else_branch: Abs 'abs' reads the outer value 'h', but "
        "graph 'g' > If 'if' else_branch defines a value of that name that hides it"
    ) in problems


def test_require_invariants_raises_one_line() -> None:
    model = _chain()
    baseline = Baseline.capture(model)
    _nodes(model)["b"].name = "a"
    model.graph.outputs[0].name = "z"
    with pytest.raises(InvariantError) as caught:
        require_invariants(model, step="rewrite", baseline=baseline)
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, mixprec.MixprecError)
    assert message.startswith("after step 'rewrite': graph 'g': two nodes are named 'a'")
    assert message.endswith("(and 1 more)")


def test_switch_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXPREC_CHECK_STEPS", "1")
    assert steps_checked() and runner.steps_checked()
    monkeypatch.setenv("MIXPREC_CHECK_STEPS", "0")
    assert not steps_checked()
    monkeypatch.delenv("MIXPREC_CHECK_STEPS")
    assert not steps_checked()


def test_pipeline_names_the_step_that_broke_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXPREC_CHECK_STEPS", "1")

    make_plan = runner.make_plan

    def plan_and_break(model: ir.Model, *args: object) -> object:
        planned = make_plan(model, *args)
        nodes = list(model.graph)
        nodes[1].name = nodes[0].name
        return planned

    monkeypatch.setattr(runner, "make_plan", plan_and_break)
    with pytest.raises(InvariantError, match=r"^after step 'plan': graph 'g': two nodes are named 'a'"):
        mixprec.convert(ir.to_proto(_chain()), validate="none")
    monkeypatch.setenv("MIXPREC_CHECK_STEPS", "0")
    mixprec.convert(ir.to_proto(_chain()), validate="none")  # unchecked: the broken model goes through


def test_cli_exits_4_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MIXPREC_CHECK_STEPS", "1")

    rewrite = runner.rewrite

    def rewrite_and_break(model: ir.Model, *args: object) -> object:
        rewritten = rewrite(model, *args)
        model.graph.outputs[0].name = "renamed"
        return rewritten

    monkeypatch.setattr(runner, "rewrite", rewrite_and_break)
    source, output = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(ir.to_proto(_chain()), source)
    assert cli.main(["convert", str(source), str(output), "--validate", "none"]) == 4
    error = capsys.readouterr().err.strip()
    assert error == (
        "mixprec: error: after step 'rewrite': graph 'g': the graph outputs are now ['renamed'], were "
        "['y'] (nothing written)"
    )
    assert not output.exists()


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_light_cnn_converts_cleanly_with_the_checks_on(
    target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MIXPREC_CHECK_STEPS", "1")
    seen: list[str] = []
    real = runner.require_invariants

    def spy(model: ir.Model, *, step: str, baseline: Baseline | None) -> None:
        seen.append(step)
        real(model, step=step, baseline=baseline)

    monkeypatch.setattr(runner, "require_invariants", spy)
    result = mixprec.convert(
        LIGHT / "light_squeezenet.onnx", tmp_path / "out.onnx", target_dtype=target, validate="checker"
    )
    assert result.report.nodes_by_precision.get("low", 0) > 0
    assert seen == [
        "inline", "upgrade", "fold", "type", "normalize", "analyze", "plan", "rewrite", "save", "save (staged file)"
    ]
