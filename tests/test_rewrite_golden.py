"""Golden tests for the rewrite rules: a small FP32 model in, the exact converted structure out.

Each test builds its input in ONNX text syntax, converts it, checks the resulting structure
(per-node op and element types from strict ONNX shape inference, Casts and their `to`,
initializer types) and runs both models in onnxruntime to compare the numbers.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from helpers import (
    BFLOAT16,
    FLOAT,
    FLOAT16,
    INT64,
    NodeSig,
    all_node_sigs,
    assert_close,
    assert_matches_fp32,
    cast_targets,
    casts,
    check_full,
    consumers,
    convert,
    initializer_types,
    io_types,
    iter_nodes,
    node_named,
    node_sigs,
    parse,
    producer,
    random_feeds,
    run,
    run_low,
    sigs_of,
    value_types,
)

import mixprec

F, H, B, I = "float", "float16", "bfloat16", "int64"

W33 = "{0.5, -0.25, 1, 0.125, 2, -1, 1.5, 0.75, -0.5}"
W33B = "{1, 2, 3, 4, 5, 6, 7, 8, 9}"
W33C = "{-1, 0.5, 0.25, 2, -0.75, 1, 0.5, 0.5, -2}"


def header(opset: int = 17, ir_version: int = 8) -> str:
    return f'<ir_version: {ir_version}, opset_import: ["" : {opset}]>'


def fp32_kept(result: mixprec.ConversionResult, op_type: str) -> list:
    return [k for k in result.report.kept_fp32 if k.op_type == op_type]


# -- rule 1/4/5: a MatMul chain -----------------------------------------------------------------

MATMUL_CHAIN = f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}, float[3,3] w2 = {W33B}>
{{
  h = MatMul(x, w1)
  y = MatMul(h, w2)
}}
"""


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_matmul_chain_keep_io_types(target: str) -> None:
    model = parse(MATMUL_CHAIN)
    result, out = convert(model, target_dtype=target)
    low = {"float16": H, "bfloat16": B}[target]
    low_t = {"float16": FLOAT16, "bfloat16": BFLOAT16}[target]
    check_full(out)
    assert node_sigs(out) == [
        NodeSig("Cast", (F,), (low,)),
        NodeSig("MatMul", (low, low), (low,)),
        NodeSig("MatMul", (low, low), (low,)),
        NodeSig("Cast", (low,), (F,)),
    ]
    # Weights are stored in the 16-bit type, once each.
    assert initializer_types(out) == {"w1": low_t, "w2": low_t}
    assert casts(out) == [("x", low_t), (out.graph.node[2].output[0], FLOAT)]
    # The model-facing names and types are unchanged.
    assert io_types(out) == ([("x", FLOAT)], [("y", FLOAT)])
    assert out.graph.node[-1].output[0] == "y"
    assert result.report.casts_runtime == 2
    assert result.report.constants_lowered == 2
    feeds = random_feeds(model)
    assert_matches_fp32(model, out, feeds, target=target, rtol=1e-2 if target == "float16" else 5e-2,
                        atol=1e-2 if target == "float16" else 5e-2)


def test_matmul_chain_without_keep_io_types() -> None:
    model = parse(MATMUL_CHAIN)
    _, out = convert(model, keep_io_types=False)
    check_full(out)
    assert io_types(out) == ([("x", FLOAT16)], [("y", FLOAT16)])
    assert casts(out) == []
    assert node_sigs(out) == [NodeSig("MatMul", (H, H), (H,))] * 2
    assert_matches_fp32(model, out, random_feeds(model))


def test_matmul_chain_numbers_really_compared() -> None:
    """The comparison helper fails on a wrong model (guards against vacuous tests)."""
    model = parse(MATMUL_CHAIN)
    _, out = convert(model)
    # Scale one weight: the converted model must no longer match.
    for init in out.graph.initializer:
        if init.name == "w2":
            values = onnx.numpy_helper.to_array(init) * np.float16(2)
            init.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float16), "w2"))
    with pytest.raises(AssertionError):
        assert_matches_fp32(model, out, random_feeds(model))


# -- rule 4: one Cast per (value, type) ---------------------------------------------------------


def test_one_cast_per_value_and_type() -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}, float[3,3] w2 = {W33B}, float[3,3] w3 = {W33C}>
{{
  a = MatMul(x, w1)
  b = MatMul(x, w2)
  c = MatMul(x, w3)
  ab = Add(a, b)
  y = Add(ab, c)
}}
""")
    _, out = convert(model)
    check_full(out)
    x_casts = [c for c in casts(out) if c[0] == "x"]
    assert x_casts == [("x", FLOAT16)]
    cast_out = next(n.output[0] for n in iter_nodes(out) if n.op_type == "Cast" and n.input[0] == "x")
    assert len([n for n in consumers(out, cast_out) if n.op_type == "MatMul"]) == 3
    assert cast_targets(out) == [FLOAT16, FLOAT]
    assert [s for s in node_sigs(out) if s.op_type == "Add"] == [NodeSig("Add", (H, H), (H,))] * 2
    assert_matches_fp32(model, out, random_feeds(model))


# -- FP32-class nodes between 16-bit nodes ------------------------------------------------------


def test_softmax_between_matmuls_computes_in_fp32() -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}, float[3,3] w2 = {W33B}>
{{
  h = MatMul(x, w1)
  s = Softmax<axis = -1>(h)
  y = MatMul(s, w2)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert node_sigs(out) == [
        NodeSig("Cast", (F,), (H,)),
        NodeSig("MatMul", (H, H), (H,)),
        NodeSig("Cast", (H,), (F,)),
        NodeSig("Softmax", (F,), (F,)),
        NodeSig("Cast", (F,), (H,)),
        NodeSig("MatMul", (H, H), (H,)),
        NodeSig("Cast", (H,), (F,)),
    ]
    softmax = next(n for n in out.graph.node if n.op_type == "Softmax")
    assert producer(out, softmax.input[0]).op_type == "Cast"
    assert [n.op_type for n in consumers(out, softmax.output[0])] == ["Cast"]
    assert [k.category for k in fp32_kept(result, "Softmax")] == ["policy"]
    assert_matches_fp32(model, out, random_feeds(model))


def test_follow_op_takes_the_widest_input() -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}>
{{
  a = MatMul(x, w1)
  s = Exp(x)
  y = Add(a, s)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert sigs_of(out, "Add") == [NodeSig("Add", (F, F), (F,))]
    assert sigs_of(out, "Exp") == [NodeSig("Exp", (F,), (F,))]  # float16: FP32 by policy
    assert sigs_of(out, "MatMul") == [NodeSig("MatMul", (H, H), (H,))]
    add = next(n for n in out.graph.node if n.op_type == "Add")
    cast_up = producer(out, add.input[0])
    assert cast_up.op_type == "Cast" and producer(out, cast_up.input[0]).op_type == "MatMul"
    assert add.input[1] == "s"
    assert sorted(cast_targets(out)) == sorted([FLOAT16, FLOAT])
    assert add.output[0] == "y"
    assert [k.category for k in fp32_kept(result, "Add")] == ["follows inputs"]
    assert_matches_fp32(model, out, random_feeds(model))


def test_bounded_fp32_input_does_not_hold_a_follow_op() -> None:
    """A Softmax output lies in [0, 1]: the Add of it and a 16-bit MatMul output, read by another
    MatMul, computes in 16 bits, with one Cast on the Softmax output (the FP32 island ends right
    there)."""
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}>
{{
  a = MatMul(x, w1)
  s = Softmax<axis = -1>(x)
  z = Add(a, s)
  y = MatMul(z, w1)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert sigs_of(out, "Softmax") == [NodeSig("Softmax", (F,), (F,))]
    assert sigs_of(out, "Add") == [NodeSig("Add", (H, H), (H,))]
    add = next(n for n in out.graph.node if n.op_type == "Add")
    cast_down = producer(out, add.input[1])
    assert cast_down.op_type == "Cast" and cast_down.input[0] == "s"
    assert not fp32_kept(result, "Add")
    assert_matches_fp32(model, out, random_feeds(model))


def test_unbounded_fp32_input_still_holds_a_follow_op() -> None:
    """The same graph with an unbounded FP32 producer (Exp, FP32 for float16): the Add follows it."""
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}>
{{
  a = MatMul(x, w1)
  e = Exp(x)
  s = Unsqueeze(e, axes)
  t = Squeeze(s, axes)
  y = Add(a, t)
}}
""".replace("<float[3,3] w1", "<int64[1] axes = {0}, float[3,3] w1"))
    result, out = convert(model)
    check_full(out)
    assert sigs_of(out, "Add") == [NodeSig("Add", (F, F), (F,))]


def test_measured_range_ends_an_fp32_island() -> None:
    """Exp stays FP32 in float16 (it may overflow). Measured on data that keeps it far below
    65504, its output does not hold the Add after it (read by a MatMul) in FP32: one Cast, and
    the Add computes in 16 bits; without data the Add follows the FP32 input as before."""
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}>
{{
  a = MatMul(x, w1)
  e = Exp(x)
  z = Add(a, e)
  y = MatMul(z, w1)
}}
""")
    _, blind = convert(model)
    assert sigs_of(blind, "Add") == [NodeSig("Add", (F, F), (F,))]
    data = [{"x": np.random.default_rng(0).uniform(-1, 1, (2, 3)).astype(np.float32)}]
    result, out = convert(model, data=data)
    check_full(out)
    assert sigs_of(out, "Exp") == [NodeSig("Exp", (F,), (F,))]
    assert sigs_of(out, "Add") == [NodeSig("Add", (H, H), (H,))]
    add = next(n for n in out.graph.node if n.op_type == "Add")
    assert producer(out, add.input[1]).op_type == "Cast" and producer(out, add.input[1]).input[0] == "e"
    (decision,) = [d for n, d in result.plan.decisions.items() if n.op_type == "Add"]
    assert "'e' is cast to 16 bits (measured within" in decision.reason
    assert_matches_fp32(model, out, data[0])


def test_integer_path_stays_fp32_and_its_bounded_result_is_cast_once() -> None:
    """Positions (Range, cast to float) feed Cos: integer semantics keeps them FP32 and exact.
    Cos's output lies in [-1, 1]: the 16-bit activations it multiplies (for another MatMul) are
    not pulled into FP32; the island ends with one Cast on the Cos output."""
    model = parse(f"""{header()}
agraph (float[N,4] x) => (float[N,4] y)
<float[4,4] w = {{{", ".join(["0.25", "-0.5", "1", "0.75"] * 4)}}}, int64 zero = {{0}}, int64 one = {{1}}, int64 idx = {{0}}, int64[1] axis1 = {{1}}>
{{
  s = Shape(x)
  n = Gather<axis = 0>(s, idx)
  r = Range(zero, n, one)
  f = Cast<to = 1>(r)
  c = Cos(f)
  u = Unsqueeze(c, axis1)
  a = MatMul(x, w)
  m = Mul(a, u)
  y = MatMul(m, w)
}}
""")
    result, out = convert(model)
    check_full(out)
    # The sequence length is symbolic: the positions may exceed 2048, where float16 stops
    # holding integers.
    assert [k.category for k in fp32_kept(result, "Cast")] == ["integer semantics"]
    assert sigs_of(out, "Cos") == [NodeSig("Cos", (F,), (F,))]
    assert sigs_of(out, "Mul") == [NodeSig("Mul", (H, H), (H,))]
    assert sigs_of(out, "Unsqueeze") == [NodeSig("Unsqueeze", (H, I), (H,))]
    unsqueeze = next(n for n in out.graph.node if n.op_type == "Unsqueeze")
    cast = producer(out, unsqueeze.input[0])
    assert cast.op_type == "Cast" and cast.input[0] == "c"
    assert result.report.casts_runtime == 3  # x in, y out, and the Cos output
    assert_matches_fp32(model, out, random_feeds(model))


# -- rule 2: ops whose output type is an attribute ----------------------------------------------


def test_cast_from_int_is_retargeted() -> None:
    model = parse(f"""{header()}
agraph (int64[2,3] idx) => (float[2,3] y)
<float[3,3] w = {W33}>
{{
  c = Cast<to = 1>(idx)
  y = MatMul(c, w)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert node_sigs(out) == [
        NodeSig("Cast", (I,), (H,)),
        NodeSig("MatMul", (H, H), (H,)),
        NodeSig("Cast", (H,), (F,)),
    ]
    assert casts(out) == [("idx", FLOAT16), (out.graph.node[1].output[0], FLOAT)]
    assert result.report.casts_runtime == 1  # only the output cast was added
    feeds = {"idx": np.array([[1, 2, 3], [-4, 0, 7]], np.int64)}
    assert_close(run(out, feeds), run(model, feeds), rtol=1e-2, atol=1e-2)


def test_identity_cast_after_16_bit_node_disappears() -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}, float[3,3] w2 = {W33B}>
{{
  h = MatMul(x, w1)
  h2 = Cast<to = 1>(h)
  y = MatMul(h2, w2)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert node_sigs(out) == [
        NodeSig("Cast", (F,), (H,)),
        NodeSig("MatMul", (H, H), (H,)),
        NodeSig("MatMul", (H, H), (H,)),
        NodeSig("Cast", (H,), (F,)),
    ]
    types = value_types(out)
    for node in iter_nodes(out):
        if node.op_type == "Cast":
            to = next(a.i for a in node.attribute if a.name == "to")
            assert types[node.input[0]] != to
    assert result.report.casts_removed >= 1
    assert_matches_fp32(model, out, random_feeds(model))


def test_constant_node_weight_is_stored_in_16_bits() -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
{{
  w = Constant<value = float[3,3] {W33}>()
  y = MatMul(x, w)
}}
""")
    _, out = convert(model)
    check_full(out)
    constant = next(n for n in out.graph.node if n.op_type == "Constant")
    value = next(a.t for a in constant.attribute if a.name == "value")
    assert value.data_type == FLOAT16
    np.testing.assert_array_equal(
        onnx.numpy_helper.to_array(value),
        np.array(eval(W33.replace("{", "[").replace("}", "]")), np.float32).reshape(3, 3).astype(np.float16),
    )
    assert sigs_of(out, "MatMul") == [NodeSig("MatMul", (H, H), (H,))]
    assert cast_targets(out) == [FLOAT16, FLOAT]  # input and output only, none for the weight
    assert_matches_fp32(model, out, random_feeds(model))


# -- integer and bool tensors -------------------------------------------------------------------


def test_integer_shape_arithmetic_untouched() -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w = {W33}>
{{
  h = MatMul(x, w)
  s = Shape(h)
  i0 = Constant<value = int64[1] {{0}}>()
  d0 = Gather<axis = 0>(s, i0)
  m1 = Constant<value = int64[1] {{-1}}>()
  shp = Concat<axis = 0>(d0, m1)
  r = Reshape(h, shp)
  y = Relu(r)
}}
""")
    _, out = convert(model)
    check_full(out)
    assert node_sigs(out) == [
        NodeSig("Cast", (F,), (H,)),
        NodeSig("MatMul", (H, H), (H,)),
        NodeSig("Shape", (H,), (I,)),
        NodeSig("Constant", (), (I,)),
        NodeSig("Gather", (I, I), (I,)),
        NodeSig("Constant", (), (I,)),
        NodeSig("Concat", (I, I), (I,)),
        NodeSig("Reshape", (H, I), (H,)),
        NodeSig("Relu", (H,), (H,)),
        NodeSig("Cast", (H,), (F,)),
    ]
    # Shape reads the MatMul's 16-bit output directly.
    shape = next(n for n in out.graph.node if n.op_type == "Shape")
    assert producer(out, shape.input[0]).op_type == "MatMul"
    types = value_types(out)
    assert all(types[name] in (FLOAT, FLOAT16) for name, _ in casts(out))
    assert_matches_fp32(model, out, random_feeds(model))


def test_where_with_bool_condition() -> None:
    model = parse(f"""{header()}
agraph (bool[2,3] c, float[2,3] x) => (float[2,3] y)
<float[3,3] w = {W33}>
{{
  h = MatMul(x, w)
  n = Neg(h)
  y = Where(c, h, n)
}}
""")
    _, out = convert(model)
    check_full(out)
    assert sigs_of(out, "Where") == [NodeSig("Where", ("bool", H, H), (H,))]
    assert cast_targets(out) == [FLOAT16, FLOAT]
    feeds = {**random_feeds(model), "c": np.array([[True, False, True], [False, False, True]])}
    assert_close(run(out, feeds), run(model, feeds))


# -- out-of-range constants ---------------------------------------------------------------------


def test_add_of_finfo_min_constant_stays_fp32() -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w = {W33}, float c = {{-3.4e38}}>
{{
  h = MatMul(x, w)
  y = Add(h, c)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert initializer_types(out)["c"] == FLOAT
    assert sigs_of(out, "Add") == [NodeSig("Add", (F, F), (F,))]
    assert sigs_of(out, "MatMul") == [NodeSig("MatMul", (H, H), (H,))]
    kept = fp32_kept(result, "Add")
    assert len(kept) == 1
    assert kept[0].category == "out-of-range constant"
    assert "range" in kept[0].reason and "c" in kept[0].reason
    assert "c" in result.report.constants_kept_for_range
    feeds = random_feeds(model)
    expected, actual = run(model, feeds), run(out, feeds)
    assert np.isfinite(actual[0]).all()
    assert_close(actual, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("keep_io_types", [True, False])
def test_add_of_finfo_min_constant_on_graph_input(keep_io_types: bool) -> None:
    """`Add(x, c)` straight on the graph input stays FP32; c is never narrowed."""
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float c = {{-3.4e38}}>
{{
  y = Add(x, c)
}}
""")
    result, out = convert(model, keep_io_types=keep_io_types)
    check_full(out)
    assert initializer_types(out) == {"c": FLOAT}
    if keep_io_types:
        assert node_sigs(out) == [NodeSig("Add", (F, F), (F,))]
    else:
        # The 16-bit model input is cast up for the Add, its result down for the 16-bit output.
        assert node_sigs(out) == [
            NodeSig("Cast", (H,), (F,)), NodeSig("Add", (F, F), (F,)), NodeSig("Cast", (F,), (H,))
        ]
        assert io_types(out) == ([("x", FLOAT16)], [("y", FLOAT16)])
    kept = fp32_kept(result, "Add")
    assert len(kept) == 1 and kept[0].category == "out-of-range constant"
    assert "range" in kept[0].reason
    if keep_io_types:
        feeds = random_feeds(model)
        assert_close(run(out, feeds), run(model, feeds), rtol=1e-7, atol=0)


TINY_SCALE = f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w = {W33}, float eps = {{1e-12}}>
{{
  h = MatMul(x, w)
  y = Mul(h, eps)
}}
"""


def test_tiny_scalar_keeps_mul_fp32_for_float16() -> None:
    model = parse(TINY_SCALE)
    result, out = convert(model, target_dtype="float16")
    check_full(out)
    assert initializer_types(out) == {"w": FLOAT16, "eps": FLOAT}
    assert sigs_of(out, "Mul") == [NodeSig("Mul", (F, F), (F,))]
    kept = fp32_kept(result, "Mul")
    assert len(kept) == 1 and kept[0].category == "out-of-range constant"
    assert "flush" in kept[0].reason
    feeds = random_feeds(model)
    expected, actual = run(model, feeds), run(out, feeds)
    assert np.abs(actual[0]).max() > 0  # not flushed to zero
    assert_close(actual, expected, rtol=1e-2, atol=1e-15)


def test_tiny_scalar_converts_for_bfloat16() -> None:
    model = parse(TINY_SCALE)
    result, out = convert(model, target_dtype="bfloat16")
    check_full(out)
    assert initializer_types(out) == {"w": BFLOAT16, "eps": BFLOAT16}
    assert sigs_of(out, "Mul") == [NodeSig("Mul", (B, B), (B,))]
    assert fp32_kept(result, "Mul") == []
    feeds = random_feeds(model)
    expected, actual = run(model, feeds), run_low(out, feeds, "bfloat16")
    assert_close(actual, expected, rtol=5e-2, atol=1e-14)


def test_weight_with_a_few_tiny_entries_still_converts() -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w = {{0.5, 1e-10, 1, 0.125, 2, -1e-10, 1.5, 0.75, 1e-10}}>
{{
  y = MatMul(x, w)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert initializer_types(out) == {"w": FLOAT16}
    assert sigs_of(out, "MatMul") == [NodeSig("MatMul", (H, H), (H,))]
    assert result.report.kept_fp32 == []
    assert_matches_fp32(model, out, random_feeds(model))


# -- BatchNormalization: separate type variables for the statistics -----------------------------


def _batchnorm(opset: int) -> str:
    return f"""{header(opset)}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w = {W33}, float[3] scale = {{1, 0.5, 2}}, float[3] bias = {{0, 1, -1}},
 float[3] mean = {{0.1, -0.2, 0.3}}, float[3] var = {{1e8, 4, 0.25}}>
{{
  h = MatMul(x, w)
  y = BatchNormalization(h, scale, bias, mean, var)
}}
"""


@pytest.mark.parametrize("opset", [14, 15])
def test_batchnorm_converts_but_keeps_large_variance_fp32(opset: int) -> None:
    """BatchNormalization-14 binds mean/var to their own type variable (U; T2 since 15)."""
    model = parse(_batchnorm(opset))
    result, out = convert(model)
    check_full(out)
    inits = initializer_types(out)
    assert inits["mean"] == FLOAT and inits["var"] == FLOAT
    assert inits["w"] == FLOAT16
    (bn,) = sigs_of(out, "BatchNormalization")
    assert bn.inputs[0] == H and bn.outputs == (H,)
    assert bn.inputs[3:] == (F, F)
    assert fp32_kept(result, "BatchNormalization") == []
    assert "var" in result.report.constants_kept_for_range
    assert_matches_fp32(model, out, random_feeds(model))


def test_batchnorm_opset13_stays_fp32() -> None:
    """BatchNormalization-9 binds every input to T: the large variance pins the whole node."""
    model = parse(_batchnorm(13))
    result, out = convert(model)
    check_full(out)
    (bn,) = sigs_of(out, "BatchNormalization")
    assert bn == NodeSig("BatchNormalization", (F,) * 5, (F,))
    inits = initializer_types(out)
    assert all(inits[n] == FLOAT for n in ("scale", "bias", "mean", "var"))
    kept = fp32_kept(result, "BatchNormalization")
    assert len(kept) == 1 and kept[0].category == "out-of-range constant"
    assert cast_targets(out) == [FLOAT16, FLOAT]  # into the MatMul, back up for the BN
    assert out.graph.node[-1].op_type == "BatchNormalization"
    assert_matches_fp32(model, out, random_feeds(model))


# -- Resize ------------------------------------------------------------------------------------


def test_resize_keeps_roi_and_scales_fp32() -> None:
    model = parse(f"""{header()}
agraph (float[1,1,2,3] x) => (float[1,1,4,6] y)
<float[3,3] w = {W33}, float[8] roi = {{0, 0, 0, 0, 1, 1, 1, 1}}, float[4] scales = {{1, 1, 2, 2}}>
{{
  h = MatMul(x, w)
  y = Resize<mode = "linear", coordinate_transformation_mode = "tf_crop_and_resize">(h, roi, scales)
}}
""")
    _, out = convert(model)
    check_full(out)
    inits = initializer_types(out)
    assert inits == {"w": FLOAT16, "roi": FLOAT, "scales": FLOAT}
    assert sigs_of(out, "Resize") == [NodeSig("Resize", (H, F, F), (H,))]
    assert cast_targets(out) == [FLOAT16, FLOAT]
    assert_matches_fp32(model, out, random_feeds(model))


# -- schema limits and saturation ---------------------------------------------------------------


def test_range_stays_fp32_for_float16() -> None:
    model = parse(f"""{header(21, 10)}
agraph (float[4] x) => (float[4] y)
<float start = {{0}}, float limit = {{4}}, float delta = {{1}}>
{{
  r = Range(start, limit, delta)
  y = Mul(x, r)
}}
""")
    result, out = convert(model, keep_io_types=False)
    check_full(out)
    assert sigs_of(out, "Range") == [NodeSig("Range", (F, F, F), (F,))]
    kept = fp32_kept(result, "Range")
    assert len(kept) == 1
    assert kept[0].category in ("schema has no 16-bit type", "policy")
    assert "Range" in kept[0].reason
    feeds = random_feeds(model)
    assert_close(run(out, feeds), run(model, feeds))


CLIP_FINFO = f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w = {W33}, float lo = {{-3.4e38}}, float hi = {{3.4e38}}>
{{
  h = MatMul(x, w)
  y = Clip(h, lo, hi)
}}
"""


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_clip_with_finfo_bounds_gives_correct_numbers(target: str) -> None:
    model = parse(CLIP_FINFO)
    _, out = convert(model, target_dtype=target)
    check_full(out)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer}
    # Wherever the bounds end up, they are not infinite in a 16-bit type.
    for name in ("lo", "hi"):
        assert np.isfinite(inits[name].astype(np.float32)).all()
    feeds = random_feeds(model, low=-4, high=4)
    actual = run_low(out, feeds, target)
    assert np.isfinite(actual[0]).all()
    assert_close(actual, run(model, feeds), rtol=5e-2 if target == "bfloat16" else 1e-2, atol=5e-2)


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_clip_with_finfo_bounds_converts_and_saturates(target: str) -> None:
    model = parse(CLIP_FINFO)
    result, out = convert(model, target_dtype=target)
    check_full(out)
    low = {"float16": H, "bfloat16": B}[target]
    low_t = {"float16": FLOAT16, "bfloat16": BFLOAT16}[target]
    assert fp32_kept(result, "Clip") == []
    assert sigs_of(out, "Clip") == [NodeSig("Clip", (low, low, low), (low,))]
    assert cast_targets(out) == [low_t, FLOAT]
    inits = {i.name: onnx.numpy_helper.to_array(i).astype(np.float32) for i in out.graph.initializer}
    limit = float(np.finfo(np.float16).max) if target == "float16" else 3.3895313892515355e38
    assert inits["lo"] == -limit and inits["hi"] == limit
    feeds = random_feeds(model, low=-4, high=4)
    actual = run_low(out, feeds, target)
    assert_close(actual, run(model, feeds), rtol=5e-2 if target == "bfloat16" else 1e-2, atol=5e-2)


# -- rule 3: constants shared by 16-bit and FP32 consumers --------------------------------------


def test_small_shared_initializer_is_duplicated() -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y, float[1,1] total)
<float[3,3] w = {W33}>
{{
  y = MatMul(x, w)
  total = ReduceSum<keepdims = 1>(w)
}}
""")
    result, out = convert(model)
    check_full(out)
    inits = initializer_types(out)
    assert sorted(inits.values()) == sorted([FLOAT, FLOAT16])
    assert inits["w"] == FLOAT
    # No runtime Cast reads the weight.
    assert [c for c in casts(out) if c[0] == "w"] == []
    assert sigs_of(out, "ReduceSum") == [NodeSig("ReduceSum", (F,), (F,))]
    assert sigs_of(out, "MatMul") == [NodeSig("MatMul", (H, H), (H,))]
    assert result.report.constants_duplicated == 1
    assert_matches_fp32(model, out, random_feeds(model))


def test_large_shared_initializer_is_cast_once() -> None:
    rows, cols = 128, 256  # 128 KiB in FP32, above the duplication limit
    rng = np.random.default_rng(0)
    weight = rng.uniform(-0.1, 0.1, size=(rows, cols)).astype(np.float32)
    model = parse(f"""{header()}
agraph (float[2,{rows}] x) => (float[2,{cols}] y, float[1,1] total)
{{
  y = MatMul(x, w)
  total = ReduceSum<keepdims = 1>(w)
}}
""", check=False)
    model.graph.initializer.append(onnx.numpy_helper.from_array(weight, "w"))
    onnx.checker.check_model(model, full_check=True)
    result, out = convert(model)
    check_full(out)
    assert initializer_types(out) == {"w": FLOAT}
    assert [c for c in casts(out) if c[0] == "w"] == [("w", FLOAT16)]
    assert sigs_of(out, "MatMul") == [NodeSig("MatMul", (H, H), (H,))]
    assert sigs_of(out, "ReduceSum") == [NodeSig("ReduceSum", (F,), (F,))]
    assert result.report.constants_duplicated == 0
    assert_matches_fp32(model, out, random_feeds(model), rtol=2e-2, atol=2e-2)


# -- user overrides ----------------------------------------------------------------------------

NAMED_CHAIN = f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}, float[3,3] w2 = {W33B}>
{{
  [block0_mm] h = MatMul(x, w1)
  [block1_mm] y = MatMul(h, w2)
}}
"""


def named_chain() -> onnx.ModelProto:
    """Two MatMuls named like exported models name them (the text syntax takes no '/')."""
    model = parse(NAMED_CHAIN)
    for node in model.graph.node:
        node.name = node.name.replace("_", "/")
    return model


def test_exclude_node_by_exact_name() -> None:
    model = named_chain()
    result, out = convert(model, exclude_nodes=["block1/mm"])
    check_full(out)
    assert node_sigs(out) == [
        NodeSig("Cast", (F,), (H,)),
        NodeSig("MatMul", (H, H), (H,)),
        NodeSig("Cast", (H,), (F,)),
        NodeSig("MatMul", (F, F), (F,)),
    ]
    assert node_named(out, "block1/mm").output[0] == "y"
    assert initializer_types(out) == {"w1": FLOAT16, "w2": FLOAT}
    assert [(k.name, k.category) for k in result.report.kept_fp32] == [("block1/mm", "excluded by user")]
    assert_matches_fp32(model, out, random_feeds(model))


def test_exclude_nodes_by_regex() -> None:
    model = named_chain()
    result, out = convert(model, exclude_nodes=[r"^block\d/"])
    check_full(out)
    assert node_sigs(out) == [NodeSig("MatMul", (F, F), (F,))] * 2
    assert casts(out) == []
    assert initializer_types(out) == {"w1": FLOAT, "w2": FLOAT}
    assert {k.name for k in result.report.kept_fp32} == {"block0/mm", "block1/mm"}


def test_exclude_pattern_matching_nothing_is_an_error() -> None:
    model = named_chain()
    with pytest.raises(mixprec.InputError, match="no_such_node"):
        convert(model, exclude_nodes=["block0/mm", "no_such_node"])


def test_fp32_ops_keeps_matmuls_fp32() -> None:
    model = named_chain()
    result, out = convert(model, fp32_ops=["MatMul"])
    check_full(out)
    assert node_sigs(out) == [NodeSig("MatMul", (F, F), (F,))] * 2
    assert casts(out) == []
    assert initializer_types(out) == {"w1": FLOAT, "w2": FLOAT}
    assert result.report.nodes_by_precision.get("low", 0) == 0


def test_unknown_fp32_op_is_an_error() -> None:
    model = named_chain()
    with pytest.raises(mixprec.InputError, match="NotAnOp"):
        convert(model, fp32_ops=["NotAnOp"])


# -- control flow ------------------------------------------------------------------------------


def test_if_branches_with_outer_scope_matmuls() -> None:
    model = parse(f"""{header()}
agraph (bool c, float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}, float[3,3] w2 = {W33B}>
{{
  y = If(c) <
    then_branch = g1 () => (float[2,3] t) {{ t = MatMul(x, w1) }},
    else_branch = g2 () => (float[2,3] e) {{ e = MatMul(x, w2) }}
  >
}}
""")
    _, out = convert(model)
    check_full(out)
    if_node = next(n for n in out.graph.node if n.op_type == "If")
    branches = {a.name: a.g for a in if_node.attribute}
    then_sigs = node_sigs(out, branches["then_branch"])
    else_sigs = node_sigs(out, branches["else_branch"])
    assert then_sigs == else_sigs == [NodeSig("MatMul", (H, H), (H,)), NodeSig("Cast", (H,), (F,))]
    out_types = {
        name: [o.type.tensor_type.elem_type for o in g.output] for name, g in branches.items()
    }
    assert out_types["then_branch"] == out_types["else_branch"] == [FLOAT]
    assert [c[1] for c in casts(out) if c[0] == "x"] == [FLOAT16]
    for cond in (True, False):
        feeds = {**random_feeds(model), "c": np.array(cond)}
        assert_close(run(out, feeds), run(model, feeds))


def test_loop_with_matmul_in_body_and_float_state() -> None:
    model = parse(f"""{header()}
agraph (int64 n, float[2,3] x) => (float[2,3] y)
<float[3,3] w = {W33}>
{{
  cond0 = Constant<value = bool {{1}}>()
  y = Loop(n, cond0, x) <body = b (int64 i, bool cin, float[2,3] s) => (bool cout, float[2,3] s2) {{
    cout = Identity(cin)
    s2 = MatMul(s, w)
  }}>
}}
""")
    _, out = convert(model)
    check_full(out)
    loop = next(n for n in out.graph.node if n.op_type == "Loop")
    body = loop.attribute[0].g
    assert [o.type.tensor_type.elem_type for o in body.output] == [onnx.TensorProto.BOOL, FLOAT]
    assert [i.type.tensor_type.elem_type for i in body.input] == [INT64, onnx.TensorProto.BOOL, FLOAT]
    assert sigs_of(out, "MatMul") == [NodeSig("MatMul", (H, H), (H,))]
    assert initializer_types(out) == {"w": FLOAT16}
    for steps in (0, 1, 3):
        feeds = {**random_feeds(model), "n": np.array(steps, np.int64)}
        assert_close(run(out, feeds), run(model, feeds))


# -- stability --------------------------------------------------------------------------------


@pytest.mark.parametrize("keep_io_types", [True, False])
@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_converting_twice_changes_nothing(target: str, keep_io_types: bool) -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w1 = {W33}, float[3,3] w2 = {W33B}, float[3] b = {{0.1, 0.2, 0.3}}>
{{
  h = MatMul(x, w1)
  s = Softmax<axis = -1>(h)
  a = Add(s, b)
  t = MatMul(a, w2)
  y = Relu(t)
}}
""")
    _, once = convert(model, target_dtype=target, keep_io_types=keep_io_types)
    result, twice = convert(once, target_dtype=target, keep_io_types=keep_io_types)
    check_full(twice)
    assert all_node_sigs(twice) == all_node_sigs(once)
    assert [(n.op_type, list(n.input), list(n.output)) for n in twice.graph.node] == [
        (n.op_type, list(n.input), list(n.output)) for n in once.graph.node
    ]
    assert initializer_types(twice) == initializer_types(once)
    assert io_types(twice) == io_types(once)
    assert result.report.casts_inserted == 0
    assert result.report.casts_removed == 0


# -- regressions: converter bugs found by these tests, fixed since --------------------------------


@pytest.mark.parametrize("attr", ["value_float = 2.0", "value_floats = [2.0, 1.0, 3.0]"])
def test_constant_value_float_attribute(attr: str) -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y)
<float[3,3] w = {W33}>
{{
  h = MatMul(x, w)
  c = Constant<{attr}>()
  y = Mul(h, c)
}}
""")
    _, out = convert(model)
    check_full(out)
    assert sigs_of(out, "Mul") == [NodeSig("Mul", (H, H), (H,))]
    assert_matches_fp32(model, out, random_feeds(model))


OVERRIDABLE = f"""{header()}
agraph (float[2,3] x, float[3,3] w) => (float[2,3] y)
<float[3,3] w = {W33}>
{{
  y = MatMul(x, w)
}}
"""


def test_overridable_initializer_still_overridable() -> None:
    model = parse(OVERRIDABLE)
    _, out = convert(model)
    check_full(out)
    assert io_types(out) == ([("x", FLOAT), ("w", FLOAT)], [("y", FLOAT)])
    feeds = {**random_feeds(model), "w": np.eye(3, dtype=np.float32) * 3}
    assert_close(run(out, feeds), run(model, feeds))


def test_overridable_initializer_without_keep_io_types() -> None:
    model = parse(OVERRIDABLE)
    _, out = convert(model, keep_io_types=False)
    check_full(out)
    feeds = {**random_feeds(model), "w": np.eye(3, dtype=np.float32) * 3}
    assert_close(run(out, feeds), run(model, feeds))


@pytest.mark.parametrize("keep_io_types", [True, False])
def test_existing_fp32_cast_of_16_bit_value_is_reused(keep_io_types: bool) -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y, float[2,3] z)
<float[3,3] w = {W33}>
{{
  h = MatMul(x, w)
  c = Cast<to = 1>(h)
  y = Softmax(c)
  z = Softmax(h)
}}
""")
    _, out = convert(model, keep_io_types=keep_io_types)
    check_full(out)
    mm = next(n for n in out.graph.node if n.op_type == "MatMul")
    assert [c for c in casts(out) if c[0] == mm.output[0]] == [(mm.output[0], FLOAT)]
    assert_matches_fp32(model, out, random_feeds(model))


def test_small_shared_constant_node_is_duplicated() -> None:
    model = parse(f"""{header()}
agraph (float[2,3] x) => (float[2,3] y, float[1,1] total)
{{
  w = Constant<value = float[3,3] {W33}>()
  y = MatMul(x, w)
  total = ReduceSum<keepdims = 1>(w)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert [c for c in casts(out) if c[0] == "w"] == []
    assert result.report.casts_runtime == 2  # model input and output only
    assert_matches_fp32(model, out, random_feeds(model))


@pytest.mark.parametrize("keep_io_types", [True, False])
def test_converting_control_flow_twice_changes_nothing(keep_io_types: bool) -> None:
    model = parse(f"""{header()}
agraph (bool c, int64 n, float[2,3] x) => (float[2,3] y, float[2,3] z)
<float[3,3] w1 = {W33}, float[3,3] w2 = {W33B}>
{{
  h = MatMul(x, w1)
  y = If(c) <
    then_branch = g1 () => (float[2,3] t) {{ t = MatMul(h, w2) }},
    else_branch = g2 () => (float[2,3] e) {{ e = Softmax(h) }}
  >
  cond0 = Constant<value = bool {{1}}>()
  z = Loop(n, cond0, x) <body = b (int64 i, bool cin, float[2,3] s) => (bool cout, float[2,3] s2) {{
    cout = Identity(cin)
    s2 = MatMul(s, w1)
  }}>
}}
""")
    _, once = convert(model, keep_io_types=keep_io_types)
    check_full(once)
    result, twice = convert(once, keep_io_types=keep_io_types)
    check_full(twice)
    assert all_node_sigs(twice) == all_node_sigs(once)
    assert result.report.casts_inserted == 0 and result.report.casts_removed == 0
    assert initializer_types(twice) == initializer_types(once)
    for cond in (True, False):
        feeds = {**random_feeds(model), "c": np.array(cond), "n": np.array(2, np.int64)}
        expected = run(model, feeds)
        if not keep_io_types:
            feeds = {**feeds, "x": feeds["x"].astype(np.float16).astype(np.float32)}
        assert_close(run(twice, feeds), expected, rtol=2e-2, atol=2e-2)


def test_exclude_exact_name_that_is_not_a_regex() -> None:
    model = named_chain()
    model.graph.node[0].name = "block(0"
    result, out = convert(model, exclude_nodes=["block(0"])
    assert [k.name for k in result.report.kept_fp32] == ["block(0"]
    assert node_sigs(out)[0] == NodeSig("MatMul", (F, F), (F,))


@pytest.mark.parametrize(("target", "runtime"), [("float16", "ran and emulated"), ("bfloat16", "emulated")])
def test_builtin_validation_agrees(target: str, runtime: str) -> None:
    """validate='run' checks and runs the converted chain and records small errors."""
    model = parse(MATMUL_CHAIN)
    result, _ = convert(model, target_dtype=target, validate="run", tolerance=(5e-2, 5e-2))
    validation = result.report.validation
    assert validation.checker == "passed"
    assert validation.runtime == runtime
    assert [o.name for o in validation.outputs] == ["y"]
    assert validation.outputs[0].within_tolerance is True
    assert validation.outputs[0].new_nonfinite == 0


def test_weights_in_constant_nodes_count_in_the_report() -> None:
    """Exporters that keep weights in Constant nodes (Paddle): the weights card counts them."""
    rng = np.random.default_rng(0)
    w1 = helper.make_node("Constant", [], ["w1"], value=numpy_helper.from_array(rng.normal(size=(64, 64)).astype(np.float32)))
    w2 = helper.make_node("Constant", [], ["w2"], value=numpy_helper.from_array(rng.normal(size=(64, 8)).astype(np.float32)))
    graph = helper.make_graph(
        [w1, w2, helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])],
        "constants",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result, _ = convert(model, target_dtype="float16")
    report = result.report
    assert report.weight_bytes_before == (64 * 64 + 64 * 8) * 4
    assert report.weight_bytes_after == (64 * 64 + 64 * 8) * 2
    assert report.constants_lowered == 2


def test_identity_cast_of_a_value_shares_its_16bit_cast() -> None:
    """x and Cast(x, to=FLOAT) both feed 16-bit compute: one Cast of x, since the identity Cast
    is removed (found by the random-graph property test)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(8, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["same"], to=TensorProto.FLOAT),
            helper.make_node("Concat", ["x", "same"], ["both"], axis=1),
            helper.make_node("MatMul", ["both", "w"], ["y"]),
        ],
        "identity_cast",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _, out = convert(model, target_dtype="float16")
    casts_of_x = [n for n in out.graph.node if n.op_type == "Cast" and n.input[0] == "x"]
    assert len(casts_of_x) == 1, [(n.name, n.input, n.output) for n in out.graph.node]
