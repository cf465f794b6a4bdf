"""Loading and saving models: clear errors for bad files, atomic writes, external data.

Loading goes through onnx_ir, so external weights stay memory-mapped / unread until needed.
External data locations are checked before any file is touched: relative, inside the model's
folder, no symlink leading out of it.

Saving writes into a staging folder next to the destination (named with the writer's process
id) and publishes only after the caller's check passed, so a failed conversion never leaves a
half-written output. Weights go to a data file with a name of its own per save
(`<name>.<pid>-<token>.data`): the data file moves into place first, then the `.onnx` replaces
the old one in one atomic rename, so a reader sees the old pair or the new pair, never a mix;
the old data file is removed after. Leftovers of killed runs (staging folders, data files no
model refers to) are removed by the next save to the same output.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePath

import onnx
import onnx_ir as ir

from mixprec.graphs import all_graphs, is_default_domain
from google.protobuf.message import DecodeError

from mixprec.errors import InputError, ModelLoadError
from mixprec.progress import Progress

logger = logging.getLogger(__name__)

# Above this many bytes of weights the output is saved with external data.
EXTERNAL_DATA_THRESHOLD = 1 << 30
# Tensors of at least this size go to the external data file.
_EXTERNAL_TENSOR_MIN_BYTES = 1024
# The data file of a save, after "<name>.": the writer's process id and a random token.
_OUR_DATA = re.compile(r"(\d+)-[0-9a-f]{8}\.data$")
# A single protobuf (an .onnx file without external data) cannot exceed this.
_PROTOBUF_LIMIT = (2 << 30) - 1


def _external_tensors(model: ir.Model) -> Iterator[tuple[str, ir.ExternalTensor]]:
    """(name, tensor) of every tensor stored in an external file: initializers of every graph
    and function, and tensors held in node attributes (Constant values)."""
    graphs: list[ir.Graph | ir.Function] = [*all_graphs(model), *model.functions.values()]
    for graph in graphs:
        if isinstance(graph, ir.Graph):
            for value in graph.initializers.values():
                if isinstance(value.const_value, ir.ExternalTensor):
                    yield value.name or "", value.const_value
        for node in graph:
            if node.op_type != "Constant" and not node.attributes:
                continue
            for attr in node.attributes.values():
                if attr.type is ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                    yield f"{node.name or node.op_type}.{attr.name}", attr.value


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


def _check_external_data(model: ir.Model, path: Path) -> None:
    tensors = list(_external_tensors(model))
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
    inlined: list[tuple[ir.Value, ir.TensorProtocol]] = []
    original_inputs = list(graph.inputs)
    input_set = set(original_inputs)
    try:
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
            elif isinstance(tensor, ir.ExternalTensor):
                # A small tensor in an external file: inline its bytes (its file reference is
                # relative to the model's folder, which the copy does not have).
                try:
                    array = tensor.numpy()
                except OSError as e:
                    raise ModelLoadError(f"initializer {value.name!r}: its external data cannot be read: {e}") from e
                inlined.append((value, tensor))
                value.const_value = ir.Tensor(array, name=value.name)
        return ir.serde.serialize_model(model)
    finally:
        for value, tensor in inlined:
            value.const_value = tensor
        for value, tensor in removed:
            value.const_value = tensor
            graph.initializers.add(value)
        graph.inputs.clear()
        graph.inputs.extend(original_inputs)


def weight_bytes(model: ir.Model) -> int:
    """Total bytes of the weights: initializers and tensors held in Constant nodes (as some
    exporters store them), subgraphs included."""
    total = 0
    for graph in all_graphs(model):
        total += sum(v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None)
        for node in graph:
            if node.op_type == "Constant" and (attr := node.attributes.get("value")) is not None:
                if attr.type is ir.AttributeType.TENSOR:
                    total += attr.value.nbytes
    return total


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


def _inline_external(model: ir.Model) -> None:
    """Read external tensors into memory, for a save without external data."""
    if not uses_external_data(model):
        return
    total = sum(t.nbytes for _, t in _external_tensors(model))
    if total > _PROTOBUF_LIMIT:
        raise InputError(
            f"the model keeps {total / 1e9:.1f} GB of weights in external data: too large for one "
            ".onnx file (protobuf's 2 GB limit); save with external data (--external-data yes)"
        )
    for graph in all_graphs(model):
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor):
                value.const_value = ir.Tensor(tensor.numpy(), name=tensor.name)


def typed_values(model: ir.Model) -> set[str]:
    """Names of the node outputs and initializers that carry a type or shape now (in a loaded
    model: those the file declared in its value_info)."""
    typed: set[str] = set()
    for graph in all_graphs(model):
        typed.update(v.name for v in graph.initializers.values() if v.type is not None or v.shape is not None)
        for node in graph:
            typed.update(v.name for v in node.outputs if v.name and (v.type is not None or v.shape is not None))
    return typed


@contextlib.contextmanager
def _value_info_of(model: ir.Model, declared: set[str] | None) -> Iterator[None]:
    """Leave out of the saved file the types and shapes of intermediate values and initializers
    that the input did not declare (`declared`, by name; None: keep all): ONNX inference filled
    them in, a runtime infers them again, and writing them costs as much as writing the nodes.
    Outputs of ops outside the ONNX domain keep theirs (no ONNX inference can recover them)."""
    if declared is None:
        yield
        return
    stashed: list[tuple[ir.Value, ir.TypeProtocol | None, ir.Shape | None]] = []
    for graph in all_graphs(model):
        boundary = {*graph.inputs, *graph.outputs}
        values = [*graph.initializers.values(), *(v for node in graph for v in node.outputs)]
        for value in values:
            if value.name in declared or value in boundary or (value.type is None and value.shape is None):
                continue
            producer = value.producer()
            if producer is not None and not is_default_domain(producer.domain):
                continue
            stashed.append((value, value.type, value.shape))
            value.type = None
            value.shape = None
    try:
        yield
    finally:
        for value, type_, shape in stashed:
            value.type = type_
            value.shape = shape


def _write(
    model: ir.Model, path: Path, data_name: str | None, progress: bool | None, declared: set[str] | None = None
) -> None:
    with _value_info_of(model, declared):
        _write_all(model, path, data_name, progress)


def _write_all(model: ir.Model, path: Path, data_name: str | None, progress: bool | None) -> None:
    if data_name is not None:
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
            external_data=data_name,
            size_threshold_bytes=_EXTERNAL_TENSOR_MIN_BYTES,
            max_in_flight_bytes=256 << 20,
            callback=callback,
        )
        bar.close()
    else:
        _inline_external(model)
        ir.save(model, path)


def _new_file_mode(path: Path) -> int:
    """The mode a file written at `path` gets: the existing file's, else the umask's default."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write a text file atomically: a temporary file in the same folder, then renamed over
    `path` (readers see the old file or the new one, never a part)."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, _new_file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def check_output_path(destination: str | os.PathLike) -> Path:
    """Refuse an output path that cannot be written, before any work is done."""
    destination = Path(destination)
    parent = destination.parent if str(destination.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{destination}: output folder {parent} does not exist")
    if destination.is_dir():
        raise InputError(f"{destination}: is a directory, expected a file name")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{destination}: output folder {parent} is not writable")
    return destination


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _data_files_of(model_path: Path) -> set[str]:
    """Names of the external data files a saved model refers to (in its folder)."""
    if not model_path.is_file():
        return set()
    try:
        proto = onnx.load(str(model_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not a model we wrote: it refers to nothing of ours
        return set()
    names: set[str] = set()
    graphs = [proto.graph]
    while graphs:
        graph = graphs.pop()
        tensors = list(graph.initializer)
        for node in graph.node:
            for attr in node.attribute:
                tensors.extend([attr.t] if attr.HasField("t") else [])
                graphs.extend([attr.g] if attr.HasField("g") else [])
                graphs.extend(attr.graphs)
        for tensor in tensors:
            for entry in tensor.external_data:
                if entry.key == "location":
                    names.add(entry.value)
    return names


def _remove_leftovers(destination: Path, keep: set[str]) -> None:
    """Staging folders and data files of dead writers of `destination`, and data files of
    ours that no published model refers to."""
    parent = destination.parent if str(destination.parent) else Path(".")
    staging = re.compile(re.escape(f".{destination.name}.mixprec-") + r"(\d+)-")
    prefixes = (f".{destination.name}.mixprec-", f"{destination.name}.")
    for entry in parent.iterdir():
        if not entry.name.startswith(prefixes):
            continue
        match = staging.match(entry.name)
        if match and entry.is_dir() and not _alive(int(match[1])):
            shutil.rmtree(entry, ignore_errors=True)
            continue
        match = _OUR_DATA.match(entry.name.removeprefix(f"{destination.name}.")) if entry.name.startswith(f"{destination.name}.") else None
        if match and entry.name not in keep and (not _alive(int(match[1])) or int(match[1]) == os.getpid()):
            entry.unlink(missing_ok=True)


# A staging folder in a path: ".<name>.mixprec-<pid>-<token>-<random>/" (see `staged_save`).
_STAGING_IN_TEXT = re.compile(r"\.([^/\s]+)\.mixprec-\d+-[0-9a-f]+-[^/\s]+/")


def without_staging(text: str) -> str:
    """`text` (a runtime's error about a staged model) with the staging folder taken out of its
    paths: it names the output the user asked for, not a folder that is gone."""
    return _STAGING_IN_TEXT.sub("", text)


@contextlib.contextmanager
def staged_save(
    model: ir.Model,
    destination: str | os.PathLike,
    *,
    external_data: bool | None = None,
    progress: bool | None = False,
    declared: set[str] | None = None,
) -> Iterator[Path]:
    """Save `model` into a staging folder beside `destination`; publish on clean exit.

    Yields the staged model path (for checks). When the `with` block raises (or the process
    is interrupted), nothing is published and the staging folder is removed.

    Args:
        model: The model to save.
        destination: Final path of the .onnx file.
        external_data: Save weights to a data file beside it; default: when the weights exceed
            1 GiB or the model already used external data.
        progress: Show a progress line while writing weights (None: when stderr is a terminal).
        declared: Save the types and shapes of intermediate values only for these values
            (see `typed_values`); None: for every value that has them.
    """
    destination = check_output_path(destination)
    parent = destination.parent if str(destination.parent) else Path(".")
    previous = _data_files_of(destination)
    _remove_leftovers(destination, previous)
    if external_data is None:
        external_data = wants_external_data(model)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    data_name = f"{destination.name}.{token}.data" if external_data else None
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.mixprec-{token}-", dir=parent))
    staged = staging / destination.name
    try:
        _write(model, staged, data_name, progress, declared)
        yield staged
        if data_name is not None and (staging / data_name).exists():
            os.replace(staging / data_name, parent / data_name)
        os.replace(staged, destination)  # the atomic switch from the old pair to the new one
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    current = {data_name} if data_name is not None else set()  # what the new model refers to
    for name in previous - current:  # the old pair's data file, if it was one of ours
        if name == f"{destination.name}.data" or _OUR_DATA.match(name.removeprefix(f"{destination.name}.")):
            (parent / name).unlink(missing_ok=True)
    _remove_leftovers(destination, current)


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
