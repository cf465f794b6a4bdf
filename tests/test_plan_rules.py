"""Each planning rule (`mixprec.plan.rules`) alone: on a small graph, the ruling it returns for
one node (after the planner decided the nodes before it), or None where it passes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
from onnx import TensorProto, numpy_helper

from mixprec.analysis.typeinfo import infer_types
from mixprec.dtypes import LowPrecision
from mixprec.plan import rules
from mixprec.plan.model import Category, Decision, NodeMatcher, Precision, State
from mixprec.plan.planner import Planner
from mixprec.plan.rules import Action, Ruling
from mixprec.policy.profiles import load_runtime
from mixprec.policy.table import load_policy

F32 = TensorProto.FLOAT


def _info(name: str, elem: int = F32, shape: Sequence[int | str] = (2, 3)) -> onnx.ValueInfoProto:
    return oh.make_tensor_value_info(name, elem, list(shape))


def _const(name: str, value: float, shape: Sequence[int] = (2, 3)) -> onnx.TensorProto:
    return numpy_helper.from_array(np.full(shape, value, np.float32), name)


def _planner(
    nodes: list[onnx.NodeProto],
    inputs: Sequence[str] = ("x", "y"),
    outputs: Sequence[str] = ("z",),
    *,
    initializers: Sequence[onnx.TensorProto] = (),
    opset: int = 17,
    target: LowPrecision = LowPrecision.FLOAT16,
    runtime: str = "onnx",
    exclude: Sequence[str] = (),
    functions: Sequence[onnx.FunctionProto] = (),
    input_infos: Sequence[onnx.ValueInfoProto] = (),
) -> Planner:
    graph = oh.make_graph(
        nodes, "g", list(input_infos) or [_info(n) for n in inputs], [_info(n) for n in outputs],
        initializer=list(initializers),
    )
    opsets = [oh.make_opsetid("", opset)] + [oh.make_opsetid(f.domain, 1) for f in functions]
    proto = oh.make_model(graph, opset_imports=opsets, functions=list(functions))
    model = ir.serde.deserialize_model(proto)
    infer_types(model)
    planner = Planner(model, load_policy(target), NodeMatcher(exclude), True, runtime=load_runtime(runtime))
    return planner


def _node(planner: Planner, name: str) -> ir.Node:
    return next(node for node in planner.order if node.name == name)


def _rule_at(planner: Planner, name: str, rule: Callable[..., Ruling | None]) -> Ruling | None:
    """The rule's ruling on node `name`, the nodes before it decided by the planner."""
    planner.start()
    for node in planner.order:
        if node.name == name:
            return rule(node, planner.node_facts(node), planner)
        planner.decide(node)
    raise AssertionError(name)


def _add(name: str = "add", a: str = "x", b: str = "y", out: str = "z") -> onnx.NodeProto:
    return oh.make_node("Add", [a, b], [out], name=name)


def test_rules_are_in_order_and_named() -> None:
    names = [rule.__name__ for rule in rules.RULES]
    assert names == [
        "control_flow", "function_call", "integer_kernel", "unknown_op", "no_float", "unknown_type", "excluded", "forced",
        "measured_wide", "dtype_source", "fixed_type", "runtime_blocked", "schema", "policy_class",
        "runtime_one_type", "wide_inputs", "folded_at_load", "low_class", "follow_fp32", "follow_low", "flexible",
    ]


def test_control_flow() -> None:
    then = oh.make_graph([oh.make_node("Identity", ["x"], ["t"])], "then", [], [_info("t")])
    other = oh.make_graph([oh.make_node("Neg", ["x"], ["e"])], "else", [], [_info("e")])
    planner = _planner(
        [oh.make_node("If", ["c"], ["z"], name="if", then_branch=then, else_branch=other)],
        input_infos=[_info("x"), _info("c", TensorProto.BOOL, ())],
    )
    ruling = _rule_at(planner, "if", rules.control_flow)
    assert ruling is not None and ruling.action is Action.KEEP and ruling.state is State.HIGH
    assert ruling.decision == Decision(
        Precision.FP32, Category.CONTROL_FLOW, "boundary keeps its types; subgraphs are converted inside"
    )
    assert _rule_at(_planner([_add()]), "add", rules.control_flow) is None


def test_function_call() -> None:
    body = oh.make_function(
        "local", "Twice", ["a"], ["b"], [oh.make_node("Add", ["a", "a"], ["b"])], [oh.make_opsetid("", 17)]
    )
    planner = _planner(
        [oh.make_node("Twice", ["x"], ["z"], name="call", domain="local")], inputs=("x",), functions=[body]
    )
    ruling = _rule_at(planner, "call", rules.function_call)
    assert ruling is not None and ruling.decision.category is Category.FUNCTION
    assert ruling.reason == "local::Twice: signature kept; its body is converted inside"
    assert _rule_at(_planner([_add()]), "add", rules.function_call) is None


def test_unknown_op() -> None:
    planner = _planner([oh.make_node("Foo", ["x"], ["z"], name="foo", domain="example")], inputs=("x",))
    planner.model.opset_imports["example"] = 1
    ruling = _rule_at(planner, "foo", rules.unknown_op)
    assert ruling is not None
    assert ruling.decision == Decision(
        Precision.FP32, Category.UNKNOWN_OP, "example::Foo: no ONNX schema for this op and opset"
    )
    assert _rule_at(_planner([_add()]), "add", rules.unknown_op) is None


def test_no_float() -> None:
    planner = _planner(
        [oh.make_node("Shape", ["x"], ["s"], name="shape")], inputs=("x",), outputs=(),
        input_infos=[_info("x")],
    )
    planner.model.graph.outputs.append(_node(planner, "shape").outputs[0])
    ruling = _rule_at(planner, "shape", rules.no_float)
    assert ruling is not None and ruling.decision == Decision(Precision.FP32, Category.NO_FLOAT, "no FP32 values")
    assert _rule_at(_planner([_add()]), "add", rules.no_float) is None


def test_unknown_type() -> None:
    planner = _planner([_add()])
    planner.model.graph.inputs[1].dtype = None
    ruling = _rule_at(planner, "add", rules.unknown_type)
    assert ruling is not None
    assert ruling.decision == Decision(Precision.FP32, Category.UNKNOWN_TYPE, "type of 'y' is unknown")
    assert _rule_at(_planner([_add()]), "add", rules.unknown_type) is None


def test_excluded() -> None:
    ruling = _rule_at(_planner([_add()], exclude=["ad+"]), "add", rules.excluded)
    assert ruling is not None
    assert ruling.decision == Decision(Precision.FP32, Category.EXCLUDED, "node name matches 'ad+'")
    assert _rule_at(_planner([_add()], exclude=["mul"]), "add", rules.excluded) is None


def test_forced() -> None:
    planner = _planner([_add()])
    planner.forced[_node(planner, "add")] = (Category.INTEGER, "adds integers held in floats")
    ruling = _rule_at(planner, "add", rules.forced)
    assert ruling is not None
    assert ruling.decision == Decision(Precision.FP32, Category.INTEGER, "adds integers held in floats")
    assert _rule_at(_planner([_add()]), "add", rules.forced) is None


def test_measured_wide() -> None:
    planner = _planner([_add()])
    planner.wide_values[_node(planner, "add").outputs[0]] = "absmax 1e+05 > 65504"
    ruling = _rule_at(planner, "add", rules.measured_wide)
    assert ruling is not None and ruling.state is State.WIDE
    assert ruling.decision == Decision(Precision.FP32, Category.DATA_RANGE, "z: absmax 1e+05 > 65504")
    assert _rule_at(_planner([_add()]), "add", rules.measured_wide) is None


def test_dtype_source() -> None:
    fill = numpy_helper.from_array(np.array([1e5], np.float32), "fill")
    shape = numpy_helper.from_array(np.array([2, 3], np.int64), "shape")
    planner = _planner(
        [oh.make_node("ConstantOfShape", ["shape"], ["c"], name="fill", value=fill), _add(a="x", b="c")],
        inputs=("x",), initializers=[shape],
    )
    ruling = _rule_at(planner, "fill", rules.dtype_source)
    assert ruling is not None and ruling.action is Action.KEEP and ruling.state is State.WIDE
    assert ruling.category is Category.CONSTANT_RANGE and ruling.reason.startswith("fill value [100000.]")
    # A Cast of an FP32 value follows it; a Cast of a flexible one is left to its consumers.
    planner = _planner(
        [oh.make_node("Exp", ["x"], ["e"], name="exp"), oh.make_node("Cast", ["e"], ["z"], name="cast", to=F32)],
        inputs=("x",),
    )
    ruling = _rule_at(planner, "cast", rules.dtype_source)
    assert ruling is not None and ruling.decision == Decision(Precision.FP32, Category.FOLLOW, "follows FP32 input 'e'")
    planner = _planner([oh.make_node("Cast", ["x"], ["z"], name="cast", to=F32)], inputs=("x",))
    ruling = _rule_at(planner, "cast", rules.dtype_source)
    assert ruling is not None and ruling.action is Action.FLEX and ruling.facts is not None
    assert _rule_at(_planner([_add()]), "add", rules.dtype_source) is None


def test_fixed_type() -> None:
    scale = numpy_helper.from_array(np.array(0.5, np.float32), "scale")
    planner = _planner(
        [oh.make_node("DequantizeLinear", ["q", "scale"], ["z"], name="dq", output_dtype=F32)],
        inputs=("q",), initializers=[scale], opset=23, input_infos=[_info("q", TensorProto.INT8)],
    )
    ruling = _rule_at(planner, "dq", rules.fixed_type)
    assert ruling is not None
    assert ruling.decision == Decision(
        Precision.FP32, Category.SCHEMA, "DequantizeLinear: its output_dtype attribute fixes its output type"
    )
    assert _rule_at(_planner([_add()]), "add", rules.fixed_type) is None


def test_runtime_blocked() -> None:
    planner = _planner([oh.make_node("Sqrt", ["x"], ["z"], name="sqrt")], inputs=("x",), runtime="ort-cpu")
    ruling = _rule_at(planner, "sqrt", rules.runtime_blocked)
    assert ruling is not None and ruling.category is Category.RUNTIME
    assert "kernel" in ruling.reason and "Sqrt" in ruling.reason
    planner = _planner([oh.make_node("Sqrt", ["x"], ["z"], name="sqrt")], inputs=("x",), runtime="ort-cuda")
    assert _rule_at(planner, "sqrt", rules.runtime_blocked) is None


def test_schema() -> None:
    planner = _planner(
        [oh.make_node("Relu", ["x"], ["z"], name="relu")], inputs=("x",), opset=11, target=LowPrecision.BFLOAT16
    )
    ruling = _rule_at(planner, "relu", rules.schema)
    assert ruling is not None
    assert ruling.decision == Decision(
        Precision.FP32, Category.SCHEMA, "Relu-6 has no bfloat16 type for its FP32 values"
    )
    assert _rule_at(_planner([_add()]), "add", rules.schema) is None


def test_policy_class() -> None:
    planner = _planner([oh.make_node("Exp", ["x"], ["z"], name="exp")], inputs=("x",))
    ruling = _rule_at(planner, "exp", rules.policy_class)
    assert ruling is not None and ruling.category is Category.POLICY and ruling.reason.startswith("Exp: ")
    # A condition that does not hold: a mean over a long axis.
    planner = _planner(
        [oh.make_node("ReduceMean", ["x"], ["z"], name="mean", axes=[1])],
        input_infos=[_info("x", shape=(2, 100_000))],
        inputs=("x",),
    )
    ruling = _rule_at(planner, "mean", rules.policy_class)
    assert ruling is not None and ruling.category is Category.CONDITION and ruling.action is Action.KEEP
    assert _rule_at(_planner([_add()]), "add", rules.policy_class) is None


@pytest.mark.parametrize(
    ("shape", "axes", "held", "why"),
    [
        (("batch", 16, 64), [-1], True, "reduces 64 <= 256 elements"),  # a dynamic batch aside
        (("batch", 16, 64), [1, 2], False, "reduces 1024 > 256 elements"),
        (("batch", 16, 64), [0], False, "reduced size unknown (a reduced dimension is not static)"),
        ((2, "tokens", 64), [1], False, "reduced size unknown (a reduced dimension is not static)"),
        ((), [0], True, "reduces 1 <= 256 elements"),  # a scalar: its one (wrapped) axis
        (("batch", 300), None, True, "no reduction"),  # no axes, noop_with_empty_axes=1
    ],
)
def test_a_mean_is_judged_by_the_size_of_its_reduced_dimensions(
    shape: tuple, axes: list[int], held: bool, why: str
) -> None:
    """ReduceMean converts where each output element averages at most 256 elements: the sizes of
    the reduced dimensions alone count, so a dynamic batch (or any dimension kept) does not hold
    it in FP32."""
    if axes is None:  # opset 18: axes an input, here none given
        node = oh.make_node("ReduceMean", ["x"], ["z"], name="mean", noop_with_empty_axes=1)
        planner = _planner([node], input_infos=[_info("x", shape=shape)], inputs=("x",), outputs=(), opset=18)
    else:
        planner = _planner(
            [oh.make_node("ReduceMean", ["x"], ["z"], name="mean", axes=axes)],
            input_infos=[_info("x", shape=shape)], inputs=("x",), outputs=(),
        )
    ruling = _rule_at(planner, "mean", rules.policy_class)
    if held:
        assert ruling is None
        assert planner.classify(_node(planner, "mean"), planner.node_facts(_node(planner, "mean"))).reason.endswith(why)
    else:
        assert ruling is not None and ruling.category is Category.CONDITION and ruling.reason.endswith(why)


def test_runtime_one_type() -> None:
    inits = [_const(name, value, (3,)) for name, value in (("s", 1e5), ("b", 0.0), ("m", 0.0), ("v", 1.0))]
    node = oh.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["z"], name="bn")
    planner = _planner([node], inputs=("x",), initializers=inits, runtime="openvino",
                       input_infos=[_info("x", shape=(2, 3))])
    ruling = _rule_at(planner, "bn", rules.runtime_one_type)
    assert ruling is not None and ruling.category is Category.RUNTIME
    assert ruling.reason.startswith("openvino needs one element type for all BatchNormalization inputs; s: ")
    planner = _planner([node], inputs=("x",), initializers=inits, input_infos=[_info("x", shape=(2, 3))])
    assert _rule_at(planner, "bn", rules.runtime_one_type) is None


def test_wide_inputs() -> None:
    planner = _planner([_add(b="c")], inputs=("x",), initializers=[_const("c", 1e5)])
    ruling = _rule_at(planner, "add", rules.wide_inputs)
    assert ruling is not None and ruling.category is Category.CONSTANT_RANGE and ruling.state is State.WIDE
    assert ruling.reason.startswith("c: ") and ruling.carries is not None and ruling.carries.name == "c"
    assert _rule_at(_planner([_add()]), "add", rules.wide_inputs) is None
    # A bounded op ends the range it reads: its output is an FP32 value that fits.
    sigmoid = _planner(
        [_add(b="c", out="a"), oh.make_node("Sigmoid", ["a"], ["z"], name="sigmoid")],
        inputs=("x",), initializers=[_const("c", 1e5)],
    )
    ruling = _rule_at(sigmoid, "sigmoid", rules.wide_inputs)
    assert ruling is not None and ruling.state is State.HIGH and ruling.carries is None
    assert ruling.category is Category.CONSTANT_RANGE and ruling.reason.startswith("a: carries 'c'")
    # So does an op whose output is measured to fit (an accumulator times its scale).
    scaled = _planner(
        [_add(b="c", out="a"), oh.make_node("Mul", ["a", "s"], ["z"], name="scale")],
        inputs=("x",), initializers=[_const("c", 1e5), _const("s", 1e-4)],
    )
    scaled.bounded[scaled.model.graph.outputs[0]] = "measured absmax 10"
    ruling = _rule_at(scaled, "scale", rules.wide_inputs)
    assert ruling is not None and ruling.state is State.HIGH and ruling.carries is None


def test_low_class() -> None:
    planner = _planner(
        [oh.make_node("MatMul", ["x", "w"], ["z"], name="mm")], inputs=("x",), initializers=[_const("w", 0.5, (3, 3))]
    )
    ruling = _rule_at(planner, "mm", rules.low_class)
    assert ruling is not None and ruling.action is Action.LOWER
    assert ruling.decision.precision is Precision.LOW and ruling.category is Category.POLICY
    assert ruling.reason.startswith("MatMul: ")
    assert _rule_at(_planner([_add()]), "add", rules.low_class) is None


def test_follow_fp32() -> None:
    planner = _planner([oh.make_node("Exp", ["x"], ["e"], name="exp"), _add(b="e")])
    ruling = _rule_at(planner, "add", rules.follow_fp32)
    assert ruling is not None
    assert ruling.decision == Decision(Precision.FP32, Category.FOLLOW, "follows FP32 input 'e'")
    assert _rule_at(_planner([_add()]), "add", rules.follow_fp32) is None


def test_follow_low() -> None:
    planner = _planner(
        [oh.make_node("MatMul", ["x", "w"], ["m"], name="mm"), _add(a="m", b="y")],
        initializers=[_const("w", 0.5, (3, 3))],
    )
    ruling = _rule_at(planner, "add", rules.follow_low)
    assert ruling is not None
    assert ruling.decision == Decision(Precision.LOW, Category.FOLLOW, "follows 16-bit inputs (Add)")
    assert _rule_at(_planner([_add()]), "add", rules.follow_low) is None


def test_flexible() -> None:
    ruling = _rule_at(_planner([_add()]), "add", rules.flexible)
    assert ruling is not None and ruling.action is Action.FLEX and not ruling.tiny
    assert ruling.decision == Decision(Precision.FP32, Category.CONSUMERS, "pending")


@pytest.mark.parametrize("name", ["add", "exp"])
def test_decide_takes_the_first_rule_that_decides(name: str) -> None:
    planner = _planner([oh.make_node("Exp", ["x"], ["e"], name="exp"), _add(b="e")])
    ruling = _rule_at(planner, name, rules.decide)
    expected = rules.follow_fp32 if name == "add" else rules.policy_class
    assert ruling == _rule_at(Planner(planner.model, planner.policy, NodeMatcher(), True), name, expected)


@pytest.mark.parametrize("model", ["mixed", "newer_op", "control_flow", "function"])
def test_the_rules_a_template_may_need_decide_each_node_as_all_rules_do(model: str) -> None:
    """`rules_for` leaves out rules that pass on every node of an op template: the unknown-op rule
    is kept for an op without a schema (a custom op; an op newer than the model's opset, which
    has a policy rule) and for one without a policy rule, and left out for one with both; the
    control-flow and function-call rules only in a model with subgraphs or functions. Each
    node's ruling from the template's rules is that of all rules."""
    if model == "mixed":
        planner = _planner(
            [
                oh.make_node("Foo", ["x"], ["f"], name="foo", domain="example"),  # no schema
                oh.make_node("HannWindow", ["n"], ["w"], name="hann"),  # no policy rule
                oh.make_node("Exp", ["x"], ["e"], name="exp"),
                _add(b="e"),
                oh.make_node("Shape", ["z"], ["s"], name="shape"),
            ],
            inputs=("x",),
            outputs=("z", "f", "w"),
            initializers=[numpy_helper.from_array(np.array(8, np.int64), "n")],
        )
        unknown = {"foo", "hann"}
    elif model == "newer_op":  # RMSNormalization (opset 23) in an opset-17 model
        planner = _planner(
            [oh.make_node("RMSNormalization", ["x", "g"], ["r"], name="rms")],
            inputs=("x",), outputs=("r",), initializers=[_const("g", 1.0, (3,))],
        )
        unknown = {"rms"}
    elif model == "control_flow":  # an If whose branches hold an Exp like the main graph's
        branch = oh.make_graph([oh.make_node("Exp", ["x"], ["t"], name="inner_exp")], "then", [], [_info("t")])
        planner = _planner(
            [
                oh.make_node("If", ["c"], ["i"], name="if", then_branch=branch, else_branch=branch),
                oh.make_node("Exp", ["x"], ["e"], name="exp"),
                _add(a="i", b="e"),
            ],
            input_infos=[_info("x"), _info("c", TensorProto.BOOL, ())],
        )
        unknown = set()
    else:  # a call of a function whose body adds, beside an Add of the main graph
        body = oh.make_function(
            "example", "Twice", ["a"], ["b"], [oh.make_node("Add", ["a", "a"], ["b"])],
            [oh.make_opsetid("", 17)],
        )
        planner = _planner(
            [oh.make_node("Twice", ["x"], ["f"], name="twice", domain="example"), _add(a="f", b="x")],
            inputs=("x",), functions=[body],
        )
        unknown = set()
    planner.start()
    for node in planner.order:
        facts = planner.node_facts(node)
        chosen = rules.rules_for(node, facts, planner)
        assert (rules.control_flow in chosen) == (model == "control_flow")
        assert (rules.function_call in chosen) == (model == "function")
        if node.name not in ("if", "twice"):  # those two are decided before the unknown-op rule
            assert (rules.unknown_op in chosen) == (node.name in unknown)
        assert rules.decide(node, facts, planner, chosen) == rules.decide(node, facts, planner)
        planner.decide(node)
    assert all(planner.decisions[_node(planner, name)].category is Category.UNKNOWN_OP for name in unknown)
    if model == "control_flow":
        assert planner.decisions[_node(planner, "if")].category is Category.CONTROL_FLOW
    if model == "function":
        assert planner.decisions[_node(planner, "twice")].category is Category.FUNCTION
