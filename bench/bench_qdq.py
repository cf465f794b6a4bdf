"""QDQ models in 16 bits: the light CNNs shipped with `onnx` (seeded weights, opset 13) quantized
with onnxruntime's `quantize_static` (QDQ format, calibration on generated images) two ways —
the quantizer's defaults (int32 biases) and per channel with float biases — then converted for
four targets. Per row: nodes in 16 bits / FP32, runtime casts, quantized ops with a 16-bit float
side, the 16-bit share of the float ops outside quantized groups, the emulated output error
against the quantized FP32 model (max |diff| / max |FP32|), whether onnxruntime (CPU, default
options) ran it, and whether every Q/DQ node is still next to its op.

    python bench/bench_qdq.py                      # squeezenet shufflenet inception_v1 resnet50
    python bench/bench_qdq.py densenet121 --out /tmp/qdq
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter

ROOT = Path(__file__).resolve().parent.parent
TARGETS = [("fp16", "ort-cuda"), ("fp16", "tensorrt"), ("bf16", "onnx"), ("bf16", "ort-cuda")]
VARIANTS = {
    "default": {},
    "per-channel, float bias": {"per_channel": True, "extra_options": {"QuantizeBias": False}},
}


def _quantized(name: str, folder: Path) -> dict[str, Path]:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static  # noqa: PLC0415
    from test_real_cnns import LIGHT, realistic_weights  # noqa: PLC0415

    model = onnx.version_converter.convert_version(realistic_weights(onnx.load(str(LIGHT / f"light_{name}.onnx"))), 13)
    weights = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in weights]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    source = folder / f"{name}.onnx"
    onnx.save(model, str(source))
    shape = [d.dim_value for d in inputs[0].type.tensor_type.shape.dim]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.batches = iter([{inputs[0].name: rng.uniform(0, 1, shape).astype(np.float32)} for _ in range(2)])

        def get_next(self) -> dict | None:
            return next(self.batches, None)

    out = {}
    for variant, options in VARIANTS.items():
        path = folder / f"{name}_{variant.split(',')[0]}_qdq.onnx"
        quantize_static(str(source), str(path), Reader(), quant_format=QuantFormat.QDQ, **options)
        out[variant] = path
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["squeezenet", "shufflenet", "inception_v1", "resnet50"])
    parser.add_argument("--out", type=Path, help="keep the quantized models here")
    options = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    logging.disable(logging.WARNING)
    import onnxruntime  # noqa: PLC0415

    onnxruntime.set_default_logger_severity(3)
    import mixprec  # noqa: PLC0415
    from test_qdq import assert_pairs_adjacent  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="bench_qdq_") as scratch:
        folder = options.out or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        print(f"{'model':<13} {'quantization':<24} {'target':<14} {'16-bit':>6} {'fp32':>5} {'casts':>5} "
              f"{'q-ops 16-bit':>12} {'outside':>8} {'error':>9}  runtime / pairs")
        for name in options.models:
            for variant, path in _quantized(name, folder).items():
                source = onnx.load(str(path))
                for target, runtime in TARGETS:
                    converted = folder / "converted.onnx"
                    result = mixprec.convert(path, converted, target_dtype=target, runtime=runtime, validate="run", overwrite=True)
                    report = result.report
                    q = report.quantization
                    try:
                        assert_pairs_adjacent(source, onnx.load(str(converted)))
                        pairs = "adjacent"
                    except AssertionError as e:
                        pairs = f"BROKEN {e}"
                    error = max((o.scaled_error or 0.0) for o in report.validation.outputs)
                    share = f"{q.float_low_share:.0%}" if q.float_low_share is not None else "-"
                    counts = report.nodes_by_precision
                    print(
                        f"{name:<13} {variant:<24} {target + ' ' + runtime:<14} {counts.get('low', 0):>6} "
                        f"{counts.get('fp32', 0):>5} {report.casts_runtime:>5} "
                        f"{f'{q.quantized_low}/{sum(q.quantized_ops.values())}':>12} {share:>8} {error:>9.2e}  "
                        f"{report.validation.runtime} / {pairs}",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
