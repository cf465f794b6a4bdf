"""Quantize an FP32 ONNX model with NNCF's ONNX backend (run by `bench_qdq.py --quantizer nncf`
with the python of its venv, bench/out/nncf-venv: bench/README.md).

    python quantize_nncf.py FP32.onnx CALIBRATION.npz OUT.onnx

CALIBRATION.npz holds the calibration batches as `<batch index>/<input name>` arrays.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import nncf
import numpy as np
import onnx


def main(source: str, calibration: str, target: str) -> None:
    batches: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
    with np.load(calibration) as archive:
        for key in archive.files:
            index, name = key.split("/", 1)
            batches[int(index)][name] = archive[key]
    items = [batches[i] for i in sorted(batches)]
    quantized = nncf.quantize(onnx.load(source), nncf.Dataset(items), subset_size=len(items))
    onnx.save(quantized, target)


if __name__ == "__main__":
    main(*sys.argv[1:4])
