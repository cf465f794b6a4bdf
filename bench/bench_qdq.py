"""QDQ models in 16 bits, judged against the INT8 + FP32 model run two ways, beside other tools.

Models, quantized with onnxruntime's `quantize_static` (QDQ, per channel, int32 biases, MinMax):
the light SqueezeNet shipped with `onnx` (seeded weights, opset 13; calibration on generated
inputs), a PyTorch transformer encoder (TorchScript export, MatMul/Gemm quantized) and a PyTorch
Conv1d + GRU speech encoder (skipped without torch or with `--no-torch`); more light CNNs by name;
real detectors from the corpus (`--corpus ddddocr_det nudenet_320n`: bench/corpus.py's cache,
every op type the quantizer knows, calibration on the corpus's own inputs, test inputs of the same
kind). Each is converted for several targets and runtime profiles, then run on several batches.
With `--quantizer nncf` the same FP32 models are quantized by NNCF instead (`nncf.quantize`, ONNX
backend, default preset, same calibration inputs; run from bench/out/nncf-venv: bench/README.md):
Q/DQ on the inputs of Conv/MatMul/Add, float biases, Concat unquantized. With `--quantizer quark`
AMD Quark's ONNX quantizer does, with a named configuration (`--quark-config`, default XINT8:
power-of-two scales, the NPU form; run from bench/out/quark-venv).

The reference is the quantized FP32 model run **unfused** (onnxruntime with graph optimizations
off: DequantizeLinear, the op and QuantizeLinear as written, the form a 16-bit runtime runs) and
**fused** (default options: onnxruntime's CPU provider fuses groups into integer kernels). The
`INT8+FP32 fused` row is the difference between the two references (integer kernels round
differently); for detectors the `INT8+FP32 noisy` row runs the unfused model on inputs with
half a grey level of Gaussian noise: how sensitive the task output is by itself. The converted
model (16-bit numerics emulated in FP32, `mixprec.validate.emulate`) is compared with both, so
conversion error and quantization noise are told apart. Agreement: top-1 (per row; per token for
the transformer) and the smallest cosine similarity over the batches; detectors: `k/n I -m+e`,
k of n inputs with the same boxes (corpus metric: same class, IoU >= 0.9, same count), I the
smallest IoU of a reference box with its same-class match, m reference boxes lost, e boxes added.

Columns: groups (ops between DequantizeLinear and QuantizeLinear with a 16-bit float side; `+Ni`:
N more groups of data movement written on integers, which have no float side left), outside (the
float ops outside quantized groups in 16 bits: where a quantizer wraps no op in Q/DQ on both sides,
NNCF's way, this is the figure), folded
(constant DequantizeLinear folded into float constants), casts (runtime Casts; `adjacent`: none
beside a Q/DQ node), ints (integer tensors byte-identical, folded ones aside), ort-cpu (float16:
runs on onnxruntime's CPU provider with default options, and its agreement with the unfused model).

Rows of other tools: `fp16 occ` is onnxconverter-common's `float16.convert_float_to_float16(...,
keep_io_types=True)` of the same QDQ model; `fp16 modelopt` is ModelOpt's own INT8 + FP16 output
of the FP32 model (`modelopt.onnx.quantization --quantize_mode int8 --calibration_method max
--high_precision_dtype fp16`, `--modelopt`, run from bench/out/modelopt-venv: bench/README.md),
compared with ModelOpt's INT8 + FP32 output (`--high_precision_dtype fp32`) of the same
calibration, since it quantizes differently. Their `groups` is counted from the types: ops reading
a dequantized activation whose output is 16-bit; `vs unfused`/`vs fused` are their real float16
runs on onnxruntime's CPU provider with optimizations off; `casts` N beside: Casts reading a
DequantizeLinear or feeding a QuantizeLinear.

    python bench/bench_qdq.py                        # squeezenet, transformer, speech
    python bench/bench_qdq.py --corpus ddddocr_det --modelopt --batches 8 --out /tmp/qdq
    python bench/bench_qdq.py --cnn --corpus ddddocr_det --no-torch   # the detector alone
    python bench/bench_qdq.py --corpus nudenet_320n --quantizer nncf --batches 4
    python bench/bench_qdq.py --corpus nudenet_320n --quantizer quark --quark-config XINT8 --batches 4
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter

ROOT = Path(__file__).resolve().parent.parent
TARGETS = [("fp16", "ort-cuda"), ("fp16", "tensorrt"), ("bf16", "tensorrt"), ("bf16", "onnx"), ("fp16", "ort-cpu")]
Batch = dict[str, np.ndarray]


@dataclass
class Case:
    """A quantized model and how to feed and judge it."""

    name: str
    path: Path
    batches: list[Batch]
    per_token: bool = False  # top-1 over the last axis of every position
    judge: Callable[[list[np.ndarray], list[np.ndarray]], str] | None = None  # task agreement (detectors)
    fp32: Path | None = None  # the model before quantization (ModelOpt quantizes it itself)
    calibration: list[Batch] | None = None  # its calibration inputs (else the first batches)


def _save_without_weight_inputs(model: onnx.ModelProto, path: Path) -> list[onnx.ValueInfoProto]:
    """Save `model` with its initializers no longer listed as graph inputs (IR 3 listed them;
    the quantizer wants IR 4); its real inputs."""
    weights = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in weights]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    onnx.save(model, str(path))
    return inputs


def _cnn(name: str, folder: Path, count: int) -> Case:
    from test_qdq import _quantize  # noqa: PLC0415
    from test_real_cnns import LIGHT, realistic_weights  # noqa: PLC0415

    model = onnx.version_converter.convert_version(realistic_weights(onnx.load(str(LIGHT / f"light_{name}.onnx"))), 13)
    source = folder / f"{name}.onnx"
    inputs = _save_without_weight_inputs(model, source)
    shape = [d.dim_value for d in inputs[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    calibration = [{inputs[0].name: rng.uniform(0, 1, shape).astype(np.float32)} for _ in range(2)]
    ops = ["Conv", "MaxPool", "Concat", "GlobalAveragePool", "Add", "Gemm", "MatMul"]
    _quantize(source, folder / f"{name}_qdq.onnx", calibration, op_types_to_quantize=ops, per_channel=True)
    test = np.random.default_rng(1)
    batches = [{inputs[0].name: test.uniform(0, 1, shape).astype(np.float32)} for _ in range(count)]
    return Case(name, folder / f"{name}_qdq.onnx", batches, fp32=source, calibration=calibration)


def _transformer(folder: Path, count: int) -> Case:
    import torch_models  # noqa: PLC0415
    from test_qdq import _quantize  # noqa: PLC0415

    fp32 = torch_models.export(torch_models.make_model(), folder / "encoder.onnx", dynamo=False)
    rng = np.random.default_rng(0)

    def batch() -> Batch:
        return {
            "input_ids": rng.integers(0, torch_models.VOCAB, (2, 6)).astype(np.int64),
            "attention_mask": np.ones((2, 6), np.int64),
        }

    _quantize(fp32, folder / "encoder_qdq.onnx", [batch() for _ in range(4)], op_types_to_quantize=["MatMul", "Gemm"])
    return Case("transformer", folder / "encoder_qdq.onnx", [batch() for _ in range(count)], per_token=True, fp32=Path(fp32))


def _speech(folder: Path, count: int) -> Case:
    from test_qdq_fold import speech_encoder_qdq  # noqa: PLC0415

    rng = np.random.default_rng(3)
    path = speech_encoder_qdq(folder)
    batches = [{"x": rng.normal(0, 1, (1, 16, 50)).astype(np.float32)} for _ in range(count)]
    return Case("speech", path, batches, fp32=folder / "speech.onnx")


# Real-model corpus detectors (bench/corpus.py): their own inputs, calibration on the corpus's
# inputs, further inputs of the same kind for the test batches.
DETECTOR_TEXTS = ("拼图验证", "点选文字", "天地玄黄", "宇宙洪荒", "日月盈昃", "辰宿列张", "寒来暑往", "秋收冬藏",
                  "闰余成岁", "律吕调阳", "云腾致雨", "露结为霜")


NOISE = 0.5 / 255  # input noise of the `INT8+FP32 noisy` row: half a grey level, relative to the input's range


def _detector_inputs(name: str, count: int) -> tuple[list[Batch], list[Batch]]:
    """(calibration inputs: the corpus's own, test inputs: `count` of the same kind)."""
    import corpus  # noqa: PLC0415

    if name == "ddddocr_det":
        texts = [DETECTOR_TEXTS[k % len(DETECTOR_TEXTS)] for k in range(count)]
        return corpus._ddddocr_det_samples(), corpus._ddddocr_det_samples(texts)  # noqa: SLF001
    if name == "nudenet_320n":
        return corpus._nudenet_samples(), corpus._nudenet_samples(range(count))  # noqa: SLF001
    raise SystemExit(f"--corpus: no detector inputs for {name!r} (ddddocr_det, nudenet_320n)")


def _boxes_judge(name: str) -> Callable[[list[np.ndarray], list[np.ndarray]], str]:
    """Boxes decoded as the corpus decodes them: `k/n I -m+e`: k of n inputs whose boxes all
    match (same class, IoU >= 0.9, same count; nudenet without boxes: raw output at cosine >=
    0.999), I the smallest IoU of a reference box with its best same-class box (those at IoU >=
    0.5: the same object), m reference boxes with no such box, e boxes with no reference."""
    import corpus  # noqa: PLC0415

    task = corpus.task_for(name)

    def decode(raw: np.ndarray):  # noqa: ANN202
        return task.decode(lambda _feeds: {"output": raw}, None)

    def judge(got: list[np.ndarray], expected: list[np.ndarray]) -> str:
        same, smallest, missing, extra = 0, 1.0, 0, 0
        for g, e in zip(got, expected):
            dg, de = decode(g), decode(e)
            same += bool(task.agree(de, dg)[0])
            boxes_g, boxes_e = (dg[0], de[0]) if isinstance(dg, tuple) else (dg, de)
            matched = 0
            for r in boxes_e:
                best = max((corpus.iou(np.array(r[:4]), np.array(b[:4])) for b in boxes_g if b[4] == r[4]), default=0.0)
                if best >= 0.5:  # the same object: how well its box agrees
                    smallest, matched = min(smallest, best), matched + 1
            missing += len(boxes_e) - matched
            extra += max(0, len(boxes_g) - matched)
        return f"{same}/{len(got)} {smallest:.2f} -{missing}+{extra}"

    return judge


def _detector(name: str, folder: Path, count: int) -> Case:
    """A corpus detector quantized with `quantize_static` (QDQ, per channel, MinMax on the
    corpus's inputs; opset 13 at least, which per-channel DequantizeLinear needs)."""
    import corpus  # noqa: PLC0415
    from test_qdq import _quantize  # noqa: PLC0415

    source = corpus.model_path(name)
    if not source.exists():
        raise SystemExit(f"--corpus {name}: {source} is missing (python bench/corpus.py build)")
    model = onnx.load(str(source))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    if opset < 13:
        model = onnx.version_converter.convert_version(model, 13)
    fp32 = folder / f"{name}.onnx"
    _save_without_weight_inputs(model, fp32)
    calibration, batches = _detector_inputs(name, count)
    _quantize(fp32, folder / f"{name}_qdq.onnx", calibration, per_channel=True)
    return Case(name, folder / f"{name}_qdq.onnx", batches, judge=_boxes_judge(name), fp32=fp32, calibration=calibration)


def _session(model: onnx.ModelProto | Path, fused: bool) -> Callable[[Batch], np.ndarray]:
    import onnxruntime as ort  # noqa: PLC0415

    options = ort.SessionOptions()
    if not fused:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    inputs = {i.name: i.type for i in session.get_inputs()}

    def run(feeds: Batch) -> np.ndarray:
        prepared = {
            k: v.astype(np.float16) if inputs[k] == "tensor(float16)" else v for k, v in feeds.items() if k in inputs
        }
        return np.asarray(session.run(None, prepared)[0], np.float32)

    return run


def _agreement(got: list[np.ndarray], expected: list[np.ndarray], per_token: bool) -> str:
    """Top-1 agreement and the smallest cosine similarity over the batches."""
    same = total = 0
    cosine = 1.0
    for g, e in zip(got, expected):
        rows_g, rows_e = (g.reshape(-1, g.shape[-1]), e.reshape(-1, e.shape[-1])) if per_token else (g.reshape(1, -1), e.reshape(1, -1))
        same += int((rows_g.argmax(-1) == rows_e.argmax(-1)).sum())
        total += rows_g.shape[0]
        a, b = g.reshape(-1).astype(np.float64), e.reshape(-1).astype(np.float64)
        cosine = min(cosine, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30)))
    return f"{same}/{total} {cosine:.5f}"


def _agree(case: Case, got: list[np.ndarray], expected: list[np.ndarray]) -> str:
    return case.judge(got, expected) if case.judge else _agreement(got, expected, case.per_token)


def _casts_beside_qdq(model: onnx.ModelProto) -> int:
    """Casts that read a DequantizeLinear's output or feed a QuantizeLinear (main graph)."""
    dq_outputs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    q_inputs = {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    return sum(n.op_type == "Cast" and (n.input[0] in dq_outputs or n.output[0] in q_inputs) for n in model.graph.node)


def _integers_kept(source: onnx.ModelProto, converted: onnx.ModelProto) -> bool:
    """Whether every integer initializer still in the converted model is byte-identical."""
    kept = {t.name: t for t in converted.graph.initializer}
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
    return all(kept[t.name] == t for t in source.graph.initializer if t.data_type not in floats and t.name in kept)


def _row(case: Case, target: str, runtime: str, folder: Path, references: dict[str, list[np.ndarray]]) -> str:
    import mixprec  # noqa: PLC0415
    from mixprec.validate.emulate import emulate_low_precision  # noqa: PLC0415
    from test_qdq import assert_pairs_adjacent  # noqa: PLC0415

    out = folder / "converted.onnx"
    result = mixprec.convert(case.path, out, target_dtype=target, runtime=runtime, validate="run", overwrite=True)
    report, source, converted = result.report, onnx.load(str(case.path)), onnx.load(str(out))
    q = report.quantization
    try:
        assert_pairs_adjacent(source, converted, q.folded, q.on_integers)
        pairs = "adjacent"
    except AssertionError:
        pairs = "BROKEN"
    emulated = _session(emulate_low_precision(converted), fused=False)
    got = [emulated(feeds) for feeds in case.batches]
    total = sum(q.quantized_ops.values())
    groups = f"{q.quantized_low}/{total} {q.quantized_low / total:.0%}" if total else "-"
    if q.on_integers:
        groups += f" +{len(q.on_integers)}i"
    outside = f"{q.float_low_share:.0%}" if q.float_low_share is not None else "-"
    cpu = "-"
    if target == "fp16":
        real = _session(out, fused=True)
        cpu = _agree(case, [real(feeds) for feeds in case.batches], references["unfused"])
    return (
        f"{case.name:<12} {target + ' ' + runtime:<14} {groups:>16} {outside:>7} {len(q.folded):>6} {report.casts_runtime:>5} "
        f"{pairs:<8} {'same' if _integers_kept(source, converted) else 'CHANGED':<7} {report.validation.checker:<7} "
        f"{_agree(case, got, references['unfused']):>16} {_agree(case, got, references['fused']):>16} "
        f"{cpu:>16}"
    )


def _group_share(model: onnx.ModelProto) -> str:
    """Ops that read a dequantized activation (DequantizeLinear of a non-constant; Q/DQ and Casts
    aside) with a 16-bit float output, over all such ops: the `groups` figure for models mixprec
    did not write (types from shape inference)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    constants = {t.name for t in graph.initializer}
    activations = {
        n.output[0] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] not in constants
    }
    ops = [n for n in graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear", "Cast") and set(n.input) & activations]
    low = sum(types.get(n.output[0]) in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16) for n in ops)
    return f"{low}/{len(ops)} {low / len(ops):.0%}" if ops else "-"


def _foreign_row(
    case: Case, label: str, path: Path, references: dict[str, list[np.ndarray]], source: onnx.ModelProto | None
) -> str:
    """A 16-bit model another tool wrote: the checker, casts (all, and beside Q/DQ), integer
    tensors against `source` (when it is the same quantized model), and its real float16 run on
    onnxruntime's CPU provider, optimizations off (`vs unfused`, `vs fused`) and default options
    (`ort-cpu`)."""
    converted = onnx.load(str(path))
    try:
        onnx.checker.check_model(converted, full_check=True)
        checker = "passed"
    except Exception:  # noqa: BLE001 - the row reports it
        checker = "failed"
    beside = _casts_beside_qdq(converted)
    casts = sum(n.op_type == "Cast" for n in converted.graph.node)
    try:
        groups = _group_share(converted)
    except Exception:  # noqa: BLE001 - shape inference rejects the model
        groups = "?"
    runs: dict[str, list[np.ndarray] | str] = {}
    for key, fused in (("unfused", False), ("fused", True)):
        try:
            session = _session(path, fused=fused)
            runs[key] = [session(feeds) for feeds in case.batches]
        except Exception as e:  # noqa: BLE001 - a model onnxruntime rejects
            runs[key] = f"no load: {type(e).__name__}"
    unfused, fused = runs["unfused"], runs["fused"]
    cols = [
        unfused if isinstance(unfused, str) else _agree(case, unfused, references["unfused"]),
        unfused if isinstance(unfused, str) else _agree(case, unfused, references["fused"]),
        fused if isinstance(fused, str) else _agree(case, fused, references["unfused"]),
    ]
    pairs = "adjacent" if beside == 0 else f"{beside} beside"
    ints = "-" if source is None else "same" if _integers_kept(source, converted) else "CHANGED"
    return (
        f"{case.name:<12} {label:<14} {groups:>16} {'-':>7} {'-':>6} {casts:>5} {pairs:<8} {ints:<7} {checker:<7} "
        f"{cols[0][:16]:>16} {cols[1][:16]:>16} {cols[2][:16]:>16}"
    )


def _converter_common(case: Case, folder: Path) -> Path:
    """onnxconverter-common's float16 conversion of the QDQ model (keep_io_types=True)."""
    from onnxconverter_common import float16  # noqa: PLC0415

    converted = float16.convert_float_to_float16(onnx.load(str(case.path)), keep_io_types=True)
    out = folder / f"{case.name}_onnxconverter_common.onnx"
    onnx.save(converted, str(out))
    return out


MODELOPT = ROOT / "bench" / "out" / "modelopt-venv" / "bin" / "python"
# The other quantizers, each run by the python of its own venv (bench/README.md).
QUANTIZERS = {
    "nncf": (ROOT / "bench" / "out" / "nncf-venv" / "bin" / "python", ROOT / "bench" / "quantize_nncf.py"),
    "quark": (ROOT / "bench" / "out" / "quark-venv" / "bin" / "python", ROOT / "bench" / "quantize_quark.py"),
}


def _requantized(case: Case, folder: Path, quantizer: str, options: list[str]) -> Case:
    """The case with its FP32 model quantized by `quantizer` instead (NNCF: `nncf.quantize`, ONNX
    backend, its default MinMax preset; Quark: `ModelQuantizer` with the named configuration in
    `options`), on the same calibration inputs, run in the quantizer's venv."""
    import dataclasses  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    if case.fp32 is None:
        raise SystemExit(f"--quantizer {quantizer}: {case.name} has no FP32 model")
    python, script = QUANTIZERS[quantizer]
    calibration = case.calibration or case.batches[:4]
    data = folder / f"{case.name}_{quantizer}_calibration.npz"
    np.savez(data, **{f"{i}/{name}": array for i, batch in enumerate(calibration) for name, array in batch.items()})
    out = folder / f"{case.name}_{quantizer}.onnx"
    command = [str(python), str(script), str(case.fp32), str(data), str(out), *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode or not out.exists():
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise SystemExit(f"--quantizer {quantizer}: {case.name}: exit {done.returncode}: {lines[-1] if lines else ''}")
    return dataclasses.replace(case, path=out)


def _modelopt(case: Case, folder: Path, precision: str) -> Path:
    """ModelOpt's INT8 quantization of the FP32 model (`modelopt.onnx.quantization`, MinMax
    calibration on the CPU provider) with `precision` (fp16: its INT8 + FP16 output; fp32: its
    own INT8 + FP32 reference), run in ModelOpt's venv (see bench/README.md)."""
    import subprocess  # noqa: PLC0415

    assert case.fp32 is not None
    calibration = case.calibration or case.batches[:4]
    data = folder / f"{case.name}_calibration.npz"
    np.savez(data, **{k: np.concatenate([b[k] for b in calibration]) for k in calibration[0]})
    out = folder / f"{case.name}_modelopt_int8_{precision}.onnx"
    command = [
        str(MODELOPT), "-m", "modelopt.onnx.quantization", "--onnx_path", str(case.fp32), "--quantize_mode", "int8",
        "--calibration_method", "max", "--calibration_data_path", str(data), "--calibration_eps", "cpu",
        "--high_precision_dtype", precision, "--output_path", str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode or not out.exists():
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise RuntimeError(f"exit {done.returncode}: {lines[-1] if lines else ''}")
    return out


def _other_tools(case: Case, folder: Path, references: dict[str, list[np.ndarray]], modelopt: bool) -> None:
    """The rows of onnxconverter-common and ModelOpt for one model."""
    label = "fp16 occ"
    try:
        print(_foreign_row(case, label, _converter_common(case, folder), references, onnx.load(str(case.path))), flush=True)
    except ImportError:
        print(f"{case.name:<12} {label:<14} onnxconverter-common is not installed")
    except Exception as e:  # noqa: BLE001
        print(f"{case.name:<12} {label:<14} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
    if not modelopt:
        return
    label = "fp16 modelopt"
    if not MODELOPT.exists() or case.fp32 is None:
        print(f"{case.name:<12} {label:<14} skipped: {'no FP32 model' if MODELOPT.exists() else f'no {MODELOPT}'}")
        return
    try:
        reference = _modelopt(case, folder, "fp32")
        unfused, fused = _session(reference, fused=False), _session(reference, fused=True)
        own = {"unfused": [unfused(f) for f in case.batches], "fused": [fused(f) for f in case.batches]}
        print(_foreign_row(case, label, _modelopt(case, folder, "fp16"), own, None), flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"{case.name:<12} {label:<14} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cnn", nargs="*", default=["squeezenet"], help="light CNNs shipped with onnx")
    parser.add_argument("--corpus", nargs="*", default=[], help="corpus detectors: ddddocr_det, nudenet_320n (bench/corpus.py)")
    parser.add_argument("--modelopt", action="store_true", help="ModelOpt rows (its venv: bench/README.md)")
    parser.add_argument("--no-torch", action="store_true", help="skip the transformer and speech models")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--quantizer", choices=["onnxruntime", *QUANTIZERS], default="onnxruntime",
                        help="who quantizes the FP32 models (nncf, quark: their venvs, bench/README.md)")
    parser.add_argument("--quark-config", default="XINT8", help="Quark's named configuration (XINT8, A8W8, ...)")
    parser.add_argument("--out", type=Path, help="keep the quantized models here")
    options = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    logging.disable(logging.WARNING)
    import onnxruntime  # noqa: PLC0415

    onnxruntime.set_default_logger_severity(3)
    with tempfile.TemporaryDirectory(prefix="bench_qdq_") as scratch:
        folder = options.out or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        cases = [_cnn(name, folder, options.batches) for name in options.cnn]
        cases += [_detector(name, folder, options.batches) for name in options.corpus]
        try:
            import torch  # noqa: F401, PLC0415
        except ImportError:
            print("torch is not installed: the transformer and speech models are skipped")
        else:
            if not options.no_torch:
                cases += [_transformer(folder, options.batches), _speech(folder, options.batches)]
        if options.quantizer in QUANTIZERS:
            python = QUANTIZERS[options.quantizer][0]
            if not python.exists():
                raise SystemExit(f"--quantizer {options.quantizer}: no {python} (bench/README.md)")
            extra = [options.quark_config] if options.quantizer == "quark" else []
            cases = [_requantized(case, folder, options.quantizer, extra) for case in cases]
            if extra:
                print(f"Quark configuration {options.quark_config}")
        print(f"quantized with {options.quantizer}")
        print(
            f"{'model':<12} {'target':<14} {'groups 16-bit':>16} {'outside':>7} {'folded':>6} {'casts':>5} {'pairs':<8} {'ints':<7} "
            f"{'checker':<7} {'vs unfused':>16} {'vs fused':>16} {'ort-cpu fp16':>16}   (top-1, min cosine over "
            f"{options.batches} batches)"
        )
        for case in cases:
            unfused, fused = _session(case.path, fused=False), _session(case.path, fused=True)
            references = {
                "unfused": [unfused(feeds) for feeds in case.batches],
                "fused": [fused(feeds) for feeds in case.batches],
            }
            noise = _agree(case, references["fused"], references["unfused"])
            print(f"{case.name:<12} {'INT8+FP32 fused':<14} {'':>16} {'':>7} {'':>6} {'':>5} {'':<8} {'':<7} {'':<7} {noise:>16} {'-':>16}")
            if case.judge:  # how sensitive the task output is: the unfused model on inputs with imperceptible noise
                rng = np.random.default_rng(7)
                noisy = [
                    {k: v + rng.normal(0, NOISE * float(v.max() - v.min()), v.shape).astype(v.dtype) for k, v in feeds.items()}
                    for feeds in case.batches
                ]
                jitter = _agree(case, [unfused(feeds) for feeds in noisy], references["unfused"])
                print(f"{case.name:<12} {'INT8+FP32 noisy':<14} {'':>16} {'':>7} {'':>6} {'':>5} {'':<8} {'':<7} {'':<7} {jitter:>16} {'-':>16}")
            for target, runtime in TARGETS:
                try:
                    print(_row(case, target, runtime, folder, references), flush=True)
                except Exception as e:  # noqa: BLE001 - a row reports its failure, the table goes on
                    print(f"{case.name:<12} {target + ' ' + runtime:<14} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
            _other_tools(case, folder, references, options.modelopt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
