"""Benchmark accuracy-aware mixed precision: `mixprec.tune` against onnxconverter-common's
`auto_convert_mixed_precision`, on the same model, data and tolerance.

Both tools get one input batch (onnxconverter-common takes one feed dict) and the same allclose
rule ``|candidate - fp32| <= atol + rtol * |fp32|`` on every output (given to
onnxconverter-common as its `validate_fn`). For each tool the table shows:

* ``evals``: full evaluations (one conversion plus one run on the data each); for
  onnxconverter-common the calls of `validate_fn`, less its initial self-check;
* ``wall s``: wall time of the whole call;
* ``fp32`` / ``16-bit``: compute nodes (casts aside) touching only FP32 / only 16-bit floats in
  the result (`mixprec.inspection.summarize_model`);
* ``own``: whether the tool reports success;
* ``emulated`` / ``ort-cpu``: the result re-checked here against the FP32 model, on the emulated
  model (every 16-bit value rounded, as a GPU computes; `mixprec.validate.emulate`) and by a real
  onnxruntime CPU run (which computes many float16 ops in FP32 and can hide rounding).

A tool that raises becomes a row with its error. Models: ``cnn`` (the demo CNN,
`mixprec.demo_models.small_cnn`), ``transformer`` (the PyTorch encoder of
``tests/torch_models.py``, exported with torch.onnx; needs torch), and two variants with one
clearly sensitive node: ``offset-cnn`` (raw pixels minus 500) and ``offset-transformer``
(embedding tables shifted by +1000 / -1000, cancelling in their sum).

Example::

    python bench/bench_tune.py                       # cnn and transformer, float16
    python bench/bench_tune.py --models cnn offset-cnn --to bf16 --opset 22 --tolerance 2e-2
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

LOG = logging.getLogger("bench_tune")
ROOT = Path(__file__).resolve().parent.parent

# Default tolerance (atol = rtol) per model: tight enough that the default plan fails it.
DEFAULT_TOLERANCE = {"cnn": 5e-4, "transformer": 2e-3, "offset-cnn": 1e-2, "offset-transformer": 1e-2}

Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class Row:
    """One tool on one model."""

    model: str
    tool: str
    evaluations: int | None
    seconds: float
    fp32_nodes: int | None
    low_nodes: int | None
    own: str
    emulated: str
    ort_cpu: str
    note: str = ""


# -- models and data -------------------------------------------------------------------------


def _demo_cnn(folder: Path) -> tuple[Path, Batch]:
    from mixprec.demo_models import small_cnn  # noqa: PLC0415

    path = folder / "cnn.onnx"
    onnx.save(small_cnn(), str(path))
    rng = np.random.default_rng(0)
    return path, {"image": rng.standard_normal((8, 3, 32, 32)).astype(np.float32)}


def _transformer(folder: Path, offset: float = 0.0) -> tuple[Path, Batch]:
    import torch  # noqa: PLC0415

    sys.path.insert(0, str(ROOT / "tests"))
    import torch_models  # noqa: PLC0415

    model = torch_models.make_model(seed=0)
    if offset:
        with torch.no_grad():
            model.word.weight += offset
            model.position.weight -= offset
    path = folder / f"transformer{'-offset' if offset else ''}.onnx"
    with contextlib.redirect_stderr(io.StringIO()):
        torch_models.export(model, path, dynamo=False)
    rng = np.random.default_rng(0)
    mask = np.ones((4, 16), np.int64)
    mask[:, -4:] = 0
    ids = rng.integers(0, torch_models.VOCAB, (4, 16)).astype(np.int64)
    return path, {"input_ids": ids, "attention_mask": mask}


def _offset_cnn(folder: Path) -> tuple[Path, Batch]:
    rng = np.random.default_rng(0)

    def weight(name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
        return nh.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    nodes = [
        oh.make_node("Sub", ["image", "offset"], ["centered"], name="normalize/Sub"),
        oh.make_node("Conv", ["centered", "w1", "b1"], ["c1"], name="conv1/Conv", pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c1"], ["r1"], name="conv1/Relu"),
        oh.make_node("MaxPool", ["r1"], ["p1"], name="pool1/MaxPool", kernel_shape=[2, 2], strides=[2, 2]),
        oh.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2/Conv", pads=[1, 1, 1, 1]),
        oh.make_node("Relu", ["c2"], ["r2"], name="conv2/Relu"),
        oh.make_node("GlobalAveragePool", ["r2"], ["g"], name="pool2/GlobalAveragePool"),
        oh.make_node("Flatten", ["g"], ["f"], name="head/Flatten"),
        oh.make_node("Gemm", ["f", "wfc", "bfc"], ["logits"], name="head/Gemm"),
    ]
    initializers = [
        nh.from_array(np.array(500.0, np.float32), "offset"),
        weight("w1", (8, 3, 3, 3), 0.3), weight("b1", (8,), 0.1), weight("w2", (16, 8, 3, 3), 0.15),
        weight("b2", (16,), 0.1), weight("wfc", (16, 10), 0.3), weight("bfc", (10,), 0.1),
    ]
    graph = oh.make_graph(
        nodes, "offset_cnn", [oh.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [oh.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], initializers,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 10
    path = folder / "offset-cnn.onnx"
    onnx.save(model, str(path))
    data_rng = np.random.default_rng(1)
    return path, {"image": (500 + data_rng.standard_normal((8, 3, 16, 16))).astype(np.float32)}


MODELS: dict[str, Callable[[Path], tuple[Path, Batch]]] = {
    "cnn": _demo_cnn,
    "transformer": _transformer,
    "offset-cnn": _offset_cnn,
    "offset-transformer": lambda folder: _transformer(folder, offset=1000.0),
}


# -- checks ------------------------------------------------------------------------------------


def _within(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray] | Sequence[np.ndarray],
            atol: float, rtol: float) -> bool:
    """The allclose rule on every output (NaN/Inf where FP32 is finite fails)."""
    values = candidate.values() if isinstance(candidate, Mapping) else candidate
    for ref, cand in zip(reference.values(), values):
        ref = np.asarray(ref, dtype=np.float64)
        cand = np.asarray(cand, dtype=np.float64)
        if ref.shape != cand.shape:
            return False
        if not np.all(np.abs(cand - ref) <= atol + rtol * np.abs(ref)):
            return False
    return True


def _check(path: Path, reference: Mapping[str, np.ndarray], batch: Batch, atol: float, rtol: float,
           *, emulated: bool) -> str:
    from mixprec.runtime import sessions  # noqa: PLC0415
    from mixprec.validate.emulate import emulate_low_precision_file  # noqa: PLC0415

    try:
        run_path = path
        if emulated:
            run_path = emulate_low_precision_file(path, path.with_name(path.stem + ".emulated.onnx"))
        session = sessions.make_session(run_path, graph_optimization="disable")
        outputs = sessions.run_session(session, batch)
    except Exception as e:  # noqa: BLE001 - a failing run is a result
        return f"error: {str(e)[:60]}"
    return "yes" if _within(reference, outputs, atol, rtol) else "no"


def _node_counts(path: Path) -> tuple[int, int]:
    from mixprec.inspection import summarize_model  # noqa: PLC0415

    counts = summarize_model(path).nodes_by_precision
    return counts.get("fp32", 0), counts.get("fp16", 0) + counts.get("bf16", 0)


# -- tools -------------------------------------------------------------------------------------


def _run_mixprec(path: Path, batch: Batch, target: str, atol: float, rtol: float, out: Path,
                 opset: int | None = None) -> tuple[int | None, str, str]:
    from mixprec.tune import Tolerance, tune  # noqa: PLC0415

    extra = {"opset": opset} if opset is not None else {}
    result = tune(path, [batch], target_dtype=target, tolerance=Tolerance(atol=atol, rtol=rtol),
                  max_batches=1, output=out, **extra)
    if not result.met:
        import onnx_ir as ir  # noqa: PLC0415

        ir.save(result.model, out)
    note = (f"{len(result.fp32_nodes)}/{result.candidates} candidates FP32, "
            f"bound {result.max_evaluations}")
    return result.evaluations, "yes" if result.met else "no", note


def _run_auto_mixed_precision(path: Path, batch: Batch, target: str, atol: float, rtol: float,
                              out: Path, opset: int | None = None, *,
                              keep_io_types: bool = True) -> tuple[int | None, str, str]:
    from onnxconverter_common.auto_mixed_precision import auto_convert_mixed_precision  # noqa: PLC0415

    calls = 0

    def validate(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray]) -> bool:
        nonlocal calls
        calls += 1
        return _within(dict(enumerate(reference)), list(candidate), atol, rtol)

    model = onnx.load(str(path))
    with contextlib.redirect_stdout(io.StringIO()):
        converted = auto_convert_mixed_precision(
            model, dict(batch), validate_fn=validate, keep_io_types=keep_io_types
        )
    onnx.save(converted, str(out))
    return max(calls - 1, 0), "yes", "" if keep_io_types else "16-bit model inputs/outputs"


TOOLS: dict[str, Callable[..., tuple[int | None, str, str]]] = {
    "mixprec tune": _run_mixprec,
    "auto_mp keep_io_types=True": _run_auto_mixed_precision,
    "auto_mp keep_io_types=False": lambda *a: _run_auto_mixed_precision(*a, keep_io_types=False),
}
FLOAT16_ONLY = frozenset({"auto_mp keep_io_types=True", "auto_mp keep_io_types=False"})


def bench_model(name: str, folder: Path, target: str, tolerance: float | None,
                opset: int | None = None) -> list[Row]:
    """Run every tool on one model; failures become rows."""
    from mixprec.runtime import sessions  # noqa: PLC0415

    path, batch = MODELS[name](folder)
    atol = rtol = tolerance if tolerance is not None else DEFAULT_TOLERANCE[name]
    reference = sessions.run_session(sessions.make_session(path, graph_optimization="disable"), batch)
    rows = []
    for tool, run in TOOLS.items():
        out = folder / f"{name}.{tool.replace(' ', '_').replace('=', '-')}.onnx"
        if tool in FLOAT16_ONLY and target != "fp16":
            rows.append(Row(name, tool, None, math.nan, None, None, "skipped", "-", "-", "float16 only"))
            continue
        start = time.perf_counter()
        try:
            evaluations, own, note = run(path, batch, target, atol, rtol, out, opset)
        except Exception as e:  # noqa: BLE001 - a failing tool is a row
            seconds = time.perf_counter() - start
            LOG.debug("%s failed on %s", tool, name, exc_info=True)
            message = (str(e).splitlines() or [""])[0].split("FAIL : ")[-1]
            rows.append(Row(name, tool, None, seconds, None, None, "failed", "-", "-",
                            f"{type(e).__name__}: {message[:110]}"))
            continue
        seconds = time.perf_counter() - start
        fp32, low = _node_counts(out)
        rows.append(Row(
            name, tool, evaluations, seconds, fp32, low, own,
            _check(out, reference, batch, atol, rtol, emulated=True),
            _check(out, reference, batch, atol, rtol, emulated=False) if target in ("fp16", "float16") else "-",
            note + (f"; tolerance atol=rtol={atol:g}" if tool == "mixprec tune" else ""),
        ))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The rows as a fixed-width text table."""
    header = ("model", "tool", "evals", "wall s", "fp32", "16-bit", "own", "emulated", "ort-cpu", "note")
    lines = [header]
    for r in rows:
        lines.append((
            r.model, r.tool, "-" if r.evaluations is None else str(r.evaluations),
            "-" if math.isnan(r.seconds) else f"{r.seconds:.2f}",
            "-" if r.fp32_nodes is None else str(r.fp32_nodes), "-" if r.low_nodes is None else str(r.low_nodes),
            r.own, r.emulated, r.ort_cpu, r.note,
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    text = []
    for i, line in enumerate(lines):
        text.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1])
        if i == 0:
            text.append("-" * (sum(widths) + 2 * len(widths) + 4))
    return "\n".join(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "transformer"], choices=list(MODELS))
    parser.add_argument("--to", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--tolerance", type=float, help="atol = rtol for every model (default: per model)")
    parser.add_argument("--keep", metavar="DIR", help="keep the models in this folder")
    parser.add_argument("--opset", type=int, metavar="N",
                        help="mixprec upgrades the models to opset N first (bfloat16 Conv needs 22)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mixprec").setLevel(logging.ERROR)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.models:
            try:
                rows.extend(bench_model(name, folder, args.to, args.tolerance, args.opset))
            except ImportError as e:
                rows.append(Row(name, "-", None, math.nan, None, None, "skipped", "-", "-", str(e)))
    print(f"target {args.to}; one batch per model; tolerance: allclose with atol = rtol as noted")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
