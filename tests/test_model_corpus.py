"""Whole-model backend cases shipped with onnx (PyTorch-converted modules and operators, simple
models): each converts to float16 and bfloat16, runs, and matches the expected outputs."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import mixprec
from mixprec.runtime.data import load_batches, load_expected_outputs
from mixprec.validate.emulate import emulate_low_precision

DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
CASES = sorted(
    p
    for sub in ("pytorch-converted", "pytorch-operator", "simple")
    for p in (DATA / sub).glob("*")
    if (p / "model.onnx").exists() and (p / "test_data_set_0").is_dir()
)


def _session(model: str | bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _case(path: Path):  # type: ignore[no-untyped-def]
    model = onnx.load(str(path / "model.onnx"))
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    outputs = [o.name for o in model.graph.output]
    feeds = next(iter(load_batches(path / "test_data_set_0", inputs)))
    expected = load_expected_outputs(path / "test_data_set_0", outputs)
    return feeds, [expected[n] for n in outputs]


def _close(actual: list, expected: list, tol: float) -> bool:
    for a, e in zip(actual, expected):
        a, e = np.asarray(a), np.asarray(e)
        if a.dtype.kind in "OUSb" or e.dtype.kind in "OUSb":
            if a.shape != e.shape or not np.array_equal(a, e):
                return False
        elif not np.allclose(a.astype(np.float64), e.astype(np.float64), rtol=tol, atol=tol):
            return False
    return True


def test_model_corpus_converts_runs_and_matches(tmp_path: Path) -> None:
    ran, converted = 0, 0
    failures = []
    for case in CASES:
        feeds, expected = _case(case)
        try:
            reference = _session(str(case / "model.onnx")).run(None, feeds)
        except Exception:  # noqa: BLE001 - e.g. opset 6 models onnxruntime no longer runs
            continue
        if not _close(reference, expected, 1e-3):
            continue
        ran += 1
        for target, tol in (("fp16", 1e-2), ("bf16", 1e-1)):
            out = tmp_path / f"{case.name}.{target}.onnx"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = mixprec.convert(
                    case / "model.onnx", out, target_dtype=target, validate="checker",
                    opset=22 if target == "bf16" else None,
                )
            converted += result.report.nodes_by_precision.get("low", 0) > 0
            model = str(out) if target == "fp16" else emulate_low_precision(onnx.load(str(out))).SerializeToString()
            if not _close(_session(model).run(None, feeds), expected, tol):
                failures.append(f"{case.name} {target}")
    print(f"\nmodel corpus: {ran} cases run in FP32; {converted} conversions converted nodes")
    assert ran >= 60, ran
    # Single elementwise ops between FP32 inputs and outputs stay FP32; modules convert.
    assert converted >= ran // 2
    assert not failures, failures

