"""Emulated output error of a conversion, side by side with another mixprec version, for models
of any size (the emulation is written to a file with external data, never held as one protobuf).

For each target type and version: runtime casts, 16-bit nodes among the float nodes, and the
error of every output of the emulated 16-bit model (FP32 compute, 16-bit rounding) against the
FP32 model on the same generated inputs, as max |diff| / max |FP32| — run with onnxruntime's CPU
provider, default options, one session at a time.

    python bench/bench_error.py bench/out/llama_1.1b.onnx --to fp16
    python bench/bench_error.py bench/out/llama_s.onnx --to fp16 --to bf16 --baseline /tmp/base/src

Integer inputs are drawn in [0, --int-high) (token ids), symbolic dimensions take --dim.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _child(model: str, target: str, folder: str) -> None:
    """Convert and emulate with the mixprec on the import path; print what the parent needs."""
    import mixprec  # noqa: PLC0415
    from mixprec.validate.emulate import emulate_low_precision_file  # noqa: PLC0415

    converted = Path(folder) / "converted.onnx"
    result = mixprec.convert(model, converted, target_dtype=target, validate="none", overwrite=True)
    report = result.report
    counts = report.nodes_by_precision
    floats = counts.get("low", 0) + counts.get("fp32", 0)
    emulated = emulate_low_precision_file(converted, Path(folder) / "emulated.onnx")
    print(json.dumps({
        "casts": report.casts_runtime,
        "low_nodes": counts.get("low", 0),
        "float_nodes": floats,
        "emulated": str(emulated),
    }))


def _inputs(model: str, dim: int, int_high: int, seed: int) -> dict[str, np.ndarray]:
    import onnx  # noqa: PLC0415

    proto = onnx.load(model, load_external_data=False)
    weights = {t.name for t in proto.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in proto.graph.input:
        if value.name in weights:
            continue
        tensor = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dim for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        if np.issubdtype(dtype, np.integer):
            feeds[value.name] = rng.integers(0, int_high, shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[value.name] = np.ones(shape, np.bool_)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _run(path: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort  # noqa: PLC0415

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    outputs = session.run(None, feeds)
    del session
    return [np.asarray(o, dtype=np.float64) for o in outputs]


def _version(model: str, target: str, src: str | None, folder: Path) -> dict:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, __file__, "--child", model, target, str(folder)],
        env=env, capture_output=True, text=True, check=False, cwd=ROOT,
    )
    if done.returncode != 0:
        raise SystemExit(f"{'baseline' if src else 'this version'} failed on {model} ({target}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--child"]:
        _child(*args[1:4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--to", action="append", dest="targets", help="fp16 / bf16 (repeatable; default fp16)")
    parser.add_argument("--baseline", help="another checkout's src folder, measured first")
    parser.add_argument("--dim", type=int, default=16, help="size of symbolic dimensions (default 16)")
    parser.add_argument("--int-high", type=int, default=100, help="integer inputs in [0, N) (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=int, default=1, help="input batches (seeds seed..seed+N-1; default 1)")
    options = parser.parse_args(args)
    batches = [_inputs(options.model, options.dim, options.int_high, options.seed + i) for i in range(options.batches)]
    references = [_run(options.model, feeds) for feeds in batches]
    versions = [("baseline", options.baseline)] if options.baseline else []
    versions.append(("this", None))
    rows = []
    for target in options.targets or ["fp16"]:
        for label, src in versions:
            with tempfile.TemporaryDirectory(prefix="bench_error_") as folder:
                info = _version(options.model, target, src, Path(folder))
                errors = []
                for feeds, reference in zip(batches, references):
                    got = _run(info["emulated"], feeds)
                    errors.append(max(
                        float(np.abs(g - r).max()) / (float(np.abs(r).max()) or 1.0) for g, r in zip(got, reference)
                    ))
            rows.append((target, label, info["casts"], info["low_nodes"], info["float_nodes"], errors))
    print("error: max |diff| / max |FP32| over the outputs, per batch: mean and worst")
    print(f"{'target':<6} {'version':<9} {'casts':>6} {'16-bit nodes':>13} {'mean error':>11} {'worst':>10}")
    for target, label, casts, low, floats, errors in rows:
        print(f"{target:<6} {label:<9} {casts:>6} {f'{low}/{floats}':>13} {np.mean(errors):>11.3e} {max(errors):>10.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
