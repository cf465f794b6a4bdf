"""Range analysis on data: measure every FP32 value of a model in one FP32 pass over input batches.

:func:`calibrate` runs the FP32 model with onnxruntime and records, for each float32 tensor of
the main graph (graph inputs and node outputs), streaming statistics: the largest finite
magnitude, the smallest non-zero magnitude, the number of non-finite elements and the number
of elements seen. :func:`wide_values_from_ranges` turns the table into the ``wide_values`` the
planner keeps in FP32.

How intermediate values are measured: :class:`mixprec.runtime.intermediates.IntermediateRunner`
runs a copy of the model that lists them as outputs. All values at once would keep every
activation of a run alive together; instead the values are exposed in chunks of at most
``max_outputs_per_run`` per session, so the memory held at once is that of one chunk. The
price is time: every chunk builds a session and re-runs every batch through the whole model,
so a model with N float values costs ``ceil(N / max_outputs_per_run)`` passes over the data.
Raise ``max_outputs_per_run`` when memory allows (``0`` = no limit, one pass).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import FLUSH_WORDS, is_constant
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.errors import InputError
from mixprec.graphs import main_values
from mixprec.io import write_text_atomic
from mixprec.progress import Progress
from mixprec.runtime.batches import BatchesLike, BatchSource
from mixprec.runtime.intermediates import IntermediateRunner, chunks

logger = logging.getLogger(__name__)

_FORMAT = "mixprec.ranges/1"


@dataclass(frozen=True)
class ValueRange:
    """Statistics of one float32 tensor over all batches.

    Attributes:
        absmax: Largest finite magnitude (0.0 when there is none).
        min_nonzero: Smallest finite non-zero magnitude (``inf`` when there is none).
        nonfinite: Number of NaN and infinite elements.
        count: Number of elements seen.
    """

    absmax: float = 0.0
    min_nonzero: float = math.inf
    nonfinite: int = 0
    count: int = 0

    @classmethod
    def of(cls, array: np.ndarray) -> ValueRange:
        """Statistics of one array (any float dtype; compared in float32)."""
        magnitude = np.abs(np.asarray(array, dtype=np.float32)).reshape(-1)
        finite = np.isfinite(magnitude)
        nonfinite = int(magnitude.size - np.count_nonzero(finite))
        if magnitude.size == 0:
            return cls(count=0)
        absmax = float(np.max(magnitude, where=finite, initial=0.0))
        min_nonzero = float(np.min(magnitude, where=finite & (magnitude > 0), initial=np.inf))
        return cls(absmax, min_nonzero, nonfinite, int(magnitude.size))

    def merge(self, other: ValueRange) -> ValueRange:
        """Statistics over the elements of both."""
        return ValueRange(
            max(self.absmax, other.absmax),
            min(self.min_nonzero, other.min_nonzero),
            self.nonfinite + other.nonfinite,
            self.count + other.count,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``min_nonzero`` is null when there is no non-zero value)."""
        return {
            "absmax": self.absmax,
            "min_nonzero": None if math.isinf(self.min_nonzero) else self.min_nonzero,
            "nonfinite": self.nonfinite,
            "count": self.count,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValueRange:
        """Inverse of :meth:`to_dict`."""
        min_nonzero = data.get("min_nonzero")
        return cls(
            float(data["absmax"]),
            math.inf if min_nonzero is None else float(min_nonzero),
            int(data.get("nonfinite", 0)),
            int(data.get("count", 0)),
        )


@dataclass(frozen=True)
class RangeTable(Mapping[str, ValueRange]):
    """Measured ranges by tensor name (graph inputs first, then node outputs in graph order).

    Attributes:
        ranges: Tensor name -> range.
        batches: Number of batches measured.
        runs: Number of chunked passes over the data it took (not part of equality).
    """

    ranges: Mapping[str, ValueRange] = field(default_factory=dict)
    batches: int = 0
    runs: int = field(default=0, compare=False)

    def __getitem__(self, name: str) -> ValueRange:
        return self.ranges[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.ranges)

    def __len__(self) -> int:
        return len(self.ranges)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "format": _FORMAT,
            "batches": self.batches,
            "runs": self.runs,
            "ranges": {name: r.to_dict() for name, r in self.ranges.items()},
        }

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text (strict JSON: no NaN or Infinity)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str, *, source: str = "range table") -> RangeTable:
        """Parse :meth:`to_json` output.

        Raises:
            InputError: The text is not a range table; the message names `source`.
        """
        try:
            data = json.loads(text)
            if data.get("format") != _FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {_FORMAT!r}")
            ranges = {str(k): ValueRange.from_dict(v) for k, v in data["ranges"].items()}
            return cls(ranges, int(data.get("batches", 0)), int(data.get("runs", 0)))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError(f"{source}: not a mixprec range table: {e}") from e

    def save(self, path: str | os.PathLike) -> Path:
        """Write the table as JSON."""
        return write_text_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> RangeTable:
        """Read a table written by :meth:`save`."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise InputError(f"cannot read range table {path}: {e}") from e
        return cls.from_json(text, source=str(path))


def _merge_inputs(
    stats: dict[str, ValueRange], feeds: Mapping[str, np.ndarray], float_inputs: Sequence[str]
) -> None:
    """Merge the ranges of one batch's float inputs into `stats`."""
    for name in float_inputs:
        if name in feeds:
            stats[name] = stats[name].merge(ValueRange.of(feeds[name]))


def _merge_outputs(
    stats: dict[str, ValueRange], measured: set[str], outputs: Mapping[str, np.ndarray]
) -> None:
    """Merge the ranges of one batch's float32 outputs into `stats` and note them measured."""
    for name, array in outputs.items():
        if array.dtype != np.float32:
            continue
        measured.add(name)
        previous = stats.get(name)
        current = ValueRange.of(array)
        stats[name] = current if previous is None else previous.merge(current)


def _checked_batch_count(index: int, seen: int, batch_count: int, description: str) -> int:
    """The batch count of the first run, after run `index` saw `seen` batches.

    Raises:
        InputError: The first run saw no batch, or a later run saw another number of them.
    """
    if index == 0:
        if seen == 0:
            raise InputError(f"no calibration batches in {description}")
        return seen
    if seen != batch_count:
        raise InputError(
            f"calibration data {description} gave {batch_count} batches on "
            f"the first run and {seen} on run {index + 1}: pass a path, a list or a "
            "callable that yields the same batches every time"
        )
    return batch_count


def calibrate(
    model_path: str | os.PathLike,
    batches: BatchesLike,
    *,
    max_outputs_per_run: int = 256,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    progress: bool | None = False,
    max_batches: int | None = None,
    elem_types: Mapping[str, int | None] | None = None,
) -> RangeTable:
    """Measure the range of every float32 tensor of an FP32 model on data.

    Args:
        model_path: The FP32 ``.onnx`` file (external data beside it).
        batches: Input batches: a path (``.npz``, folder of them, ONNX test data), a list of
            paths, a batch dict, a list of them, a callable returning an iterable of batches
            (called once per run), or a one-shot iterable (kept in memory after the first run
            when several runs are needed). See :class:`BatchSource`.
        max_outputs_per_run: At most this many intermediate tensors are outputs of one session
            (bounds the memory held at once; each extra run re-reads and re-runs every batch).
            0: no limit.
        providers: onnxruntime execution providers.
        progress: Show a progress line on stderr (None: when stderr is a terminal).
        max_batches: Use at most this many batches (None: all).
        elem_types: The model's value types when already known (see `IntermediateRunner`).

    Returns:
        The table of measured ranges (graph inputs, then node outputs in graph order).

    Raises:
        ModelLoadError: The model cannot be read.
        InputError: No batches, a batch lacks an input, or a bad argument.
        RunError: onnxruntime cannot load or run the model.
    """
    if max_outputs_per_run < 0:
        raise InputError(f"max_outputs_per_run must be >= 0, got {max_outputs_per_run}")
    start = time.perf_counter()
    with IntermediateRunner(model_path, providers=providers, elem_types=elem_types) as runner:
        source = BatchSource(batches, runner.input_names, max_batches)
        float_inputs = runner.float_inputs()
        parts = chunks(runner.node_outputs(), max_outputs_per_run)
        stats: dict[str, ValueRange] = {name: ValueRange() for name in float_inputs}
        measured: set[str] = set(float_inputs)
        batch_count = 0
        bar = Progress.auto("calibrate", len(parts), unit=" runs", enabled=progress)
        try:
            for index, part in enumerate(parts):
                seen = 0
                for feeds, outputs in runner.run(part, source):
                    seen += 1
                    if index == 0:
                        _merge_inputs(stats, feeds, float_inputs)
                    _merge_outputs(stats, measured, outputs)
                bar.advance()
                batch_count = _checked_batch_count(index, seen, batch_count, source.description)
        finally:
            bar.close()
    ordered = {name: stats[name] for name in stats if name in measured}
    logger.info(
        "calibrated %d float32 tensors of %s on %d batch(es) in %d run(s), %.2f s",
        len(ordered),
        model_path,
        batch_count,
        len(parts),
        time.perf_counter() - start,
    )
    return RangeTable(ordered, batch_count, len(parts))


def wide_values_from_ranges(
    model: ir.Model, table: Mapping[str, ValueRange], target: LowPrecision, margin: float = 2.0
) -> dict[ir.Value, str]:
    """The FP32 values whose measured range the 16-bit type cannot hold, with evidence.

    Rules (``margin`` is a safety factor for data the calibration did not see):

    * **overflow**: ``absmax * margin > max`` of the target (65504 for float16, about 3.39e38
      for bfloat16).
    * **flush to zero that matters**: some non-zero value flushes (``min_nonzero`` at most half
      the smallest subnormal) *and* the tensor is so small that the flush is not rounding noise:
      ``absmax * eps < margin * flush threshold``, i.e. with the default margin 2,
      ``absmax < smallest normal`` (6.1e-5 for float16). A flushed element is then larger than
      the 16-bit rounding error of the tensor's largest element, so zeroing it is a real error;
      in a tensor of ordinary scale, flushing a few 1e-9 elements is below rounding and does
      not keep anything FP32.

    Only main-graph graph inputs and node outputs that are float32 (or untyped: the table only
    holds float32 tensors) count; constants are analysed exactly elsewhere and are skipped.

    Args:
        model: The FP32 model the table was measured on (matched by value name).
        table: Measured ranges, e.g. from :func:`calibrate`.
        target: The 16-bit type.
        margin: Safety factor >= 1.

    Returns:
        Value -> evidence, for ``plan_precision(wide_values=...)``.

    Raises:
        InputError: `margin` is below 1.
    """
    return measured_values(model, table, target, margin)[0]


def safe_values_from_ranges(
    model: ir.Model, table: Mapping[str, ValueRange], target: LowPrecision, margin: float = 2.0
) -> dict[ir.Value, str]:
    """The FP32 values whose measured range the 16-bit type holds (by the rules of
    :func:`wide_values_from_ranges`, and finite), with evidence, for
    ``plan_precision(safe_values=...)``."""
    return measured_values(model, table, target, margin)[1]


def measured_values(
    model: ir.Model, table: Mapping[str, ValueRange], target: LowPrecision, margin: float = 2.0
) -> tuple[dict[ir.Value, str], dict[ir.Value, str]]:
    """Both in one pass: (values beyond the 16-bit range, values it holds), with evidence."""
    if not margin >= 1.0:
        raise InputError(f"calibration margin must be >= 1, got {margin}")
    wide: dict[ir.Value, str] = {}
    safe: dict[ir.Value, str] = {}
    for value, rng in _measured(model, table):
        evidence = range_evidence(rng, target, margin)
        if evidence is not None:
            wide[value] = evidence
        elif rng.nonfinite == 0:
            safe[value] = f"measured within +-{rng.absmax:.3g} on data"
    return wide, safe


def _measured(model: ir.Model, table: Mapping[str, ValueRange]) -> Iterator[tuple[ir.Value, ValueRange]]:
    """Main-graph FP32 (or untyped) graph inputs and node outputs with a measured range."""
    initializers = model.graph.initializers
    for value in main_values(model):
        if value.name in initializers:
            continue
        rng = table.get(value.name or "")
        if rng is None or rng.count == 0:
            continue
        if not (is_fp32_tensor(value) or value.type is None) or is_constant(value):
            continue
        yield value, rng


class RangeEvidence(str):
    """Why a measured range does not fit the 16-bit type: the text for reports, and whether the
    problem is underflow (`flushes`: values flush to zero) rather than overflow."""

    flushes: bool

    def __new__(cls, text: str, *, flushes: bool) -> RangeEvidence:
        evidence = super().__new__(cls, text)
        evidence.flushes = flushes
        return evidence


def range_evidence(rng: ValueRange, target: LowPrecision, margin: float = 2.0) -> RangeEvidence | None:
    """Why a measured range does not fit `target` (see :func:`wide_values_from_ranges`), or None."""
    limits = target.limits
    name = target.short_name
    if rng.absmax * margin > limits.max:
        return RangeEvidence(
            f"measured absmax {rng.absmax:.3g} x margin {margin:g} > {name} max {limits.max:.6g}", flushes=False
        )
    flush_threshold = limits.smallest_subnormal / 2
    if rng.min_nonzero <= flush_threshold and rng.absmax * limits.eps < margin * flush_threshold:
        return RangeEvidence(
            f"measured absmax {rng.absmax:.3g} with non-zero values down to {rng.min_nonzero:.3g}: "
            f"values below {flush_threshold:.3g} {FLUSH_WORDS} in {name} (underflow), more than its "
            f"rounding at this scale (margin {margin:g})",
            flushes=True,
        )
    return None
