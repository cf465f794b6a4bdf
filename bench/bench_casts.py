"""Casts and 16-bit share per model: what a conversion leaves at run time, side by side with
another mixprec version.

For each model and target type: runtime casts, bytes they move per inference (estimated with
named symbolic dimensions as 128 where shapes are not static), 16-bit nodes among the nodes that
compute floats, the 16-bit share of the matrix/convolution FLOPs, and the cost model's
estimated speed against FP32 (the `onnx` runtime's default figures). Models: the demo models,
the light CNNs shipped with `onnx`, the PyTorch exports of `tests/torch_models.py` (when torch
is installed), ONNX backend node cases with If/Loop/Scan, and any `.onnx` given on the command
line (e.g. `bench/out/llama_tiny.onnx`).

    python bench/bench_casts.py bench/out/llama_tiny.onnx                  # this version
    python bench/bench_casts.py bench/out/llama_tiny.onnx --baseline /tmp/base/src

`--baseline SRC` runs the same in a child process with SRC (another checkout's `src`) first on
the import path, and prints both.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent


def _models(extra: list[str], folder: Path) -> list[tuple[str, str]]:
    """(name, path) of every model measured."""
    from mixprec import demo_models  # noqa: PLC0415

    out: list[tuple[str, str]] = []
    for name, factory in sorted(demo_models.DEMO_MODELS.items()):
        path = folder / f"demo_{name}.onnx"
        onnx.save(factory(), str(path))
        out.append((f"demo/{name}", str(path)))
    light = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    for path in sorted(light.glob("light_*.onnx")):
        if path.stem not in ("light_vgg19",):
            out.append((f"light/{path.stem}", str(path)))
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        from onnx.backend.test.case.node import collect_testcases  # noqa: PLC0415

        for case in collect_testcases():
            if any(n.op_type in ("If", "Loop", "Scan") for n in case.model.graph.node):
                path = folder / f"{case.name}.onnx"
                onnx.save(case.model, str(path))
                out.append((f"node/{case.name}", str(path)))
    try:
        sys.path.insert(0, str(ROOT / "tests"))
        import torch_models  # noqa: PLC0415

        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            model = torch_models.make_model(seed=0)
            for label, dynamo, opset in (("torchscript-opset14", False, 14), ("torchscript-opset17", False, 17)):
                path = folder / f"torch_{label}.onnx"
                torch_models.export(model, path, dynamo=dynamo, opset=opset)
                out.append((f"torch/{label}", str(path)))
    except Exception as e:  # noqa: BLE001 - torch is optional here
        print(f"(PyTorch exports skipped: {type(e).__name__}: {e})", file=sys.stderr)
    out.extend((f"file/{Path(p).name}", p) for p in extra)
    return out


def measure(models: list[tuple[str, str]]) -> dict[str, dict]:
    """Per model and target: casts, estimated cast bytes, 16-bit node and FLOPs shares."""
    import mixprec  # noqa: PLC0415

    rows: dict[str, dict] = {}
    for name, path in models:
        for target in ("float16", "bfloat16"):
            try:
                report = mixprec.convert(path, None, target_dtype=target, runtime="onnx", validate="none").report
            except Exception as e:  # noqa: BLE001 - a row with the error
                rows[f"{name}:{target}"] = {"error": f"{type(e).__name__}: {str(e)[:80]}"}
                continue
            counts = report.nodes_by_precision
            float_nodes = counts.get("low", 0) + counts.get("fp32", 0)
            rows[f"{name}:{target}"] = {
                "casts": report.casts_runtime,
                "cast_bytes": report.cast_bytes_per_inference
                if report.cast_bytes_per_inference is not None else getattr(report, "cast_bytes_estimate", None),
                "low_nodes": round(counts.get("low", 0) / float_nodes, 3) if float_nodes else None,
                "low_flops": getattr(report, "low_compute_share", None),
                "speed": getattr(report, "estimated_speedup", None),
            }
    return rows


def _compared(row: dict | None) -> dict | None:
    """A row without the speed estimate (versions without it compare on the rest)."""
    return None if row is None else {k: v for k, v in row.items() if k != "speed"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="more .onnx models")
    parser.add_argument("--baseline", metavar="SRC", help="also measure this mixprec source folder")
    parser.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(Path(args.child).read_text()))))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        models = _models(args.models, Path(tmp))
        listing = Path(tmp) / "models.json"
        listing.write_text(json.dumps(models))
        runs = {"current": None, **({"baseline": args.baseline} if args.baseline else {})}
        results = {}
        for label, src in runs.items():
            env = dict(os.environ)
            if src:
                env["PYTHONPATH"] = src
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(listing)], env=env, capture_output=True, text=True, check=True
            )
            results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    current, base = results["current"], results.get("baseline", {})

    def cell(row: dict | None) -> str:
        if not row:
            return "-"
        if "error" in row:
            return row["error"][:40]
        mb = "?" if row["cast_bytes"] is None else f"{row['cast_bytes'] / 1e6:.2f}MB"
        flops = "?" if row["low_flops"] is None else f"{100 * row['low_flops']:.0f}%"
        nodes = "?" if row["low_nodes"] is None else f"{100 * row['low_nodes']:.0f}%"
        speed = "?" if row.get("speed") is None else f"{row['speed']:.2f}x"
        return f"{row['casts']:4d} casts {mb:>9} {nodes:>4} nodes {flops:>4} FLOPs {speed:>6}"

    changed = 0
    print(f"{'model:target':60} {'current':47} {'baseline' if base else ''}")
    for key in sorted(current):
        differs = bool(base) and _compared(base.get(key)) != _compared(current[key])
        changed += differs
        if not base or differs or not key.startswith("node/"):
            print(f"{key[:60]:60} {cell(current[key]):47} {cell(base.get(key)) if base else ''}")
    if base:
        grew = [k for k in current if "casts" in current[k] and "casts" in (base.get(k) or {}) and current[k]["casts"] > base[k]["casts"]]
        print(f"{len(current)} rows, {changed} differ; casts grew in {len(grew)}: {', '.join(grew[:5])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
