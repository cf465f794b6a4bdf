"""The rewrite (`mixprec.passes.rewrite.apply_plan`) on a real plan: one shared Cast per
(tensor, type), integer tensors untouched, weights stored in the 16-bit type, and a result that
runs in onnxruntime close to FP32.

The plan comes from the pipeline's own preparation (`mixprec.pipeline.prepare` then
`Prepared.rewrite`), so the rewrite meets what it meets in a conversion; the structure is read
back from the serialised proto with strict ONNX type inference (tests/helpers.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from helpers import (
    FLOAT,
    INT64,
    LOW_TYPES,
    assert_matches_fp32,
    casts,
    check_full,
    consumers,
    initializer_types,
    producer,
    value_types,
)
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from mixprec.analysis.constants import copy_ranges
from mixprec.config import Config
from mixprec.graphs import node_keys
from mixprec.io import value_types as ir_value_types
from mixprec.pipeline import prepare
from mixprec.pipeline.planning import make_plan
from mixprec.pipeline.steps import rewrite
from mixprec.plan.model import Precision, PrecisionPlan

TARGETS = ["float16", "bfloat16"]


def _fan_out_model() -> onnx.ModelProto:
    """x (FP32) feeds three MatMuls and an FP32 Gather; an integer input goes through an
    integer Add; a MatMul `pre` produces `h`, which feeds two more MatMuls."""
    rng = np.random.default_rng(0)
    weights = [nh.from_array(rng.normal(0, 0.5, (8, 8)).astype(np.float32), f"w{k}") for k in range(1, 6)]
    nodes = [
        oh.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
        oh.make_node("MatMul", ["x", "w2"], ["b"], name="mm2"),
        oh.make_node("MatMul", ["x", "w3"], ["h"], name="pre"),
        oh.make_node("MatMul", ["h", "w4"], ["c"], name="mm4"),
        oh.make_node("MatMul", ["h", "w5"], ["d"], name="mm5"),
        oh.make_node("Sum", ["a", "b", "c", "d"], ["y"], name="sum"),
        oh.make_node("Gather", ["x", "idx"], ["g"], name="gather", axis=1),
        oh.make_node("Add", ["idx", "one"], ["i"], name="iadd"),
        oh.make_node("Shape", ["x"], ["s"], name="shape"),
    ]
    graph = oh.make_graph(
        nodes, "fan_out",
        [oh.make_tensor_value_info("x", FLOAT, [2, 8]), oh.make_tensor_value_info("idx", INT64, [3])],
        [
            oh.make_tensor_value_info("y", FLOAT, [2, 8]),
            oh.make_tensor_value_info("g", FLOAT, [2, 3]),
            oh.make_tensor_value_info("i", INT64, [3]),
            oh.make_tensor_value_info("s", INT64, [2]),
        ],
        [*weights, nh.from_array(np.array(1, np.int64), "one")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _rewrite(model: onnx.ModelProto, **options: object) -> tuple[onnx.ModelProto, PrecisionPlan]:
    prepared = prepare(model, Config().with_options(runtime="onnx", **options))
    rewritten, plan = prepared.rewrite()
    out = ir.to_proto(rewritten)
    check_full(out)
    return out, plan


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.uniform(-1, 1, (2, 8)).astype(np.float32), "idx": np.array([0, 7, 3], np.int64)}


def _precisions(plan: PrecisionPlan) -> dict[str, Precision]:
    return {node.name: decision.precision for node, decision in plan.decisions.items()}


@pytest.mark.parametrize("target", TARGETS)
def test_one_shared_cast_per_tensor_and_type(target: str) -> None:
    out, plan = _rewrite(_fan_out_model(), target_dtype=target)
    low = LOW_TYPES[target]
    precisions = _precisions(plan)
    assert {precisions[n] for n in ("mm1", "mm2", "pre", "mm4", "mm5", "sum")} == {Precision.LOW}
    assert precisions["gather"] is Precision.FP32
    pairs = casts(out)
    assert len(pairs) == len(set(pairs)), f"two Casts of one tensor to one type: {pairs}"
    # x feeds three 16-bit MatMuls through one Cast; the FP32 Gather still reads x itself.
    (x_low,) = [n for n in out.graph.node if n.op_type == "Cast" and n.input[0] == "x"]
    assert x_low.attribute[0].i == low
    assert sorted(n.name for n in consumers(out, x_low.output[0])) == ["mm1", "mm2", "pre"]
    assert sorted(n.name for n in consumers(out, "x")) == sorted([x_low.name, "gather", "shape"])
    # h stays 16-bit between 16-bit nodes: no Cast at all.
    assert not [n for n in consumers(out, "h") if n.op_type == "Cast"]
    # The only other Cast brings y back to FP32 (keep_io_types).
    assert Counter(to for _, to in pairs) == Counter({low: 1, FLOAT: 1})
    assert producer(out, "y").op_type == "Cast"


def test_an_fp32_value_read_by_several_16bit_nodes_is_cast_once() -> None:
    out, plan = _rewrite(_fan_out_model(), exclude_nodes=["pre"])
    assert _precisions(plan)["pre"] is Precision.FP32
    types = value_types(out)
    assert types["h"] == FLOAT
    h_casts = [n for n in consumers(out, "h") if n.op_type == "Cast"]
    assert len(h_casts) == 1
    assert sorted(n.name for n in consumers(out, h_casts[0].output[0])) == ["mm4", "mm5"]
    assert len(casts(out)) == len(set(casts(out)))


@pytest.mark.parametrize("target", TARGETS)
def test_integer_tensors_are_untouched(target: str) -> None:
    source = _fan_out_model()
    out, _ = _rewrite(source, target_dtype=target)
    types = value_types(out)
    for name in ("idx", "one", "i", "s"):
        assert types[name] == INT64, name
    assert initializer_types(out)["one"] == INT64
    assert all(types[name] != INT64 for name, _ in casts(out))  # no Cast reads an integer
    iadd = next(n for n in out.graph.node if n.name == "iadd")
    assert list(iadd.input) == ["idx", "one"]
    np.testing.assert_array_equal(
        nh.to_array(next(i for i in out.graph.initializer if i.name == "one")), np.array(1, np.int64)
    )


@pytest.mark.parametrize("target", TARGETS)
def test_weights_are_stored_in_the_16bit_type(target: str) -> None:
    source = _fan_out_model()
    out, _ = _rewrite(source, target_dtype=target)
    stored = initializer_types(out)
    for k in range(1, 6):
        assert stored[f"w{k}"] == LOW_TYPES[target], f"w{k}"
    # Stored values are the FP32 weights rounded to the 16-bit type.
    original = {i.name: nh.to_array(i) for i in source.graph.initializer}
    for init in out.graph.initializer:
        if init.name.startswith("w"):
            got = nh.to_array(init).astype(np.float32)
            np.testing.assert_allclose(got, original[init.name], rtol=2 ** -7, atol=0)
    # No weight is cast at run time: each is stored in the type its readers compute in.
    assert all(not name.startswith("w") for name, _ in casts(out))


def test_a_weight_shared_by_an_fp32_and_a_16bit_node_gets_a_16bit_copy() -> None:
    # w1 is read by mm1 (16-bit) and, through the excluded MatMul, FP32.
    source = _fan_out_model()
    graph = source.graph
    graph.node.append(oh.make_node("MatMul", ["x", "w1"], ["e"], name="fp32_mm"))
    graph.output.append(oh.make_tensor_value_info("e", FLOAT, [2, 8]))
    out, plan = _rewrite(source, exclude_nodes=["fp32_mm"])
    assert _precisions(plan)["fp32_mm"] is Precision.FP32
    types = value_types(out)
    fp32_mm = next(n for n in out.graph.node if n.name == "fp32_mm")
    mm1 = next(n for n in out.graph.node if n.name == "mm1")
    assert types[fp32_mm.input[1]] == FLOAT and types[mm1.input[1]] == TensorProto.FLOAT16
    assert fp32_mm.input[1] != mm1.input[1]


@pytest.mark.parametrize("target", TARGETS)
def test_rewritten_model_runs_close_to_fp32(target: str) -> None:
    source = _fan_out_model()
    out, _ = _rewrite(source, target_dtype=target)
    tolerance = 2e-2 if target == "float16" else 8e-2
    actual = assert_matches_fp32(source, out, _feeds(), target=target, rtol=tolerance, atol=tolerance)
    # The integer outputs are exact.
    np.testing.assert_array_equal(actual[2], np.array([1, 8, 4], np.int64))
    np.testing.assert_array_equal(actual[3], np.array([2, 8], np.int64))


def test_rewrite_leaves_the_prepared_model_fp32() -> None:
    """`Prepared.rewrite` works on a clean copy: a second rewrite sees the FP32 model again."""
    prepared = prepare(_fan_out_model(), Config().with_options(runtime="onnx"))
    first, _ = prepared.rewrite()
    second, _ = prepared.rewrite()
    assert [v.dtype for v in prepared.model.graph.initializers.values()][:5] == [ir.DataType.FLOAT] * 5
    assert casts(ir.to_proto(first)) == casts(ir.to_proto(second))


_WITH_FUNCTION_AND_BRANCH = """
<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
agraph (float[2,3] x, bool c) => (float[2,4] y, float[2,4] z) {
  w = Constant<value = float[3,4] {0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2}>()
  h = local.Linear(x, w)
  y = Softmax(h)
  z = If(c) <then_branch = g1 () => (float[2,4] t) { t = MatMul(x, w) },
             else_branch = g2 () => (float[2,4] e) { e = local.Linear(x, w) }>
}
<domain: "local", opset_import: ["" : 18]>
Linear (a, b) => (o) {
  m = MatMul(a, b)
  o = Relu(m)
}
"""


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["fan_out", "function_and_branch"])
def test_a_plan_without_the_planners_fp32_values_rewrites_the_same(target: str, kind: str) -> None:
    """The rewrite takes the FP32 values the planner read with its plan; a plan that does not
    carry them (made elsewhere) has them read again, and the model comes out the same (also
    with a function body and a subgraph reading outer values)."""
    source = _fan_out_model() if kind == "fan_out" else onnx.parser.parse_model(_WITH_FUNCTION_AND_BRANCH)
    prepared = prepare(source, Config().with_options(runtime="onnx", target_dtype=target))
    texts = []
    for carried in (True, False):
        model = ir_value_types.carry(prepared.model, prepared.model.clone())
        copy_ranges(prepared.model, model)
        plan = make_plan(model, node_keys(model), prepared.config, prepared.plan_inputs()).plan
        assert plan.fp32 is not None and "x" in {v.name for v in plan.fp32}
        assert ("idx" if kind == "fan_out" else "c") not in {v.name for v in plan.fp32}  # an integer / bool input
        if not carried:
            plan = dataclasses.replace(plan, fp32=None)
        out = ir.to_proto(rewrite(model, plan, prepared.config).model)
        check_full(out)
        texts.append(onnx.printer.to_text(out))
    assert texts[0] == texts[1]
    assert "Cast" in texts[0]
