"""Models that draw random numbers (VITS's duration noise, a VAE's sampling): an upgrade never
strands their random-number ops on onnxruntime, their emulation runs there, and the outputs
that depend on the random numbers are not compared (two FP32 runs differ already)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from mixprec.policy.profiles import load_runtime

RANDOM_OPS = ("Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike")


def noisy_conv(noise_scale: float) -> onnx.ModelProto:
    """x -> Conv -> c; outputs clean = Relu(c) and noisy = c + noise_scale * RandomNormalLike(c)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["clean"], name="relu"),
        helper.make_node("RandomNormalLike", ["c"], ["n"], name="noise"),
        helper.make_node("Mul", ["n", "k"], ["nk"], name="scale"),
        helper.make_node("Add", ["c", "nk"], ["noisy"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "noisy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 8, 8, 8]) for n in ("clean", "noisy")],
        [numpy_helper.from_array(rng.normal(0, 0.2, (8, 4, 3, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(np.array(noise_scale, np.float32), "k")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _loads(op: str, opset: int) -> bool:
    """Whether onnxruntime's CPU provider has a kernel of a one-node `op` model at `opset`."""
    inputs = {"RandomNormal": [], "RandomUniform": []}.get(op, ["x"])
    attributes = {"shape": [2]} if not inputs else {}
    output = TensorProto.INT32 if op == "Multinomial" else TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], **attributes)], "one",
        [helper.make_tensor_value_info(i, TensorProto.FLOAT, [2, 2]) for i in inputs],
        [helper.make_tensor_value_info("y", output, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - onnxruntime raises its own types
        return False
    return True


@pytest.mark.parametrize("op", RANDOM_OPS)
def test_the_profiles_end_the_random_ops_where_onnxruntime_does(op: str) -> None:
    # OperatorKernels.md lists them as "1+"; the installed onnxruntime finds no kernel at 22.
    cpu = load_runtime("ort-cpu")
    last = max(k.until for k in cpu.kernels[("", op)] if k.until is not None)
    assert _loads(op, last) and not _loads(op, last + 1)
    assert cpu.runs_at("", op, last) and not cpu.runs_at("", op, last + 1)
    assert not load_runtime("ort-cuda").runs_at("", op, last + 1)  # nor does its CPU fallback


def test_bfloat16_conv_does_not_upgrade_past_the_random_ops_kernels() -> None:
    # bfloat16 Conv needs opset 22, where onnxruntime has no RandomNormalLike: the model stays
    # at 17 and loads; the note says why Conv stays FP32.
    result = mixprec.convert(noisy_conv(0.1), None, target_dtype="bf16", runtime="ort-cuda", validate="none")
    assert result.model.opset_imports[""] == 17
    note = next(n for n in result.report.notes if n.startswith("Conv need"))
    assert "Conv need opset 22 for bfloat16, but CUDAExecutionProvider has no kernel of RandomNormalLike at opset 22" in note
    assert not any("convert with --opset 22" in n for n in result.report.notes)  # no advice to strand it
    # Bernoulli has no kernel of its own: onnxruntime runs its function body, RandomUniformLike.
    model = noisy_conv(0.1)
    model.graph.node.extend([
        helper.make_node("Sigmoid", ["c"], ["p"], name="probability"),
        helper.make_node("Bernoulli", ["p"], ["drawn"], name="draw"),
    ])
    model.graph.output.append(helper.make_tensor_value_info("drawn", TensorProto.FLOAT, [1, 8, 8, 8]))
    assert _loads_model(model, 17) and not _loads_model(model, 22)
    result = mixprec.convert(model, None, target_dtype="bf16", runtime="ort-cuda", validate="none")
    assert result.model.opset_imports[""] == 17
    assert any("no kernel of Bernoulli, RandomNormalLike at opset 22" in n for n in result.report.notes)


def _loads_model(model: onnx.ModelProto, opset: int) -> bool:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.opset_import[0].version = opset
    try:
        ort.InferenceSession(copy.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - onnxruntime raises its own types
        return False
    return True


def test_outputs_that_depend_on_random_numbers_are_not_compared(tmp_path) -> None:
    # OpenVINO's profile has no kernel table: the model is upgraded to 22, and its emulation
    # declares 21 again for onnxruntime. `noisy` differs between two FP32 runs: only `clean`
    # is compared.
    result = mixprec.convert(noisy_conv(0.1), tmp_path / "out.onnx", target_dtype="bf16", runtime="openvino", validate="run")
    v = result.report.validation
    assert result.model.opset_imports[""] == 22
    assert [o.name for o in v.outputs] == ["clean"] and v.outputs[0].scaled_error < 0.02
    assert [o.name for o in v.real_outputs] in (["clean"], [])  # [] without openvino installed
    # A tolerance judges only what is compared.
    mixprec.convert(noisy_conv(0.1), None, target_dtype="bf16", runtime="openvino", validate="run", tolerance=(0.05, 0.05))
    assert any("output(s) noisy of the FP32 model depend on random numbers (RandomNormalLike" in n for n in v.notes)
    # Noise scaled to 0: two runs agree, so both outputs are compared.
    quiet = mixprec.convert(noisy_conv(0.0), None, target_dtype="fp16", runtime="ort-cuda", validate="run")
    assert [o.name for o in quiet.report.validation.outputs] == ["clean", "noisy"]


def test_a_model_onnxruntime_cannot_load_at_its_own_opset_is_not_blamed_on_the_conversion() -> None:
    # At opset 22 onnxruntime loads neither the FP32 model nor the converted one (RandomNormalLike):
    # the conversion stands, and the report says the numerics were not checked, and why.
    model = noisy_conv(0.1)
    model.opset_import[0].version = 22
    for runtime in ("ort-cpu", "openvino"):
        v = mixprec.convert(model, None, target_dtype="fp16", runtime=runtime, validate="run").report.validation
        assert v.numerics.startswith("not checked: the FP32 model does not load in onnxruntime")
        assert "RandomNormalLike(22)" in v.numerics


def test_an_upgrade_the_user_pins_past_the_random_ops_kernels_is_refused_on_onnxruntime() -> None:
    # --opset 22 for ort-cpu: the FP32 model (opset 17) loads, the converted one cannot; no node
    # kept FP32 helps, so nothing is written. The note at the upgrade says why.
    from mixprec.errors import ValidationFailure  # noqa: PLC0415

    with pytest.raises(ValidationFailure, match="RandomNormalLike"):
        mixprec.convert(noisy_conv(0.1), None, target_dtype="fp16", runtime="ort-cpu", validate="run", opset=22)


def test_random_numbers_drawn_in_a_local_function_are_found() -> None:
    # The noise comes from a model-local function: its call's output is random too.
    model = noisy_conv(0.1)
    graph = model.graph
    index = next(i for i, n in enumerate(graph.node) if n.op_type == "RandomNormalLike")
    del graph.node[index]
    graph.node.insert(index, helper.make_node("Noise", ["c"], ["n"], domain="local", name="noise"))
    body = helper.make_function(
        "local", "Noise", ["x"], ["y"], [helper.make_node("RandomNormalLike", ["x"], ["y"])],
        [helper.make_opsetid("", 17)],
    )
    model.functions.append(body)
    model.opset_import.append(helper.make_opsetid("local", 1))
    onnx.checker.check_model(model)
    v = mixprec.convert(model, None, target_dtype="fp16", runtime="ort-cuda", validate="run").report.validation
    assert [o.name for o in v.outputs] == ["clean"]
    assert any("output(s) noisy of the FP32 model depend on random numbers (RandomNormalLike" in n for n in v.notes)
