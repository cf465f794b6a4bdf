"""Loading and saving models: clear errors for bad files, atomic writes, external data.

Loading goes through onnx_ir, so external weights stay memory-mapped / unread until needed.
Saving writes into a temporary folder next to the destination and moves the files into place
only after the caller's check passed: a failed conversion never leaves a half-written output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import onnx_ir as ir

from mixprec.graphs import all_graphs
from google.protobuf.message import DecodeError

from mixprec.errors import InputError, ModelLoadError
from mixprec.progress import Progress

logger = logging.getLogger(__name__)

# Above this many bytes of weights the output is saved with external data.
EXTERNAL_DATA_THRESHOLD = 1 << 30
# Tensors of at least this size go to the external data file.
_EXTERNAL_TENSOR_MIN_BYTES = 1024


def _check_external_data(model: ir.Model, path: Path) -> None:
    for graph in all_graphs(model):
        for value in graph.initializers.values():
            tensor = value.const_value
            if not isinstance(tensor, ir.ExternalTensor):
                continue
            data_path = Path(tensor.path)
            if not data_path.is_file():
                raise ModelLoadError(
                    f"{path}: external data file {str(tensor.location)!r} for tensor "
                    f"{value.name!r} is missing (looked in {data_path.parent})"
                )
            needed = (tensor.offset or 0) + (tensor.length or tensor.nbytes)
            if data_path.stat().st_size < needed:
                raise ModelLoadError(
                    f"{path}: external data file {data_path} is truncated: tensor "
                    f"{value.name!r} needs {needed} bytes, the file has {data_path.stat().st_size}"
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
            return ir.serde.deserialize_model(source), None
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
        model = ir.load(path)
    except DecodeError as e:
        raise ModelLoadError(f"{path}: not an ONNX model or truncated (protobuf parse error)") from e
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot be loaded: {_root_message(e)}") from e
    except Exception as e:  # noqa: BLE001 - any parser failure is a bad model file
        raise ModelLoadError(f"{path}: cannot be read: {_root_message(e)}") from e
    if model.graph is None or (len(model.graph) == 0 and not model.graph.outputs):
        raise ModelLoadError(f"{path}: not an ONNX model (no graph)")
    _check_external_data(model, path)
    return model, path


def graph_only_proto(path: str | os.PathLike, max_inline_bytes: int = 1024) -> onnx.ModelProto:
    """A model file's graph without large initializer data: those become typed graph inputs.

    Reads the graph (never external data); enough for shape inference and for an onnxruntime
    session that proves the graph loads, at a fraction of the memory of the weights.
    """
    proto = onnx.load(str(path), load_external_data=False)
    # Before IR 4 an initializer is typed only through a graph input of the same name.
    proto.ir_version = max(proto.ir_version, 4)
    graph = proto.graph
    inputs = {i.name for i in graph.input}
    kept = []
    for tensor in graph.initializer:
        external = tensor.data_location == onnx.TensorProto.EXTERNAL
        if not external and len(tensor.raw_data) <= max_inline_bytes:
            kept.append(tensor)
            continue
        if tensor.name not in inputs:
            graph.input.append(
                onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))
            )
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return proto


def weight_free_proto(model: ir.Model, max_inline_bytes: int = 1024) -> onnx.ModelProto:
    """Serialize `model` with large main-graph initializers turned into typed graph inputs
    (the in-memory counterpart of :func:`graph_only_proto`; no weight is read)."""
    graph = model.graph
    removed: list[tuple[ir.Value, ir.TensorProtocol | None]] = []
    original_inputs = list(graph.inputs)
    input_set = set(original_inputs)
    for value in list(graph.initializers.values()):
        tensor = value.const_value
        if tensor is not None:
            if value.dtype is None:
                value.dtype = tensor.dtype
            if value.shape is None:
                value.shape = ir.Shape(tensor.shape)
        if tensor is None or tensor.nbytes > max_inline_bytes:
            removed.append((value, tensor))
            graph.initializers.pop(value.name)
            if value not in input_set:
                graph.inputs.append(value)
    try:
        return ir.serde.serialize_model(model)
    finally:
        for value, tensor in removed:
            value.const_value = tensor
            graph.initializers.add(value)
        graph.inputs.clear()
        graph.inputs.extend(original_inputs)


def weight_bytes(model: ir.Model) -> int:
    """Total bytes of all initializers (subgraphs included)."""
    return sum(
        v.const_value.nbytes
        for graph in all_graphs(model)
        for v in graph.initializers.values()
        if v.const_value is not None
    )


def uses_external_data(model: ir.Model) -> bool:
    """Whether any initializer lives in an external data file."""
    return any(
        isinstance(v.const_value, ir.ExternalTensor)
        for graph in all_graphs(model)
        for v in graph.initializers.values()
    )


def wants_external_data(model: ir.Model, weights: int | None = None) -> bool:
    """The default for saving `model`: external data when it already uses external data or its
    weights exceed 1 GiB. `weights`: its `weight_bytes`, when already known."""
    if uses_external_data(model):
        return True
    return (weight_bytes(model) if weights is None else weights) > EXTERNAL_DATA_THRESHOLD


def _write(model: ir.Model, path: Path, external: bool, progress: bool | None) -> None:
    if external:
        sizes = {
            v.name: v.const_value.nbytes
            for graph in all_graphs(model)
            for v in graph.initializers.values()
            if v.const_value is not None and v.const_value.nbytes >= _EXTERNAL_TENSOR_MIN_BYTES
        }
        bar = Progress.auto("writing weights", float(sum(sizes.values())), unit="B", enabled=progress)

        def callback(tensor: ir.TensorProtocol, info: ir.external_data.CallbackInfo) -> None:
            bar.advance(float(tensor.nbytes))

        ir.save(
            model,
            path,
            external_data=f"{path.name}.data",
            size_threshold_bytes=_EXTERNAL_TENSOR_MIN_BYTES,
            max_in_flight_bytes=256 << 20,
            callback=callback,
        )
        bar.close()
    else:
        ir.save(model, path)


@contextlib.contextmanager
def staged_save(
    model: ir.Model,
    destination: str | os.PathLike,
    *,
    external_data: bool | None = None,
    progress: bool | None = False,
) -> Iterator[Path]:
    """Save `model` into a staging folder beside `destination`; publish on clean exit.

    Yields the staged model path (for checks). When the `with` block raises, nothing is
    published and the staging folder is removed.

    Args:
        model: The model to save.
        destination: Final path of the .onnx file.
        external_data: Save weights to `<name>.data`; default: when the weights exceed 1 GiB or
            the model already used external data.
        progress: Show a progress line while writing weights (None: when stderr is a terminal).
    """
    destination = Path(destination)
    parent = destination.parent if str(destination.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{destination}: output folder {parent} does not exist")
    if destination.is_dir():
        raise InputError(f"{destination}: is a directory, expected a file name")
    if external_data is None:
        external_data = wants_external_data(model)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=parent))
    staged = staging / destination.name
    try:
        _write(model, staged, external_data, progress)
        yield staged
        data = staging / f"{destination.name}.data"
        if data.exists():
            os.replace(data, parent / data.name)
        os.replace(staged, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_model(
    model: ir.Model,
    destination: str | os.PathLike,
    *,
    external_data: bool | None = None,
    check: Callable[[Path], None] | None = None,
    progress: bool | None = False,
) -> Path:
    """Save atomically; `check(staged_path)` may raise to prevent publishing."""
    with staged_save(model, destination, external_data=external_data, progress=progress) as staged:
        if check is not None:
            check(staged)
    return Path(destination)
