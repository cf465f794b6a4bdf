"""Loading models: clear errors for bad files, and external data checked before any file of it
is touched (relative, inside the model's folder, no symlink leading out of it). Loading goes
through onnx_ir, so external weights stay memory-mapped / unread until needed."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from mixprec.errors import InputError, ModelLoadError
from mixprec.graphs import all_graphs, all_nodes
from mixprec.io.value_types import deserialize

__all__ = ["load_model"]


@dataclass(frozen=True)
class TensorSlot:
    """A tensor of the model and where it sits: an initializer (`value`) or a node's tensor
    attribute (`node`, `attribute`; `position` in a list of tensors)."""

    name: str
    tensor: ir.TensorProtocol
    value: ir.Value | None = None
    node: ir.Node | None = None
    attribute: str | None = None
    position: int | None = None

    def replace(self, tensor: ir.TensorProtocol) -> None:
        """Put `tensor` where this one was."""
        if self.value is not None:
            self.value.const_value = tensor
            return
        assert self.node is not None and self.attribute is not None
        old = self.node.attributes[self.attribute]
        if self.position is None:
            self.node.attributes[self.attribute] = ir.AttrTensor(self.attribute, tensor, doc_string=old.doc_string)
        else:
            tensors = list(old.value)
            tensors[self.position] = tensor
            self.node.attributes[self.attribute] = ir.AttrTensors(self.attribute, tensors, doc_string=old.doc_string)


def tensor_slots(model: ir.Model, kind: type | tuple[type, ...]) -> Iterator[TensorSlot]:
    """Every tensor of class `kind`: initializers of every graph, and tensors held in node
    attributes (Constant values, lists of tensors) anywhere, function bodies and their
    subgraphs included."""
    for graph in all_graphs(model):
        for value in graph.initializers.values():
            if isinstance(value.const_value, kind):
                yield TensorSlot(value.name or "", value.const_value, value=value)
    for node in all_nodes(model):
        if not node.attributes:
            continue
        for attr in node.attributes.values():
            if attr.type is ir.AttributeType.TENSOR and isinstance(attr.value, kind):
                yield TensorSlot(f"{node.name or node.op_type}.{attr.name}", attr.value, node=node, attribute=attr.name)
            elif attr.type is ir.AttributeType.TENSORS and not attr.is_ref():
                for position, tensor in enumerate(attr.value or ()):
                    if isinstance(tensor, kind):
                        yield TensorSlot(
                            f"{node.name or node.op_type}.{attr.name}[{position}]", tensor,
                            node=node, attribute=attr.name, position=position,
                        )


def external_slots(model: ir.Model) -> Iterator[TensorSlot]:
    """Every tensor stored in an external file (see `tensor_slots`)."""
    return tensor_slots(model, ir.ExternalTensor)


def _release_parsed_file(slots: list[TensorSlot]) -> None:
    """Copy the tensors onnx_ir read from the parsed file (inline initializers, Constant
    values) into a protobuf of their own. A tensor onnx_ir deserialized keeps its part of the
    parsed message, and a part keeps the whole message alive, nodes included: 60 MB on a graph
    of 100k nodes, for a few small constants."""
    if not slots:
        return
    holder = onnx.GraphProto()  # one message for all, apart from the file's
    holder.initializer.extend(slot.tensor.raw for slot in slots)  # type: ignore[attr-defined]
    for slot, proto in zip(slots, holder.initializer, strict=True):
        slot.replace(ir.serde.TensorProtoTensor(proto))


def _settle_tensors(model: ir.Model, path: Path) -> None:
    """One walk over the tensors of a model loaded from `path`: external ones learn the
    model's folder and are checked (see `_check_external_data`), the ones read from the
    parsed file get a protobuf of their own (`_release_parsed_file`)."""
    external: list[TensorSlot] = []
    parsed: list[TensorSlot] = []
    for slot in tensor_slots(model, (ir.ExternalTensor, ir.serde.TensorProtoTensor)):
        (external if isinstance(slot.tensor, ir.ExternalTensor) else parsed).append(slot)
    _release_parsed_file(parsed)
    _check_external_data(external, path)


class ExternalReader:
    """Reads external tensors with one open file per data file (a context manager): thousands
    of small tensors in one file cost one positioned read each, not an open each."""

    def __init__(self) -> None:
        self._files: dict[tuple[object, str], int] = {}  # (folder, location) -> descriptor

    def __enter__(self) -> ExternalReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for descriptor in self._files.values():
            os.close(descriptor)
        self._files.clear()

    def read(self, tensor: ir.ExternalTensor) -> np.ndarray | None:
        """The tensor's values, flat (None for element types narrower than a byte)."""
        dtype = tensor.dtype
        if not dtype.itemsize or dtype.bitwidth % 8:
            return None
        key = (tensor.base_dir, tensor.location)
        descriptor = self._files.get(key)
        if descriptor is None:
            descriptor = self._files[key] = os.open(tensor.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        array = np.empty(tensor.size, dtype=dtype.numpy())
        target, done, offset = array.view(np.uint8), 0, tensor.offset or 0
        while done < target.size:
            count = _read_at(descriptor, target[done:], offset + done)
            if not count:
                raise OSError(f"external data file {tensor.path} is shorter than declared")
            done += count
        return array


def _read_at(descriptor: int, into: np.ndarray, offset: int) -> int:
    """Read into `into` (bytes) from `offset` of the file; the count read (0 at its end)."""
    if hasattr(os, "preadv"):
        return os.preadv(descriptor, [into], offset)
    os.lseek(descriptor, offset, os.SEEK_SET)  # platforms without positioned reads into a buffer
    data = os.read(descriptor, into.size)
    into[: len(data)] = np.frombuffer(data, np.uint8)
    return len(data)


def read_external(tensor: ir.ExternalTensor) -> np.ndarray | None:
    """An external tensor's values read from its file (None for element types narrower than a
    byte). onnx_ir's own `numpy()` maps the whole data file once per tensor: thousands of small
    tensors each touching their own mapping cost tens of kilobytes of memory apiece, and one of
    the process's limited mappings each. Within :func:`shared_reads` the files stay open;
    many tensors in one place: :class:`ExternalReader`."""
    shared = _SHARED.get()
    if shared is not None:
        array = shared.read(tensor)
    else:
        with ExternalReader() as reader:
            array = reader.read(tensor)
    return None if array is None else array.reshape(tuple(int(d) for d in tensor.shape))


# The reader of the innermost `shared_reads` block in progress (per thread and task).
_SHARED: contextvars.ContextVar[ExternalReader | None] = contextvars.ContextVar("mixprec_shared_reads", default=None)


@contextlib.contextmanager
def shared_reads() -> Iterator[None]:
    """Within the block, `read_external` keeps each data file open (a save reads thousands of
    small weights one at a time, through their lazy 16-bit copies: an open each otherwise)."""
    with ExternalReader() as reader:
        token = _SHARED.set(reader)
        try:
            yield
        finally:
            _SHARED.reset(token)


def _check_locations(tensors: list[tuple[str, ir.ExternalTensor]], path: Path) -> None:
    """Refuse external data outside the model's folder, before any file of it is touched (each
    distinct location is resolved once: thousands of tensors share one data file)."""
    root = os.path.realpath(path.parent)
    checked: set[str] = set()
    for name, tensor in tensors:
        location = str(tensor.location)
        if location in checked:
            continue
        parts = PurePath(location).parts
        escapes = not location or "\0" in location or PurePath(location).is_absolute() or ".." in parts
        if not escapes:
            resolved = os.path.realpath(os.path.join(root, location))
            escapes = os.path.commonpath([root, resolved]) != root
        if escapes:
            raise ModelLoadError(
                f"{path}: tensor {name!r} keeps its data at {location!r}, outside the model's "
                "folder; external data must lie in the model's folder (or below it)"
            )
        checked.add(location)


def _check_external_data(slots: list[TensorSlot], path: Path) -> None:
    """External tensors read from the model's folder, and only from there; their files exist
    and hold their bytes."""
    for slot in slots:
        slot.tensor.base_dir = path.parent  # type: ignore[attr-defined]
    tensors = [(slot.name, slot.tensor) for slot in slots]
    _check_locations(tensors, path)
    sizes: dict[str, int | None] = {}  # data file -> its size (None: missing), looked up once
    for name, tensor in tensors:
        data_path = str(tensor.path)
        if data_path not in sizes:
            sizes[data_path] = os.path.getsize(data_path) if os.path.isfile(data_path) else None
        size = sizes[data_path]
        if size is None:
            raise ModelLoadError(
                f"{path}: external data file {str(tensor.location)!r} for tensor "
                f"{name!r} is missing (looked in {Path(data_path).parent})"
            )
        needed = (tensor.offset or 0) + (tensor.length or tensor.nbytes)
        if size < needed:
            raise ModelLoadError(
                f"{path}: external data file {data_path} is truncated: tensor "
                f"{name!r} needs {needed} bytes, the file has {size}"
            )


def _root_message(error: BaseException) -> str:
    """The first line of the innermost cause: the IR's wrappers repeat whole protobufs."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def load_model(source: str | os.PathLike | onnx.ModelProto | ir.Model) -> tuple[ir.Model, Path | None]:
    """Load a model from a path, a ModelProto or an onnx_ir Model.

    Returns:
        The IR model and the path it came from (None for in-memory models). An `ir.Model` is
        returned as is (and later converted in place).

    Raises:
        ModelLoadError: The file is missing, not an ONNX model, truncated, or its external
            data is missing.
    """
    if isinstance(source, ir.Model):
        return source, None
    if isinstance(source, onnx.ModelProto):
        try:
            return deserialize(source, owned=False), None
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot read the given ModelProto: {_root_message(e)}") from e
    if not isinstance(source, (str, os.PathLike)):
        raise InputError(
            f"expected a path, an onnx.ModelProto or an onnx_ir.Model, got {type(source).__name__}"
        )
    path = Path(source)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, expected an .onnx file")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: file is empty")
    try:
        # onnx_ir's `load` without its own walk over the tensors (`_settle_tensors` makes one).
        model = deserialize(onnx.load(path, load_external_data=False))
    except DecodeError as e:
        raise ModelLoadError(f"{path}: not an ONNX model or truncated (protobuf parse error)") from e
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot be loaded: {_root_message(e)}") from e
    except Exception as e:  # noqa: BLE001 - any parser failure is a bad model file
        raise ModelLoadError(f"{path}: cannot be read: {_root_message(e)}") from e
    if model.graph is None or (len(model.graph) == 0 and not model.graph.outputs):
        raise ModelLoadError(f"{path}: not an ONNX model (no graph)")
    _settle_tensors(model, path)
    return model, path
