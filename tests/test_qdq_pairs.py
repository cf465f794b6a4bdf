"""The Q/DQ pair rule (`mixprec.plan.qdq_pairs`) and what the report derives from a plan: the
cost estimate (`mixprec.plan.estimate.estimate_plan`) and the quantization summary
(`mixprec.report.quantized.quantized_summary`).

`keep_pairs` is driven with the planner itself on a prepared model (the pipeline's own inputs),
with one Q/DQ node forced FP32: planned once, the edge beside it would need a Cast; planned
through `keep_pairs`, no Cast separates any Q/DQ node from its op once the plan is applied.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import FLOAT, QDQ_K, QDQ_M, QDQ_N, check_full, convert, qdq_conv_group, qdq_matmul
from onnx import helper as oh
from onnx import numpy_helper as nh

import mixprec
from mixprec.config import Config
from mixprec.dtypes import LowPrecision
from mixprec.passes.rewrite import apply_plan
from mixprec.pipeline import Prepared, prepare
from mixprec.plan.estimate import PlanEstimate, estimate_plan
from mixprec.plan.model import Category, Precision, PrecisionPlan
from mixprec.plan.planner import plan_precision
from mixprec.plan.qdq_pairs import broken_pairs, keep_pairs, small_scales
from mixprec.policy.costs import runtime_cost
from mixprec.report.quantized import quantized_summary

K, N, M = QDQ_K, QDQ_N, QDQ_M
FP16_TINY = float(np.finfo(np.float16).tiny)  # 6.1e-5, float16's smallest normal


def matmul_chain() -> tuple[onnx.ModelProto, list[tuple[int, int, int]]]:
    """x[32,64] -> MatMul mm0 -> mm1 -> mm2 -> y, and each MatMul's (m, k, n)."""
    rng = np.random.default_rng(0)
    dims = [(64, 128), (128, 32), (32, 64)]
    nodes, inits, previous = [], [], "x"
    for i, (k, n) in enumerate(dims):
        out = "y" if i == len(dims) - 1 else f"h{i}"
        nodes.append(oh.make_node("MatMul", [previous, f"w{i}"], [out], name=f"mm{i}"))
        inits.append(nh.from_array(rng.normal(0, 0.1, (k, n)).astype(np.float32), f"w{i}"))
        previous = out
    graph = oh.make_graph(
        nodes, "chain", [oh.make_tensor_value_info("x", FLOAT, [32, 64])],
        [oh.make_tensor_value_info("y", FLOAT, [32, 64])], inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model, [(32, k, n) for k, n in dims]


def _nodes(model: onnx.ModelProto) -> dict[str, ir.Node]:
    return {node.name: node for node in ir.from_proto(model).graph}


def _precisions(plan: PrecisionPlan) -> dict[str, Precision]:
    return {node.name: d.precision for node, d in plan.decisions.items()}


# -- small_scales --------------------------------------------------------------------------------


def test_small_scales_finds_a_scale_below_the_float16_normal_range() -> None:
    nodes = _nodes(qdq_matmul(w_scale=2e-6))
    found = small_scales(list(nodes.values()), LowPrecision.FLOAT16)
    assert set(found) == {nodes["dq_w"]}
    category, reason = found[nodes["dq_w"]]
    assert category is Category.CONSTANT_RANGE
    assert "w_scale" in reason and "2e-06" in reason
    # bfloat16 has FP32's exponent range: nothing is too small for it.
    assert small_scales(list(nodes.values()), LowPrecision.BFLOAT16) == {}


def test_small_scales_finds_nothing_in_a_normal_model() -> None:
    nodes = list(_nodes(qdq_matmul()).values())
    assert small_scales(nodes, LowPrecision.FLOAT16) == {}


def test_small_scales_checks_quantize_nodes_and_each_channel() -> None:
    # One tiny channel among normal ones; the activation scale (read by q_x and dq_x) is tiny.
    scales = np.full(N, 0.01, np.float32)
    scales[3] = 1e-7
    nodes = _nodes(qdq_matmul(w_scale=scales, x_scale=1e-5))
    found = small_scales(list(nodes.values()), LowPrecision.FLOAT16)
    assert set(found) == {nodes["q_x"], nodes["dq_x"], nodes["dq_w"]}
    assert "1e-07" in found[nodes["dq_w"]][1]


@pytest.mark.parametrize(
    ("scale", "small"),
    [
        (FP16_TINY, False),  # the smallest normal itself is fine
        (np.nextafter(np.float32(FP16_TINY), np.float32(0)), True),
        (0.0, False),  # zeros lose nothing
        (-1e-6, True),  # by magnitude
    ],
)
def test_small_scales_boundary(scale: float, small: bool) -> None:
    nodes = _nodes(qdq_matmul(w_scale=scale))
    found = small_scales([nodes["dq_w"]], LowPrecision.FLOAT16)
    assert (nodes["dq_w"] in found) is small


def test_a_scale_computed_at_run_time_is_not_checked() -> None:
    model = qdq_matmul(w_scale=2e-6)
    # The weight scale becomes a graph input: no constant to read.
    init = next(i for i in model.graph.initializer if i.name == "w_scale")
    model.graph.initializer.remove(init)
    model.graph.input.append(oh.make_tensor_value_info("w_scale", FLOAT, [N]))
    nodes = _nodes(model)
    assert small_scales(list(nodes.values()), LowPrecision.FLOAT16) == {}


# -- keep_pairs ----------------------------------------------------------------------------------


def _prepared(model: onnx.ModelProto, target: str = "float16") -> Prepared:
    # The `onnx` profile (the schema alone): 16-bit Q/DQ and MatMul exist for every target.
    return prepare(copy.deepcopy(model), Config().with_options(runtime="onnx", target_dtype=target))


class Planner:
    """The planner on a prepared model, counting its calls."""

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        self.calls = 0

    def __call__(self, extra: Mapping[ir.Node, tuple[Category, str]]) -> PrecisionPlan:
        self.calls += 1
        p = self.prepared
        return plan_precision(p.model, p.loaded.policy, forced_fp32=extra, runtime=p.profile, keys=p.keys)


def _assert_no_cast_beside_qdq(prepared: Prepared, plan: PrecisionPlan) -> onnx.ModelProto:
    """Apply `plan`; no Cast reads a DequantizeLinear's output or feeds a QuantizeLinear."""
    apply_plan(prepared.model, plan)
    out = ir.to_proto(prepared.model)
    check_full(out)
    cast_in = {n.input[0] for n in out.graph.node if n.op_type == "Cast"}
    cast_out = {n.output[0] for n in out.graph.node if n.op_type == "Cast"}
    for node in out.graph.node:
        if node.op_type == "DequantizeLinear":
            assert node.output[0] not in cast_in, node.name
        if node.op_type == "QuantizeLinear":
            assert node.input[0] not in cast_out, node.name
    return out


@pytest.mark.parametrize(
    ("forced_name", "bound", "partners"),
    [
        # The quantized MatMul is bound to the forced node, its other Q/DQ nodes follow it.
        ("dq_w", "matmul_q", {"dq_x", "q_h"}),
        ("q_h", "matmul_q", {"dq_x", "dq_w"}),
        ("dq_h", "matmul_float", set()),
    ],
)
def test_keep_pairs_leaves_no_qdq_edge_that_needs_a_cast(forced_name: str, bound: str, partners: set[str]) -> None:
    prepared = _prepared(qdq_matmul())
    planner = Planner(prepared)
    node = next(n for n in prepared.model.graph if n.name == forced_name)
    forced = {node: (Category.CONSTANT_RANGE, "forced by the test")}
    # Planned once, an edge beside the forced node would need a Cast.
    assert broken_pairs(planner(forced)), "the test's premise: one plan alone breaks a pair"
    planner.calls = 0
    plan = keep_pairs(planner, list(prepared.keys), LowPrecision.FLOAT16, forced, prepared.profile.name)
    assert 1 < planner.calls <= 1 + len(prepared.keys)  # each round keeps one more node FP32
    assert broken_pairs(plan) == {}
    assert len(forced) == 1  # the caller's mapping is not changed
    precisions = _precisions(plan)
    assert precisions[forced_name] is Precision.FP32
    decision = plan.decisions[next(n for n in plan.decisions if n.name == bound)]
    assert decision.precision is Precision.FP32 and decision.category is Category.QDQ
    assert repr(forced_name) in decision.reason
    for name in partners:
        assert precisions[name] is Precision.FP32, name
    assert precisions["matmul_other"] is Precision.LOW  # outside any pair
    _assert_no_cast_beside_qdq(prepared, plan)


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_keep_pairs_keeps_a_small_scale_and_its_pair_fp32_for_float16_only(target: str) -> None:
    prepared = _prepared(qdq_matmul(w_scale=2e-6), target)
    low = LowPrecision(target)
    plan = keep_pairs(Planner(prepared), list(prepared.keys), low, None, prepared.profile.name)
    precisions = _precisions(plan)
    if low is LowPrecision.FLOAT16:
        assert precisions["dq_w"] is Precision.FP32 and precisions["matmul_q"] is Precision.FP32
        assert plan.decisions[next(n for n in plan.decisions if n.name == "dq_w")].category is Category.CONSTANT_RANGE
    else:
        assert precisions["dq_w"] is Precision.LOW and precisions["matmul_q"] is Precision.LOW
    assert broken_pairs(plan) == {}
    _assert_no_cast_beside_qdq(prepared, plan)


def test_keep_pairs_plans_a_model_without_qdq_once() -> None:
    model, _ = matmul_chain()
    prepared = _prepared(model)
    planner = Planner(prepared)
    mm1 = next(n for n in prepared.model.graph if n.name == "mm1")
    plan = keep_pairs(planner, list(prepared.keys), LowPrecision.FLOAT16, {mm1: (Category.CONSTANT_RANGE, "test")})
    assert planner.calls == 1
    assert _precisions(plan) == {"mm0": Precision.LOW, "mm1": Precision.FP32, "mm2": Precision.LOW}


# -- estimate_plan -------------------------------------------------------------------------------


Estimated = tuple[PlanEstimate, mixprec.ConversionResult, list[tuple[int, int, int]]]


def _estimate(exclude: list[str]) -> Estimated:
    """The estimate of the MatMul chain converted to float16 (`exclude` kept FP32), with the
    runtime Casts of the same plan, the conversion and each MatMul's (m, k, n)."""
    model, dims = matmul_chain()
    result = mixprec.convert(copy.deepcopy(model), validate="none", runtime="onnx", exclude_nodes=exclude)
    prepared = prepare(copy.deepcopy(model), Config().with_options(runtime="onnx", exclude_nodes=exclude))
    _, rewritten = prepared.replan()
    elements = [c.guessed_elements for c in rewritten.stats.casts if c.runtime and not c.of_constant]
    return estimate_plan(result.plan, elements, runtime_cost("onnx", "float16")), result, dims


def test_estimate_of_an_all_matmul_model_in_float16() -> None:
    estimate, result, _ = _estimate([])
    assert set(_precisions(result.plan).values()) == {Precision.LOW}
    assert estimate.low_flops_share == 1.0
    assert estimate.speedup is not None and estimate.speedup > 1
    assert estimate.time < estimate.fp32_time
    # The report's figures are this estimate.
    assert result.report.low_compute_share == estimate.low_flops_share
    assert result.report.estimated_speedup == pytest.approx(estimate.speedup, abs=1e-3)


def test_estimate_with_a_matmul_excluded() -> None:
    full, _, dims = _estimate([])
    estimate, result, _ = _estimate(["mm1"])
    assert _precisions(result.plan)["mm1"] is Precision.FP32
    assert estimate.low_flops_share is not None and 0 < estimate.low_flops_share < 1
    # The share is by FLOPs, each proportional to m*k*n.
    flops = [m * k * n for m, k, n in dims]
    assert estimate.low_flops_share == pytest.approx((flops[0] + flops[2]) / sum(flops))
    assert estimate.fp32_time == full.fp32_time
    assert estimate.speedup is not None and full.speedup is not None and estimate.speedup < full.speedup


def test_estimate_with_everything_fp32_is_no_faster() -> None:
    estimate, _, _ = _estimate(["mm0", "mm1", "mm2"])
    assert estimate.low_flops_share == 0.0
    assert estimate.speedup == pytest.approx(1.0)


def test_runtime_casts_cost_time_and_unknown_sizes_their_launch() -> None:
    model, _ = matmul_chain()
    plan = mixprec.convert(copy.deepcopy(model), validate="none", runtime="onnx").plan
    cost = runtime_cost("onnx", "float16")
    bare = estimate_plan(plan, [], cost)
    small, large = estimate_plan(plan, [16], cost), estimate_plan(plan, [1 << 20], cost)
    unknown, empty = estimate_plan(plan, [None], cost), estimate_plan(plan, [0], cost)
    assert bare.time < small.time < large.time
    assert unknown.time == empty.time > bare.time  # a launch, no traffic
    assert {e.fp32_time for e in (bare, small, large, unknown)} == {bare.fp32_time}
    assert bare.low_flops_share == large.low_flops_share == 1.0


# -- quantized_summary ---------------------------------------------------------------------------


def test_quantized_summary_is_none_without_qdq() -> None:
    model, _ = matmul_chain()
    result, _ = convert(model)
    assert quantized_summary(result.plan) is None
    assert result.report.quantization is None


def test_quantized_summary_counts_the_qdq_nodes() -> None:
    result, out = convert(qdq_matmul())
    summary = quantized_summary(result.plan)
    assert summary is not None
    in_model = Counter(n.op_type for n in out.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear"))
    assert summary.qdq_nodes == dict(in_model)
    assert sum(summary.qdq_nodes.values()) + len(summary.folded) >= 5  # no Q/DQ node is lost
    assert summary.quantized_ops == {"MatMul": 1}  # matmul_q, between DQ and Q
    precisions = _precisions(result.plan)
    assert summary.quantized_low == (precisions["matmul_q"] is Precision.LOW)
    # matmul_float and matmul_other are float ops outside quantized groups.
    outside = [precisions["matmul_float"], precisions["matmul_other"]]
    assert summary.float_low == outside.count(Precision.LOW)
    assert summary.float_fp32 == outside.count(Precision.FP32)
    assert summary.float_low + summary.float_fp32 == 2
    assert summary.float_low_share == summary.float_low / 2


def test_quantized_summary_counts_the_fp32_ops_outside_the_pairs() -> None:
    result, _ = convert(qdq_matmul(), exclude_nodes=["matmul_other"])
    summary = quantized_summary(result.plan)
    assert summary is not None
    precisions = _precisions(result.plan)
    assert precisions["matmul_other"] is Precision.FP32
    outside = [precisions["matmul_float"], precisions["matmul_other"]]
    assert summary.fp32_ops == {"MatMul": outside.count(Precision.FP32)}
    assert summary.float_fp32 == outside.count(Precision.FP32)
    assert summary.float_low_share == pytest.approx(outside.count(Precision.LOW) / 2)
    assert summary.float_low_share < 1


def _qdq_conv_of(activation: int) -> onnx.ModelProto:
    """x -> Q -> DQ -> Conv(DQ(int8 W)) -> Q -> DQ y, activations quantized to `activation`
    (an integer TensorProto type) with zero point 0 and scales normal in float16."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.2, (8, 4, 3, 3)).astype(np.float32)
    w_scale = np.float32(np.abs(w).max() / 127)
    zero = np.zeros((), onnx.helper.tensor_dtype_to_np_dtype(activation))
    initializers = [
        nh.from_array(np.array(0.002, np.float32), "xs"), nh.from_array(zero, "xz"),
        nh.from_array(np.round(w / w_scale).astype(np.int8), "wq"), nh.from_array(np.array(w_scale), "ws"),
        nh.from_array(np.array(0, np.int8), "wz"),
        nh.from_array(np.array(0.004, np.float32), "ys"), nh.from_array(zero.copy(), "yz"),
    ]
    return qdq_conv_group(initializers, [1, 4, 8, 8], [1, 8, 8, 8], pads=[1, 1, 1, 1])


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_activations_quantized_to_16_bit_integers_keep_their_group_fp32(target: str) -> None:
    # 65,536 steps of 0.002: float16 holds every integer up to 2,048 (bfloat16 256), so a 16-bit
    # DequantizeLinear output, or the Conv output a 16-bit QuantizeLinear reads, would round
    # away up to 31 steps (bfloat16: 255); int8 activations convert.
    x = {"x": np.random.default_rng(1).normal(0, 20, (1, 4, 8, 8)).astype(np.float32)}
    fine = mixprec.convert(_qdq_conv_of(onnx.TensorProto.UINT16), None, target_dtype=target, runtime="onnx", data=[x])
    kept = {d.name: d for d in fine.report.kept_fp32}
    assert {"q_x", "dq_x", "conv", "q_c", "dq_c"} <= set(kept) and not fine.report.low_by_op
    assert kept["dq_x"].category == Category.QDQ.value and "65,536 integer steps" in kept["dq_x"].reason
    assert all(o.max_abs_error == 0.0 for o in fine.report.validation.outputs)
    coarse = mixprec.convert(_qdq_conv_of(onnx.TensorProto.INT8), None, target_dtype=target, runtime="onnx", data=[x])
    assert coarse.report.low_by_op.get("Conv") == 1
