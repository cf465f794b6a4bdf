"""Range analysis on data (calibration) and its use by `convert()` and the CLI.

The test model is single-head attention whose scores overflow float16: x ~ N(0, 30) of shape
[1, 8, 64], Q = xW and K = xW with the same W, so the diagonal of QK^T is |q_i|^2 ~ 1e5 >
65504. The scores are viewed as [batch, heads, query, key] (a Reshape, as exported attention
does) before the Softmax.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from mixprec.analysis.calibrate import RangeTable, ValueRange, calibrate, wide_values_from_ranges
from mixprec.runtime.batches import BatchSource
from mixprec.runtime.intermediates import IntermediateRunner
from mixprec.analysis.typeinfo import infer_types
from mixprec.cli import main
from mixprec.dtypes import LowPrecision
from mixprec.errors import InputError
from mixprec.validate.emulate import emulate_low_precision
from mixprec.runtime.sessions import make_session, run_session

DATA_RANGE = "range measured on data"


def attention_model() -> onnx.ModelProto:
    """Attention with scores ~1e5 on N(0, 30) inputs (see the module docstring)."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.165, (64, 64)).astype(np.float32)
    wv = rng.normal(0, 1 / 240, (64, 64)).astype(np.float32)
    initializers = [
        numpy_helper.from_array(w, "wq"),
        numpy_helper.from_array(w.copy(), "wk"),
        numpy_helper.from_array(wv, "wv"),
        numpy_helper.from_array(np.array([1, 1, 8, 8], np.int64), "heads_shape"),
        numpy_helper.from_array(np.array([1, 8, 8], np.int64), "flat_shape"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="attn/q"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="attn/k"),
        helper.make_node("Transpose", ["k"], ["kt"], name="attn/kt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="attn/scores"),
        helper.make_node("Reshape", ["scores", "heads_shape"], ["scores4"], name="attn/view"),
        helper.make_node("Softmax", ["scores4"], ["probs4"], name="attn/softmax", axis=-1),
        helper.make_node("Reshape", ["probs4", "flat_shape"], ["probs"], name="attn/unview"),
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="attn/v"),
        helper.make_node("MatMul", ["probs", "v"], ["y"], name="attn/out"),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 64])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def attention_batch(seed: int) -> dict[str, np.ndarray]:
    """One input batch, x ~ N(0, 30)."""
    return {"x": np.random.default_rng(seed).normal(0, 30, (1, 8, 64)).astype(np.float32)}


def write_model(folder: Path, **save_args: object) -> Path:
    """Save the attention model into `folder` (keyword arguments go to `onnx.save`)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "attention.onnx"
    onnx.save(attention_model(), str(path), **save_args)  # type: ignore[arg-type]
    return path


def write_batch(path: Path, seed: int) -> Path:
    """Write one batch as .npz."""
    np.savez(path, **attention_batch(seed))
    return path


def fp32_values(
    model: Path, feeds: dict[str, np.ndarray], names: list[str]
) -> dict[str, np.ndarray]:
    """Intermediate values of a model on one batch."""
    values: dict[str, np.ndarray] = {}
    with IntermediateRunner(model) as runner:
        for _, values in runner.run(names, [feeds]):
            pass
    return values


def run(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return run_session(make_session(path, graph_optimization="disable"), feeds)["y"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("calibration")
    return {
        "model": write_model(folder),
        "b1": write_batch(folder / "b1.npz", 1),
        "b2": write_batch(folder / "b2.npz", 2),
    }


def test_plain_float16_conversion_overflows(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "plain.onnx"
    mixprec.convert(files["model"], out, target_dtype="fp16")  # validated on generated N(0, 1) data
    feeds = attention_batch(1)
    scores = fp32_values(out, feeds, ["scores"])["scores"]
    assert scores.dtype == np.float16 and np.isinf(scores).any()
    # Emulated float16 (each 16-bit value rounded as a float16 runtime does): NaN after Softmax.
    emulated = tmp_path / "plain.emulated.onnx"
    onnx.save(emulate_low_precision(out), str(emulated))
    assert not np.isfinite(run(emulated, feeds)).all()
    assert not np.isfinite(run(out, feeds)).all()  # onnxruntime materializes it at the Reshape


def test_calibrated_conversion_keeps_overflowing_nodes_fp32(
    files: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "calibrated.onnx"
    result = mixprec.convert(files["model"], out, target_dtype="fp16", data=files["b1"])
    feeds = attention_batch(1)
    measured = float(np.abs(fp32_values(files["model"], feeds, ["scores"])["scores"]).max())
    assert measured > 65504

    kept = {k.name: k for k in result.report.kept_fp32}
    assert kept["attn/scores"].category == DATA_RANGE
    assert f"absmax {measured:.3g}" in kept["attn/scores"].reason
    assert "65504" in kept["attn/scores"].reason
    assert "attn/q" not in kept and "attn/v" not in kept and "attn/out" not in kept
    assert result.ranges is not None and result.ranges["scores"].absmax == pytest.approx(measured)
    assert any(n.startswith("calibration:") for n in result.report.notes)
    data = json.loads(result.report.to_json())
    row = next(k for k in data["kept_fp32"] if k["name"] == "attn/scores")
    assert (row["category"], row["reason"]) == (DATA_RANGE, kept["attn/scores"].reason)

    # The numeric check ran on the same data and found no new NaN/Inf.
    validation = result.report.validation
    assert validation.batches == 1 and validation.outputs[0].new_nonfinite == 0
    expected = run(files["model"], feeds)
    emulated = tmp_path / "calibrated.emulated.onnx"
    onnx.save(emulate_low_precision(out), str(emulated))
    for candidate in (out, emulated):
        np.testing.assert_allclose(run(candidate, feeds), expected, rtol=1e-2, atol=1e-2)


def test_in_memory_model_is_calibrated(files: dict[str, Path]) -> None:
    batches = [attention_batch(1), attention_batch(2)]
    result = mixprec.convert(attention_model(), target_dtype="fp16", data=iter(batches))
    assert result.report.validation.batches == 2  # the iterator served calibration and validation
    decisions = {n.name: d for n, d in result.plan.decisions.items()}
    assert decisions["attn/scores"].category.value == DATA_RANGE


def test_range_table_streams_and_is_deterministic(files: dict[str, Path], tmp_path: Path) -> None:
    b1, b2 = attention_batch(1), attention_batch(2)
    t1 = calibrate(files["model"], [b1])
    t2 = calibrate(files["model"], b2)  # one batch dict
    both = calibrate(files["model"], [b1, b2])
    assert list(both) == ["x", "q", "k", "kt", "scores", "scores4", "probs4", "probs", "v", "y"]
    assert both.batches == 2 and t1.batches == 1
    for name in both:
        assert both[name].absmax == max(t1[name].absmax, t2[name].absmax)
        assert both[name].min_nonzero == min(t1[name].min_nonzero, t2[name].min_nonzero)
        assert both[name].count == t1[name].count + t2[name].count
        assert both[name].nonfinite == 0
    assert both["x"].count == 2 * 8 * 64 and both["scores"].count == 2 * 8 * 8
    scores = np.concatenate(
        [fp32_values(files["model"], b, ["scores"])["scores"].ravel() for b in (b1, b2)]
    )
    assert both["scores"] == ValueRange(
        float(np.abs(scores).max()), float(np.abs(scores[scores != 0]).min()), 0, scores.size
    )
    assert calibrate(files["model"], [b1, b2]) == both
    assert RangeTable.from_json(both.to_json()) == both
    assert RangeTable.load(both.save(tmp_path / "ranges.json")) == both


def test_chunked_runs_give_the_same_table(files: dict[str, Path]) -> None:
    paths = [files["b1"], files["b2"]]
    single = calibrate(files["model"], paths, max_outputs_per_run=256)
    chunked = calibrate(files["model"], paths, max_outputs_per_run=2)
    assert single.runs == 1 and chunked.runs == math.ceil(9 / 2)
    assert chunked == single
    # A one-shot iterator is read once and replayed for the later runs; a callable is re-called.
    generator = (attention_batch(s) for s in (1, 2))
    assert calibrate(files["model"], generator, max_outputs_per_run=2) == single
    factory = lambda: (attention_batch(s) for s in (1, 2))  # noqa: E731
    assert calibrate(files["model"], factory, max_outputs_per_run=3) == single


def test_calibrate_model_with_external_data(files: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "external"
    path = write_model(folder, save_as_external_data=True, location="weights.bin")
    table = calibrate(path, files["b1"], max_outputs_per_run=4, progress=True)
    assert table == calibrate(files["model"], files["b1"])
    assert sorted(p.name for p in folder.iterdir()) == ["attention.onnx", "weights.bin"]


def test_calibration_input_errors(files: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(InputError, match="missing.npz"):
        calibrate(files["model"], tmp_path / "missing.npz")
    with pytest.raises(InputError, match="batch #0"):
        calibrate(files["model"], [np.zeros(3)])
    with pytest.raises(InputError, match="no calibration batches"):
        calibrate(files["model"], [])
    with pytest.raises(InputError, match="'x'"):
        calibrate(files["model"], [{"y": np.zeros((1, 8, 64), np.float32)}])
    with pytest.raises(InputError, match="margin"):
        wide_values_from_ranges(
            ir.from_proto(attention_model()), {}, LowPrecision.FLOAT16, margin=0.5
        )
    assert len(list(BatchSource([files["b1"], files["b2"]], ["x"], max_batches=1))) == 1


def _typed_model() -> ir.Model:
    model = ir.from_proto(attention_model())
    infer_types(model)
    return model


@pytest.mark.parametrize(
    ("rng", "target", "margin", "wide"),
    [
        (ValueRange(4e4, 1.0, 0, 10), LowPrecision.FLOAT16, 2.0, True),  # 8e4 > 65504
        (ValueRange(4e4, 1.0, 0, 10), LowPrecision.FLOAT16, 1.0, False),
        (ValueRange(4e4, 1.0, 0, 10), LowPrecision.BFLOAT16, 2.0, False),
        (ValueRange(2e38, 1.0, 0, 10), LowPrecision.BFLOAT16, 2.0, True),
        # Every non-zero value is below the float16 normal range and some flush to zero.
        (ValueRange(3e-5, 1e-8, 0, 10), LowPrecision.FLOAT16, 2.0, True),
        # Tiny elements of a tensor of ordinary scale flush below its rounding error: harmless.
        (ValueRange(1.0, 1e-9, 0, 10), LowPrecision.FLOAT16, 2.0, False),
        # Small, but nothing flushes.
        (ValueRange(3e-5, 1e-6, 0, 10), LowPrecision.FLOAT16, 2.0, False),
        (ValueRange(3e-5, 1e-8, 0, 10), LowPrecision.BFLOAT16, 2.0, False),
        (ValueRange(0.0, math.inf, 0, 10), LowPrecision.FLOAT16, 2.0, False),  # all zeros
    ],
)
def test_wide_value_rules(rng: ValueRange, target: LowPrecision, margin: float, wide: bool) -> None:
    model = _typed_model()
    found = wide_values_from_ranges(model, {"q": rng, "wq": rng}, target, margin)
    assert {v.name for v in found} == ({"q"} if wide else set())  # constants are not measured
    if wide:
        evidence = next(iter(found.values()))
        assert ("flush" in evidence) == (rng.absmax < 1) and f"margin {margin:g}" in evidence


def test_cli_data_is_repeatable_and_calibrates(files: dict[str, Path], tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    args = [
        "convert",
        str(files["model"]),
        str(tmp_path / "out.onnx"),
        "--to",
        "fp16",
        "--data",
        str(files["b1"]),
        "--data",
        str(files["b2"]),
        "--report",
        str(report),
    ]
    assert main(args) == 0
    data = json.loads(report.read_text())
    kept = {k["name"]: k for k in data["kept_fp32"]}
    assert kept["attn/scores"]["category"] == DATA_RANGE
    assert data["validation"]["batches"] == 2
    assert main([*args, "--no-calibrate"]) == 0
    data = json.loads(report.read_text())
    assert "attn/scores" not in {k["name"] for k in data["kept_fp32"]}
    assert any(
        "non-finite values start at MatMul node 'attn/scores'" in n
        for n in data["validation"]["notes"]
    )


def test_external_data_is_copied_when_it_cannot_be_linked(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mixprec.analysis.calibrate as calibrate_module  # noqa: PLC0415

    def no_link(*args: object) -> None:
        raise OSError("cross-device link")

    monkeypatch.setattr(calibrate_module.os, "link", no_link)
    path = write_model(tmp_path / "external", save_as_external_data=True, location="weights.bin")
    before = (path.parent / "weights.bin").read_bytes()
    assert calibrate(path, files["b1"], max_outputs_per_run=4) == calibrate(
        files["model"], files["b1"]
    )
    assert (path.parent / "weights.bin").read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["attention.onnx", "weights.bin"]


def test_tune_starts_from_the_calibrated_plan(files: dict[str, Path]) -> None:
    from mixprec.tune import Tolerance, tune  # noqa: PLC0415

    result = tune(files["model"], [files["b1"], files["b2"]], tolerance=Tolerance(atol=5e-2, rtol=5e-2))
    assert result.met
    # The measured overflow is kept FP32 before any search: the default plan already meets it.
    assert result.evaluations <= 2
    assert result.report is not None
    kept = {k.name: k.category for k in result.report.kept_fp32}
    assert kept.get("attn/scores") == "range measured on data"


def _dynamic_conv_attention(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """Conv -> SiLU -> self-attention scores (a float MatMul of activations), quantized by
    onnxruntime's `quantize_dynamic`: the Conv becomes ConvInteger, whose int32 accumulator,
    cast to float, reaches ~1e5 before it is multiplied by its scale back to ~1."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.1, (32, 16, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c"], ["s"], name="sigmoid"),
        helper.make_node("Mul", ["c", "s"], ["a"], name="silu"),
        helper.make_node("Reshape", ["a", "flat"], ["f"], name="flatten"),
        helper.make_node("Transpose", ["f"], ["ft"], name="transpose", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["ft", "f"], ["y"], name="scores"),
    ]
    graph = helper.make_graph(
        nodes, "dynamic", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 64])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([1, 32, 64], np.int64), "flat")],
    )
    source, quantized = tmp_path / "float.onnx", tmp_path / "dynamic.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)
    quantize_dynamic(source, quantized, weight_type=QuantType.QUInt8)
    return quantized, {"x": rng.normal(0, 3, (1, 16, 8, 8)).astype(np.float32)}


def test_a_measured_accumulator_does_not_hold_what_its_scale_brings_back_in_range(tmp_path: Path) -> None:
    # The cast accumulator leaves float16's range on the data, so its Cast and the Mul by its
    # scale stay FP32; the Mul's output is measured to fit, so the SiLU and the attention
    # MatMul after it are free to convert (a value measured to fit carries no range on), and
    # nothing is blamed on an out-of-range constant.
    model, feeds = _dynamic_conv_attention(tmp_path)
    assert "ConvInteger" in {n.op_type for n in onnx.load(model).graph.node}
    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda", data=[feeds])
    kept = {d.name: d for d in result.report.kept_fp32}
    by_op = {d.op_type: d.category for d in result.report.kept_fp32}
    assert by_op.get("Cast") == DATA_RANGE and by_op.get("Mul") == DATA_RANGE
    assert not {"out-of-range constant", "unknown op"} & {d.category for d in result.report.kept_fp32}
    assert "scores" not in kept and result.report.low_by_op.get("MatMul") == 1
    errors = result.report.validation.outputs
    assert errors and all(o.nan_count == 0 and o.inf_count == 0 and o.scaled_error < 0.01 for o in errors)


def _scaled_attention(in_function: bool) -> onnx.ModelProto:
    """The attention model with its query and key weights 30 times larger: its scores overflow
    float16 on N(0, 1) inputs; `in_function`: its nodes are the body of one local function."""
    model = attention_model()
    for init in model.graph.initializer:
        if init.name in ("wq", "wk"):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 30, init.name))
    if not in_function:
        return model
    graph = model.graph
    weights = [helper.make_node("Constant", [], [t.name], value=t) for t in graph.initializer]
    body = helper.make_function(
        "local", "Attn", ["x"], ["y"], [*weights, *graph.node], [helper.make_opsetid("", 17)]
    )
    call = helper.make_graph([helper.make_node("Attn", ["x"], ["y"], domain="local")], "g", graph.input, graph.output)
    return helper.make_model(
        call, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)], functions=[body], ir_version=10
    )


@pytest.mark.parametrize("in_function", [False, True])
def test_an_overflow_on_generated_inputs_is_planned_again_with_their_ranges(tmp_path: Path, in_function: bool) -> None:
    """With no data, the attention's scores overflow float16 on the generated N(0, 1) inputs:
    the first plan gains non-finite outputs there, so the model is planned again with the
    ranges measured on those inputs (on the model with its function inlined, the one that names
    the scores), the scores stay FP32, and the output written is finite. The ranges, measured
    on random inputs, are not the result's. With calibration off, the first plan stands and
    overflows."""
    model = _scaled_attention(in_function)
    source = tmp_path / "scaled.onnx"
    onnx.save(model, str(source))
    out = tmp_path / "out.onnx"
    result = mixprec.convert(source, out, target_dtype="fp16", runtime="ort-cuda")
    (note,) = [n for n in result.report.notes if n.startswith("planned twice")]
    assert "non-finite values start at MatMul node 'attn/scores'" in note, note
    assert result.report.source == str(source)
    kept = {k.name: k.category for k in result.report.kept_fp32}
    assert kept.get("attn/scores") == DATA_RANGE, kept
    assert all(o.new_nonfinite == 0 for o in result.report.validation.outputs)
    x = {"x": np.random.default_rng(3).normal(0, 1, (1, 8, 64)).astype(np.float32)}
    assert np.isfinite(run(out, x)).all()
    seconds = result.report.seconds
    assert seconds["validate"] > 0 and seconds["total"] >= sum(v for k, v in seconds.items() if k != "total") * 0.99
    assert result.ranges is None
    plain = mixprec.convert(source, tmp_path / "plain.onnx", target_dtype="fp16", runtime="ort-cuda", calibrate=False)
    assert not [n for n in plain.report.notes if n.startswith("planned twice")]
    assert any(o.new_nonfinite for o in plain.report.validation.outputs)
    assert not np.isfinite(run(tmp_path / "plain.onnx", x)).all()


def test_a_tolerance_failed_on_generated_inputs_for_an_overflow_is_planned_again(tmp_path: Path) -> None:
    """With a tolerance, the first plan's overflow fails the check on the generated inputs; the
    model is planned again with their ranges and meets it, and only then written. A model whose
    ranges change nothing fails as before."""
    source = tmp_path / "scaled.onnx"
    onnx.save(_scaled_attention(False), str(source))
    out = tmp_path / "out.onnx"
    result = mixprec.convert(source, out, target_dtype="fp16", runtime="ort-cuda", tolerance=(0.05, 0.05))
    assert [n for n in result.report.notes if n.startswith("planned twice")]
    assert all(o.within_tolerance for o in result.report.validation.outputs)
    assert out.is_file()
    with pytest.raises(mixprec.ValidationFailure, match="differs from the FP32 model beyond atol=1e-09"):
        mixprec.convert(source, tmp_path / "strict.onnx", target_dtype="fp16", runtime="ort-cuda", tolerance=(1e-9, 0.0))
    assert not (tmp_path / "strict.onnx").exists()
