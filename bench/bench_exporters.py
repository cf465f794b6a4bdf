"""Models of other frameworks' exporters, converted and compared with their FP32 export.

    python bench/bench_exporters.py [--jax-python P] [--keras-python P] [--sklearn-python P]
                                    [--diffusers-python P] [--out bench/out/exporters]

Exports the models of bench/export_jax.py (Flax through jax2onnx), bench/export_keras.py
(Keras through tf2onnx), bench/export_sklearn.py (scikit-learn, LightGBM and XGBoost through
skl2onnx and onnxmltools) and bench/export_diffusers.py (diffusers' UNet and VAE decoder through
both PyTorch exporters), each with the interpreter of a venv that has that framework
(bench/README.md §8; an exporter whose interpreter is missing is skipped), converts each model
to float16 for ort-cuda and tensorrt and to bfloat16 for openvino, and prints per conversion:
the share of float nodes converted, the normalizations fused, the checker, and the worst output
error against the FP32 export (16-bit numerics emulated in FP32, as a GPU rounds them) on the
inputs saved beside a model (`<model>.npz` by input name, or `<model>.npy` for its one input:
the data it was fit on, a diffusion timestep; at their own scale) or
generated ones, at their usual scale and, for float inputs, 1000 times it (activations of a
residual stream: squares leave float16's range there); integer outputs (labels) count the
elements that differ. Outputs of any type compare as arrays (a classifier's per-class
maps as [samples, classes]).
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import mixprec
from mixprec.runtime.sessions import as_array
from mixprec.validate.emulate import emulate_low_precision

TARGETS = [("float16", "ort-cuda"), ("float16", "tensorrt"), ("bfloat16", "openvino")]
_SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def _feeds(model: onnx.ModelProto, scale: float, saved: Path, seed: int = 0) -> dict[str, np.ndarray]:
    if saved.suffix == ".npz":
        with np.load(saved) as inputs:
            return {name: (inputs[name] * scale).astype(np.float32) for name in inputs.files}
    if saved.is_file():
        return {model.graph.input[0].name: (np.load(saved) * scale).astype(np.float32)}
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
    names = [o.name for o in session.get_outputs()]
    return [as_array(name, o) for name, o in zip(names, session.run(None, feeds))]


def _error(expected: list[np.ndarray], actual: list[np.ndarray]) -> str:
    """The worst float output error relative to that output's largest FP32 value, NaN/Inf, and
    the share of integer outputs (labels, indices) that differ."""
    worst, bad, differ, total = 0.0, 0, 0, 0
    for e, a in zip(expected, actual):
        if e.dtype.kind in "iub":
            differ += int(np.sum(e != a))
            total += e.size
            continue
        e, a = e.astype(np.float32), a.astype(np.float32)
        bad += int((~np.isfinite(a)).sum())
        scale = float(np.abs(e).max()) or 1.0
        worst = max(worst, float(np.nanmax(np.abs(a - e))) / scale if np.isfinite(a).any() else np.inf)
    text = f"{worst:8.2%}" + (f" {bad} non-finite" if bad else "")
    return text + (f" labels {differ}/{total} differ" if differ else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jax-python", default="bench/out/jax-venv/bin/python")
    parser.add_argument("--keras-python", default="bench/out/keras-venv/bin/python")
    parser.add_argument("--sklearn-python", default="bench/out/sklearn-venv/bin/python")
    parser.add_argument("--diffusers-python", default="bench/out/diffusers-venv/bin/python")
    parser.add_argument("--out", type=Path, default=Path("bench/out/exporters"))
    args = parser.parse_args()
    exporters = (
        ("export_jax.py", args.jax_python), ("export_keras.py", args.keras_python),
        ("export_sklearn.py", args.sklearn_python), ("export_diffusers.py", args.diffusers_python),
    )
    for script, python in exporters:
        if not Path(python).exists():
            print(f"skipped {script}: no interpreter at {python} (bench/README.md §8)")
            continue
        subprocess.run([python, str(Path(__file__).with_name(script)), str(args.out)], check=True, capture_output=True)
    print(f"{'model':30} {'target':18} {'converted':>9} {'fused':>5} {'checker':>8} {'error x1':>10} {'error x1000':>12}")
    for path in sorted(args.out.glob("*.onnx")):
        source = onnx.load(path)
        # A model with local functions, inlined by default, also converts with them kept (its row
        # marked "+keep").
        variants = [(path.stem, None)] + ([(f"{path.stem}+keep", False)] if source.functions else [])
        for (name, inline), (target, runtime) in itertools.product(variants, TARGETS):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "converted.onnx"
                try:
                    result = mixprec.convert(
                        str(path), str(out), target_dtype=target, runtime=runtime, inline_functions=inline
                    )
                except mixprec.MixprecError as e:
                    print(f"{name:30} {_SHORT[target]} {runtime:13} refused: {str(e).splitlines()[0][:80]}")
                    continue
                converted = emulate_low_precision(onnx.load(out))
            report = result.report
            counts = report.nodes_by_precision
            share = counts.get("low", 0) / max(1, counts.get("low", 0) + counts.get("fp32", 0))
            fused = next((note.split()[1] for note in report.notes if note.startswith("fused ")), "0")
            errors = []
            for scale in (1.0, 1000.0):
                saved = next((p for p in (path.with_suffix(".npz"), path.with_suffix(".npy")) if p.is_file()), path.with_suffix(".npy"))
                no_float_input = all(v.type.tensor_type.elem_type != onnx.TensorProto.FLOAT for v in source.graph.input)
                if scale != 1.0 and (no_float_input or saved.is_file()):  # real inputs: their own scale
                    errors.append("-")
                    continue
                feeds = _feeds(source, scale, saved)
                errors.append(_error(_run(source, feeds), _run(converted, feeds)))
            print(f"{name:30} {_SHORT[target]} {runtime:13} {share:9.1%} {fused:>5} {report.validation.checker:>8} "
                  f"{errors[0]:>10} {errors[1]:>12}")


if __name__ == "__main__":
    sys.exit(main())
