"""Quantize an FP32 ONNX model with AMD Quark's ONNX quantizer (run by `bench_qdq.py --quantizer
quark` with the python of its venv, bench/out/quark-venv: bench/README.md).

    python quantize_quark.py FP32.onnx CALIBRATION.npz OUT.onnx CONFIG

CALIBRATION.npz holds the calibration batches as `<batch index>/<input name>` arrays; CONFIG is
one of Quark's named configurations (XINT8: power-of-two scales for NPUs, A8W8, A16W8, ...).
"""

from __future__ import annotations

import sys
from collections import defaultdict

import numpy as np
from onnxruntime.quantization import CalibrationDataReader
from quark.onnx import ModelQuantizer
from quark.onnx.quantization.config import Config, get_default_config


class _Batches(CalibrationDataReader):
    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self._items = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._items, None)


def main(source: str, calibration: str, target: str, config: str) -> None:
    batches: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
    with np.load(calibration) as archive:
        for key in archive.files:
            index, name = key.split("/", 1)
            batches[int(index)][name] = archive[key]
    quantizer = ModelQuantizer(Config(global_quant_config=get_default_config(config)))
    quantizer.quantize_model(source, target, _Batches([batches[i] for i in sorted(batches)]))


if __name__ == "__main__":
    main(*sys.argv[1:5])
