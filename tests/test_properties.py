"""Property tests: random FP32 DAGs, converted to float16 and bfloat16, with and without
keep_io_types, must give valid, type-consistent, idempotent models with matching numbers.

Graphs are built from ops of every policy class (low, fp32, follow, dtype-attribute, shape
plumbing) over float32 [4, 4] tensors, with random FP32 initializers. Optionally a constant with
values outside the 16-bit range (or flushing to zero) is mixed in, to exercise the WIDE paths.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
import onnx.helper as oh
import pytest
from helpers import (
    BFLOAT16,
    BOOL,
    FLOAT,
    FLOAT16,
    INT64,
    LOW_TYPES,
    all_node_sigs,
    check_full,
    convert,
    infer,
    initializer_types,
    io_types,
    iter_nodes,
    run,
    run_low,
    to_low,
    value_types,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from onnx import numpy_helper

from mixprec.plan.model import Category
from mixprec.policy.opfacts import op_facts
from mixprec.validate.emulate import emulate_low_precision

N = 4

# Ops of the generator and how many float operands they take.
UNARY = ["Relu", "Sigmoid", "Tanh", "Exp", "Softmax", "Transpose", "LayerNormalization",
         "ReduceSum", "ReshapeRoundTrip", "Neg", "IdentityCast"]
BINARY = ["MatMul", "Add", "Mul", "Sub", "Concat", "Where"]
SOURCES = ["CastFromInt", "ConstantNode"]
OPS = UNARY + BINARY + SOURCES
# FP32-class ops per target (their float inputs and outputs must stay float32).
FP32_CLASS = {
    "float16": {"Softmax", "ReduceSum", "Exp"},
    "bfloat16": {"Softmax", "ReduceSum"},
}
# Constants whose values the 16-bit types cannot hold (overflow or significant flush).
SPECIAL_SCALARS = [-3.4e38, 1e-12, 1e5]
_LOW_NUMPY = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@dataclass
class Step:
    op: str
    a: int
    b: int
    const_operand: int  # 0: pool value, 1: new [4,4] initializer, 2: [4] initializer, 3: scalar,
    # 4: an existing [4,4] initializer or Constant (shared between consumers)
    special: int  # -1 or an index into SPECIAL_SCALARS for a scalar operand


@dataclass
class Recipe:
    n_inputs: int
    steps: list[Step]
    outputs: list[int]
    seed: int
    opset: int = 17


@st.composite
def recipes(draw) -> Recipe:
    n_inputs = draw(st.integers(1, 3))
    n_steps = draw(st.integers(1, 8))
    steps = []
    for _ in range(n_steps):
        special = draw(st.sampled_from([-1] * 6 + list(range(len(SPECIAL_SCALARS)))))
        steps.append(
            Step(
                op=draw(st.sampled_from(OPS)),
                a=draw(st.integers(0, 63)),
                b=draw(st.integers(0, 63)),
                const_operand=draw(st.integers(0, 4)),
                special=special,
            )
        )
    outputs = draw(st.lists(st.integers(0, 63), min_size=1, max_size=2))
    return Recipe(n_inputs, steps, outputs, draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from([17, 21])))


@dataclass
class Built:
    model: onnx.ModelProto
    has_special: bool
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    identity_casts: set[str] = field(default_factory=set)  # names of Cast(float -> float) nodes


def build(recipe: Recipe) -> Built:
    """Turn a recipe into a valid FP32 model (every float tensor is [4, 4])."""
    rng = np.random.default_rng(recipe.seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    inputs = [oh.make_tensor_value_info(f"x{i}", FLOAT, [N, N]) for i in range(recipe.n_inputs)]
    pool = [f"x{i}" for i in range(recipe.n_inputs)]
    produced: list[str] = []
    extra_inputs: dict[str, onnx.ValueInfoProto] = {}
    has_special = False
    matrices: list[str] = []  # [4,4] constants (initializers and Constant outputs) for sharing
    identity_casts: set[str] = set()
    counter = [0]

    def fresh(prefix: str) -> str:
        counter[0] += 1
        return f"{prefix}{counter[0]}"

    def init(array: np.ndarray, prefix: str = "w") -> str:
        name = fresh(prefix)
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(op: str, ins: list[str], **attrs) -> str:
        out = fresh("v")
        nodes.append(oh.make_node(op, ins, [out], name=fresh(f"{op.lower()}_"), **attrs))
        return out

    def weight(shape: tuple[int, ...], scale: float = 0.5) -> str:
        name = init((rng.uniform(-1, 1, size=shape) * scale).astype(np.float32))
        if shape == (N, N):
            matrices.append(name)
        return name

    def matrix(step: Step, pick: str) -> str:
        """A [4,4] operand: a pool value, a new weight, or a shared one."""
        if step.const_operand == 0:
            return pick
        if step.const_operand == 4 and matrices:
            return matrices[step.b % len(matrices)]
        return weight((N, N))

    def second_operand(step: Step, pick: str) -> str:
        nonlocal has_special
        if step.const_operand in (0, 1, 4):
            return matrix(step, pick)
        if step.const_operand == 2:
            return weight((N,))
        if step.special >= 0:
            has_special = True
            return init(np.array(SPECIAL_SCALARS[step.special], np.float32), "special")
        return init(np.array(rng.uniform(0.5, 1.5), np.float32), "s")

    for step in recipe.steps:
        a = pool[step.a % len(pool)]
        b = pool[step.b % len(pool)]
        op = step.op
        if op == "MatMul":
            out = node("MatMul", [a, matrix(step, b)])
        elif op in ("Add", "Mul", "Sub"):
            out = node(op, [a, second_operand(step, b)])
        elif op in ("Relu", "Sigmoid", "Tanh", "Neg"):
            out = node(op, [a])
        elif op == "Exp":
            out = node("Exp", [a])
        elif op == "Softmax":
            out = node("Softmax", [a], axis=-1)
        elif op == "Transpose":
            out = node("Transpose", [a], perm=[1, 0])
        elif op == "LayerNormalization":
            out = node("LayerNormalization", [a, weight((N,), 1.0), weight((N,), 0.1)], axis=-1)
        elif op == "ReduceSum":
            axes = init(np.array([1], np.int64), "axes")
            source = a if step.const_operand in (0, 2, 3) else matrix(step, a)
            reduced = node("ReduceSum", [source, axes], keepdims=1)  # [4, 1]
            out = node("Add", [b, reduced])  # broadcast back to [4, 4]
        elif op == "ReshapeRoundTrip":
            flat = node("Reshape", [a, init(np.array([2, 2 * N], np.int64), "shape")])
            out = node("Reshape", [flat, init(np.array([N, N], np.int64), "shape")])
        elif op == "Concat":
            joined = node("Concat", [a, b], axis=0)  # [8, 4]
            folded = node("Reshape", [joined, init(np.array([N, 2 * N], np.int64), "shape")])
            out = node("MatMul", [folded, weight((2 * N, N))])
        elif op == "Where":
            if "cond" not in extra_inputs:
                extra_inputs["cond"] = oh.make_tensor_value_info("cond", BOOL, [N, N])
            out = node("Where", ["cond", a, second_operand(step, b)])
        elif op == "CastFromInt":
            if "ints" not in extra_inputs:
                extra_inputs["ints"] = oh.make_tensor_value_info("ints", INT64, [N, N])
            out = node("Cast", ["ints"], to=FLOAT)
        elif op == "ConstantNode":
            tensor = numpy_helper.from_array(
                (rng.uniform(-1, 1, size=(N, N)) * 0.5).astype(np.float32), fresh("c")
            )
            const = node("Constant", [], value=tensor)
            matrices.append(const)
            out = node("MatMul", [a, const])
        elif op == "IdentityCast":
            out = node("Cast", [a], to=FLOAT)
            identity_casts.add(nodes[-1].name)
        else:  # pragma: no cover
            raise AssertionError(op)
        pool.append(out)
        produced.append(out)

    output_names = list(dict.fromkeys(produced[i % len(produced)] for i in recipe.outputs))
    graph = oh.make_graph(
        nodes,
        "random",
        [*inputs, *extra_inputs.values()],
        [oh.make_tensor_value_info(n, FLOAT, [N, N]) for n in output_names],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", recipe.opset)])
    model.ir_version = 8 if recipe.opset < 21 else 10
    check_full(model)

    feeds = {f"x{i}": rng.uniform(-1, 1, size=(N, N)).astype(np.float32) for i in range(recipe.n_inputs)}
    if "cond" in extra_inputs:
        feeds["cond"] = rng.uniform(size=(N, N)) < 0.5
    if "ints" in extra_inputs:
        feeds["ints"] = rng.integers(-3, 4, size=(N, N)).astype(np.int64)
    return Built(model, has_special, feeds, identity_casts)


# -- properties ---------------------------------------------------------------------------------


def _cast_to(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "to")


def _representable(value: float, target: str) -> bool:
    with np.errstate(over="ignore"):
        low = np.float32(value).astype(np.float16 if target == "float16" else ml_dtypes.bfloat16)
    return bool(np.isfinite(low.astype(np.float32)) and (low != 0 or value == 0))


def assert_structure(built: Built, out: onnx.ModelProto, target: str, keep: bool, decisions: dict) -> None:
    original = built.model
    low = LOW_TYPES[target]
    # Full checker, and strict type inference: every edge's type matches the consumer's binding.
    check_full(out)
    types = value_types(out)
    producers = {o: n for n in iter_nodes(out) for o in n.output}
    graph_outputs = {o.name for o in out.graph.output}
    seen_casts: set[tuple[str, int]] = set()
    original_names = {n.name for n in iter_nodes(original)}

    for node in iter_nodes(out):
        float_in = [types[i] for i in node.input if i and types.get(i) in (FLOAT, FLOAT16, BFLOAT16)]
        float_out = [types[o] for o in node.output if types.get(o) in (FLOAT, FLOAT16, BFLOAT16)]
        # The converted model uses FP32 and the chosen 16-bit type only.
        other = {FLOAT16, BFLOAT16} - {low}
        assert not set(float_in + float_out) & other, (node.name, float_in, float_out)
        if node.op_type == "Cast":
            to = _cast_to(node)
            src = types[node.input[0]]
            if (
                node.name not in original_names
                and node.output[0] not in graph_outputs
            ):
                # The converter adds at most one Cast per (value, type) (graph outputs aside:
                # two outputs need two tensors even when they hold the same values).
                assert (node.input[0], to) not in seen_casts, f"second Cast of {node.input[0]} to {to}"
                seen_casts.add((node.input[0], to))
            if src == to:
                # Only a no-op Cast of the original model that names a graph output may remain.
                assert node.name in built.identity_casts and node.output[0] in graph_outputs, (
                    f"no-op Cast {node.name}: {src} -> {to}"
                )
            prev = producers.get(node.input[0])
            if prev is not None and prev.op_type == "Cast" and prev.name not in built.identity_casts:
                # A round trip A -> B -> A through two Casts never appears.
                assert types.get(prev.input[0]) != to, f"round-trip Casts {prev.name} -> {node.name}"
        if node.op_type in FP32_CLASS[target]:
            assert set(float_in + float_out) <= {FLOAT}, (node.name, float_in, float_out)
        # Nodes keep a consistent precision: what the plan says is what the model does.
        decision = decisions.get(node.name)
        if decision == "low" and node.op_type not in ("Cast", "Constant"):
            assert set(float_in + float_out) == {low}, (node.name, node.op_type, float_in, float_out)
        elif decision == "fp32" and node.op_type not in ("Cast", "Constant"):
            assert set(float_in + float_out) <= {FLOAT}, (node.name, node.op_type, float_in, float_out)
    # Constants the 16-bit type cannot hold stay FP32 and are never cast down; their
    # consumers compute in FP32. One that only flushes to zero is read in 16 bits only where it
    # is added (its flushed values are within the rounding of the 16-bit sum).
    original_inits = {i.name: numpy_helper.to_array(i) for i in original.graph.initializer}
    out_inits = initializer_types(out)
    for name, array in original_inits.items():
        if array.dtype != np.float32 or all(_representable(float(v), target) for v in array.reshape(-1)):
            continue
        with np.errstate(over="ignore"):
            overflows = not np.isfinite(array.astype(_LOW_NUMPY[target]).astype(np.float32)).all()
        readers = [n for n in iter_nodes(out) if name in n.input]
        if not overflows and all(
            op_facts("", n.op_type).adds(list(n.input).index(name)) for n in readers
        ):
            continue
        assert out_inits.get(name) == FLOAT, f"out-of-range constant {name} stored as {out_inits.get(name)}"
        for node in readers:
            assert node.op_type != "Cast", f"out-of-range constant {name} is cast by {node.name}"
            assert decisions.get(node.name) == "fp32", f"{node.name} reads {name} in 16 bits"
    # Model inputs and outputs: names kept; types kept with keep_io_types, else 16-bit floats.
    (orig_in, orig_out), (new_in, new_out) = io_types(original), io_types(out)
    if keep:
        assert (new_in, new_out) == (orig_in, orig_out)
    else:
        def lowered(pairs):
            return [(n, low if t == FLOAT else t) for n, t in pairs]
        assert (new_in, new_out) == (lowered(orig_in), lowered(orig_out))


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of `model` that also outputs the named tensors (those inference can type)."""
    probe = infer(copy.deepcopy(model))
    infos = {vi.name: vi for vi in probe.graph.value_info}
    existing = {o.name for o in probe.graph.output}
    for name in names:
        if name in infos and name not in existing:
            probe.graph.output.append(infos[name])
    return probe


def low_absmax(out: onnx.ModelProto, feeds: dict, target: str) -> float:
    """Largest |value| among the 16-bit tensors the converted model computes (inf if any is not
    finite): the scale of its rounding errors, and whether it overflowed."""
    low = LOW_TYPES[target]
    produced = {o for n in out.graph.node for o in n.output}
    names = [n for n, t in value_types(out).items() if t == low and n in produced]
    model = emulate_low_precision(out) if target == "bfloat16" else out
    extended = _with_outputs(model, names)
    values = run(extended, feeds)
    largest = 0.0
    for v in values:
        if v.dtype.kind == "f" and v.size:
            if not np.isfinite(v).all():
                return float("inf")
            largest = max(largest, float(np.abs(v).max()))
    return largest


def assert_numbers(
    original: onnx.ModelProto, out: onnx.ModelProto, feeds: dict, target: str, keep: bool
) -> bool:
    """Compare with the FP32 model; False when skipped (16-bit values out of a safe range)."""
    scale = low_absmax(out, feeds, target)
    if target == "float16" and not scale < 1e4:
        return False  # dynamic range beyond what float16 computes accurately: not the converter's
    if not np.isfinite(scale):
        return False
    if not keep:
        # 16-bit model inputs: the reference sees the same rounded data.
        feeds = {k: to_low(v, target) if v.dtype == np.float32 else v for k, v in feeds.items()}
    expected = run(original, feeds)
    if not keep:
        # 16-bit model outputs: the best they can hold is the rounded FP32 result.
        with np.errstate(over="ignore"):
            expected = [to_low(e, target) for e in expected]
    actual = run_low(out, feeds, target)
    assert len(actual) == len(expected)
    for name, a, e in zip([o.name for o in original.graph.output], actual, expected):
        assert a.shape == e.shape
        finite = np.isfinite(e)
        # No new non-finite values, and finite outputs within a tolerance that grows with the
        # magnitudes the 16-bit part of the graph handles (cancellation).
        assert np.isfinite(a[finite]).all(), f"output {name}: new non-finite values"
        a, e = a[finite].astype(np.float64), e[finite].astype(np.float64)
        if not e.size:
            continue
        if target == "float16":
            atol = 5e-2 * max(1.0, scale / 16)
            np.testing.assert_allclose(a, e, rtol=5e-2, atol=atol, err_msg=f"output {name}")
        else:
            bound = 1e-1 * max(float(np.abs(e).max()), scale / 8, 1e-3)
            err = float(np.abs(a - e).max())
            assert err <= bound, f"output {name}: max error {err} > {bound}"
    return True


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes())
@example(  # an identity Cast of a 16-bit input read by 16-bit and FP32 consumers: converted twice alike
    recipe=Recipe(
        n_inputs=1,
        steps=[
            Step(op="IdentityCast", a=0, b=0, const_operand=0, special=-1),
            Step(op="LayerNormalization", a=1, b=0, const_operand=0, special=-1),
            Step(op="Exp", a=2, b=0, const_operand=0, special=-1),
            Step(op="Relu", a=1, b=0, const_operand=0, special=-1),
        ],
        outputs=[0], seed=0, opset=17,
    ),
)
def test_random_graphs(recipe: Recipe) -> None:
    built = build(recipe)
    model, feeds = built.model, built.feeds
    for target in ("float16", "bfloat16"):
        for keep in (True, False):
            where = f"[{target}, keep_io_types={keep}]"
            result, out = convert(model, target_dtype=target, keep_io_types=keep)
            decisions = {n.name: d.precision.value for n, d in result.plan.decisions.items() if n.name}
            try:
                assert_structure(built, out, target, keep, decisions)
            except AssertionError as e:
                raise AssertionError(f"{where} {e}\n{onnx.printer.to_text(out)}") from e
            # The report counts what was done: Casts added (at run time, or of constants, folded
            # when the model loads) and no-op Casts removed.
            report = result.report
            n_casts = sum(1 for n in iter_nodes(out) if n.op_type == "Cast")
            n_original = sum(1 for n in iter_nodes(model) if n.op_type == "Cast")
            assert n_casts == n_original - report.casts_removed + report.casts_runtime + report.casts_folded, where
            if not built.has_special:
                categories = {n.name: d.category for n, d in result.plan.decisions.items() if n.name}
                for node in model.graph.node:
                    # A normalization (memory-bound) may stay FP32 where that saves casts.
                    placed = node.op_type == "LayerNormalization" and categories[node.name] is Category.CAST_COST
                    if node.op_type in ("MatMul", "LayerNormalization") and not placed:
                        assert decisions[node.name] == "low", f"{where} {node.name} not converted"
            # Converting the result again changes nothing.
            again_result, again = convert(out, target_dtype=target, keep_io_types=keep)
            assert all_node_sigs(again) == all_node_sigs(out), where
            assert [(n.op_type, list(n.input), list(n.output)) for n in again.graph.node] == [
                (n.op_type, list(n.input), list(n.output)) for n in out.graph.node
            ], where
            assert initializer_types(again) == initializer_types(out), where
            assert io_types(again) == io_types(out), where
            assert again_result.report.casts_inserted == 0, where
            try:
                assert_numbers(model, out, feeds, target, keep)
            except AssertionError as e:
                raise AssertionError(f"{where} {e}\n{onnx.printer.to_text(out)}") from e


@pytest.mark.parametrize("op", OPS)
def test_generator_covers_every_op(op: str) -> None:
    """Each generator op builds a valid model that converts (guards the generator itself)."""
    for const_operand in range(5):
        recipe = Recipe(2, [Step("MatMul", 0, 1, 1, -1), Step(op, 2, 1, const_operand, -1)], [1, 0], seed=1)
        built = build(recipe)
        for target in ("float16", "bfloat16"):
            result, out = convert(built.model, target_dtype=target)
            decisions = {n.name: d.precision.value for n, d in result.plan.decisions.items() if n.name}
            assert_structure(built, out, target, True, decisions)
            assert assert_numbers(built.model, out, built.feeds, target, True)


def test_a_cast_that_vanished_for_its_consumers_comes_back_when_the_placement_keeps_them_fp32() -> None:
    """A converted model with 16-bit inputs, converted again: its `Cast(x1 -> FP32)` first
    vanishes for its 16-bit consumers (the forward pass), then the cast placement keeps the
    LayerNormalization and Add after it FP32. The Cast then stays as it was (the upcast they
    need), so the second conversion gives the same model, names included."""
    steps = [
        Step("Relu", 0, 0, 0, -1), Step("Exp", 0, 0, 0, -1), Step("LayerNormalization", 3, 0, 0, -1),
        Step("Add", 1, 24, 0, -1), Step("Relu", 0, 0, 0, -1), Step("ReduceSum", 0, 54, 0, -1),
    ]
    built = build(Recipe(2, steps, [0], seed=0))
    _, out = convert(built.model, target_dtype="float16", keep_io_types=False)
    again_result, again = convert(out, target_dtype="float16", keep_io_types=False)
    cast = next(d for n, d in again_result.plan.decisions.items() if n.name == "x1_cast_fp32")
    assert cast.precision.value == "fp32" and "some consumers compute in FP32" in cast.reason
    assert [(n.op_type, list(n.input), list(n.output)) for n in again.graph.node] == [
        (n.op_type, list(n.input), list(n.output)) for n in out.graph.node
    ]
    assert again_result.report.casts_inserted == 0
