"""Models of other frameworks' exporters, converted and compared with their FP32 export.

    python bench/bench_exporters.py [--jax-python P] [--keras-python P] [--out bench/out/exporters]

Exports the models of bench/export_jax.py (Flax through jax2onnx) and bench/export_keras.py
(Keras through tf2onnx), each with the interpreter of a venv that has that framework
(bench/README.md §8; an exporter whose interpreter is missing is skipped), converts each model
to float16 for ort-cuda and tensorrt and to bfloat16 for openvino, and prints per conversion:
the share of float nodes converted, the normalizations fused, the checker, and the worst output
error against the FP32 export on generated inputs (16-bit numerics emulated in FP32, as a GPU
rounds them) at their usual scale and, for float inputs, 1000 times it (activations of a
residual stream: squares leave float16's range there).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import mixprec
from mixprec.validate.emulate import emulate_low_precision

TARGETS = [("float16", "ort-cuda"), ("float16", "tensorrt"), ("bfloat16", "openvino")]
_SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def _feeds(model: onnx.ModelProto, scale: float, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else 2 for d in value.type.tensor_type.shape.dim]
        if value.type.tensor_type.elem_type == onnx.TensorProto.INT32:
            feeds[value.name] = rng.integers(0, 100, dims).astype(np.int32)
        else:
            feeds[value.name] = (rng.standard_normal(dims) * scale).astype(np.float32)
    return feeds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the exports' unused initializers are no finding here
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [np.asarray(o, np.float32) for o in session.run(None, feeds)]


def _error(expected: list[np.ndarray], actual: list[np.ndarray]) -> str:
    """The worst output error relative to that output's largest FP32 value, and NaN/Inf."""
    worst, bad = 0.0, 0
    for e, a in zip(expected, actual):
        bad += int((~np.isfinite(a)).sum())
        scale = float(np.abs(e).max()) or 1.0
        worst = max(worst, float(np.nanmax(np.abs(a - e))) / scale if np.isfinite(a).any() else np.inf)
    return f"{worst:8.2%}" + (f" {bad} non-finite" if bad else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jax-python", default="bench/out/jax-venv/bin/python")
    parser.add_argument("--keras-python", default="bench/out/keras-venv/bin/python")
    parser.add_argument("--out", type=Path, default=Path("bench/out/exporters"))
    args = parser.parse_args()
    for script, python in (("export_jax.py", args.jax_python), ("export_keras.py", args.keras_python)):
        if not Path(python).exists():
            print(f"skipped {script}: no interpreter at {python} (bench/README.md §8)")
            continue
        subprocess.run([python, str(Path(__file__).with_name(script)), str(args.out)], check=True, capture_output=True)
    print(f"{'model':24} {'target':18} {'converted':>9} {'fused':>5} {'checker':>8} {'error x1':>10} {'error x1000':>12}")
    for path in sorted(args.out.glob("*.onnx")):
        source = onnx.load(path)
        for target, runtime in TARGETS:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "converted.onnx"
                try:
                    result = mixprec.convert(str(path), str(out), target_dtype=target, runtime=runtime)
                except mixprec.MixprecError as e:
                    print(f"{path.stem:24} {_SHORT[target]} {runtime:13} refused: {str(e).splitlines()[0][:80]}")
                    continue
                converted = emulate_low_precision(onnx.load(out))
            report = result.report
            counts = report.nodes_by_precision
            share = counts.get("low", 0) / max(1, counts.get("low", 0) + counts.get("fp32", 0))
            fused = next((note.split()[1] for note in report.notes if note.startswith("fused ")), "0")
            errors = []
            for scale in (1.0, 1000.0):
                if scale != 1.0 and all(v.type.tensor_type.elem_type != onnx.TensorProto.FLOAT for v in source.graph.input):
                    errors.append("-")
                    continue
                feeds = _feeds(source, scale)
                errors.append(_error(_run(source, feeds), _run(converted, feeds)))
            print(f"{path.stem:24} {_SHORT[target]} {runtime:13} {share:9.1%} {fused:>5} {report.validation.checker:>8} "
                  f"{errors[0]:>10} {errors[1]:>12}")


if __name__ == "__main__":
    sys.exit(main())
