"""Recurrent ops in the emulation: a 16-bit RNN/GRU/LSTM rounds the hidden state it reads at
every time step, so the emulation runs them step by step (validate/recurrent.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import mixprec
from mixprec.graphs import model_names
from mixprec.validate.emulate import emulate_low_precision
from mixprec.validate.recurrent import low_recurrent_nodes, round_state_each_step, steps_by_itself

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
SEQ, BATCH, INPUT, HIDDEN = 7, 2, 3, 5


def recurrent_model(
    op: str,
    *,
    direction: str = "forward",
    layout: int = 0,
    opset: int = 14,
    initial: bool = True,
    peepholes: bool = False,
    dtype: int = TensorProto.FLOAT,
    seq: int = SEQ,
    scale: float = 0.5,
    seed: int = 0,
) -> onnx.ModelProto:
    """One recurrent node over graph input x (and initial states), its outputs all graph outputs."""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    gates = GATES[op]
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    weights = {
        "W": rng.uniform(-scale, scale, (dirs, gates * HIDDEN, INPUT)),
        "R": rng.uniform(-scale, scale, (dirs, gates * HIDDEN, HIDDEN)),
        "B": rng.uniform(-scale, scale, (dirs, 2 * gates * HIDDEN)),
    }
    if peepholes:
        weights["P"] = rng.uniform(-scale, scale, (dirs, 3 * HIDDEN))
    inits = [onnx.numpy_helper.from_array(v.astype(np_type), k) for k, v in weights.items()]
    x_shape = [seq, BATCH, INPUT] if layout == 0 else [BATCH, seq, INPUT]
    state_shape = [dirs, BATCH, HIDDEN] if layout == 0 else [BATCH, dirs, HIDDEN]
    inputs = [helper.make_tensor_value_info("x", dtype, x_shape)]
    names = ["x", "W", "R", "B", ""]
    states = ["h0", "c0"] if op == "LSTM" else ["h0"]
    if initial:
        names += states
        inputs += [helper.make_tensor_value_info(s, dtype, state_shape) for s in states]
    else:
        names += [""] * len(states)
    if peepholes:
        names.append("P")
    while names[-1] == "":
        names.pop()
    outputs = ["y", "y_h", "y_c"][: 1 + len(states)]
    attributes = {"hidden_size": HIDDEN, "direction": direction}
    if opset >= 14:
        attributes["layout"] = layout
    if op == "GRU":
        attributes["linear_before_reset"] = 1
    node = helper.make_node(op, names, outputs, name="cell", **attributes)
    y_shape = [seq, dirs, BATCH, HIDDEN] if layout == 0 else [BATCH, seq, dirs, HIDDEN]
    shapes = [y_shape, state_shape, state_shape]
    graph = helper.make_graph(
        [node], "g", inputs, [helper.make_tensor_value_info(o, dtype, s) for o, s in zip(outputs, shapes)], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def feeds_for(model: onnx.ModelProto, seed: int = 1, dtype: type = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.uniform(-1, 1, shape).astype(dtype)
    return feeds


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def unrolled_without_rounding(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its recurrent node run step by step, the state 'rounded' through FLOAT
    (no rounding at all): the same function as the node."""
    ir_model = ir.serde.deserialize_model(model)
    values, nodes = model_names(ir_model)
    node = next(iter(ir_model.graph))
    opset = ir_model.opset_imports[""]
    assert steps_by_itself(node, opset)
    round_state_each_step(ir_model.graph, node, ir.DataType.FLOAT, opset, values, nodes)
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return proto


CASES = [
    pytest.param(op, direction, layout, opset, initial, id=f"{op}-{direction}-layout{layout}-opset{opset}-{'h0' if initial else 'zeros'}")
    for op in ("RNN", "GRU", "LSTM")
    for direction, layout, opset, initial in (
        ("forward", 0, 14, True),
        ("reverse", 0, 13, False),
        ("bidirectional", 0, 9, True),
        ("bidirectional", 1, 14, False),
        ("reverse", 1, 22, True),
        ("forward", 0, 11, False),
    )
]


@pytest.mark.parametrize(("op", "direction", "layout", "opset", "initial"), CASES)
def test_step_by_step_copy_computes_what_the_node_computes(op, direction, layout, opset, initial):
    model = recurrent_model(op, direction=direction, layout=layout, opset=opset, initial=initial)
    feeds = feeds_for(model)
    if layout == 0:
        expected = run(model, feeds)
    else:  # onnxruntime runs layout 0 only: the same node on transposed values
        seq_first = recurrent_model(op, direction=direction, layout=0, opset=opset, initial=initial)
        y, *states = run(seq_first, {k: v.transpose(1, 0, 2) for k, v in feeds.items()})
        expected = [y.transpose(2, 0, 1, 3), *(state.transpose(1, 0, 2) for state in states)]
    unrolled = unrolled_without_rounding(model)
    assert op not in {n.op_type for n in unrolled.graph.node}, "the node is replaced by Scans"
    for got, want in zip(run(unrolled, feeds), expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("op", "activations", "alpha", "beta"),
    [
        ("GRU", ["HardSigmoid", "ScaledTanh", "LeakyRelu", "Tanh"], [0.3, 1.5, 0.1], [0.5, 0.7]),
        ("RNN", ["LeakyRelu", "Tanh"], [0.3], None),
        ("LSTM", ["Sigmoid", "Tanh", "Tanh", "HardSigmoid", "Affine", "Tanh"], [0.2, 0.9], [0.5, 0.1]),
    ],
)
def test_each_direction_takes_the_alpha_and_beta_of_its_own_activations(op, activations, alpha, beta):
    """The lists are consumed in the order of the functions, only by those taking a value."""
    model = recurrent_model(op, direction="bidirectional")
    node = model.graph.node[0]
    node.attribute.append(helper.make_attribute("activations", activations))
    node.attribute.append(helper.make_attribute("activation_alpha", alpha))
    if beta is not None:
        node.attribute.append(helper.make_attribute("activation_beta", beta))
    feeds = feeds_for(model)
    for got, want in zip(run(unrolled_without_rounding(model), feeds), run(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_activations_not_given_per_direction_keep_the_node():
    model = recurrent_model("GRU", direction="bidirectional")
    model.graph.node[0].attribute.append(helper.make_attribute("activations", ["Sigmoid", "Tanh"]))
    assert not steps_by_itself(ir.serde.deserialize_model(model).graph.node(0), 14)


def test_lstm_peepholes_and_activations_of_both_directions_carry_over():
    model = recurrent_model("LSTM", direction="bidirectional", peepholes=True)
    node = model.graph.node[0]
    node.attribute.append(helper.make_attribute("activations", ["Sigmoid", "Tanh", "Tanh", "HardSigmoid", "Tanh", "Relu"]))
    node.attribute.append(helper.make_attribute("clip", 2.0))
    feeds = feeds_for(model)
    for got, want in zip(run(unrolled_without_rounding(model), feeds), run(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def integrating(model: onnx.ModelProto, bias: float = 3.0) -> onnx.ModelProto:
    """The GRU with its update gate biased open: a leaky integrator whose state takes small
    steps each time step, as a recurrent model holding context does (rounding compounds)."""
    b = next(init for init in model.graph.initializer if init.name == "B")
    values = onnx.numpy_helper.to_array(b).copy()
    values[:, :HIDDEN] = bias
    b.CopyFrom(onnx.numpy_helper.from_array(values, "B"))
    return model


def step_rounded_reference(model16: onnx.ModelProto, feeds: dict[str, np.ndarray], reverse: bool = False) -> list[np.ndarray]:
    """The final states of a float16 one-direction recurrent node computed one step at a time in
    FP32, rounding the hidden state (not an LSTM's cell state) to float16 between steps (what a
    16-bit kernel's recurrent matrix product reads)."""
    fp32 = onnx.ModelProto()
    fp32.CopyFrom(model16)
    for init in fp32.graph.initializer:
        init.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init).astype(np.float32), init.name))
    for value in [*fp32.graph.input, *fp32.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.FLOAT
        value.type.tensor_type.ClearField("shape")
    for attr in fp32.graph.node[0].attribute:
        if attr.name == "direction":
            attr.s = b"forward"  # one step each: the order of the steps is ours
    step = ort.InferenceSession(fp32.SerializeToString(), providers=["CPUExecutionProvider"])
    states = {k: v.astype(np.float32) for k, v in feeds.items() if k != "x"}
    steps = range(feeds["x"].shape[0])
    for t in reversed(steps) if reverse else steps:
        _, *finals = step.run(None, {"x": feeds["x"][t : t + 1].astype(np.float32), **states})
        states["h0"] = finals[0].astype(np.float16).astype(np.float32)
        if len(finals) > 1:
            states["c0"] = finals[1]
    return [states["h0"], *([states["c0"]] if "c0" in states else [])]


@pytest.mark.parametrize(("op", "direction"), [("LSTM", "forward"), ("GRU", "reverse")])
def test_each_step_reads_a_rounded_hidden_state(op, direction):
    model16 = recurrent_model(op, direction=direction, dtype=TensorProto.FLOAT16, seq=40, scale=1.0)
    feeds = feeds_for(model16, dtype=np.float16)
    y, *finals = run(emulate_low_precision(model16), {k: v.astype(np.float32) for k, v in feeds.items()})
    want = step_rounded_reference(model16, feeds, reverse=direction == "reverse")
    np.testing.assert_allclose(finals[0], want[0], rtol=0, atol=1e-6)
    if op == "LSTM":  # the cell state: FP32 between steps, rounded once as the output
        np.testing.assert_allclose(finals[1], want[1].astype(np.float16).astype(np.float32), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(y[0 if direction == "reverse" else -1], finals[0])


def test_a_node_whose_y_is_omitted_still_runs_step_by_step():
    model16 = recurrent_model("GRU", dtype=TensorProto.FLOAT16)
    node = model16.graph.node[0]
    node.output[0] = ""
    del model16.graph.output[0]
    emulated = emulate_low_precision(model16)
    assert "Scan" in {n.op_type for n in emulated.graph.node}
    assert low_recurrent_nodes(ir.serde.deserialize_model(model16)) == ["cell"]


def test_a_node_with_sequence_lengths_is_emulated_as_it_is():
    model16 = recurrent_model("GRU", dtype=TensorProto.FLOAT16)
    model16.graph.input.append(helper.make_tensor_value_info("lens", TensorProto.INT32, [BATCH]))
    model16.graph.node[0].input[4] = "lens"
    emulated = emulate_low_precision(model16)
    assert [n.op_type for n in emulated.graph.node].count("GRU") == 1
    assert "Scan" not in {n.op_type for n in emulated.graph.node}
    assert low_recurrent_nodes(ir.serde.deserialize_model(model16)) == []


def test_the_emulated_16_bit_gru_rounds_its_state_at_every_step():
    model16 = integrating(recurrent_model("GRU", dtype=TensorProto.FLOAT16, seq=200, scale=1.0))
    feeds = feeds_for(model16, dtype=np.float16)
    emulated = emulate_low_precision(model16)
    onnx.checker.check_model(emulated, full_check=True)
    y, y_h = run(emulated, {k: v.astype(np.float32) for k, v in feeds.items()})
    want = step_rounded_reference(model16, feeds)[0]
    np.testing.assert_allclose(y_h, want, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(y[-1], y_h)
    # Rounding the outputs only (the FP32 recurrence) ends elsewhere: the state's rounding compounds.
    fp32 = integrating(recurrent_model("GRU", dtype=TensorProto.FLOAT, seq=200, scale=1.0))
    fp32_state = run(fp32, {k: v.astype(np.float32) for k, v in feeds.items()})[1]
    ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float32)
    assert (np.abs(fp32_state - want) / ulp).max() > 4, "the state's rounding compounds over the steps"


def test_a_node_with_sequence_lengths_or_an_old_scan_stays_as_it_is():
    model = recurrent_model("GRU")
    node = ir.serde.deserialize_model(model).graph.node(0)
    assert steps_by_itself(node, 14)
    assert not steps_by_itself(node, 8), "Scan-8 has a batch axis"
    lens = ir.Value(name="lens", type=ir.TensorType(ir.DataType.INT32))
    node.replace_input_with(4, lens)
    assert not steps_by_itself(node, 14)


def test_a_gru_model_notes_that_its_state_rounding_compounds(tmp_path):
    """A bfloat16 GRU integrating a steady input over 400 steps: its small updates are lost to
    the state's rounding, the emulated error is the compounded one, and the report says where
    it comes from."""
    model = integrating(recurrent_model("GRU", initial=False, seq=400, scale=1.0, seed=3), bias=4.0)
    steady = 0.8 + 0.02 * np.random.default_rng(4).standard_normal((400, BATCH, INPUT))
    data = tmp_path / "data.npz"
    np.savez(data, x=steady.astype(np.float32))
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="bfloat16", runtime="onnx", data=str(data))
    validation = result.report.validation
    error = next(o for o in validation.outputs if o.name == "y_h").scaled_error
    assert error > 0.05, validation.outputs  # one rounding of the output alone: at most 2**-9
    assert any("cell rounds its hidden state to bfloat16 at every time step" in note for note in validation.notes), (
        validation.notes
    )


@pytest.mark.parametrize("layout", [0, 1])
def test_recurrent_flops_count_every_gate_step_and_direction(layout):
    """2 x (seq x batch) x (W + R) elements: both directions' input and recurrent products."""
    from mixprec.analysis.cost_model import flops_of

    model = ir.serde.deserialize_model(recurrent_model("LSTM", direction="bidirectional", layout=layout))
    node = model.graph.node(0)
    dirs, gates = 2, GATES["LSTM"]
    expected = 2.0 * SEQ * BATCH * (dirs * gates * HIDDEN * INPUT + dirs * gates * HIDDEN * HIDDEN)
    assert flops_of(node) == expected


def test_the_note_names_recurrent_nodes_only_for_an_output_computed_from_them(tmp_path):
    """A large error on an output that no recurrent node feeds (a cancellation after a MatMul)
    is not put down to the GRU beside it."""
    model = recurrent_model("GRU", initial=False, seq=3)
    rng = np.random.default_rng(5)
    model.graph.initializer.extend([
        onnx.numpy_helper.from_array(rng.standard_normal((INPUT, 4)).astype(np.float32), "wz"),
        onnx.numpy_helper.from_array(np.array(1000.0, np.float32), "big"),
    ])
    model.graph.node.extend([
        helper.make_node("MatMul", ["x", "wz"], ["m"]),
        helper.make_node("Add", ["m", "big"], ["shifted"]),
        helper.make_node("Sub", ["shifted", "big"], ["z"]),
    ])
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, BATCH, 4]))
    data = tmp_path / "data.npz"
    np.savez(data, x=feeds_for(model)["x"])
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="bfloat16", runtime="onnx", data=str(data))
    notes = [note for note in result.report.validation.notes if "differs from the FP32 model" in note]
    assert notes and "'z'" in notes[0], result.report.validation.notes
    assert "hidden state" not in notes[0]
