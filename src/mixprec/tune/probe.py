"""The probe model: beside each candidate, a 16-bit emulated duplicate and its own error."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from mixprec.dtypes import LowPrecision
from mixprec.graphs import FreshNames, default_domain_version, is_default_domain, model_names, node_keys, subgraphs_of
from mixprec.policy.opfacts import op_facts
from mixprec.tune.candidates import Candidate

_FLOAT = ir.DataType.FLOAT
_PREFIX = "mixprec_probe"


class ProbeBuilder:
    """Adds to an FP32 model, beside each candidate, a 16-bit emulated duplicate and its error."""

    def __init__(self, model: ir.Model, target: LowPrecision, candidates: Sequence[Candidate]) -> None:
        self.model = model
        self.low = target.ir_dtype
        by_name = {name: node for node, name in node_keys(model).items()}
        self.specs: dict[ir.Node, Candidate] = {}
        for candidate in candidates:
            node = by_name.get(candidate.name)
            if node is not None and node.op_type == candidate.op_type:
                self.specs[node] = candidate
        version = default_domain_version(model.opset_imports)
        opset = 1 if version is None else version
        # Equal on floats (opset 11) masks equal infinities and reference NaNs.
        self.masked = opset >= 11
        values, nodes = model_names(model)
        self.fresh = FreshNames(values.taken | nodes.taken)  # one namespace for the probe's nodes and values
        self.rounded: dict[tuple[int, ir.Value], ir.Value] = {}
        self.zero = self._constant("zero", 0.0)
        self.inf = self._constant("inf", math.inf)
        self.tiny = self._constant("tiny", 1e-30)

    def build(self) -> dict[str, str]:
        """Add the probes; return error output name -> candidate name."""
        results = self._graph(self.model.graph)
        outputs: dict[str, str] = {}
        for name, value in results:
            self.model.graph.outputs.append(value)
            outputs[value.name] = name  # type: ignore[index]
        return outputs

    # -- helpers
    def _name(self, base: str) -> str:
        return self.fresh(f"{_PREFIX}/{base}")

    def _constant(self, base: str, number: float) -> ir.Value:
        value = ir.Value(
            name=self._name(base),
            type=ir.TensorType(_FLOAT),
            shape=ir.Shape([]),
            const_value=ir.Tensor(np.array(number, dtype=np.float32)),
        )
        value.const_value.name = value.name  # type: ignore[union-attr]
        self.model.graph.register_initializer(value)
        return value

    def _op(self, nodes: list[ir.Node], op_type: str, inputs: Sequence[ir.Value], **attrs: Any) -> ir.Value:
        node = ir.node(op_type, list(inputs), attrs or None, name=self._name(op_type))
        node.outputs[0].name = self._name(op_type.lower())
        nodes.append(node)
        return node.outputs[0]

    def _scalar(self, value: ir.Value) -> ir.Value:
        value.type = ir.TensorType(_FLOAT)
        value.shape = ir.Shape([])
        return value

    def _round(self, graph: ir.Graph, nodes: list[ir.Node], value: ir.Value) -> ir.Value:
        key = (id(graph), value)
        cached = self.rounded.get(key)
        if cached is None:
            low = self._op(nodes, "Cast", [value], to=int(self.low))
            cached = self._op(nodes, "Cast", [low], to=int(_FLOAT))
            self.rounded[key] = cached
        return cached

    # -- errors
    def _float_error(self, nodes: list[ir.Node], cand: ir.Value, ref: ir.Value) -> ir.Value:
        diff = self._op(nodes, "Abs", [self._op(nodes, "Sub", [cand, ref])])
        magnitude = self._op(nodes, "Abs", [ref])
        if self.masked:
            same = self._op(
                nodes, "Or", [self._op(nodes, "Equal", [cand, ref]), self._op(nodes, "IsNaN", [ref])]
            )
            diff = self._op(nodes, "Where", [same, self.zero, diff])
            diff = self._op(nodes, "Where", [self._op(nodes, "IsNaN", [diff]), self.inf, diff])
            bad = self._op(
                nodes, "Or", [self._op(nodes, "IsNaN", [magnitude]), self._op(nodes, "IsInf", [magnitude])]
            )
            magnitude = self._op(nodes, "Where", [bad, self.zero, magnitude])
        num = self._op(nodes, "Max", [self._op(nodes, "ReduceMax", [diff], keepdims=0), self.zero])
        den = self._op(nodes, "Max", [self._op(nodes, "ReduceMax", [magnitude], keepdims=0), self.zero])
        return self._op(nodes, "Div", [num, self._op(nodes, "Add", [den, self.tiny])])

    def _exact_error(self, nodes: list[ir.Node], cand: ir.Value, ref: ir.Value) -> ir.Value:
        differ = self._op(nodes, "Not", [self._op(nodes, "Equal", [cand, ref])])
        flags = self._op(nodes, "Cast", [differ], to=int(_FLOAT))
        return self._op(nodes, "Max", [self._op(nodes, "ReduceMax", [flags], keepdims=0), self.zero])

    def _node(self, graph: ir.Graph, node: ir.Node, spec: Candidate) -> ir.Value | None:
        """Probe `node`: its 16-bit duplicate and the largest error of the outputs `spec`
        names, inserted after it; None when nothing is measured."""
        if not spec.outputs:
            return None
        nodes: list[ir.Node] = []
        outputs = self._candidate_outputs(graph, nodes, node, spec)
        errors = []
        for i, kind in spec.outputs:
            error = self._output_error(graph, nodes, kind, outputs[i], node.outputs[i])
            if error is not None:
                errors.append(error)
        if not errors:
            return None
        error = errors[0] if len(errors) == 1 else self._op(nodes, "Max", errors)
        graph.insert_after(node, nodes)
        return self._scalar(error)

    def _candidate_outputs(
        self, graph: ir.Graph, nodes: list[ir.Node], node: ir.Node, spec: Candidate
    ) -> dict[int, ir.Value]:
        """The probed outputs of `node` computed as in 16 bits: its duplicate's, or for a random
        op (a duplicate would draw other random numbers) its own, whose rounding alone is
        measured."""
        if op_facts(node.domain, node.op_type).random:
            return {i: node.outputs[i] for i, _ in spec.outputs}
        duplicate = self._duplicate(graph, nodes, node, spec)
        return {i: duplicate.outputs[i] for i, _ in spec.outputs}

    def _duplicate(
        self, graph: ir.Graph, nodes: list[ir.Node], node: ir.Node, spec: Candidate
    ) -> ir.Node:
        """A copy of `node` whose lowered inputs are rounded to 16 bits, added to `nodes`."""
        inputs = [
            self._round(graph, nodes, v) if v is not None and i in spec.lowered_inputs else v
            for i, v in enumerate(node.inputs)
        ]
        attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
        duplicate = ir.Node(
            node.domain, node.op_type, inputs, attributes, overload=node.overload,
            num_outputs=len(node.outputs), version=node.version, name=self._name(node.op_type),
        )
        for out in duplicate.outputs:
            out.name = self._name("dup")
        nodes.append(duplicate)
        return duplicate

    def _output_error(
        self, graph: ir.Graph, nodes: list[ir.Node], kind: str, cand: ir.Value, ref: ir.Value
    ) -> ir.Value | None:
        """The error of output `cand` against the reference `ref` by its `kind`: "exact" (any
        difference; None where unmasked comparison is not possible), "round" (rounded to 16 bits
        first) or "float"."""
        if kind == "exact":
            return self._exact_error(nodes, cand, ref) if self.masked else None
        if kind == "round":
            cand = self._round(graph, nodes, cand)
        return self._float_error(nodes, cand, ref)

    # -- graphs
    def _graph(self, graph: ir.Graph) -> list[tuple[str, ir.Value]]:
        results: list[tuple[str, ir.Value]] = []
        for node in list(graph):
            if node.attributes and subgraphs_of(node):
                results.extend(self._control_flow(graph, node))
                continue
            spec = self.specs.get(node)
            if spec is not None:
                error = self._node(graph, node, spec)
                if error is not None:
                    results.append((spec.name, error))
        return results

    def _control_flow(self, graph: ir.Graph, node: ir.Node) -> list[tuple[str, ir.Value]]:
        """Probe the subgraphs of an If, Loop or Scan `node` and carry their errors out of it
        as extra outputs (none for other ops or domains)."""
        if not is_default_domain(node.domain):
            return []
        handler = {"If": self._if, "Loop": self._loop, "Scan": self._loop}.get(node.op_type)
        return [] if handler is None else handler(graph, node)

    def _if(self, graph: ir.Graph, node: ir.Node) -> list[tuple[str, ir.Value]]:
        """Probe both branches of If `node`; each branch outputs every probed node's error (0
        for the other branch's nodes)."""
        branches = [node.attributes["then_branch"].as_graph(), node.attributes["else_branch"].as_graph()]
        found = [self._graph(branch) for branch in branches]
        names = list(dict.fromkeys(name for result in found for name, _ in result))
        if not names:
            return []
        for branch, result in zip(branches, found):
            self._branch_outputs(branch, dict(result), names)
        return self._add_outputs(graph, node, names, reduce=False)

    def _branch_outputs(
        self, branch: ir.Graph, have: dict[str, ir.Value], names: Sequence[str]
    ) -> None:
        """Append to `branch`'s outputs the error of each of `names`: the one it `have`s, else
        a zero."""
        for name in names:
            value = have.get(name)
            if value is None:
                nodes: list[ir.Node] = []
                value = self._scalar(self._op(nodes, "Identity", [self.zero]))
                branch.extend(nodes)
            branch.outputs.append(value)

    def _loop(self, graph: ir.Graph, node: ir.Node) -> list[tuple[str, ir.Value]]:
        """Probe the body of Loop or Scan `node`; its per-iteration errors become scan outputs,
        reduced to their largest."""
        body = node.attributes["body"].as_graph()
        result = self._graph(body)
        if not result:
            return []
        for _, value in result:
            body.outputs.append(value)
        if node.op_type == "Scan":
            _extend_scan_attributes(node, len(result))
        return self._add_outputs(graph, node, [name for name, _ in result], reduce=True)

    def _add_outputs(
        self, graph: ir.Graph, node: ir.Node, names: Sequence[str], *, reduce: bool
    ) -> list[tuple[str, ir.Value]]:
        first = len(node.outputs)
        node.resize_outputs(first + len(names))
        nodes: list[ir.Node] = []
        results = []
        for offset, name in enumerate(names):
            out = node.outputs[first + offset]
            out.name = self._name("cf_error")
            out.type = ir.TensorType(_FLOAT)
            if reduce:
                # Per-iteration errors: the largest (0 when the loop ran no iteration).
                out = self._op(nodes, "Max", [self._op(nodes, "ReduceMax", [out], keepdims=0), self.zero])
                results.append((name, self._scalar(out)))
            else:
                out.shape = ir.Shape([])
                results.append((name, out))
        if nodes:
            graph.insert_after(node, nodes)
        return results


def _extend_scan_attributes(node: ir.Node, added: int) -> None:
    """Give Scan `node`'s per-output attributes (axes, directions) a default 0 for each of the
    `added` scan outputs."""
    for key in ("scan_output_axes", "scan_output_directions"):
        attr = node.attributes.get(key)
        if attr is not None:
            node.attributes[key] = ir.AttrInt64s(key, [*attr.as_ints(), *([0] * added)])
