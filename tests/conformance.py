"""Conformance harness: convert every ONNX backend node test case and run it.

Used by `test_conformance.py`; also runnable as a script for a detailed tally:

    python tests/conformance.py [--only SUBSTRING] [--verbose] [--runtime NAME]

Cases convert under the `onnx` runtime profile (the schema alone) unless told otherwise: each
case exercises one ONNX op, and the converter's handling of every op is what is checked.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import mixprec
from mixprec.validate.emulate import emulate_low_precision

FP16_TOL = 1e-2
BF16_TOL = 1e-1


@dataclass
class CaseResult:
    """Outcome of one case: 'skip:<why>' or 'ok' / 'fail:<stage>' per target."""

    name: str
    status: str
    fp16: str = ""
    bf16: str = ""
    fp16_io: str = ""
    converted16: int = 0
    converted_bf16: int = 0
    converted_io: int = 0
    detail: str = ""


def _session(path_or_bytes: str | bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return ort.InferenceSession(path_or_bytes, options, providers=["CPUExecutionProvider"])


_NP = {
    "tensor(float16)": np.float16,
    "tensor(float)": np.float32,
}


def _run(session: ort.InferenceSession, model: onnx.ModelProto, inputs: list) -> list:
    names = [i.name for i in model.graph.input][: len(inputs)]
    types = {i.name: i.type for i in session.get_inputs()}
    feeds = {}
    for name, array in zip(names, inputs):
        wanted = _NP.get(types.get(name, ""))
        if wanted is not None and isinstance(array, np.ndarray) and array.dtype.kind == "f":
            array = array.astype(wanted)
        feeds[name] = array
    return session.run(None, feeds)


def _matches(expected: list, actual: list, rtol: float, atol: float) -> bool:
    if len(expected) != len(actual):
        return False
    for e, a in zip(expected, actual):
        if isinstance(e, (list, tuple)) or isinstance(a, (list, tuple)):
            if not isinstance(e, (list, tuple)) or not isinstance(a, (list, tuple)):
                return False
            if not _matches(list(e), list(a), rtol, atol):
                return False
            continue
        if e is None or a is None:
            if (e is None) != (a is None):
                return False
            continue
        e = np.asarray(e)
        a = np.asarray(a)
        if e.shape != a.shape:
            return False
        if e.dtype.kind in "fc" or a.dtype.kind in "fc" or e.dtype == object:
            if e.dtype == object:
                return bool(np.all(e == a))
            if not np.allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True):
                return False
        elif not np.array_equal(e, a):
            return False
    return True


def _has_fp32_input(model: onnx.ModelProto) -> bool:
    return any(
        i.type.HasField("tensor_type") and i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        for i in model.graph.input
    )


def run_case(case, workdir: Path, runtime: str = "onnx") -> CaseResult:  # type: ignore[no-untyped-def]
    """Convert and check one backend test case."""
    model = case.model
    result = CaseResult(case.name, "skip")
    if not case.data_sets or not _has_fp32_input(model):
        result.status = "skip:no fp32 input"
        return result
    inputs, expected = case.data_sets[0]
    try:
        reference = _session(model.SerializeToString())
        ref_out = _run(reference, model, inputs)
    except Exception:  # noqa: BLE001
        result.status = "skip:fp32 fails in onnxruntime"
        return result
    if not _matches(expected, ref_out, rtol=max(case.rtol, 1e-3), atol=max(case.atol, 1e-5)):
        result.status = "skip:fp32 mismatch in onnxruntime"
        return result
    result.status = "run"
    for target, tol, keep_io, field in (
        ("float16", FP16_TOL, True, "fp16"),
        ("bfloat16", BF16_TOL, True, "bf16"),
        ("float16", FP16_TOL, False, "fp16_io"),
    ):
        out_path = workdir / f"{case.name}.{field}.onnx"
        stage = "convert"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                converted = mixprec.convert(
                    model, out_path, target_dtype=target, validate="checker", keep_io_types=keep_io,
                    runtime=runtime,
                )
            low = converted.report.nodes_by_precision.get("low", 0)
            stage = "load"
            converted_proto = onnx.load(str(out_path))
            if field == "fp16_io":
                result.converted_io = low
                session = _session(str(out_path))
            elif target == "float16":
                result.converted16 = low
                session = _session(str(out_path))
            else:
                result.converted_bf16 = low
                session = _session(emulate_low_precision(converted_proto).SerializeToString())
            stage = "run"
            actual = _run(session, converted_proto, inputs)
            stage = "numerics"
            ok = _matches(expected, actual, rtol=tol, atol=tol)
            # With 16-bit inputs the inputs themselves are rounded: numerics are informative.
            verdict = "ok" if ok else ("lossy-io" if field == "fp16_io" else "fail:numerics")
        except Exception as e:  # noqa: BLE001
            verdict = f"fail:{stage}"
            result.detail += f"[{field} {stage}] {str(e).splitlines()[0][:300] if str(e) else type(e).__name__} "
        setattr(result, field, verdict)
    return result


def collect():  # type: ignore[no-untyped-def]
    """The ONNX backend node test cases."""
    from onnx.backend.test.case.node import collect_testcases  # noqa: PLC0415

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return collect_testcases()


def run_all(only: str | None = None, runtime: str = "onnx", every: int = 1) -> list[CaseResult]:
    """Run every case (optionally those whose name contains `only`; `every`: each N-th only)."""
    cases = [c for c in collect() if only is None or only in c.name][::every]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            results.append(run_case(case, Path(tmp), runtime))
    return results


def tally(results: list[CaseResult]) -> str:
    """A printable summary."""
    ran = [r for r in results if r.status == "run"]
    skips = Counter(r.status for r in results if r.status != "run")
    fp16 = Counter(r.fp16 for r in ran)
    bf16 = Counter(r.bf16 for r in ran)
    converted = sum(1 for r in ran if r.converted16 > 0)
    converted_bf = sum(1 for r in ran if r.converted_bf16 > 0)
    lines = [
        f"backend node cases: {len(results)}, with an FP32 input that onnxruntime passes: {len(ran)}",
        f"  skipped: {dict(skips)}",
        f"  float16 : {dict(fp16)}; cases with converted nodes: {converted}",
        f"  bfloat16: {dict(bf16)}; cases with converted nodes: {converted_bf}",
        f"  float16, 16-bit inputs/outputs: {dict(Counter(r.fp16_io for r in ran))}; cases with "
        f"converted nodes: {sum(1 for r in ran if r.converted_io > 0)}",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--runtime", default="onnx")
    args = parser.parse_args()
    results = run_all(args.only, args.runtime)
    for r in results:
        if r.status == "run" and (args.verbose or "fail" in r.fp16 + r.bf16 + r.fp16_io):
            print(f"{r.name}: fp16={r.fp16} bf16={r.bf16} fp16_io={r.fp16_io} {r.detail}")
    print(tally(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
