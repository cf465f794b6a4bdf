"""Convert every corpus model (bench/corpus.py) for each target and runtime profile and check it.

    python bench/corpus.py build
    python bench/bench_corpus.py [--models a,b] [--targets fp16,bf16] [--runtimes ort-cuda,openvino]
                                 [--batches N] [--json OUT] [--keep DIR]

Per model the FP32 model runs first in onnxruntime (CPU, default options) on the task's inputs;
a model onnxruntime cannot run is marked and its agreement columns stay empty. Then, per target
and runtime, `mixprec.convert(src, out, target_dtype=..., runtime=...)` with default options:

- convert: ok, `refused` (a MixprecError, with its one-line message) or `crashed` (any other
  exception);
- checker: `onnx.checker.check_model` on the written file (full check, external data included);
- ORT load (float16 only): an onnxruntime CPU session with default SessionOptions, created in a
  child process (a segfault is a failure, not the end of the benchmark);
- agree: the task-level agreement with the FP32 results (bench/corpus.py says which rule per
  task). float16: the converted model run in onnxruntime CPU (for a runtime that dequantizes
  constants in float, `float_dequantize` in mixprec's quantized_groups.toml: ort-cuda, tensorrt,
  with the CPU provider's QDQ rewriting off, `session.disable_quant_qdq`, as mixprec's own
  validation judges them: that rewriting quantizes their float biases again, which those runtimes
  do not). bfloat16: mixprec's emulation
  (`mixprec.validate.emulate.emulate_low_precision`, every 16-bit value rounded as bfloat16,
  run in onnxruntime) and, in the `OV` column, the converted model on OpenVINO's CPU plugin
  with each op in the graph's own element type (bfloat16 arithmetic on AVX512-BF16/AMX);
  `n/a` where OpenVINO cannot read the FP32 model either;
- heavy 16/all: MatMul/Gemm/Conv/ConvTranspose/Attention/LSTM/GRU/RNN/Einsum/... nodes
  converted to 16 bits against all such nodes of the model (subgraphs included);
- casts: Cast nodes the conversion added;
- finite to: mixprec's own probe of generated inputs scaled to |x| 255 and 32767: the largest at
  which the converted model stayed finite where the FP32 model did (`<255`: not even there; the
  corpus converts without --data, so a model fed raw pixels or samples can fail its task here
  while its report said so), and `, not at 0` where all-zero inputs gave inf/NaN;
- s: conversion wall seconds.

The markdown table goes to stdout, then every failure with a command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus  # noqa: E402

HEAVY = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Attention", "MultiHeadAttention", "LSTM", "GRU", "RNN",
         "Einsum", "MatMulInteger", "ConvInteger", "FusedMatMul", "GroupQueryAttention", "QLinearMatMul"}
TARGETS = {"fp16": "float16", "bf16": "bfloat16"}

_LOAD_CHILD = (
    "import sys, onnxruntime as ort\n"
    "ort.InferenceSession(sys.argv[1], ort.SessionOptions(), providers=['CPUExecutionProvider'])\n"
)


def heavy_ops(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    count = 0

    def walk(graph: Any) -> None:
        nonlocal count
        for node in graph.node:
            count += node.op_type in HEAVY
            for attr in node.attribute:
                if attr.g.node:
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    walk(model.graph)
    return count


def load_in_child(path: Path, timeout: float = 300) -> tuple[bool, str]:
    try:
        proc = subprocess.run([sys.executable, "-c", _LOAD_CHILD, str(path)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timeout after {timeout:.0f} s"
    if proc.returncode == 0:
        return True, ""
    lines = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()]
    msg = lines[-1] if lines else f"exit {proc.returncode}"
    if proc.returncode < 0:
        msg = f"killed by signal {-proc.returncode}: {msg}"
    return False, msg[:400]


def _session_options(runtime: str) -> Any:
    """onnxruntime's default session options, with its QDQ rewriting off for a runtime that
    dequantizes constants in float (see the module docstring); None: the defaults."""
    import onnxruntime as ort
    from mixprec.policy.quantized_groups import quantized_groups

    if not quantized_groups(runtime).float_dequantize:
        return None
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    return options


def run_task(name: str, runner: corpus.Runner, samples: list[Any]) -> list[Any]:
    task = corpus.task_for(name)
    return [task.decode(runner, s) for s in samples]


def one(name: str, src: Path, target: str, runtime: str, samples: list[Any], ref: list[Any] | None,
        workdir: Path, n_heavy: int) -> dict[str, Any]:
    import onnx

    import mixprec
    from mixprec.validate.emulate import emulate_low_precision

    row: dict[str, Any] = {"model": name, "target": target, "runtime": runtime, "heavy_total": n_heavy}
    out = workdir / f"{name}.{target}.{runtime}.onnx"
    t0 = time.perf_counter()
    try:
        result = mixprec.convert(src, out, target_dtype=TARGETS[target], runtime=runtime)
    except mixprec.MixprecError as exc:
        row.update(convert="refused", error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        row["seconds"] = time.perf_counter() - t0
        return row
    except Exception as exc:  # noqa: BLE001 - a crash is a result here
        row.update(convert="crashed", error=f"{type(exc).__name__}: {exc}".splitlines()[0],
                   traceback=traceback.format_exc())
        row["seconds"] = time.perf_counter() - t0
        return row
    row["seconds"] = time.perf_counter() - t0
    row["convert"] = "ok"
    report = result.report
    row["heavy_16"] = sum(v for k, v in report.low_by_op.items() if k.split("::")[-1] in HEAVY)
    row["casts"] = report.casts_inserted
    row["notes"] = list(report.notes)
    row["finite_to"] = _finite_to(report.validation.input_scales)
    try:
        onnx.checker.check_model(str(out), full_check=True)
        row["checker"] = "ok"
    except Exception as exc:  # noqa: BLE001
        row["checker"] = "FAIL"
        row["checker_error"] = str(exc).strip().splitlines()[0][:400]
    if target == "fp16":
        ok, msg = load_in_child(out)
        row["ort_load"] = "ok" if ok else "FAIL"
        if not ok:
            row["ort_load_error"] = msg
    if ref is None:
        return row
    # Task agreement: float16 in onnxruntime; bfloat16 emulated, and on OpenVINO for real.
    try:
        if target == "fp16":
            if row.get("ort_load") != "ok":
                raise RuntimeError("not run: the model does not load in onnxruntime")
            runner = corpus.ort_runner(out, _session_options(runtime))
        else:
            runner = corpus.ort_runner(emulate_low_precision(out).SerializeToString())
        got = run_task(name, runner, samples)
        ok, detail = corpus.agreement(name, ref, got)
        row["agree"], row["agree_detail"] = ("ok" if ok else "DIFF"), detail
    except Exception as exc:  # noqa: BLE001
        row["agree"], row["agree_detail"] = "error", f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
    if target == "bf16":
        try:
            got = run_task(name, corpus.openvino_runner(out), samples)
            ok, detail = corpus.agreement(name, ref, got)
            row["ov"], row["ov_detail"] = ("ok" if ok else "DIFF"), detail
        except Exception as exc:  # noqa: BLE001
            row["ov"], row["ov_detail"] = "error", f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
            if not _openvino_reads(src):
                row["ov"] = "n/a"
                row["ov_detail"] = "OpenVINO cannot read the FP32 model either: " + row["ov_detail"]
    return row


def _openvino_reads(model: Path) -> bool:
    """Whether OpenVINO reads and compiles `model` (a failure there is not the conversion's);
    True where OpenVINO is not installed (that failure is no model's)."""
    from mixprec.errors import RunError
    from mixprec.runtime.openvino import openvino_available

    if not openvino_available():
        return True
    try:
        corpus.openvino_runner(model)
    except RunError:
        return False
    return True


def _finite_to(scales: list[Any]) -> str:
    """The largest generated-input magnitude at which the converted model stayed finite where
    the FP32 model did ("<255" when none; "-" when not probed), and ", not at 0" where all-zero
    inputs gave inf/NaN."""
    if not scales:
        return "-"
    zeros = ", not at 0" if any(s.magnitude == 0 and s.finite is False for s in scales) else ""
    scaled = [s for s in scales if s.magnitude > 0]
    finite = [s.magnitude for s in scaled if s.finite]
    judged = [s for s in scaled if s.finite is not None]
    if not judged:
        return "-" + zeros
    return (f"{max(finite):g}" if finite else f"<{judged[0].magnitude:g}") + zeros


def fmt_table(rows: list[dict[str, Any]], fp32: dict[str, str]) -> str:
    head = ("| model | target | runtime | convert | checker | ORT load | agree | OV bf16 | heavy 16/all | casts | finite to | s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        conv = r["convert"]
        if conv != "ok":
            conv = f"{conv}: {r.get('error', '')[:90]}"
        agree = r.get("agree", "—" if fp32.get(r["model"]) == "ok" else "fp32 fails")
        lines.append(
            f"| {r['model']} | {r['target']} | {r['runtime']} | {conv} | {r.get('checker', '—')} | "
            f"{r.get('ort_load', '—')} | {agree} | {r.get('ov', '—')} | "
            f"{r.get('heavy_16', '—')}/{r['heavy_total']} | {r.get('casts', '—')} | {r.get('finite_to', '—')} | "
            f"{r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def failures(rows: list[dict[str, Any]], fp32: dict[str, str], cache: Path) -> list[str]:
    out = []
    for name, status in fp32.items():
        if status != "ok":
            out.append(f"- {name}: FP32 model does not run in onnxruntime: {status}")
    for r in rows:
        src = corpus.model_path(r["model"], cache)
        conv = f"mixprec convert {src} /tmp/{r['model']}.{r['target']}.onnx --to {r['target']} --runtime {r['runtime']}"
        bench = (f"python bench/bench_corpus.py --models {r['model']} --targets {r['target']} "
                 f"--runtimes {r['runtime']}")
        tag = f"{r['model']} {r['target']} {r['runtime']}"
        if r["convert"] != "ok":
            out.append(f"- {tag}: {r['convert']}: {r.get('error')}\n  `{conv}`")
            continue
        if r.get("checker") == "FAIL":
            out.append(f"- {tag}: checker: {r.get('checker_error')}\n  `{conv} && python -c \"import onnx; "
                       f"onnx.checker.check_model('/tmp/{r['model']}.{r['target']}.onnx', full_check=True)\"`")
        if r.get("ort_load") == "FAIL":
            out.append(f"- {tag}: onnxruntime load: {r.get('ort_load_error')}\n  `{conv} && python -c \"import "
                       f"onnxruntime as o; o.InferenceSession('/tmp/{r['model']}.{r['target']}.onnx')\"`")
        if r.get("agree") in ("DIFF", "error"):
            how = "emulated bf16" if r["target"] != "fp16" else (
                "onnxruntime CPU, QDQ rewriting off" if _session_options(r["runtime"]) is not None else "onnxruntime CPU"
            )
            out.append(f"- {tag}: task agreement ({how}) {r['agree']}: {r.get('agree_detail')}\n  `{bench}`")
        if r.get("ov") in ("DIFF", "error"):
            out.append(f"- {tag}: task agreement (OpenVINO bf16) {r['ov']}: {r.get('ov_detail')}\n  `{bench}`")
    return out


def main(argv: list[str] | None = None) -> int:
    from mixprec.policy.profiles import RUNTIMES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated corpus models (default: all)")
    ap.add_argument("--targets", default="fp16,bf16")
    ap.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"default: all ({','.join(RUNTIMES)})")
    ap.add_argument("--batches", type=int, default=0, help="samples per model (default: all of the task's)")
    ap.add_argument("--cache", help="corpus cache (default $MIXPREC_CORPUS or ~/.cache/mixprec-corpus)")
    ap.add_argument("--json", help="write all rows as JSON")
    ap.add_argument("--keep", help="keep converted models in this folder")
    args = ap.parse_args(argv)

    cache = corpus.cache_dir(args.cache)
    names = args.models.split(",") if args.models else list(corpus.MODELS)
    missing = [n for n in names if not corpus.model_path(n, cache).is_file()]
    if missing:
        print(f"corpus models missing in {cache}: {', '.join(missing)}; run: python bench/corpus.py build",
              file=sys.stderr)
        return 2
    targets = args.targets.split(",")
    runtimes = args.runtimes.split(",")
    workroot = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-corpus-"))
    workroot.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    fp32: dict[str, str] = {}
    try:
        for name in names:
            src = corpus.model_path(name, cache)
            samples = corpus.task_for(name).samples()
            if args.batches:
                samples = samples[: args.batches]
            try:
                ref = run_task(name, corpus.ort_runner(src), samples)
                fp32[name] = "ok"
            except Exception as exc:  # noqa: BLE001
                ref = None
                fp32[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            n_heavy = heavy_ops(src)
            for target in targets:
                for runtime in runtimes:
                    workdir = workroot / name
                    workdir.mkdir(exist_ok=True)
                    row = one(name, src, target, runtime, samples, ref, workdir, n_heavy)
                    rows.append(row)
                    print(f"{name} {target} {runtime}: {row['convert']} checker={row.get('checker', '-')} "
                          f"load={row.get('ort_load', '-')} agree={row.get('agree', '-')} ov={row.get('ov', '-')} "
                          f"{row['seconds']:.1f}s", file=sys.stderr, flush=True)
                    if not args.keep:
                        shutil.rmtree(workdir, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(workroot, ignore_errors=True)
    print("FP32 reference in onnxruntime: " + ", ".join(f"{n}={s}" for n, s in fp32.items()))
    print()
    print(fmt_table(rows, fp32))
    fails = failures(rows, fp32, cache)
    print()
    print(f"## Failures ({len(fails)})")
    print("\n".join(fails) if fails else "none")
    if args.json:
        Path(args.json).write_text(json.dumps({"fp32": fp32, "rows": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
