"""Accuracy-aware search: the probe localises the sensitive node, the bisection finds a small
FP32 set within the evaluation bound, deterministically, for a CNN, a control-flow model and a
PyTorch transformer, in float16 and bfloat16.

Each model has one clearly sensitive node: a subtraction of a large offset (raw pixels minus
500, raw sensor values minus 300 inside an If branch, word embeddings shifted by +1000 plus
position embeddings shifted by -1000). In 16 bits the inputs of that node lose their small
variations; every other node only adds ordinary rounding error. The tolerances sit between the
two: the default plan fails them, keeping that one node FP32 meets them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

import mixprec
from mixprec.cli import main
from mixprec.errors import InputError
from mixprec.plan.file import load_plan
from mixprec.tune import Tolerance, TuneResult, tune


def _bound(result: TuneResult) -> int:
    """2 + log2(candidates), plus one for the first split at the outliers."""
    return 2 + math.ceil(math.log2(result.candidates)) + 1


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def _weight(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
    return nh.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def offset_cnn() -> onnx.ModelProto:
    """Raw pixels minus 500, two Conv/Relu blocks, pooling and a Gemm head (opset 22: bf16 Conv)."""
    rng = np.random.default_rng(0)
    nodes = [
        oh.make_node("Sub", ["image", "offset"], ["centered"], name="normalize/Sub"),
        oh.make_node("Conv", ["centered", "w1", "b1"], ["c1"], name="conv1/Conv", pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c1"], ["r1"], name="conv1/Relu"),
        oh.make_node("MaxPool", ["r1"], ["p1"], name="pool1/MaxPool", kernel_shape=[2, 2], strides=[2, 2]),
        oh.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2/Conv", pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c2"], ["r2"], name="conv2/Relu"),
        oh.make_node("GlobalAveragePool", ["r2"], ["g"], name="pool2/GlobalAveragePool"),
        oh.make_node("Flatten", ["g"], ["f"], name="head/Flatten"),
        oh.make_node("Gemm", ["f", "wfc", "bfc"], ["logits"], name="head/Gemm"),
    ]
    initializers = [
        nh.from_array(np.array(500.0, np.float32), "offset"),
        _weight(rng, "w1", (8, 3, 3, 3), 0.3),
        _weight(rng, "b1", (8,), 0.1),
        _weight(rng, "w2", (16, 8, 3, 3), 0.15),
        _weight(rng, "b2", (16,), 0.1),
        _weight(rng, "wfc", (16, 10), 0.3),
        _weight(rng, "bfc", (10,), 0.1),
    ]
    graph = oh.make_graph(
        nodes, "offset_cnn", [oh.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [oh.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], initializers,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 22)])
    model.ir_version = 10
    return model


def control_flow_model() -> onnx.ModelProto:
    """If(use_raw): then centre the raw input (x - 300) and project, else project; a Loop
    refines the result three times (tanh(s @ W)); a MatMul/Add head."""
    rng = np.random.default_rng(0)
    d = 8
    then_branch = oh.make_graph(
        [
            oh.make_node("Sub", ["x", "offset"], ["centered"], name="then/Sub"),
            oh.make_node("MatMul", ["centered", "w_then"], ["t1"], name="then/MatMul"),
            oh.make_node("Relu", ["t1"], ["then_out"], name="then/Relu"),
        ],
        "then", [], [oh.make_tensor_value_info("then_out", TensorProto.FLOAT, None)],
    )
    else_branch = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w_else"], ["else_out"], name="else/MatMul")],
        "else", [], [oh.make_tensor_value_info("else_out", TensorProto.FLOAT, None)],
    )
    body = oh.make_graph(
        [
            oh.make_node("MatMul", ["s_in", "w_loop"], ["s_mm"], name="loop/MatMul"),
            oh.make_node("Tanh", ["s_mm"], ["s_out"], name="loop/Tanh"),
            oh.make_node("Identity", ["cond_in"], ["cond_out"], name="loop/cond"),
        ],
        "body",
        [
            oh.make_tensor_value_info("i", TensorProto.INT64, []),
            oh.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            oh.make_tensor_value_info("s_in", TensorProto.FLOAT, None),
        ],
        [
            oh.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            oh.make_tensor_value_info("s_out", TensorProto.FLOAT, None),
        ],
    )
    nodes = [
        oh.make_node("If", ["use_raw"], ["branch_out"], name="select/If",
                     then_branch=then_branch, else_branch=else_branch),
        oh.make_node("Loop", ["trips", "", "branch_out"], ["looped"], name="refine/Loop", body=body),
        oh.make_node("MatMul", ["looped", "w_head"], ["mm"], name="head/MatMul"),
        oh.make_node("Add", ["mm", "b_head"], ["y"], name="head/Add"),
    ]
    initializers = [
        nh.from_array(np.array(300.0, np.float32), "offset"),
        _weight(rng, "w_then", (d, d), 0.5),
        _weight(rng, "w_else", (d, d), 0.01),
        _weight(rng, "w_loop", (d, d), 0.4),
        _weight(rng, "w_head", (d, 4), 0.5),
        _weight(rng, "b_head", (4,), 0.1),
        nh.from_array(np.array(3, np.int64), "trips"),
    ]
    graph = oh.make_graph(
        nodes, "control_flow",
        [
            oh.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d]),
            oh.make_tensor_value_info("use_raw", TensorProto.BOOL, []),
        ],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], initializers,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 10
    return model


@pytest.fixture(scope="module")
def cnn(tmp_path_factory) -> tuple[Path, list[dict[str, np.ndarray]]]:
    path = _save(offset_cnn(), tmp_path_factory.mktemp("cnn") / "cnn.onnx")
    rng = np.random.default_rng(1)
    data = [{"image": (500 + rng.standard_normal((4, 3, 16, 16))).astype(np.float32)} for _ in range(2)]
    return path, data


@pytest.fixture(scope="module")
def control_flow(tmp_path_factory) -> tuple[Path, list[dict[str, np.ndarray]]]:
    path = _save(control_flow_model(), tmp_path_factory.mktemp("cf") / "cf.onnx")
    rng = np.random.default_rng(1)
    data = [
        {"x": (300 + rng.standard_normal((16, 8))).astype(np.float32), "use_raw": np.array(True)}
        for _ in range(2)
    ]
    return path, data


@pytest.fixture(scope="module")
def transformer(tmp_path_factory) -> tuple[Path, list[dict[str, np.ndarray]], str]:
    torch = pytest.importorskip("torch")
    import torch_models  # noqa: PLC0415 - tests/ is on sys.path (conftest.py)

    model = torch_models.make_model(seed=0)
    with torch.no_grad():  # x = (word + 1000) + (position - 1000): the embedding sum cancels
        model.word.weight += 1000.0
        model.position.weight -= 1000.0
    path = torch_models.export(model, tmp_path_factory.mktemp("tr") / "tr.onnx", dynamo=False)
    proto = onnx.load(str(path))
    producers = {out: node for node in proto.graph.node for out in node.output}
    (embedding_sum,) = [
        node.name for node in proto.graph.node
        if node.op_type == "Add" and all(
            i in producers and producers[i].op_type == "Gather" for i in node.input
        )
    ]
    rng = np.random.default_rng(0)
    data = []
    for _ in range(2):
        mask = np.ones((4, 12), np.int64)
        mask[:, -3:] = 0
        ids = rng.integers(0, torch_models.VOCAB, (4, 12)).astype(np.int64)
        data.append({"input_ids": ids, "attention_mask": mask})
    return path, data, embedding_sum


def _check(result: TuneResult, sensitive: str) -> None:
    assert not result.history[0].met, "the default plan should fail the tolerance"
    assert result.history[0].fp32_candidates == 0
    assert result.met
    assert result.contributions[0][0] == sensitive, result.contributions[:3]
    assert result.contributions[0][2] > 10 * result.contributions[1][2]
    assert result.fp32_nodes[0] == sensitive
    assert result.evaluations <= _bound(result), (result.evaluations, result.candidates)
    assert result.evaluations <= result.max_evaluations
    assert result.fp32_share_nodes < 0.5
    assert all(o.passed for o in result.outputs)
    decisions = {n.name: d for n, d in result.plan.decisions.items()}
    assert decisions[sensitive].precision is mixprec.Precision.FP32
    assert decisions[sensitive].category.value == "set by plan"


def _same(a: TuneResult, b: TuneResult) -> None:
    assert a.fp32_nodes == b.fp32_nodes
    assert a.evaluations == b.evaluations
    assert [e.fp32_candidates for e in a.history] == [e.fp32_candidates for e in b.history]
    assert a.contributions == b.contributions


def test_cnn_float16(cnn, tmp_path):
    path, data = cnn
    out = tmp_path / "cnn.fp16.onnx"
    result = tune(path, data, target_dtype="fp16", tolerance=Tolerance(atol=1e-2), output=out)
    _check(result, "normalize/Sub")
    assert result.fp32_nodes == ("normalize/Sub",)
    assert result.evaluations == 3  # default, all candidates FP32, the outlier alone
    assert result.fp32_share_flops == 0.0  # the Sub costs no MatMul/Conv/Gemm FLOPs
    assert out.is_file() and result.output_path == out
    onnx.checker.check_model(str(out), full_check=True)
    # The plan is an artifact: re-applied by convert, it gives the same FP32 set.
    plan = result.save_plan(tmp_path / "plan.json")
    assert load_plan(plan).nodes["normalize/Sub"].precision is mixprec.Precision.FP32
    again = mixprec.convert(path, validate="none", plan=plan)
    assert {n.name for n, d in again.plan.decisions.items() if d.precision is mixprec.Precision.FP32} == {
        "normalize/Sub"
    }
    _same(result, tune(path, data, target_dtype="fp16", tolerance=Tolerance(atol=1e-2)))


def test_cnn_bfloat16(cnn):
    path, data = cnn
    result = tune(path, data, target_dtype="bf16", tolerance=Tolerance(atol=5e-2))
    _check(result, "normalize/Sub")
    assert result.fp32_nodes == ("normalize/Sub",)


def test_control_flow_float16(control_flow):
    path, data = control_flow
    result = tune(path, data, target_dtype="fp16", tolerance=Tolerance(atol=1e-2))
    _check(result, "then/Sub")
    assert result.fp32_nodes == ("then/Sub",)
    errors = {name: error for name, _, error in result.contributions}
    # Nodes in the taken branch and in the loop body are probed; the branch not taken is 0.
    assert errors["loop/MatMul"] > 0 and errors["then/MatMul"] > 0 and errors["head/MatMul"] > 0
    assert errors["else/MatMul"] == 0.0
    # If and Loop own subgraphs and compute nothing: not counted in the FP32 share.
    assert result.fp32_share_nodes == pytest.approx(1 / 8)


def test_control_flow_bfloat16_is_deterministic(control_flow):
    path, data = control_flow
    first = tune(path, data, target_dtype="bf16", tolerance=Tolerance(atol=5e-2))
    _check(first, "then/Sub")
    _same(first, tune(path, data, target_dtype="bf16", tolerance=Tolerance(atol=5e-2)))


def test_transformer_float16(transformer):
    path, data, embedding_sum = transformer
    result = tune(path, data, target_dtype="fp16", tolerance=Tolerance(atol=1e-2))
    _check(result, embedding_sum)
    assert result.fp32_nodes == (embedding_sum,)
    assert result.candidates > 50 and result.evaluations == 3
    assert result.fp32_share_flops is not None and result.fp32_share_flops < 0.05


def test_transformer_bfloat16(transformer):
    path, data, embedding_sum = transformer
    first = tune(path, data, target_dtype="bf16", tolerance=Tolerance(min_cosine=0.9999))
    _check(first, embedding_sum)
    _same(first, tune(path, data, target_dtype="bf16", tolerance=Tolerance(min_cosine=0.9999)))


def test_other_criteria_and_metric(cnn):
    path, data = cnn
    result = tune(path, data, tolerance=Tolerance(min_cosine=0.99999, topk_agreement=1.0))
    assert result.met and result.outputs[0].topk_agreement == 1.0
    assert result.outputs[0].cosine >= 0.99999
    calls = []

    def metric(reference, candidate):  # type: ignore[no-untyped-def]
        calls.append(len(reference))
        return all(np.abs(r["logits"] - c["logits"]).max() < 1e-2 for r, c in zip(reference, candidate))

    by_metric = tune(path, data, metric=metric)
    assert by_metric.met and by_metric.fp32_nodes == ("normalize/Sub",)
    assert calls and set(calls) == {2}
    assert "tolerance (metric) met" in by_metric.format_text()


def test_real_float16_run(cnn):
    path, data = cnn
    # onnxruntime's CPU provider has no float16 Sub: it computes it in FP32 and drops the Cast
    # pair around it, so the real run may not see the rounding the emulation (and a GPU) sees.
    result = tune(path, data, tolerance=Tolerance(atol=1e-2), emulate=False)
    assert result.met and result.evaluations <= _bound(result)
    assert not result.notes


def test_unreachable_tolerance(cnn, tmp_path):
    path, data = cnn
    out = tmp_path / "never.onnx"
    # 16-bit model inputs: the input is rounded before any node, no FP32 node can undo it.
    result = tune(path, data, tolerance=Tolerance(atol=1e-2), keep_io_types=False, output=out)
    assert not result.met
    assert [e.fp32_candidates for e in result.history] == [0, result.candidates]
    assert not out.exists()
    plan = result.save_plan(tmp_path / "best.json")
    assert load_plan(plan).names(mixprec.Precision.FP32)


def test_bad_arguments(cnn):
    path, data = cnn
    with pytest.raises(mixprec.InputError, match="needs a tolerance or a metric"):
        tune(path, data)
    with pytest.raises(mixprec.InputError, match="sets 'validate' itself"):
        tune(path, data, tolerance=Tolerance(atol=1), validate="run")
    with pytest.raises(mixprec.InputError, match="output 'nope'"):
        tune(path, data, tolerance=Tolerance(atol=1, outputs=("nope",)))
    with pytest.raises(mixprec.InputError, match="min_cosine"):
        Tolerance(min_cosine=2.0)
    with pytest.raises(mixprec.InputError, match="no data for model input 'image'|model input 'image'"):
        tune(path, [{"x": np.zeros(1)}], tolerance=Tolerance(atol=1))


def test_cli(cnn, tmp_path, capsys):
    path, data = cnn
    folder = tmp_path / "data"
    folder.mkdir()
    for i, batch in enumerate(data):
        np.savez(folder / f"b{i}.npz", **batch)
    out, plan = tmp_path / "out.onnx", tmp_path / "plan.json"
    code = main(["tune", str(path), str(out), "--data", str(folder), "--to", "fp16",
                 "--tolerance", "1e-2,0", "--plan-out", str(plan)])
    text = capsys.readouterr().out
    assert code == 0 and out.is_file() and plan.is_file()
    assert "3 evaluation(s)" in text and "FP32 share: 11.1% of nodes" in text
    assert json.loads(plan.read_text())["nodes"]["normalize/Sub"]["precision"] == "fp32"
    never, plan2 = tmp_path / "never.onnx", tmp_path / "plan2.json"
    code = main(["tune", str(path), str(never), "--data", str(folder), "--min-cosine", "0.9999999",
                 "--io-16bit", "--plan-out", str(plan2)])
    assert code == 3 and not never.exists() and plan2.is_file()
    assert "not written" in capsys.readouterr().err


def test_probe_failure_falls_back_to_graph_order(cnn, monkeypatch):
    import mixprec.tune as tune_module  # noqa: PLC0415

    def fail(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("no probe today")

    monkeypatch.setattr(tune_module._ProbeBuilder, "build", fail)
    path, data = cnn
    result = tune(path, data, tolerance=Tolerance(atol=1e-2))
    assert result.met and any("probe failed (no probe today)" in note for note in result.notes)
    assert all(math.isnan(error) for _, _, error in result.contributions)
    assert result.contributions[0][0] == "normalize/Sub"  # graph order
    assert result.evaluations <= 2 + math.ceil(math.log2(result.candidates))


def test_model_proto_and_generated_data():
    result = tune(offset_cnn(), None, target_dtype="bf16", tolerance=Tolerance(min_cosine=0.99))
    assert result.met and any("generated batch" in note for note in result.notes)


def test_convert_refuses_criteria_only_tune_checks() -> None:
    """convert checks the allclose rule; a cosine or top-1 criterion is tune's, not silently ignored."""
    from mixprec.demo_models import small_cnn  # noqa: PLC0415

    with pytest.raises(InputError, match="min_cosine, topk_agreement and outputs are criteria"):
        mixprec.convert(small_cnn(), tolerance=Tolerance(min_cosine=0.99), validate="none")
    with pytest.raises(InputError, match="pair of numbers"):
        mixprec.convert(small_cnn(), tolerance=("a", "b"), validate="none")


def test_pinned_opset_holds_for_every_candidate(tmp_path):
    """--opset pins the version: bfloat16 Conv would need 22, the search's models stay at 21
    (the convolutions keep FP32 for the schema) and so does the final model."""
    from mixprec.demo_models import small_cnn  # noqa: PLC0415

    model = small_cnn()
    assert model.opset_import[0].version < 21
    path = _save(model, tmp_path / "cnn.onnx")
    result = tune(path, None, target_dtype="bf16", tolerance=Tolerance(atol=5e-2), opset=21)
    assert result.model.opset_imports[""] == 21
    assert result.report.low_by_op.get("Conv", 0) == 0
    assert "schema has no 16-bit type" in result.report.fp32_by_category


def test_bfloat16_probe_of_an_opset_12_model(tmp_path):
    """Before opset 13 Cast has no bfloat16: the probe is built on the conversion's upgraded FP32
    model, so every candidate gets its own error rather than its place in graph order."""
    rng = np.random.default_rng(0)
    weights = [nh.from_array(rng.normal(0, 0.3, (8, 8)).astype(np.float32), f"w{i}") for i in range(3)]
    nodes = [
        oh.make_node("MatMul", ["x", "w0"], ["h0"]), oh.make_node("Relu", ["h0"], ["r0"]),
        oh.make_node("MatMul", ["r0", "w1"], ["h1"]), oh.make_node("Tanh", ["h1"], ["r1"]),
        oh.make_node("MatMul", ["r1", "w2"], ["y"]),
    ]
    graph = oh.make_graph(nodes, "mlp", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], weights)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 12)])
    path = _save(model, tmp_path / "mlp.onnx")
    data = [{"x": rng.normal(size=(4, 8)).astype(np.float32)} for _ in range(2)]
    result = tune(path, data, target_dtype="bf16", tolerance=Tolerance(min_cosine=0.999))
    assert not [n for n in result.notes if "probe failed" in n or "could not be probed" in n], result.notes
    assert result.met and result.contributions


def _cancellation_model() -> onnx.ModelProto:
    """Two nearly equal matrix products subtracted (each rounded to 16 bits, their difference
    loses most of its digits), each product reshaped and transposed on the way: the error is the
    products', which the value-moving nodes after them only carry."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    nodes = [
        oh.make_node("MatMul", ["x", "w1"], ["p1"], name="product_1"),
        oh.make_node("MatMul", ["x", "w2"], ["p2"], name="product_2"),
    ]
    for k in (1, 2):
        nodes += [
            oh.make_node("Reshape", [f"p{k}", "shape"], [f"r{k}"], name=f"reshape_{k}"),
            oh.make_node("Transpose", [f"r{k}"], [f"t{k}"], perm=[0, 2, 1], name=f"transpose_{k}"),
        ]
    nodes += [oh.make_node("Sub", ["t1", "t2"], ["d"], name="difference"),
              oh.make_node("Relu", ["d"], ["y"], name="relu")]
    graph = oh.make_graph(
        nodes, "cancellation", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8, 8])],
        [nh.from_array(w, "w1"), nh.from_array(w + np.float32(1e-3), "w2"),
         nh.from_array(np.array([4, 8, 8], np.int64), "shape")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def test_nodes_that_only_move_values_are_not_kept_fp32_for_the_rounding_they_carry() -> None:
    """The probe measures a Reshape or Transpose at its input's rounding, as large as the
    product before it; keeping the products FP32 is what meets the tolerance, and the value-moving
    nodes then follow them without being named."""
    model = _cancellation_model()
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((4, 32)).astype(np.float32)} for _ in range(2)]
    result = tune(model, batches, target_dtype="float16", tolerance=Tolerance(atol=1e-4, rtol=1e-3))
    assert result.met, result
    assert set(result.fp32_nodes) <= {"product_1", "product_2", "difference", "relu"}, result.fp32_nodes
    assert {"product_1", "product_2"} <= set(result.fp32_nodes)
    moved = {name: error for name, op, error in result.contributions if op in ("Reshape", "Transpose")}
    assert moved and all(error == 0.0 for error in moved.values())


def test_a_node_moving_a_constant_keeps_the_rounding_it_measures() -> None:
    """Concat of a computed value and a constant (1024.49, which float16 rounds to 1024.5): the
    rounding is the Concat's own to remove, since no other candidate makes that value, so it
    keeps the error the probe measures and one node kept FP32 meets the tolerance."""
    rng = np.random.default_rng(0)
    nodes, previous = [], "x"
    for i in range(4):
        nodes += [oh.make_node("MatMul", [previous, f"w{i}"], [f"m{i}"], name=f"product_{i}"),
                  oh.make_node("Relu", [f"m{i}"], [f"r{i}"], name=f"relu_{i}")]
        previous = f"r{i}"
    nodes.append(oh.make_node("Concat", [previous, "table"], ["y"], axis=1, name="with_table"))
    weights = [nh.from_array((np.round(rng.standard_normal((16, 16)) * 2) / 8).astype(np.float32), f"w{i}")
               for i in range(4)]
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])],
        [*weights, nh.from_array(np.full((4, 16), 1024.49, np.float32), "table")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    batches = [{"x": rng.standard_normal((4, 16)).astype(np.float16).astype(np.float32)} for _ in range(2)]
    result = tune(model, batches, target_dtype="float16", tolerance=Tolerance(atol=0.1))
    assert result.met and len(result.fp32_nodes) == 1, result.fp32_nodes
    errors = {name: error for name, _, error in result.contributions}
    assert errors["with_table"] > 0  # the constant's rounding, measured
    relu_errors = {name: error for name, op, error in result.contributions if op == "Relu"}
    assert relu_errors and all(e == 0.0 for e in relu_errors.values())  # they move the products' values
