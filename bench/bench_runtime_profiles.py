"""What each runtime profile makes of real models: compute in 16 bits, casts, and whether
onnxruntime loads the result with its default session options.

For every model, target type and runtime profile, ``mixprec.convert(..., validate="load")``
converts (upgrading the opset where bfloat16 needs it, repairing what onnxruntime crashes on)
and the table reports:

* ``heavy 16-bit``: compute-bound nodes (MatMul, Conv, Gemm, attention, recurrent cells: the
  policy's ``compute_bound`` ops) converted, of all of them;
* ``nodes 16-bit``: share of float nodes converted;
* ``casts``: Casts executed per inference;
* ``ORT default load``: onnxruntime CPU, default session options, in a child process: ``ok``;
  ``no bf16 kernels`` (the CPU provider has none: the graph resolved, kernels not checked); or
  the error. A profile for a runtime that is not here (CUDA, DirectML, TensorRT) is checked
  against its kernel table only; this column then says what the CPU provider makes of it.

Models: the light CNNs shipped with ``onnx`` (seeded weights, as in tests/test_real_cnns.py),
the demo transformer and CNN, and PyTorch exports from tests/torch_models.py (a LayerNorm and
RMSNorm MLP from the TorchScript exporter at opset 14, two GRUs, and a tiny BERT optimized by
onnxruntime.transformers into com.microsoft ops) when torch (and transformers) are installed.

    python bench/bench_runtime_profiles.py [--models squeezenet bert ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx

import mixprec
from mixprec.demo_models import DEMO_MODELS
from mixprec.errors import MixprecError

ROOT = Path(__file__).resolve().parent.parent
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
RUNTIMES = ("onnx", "ort-cpu", "ort-cuda", "ort-dml", "tensorrt", "openvino")
TARGETS = ("fp16", "bf16")
LOG = logging.getLogger("bench_runtime_profiles")
sys.path.insert(0, str(ROOT / "tests"))


def _light(name: str) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        from test_real_cnns import realistic_weights  # noqa: PLC0415

        path = folder / f"{name}.onnx"
        onnx.save(realistic_weights(onnx.load(str(LIGHT / f"light_{name}.onnx"))), str(path))
        return path

    return build


def _demo(name: str) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        path = folder / f"demo_{name}.onnx"
        onnx.save(DEMO_MODELS[name](), str(path))
        return path

    return build


def _torch(name: str) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        import torch  # noqa: PLC0415
        import torch_models  # noqa: PLC0415

        path = folder / f"{name}.onnx"
        if name == "bert":
            return torch_models.export_optimized_bert(path)
        if name == "norm-mlp":
            return torch_models.export_torchscript(torch_models.NormMLP(), torch.randn(2, 5, 32), path, 14, {0: "b", 1: "t"})
        return torch_models.export_torchscript(torch_models.TwoGRU(), torch.randn(2, 8, 20), path, 14, {0: "b", 2: "t"})

    return build


MODELS: dict[str, Callable[[Path], Path]] = {
    **{n: _light(n) for n in ("squeezenet", "shufflenet", "resnet50", "densenet121", "inception_v2")},
    "demo-cnn": _demo("cnn"),
    "demo-transformer": _demo("transformer"),
    **{n: _torch(n) for n in ("norm-mlp", "gru", "bert")},
}


def _row(model: str, target: str, runtime: str, source: Path, out: Path) -> dict:
    row = {"model": model, "target": target, "runtime": runtime}
    try:
        result = mixprec.convert(source, out, target_dtype=target, runtime=runtime, validate="load")
    except MixprecError as e:
        return {**row, "error": str(e)}
    report = result.report
    policy = mixprec.build_policy(result.plan.target)
    heavy = [
        d.precision.value for n, d in result.plan.decisions.items()
        if (rule := policy.rule_for(n.domain, n.op_type)) is not None and rule.compute_bound
    ]
    counts = report.nodes_by_precision
    floats = counts.get("low", 0) + counts.get("fp32", 0)
    v = report.validation
    load = "ok" if v.runtime == "loaded" else "no bf16 kernels" if v.runtime == "no cpu kernels" else v.runtime
    repaired = [k.name for k in report.kept_fp32 if k.category == "runtime fails on it"]
    return {
        **row,
        "heavy_16bit": f"{heavy.count('low')}/{len(heavy)}",
        "nodes_16bit": round(100.0 * counts.get("low", 0) / floats, 1) if floats else 0.0,
        "casts": report.casts_runtime,
        "load": load + (f" (repaired: {len(repaired)} FP32)" if repaired else ""),
        "upgraded": next((n.split(":")[0] for n in report.notes if n.startswith("opset upgraded")), ""),
    }


def markdown(rows: Sequence[dict]) -> str:
    lines = [
        "| model | target | runtime | heavy 16-bit | nodes 16-bit % | casts | ORT default load | opset |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['target']} | {r['runtime']} | error: {r['error'][:80]} | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {r['target']} | {r['runtime']} | {r['heavy_16bit']} | {r['nodes_16bit']} "
            f"| {r['casts']} | {r['load']} | {r['upgraded']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=list(RUNTIMES))
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mixprec-profiles-") as tmp:
        folder = Path(tmp)
        for model in args.models:
            try:
                source = MODELS[model](folder)
            except ImportError as e:
                print(f"{model}: skipped ({e})", file=sys.stderr)
                continue
            for target in TARGETS:
                for runtime in args.runtimes:
                    rows.append(_row(model, target, runtime, source, folder / f"{model}.{target}.{runtime}.onnx"))
                    print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
