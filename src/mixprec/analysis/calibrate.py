"""Range analysis on data: measure every FP32 value of a model in one FP32 pass over input batches.

:func:`calibrate` runs the FP32 model with onnxruntime and records, for each float32 tensor of
the main graph (graph inputs and node outputs), streaming statistics: the largest finite
magnitude, the smallest non-zero magnitude, the number of non-finite elements and the number
of elements seen. :func:`wide_values_from_ranges` turns the table into the ``wide_values`` the
planner keeps in FP32.

How intermediate values are measured. onnxruntime only returns graph outputs, so a temporary
copy of the model lists the wanted values as its outputs. All values at once would keep every
activation of a run alive together; instead the values are exposed in chunks of at most
``max_outputs_per_run`` per session, so the memory held at once is that of one chunk. The
price is time: every chunk builds a session and re-runs every batch through the whole model,
so a model with N float values costs ``ceil(N / max_outputs_per_run)`` passes over the data.
Raise ``max_outputs_per_run`` when memory allows (``0`` = no limit, one pass).

The temporary copy never holds the weights in its protobuf: the model is read without its
external data, embedded float weights of 1 KiB or more are moved once into a data file in a
temporary folder, and the original external data files are hard-linked into that folder
(copied when a link is impossible, e.g. across file systems and with a read-only model
folder), because onnxruntime only reads external data that lies beside the model file. Each
chunk's model is then a small file that onnxruntime loads from its path.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.shape_inference
import onnx_ir as ir

from mixprec.analysis.constants import is_constant
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.errors import InputError, ModelLoadError
from mixprec.progress import Progress

logger = logging.getLogger(__name__)

Batch = Mapping[str, np.ndarray]
BatchesLike = (
    str
    | os.PathLike
    | Sequence[str | os.PathLike]
    | Mapping[str, np.ndarray]
    | Iterable[Batch]
    | Callable[[], Iterable[Batch]]
)

_FORMAT = "mixprec.ranges/1"
# Embedded tensors of at least this size are moved to the temporary external data file.
_EMBEDDED_MIN_BYTES = 1024
_EMBEDDED_FILE = "mixprec-embedded-weights.bin"
_FLOAT_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.DOUBLE,
    }
)


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
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> RangeTable:
        """Read a table written by :meth:`save`."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise InputError(f"cannot read range table {path}: {e}") from e
        return cls.from_json(text, source=str(path))


# -- batches -------------------------------------------------------------------------------


def _is_path(item: object) -> bool:
    return isinstance(item, (str, os.PathLike))


class BatchSource:
    """Input batches that can be iterated more than once (once per chunked run).

    Accepts a path (``.npz``, a folder of them, ONNX ``test_data_set_N``), a list of paths
    (read one after the other), one batch (a mapping), a list of batches, a callable returning
    a fresh iterable of batches, or any iterable. Paths, lists and callables are re-read on
    every pass, so batches stream from disk. A one-shot iterator (a generator) is read once:
    its batches are kept in memory for the later passes.

    Args:
        data: The batches, as above.
        input_names: The model's runtime input names in graph order (to read ONNX test data).
        max_batches: Use at most this many batches per pass (None: all).

    Raises:
        InputError: A path does not exist or holds no batches; `data` has an unsupported type.
    """

    def __init__(
        self, data: BatchesLike, input_names: Sequence[str], max_batches: int | None = None
    ) -> None:
        from mixprec.validate.data import load_batches  # noqa: PLC0415

        self.input_names = list(input_names)
        self.max_batches = max_batches
        self.description = "batches"
        self._factory: Callable[[], Iterable[Batch]]
        self._cache: list[Batch] | None = None
        self._iterator: Iterator[Batch] | None = None
        if isinstance(data, BatchSource):
            self._factory = lambda: iter(data)
            self.description = data.description
        elif _is_path(data):
            load_batches(data, self.input_names)  # checks the layout now
            self._factory = lambda: load_batches(data, self.input_names)  # type: ignore[arg-type]
            self.description = str(data)
        elif isinstance(data, Mapping):
            self._factory = lambda: [data]  # type: ignore[list-item]
            self.description = "1 batch"
        elif callable(data):
            self._factory = data  # type: ignore[assignment]
            self.description = getattr(data, "__name__", "callable")
        elif isinstance(data, Sequence) and data and all(_is_path(p) for p in data):
            paths = list(data)
            for p in paths:
                load_batches(p, self.input_names)
            self._factory = lambda: (b for p in paths for b in load_batches(p, self.input_names))
            self.description = ", ".join(str(p) for p in paths)
        elif isinstance(data, Iterable):
            if iter(data) is data:  # one-shot iterator: cache what is read
                self._iterator = iter(data)
                self._cache = []
                self.description = "iterator"
            else:
                self._factory = lambda: data  # type: ignore[return-value]
        else:
            raise InputError(
                f"unsupported input data {type(data).__name__}: pass a path, a list of paths, "
                "a batch dict, a list of batch dicts, or a callable returning batches"
            )

    def _iterate_all(self) -> Iterator[Batch]:
        if self._cache is not None:
            yield from self._replay()
            return
        produced = self._factory()
        if not isinstance(produced, Iterable):
            raise InputError(
                f"the batch callable returned {type(produced).__name__}, not an iterable"
            )
        yield from produced

    def _replay(self) -> Iterator[Batch]:
        assert self._cache is not None
        index = 0
        while True:
            if index < len(self._cache):
                yield self._cache[index]
            else:
                if self._iterator is None:
                    return
                try:
                    batch = next(self._iterator)
                except StopIteration:
                    self._iterator = None
                    return
                self._cache.append(batch)
                yield batch
            index += 1

    def __iter__(self) -> Iterator[Batch]:
        for index, batch in enumerate(self._iterate_all()):
            if self.max_batches is not None and index >= self.max_batches:
                return
            if not isinstance(batch, Mapping):
                raise InputError(
                    f"batch #{index} of {self.description} is a {type(batch).__name__}, "
                    "not a mapping of input names to arrays"
                )
            yield batch


# -- exposing intermediate values ------------------------------------------------------------


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _graph_tensors(attr.g)
            for sub in attr.graphs:
                yield from _graph_tensors(sub)


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors


def _location(tensor: onnx.TensorProto) -> str | None:
    for entry in tensor.external_data:
        if entry.key == "location":
            return entry.value
    return None


def _link_all(model_dir: Path, locations: Sequence[str], folder: Path) -> bool:
    """Hard-link each external data file into `folder` (same relative path); False on failure."""
    try:
        for location in locations:
            destination = folder / location
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.link(model_dir / location, destination)
    except OSError as e:
        logger.debug("cannot link external data into %s: %s", folder, e)
        return False
    return True


def elem_types(model: onnx.ModelProto, *, source: str = "model") -> dict[str, int | None]:
    """Element type of every main-graph tensor: ONNX type, 0 for non-tensors, None if unknown.

    Runs ONNX shape inference on `model`; pass a proto without large embedded weights.
    """
    graph = model.graph
    types: dict[str, int | None] = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        infos = [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]
    except Exception as e:  # noqa: BLE001 - shape inference raises assorted types
        logger.debug("%s: shape inference failed (%s); types come from the run", source, e)
        infos = [*graph.value_info, *graph.output, *graph.input]
    for info in infos:
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            types[info.name] = info.type.tensor_type.elem_type
        elif info.type.WhichOneof("value") is not None:
            types[info.name] = 0  # a sequence, map or optional: not a tensor
    for tensor in graph.initializer:
        types[tensor.name] = tensor.data_type
    for node in graph.node:
        for out in node.output:
            if out and out not in types:
                types[out] = None
    return types


class IntermediateRunner:
    """Runs a model file with chosen intermediate values of its main graph as outputs.

    Use as a context manager; the temporary folder is removed on exit. See the module
    docstring for how the temporary model refers to the weights.

    Args:
        model_path: The ``.onnx`` file (external data next to it, as ONNX requires).
        providers: onnxruntime execution providers.

    Raises:
        ModelLoadError: The file is missing, unreadable, or its external data is missing.
    """

    def __init__(
        self, model_path: str | os.PathLike, *, providers: Sequence[str] = ("CPUExecutionProvider",)
    ) -> None:
        self.path = Path(model_path)
        self.providers = tuple(providers)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such model file")
        try:
            self.proto = onnx.load(str(self.path), load_external_data=False)
        except Exception as e:  # noqa: BLE001 - protobuf raises assorted types
            raise ModelLoadError(f"{self.path}: cannot be loaded: {e}") from e
        graph = self.proto.graph
        initializers = {t.name for t in graph.initializer}
        self.input_names = [v.name for v in graph.input if v.name not in initializers]
        self.workdir = self._make_workdir()
        try:
            self._externalize_embedded()
            self.elem_types = self._infer_elem_types()
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self._runs = 0

    # -- setup ------------------------------------------------------------------------------
    def _make_workdir(self) -> Path:
        """A temporary folder holding the original external data files (linked or copied)."""
        model_dir = self.path.parent
        locations = sorted(
            {loc for t in _all_tensors(self.proto) if (loc := _location(t)) is not None}
        )
        for location in locations:
            if not (model_dir / location).is_file():
                raise ModelLoadError(f"{self.path}: external data file {location!r} is missing")
        workdir = Path(tempfile.mkdtemp(prefix="mixprec-expose-"))
        if not locations or _link_all(model_dir, locations, workdir):
            return workdir
        # No hard link into the system temp folder (another file system?): try beside the model.
        try:
            beside = Path(tempfile.mkdtemp(prefix=".mixprec-expose-", dir=model_dir))
        except OSError:
            beside = None
        if beside is not None:
            if _link_all(model_dir, locations, beside):
                shutil.rmtree(workdir, ignore_errors=True)
                return beside
            shutil.rmtree(beside, ignore_errors=True)
        try:
            size = 0
            for location in locations:
                destination = workdir / location
                destination.unlink(missing_ok=True)  # never copy onto a link to the original
                shutil.copyfile(model_dir / location, destination)
                size += destination.stat().st_size
        except OSError as e:
            shutil.rmtree(workdir, ignore_errors=True)
            raise ModelLoadError(
                f"{self.path}: cannot prepare its external data for a run: {e}"
            ) from e
        logger.warning(
            "%s: external data could not be linked; copied %.1f MB to %s",
            self.path,
            size / 1e6,
            workdir,
        )
        return workdir

    def _externalize_embedded(self) -> None:
        """Move large embedded float weights to one data file, so chunk models stay small."""
        name = _EMBEDDED_FILE
        taken = {_location(t) for t in _all_tensors(self.proto)}
        while name in taken:
            name = f"_{name}"
        offset = 0
        with open(self.workdir / name, "wb") as f:
            for tensor in _graph_tensors(self.proto.graph):
                if tensor.data_location == onnx.TensorProto.EXTERNAL:
                    continue
                if tensor.data_type not in _FLOAT_TYPES:
                    continue  # integer tensors may be shapes that inference must read
                if not tensor.HasField("raw_data") or len(tensor.raw_data) < _EMBEDDED_MIN_BYTES:
                    continue
                data = tensor.raw_data
                f.write(data)
                del tensor.external_data[:]
                for key, value in (
                    ("location", name),
                    ("offset", str(offset)),
                    ("length", str(len(data))),
                ):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, value
                tensor.data_location = onnx.TensorProto.EXTERNAL
                tensor.ClearField("raw_data")
                offset += len(data)
        if offset == 0:
            (self.workdir / name).unlink()

    def _infer_elem_types(self) -> dict[str, int | None]:
        return elem_types(self.proto, source=str(self.path))

    # -- queries ------------------------------------------------------------------------------
    def node_outputs(self, types: frozenset[int] = frozenset({onnx.TensorProto.FLOAT})) -> list[str]:
        """Main-graph node outputs (graph order) of these element types or of unknown type.

        Outputs of ``Constant`` nodes are left out: constants are analysed exactly elsewhere.
        """
        names: list[str] = []
        seen: set[str] = set(self.input_names)
        for node in self.proto.graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                continue
            for out in node.output:
                if not out or out in seen:
                    continue
                seen.add(out)
                elem = self.elem_types.get(out)
                if elem is None or elem in types:
                    names.append(out)
        return names

    def float_inputs(self) -> list[str]:
        """Runtime graph inputs of type float32."""
        return [n for n in self.input_names if self.elem_types.get(n) == onnx.TensorProto.FLOAT]

    # -- runs ---------------------------------------------------------------------------------
    def _write_chunk_model(self, names: Sequence[str]) -> Path:
        graph = self.proto.graph
        saved = onnx.GraphProto()
        saved.output.extend(graph.output)  # copies
        del graph.output[:]
        for name in names:
            elem = self.elem_types.get(name)
            if elem:
                graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
            else:
                graph.output.append(onnx.ValueInfoProto(name=name))
        self._runs += 1
        path = self.workdir / f"exposed-{self._runs}.onnx"
        try:
            path.write_bytes(self.proto.SerializeToString())
        finally:
            del graph.output[:]
            graph.output.extend(saved.output)
        return path

    def run(
        self, names: Sequence[str], batches: Iterable[Batch]
    ) -> Iterator[tuple[Batch, dict[str, np.ndarray]]]:
        """Run every batch with `names` as the model's outputs.

        Yields:
            (feeds, outputs by name) per batch; outputs that are not arrays are left out.

        Raises:
            ValidationError: onnxruntime cannot load or run the model.
            InputError: A batch lacks a model input.
        """
        from mixprec.validate import runner  # noqa: PLC0415

        names = list(dict.fromkeys(names))
        if not names:
            for feeds in batches:
                yield feeds, {}
            return
        path = self._write_chunk_model(names)
        try:
            session = runner.make_session(
                path, providers=self.providers, graph_optimization="disable"
            )
            try:
                for feeds in batches:
                    results = runner.run_session(session, feeds)
                    yield feeds, {k: v for k, v in results.items() if isinstance(v, np.ndarray)}
            finally:
                del session
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove the temporary folder."""
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> IntermediateRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chunks(names: Sequence[str], size: int) -> list[list[str]]:
    """Split `names` into consecutive chunks of at most `size` (0: one chunk)."""
    if size <= 0 or len(names) <= size:
        return [list(names)]
    return [list(names[i : i + size]) for i in range(0, len(names), size)]


def calibrate(
    model_path: str | os.PathLike,
    batches: BatchesLike,
    *,
    max_outputs_per_run: int = 256,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    progress: bool | None = False,
    max_batches: int | None = None,
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

    Returns:
        The table of measured ranges (graph inputs, then node outputs in graph order).

    Raises:
        ModelLoadError: The model cannot be read.
        InputError: No batches, a batch lacks an input, or a bad argument.
        ValidationError: onnxruntime cannot load or run the model.
    """
    if max_outputs_per_run < 0:
        raise InputError(f"max_outputs_per_run must be >= 0, got {max_outputs_per_run}")
    start = time.perf_counter()
    with IntermediateRunner(model_path, providers=providers) as runner:
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
                        for name in float_inputs:
                            if name in feeds:
                                stats[name] = stats[name].merge(ValueRange.of(feeds[name]))
                    for name, array in outputs.items():
                        if array.dtype != np.float32:
                            continue
                        measured.add(name)
                        previous = stats.get(name)
                        current = ValueRange.of(array)
                        stats[name] = current if previous is None else previous.merge(current)
                bar.advance()
                if index == 0:
                    batch_count = seen
                    if seen == 0:
                        raise InputError(f"no calibration batches in {source.description}")
                elif seen != batch_count:
                    raise InputError(
                        f"calibration data {source.description} gave {batch_count} batches on "
                        f"the first run and {seen} on run {index + 1}: pass a path, a list or a "
                        "callable that yields the same batches every time"
                    )
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
    if not margin >= 1.0:
        raise InputError(f"calibration margin must be >= 1, got {margin}")
    graph = model.graph
    candidates: list[ir.Value] = [v for v in graph.inputs if v.name not in graph.initializers]
    candidates.extend(out for node in graph for out in node.outputs)
    wide: dict[ir.Value, str] = {}
    for value in candidates:
        rng = table.get(value.name or "")
        if rng is None or rng.count == 0:
            continue
        if not (is_fp32_tensor(value) or value.type is None) or is_constant(value):
            continue
        evidence = range_evidence(rng, target, margin)
        if evidence is not None:
            wide[value] = evidence
    return wide


def range_evidence(rng: ValueRange, target: LowPrecision, margin: float = 2.0) -> str | None:
    """Why a measured range does not fit `target` (see :func:`wide_values_from_ranges`), or None."""
    limits = target.limits
    name = target.short_name
    if rng.absmax * margin > limits.max:
        return f"measured absmax {rng.absmax:.3g} x margin {margin:g} > {name} max {limits.max:.6g}"
    flush_threshold = limits.smallest_subnormal / 2
    if rng.min_nonzero <= flush_threshold and rng.absmax * limits.eps < margin * flush_threshold:
        return (
            f"measured absmax {rng.absmax:.3g} with non-zero values down to {rng.min_nonzero:.3g}: "
            f"values below {flush_threshold:.3g} flush to zero in {name}, beyond its rounding at "
            f"this scale (margin {margin:g})"
        )
    return None
