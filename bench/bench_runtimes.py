"""Benchmark mixprec's 16-bit models on real runtimes: OpenVINO CPU (real bfloat16) and onnxruntime.

For each model the FP32 graph is converted with ``mixprec.convert(..., runtime="openvino")`` to
bfloat16 (upgraded to opset 22 where bfloat16 Conv and pooling need it) and to float16, and these
variants run side by side:

=================  ==========================================================================
``ov-f32``         FP32 graph, OpenVINO with ``INFERENCE_PRECISION_HINT=f32`` (the time base)
``ov-auto-bf16``   FP32 graph, OpenVINO's automatic bfloat16 (its default on AVX512-BF16 CPUs):
                   the anchor a mixprec bfloat16 model competes with
``mx-bf16@ov``     mixprec bfloat16 model, OpenVINO honouring the model's types (``"model"``)
``mx-bf16@ov-bf16``  the same model under OpenVINO's bf16 hint, which also lowers the ops mixprec
                   kept in FP32
``mx-fp16@ov``     mixprec float16 model, OpenVINO ``"model"`` (without float16 hardware the CPU
                   plugin computes float16 graphs in FP32)
``ort-fp32``       FP32 graph on onnxruntime CPU, default session options: the accuracy reference
``mx-fp16@ort``    mixprec float16 model on onnxruntime CPU
``mx-bf16-emu``    mixprec bfloat16 model through ``emulate_low_precision`` on onnxruntime: the
                   emulated check mixprec uses where no runtime computes bfloat16
=================  ==========================================================================

Latency: median of ``--repeat`` synchronous single-request inferences (batch 1), one stream, all
cores, for both runtimes; the timed calls are spread over 5 rounds that visit each variant in
turn (3 untimed calls first), so load from other processes falls on all variants alike.
``t/ov-f32`` divides by the ``ov-f32`` time.
Accuracy, over ``--inputs`` seeded random inputs, against ``ort-fp32``: ``top-1`` agreement (per
image for CNNs, per unmasked token for the transformer's LM head), the largest absolute error and
the smallest cosine similarity of the first output. ``bf16 nodes``: executed OpenVINO nodes whose
runtime precision is bf16, of all executed nodes. Under each model's table, ``emulated vs real``
counts the inputs where the emulated bfloat16 check (``mx-bf16-emu``) and the real run
(``mx-bf16@ov``) reach different top-1 verdicts (one agrees with FP32, the other not).

Models: ``cnn`` and ``transformer`` (``mixprec.demo_models``), and the light CNNs shipped with
``onnx`` (``onnx/backend/test/data/light/light_<name>.onnx``) with seeded realistic weights as in
``tests/test_real_cnns.py``.

Example::

    python bench/bench_runtimes.py                                   # default models
    python bench/bench_runtimes.py --models resnet50 transformer --repeat 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort

import mixprec
from mixprec.demo_models import DEMO_MODELS
from mixprec.validate.emulate import emulate_low_precision
from mixprec.runtime.openvino import OpenVinoSession, openvino_available

ROOT = Path(__file__).resolve().parent.parent

LOG = logging.getLogger("bench_runtimes")
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
LIGHT_NAMES = sorted(p.stem.removeprefix("light_") for p in LIGHT.glob("light_*.onnx"))
DEFAULT_MODELS = ["cnn", "transformer", "squeezenet", "shufflenet", "resnet50"]
TRANSFORMER_SEQ = 128

Feeds = dict[str, np.ndarray]


# ---------------------------------------------------------------------------------------------
# Models and inputs


def _light_weights() -> Callable[[onnx.ModelProto, int], onnx.ModelProto]:
    """The seeded-weight helper of tests/test_real_cnns.py (one procedure for tests and bench)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from test_real_cnns import realistic_weights

        return realistic_weights
    finally:
        sys.path.remove(str(ROOT / "tests"))


def build_model(name: str) -> onnx.ModelProto:
    if name == "cnn":
        return DEMO_MODELS["cnn"]()
    if name == "transformer":
        return DEMO_MODELS["transformer"]()
    return _light_weights()(onnx.load(str(LIGHT / f"light_{name}.onnx")), 0)


def make_inputs(name: str, model: onnx.ModelProto, count: int) -> list[Feeds]:
    """``count`` seeded inputs of batch 1."""
    if name == "transformer":
        feeds = []
        for seed in range(count):
            rng = np.random.default_rng(1000 + seed)
            ids = rng.integers(0, 256, (1, TRANSFORMER_SEQ), dtype=np.int64)
            mask = np.zeros((1, TRANSFORMER_SEQ), dtype=np.int64)
            mask[:, : int(rng.integers(TRANSFORMER_SEQ // 2, TRANSFORMER_SEQ + 1))] = 1
            feeds.append({"input_ids": ids, "attention_mask": mask})
        return feeds
    initializers = {t.name for t in model.graph.initializer}
    inp = next(i for i in model.graph.input if i.name not in initializers)
    dims = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    dims[0] = 1
    return [
        {inp.name: np.random.default_rng(1000 + seed).uniform(0.0, 1.0, dims).astype(np.float32)}
        for seed in range(count)
    ]


# ---------------------------------------------------------------------------------------------
# Runners


class _Runner:
    """A uniform interface over OpenVINO and onnxruntime sessions: run, and time one call."""

    def __init__(self, run: Callable[[Feeds], np.ndarray], time_one: Callable[[Feeds], float]):
        self.run = run
        self.time_one = time_one  # seconds of one synchronous inference, inputs prepared before
        self.bf16_nodes = ""


def _ov_runner(path: Path, precision: str) -> _Runner:
    session = OpenVinoSession(path, precision=precision)
    first = session.output_names[0]
    runner = _Runner(
        lambda feeds: session.run(feeds)[first],
        lambda feeds: session.latency(feeds, warmup=0, repeat=1),
    )
    executed = session.executed_precisions()
    bf16 = sum(n for (_, prec), n in executed.items() if prec == "bf16")
    runner.bf16_nodes = f"{bf16}/{sum(executed.values())}"
    return runner


def _ort_runner(path: Path) -> _Runner:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}

    def run(feeds: Feeds) -> np.ndarray:
        out = session.run(None, {k: v for k, v in feeds.items() if k in names})[0]
        return np.asarray(out).astype(np.float32)

    def time_one(feeds: Feeds) -> float:
        feeds = {k: v for k, v in feeds.items() if k in names}
        start = time.perf_counter()
        session.run(None, feeds)
        return time.perf_counter() - start

    return _Runner(run, time_one)


def interleaved_latency(
    runners: Mapping[str, _Runner], feeds: Feeds, repeat: int, rounds: int = 5
) -> dict[str, float]:
    """Median seconds per inference of each runner over ``repeat`` timed calls.

    The calls are spread over ``rounds`` rounds that visit every runner in turn, so load
    from other processes on the machine falls on all variants alike. Each visit starts with
    untimed calls: the previous runner's thread pool may still be spinning (onnxruntime's
    threads busy-wait after a run by default), which would slow the first calls.
    """
    rounds = max(1, min(rounds, repeat))
    times: dict[str, list[float]] = {name: [] for name in runners}
    for index in range(rounds):
        count = repeat // rounds + (1 if index < repeat % rounds else 0)
        for name, runner in runners.items():
            for _ in range(3):
                runner.time_one(feeds)
            times[name].extend(runner.time_one(feeds) for _ in range(count))
    return {name: statistics.median(t) for name, t in times.items()}


# ---------------------------------------------------------------------------------------------
# Metrics


def _top1(name: str, output: np.ndarray, feeds: Feeds) -> np.ndarray:
    """Top-1 class per image, or per unmasked token for the transformer."""
    if name == "transformer":
        keep = feeds["attention_mask"].reshape(-1).astype(bool)
        return output.reshape(-1, output.shape[-1]).argmax(-1)[keep]
    return output.reshape(output.shape[0], -1).argmax(-1)


@dataclass
class Row:
    model: str
    variant: str
    latency_ms: float | None = None
    ratio: float | None = None
    top1: float | None = None
    max_abs_err: float | None = None
    min_cosine: float | None = None
    bf16_nodes: str = ""
    error: str = ""
    # per input: top-1 equal to FP32's (on every token for the transformer)
    verdicts: list[bool] = field(default_factory=list, repr=False)


def score(
    row: Row, inputs: list[Feeds], outputs: list[np.ndarray], reference: list[np.ndarray]
) -> None:
    """Fills the accuracy columns of ``row``: ``outputs`` against the FP32 ``reference``."""
    agree = total = 0
    errs, cosines = [], []
    for feeds, got, ref in zip(inputs, outputs, reference):
        same = _top1(row.model, got, feeds) == _top1(row.model, ref, feeds)
        agree += int(same.sum())
        total += same.size
        row.verdicts.append(bool(same.all()))
        a, b = got.reshape(-1).astype(np.float64), ref.reshape(-1).astype(np.float64)
        errs.append(float(np.abs(a - b).max()))
        cosines.append(float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300)))
    row.top1 = agree / max(total, 1)
    row.max_abs_err = max(errs)
    row.min_cosine = min(cosines)


def bench_model(name: str, workdir: Path, n_inputs: int, repeat: int) -> tuple[list[Row], dict]:
    model = build_model(name)
    fp32 = workdir / f"{name}_fp32.onnx"
    onnx.save(model, str(fp32))
    inputs = make_inputs(name, model, n_inputs)
    files = {"bf16": workdir / f"{name}_bf16.onnx", "fp16": workdir / f"{name}_fp16.onnx"}
    for dtype in ("bf16", "fp16"):
        start = time.perf_counter()
        # The OpenVINO profile: every schema type runs (no kernel gaps to route around).
        mixprec.convert(fp32, files[dtype], target_dtype=dtype, validate="none", runtime="openvino")
        LOG.info("%s: converted to %s in %.1f s", name, dtype, time.perf_counter() - start)
    emulated = workdir / f"{name}_bf16_emulated.onnx"
    onnx.save(emulate_low_precision(onnx.load(str(files["bf16"]))), str(emulated))

    variants: dict[str, Callable[[], _Runner]] = {
        "ov-f32": lambda: _ov_runner(fp32, "f32"),
        "ort-fp32": lambda: _ort_runner(fp32),
        "ov-auto-bf16": lambda: _ov_runner(fp32, "bf16"),
        "mx-bf16@ov": lambda: _ov_runner(files["bf16"], "model"),
        "mx-bf16@ov-bf16": lambda: _ov_runner(files["bf16"], "bf16"),
        "mx-fp16@ov": lambda: _ov_runner(files["fp16"], "model"),
        "mx-fp16@ort": lambda: _ort_runner(files["fp16"]),
        "mx-bf16-emu": lambda: _ort_runner(emulated),
    }
    rows = {variant: Row(name, variant) for variant in variants}
    runners: dict[str, _Runner] = {}
    outputs: dict[str, list[np.ndarray]] = {}
    for variant, make in variants.items():
        LOG.info("%s: %s", name, variant)
        try:
            runner = make()
            outputs[variant] = [runner.run(feeds) for feeds in inputs]
        except Exception as exc:  # one failing variant must not stop the benchmark
            rows[variant].error = str(exc).splitlines()[0][:200]
            LOG.warning("%s %s: %s", name, variant, rows[variant].error)
            continue
        runners[variant] = runner
        rows[variant].bf16_nodes = runner.bf16_nodes
    if "ort-fp32" not in outputs:
        error = rows["ort-fp32"].error
        raise RuntimeError(f"{name}: the onnxruntime FP32 reference failed: {error}")
    for variant, outs in outputs.items():
        score(rows[variant], inputs, outs, outputs["ort-fp32"])

    LOG.info("%s: timing %d variants, %d runs each", name, len(runners), repeat)
    for variant, seconds in interleaved_latency(runners, inputs[0], repeat).items():
        rows[variant].latency_ms = 1e3 * seconds
    base = rows["ov-f32"].latency_ms
    for row in rows.values():
        if row.latency_ms is not None and base:
            row.ratio = row.latency_ms / base
    return list(rows.values()), _emulated_vs_real(name, inputs, rows, outputs)


def _emulated_vs_real(
    name: str, inputs: list[Feeds], rows: Mapping[str, Row], outputs: Mapping[str, list[np.ndarray]]
) -> dict:
    emu, real = rows["mx-bf16-emu"], rows["mx-bf16@ov"]
    if not emu.verdicts or not real.verdicts:
        return {"model": name, "verdict_mismatches": None, "inputs": len(inputs)}
    mismatches = sum(a != b for a, b in zip(emu.verdicts, real.verdicts))
    agree = total = 0
    err = 0.0
    for feeds, a, b in zip(inputs, outputs["mx-bf16-emu"], outputs["mx-bf16@ov"]):
        same = _top1(name, a, feeds) == _top1(name, b, feeds)
        agree += int(same.sum())
        total += same.size
        err = max(err, float(np.abs(a - b).max()))
    return {
        "model": name,
        "inputs": len(inputs),
        "verdict_mismatches": mismatches,
        "emu_vs_real_top1": agree / max(total, 1),
        "emu_vs_real_max_abs": err,
    }


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(rows: Sequence[Row], summaries: Sequence[dict]) -> str:
    header = (
        "| model | variant | ms | t/ov-f32 | top-1 | max abs err | min cos | bf16 nodes | error |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.variant} | {_fmt(r.latency_ms, '.3f')} | {_fmt(r.ratio, '.2f')} | "
            f"{_fmt(r.top1, '.3f')} | {_fmt(r.max_abs_err, '.2e')} | {_fmt(r.min_cosine, '.6f')} | "
            f"{r.bf16_nodes} | {r.error} |"
        )
    lines.append("")
    lines.append(
        "| model | emulated vs real bf16: top-1 verdict differs | top-1 agreement | max abs diff |"
    )
    lines.append("|---|---:|---:|---:|")
    for s in summaries:
        if s.get("verdict_mismatches") is None:
            lines.append(f"| {s['model']} | n/a | | |")
            continue
        lines.append(
            f"| {s['model']} | {s['verdict_mismatches']}/{s['inputs']} | "
            f"{s['emu_vs_real_top1']:.3f} | {s['emu_vs_real_max_abs']:.2e} |"
        )
    return "\n".join(lines)


def environment() -> dict:
    import openvino

    flags = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = " ".join(
            f for f in ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16") if f in cpuinfo
        )
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "openvino": openvino.__version__,
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
        "mixprec": mixprec.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": flags,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=DEFAULT_MODELS, choices=["cnn", "transformer", *LIGHT_NAMES],
        help=f"default: {' '.join(DEFAULT_MODELS)}",
    )
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per variant (median)")
    parser.add_argument(
        "--inputs", type=int, default=16, help="random inputs for the accuracy metrics"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--keep", metavar="DIR", help="keep the converted models in this folder")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(message)s")
    ort.set_default_logger_severity(3)  # the light models' unused-initializer warnings
    if not openvino_available():
        parser.error("openvino is not installed (pip install openvino)")
    if args.repeat < 1 or args.inputs < 1:
        parser.error("--repeat and --inputs must be >= 1")

    rows: list[Row] = []
    summaries: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            start = time.perf_counter()
            model_rows, summary = bench_model(name, workdir, args.inputs, args.repeat)
            rows.extend(model_rows)
            summaries.append(summary)
            LOG.info("%s done in %.1f s", name, time.perf_counter() - start)

    env = environment()
    print(
        f"OpenVINO {env['openvino']}, onnxruntime {env['onnxruntime']}, CPU flags: "
        f"{env['cpu_flags'] or 'none'}; {args.inputs} inputs, median of {args.repeat} runs\n"
    )
    print(markdown(rows, summaries))
    if args.json:
        payload = {
            "environment": env,
            "settings": {"models": args.models, "repeat": args.repeat, "inputs": args.inputs},
            "rows": [{k: v for k, v in asdict(r).items() if k != "verdicts"} for r in rows],
            "emulated_vs_real": summaries,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
