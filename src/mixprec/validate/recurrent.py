"""Recurrent ops (RNN, GRU, LSTM) in the emulation, step by step.

A 16-bit recurrent kernel multiplies the hidden state by its recurrent weights in 16 bits at
every time step, so the state it reads is rounded to the 16-bit type each step, and the
rounding compounds over the sequence. Rounding only the op's outputs, as the emulation does
for other ops, misses that: a 16-bit GRU over a few hundred steps is measured an order of
magnitude closer to FP32 than a runtime computes it.

:func:`round_state_each_step` replaces such a node (its values already FLOAT, as the emulation
makes them) by one ``Scan`` per direction over one-step copies of the op, rounding the hidden
state through the 16-bit type after each step. The cell state of an LSTM is elementwise FP32
arithmetic a kernel may keep in FP32 between steps; it is not rounded. Nodes with
``sequence_lens`` (per-batch lengths a step-wise copy cannot honour simply), with activation
functions not given per direction, or at an opset before today's Scan (9) keep output rounding
only. A zero-length sequence fails in the Scan (onnxruntime's CPU GRU fails on one too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from mixprec.graphs import default_domain_version, subgraphs_of, walk_nodes

__all__ = ["RECURRENT_OPS", "low_recurrent_nodes", "round_state_each_step", "steps_by_itself"]

# Op -> activation functions per direction (f; f, g; f, g, h).
RECURRENT_OPS: dict[str, int] = {"RNN": 1, "GRU": 2, "LSTM": 3}
# Activation functions that take an `activation_alpha` / `activation_beta` value (the lists are
# consumed in the order of the functions, each taking its own).
_TAKE_ALPHA = frozenset({"affine", "leakyrelu", "thresholdedrelu", "scaledtanh", "hardsigmoid", "elu"})
_TAKE_BETA = frozenset({"affine", "scaledtanh", "hardsigmoid"})
# Input positions: W, R, B; sequence_lens; initial_h, initial_c and P (LSTM).
_WEIGHTS, _SEQUENCE_LENS, _INITIAL_H, _INITIAL_C, _PEEPHOLES = (1, 2, 3), 4, 5, 6, 7
_FLOAT = ir.DataType.FLOAT
_LOW = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
# Scan's form without a batch axis.
_FIRST_SCAN_OPSET = 9

Fresh = Callable[[str], str]


def low_recurrent_nodes(model: ir.Model | None, output: str | None = None) -> list[str]:
    """Names (op types where unnamed) of the 16-bit recurrent nodes of `model` that the
    emulation runs step by step: those the graph output called `output` is computed from
    (None: all, in every graph); none when the model is not in memory."""
    if model is None:
        return []
    opset = default_domain_version(model.opset_imports)
    nodes = _upstream(model.graph, output) if output is not None else [n for g in model.graphs() for n in g]
    return [
        node.name or node.op_type
        for node in nodes
        if steps_by_itself(node, opset) and node.inputs[0] is not None and node.inputs[0].dtype in _LOW
    ]


def _upstream(graph: ir.Graph, output: str) -> list[ir.Node]:
    """The main-graph nodes the graph output `output` is computed from, with every node of
    their subgraphs."""
    start = next((v for v in graph.outputs if v.name == output), None)
    found: dict[ir.Node, None] = {}
    pending = [start] if start is not None else []
    while pending:
        producer = pending.pop().producer()
        if producer is None or producer in found:
            continue
        found[producer] = None
        pending.extend(v for v in producer.inputs if v is not None)
        for sub in subgraphs_of(producer):
            found.update(dict.fromkeys(walk_nodes(sub)))
            pending.extend(v for n in walk_nodes(sub) for v in n.inputs if v is not None and v.graph is not sub)
    return list(found)


def steps_by_itself(node: ir.Node, opset: int | None) -> bool:
    """Whether the node can be emulated step by step: a default-domain recurrent op without
    `sequence_lens`, of a known hidden size and direction, at an opset with today's Scan."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in RECURRENT_OPS:
        return False
    if opset is None or opset < _FIRST_SCAN_OPSET:
        return False
    inputs = node.inputs
    if len(inputs) > _SEQUENCE_LENS and inputs[_SEQUENCE_LENS] is not None:
        return False
    direction = node.attributes.get_string("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional") or node.attributes.get_int("hidden_size", 0) <= 0:
        return False
    activations = node.attributes.get_strings("activations", None)
    directions = 2 if direction == "bidirectional" else 1
    return activations is None or len(activations) == directions * RECURRENT_OPS[node.op_type]


def round_state_each_step(
    graph: ir.Graph, node: ir.Node, low: ir.DataType, opset: int, value_name: Fresh, node_name: Fresh
) -> None:
    """Replace `node` (see :func:`steps_by_itself`) by a Scan per direction whose one-step
    copies read a hidden state rounded through `low`; the node's outputs' readers read the
    Scans' results (the outputs keep their FLOAT types)."""
    builder = _Builder(node, opset, value_name, node_name)
    direction = node.attributes.get_string("direction", "forward")
    directions = ("forward", "reverse") if direction == "bidirectional" else (direction,)
    layout = node.attributes.get_int("layout", 0)
    x = node.inputs[0]
    if layout == 1:  # [batch, seq, input] -> [seq, batch, input]
        x = builder.op("Transpose", [x], perm=[1, 0, 2])
    initial = [builder.input(index) for index in (_INITIAL_H, _INITIAL_C)]
    if layout == 1:  # [batch, dirs, hidden] -> [dirs, batch, hidden]
        initial = [None if v is None else builder.op("Transpose", [v], perm=[1, 0, 2]) for v in initial]
    is_lstm = node.op_type == "LSTM"
    states = 2 if is_lstm else 1
    per_direction = []
    for index, way in enumerate(directions):
        weights = [builder.direction_slice(builder.input(i), index, len(directions)) for i in _WEIGHTS]
        peepholes = builder.direction_slice(builder.input(_PEEPHOLES), index, len(directions)) if is_lstm else None
        starts = [
            builder.direction_slice(value, index, len(directions)) if value is not None else builder.zero_state(x)
            for value in initial[:states]
        ]
        per_direction.append(
            builder.scan(x, weights, peepholes, starts, way, index, len(directions), low)
        )
    # Scan results per direction: final h, (final c), stacked h [seq, 1, batch, hidden].
    y = per_direction[0][-1] if len(per_direction) == 1 else builder.op("Concat", [d[-1] for d in per_direction], axis=1)
    finals = [
        per_direction[0][k] if len(per_direction) == 1 else builder.op("Concat", [d[k] for d in per_direction], axis=0)
        for k in range(states)
    ]
    if layout == 1:
        y = builder.op("Transpose", [y], perm=[2, 0, 1, 3])
        finals = [builder.op("Transpose", [v], perm=[1, 0, 2]) for v in finals]
    for old, new in zip(node.outputs, [y, *finals]):
        if old.name:
            new.type, new.shape = old.type, old.shape
            old.replace_all_uses_with(new, replace_graph_outputs=True)
    graph.insert_before(node, builder.nodes)
    graph.remove(node, safe=True)


class _Builder:
    """Nodes replacing one recurrent node, collected in order."""

    def __init__(self, node: ir.Node, opset: int, value_name: Fresh, node_name: Fresh) -> None:
        self.node, self.opset = node, opset
        self.value_name, self.node_name = value_name, node_name
        self.base = node.name or node.op_type
        self.hidden = node.attributes.get_int("hidden_size", 0)
        self.nodes: list[ir.Node] = []

    def input(self, index: int) -> ir.Value | None:
        inputs = self.node.inputs
        return inputs[index] if index < len(inputs) else None

    def make(self, op: str, inputs: Sequence[ir.Value | None], outputs: int = 1, **attributes: object) -> ir.Node:
        created = ir.Node(
            "", op, inputs,
            [v if isinstance(v, ir.Attr) else ir.convenience.convert_attribute(k, v) for k, v in attributes.items()],
            num_outputs=outputs, name=self.node_name(f"{self.base}_step_{op}"),
        )
        for out in created.outputs:
            out.name = self.value_name(f"{self.base}_step_{op}")
        return created

    def op(self, op: str, inputs: Sequence[ir.Value | None], **attributes: object) -> ir.Value:
        created = self.make(op, inputs, **attributes)
        self.nodes.append(created)
        return created.outputs[0]

    def constant(self, values: Sequence[int]) -> ir.Value:
        return self.op("Constant", [], value=ir.tensor(np.asarray(values, dtype=np.int64)))

    def slice(self, value: ir.Value, start: int, axis: int = 0) -> ir.Value:
        """`value[start:start + 1]` along `axis` (Slice's attribute form before opset 10)."""
        if self.opset < 10:
            return self.op("Slice", [value], starts=[start], ends=[start + 1], axes=[axis])
        return self.op("Slice", [value, self.constant([start]), self.constant([start + 1]), self.constant([axis])])

    def direction_slice(self, value: ir.Value | None, index: int, count: int) -> ir.Value | None:
        """The direction `index` of a [dirs, ...] value (as is when there is one direction)."""
        if value is None or count == 1:
            return value
        return self.slice(value, index)

    def zero_state(self, x: ir.Value) -> ir.Value:
        """Zeros of [1, batch, hidden], the batch read from `x` [seq, batch, input]."""
        batch = self.slice(self.op("Shape", [x]), 1)
        shape = self.op("Concat", [self.constant([1]), batch, self.constant([self.hidden])], axis=0)
        return self.op("ConstantOfShape", [shape], value=ir.tensor(np.zeros(1, np.float32)))

    def scan(
        self,
        x: ir.Value,
        weights: list[ir.Value | None],
        peepholes: ir.Value | None,
        starts: list[ir.Value],
        direction: str,
        index: int,
        count: int,
        low: ir.DataType,
    ) -> list[ir.Value]:
        """One Scan over the sequence `x` [seq, batch, input]: its final states and the
        stacked hidden states [seq, 1, batch, hidden]."""
        states = [ir.Value(name=self.value_name(f"{self.base}_step_state"), type=ir.TensorType(_FLOAT)) for _ in starts]
        x_t = ir.Value(name=self.value_name(f"{self.base}_step_x"), type=ir.TensorType(_FLOAT))
        body: list[ir.Node] = []

        def add(op: str, inputs: Sequence[ir.Value | None], outputs: int = 1, **attributes: object) -> list[ir.Value]:
            created = self.make(op, inputs, outputs, **attributes)
            body.append(created)
            return list(created.outputs)

        if self.opset < 13:
            x_1 = add("Unsqueeze", [x_t], axes=[0])[0]
        else:
            x_1 = add("Unsqueeze", [x_t, add("Constant", [], value=ir.tensor(np.asarray([0], dtype=np.int64)))[0]])[0]
        step_inputs = [x_1, *weights, None, states[0]]
        if len(starts) == 2:
            step_inputs += [states[1], peepholes]
        while step_inputs and step_inputs[-1] is None:
            step_inputs.pop()
        outputs = add(self.node.op_type, step_inputs, 1 + len(starts), **self._step_attributes(index, count))
        final_h = outputs[1]
        rounded = add("Cast", [add("Cast", [final_h], to=low)[0]], to=_FLOAT)[0]
        finals = [rounded, *outputs[2:]]
        stacked = add("Identity", [rounded])[0]
        for value in (*finals, stacked):
            value.type = ir.TensorType(_FLOAT)
        graph = ir.Graph([*states, x_t], [*finals, stacked], nodes=body, name=self.node_name(f"{self.base}_step"))
        reverse = [1 if direction == "reverse" else 0]
        scan = self.make(
            "Scan", [*starts, x], len(starts) + 1, body=graph, num_scan_inputs=1,
            scan_input_directions=reverse, scan_output_directions=reverse,
        )
        self.nodes.append(scan)
        return list(scan.outputs)

    def _step_attributes(self, index: int, count: int) -> dict[str, object]:
        """The node's attributes for one forward step of direction `index` of `count`: its own
        activation functions, with the alpha and beta values those functions take."""
        attributes = self.node.attributes
        kept: dict[str, object] = {
            name: ir.Attr(name, attr.type, attr.value) for name, attr in attributes.items()
            if name not in ("direction", "layout", "activations", "activation_alpha", "activation_beta")
        }
        activations = attributes.get_strings("activations", None)
        if activations is None:
            return kept
        per_direction = len(activations) // count
        before, mine = activations[: index * per_direction], activations[index * per_direction : (index + 1) * per_direction]
        kept["activations"] = ir.AttrStrings("activations", list(mine))
        for name, takers in (("activation_alpha", _TAKE_ALPHA), ("activation_beta", _TAKE_BETA)):
            values = attributes.get_floats(name, None)
            if values is None:
                continue
            start = sum(f.lower() in takers for f in before)
            taken = list(values)[start : start + sum(f.lower() in takers for f in mine)]
            if taken:
                kept[name] = ir.AttrFloat32s(name, taken)
        return kept
