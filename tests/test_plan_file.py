"""The plan as an artifact: save, edit, re-apply; stable names; clear errors."""

from __future__ import annotations

import copy
import json

import onnx
import onnx_ir as ir
import pytest
from helpers import node_sigs
from onnx import TensorProto
from onnx import helper as oh

import mixprec
from mixprec.cli import main
from mixprec.demo_models import small_cnn
from mixprec.plan.file import PLAN_REASON, dumps_plan, load_plan, plan_to_dict, save_plan
from mixprec.plan.model import Category, Precision


@pytest.fixture(scope="module")
def cnn() -> onnx.ModelProto:
    return small_cnn()


def _convert(model: onnx.ModelProto, **kwargs):  # type: ignore[no-untyped-def]
    kwargs.setdefault("validate", "none")
    return mixprec.convert(copy.deepcopy(model), **kwargs)


def _decision(result, name: str):  # type: ignore[no-untyped-def]
    (node,) = [n for n in result.plan.order if n.name == name]
    return result.plan.decisions[node]


def test_save_edit_reapply_keeps_the_node_fp32(cnn, tmp_path):
    result = _convert(cnn)
    assert _decision(result, "block2/Conv").precision is Precision.LOW
    path = save_plan(result.plan, tmp_path / "plan.json")

    data = json.loads(path.read_text())
    assert data["format"] == "mixprec.plan/1" and data["target"] == "float16"
    assert data["keep_io_types"] is True and data["mixprec_version"] == mixprec.__version__
    assert data["nodes"]["block2/Conv"] == {
        "category": "policy",
        "op_type": "Conv",
        "precision": "low",
        "reason": "Conv: compute-bound matrix multiply or convolution",
    }
    data["nodes"]["block2/Conv"]["precision"] = "fp32"
    path.write_text(json.dumps(data))

    edited = _convert(cnn, plan=path)
    decision = _decision(edited, "block2/Conv")
    assert decision.precision is Precision.FP32
    assert decision.category is Category.PLAN and decision.reason == PLAN_REASON == "set by plan"
    assert _decision(edited, "block1/Conv").precision is Precision.LOW
    # The Conv really computes in FP32 in the converted model (the other one in float16).
    convs = [sig for sig in node_sigs(ir.to_proto(edited.model)) if sig.op_type == "Conv"]
    assert sorted(c.inputs[0] for c in convs) == ["float", "float16"]
    # Its neighbours that were `low` only by following it are reported, not silently dropped.
    assert any("follow FP32 neighbours" in note and "block2/Relu" in note for note in edited.report.notes)
    # The report of the FP32 nodes carries the plan reason.
    kept = {k.name: k for k in edited.report.kept_fp32}
    assert kept["block2/Conv"].category == "set by plan"
    # The edited plan is a fixed point: saving and applying it again changes nothing.
    saved = save_plan(edited.plan, tmp_path / "edited.json")
    again = save_plan(_convert(cnn, plan=saved).plan, tmp_path / "again.json")
    assert saved.read_text() == again.read_text()
    assert json.loads(saved.read_text())["nodes"]["block2/Relu"]["category"] == "follows inputs"
    # A node recorded as following its inputs can be set fp32 by hand, too.
    data = plan_to_dict(result.plan)
    assert data["nodes"]["block1/Relu"]["category"] == "follows inputs"
    data["nodes"]["block1/Relu"]["precision"] = "fp32"
    decision = _decision(_convert(cnn, plan=data), "block1/Relu")
    assert decision.precision is Precision.FP32 and decision.category is Category.PLAN


def test_round_trip_is_stable(cnn, tmp_path):
    first = save_plan(_convert(cnn).plan, tmp_path / "a.json")
    second = save_plan(_convert(cnn, plan=first).plan, tmp_path / "b.json")
    assert first.read_text() == second.read_text()
    # One line per node, sorted: diffs are line by line.
    lines = first.read_text().splitlines()
    node_lines = [line for line in lines if line.startswith("    ")]
    assert len(node_lines) == len(cnn.graph.node)
    keys = [line.split('"')[1] for line in node_lines]
    assert keys == sorted(keys)
    # The dict and the text agree and load back.
    assert json.loads(first.read_text()) == json.loads(dumps_plan(plan_to_dict(_convert(cnn).plan)))
    assert set(load_plan(first).nodes) == set(keys)


def _unnamed_model() -> onnx.ModelProto:
    nodes = [
        oh.make_node("MatMul", ["x", "w"], ["a"]),
        oh.make_node("Relu", ["a"], ["b"], name="dup"),
        oh.make_node("Relu", ["b"], ["c"], name="dup"),
        oh.make_node("Softmax", ["c"], ["y"], axis=-1),
    ]
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [oh.make_tensor("w", TensorProto.FLOAT, [4, 4], [0.1] * 16)],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_unnamed_and_duplicate_nodes_get_stable_generated_names(tmp_path):
    model = _unnamed_model()
    names = list(plan_to_dict(_convert(model).plan)["nodes"])
    assert names == sorted(["MatMul#0", "dup", "Relu#2", "Softmax#3"])
    assert list(plan_to_dict(_convert(model).plan)["nodes"]) == names  # same on every run
    # A generated name addresses its node.
    result = _convert(model, plan={"nodes": {"MatMul#0": "fp32", "Relu#2": {"precision": "fp32"}}})
    matmul = next(n for n in result.plan.order if n.op_type == "MatMul")
    assert result.plan.decisions[matmul].category is Category.PLAN
    second_relu = [n for n in result.plan.order if n.op_type == "Relu"][1]
    assert result.plan.decisions[second_relu].category is Category.PLAN


def test_unknown_node_is_an_input_error(cnn):
    with pytest.raises(mixprec.InputError, match="'no/such/node' is not in the model"):
        _convert(cnn, plan={"nodes": {"no/such/node": {"precision": "fp32"}}})


def test_op_type_mismatch_is_an_input_error(cnn):
    with pytest.raises(mixprec.InputError, match="'block1/Conv' is a MatMul in the plan but a Conv"):
        _convert(cnn, plan={"nodes": {"block1/Conv": {"precision": "fp32", "op_type": "MatMul"}}})


def test_malformed_plans_name_the_file_and_node(tmp_path):
    missing = tmp_path / "missing.json"
    with pytest.raises(mixprec.InputError, match="missing.json does not exist"):
        load_plan(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(mixprec.InputError, match="broken.json is not readable JSON"):
        load_plan(broken)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nodes": {"n1": {"precision": "half"}}}))
    with pytest.raises(mixprec.InputError, match=r"bad.json: node 'n1': precision must be one of"):
        load_plan(bad)
    with pytest.raises(mixprec.InputError, match="unsupported format"):
        load_plan({"format": "other/2", "nodes": {}})
    with pytest.raises(mixprec.InputError, match="'nodes' must be an object"):
        load_plan({"nodes": []})


def test_low_entries_the_planner_keeps_fp32_are_noted(cnn):
    result = _convert(cnn, plan={"nodes": {"head/Softmax": "low"}, "target": "bfloat16"})
    notes = " | ".join(result.report.notes)
    assert "head/Softmax (policy:" in notes
    assert "made for bfloat16, applied for float16" in notes


def test_cli_plan_out_and_plan(cnn, tmp_path):
    source = tmp_path / "cnn.onnx"
    onnx.save(cnn, str(source))
    plan = tmp_path / "plan.json"
    assert main(["convert", str(source), str(tmp_path / "a.onnx"), "--validate", "none",
                 "--plan-out", str(plan)]) == 0
    data = json.loads(plan.read_text())
    data["nodes"]["head/Gemm"]["precision"] = "fp32"
    plan.write_text(json.dumps(data))
    again = tmp_path / "again.json"
    assert main(["convert", str(source), str(tmp_path / "b.onnx"), "--validate", "none",
                 "--plan", str(plan), "--plan-out", str(again)]) == 0
    assert json.loads(again.read_text())["nodes"]["head/Gemm"]["category"] == "set by plan"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nodes": {"ghost": "fp32"}}))
    assert main(["convert", str(source), str(tmp_path / "c.onnx"), "--plan", str(bad)]) == 2
    assert not (tmp_path / "c.onnx").exists()
