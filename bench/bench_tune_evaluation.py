"""What one evaluation of `mixprec.tune` costs: per-evaluation wall time on one model and data.

An evaluation converts one candidate plan and runs it on the data. Run it with `--baseline SRC`
(the `src` folder of another mixprec checkout, e.g. a `git worktree` of an older commit) to
time that version side by side, in a child process, on the same model, data and tolerance:

    git worktree add /tmp/base <commit>
    python bench/bench_tune_evaluation.py bench/out/llama_tiny.onnx --baseline /tmp/base/src

Inputs are generated once (seed 0, symbolic dimensions 16) and shared by both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _measure(model: str, data: str, target: str, atol: float) -> dict:
    """Run tune once in this process; per-evaluation times from its history."""
    import mixprec  # noqa: PLC0415
    from mixprec.tune import Tolerance, tune  # noqa: PLC0415

    start = time.perf_counter()
    result = tune(model, data, target_dtype=target, tolerance=Tolerance(atol=atol, rtol=atol), max_batches=1)
    total = time.perf_counter() - start
    times = [e.seconds for e in result.history]
    return {
        "mixprec": str(Path(mixprec.__file__).parent),
        "met": result.met,
        "fp32_nodes": len(result.fp32_nodes),
        "evaluations": len(times),
        "per_evaluation_s": times,
        "median_s": statistics.median(times) if times else None,
        "total_s": round(total, 2),
    }


def _inputs(model: str, folder: Path) -> str:
    import numpy as np  # noqa: PLC0415
    import onnx  # noqa: PLC0415

    from mixprec.runtime.data import generate_inputs, input_specs  # noqa: PLC0415

    feeds = generate_inputs(input_specs(onnx.load(model, load_external_data=False)), seed=0, dim_value=16)
    path = folder / "batch.npz"
    np.savez(path, **feeds)
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--to", default="fp16")
    parser.add_argument("--atol", type=float, default=1e-3, help="atol = rtol of the tolerance (default 1e-3)")
    parser.add_argument("--baseline", metavar="SRC", help="time this mixprec source folder too")
    parser.add_argument("--child", metavar="NPZ", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.model, args.child, args.to, args.atol)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        data = _inputs(args.model, Path(tmp))
        rows = {}
        runs = [("current", None)] + ([("baseline", args.baseline)] if args.baseline else [])
        for label, src in runs:
            env = dict(os.environ)
            if src:
                env["PYTHONPATH"] = src
            out = subprocess.run(
                [sys.executable, __file__, args.model, "--to", args.to, "--atol", str(args.atol), "--child", data],
                env=env, capture_output=True, text=True, check=True,
            )
            rows[label] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'version':10} {'evals':>5} {'median s/eval':>13} {'total s':>8} {'met':>5} {'fp32 nodes':>10}  source")
    for label, row in rows.items():
        print(
            f"{label:10} {row['evaluations']:5d} {row['median_s']:13.3f} {row['total_s']:8.2f} "
            f"{str(row['met']):>5} {row['fp32_nodes']:10d}  {row['mixprec']}"
        )
    if "baseline" in rows:
        ratio = rows["current"]["median_s"] / rows["baseline"]["median_s"]
        print(f"median evaluation time, current / baseline: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
