"""A value read by very many nodes (attention masks and position ids feed every layer; a hostile
graph feeds 100,000): planning and rewriting visit each reader a bounded number of times, counted
through `ir.Value.uses`, not timed."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec

READERS = 10_000


def _star(op_type: str, readers: int) -> onnx.ModelProto:
    """One input read by `readers` nodes, each output a graph output."""
    weight = numpy_helper.from_array(np.eye(8, dtype=np.float32), "w")
    second = ["w"] if op_type == "MatMul" else []
    nodes = [helper.make_node(op_type, ["x", *second], [f"y{i}"], name=f"n{i}") for i in range(readers)]
    graph = helper.make_graph(
        nodes, "star", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2, 8]) for i in range(readers)],
        [weight] if second else [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op_type", ["Relu", "MatMul"])
def test_a_value_with_many_readers_is_visited_linearly(op_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    visited = [0]
    uses = ir.Value.uses

    def counting(self: ir.Value):  # type: ignore[no-untyped-def]
        found = uses(self)
        visited[0] += len(found)
        return found

    monkeypatch.setattr(ir.Value, "uses", counting)
    result = mixprec.convert(_star(op_type, READERS), target_dtype="fp16", validate="none")
    assert visited[0] <= 20 * READERS, f"{visited[0]} uses visited for {READERS} readers"
    low = result.report.nodes_by_precision.get("low", 0)
    assert low == (READERS if op_type == "MatMul" else 0)


def test_many_readers_convert_correctly() -> None:
    model = _star("MatMul", 300)
    result = mixprec.convert(model, target_dtype="fp16")
    assert result.report.casts_runtime == 1 + 300  # x once, each output back to FP32
    assert result.report.validation.runtime in ("ran", "ran and emulated")
    assert max(o.max_abs_error for o in result.report.validation.outputs) < 1e-2
