"""Cast placement by cost (`mixprec.plan.placement`): the follow nodes of an island are
decided together so that its Casts sit on the cheapest edges, within the numeric rules.

Each graph moves a value through Unsqueeze -> Expand (x8) between a fixed 16-bit node (MatMul)
and a fixed FP32 one (ReduceSum): "widest input" would cast the expanded tensor, the cut casts
the small one.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from mixprec.plan import placement
from helpers import NodeSig, assert_matches_fp32, check_full, convert, parse, producer, random_feeds, run, sigs_of

F, H, I = "float", "float16", "int64"

HEADER = '<ir_version: 8, opset_import: ["" : 17]>'
W44 = "{" + ", ".join(["0.5", "-0.25", "1", "0.125"] * 4) + "}"


def _category(result, op_type: str) -> str:  # noqa: ANN001
    (decision,) = [d for n, d in result.plan.decisions.items() if n.op_type == op_type]
    return decision.category.value


def test_upcast_moves_before_the_expand() -> None:
    model = parse(f"""{HEADER}
agraph (float[16,4] x) => (float[8,16,1] y)
<float[4,4] w = {W44}, int64[1] axis0 = {{0}}, int64[3] reps = {{8, 16, 4}}, int64[1] last = {{2}}>
{{
  a = MatMul(x, w)
  u = Unsqueeze(a, axis0)
  e = Expand(u, reps)
  y = ReduceSum<keepdims = 1>(e, last)
}}
""")
    result, out = convert(model)
    check_full(out)
    # The 64-element tensor is cast up once, before the Expand, which runs in FP32.
    assert sigs_of(out, "Expand") == [NodeSig("Expand", (F, I), (F,))]
    assert sigs_of(out, "Unsqueeze") == [NodeSig("Unsqueeze", (H, I), (H,))]
    expand = next(n for n in out.graph.node if n.op_type == "Expand")
    cast = producer(out, expand.input[0])
    assert cast.op_type == "Cast" and producer(out, cast.input[0]).op_type == "Unsqueeze"
    assert _category(result, "Expand") == "placed by cast cost"
    assert "1 -> 1 casts, 3,072 -> 384 bytes per inference" in result.plan.decisions[
        next(n for n in result.plan.decisions if n.op_type == "Expand")
    ].reason
    assert result.report.cast_bytes_per_inference < 8 * 16 * 4 * 6
    assert_matches_fp32(model, out, random_feeds(model))


def test_downcast_of_an_fp32_value_moves_before_the_expand_when_only_16bit_nodes_read_it() -> None:
    # ReduceSum stays FP32 (a long sum may leave the float16 range): its result is not narrowed
    # where an FP32 node would read it, but Unsqueeze and Expand only move it to a MatMul, which
    # reads 16 bits anyway: the Cast goes on the small tensor.
    model = parse(f"""{HEADER}
agraph (float[16,4,8] x) => (float[8,16,4] y)
<float[4,4] w = {W44}, int64[1] axis0 = {{0}}, int64[3] reps = {{8, 16, 4}}, int64[1] last = {{2}}>
{{
  s = ReduceSum<keepdims = 0>(x, last)
  u = Unsqueeze(s, axis0)
  e = Expand(u, reps)
  y = MatMul(e, w)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert sigs_of(out, "ReduceSum") == [NodeSig("ReduceSum", (F, I), (F,))]
    assert sigs_of(out, "Expand") == [NodeSig("Expand", (H, I), (H,))]
    unsqueeze = next(n for n in out.graph.node if n.op_type == "Unsqueeze")
    assert producer(out, unsqueeze.input[0]).op_type == "Cast"
    assert _category(result, "Unsqueeze") == "placed by cast cost"
    assert_matches_fp32(model, out, random_feeds(model))


def test_fp32_value_stays_fp32_where_an_fp32_node_also_reads_the_moved_copy() -> None:
    model = parse(f"""{HEADER}
agraph (float[16,4,8] x) => (float[8,16,4] y, float[8,16,4] z)
<float[4,4] w = {W44}, int64[1] axis0 = {{0}}, int64[3] reps = {{8, 16, 4}}, int64[1] last = {{2}}>
{{
  s = ReduceSum<keepdims = 0>(x, last)
  u = Unsqueeze(s, axis0)
  z = Expand(u, reps)
  y = MatMul(z, w)
}}
""")
    result, out = convert(model)
    check_full(out)
    # z is a model output (FP32): the expanded values must be the FP32 ones.
    assert sigs_of(out, "Expand") == [NodeSig("Expand", (F, I), (F,))]
    assert sigs_of(out, "Unsqueeze") == [NodeSig("Unsqueeze", (F, I), (F,))]
    assert_matches_fp32(model, out, random_feeds(model))


def test_arithmetic_on_an_fp32_value_stays_fp32_and_the_cast_follows_it() -> None:
    model = parse(f"""{HEADER}
agraph (float[16,4,8] x) => (float[8,16,4] y)
<float[4,4] w = {W44}, int64[1] axis0 = {{0}}, int64[3] reps = {{8, 16, 4}}, int64[1] last = {{2}}, float two = {{2.0}}>
{{
  s = ReduceSum<keepdims = 0>(x, last)
  d = Mul(s, two)
  u = Unsqueeze(d, axis0)
  e = Expand(u, reps)
  y = MatMul(e, w)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert sigs_of(out, "Mul") == [NodeSig("Mul", (F, F), (F,))]
    assert sigs_of(out, "Expand") == [NodeSig("Expand", (H, I), (H,))]
    unsqueeze = next(n for n in out.graph.node if n.op_type == "Unsqueeze")
    cast = producer(out, unsqueeze.input[0])
    assert cast.op_type == "Cast" and producer(out, cast.input[0]).op_type == "Mul"
    assert_matches_fp32(model, out, random_feeds(model))


def _reordered(model):  # noqa: ANN001, ANN202
    """The same graph with its nodes in another topological order (Kahn's algorithm taking the
    latest ready node first)."""
    import copy  # noqa: PLC0415
    import heapq  # noqa: PLC0415

    out = copy.deepcopy(model)
    nodes = list(out.graph.node)
    produced = {o: i for i, n in enumerate(nodes) for o in n.output}
    deps = [{produced[x] for x in n.input if x in produced} for n in nodes]
    users: dict[int, list[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            users.setdefault(j, []).append(i)
    waiting = [len(d) for d in deps]
    ready = [-i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = -heapq.heappop(ready)
        order.append(nodes[i])
        for u in users.get(i, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, -u)
    del out.graph.node[:]
    out.graph.node.extend(order)
    return out


def test_decisions_do_not_depend_on_node_order() -> None:
    from test_real_cnns import LIGHT, realistic_weights  # noqa: PLC0415

    import onnx  # noqa: PLC0415

    model = realistic_weights(onnx.load(str(LIGHT / "light_inception_v1.onnx")))
    shuffled = _reordered(model)
    assert [n.name for n in shuffled.graph.node] != [n.name for n in model.graph.node]
    results = [convert(m, target_dtype="fp16", runtime="ort-cuda")[0] for m in (model, shuffled)]
    decisions = [
        {node.name: (d.precision, d.category) for node, d in r.plan.decisions.items()} for r in results
    ]
    assert decisions[0] == decisions[1]
    assert any(category.value == "placed by cast cost" for _, category in decisions[0].values())
    assert results[0].report.casts_runtime == results[1].report.casts_runtime


def test_a_flexible_reader_inside_an_island_costs_no_cast() -> None:
    model = parse(f"""{HEADER}
agraph (float[16,4] x) => (float[16,4] y, float[1,1] z)
<float[4,4] w = {W44}>
{{
  a = MatMul(x, w)
  v = Relu(a)
  u = Neg(v)
  y = CastLike(v, u)
  z = ReduceSum<keepdims = 1>(u)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert_matches_fp32(model, out, random_feeds(model))


def test_a_launch_per_cast_breaks_the_tie_towards_fewer_casts() -> None:
    # On tiny tensors the bytes tie (two casts around a 16-bit Add, or one cast and an FP32 Add
    # that moves as many bytes more); each Cast is one more kernel launch on the runtime's device
    # (mixprec.policy.costs), so the Add computes in FP32 for its FP32 model output.
    model = parse(f"""{HEADER}
agraph (float[4,4] x) => (float[4,4] y)
<float[4,4] w = {W44}>
{{
  a = MatMul(x, w)
  s = Softmax<axis = -1>(x)
  y = Add(a, s)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert sigs_of(out, "Add") == [NodeSig("Add", (F, F), (F,))]
    assert _category(result, "Add") == "placed by cast cost"
    assert "2 -> 1 casts, 192 -> 96 bytes" in next(d.reason for n, d in result.plan.decisions.items() if n.op_type == "Add")
    assert result.report.casts_runtime == 2  # x in, and the MatMul output up
    assert_matches_fp32(model, out, random_feeds(model))


def test_casts_move_inside_an_if_branch_too() -> None:
    # The Expand graph above as both branches of an If (x from the outer scope, constants in the
    # branches as exporters write them): each branch casts the small ReduceSum result, not the
    # expanded tensor.
    def constant(name: str, array: np.ndarray) -> onnx.NodeProto:
        return onnx.helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))

    def branch(tag: str) -> onnx.GraphProto:
        nodes = [
            constant(f"{tag}_w", np.array([[0.5, -0.25, 1, 0.125]] * 4, np.float32)),
            constant(f"{tag}_axis0", np.array([0], np.int64)),
            constant(f"{tag}_reps", np.array([8, 16, 4], np.int64)),
            constant(f"{tag}_last", np.array([2], np.int64)),
            onnx.helper.make_node("ReduceSum", ["x", f"{tag}_last"], [f"{tag}_s"], keepdims=0),
            onnx.helper.make_node("Unsqueeze", [f"{tag}_s", f"{tag}_axis0"], [f"{tag}_u"]),
            onnx.helper.make_node("Expand", [f"{tag}_u", f"{tag}_reps"], [f"{tag}_e"]),
            onnx.helper.make_node("MatMul", [f"{tag}_e", f"{tag}_w"], [f"{tag}_y"]),
        ]
        out = onnx.helper.make_tensor_value_info(f"{tag}_y", onnx.TensorProto.FLOAT, [8, 16, 4])
        return onnx.helper.make_graph(nodes, tag, [], [out])

    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("If", ["c"], ["y"], then_branch=branch("a"), else_branch=branch("b"))],
        "if_expand",
        [
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [16, 4, 8]),
            onnx.helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
        ],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [8, 16, 4])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    result, out = convert(model)
    check_full(out)
    (if_node,) = [n for n in out.graph.node if n.op_type == "If"]
    for attribute in if_node.attribute:
        body = attribute.g
        (expand,) = [n for n in body.node if n.op_type == "Expand"]
        (unsqueeze,) = [n for n in body.node if n.op_type == "Unsqueeze"]
        casts = {n.output[0]: n for n in body.node if n.op_type == "Cast"}
        assert unsqueeze.input[0] in casts, "the ReduceSum result is cast before the Unsqueeze"
        assert expand.input[0] not in casts
    moved = [d for n, d in result.plan.decisions.items() if n.op_type in ("Unsqueeze", "Expand")]
    assert len(moved) == 4 and all(d.category.value == "placed by cast cost" for d in moved)
    feeds = random_feeds(model)
    for flag in (True, False):
        assert_matches_fp32(model, out, {**feeds, "c": np.array(flag)})


def test_a_cut_that_trades_cast_bytes_for_launches_gives_way_to_the_cut_by_bytes() -> None:
    # An island as plain data (see placement._Islands.problem): three free nodes, four values.
    # Priced with a launch per Cast, the cheapest cut has one Cast of a 1,000-element value (6,000
    # bytes, more than the passes' 720): not kept. The cut priced by bytes alone is (2 casts, 660
    # bytes): kept.
    nodes = ((10, 0, ()), (100, 0, ()), (100, 0, ()))
    values = (
        (10, 2, (), True, False),
        (1000, -2, (0,), False, False),
        (100, 0, (1,), True, False),
        (10, 0, (), True, False),
    )
    greedy = (False, True, False)
    assert placement._casts(values, greedy) == (3, 720)
    assert placement._casts(values, placement._solve((nodes, values), 8192)) == (1, 6000)
    assert placement._best_cut((nodes, values), greedy, (3, 720), 8192) == ((False, True, True), (2, 660))


def test_a_product_of_distinct_values_is_a_follow_op_and_a_square_is_not() -> None:
    """In float16 a square (Mul(x, x)) stays FP32 as Pow does; any other Mul follows its inputs
    like every follow op, so cast placement moves it (a free node of its island)."""
    model = parse(f"""{HEADER}
agraph (float[16,4] x) => (float[16,4] y, float[16,4] z)
<float[4,4] w = {W44}, float two = {{2.0}}>
{{
  a = MatMul(x, w)
  y = Mul(a, two)
  z = Mul(a, a)
}}
""")
    result, out = convert(model)
    check_full(out)
    decisions = {n.outputs[0].name: d for n, d in result.plan.decisions.items()}
    # a is cast once for both FP32 outputs: the cut moved the product into FP32 beside the square.
    assert decisions["y"].category.value == "placed by cast cost"
    assert decisions["z"].category.value == "policy" and "square" in decisions["z"].reason
    assert sigs_of(out, "Mul") == [NodeSig("Mul", (F, F), (F,))] * 2
    assert_matches_fp32(model, out, random_feeds(model))


def _gemm_norm_gemm() -> onnx.ModelProto:
    """Gemm -> LayerNormalization -> Gemm, as wake-word and ViT blocks have them."""
    rng = np.random.default_rng(0)
    consts = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("w1", rng.normal(0, 0.3, (16, 32))), ("w2", rng.normal(0, 0.3, (32, 8))),
        ("g", rng.uniform(0.5, 1.5, 32)), ("b", rng.uniform(-0.1, 0.1, 32)),
    )]
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Gemm", ["x", "w1"], ["h"], name="fc1"),
            onnx.helper.make_node("LayerNormalization", ["h", "g", "b"], ["n"], axis=-1, name="norm"),
            onnx.helper.make_node("Gemm", ["n", "w2"], ["y"], name="fc2"),
        ],
        "gng", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 16])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 8])], consts,
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_a_normalization_between_fp32_products_stays_fp32_instead_of_two_casts() -> None:
    """onnxruntime's CPU provider has no float16 Gemm: a float16 LayerNormalization between the
    two FP32 Gemms would cost two Casts and save less traffic than they move, so it stays FP32
    with the cast placement's reason. Where the Gemms convert, so does the normalization."""
    model = _gemm_norm_gemm()
    result, out = convert(model, runtime="ort-cpu")
    assert _category(result, "LayerNormalization") == "placed by cast cost"
    assert result.report.casts_runtime == 0 and not [n for n in out.graph.node if n.op_type == "Cast"]
    (kept,) = [k for k in result.report.kept_fp32 if k.op_type == "LayerNormalization"]
    assert "2 -> 0 casts" in kept.reason, kept.reason

    result, out = convert(model, runtime="ort-cuda")
    assert result.report.low_by_op.get("LayerNormalization") == 1 and result.report.low_by_op.get("Gemm") == 2
    assert_matches_fp32(model, out, random_feeds(model), target="float16")


def test_a_dead_cast_of_the_model_does_not_become_a_normalization_input() -> None:
    """A model's own Cast whose output nothing reads is not taken as the FP32 copy of its input
    for a normalization the placement keeps FP32: it would become that normalization's input,
    and converting the result again would decide the normalization differently."""
    model = parse(f"""{HEADER}
agraph (float[4,4] x) => (float[4,4] h, float[4,4] n)
<float[4,4] w = {W44}, float[4] g = {{1, 0.5, 2, 1}}, float[4] b = {{0, 0.1, 0, -0.1}}>
{{
  m = MatMul(x, w)
  h = Relu(m)
  n = LayerNormalization<axis = -1>(h, g, b)
  dead = Cast<to = 1>(h)
}}
""")
    result, out = convert(model)
    assert _category(result, "LayerNormalization") == "placed by cast cost"
    (norm,) = [n for n in out.graph.node if n.op_type == "LayerNormalization"]
    assert norm.input[0] != "dead"
    again_result, again = convert(out)
    assert [(n.op_type, list(n.input), list(n.output)) for n in again.graph.node] == [
        (n.op_type, list(n.input), list(n.output)) for n in out.graph.node
    ]
    assert_matches_fp32(model, out, random_feeds(model), target="float16")


def test_a_chain_between_an_upcast_and_a_downcast_of_16bit_values_converts() -> None:
    """x @ w -> Cast(float) -> * scale -> + shift -> Cast(float) -> @ w: the casts around a
    normalization as TorchScript exports `x.to(torch.float32) ... .to(input_dtype)`. Between two
    16-bit MatMuls the chain runs in 16 bits and both Casts vanish; it had stayed FP32 (its only
    reader, a Cast, reads either type), a conversion there and back."""
    model = parse(f"""{HEADER}
agraph (float[4,4] x) => (float[4,4] y)
<float[4,4] w = {W44}, float[4] scale = {{1.5, 0.5, 1, 2}}, float[4] shift = {{0.25, -0.5, 0, 1}}>
{{
  h = MatMul(x, w)
  up = Cast<to = 1>(h)
  scaled = Mul(up, scale)
  shifted = Add(scaled, shift)
  down = Cast<to = 1>(shifted)
  y = MatMul(down, w)
}}
""")
    result, out = convert(model)
    check_full(out)
    assert {d.precision.value for d in result.plan.decisions.values()} == {"low"}
    assert sigs_of(out, "Mul") == [NodeSig("Mul", (H, H), (H,))]
    assert sigs_of(out, "Add") == [NodeSig("Add", (H, H), (H,))]
    # Only the model's own input and output are cast: both Casts of the chain were no-ops.
    assert [(n.input[0], n.output[0]) for n in out.graph.node if n.op_type == "Cast"] == [("x", "x_fp16"), ("y_fp16", "y")]
    assert result.report.casts_removed == 2
    assert_matches_fp32(model, out, random_feeds(model))


def test_a_value_that_an_fp32_cast_also_reads_keeps_its_fp32_copy() -> None:
    """A constant read by two Casts to float, one retargeted to 16 bits (it feeds a MatMul's
    sum) and one kept FP32 (it feeds an FP32 subtraction): the FP32 path reads the exact value
    (1000.3 - 1000), not its 16-bit rounding (1000.5 - 1000)."""
    model = parse(f"""{HEADER}
agraph (float[4,4] x) => (float[4,4] y, float[4] z)
<float[4,4] w = {W44}, float thousand = {{1000}}>
{{
  c = Constant<value = float[4] {{1000.3, 1000.3, 1000.3, 1000.3}}>()
  b = Cast<to = 1>(c)
  m = MatMul(x, w)
  y = Add(m, b)
  k = Cast<to = 1>(c)
  z = Sub(k, thousand)
}}
""")
    result, out = convert(model)
    decisions = {n.outputs[0].name: d.precision.value for n, d in result.plan.decisions.items()}
    assert decisions["b"] == "low" and decisions["k"] == "fp32" and decisions["c"] == "fp32", decisions
    z = run(out, random_feeds(model))[1]
    np.testing.assert_allclose(z, np.full(4, np.float32(1000.3) - 1000, np.float32), rtol=1e-6)


def test_an_fp32_cast_of_a_computed_value_does_not_pull_its_producer_into_fp32() -> None:
    """x @ w -> Cast(float) -> + b, read by Cast(float) -> Softmax (FP32) and by Cast(float) ->
    @ w (16-bit), as a ResNet exported with a Cast after every op: the Add runs in 16 bits and
    only the Softmax's upcast converts (keeping the Add FP32 for the upcast would convert twice)."""
    model = parse(f"""{HEADER}
agraph (float[4,4] x) => (float[4,4] y, float[4,4] z)
<float[4,4] w = {W44}, float[4] b = {{0.25, -0.5, 0, 1}}>
{{
  h = MatMul(x, w)
  t = Cast<to = 1>(h)
  a = Add(t, b)
  c = Cast<to = 1>(a)
  y = Softmax<axis = -1>(c)
  d = Cast<to = 1>(a)
  z = MatMul(d, w)
}}
""")
    result, out = convert(model)
    decisions = {n.outputs[0].name: d.precision.value for n, d in result.plan.decisions.items()}
    assert decisions["a"] == "low" and decisions["c"] == "fp32" and decisions["y"] == "fp32", decisions
    conversions = [n for n in out.graph.node if n.op_type == "Cast" and n.input[0] not in ("x", "z_fp16")]
    assert [(n.input[0], n.attribute[0].i) for n in conversions] == [("a", onnx.TensorProto.FLOAT)]
    assert_matches_fp32(model, out, random_feeds(model))
