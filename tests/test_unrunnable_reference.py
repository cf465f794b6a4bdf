"""A model whose FP32 form onnxruntime cannot run (a quantizer wrote a per-axis
DequantizeLinear scale of the wrong rank): the conversion ends with "numerics not checked"
(exit 5, model written), and the generated-input retry stays bounded."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mixprec.cli import main
from mixprec.runtime import data as data_mod
from mixprec.runtime.isolated import run_isolated


def _bad_per_axis_scale(path: Path) -> None:
    """x[N, 3, H, W] -> Conv with weights dequantized per output channel, the scale written as
    [1, 8] instead of [8]: valid to the checker, fails when onnxruntime runs it."""
    rng = np.random.default_rng(0)
    tensors = [
        numpy_helper.from_array(rng.integers(-100, 100, (8, 3, 3, 3)).astype(np.int8), "w_q"),
        numpy_helper.from_array(rng.uniform(1e-3, 2e-3, (1, 8)).astype(np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(8, np.int8), "w_zero"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], axis=0, name="w_dq"),
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
            helper.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, "H", "W"])], tensors,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), str(path))


def test_reference_that_cannot_run_is_unchecked_with_bounded_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    source, out = tmp_path / "bad.onnx", tmp_path / "out.onnx"
    _bad_per_axis_scale(source)
    generated: list[dict[str, tuple[int, ...]]] = []
    original = data_mod.generate_inputs

    def recording(specs, **kwargs):  # type: ignore[no-untyped-def]
        feeds = original(specs, **kwargs)
        generated.append({name: array.shape for name, array in feeds.items()})
        return feeds

    monkeypatch.setattr(data_mod, "generate_inputs", recording)
    assert main(["convert", str(source), str(out)]) == 5
    assert out.exists()
    err = capsys.readouterr().err
    assert "numerics not checked: the FP32 model fails on generated inputs" in err
    assert "scale must be 1D" in err and "/onnxruntime_src/" not in err
    # The failure does not depend on the input size: every size up to the element cap fails
    # (each tried first in the child process), then one try at batch 1 fails alike and ends it;
    # the batch dimension never grows, and no try allocates more than the cap.
    assert [shapes["x"][0] for shapes in generated] == [2, 2, 2, 2, 1], generated
    assert all(math.prod(shapes["x"]) <= 1 << 23 for shapes in generated)


def test_generated_shapes_grow_features_not_the_batch() -> None:
    specs = [
        data_mod.InputSpec("ids", np.dtype(np.int64), ("batch", "seq")),
        data_mod.InputSpec("mask", np.dtype(np.int64), ("batch", "seq")),
        data_mod.InputSpec("audio", np.dtype(np.float32), ("samples",)),
        data_mod.InputSpec("image", np.dtype(np.float32), (None, 3, "h", "w")),
    ]
    shapes = data_mod.generated_shapes(specs, dim_value=128, batch_value=2)
    assert shapes == {"ids": (2, 128), "mask": (2, 128), "audio": (128,), "image": (2, 3, 128, 128)}
    assert data_mod.generated_shapes(specs, dim_value=16) == {
        "ids": (16, 16), "mask": (16, 16), "audio": (16,), "image": (16, 3, 16, 16)
    }


def test_a_dimension_written_as_arithmetic_of_others_takes_its_value() -> None:
    specs = [
        data_mod.InputSpec("ids", np.dtype(np.int64), ("batch", "sequence_length")),
        data_mod.InputSpec("mask", np.dtype(np.int64), ("batch", "past_sequence_length + sequence_length")),
        data_mod.InputSpec("past", np.dtype(np.float32), ("batch", 2, "past_sequence_length", 8)),
        data_mod.InputSpec("doubled", np.dtype(np.float32), ("2*batch", 8)),
        data_mod.InputSpec(
            "odd", np.dtype(np.float32),
            ("2*sequence_length", "(past_sequence_length - 1) // 2", "s - s - 1", "s // 0", "a.b", "n*1000000*1000000",
             "+".join(["s"] * 5000)),
        ),
    ]
    assert data_mod.generated_shapes(specs, dim_value=16, batch_value=2) == {
        "ids": (2, 16), "mask": (2, 32), "past": (2, 2, 16, 8),
        "doubled": (4, 8),  # arithmetic of the batch, leading or not
        # a negative size, a division by zero, a size far beyond its names' or arithmetic nested
        # too deep to read: the usual size
        "odd": (32, 7, 16, 16, 16, 16, 16),
    }


def _decoder_step_with_cache(path: Path) -> None:
    """One decoder step with a key cache, its inputs as optimum exports them: token ids
    [batch, sequence_length], the past keys [batch, past_sequence_length, 8] and the attention
    mask over both, [batch, 'past_sequence_length + sequence_length']. The mask's bias is added
    to scores over the past and new keys: inputs whose mask length is not their sum fail."""
    rng = np.random.default_rng(0)
    tensors = [
        numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "embedding"),
        numpy_helper.from_array(rng.standard_normal((8, 32)).astype(np.float32), "head"),
        numpy_helper.from_array(np.array([1], np.int64), "one_axis"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(-1e4, np.float32), "masked"),
    ]
    nodes = [
        helper.make_node("Gather", ["embedding", "input_ids"], ["x"]),
        helper.make_node("Concat", ["past_key", "x"], ["present_key"], axis=1),
        helper.make_node("Transpose", ["present_key"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["x", "kt"], ["scores"]),
        helper.make_node("Unsqueeze", ["attention_mask", "one_axis"], ["mask3"]),
        helper.make_node("Cast", ["mask3"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "maskf"], ["hidden"]),
        helper.make_node("Mul", ["hidden", "masked"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["biased"]),
        helper.make_node("Softmax", ["biased"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "present_key"], ["context"]),
        helper.make_node("MatMul", ["context", "head"], ["logits"]),
    ]
    both = "past_sequence_length + sequence_length"
    graph = helper.make_graph(
        nodes, "decoder_step",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", both]),
            helper.make_tensor_value_info("past_key", TensorProto.FLOAT, ["batch_size", "past_sequence_length", 8]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", 32]),
            helper.make_tensor_value_info("present_key", TensorProto.FLOAT, ["batch_size", both, 8]),
        ],
        tensors,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_a_decoder_with_a_cache_is_checked_on_inputs_of_consistent_lengths(tmp_path: Path) -> None:
    import mixprec  # noqa: PLC0415

    source = tmp_path / "decoder.onnx"
    _decoder_step_with_cache(source)
    result = mixprec.convert(source, tmp_path / "out.onnx", runtime="ort-cpu")
    validation = result.report.validation
    assert validation.numerics.startswith("checked"), validation.numerics
    assert not validation.numerics_unchecked
    assert {o.name for o in validation.outputs} == {"logits", "present_key"}
    assert all(o.nan_count == 0 and o.scaled_error < 0.01 for o in validation.outputs), validation.outputs


def _pyramid(path: Path) -> None:
    """x[1, 1, H, W] -> its 64x and 32x max-pooled maps (ceil mode), the coarser one resized x2 and
    concatenated with the other: a detector's feature pyramid, which runs only where H and W halve
    often enough (both maps are 1x1 at H = 2 and at 16, and the Concat fails alike; 128 runs)."""
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    graph = helper.make_graph(
        [
            helper.make_node("MaxPool", ["x"], ["p64"], kernel_shape=[64, 64], strides=[64, 64], ceil_mode=1),
            helper.make_node("MaxPool", ["x"], ["p32"], kernel_shape=[32, 32], strides=[32, 32], ceil_mode=1),
            helper.make_node("Resize", ["p64", "", "scales"], ["up"], mode="nearest"),
            helper.make_node("Concat", ["up", "p32"], ["cat"], axis=1),
            helper.make_node("Relu", ["cat"], ["y"]),
        ],
        "pyramid", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, None, None])], [scales],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_generated_sizes_grow_past_a_failure_small_inputs_share(tmp_path: Path) -> None:
    import mixprec  # noqa: PLC0415

    source = tmp_path / "pyramid.onnx"
    _pyramid(source)
    result = mixprec.convert(source, tmp_path / "out.onnx", target_dtype="fp16", validate="run")
    v = result.report.validation
    assert v.runtime != "reference-fails" and v.outputs, v.notes
    assert any("generated inputs use 128 for symbolic dimensions" in note for note in v.notes)


def _framing_model(path: Path) -> None:
    """An audio front end that frames samples with a Scan (64 samples carried, 64 new per frame),
    as onnx_asr's feature extractors do, then a projection: onnxruntime dies with SIGFPE on a
    signal shorter than one frame (a Scan over a zero-length axis)."""
    c = lambda name, value: numpy_helper.from_array(np.array(value, np.int64), name)  # noqa: E731
    body = helper.make_graph(
        [
            helper.make_node("Concat", ["prev", "curr"], ["frame"], axis=-1),
            helper.make_node("Slice", ["frame", "hop", "big", "one"], ["next"]),
        ],
        "body",
        [helper.make_tensor_value_info("prev", TensorProto.FLOAT, [2, 64]),
         helper.make_tensor_value_info("curr", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("next", TensorProto.FLOAT, [2, 64]),
         helper.make_tensor_value_info("frame", TensorProto.FLOAT, [2, 128])],
        [c("hop", [64]), c("big", [1 << 62]), c("one", [1])],
    )
    weight = numpy_helper.from_array(np.random.default_rng(0).normal(0, 0.05, (128, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Slice", ["x", "zero", "w0", "axis1"], ["x0"]),
            helper.make_node("Slice", ["x", "w0", "end", "axis1"], ["rest"]),
            helper.make_node("Reshape", ["rest", "shape"], ["chunks"]),
            helper.make_node("Scan", ["x0", "chunks"], ["last", "frames"], body=body, num_scan_inputs=1,
                             scan_input_axes=[1], scan_output_axes=[1]),
            helper.make_node("MatMul", ["frames", "w"], ["y"], name="project"),
        ],
        "framing", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "F", 8])],
        [c("zero", [0]), c("w0", [64]), c("end", [1 << 62]), c("axis1", [1]), c("shape", [0, -1, 64]), weight],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.slow
def test_generated_inputs_that_crash_the_fp32_model_are_a_failed_size_not_the_end(tmp_path: Path) -> None:
    """onnxruntime crashes (SIGFPE) on the FP32 model for the small generated sizes: each size
    is tried in the child process first, so the conversion goes on to the size that runs and
    checks the numerics there. Run as a command, so a regression fails this test only."""
    source = tmp_path / "framing.onnx"
    _framing_model(source)
    done = subprocess.run(
        [sys.executable, "-m", "mixprec", "convert", str(source), str(tmp_path / "out.onnx")],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "generated inputs use 128 for symbolic dimensions" in done.stdout, done.stdout
    assert "numerics: checked on 1 batch(es)" in done.stdout


def test_the_child_runs_a_model_at_the_optimization_level_asked(tmp_path: Path) -> None:
    """A DequantizeLinear -> Concat -> QuantizeLinear group with float16 scales: onnxruntime's
    default options fuse it into QLinearConcat, which takes float scales only, and refuse it;
    with optimizations off (the level of mixprec's in-process reference) it runs."""
    scale = lambda name, value: numpy_helper.from_array(np.array(value, np.float16), name)  # noqa: E731
    zero = lambda name: numpy_helper.from_array(np.array(0, np.uint8), name)  # noqa: E731
    graph = helper.make_graph(
        [
            helper.make_node("DequantizeLinear", ["a", "sa", "za"], ["fa"]),
            helper.make_node("DequantizeLinear", ["b", "sb", "zb"], ["fb"]),
            helper.make_node("Concat", ["fa", "fb"], ["c"], axis=1),
            helper.make_node("QuantizeLinear", ["c", "sc", "zc"], ["y"]),
        ],
        "qconcat",
        [helper.make_tensor_value_info(n, TensorProto.UINT8, [1, 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, [1, 8])],
        [scale("sa", 0.5), zero("za"), scale("sb", 0.25), zero("zb"), scale("sc", 0.5), zero("zc")],
    )
    path = tmp_path / "qconcat.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))
    feeds = {"a": np.arange(4, dtype=np.uint8)[None], "b": np.arange(4, dtype=np.uint8)[None]}
    default = run_isolated(path, feeds)
    assert not default.ok and "QLinearConcat" in (default.error or "")
    unoptimized = run_isolated(path, feeds, graph_optimization="disable")
    assert unoptimized.ok and unoptimized.outputs is not None
    np.testing.assert_array_equal(unoptimized.outputs["y"], [[0, 1, 2, 3, 0, 0, 1, 2]])


def test_a_child_that_writes_something_else_before_its_answer_is_no_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime may log to standard output (OpenVINO's warnings do). A child that writes a line
    that is not its answer ends the request at once, as a failure, instead of leaving the
    converter waiting; a child that sends its answers through `answer_channel` is not disturbed
    by what the runtime prints."""
    import os
    import time

    from mixprec.runtime.isolated import Worker

    (tmp_path / "chatty_child.py").write_text(
        "import json, sys\n"
        "for line in sys.stdin:\n"
        "    print('runtime warning: something', flush=True)\n"
        "    print(json.dumps({'ok': True}), flush=True)\n"
    )
    (tmp_path / "channelled_child.py").write_text(
        "import json, sys\n"
        "from mixprec.runtime.isolated import answer_channel\n"
        "channel = answer_channel()\n"
        "for line in sys.stdin:\n"
        "    print('runtime warning: something', flush=True)\n"
        "    print(json.dumps({'ok': True}), file=channel, flush=True)\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    chatty = Worker("chatty_child", "a runtime")
    start = time.perf_counter()
    message, death = chatty.request(["x"], timeout=60)
    assert death == "exit" and "answered something else: runtime warning" in message
    assert time.perf_counter() - start < 30 and chatty.process is None
    channelled = Worker("channelled_child", "a runtime")
    assert channelled.request(["x"], timeout=60) == {"ok": True}
    assert channelled.request(["y"], timeout=60) == {"ok": True}  # the same child answers again
    channelled.stop()
