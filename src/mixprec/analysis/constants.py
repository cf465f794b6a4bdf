"""Constant tensors (initializers and Constant nodes): their values and how they fare in 16 bits.

External tensors are read in chunks with plain file reads rather than through a memory map, so
inspecting a multi-gigabyte model does not grow the resident set.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mixprec.dtypes import LowPrecision
from mixprec.graphs import all_graphs, is_default_domain, static_shape
from mixprec.graphs import reduction_axes as graphs_reduction_axes
from mixprec.io.loading import ExternalReader, read_external
from mixprec.io.views import float32_values, tensor_size

_CHUNK_BYTES = 64 * 1024 * 1024
# What was measured of each constant, per target type (see `constant_range`). A side table, not
# the value's metadata store: a store costs ~0.5 kB, and a graph may hold 50k constants.
_RANGES: dict[LowPrecision, weakref.WeakKeyDictionary[ir.Value, ConstantRange]] = {}
# How range evidence words an underflow, here and for measured values
# (`mixprec.analysis.calibrate.range_evidence`): the planner tells a flush from an overflow by it.
FLUSH_WORDS = "flush to zero"


def constant_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """The tensor behind a value, if it is an initializer or the output of a Constant node."""
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and is_default_domain(producer.domain):
        return constant_node_tensor(producer)
    return None


def constant_node_tensor(node: ir.Node) -> ir.TensorProtocol | None:
    """The tensor a Constant node produces (`value`, `value_float(s)`, `value_int(s)`)."""
    attributes = node.attributes
    if any(attr.is_ref() for attr in attributes.values()):
        return None  # a function's caller gives the value
    attr = attributes.get("value")
    if attr is not None and attr.type == ir.AttributeType.TENSOR:
        return attr.as_tensor()
    if (attr := attributes.get("value_float")) is not None:
        return ir.Tensor(np.array(attr.as_float(), dtype=np.float32))
    if (attr := attributes.get("value_floats")) is not None:
        return ir.Tensor(np.array(list(attr.as_floats()), dtype=np.float32))
    if (attr := attributes.get("value_int")) is not None:
        return ir.Tensor(np.array(attr.as_int(), dtype=np.int64))
    if (attr := attributes.get("value_ints")) is not None:
        return ir.Tensor(np.array(list(attr.as_ints()), dtype=np.int64))
    return None


def is_constant(value: ir.Value) -> bool:
    """Whether the value is an initializer (not also a graph input) or a Constant's output."""
    if value.const_value is not None:
        return not value.is_graph_input()
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or not is_default_domain(producer.domain):
        return False
    return constant_node_tensor(producer) is not None


def iter_chunks(tensor: ir.TensorProtocol) -> Iterator[np.ndarray]:
    """Yield the tensor's elements as flat NumPy chunks of bounded size."""
    if isinstance(tensor, ScaledTensor):
        yield from tensor.chunks()
        return
    if isinstance(tensor, ir.ExternalTensor) and tensor.dtype.itemsize and tensor.dtype.bitwidth % 8 == 0:
        dtype = tensor.dtype.numpy()
        total = tensor.size
        step = max(1, _CHUNK_BYTES // dtype.itemsize)
        if total <= step:  # the common small constant: one read
            yield read_external(tensor).reshape(-1)  # type: ignore[union-attr] - whole bytes: not None
            return
        with open(tensor.path, "rb") as f:
            f.seek(tensor.offset or 0)
            done = 0
            while done < total:
                count = min(step, total - done)
                chunk = np.fromfile(f, dtype=dtype, count=count)
                if chunk.size != count:
                    raise OSError(f"external data file {tensor.path} is shorter than declared")
                yield chunk
                done += count
        return
    yield np.asarray(tensor.numpy()).reshape(-1)


class ScaledTensor(ir.LazyTensor):
    """An FP32 constant multiplied by a vector along one axis, computed when read: whole by
    `numpy()`, in bounded chunks by `iter_chunks` (reading the source in chunks too)."""

    def __init__(self, source: ir.TensorProtocol, factor: np.ndarray, axis: int) -> None:
        shape = tuple(int(d) for d in source.shape)
        self._source = source
        self._factor = np.asarray(factor, dtype=np.float32).reshape(-1)
        self._stride = math.prod(shape[axis + 1 :])  # elements that share one factor
        super().__init__(
            lambda: ir.Tensor(np.concatenate([np.empty(0, np.float32), *self.chunks()]).reshape(shape), name=source.name),
            dtype=ir.DataType.FLOAT, shape=static_shape(shape), name=source.name,
        )

    def chunks(self) -> Iterator[np.ndarray]:
        """The scaled elements, flat, in chunks cut at whole rows of the scaled axis."""
        # A row: `stride` elements that share one factor, or (the scaled axis last) one factor each.
        row = self._stride if self._stride > 1 else self._factor.size
        pending = np.empty(0, np.float32)
        done = 0
        for chunk in iter_chunks(self._source):
            data = np.concatenate([pending, chunk]) if pending.size else chunk
            usable = data.size - data.size % row
            if usable:
                yield self._scaled(data[:usable], done)
                done += usable
            pending = data[usable:]

    def _scaled(self, block: np.ndarray, offset: int) -> np.ndarray:
        """`block` (whole rows, starting at element `offset`) times its factors."""
        factor = self._factor
        if self._stride == 1:
            return (block.reshape(-1, factor.size) * factor).reshape(-1)
        rows = block.reshape(-1, self._stride)
        index = (offset // self._stride + np.arange(rows.shape[0])) % factor.size
        return (rows * factor[index, None]).reshape(-1)


def read_array(tensor: ir.TensorProtocol) -> np.ndarray:
    """The tensor's values as an array of its shape; an external tensor is read from its file
    (:func:`mixprec.io.loading.read_external`), not mapped."""
    if isinstance(tensor, ir.ExternalTensor):
        array = read_external(tensor)
        if array is not None:
            return array
    return np.asarray(tensor.numpy())


def small_constant_array(value: ir.Value, max_bytes: int = 1 << 20) -> np.ndarray | None:
    """The constant's values as an array when it is small (used by conditions), else None."""
    tensor = constant_tensor(value)
    if tensor is None or tensor.nbytes > max_bytes:
        return None
    return read_array(tensor)


@dataclass(frozen=True, slots=True)
class ConstantRange:
    """How a float constant fares when stored in a 16-bit type.

    Attributes:
        absmax: Largest finite magnitude.
        overflow: Number of finite elements that become infinite.
        flushed: Number of non-zero elements that become zero.
        max_flushed: Largest magnitude among the flushed elements.
        significant_flush: Whether a flushed element matters relative to the tensor's own scale
            (it is larger than absmax times the 16-bit epsilon), e.g. an epsilon constant.

    A flushed element is at most half the smallest subnormal: never more than the rounding error
    of a 16-bit sum it is added to, so only its other uses (products, divisions) can feel it.
    """

    absmax: float
    overflow: int
    flushed: int
    max_flushed: float
    significant_flush: bool

    @property
    def representable(self) -> bool:
        """True if storing the tensor in 16 bits changes no value beyond rounding."""
        return self.overflow == 0 and not self.significant_flush

    @property
    def only_flushes(self) -> bool:
        """True if the tensor fits the 16-bit range and meaningful values flush to zero."""
        return self.overflow == 0 and self.significant_flush

    def describe(self, target: LowPrecision) -> str:
        """Evidence for the report."""
        parts = []
        if self.overflow:
            parts.append(
                f"{self.overflow} value(s) beyond the {target.short_name} range "
                f"(absmax {self.absmax:.3g} > {target.limits.max:.6g})"
            )
        if self.significant_flush:
            parts.append(
                f"{self.flushed} non-zero value(s) {FLUSH_WORDS} in {target.short_name} "
                f"(underflow, e.g. {self.max_flushed:.3g})"
            )
        return "; ".join(parts) or "representable"



def reduction_axes(node: ir.Node) -> list[int] | None:
    """The axes of a Reduce* node (see :func:`mixprec.graphs.reduction_axes`), its constant
    input read when small."""
    return graphs_reduction_axes(node, small_constant_array)


def replace_constant(value: ir.Value, tensor: ir.TensorProtocol) -> None:
    """Give an initializer new values (same type and shape), forgetting what was measured of
    the old ones."""
    value.const_value = tensor
    for measured in _RANGES.values():
        measured.pop(value, None)


def copy_ranges(source: ir.Model, copy: ir.Model) -> None:
    """Give the initializers of `copy` (a clone of `source`) what was measured of `source`'s."""
    for graph, copied in zip(all_graphs(source), all_graphs(copy)):
        initializers = copied.initializers
        for name, value in graph.initializers.items():
            twin = initializers.get(name)
            for measured in _RANGES.values():
                found = measured.get(value)
                if found is not None and twin is not None:
                    measured[twin] = found


def measured_range(value: ir.Value, target: LowPrecision) -> ConstantRange | None:
    """What `constant_range` or `constant_ranges` measured of `value` for `target` (None: not
    measured)."""
    measured = _RANGES.get(target)
    return measured.get(value) if measured is not None else None


def constant_range(value: ir.Value, target: LowPrecision) -> ConstantRange | None:
    """Range analysis of a float32 constant for `target` (cached on the value)."""
    measured = measured_range(value, target)
    if measured is not None:
        return measured
    tensor = constant_tensor(value)
    if tensor is None or tensor.dtype != ir.DataType.FLOAT:
        return None
    result = tensor_range(tensor, target)
    _cache_range(value, target, result)
    return result


def overflows_only_below(value: ir.Value, target: LowPrecision) -> bool:
    """Whether every value of a float32 constant beyond `target`'s range lies below it (a mask
    fill of float32's lowest), none above."""
    tensor = constant_tensor(value)
    if tensor is None or tensor.dtype != ir.DataType.FLOAT:
        return False
    array = np.asarray(tensor.numpy())
    return bool(array.size) and not bool((array > target.limits.max).any())


# Constants up to this many elements are measured in batches of about as many elements (small
# enough to stay in cache: each batch is a handful of vector operations).
_BATCH_ELEMENTS = 1 << 16


def constant_ranges(values: Iterable[ir.Value], target: LowPrecision) -> None:
    """Measure many float32 constants for `target` at once (cached on each value, as
    :func:`constant_range` does): small ones are read with one open file per data file and
    measured in batches, large ones in chunks."""
    batch: list[tuple[ir.Value, np.ndarray]] = []
    size = 0
    with ExternalReader() as reader:
        for value in values:
            if measured_range(value, target) is not None:
                continue
            tensor = constant_tensor(value)
            if tensor is None or tensor.dtype != ir.DataType.FLOAT:
                continue
            array = None
            if tensor_size(tensor) <= _BATCH_ELEMENTS:
                array = reader.read(tensor) if isinstance(tensor, ir.ExternalTensor) else float32_values(tensor)
            if array is None:
                constant_range(value, target)
                continue
            if size + array.size > _BATCH_ELEMENTS:
                _record_ranges(batch, target)
                batch, size = [], 0
            batch.append((value, array))
            size += array.size
        _record_ranges(batch, target)


def _record_ranges(batch: list[tuple[ir.Value, np.ndarray]], target: LowPrecision) -> None:
    """Cache on each value the range of its (flat float32) elements, measured together with the
    others' (what :func:`tensor_range` measures, one tensor at a time)."""
    filled = [(value, array) for value, array in batch if array.size]
    for value, array in batch:
        if not array.size:
            _cache_range(value, target, ConstantRange(0.0, 0, 0, 0.0, False))
    if not filled:
        return
    limits = target.limits
    flat = np.concatenate([array for _, array in filled])
    starts = np.cumsum([0] + [array.size for _, array in filled[:-1]])
    magnitude = np.abs(flat)
    finite = np.isfinite(magnitude)
    all_finite = bool(finite.all())
    absmax = np.maximum.reduceat(magnitude if all_finite else np.where(finite, magnitude, 0.0), starts).tolist()
    overflows = magnitude >= np.float32(limits.overflow_from)  # what a cast to the 16-bit type makes inf
    if not all_finite:
        overflows &= finite
    overflow = np.add.reduceat(overflows, starts, dtype=np.int64).tolist()
    lost = (magnitude > 0) & (magnitude <= limits.smallest_subnormal / 2)
    if lost.any():
        lost[lost] = flat[lost].astype(target.numpy_dtype).astype(np.float32) == 0
    flushed = np.add.reduceat(lost, starts, dtype=np.int64).tolist()
    max_flushed = np.maximum.reduceat(np.where(lost, magnitude, 0.0), starts).tolist()
    eps = limits.eps
    _measured(target).update({
        value: ConstantRange(
            absmax=top, overflow=over, flushed=count, max_flushed=largest,
            significant_flush=count > 0 and largest > top * eps,
        )
        for (value, _), top, over, count, largest in zip(filled, absmax, overflow, flushed, max_flushed)
    })


def _measured(target: LowPrecision) -> weakref.WeakKeyDictionary[ir.Value, ConstantRange]:
    """The ranges measured for `target`, by value."""
    measured = _RANGES.get(target)
    if measured is None:
        measured = _RANGES[target] = weakref.WeakKeyDictionary()
    return measured


def _cache_range(value: ir.Value, target: LowPrecision, found: ConstantRange) -> None:
    _measured(target)[value] = found


def tensor_range(tensor: ir.TensorProtocol, target: LowPrecision) -> ConstantRange:
    """Range analysis of a float32 tensor for `target` (read in chunks)."""
    limits = target.limits
    absmax = 0.0
    overflow = 0
    flushed = 0
    max_flushed = 0.0
    half_subnormal = limits.smallest_subnormal / 2
    for chunk in iter_chunks(tensor):
        chunk = chunk.astype(np.float32, copy=False)
        if chunk.size == 0:
            continue
        magnitude = np.abs(chunk)
        chunk_max = float(magnitude.max())
        if not np.isfinite(chunk_max):
            finite = np.isfinite(magnitude)
            magnitude = np.where(finite, magnitude, 0.0)
            chunk_max = float(magnitude.max())
        absmax = max(absmax, chunk_max)
        if chunk_max >= limits.max:
            with np.errstate(over="ignore"):
                cast = chunk[np.isfinite(chunk)].astype(target.numpy_dtype)
            overflow += int(np.count_nonzero(np.isinf(cast.astype(np.float32))))
        if float(magnitude.min()) > half_subnormal:
            continue  # fast path: nothing can flush (no zeros, no tiny values)
        tiny = magnitude[(magnitude > 0) & (magnitude <= half_subnormal)]
        if tiny.size:
            tiny_cast = tiny.astype(target.numpy_dtype).astype(np.float32)
            lost = tiny[tiny_cast == 0]
            flushed += int(lost.size)
            if lost.size:
                max_flushed = max(max_flushed, float(lost.max()))
    return ConstantRange(
        absmax=absmax,
        overflow=overflow,
        flushed=flushed,
        max_flushed=max_flushed,
        significant_flush=flushed > 0 and max_flushed > absmax * limits.eps,
    )
