"""Saving models so that a reader never sees a half-written output.

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
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from mixprec.errors import InputError
from mixprec.graphs import all_graphs, default_domain_version
from mixprec.io.graph_bytes import keeps_type
from mixprec.io import streaming
from mixprec.io import value_types
from mixprec.io.loading import external_slots, read_external, shared_reads
from mixprec.io.views import tensor_nbytes, wants_external_data
from mixprec.progress import Progress

__all__ = ["StagedModel", "check_output_path", "save_model", "staged_save", "without_staging", "write_text_atomic"]

logger = logging.getLogger(__name__)

# A single protobuf (an .onnx file without external data) cannot exceed this.
_PROTOBUF_LIMIT = (2 << 30) - 1
# Tensors of at least this size go to the external data file.
_EXTERNAL_TENSOR_MIN_BYTES = 1024
# The data file of a save, after "<name>.": the writer's process id and a random token.
_OUR_DATA = re.compile(r"(\d+)-[0-9a-f]{8}\.data$")


@contextlib.contextmanager
def _value_info_of(model: ir.Model, declared: set[str] | None) -> Iterator[None]:
    """Leave out of the saved file the types and shapes of intermediate values and initializers
    that the input did not declare (`declared`, by name; None: keep all): ONNX inference filled
    them in, a runtime infers them again, and writing them costs as much as writing the nodes.
    Outputs of ops ONNX does not define keep theirs (no ONNX inference can recover them).
    The main graph's node outputs are left to the writer (:func:`mixprec.io.streaming.save`)."""
    if declared is None:
        yield
        return
    stashed: list[tuple[ir.Value, ir.TypeProtocol | None, ir.Shape | None]] = []
    opset = default_domain_version(model.opset_imports)
    for graph in all_graphs(model):
        boundary = {*graph.inputs, *graph.outputs}
        values = [*graph.initializers.values()]
        if graph is not model.graph:  # the main graph's node outputs: streaming.save's
            values.extend(v for node in graph for v in node.outputs)
        for value in values:
            if value.name in declared or value in boundary or (value.type is None and value.shape is None):
                continue
            producer = value.producer()
            if producer is not None and keeps_type(declared, producer, value.name or "", opset):
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


# The lazily created containers of onnx_ir objects that its serializer asks for on every value,
# node and tensor it writes (`meta`, `metadata_props`), creating an empty one where there was none.
_LAZY_SLOTS = ("_metadata", "_metadata_props")


@contextlib.contextmanager
def _no_metadata_left_behind(model: ir.Model) -> Iterator[None]:
    """Undo a side effect of onnx_ir's serializer: reading `meta` and `metadata_props` of every
    value, node and tensor creates an empty store on each that had none, ~35 MB that outlive
    the save on a graph of 100k nodes. Empty stores are dropped after the save (reading the
    property again makes a new one)."""
    try:
        yield
    finally:
        for graph in all_graphs(model):
            owners: list[object] = [*graph.inputs]
            for value in graph.initializers.values():
                owners.append(value)
                owners.append(value.const_value)
            for node in graph:
                owners.append(node)
                owners.extend(node.outputs)
            for owner in owners:
                for slot in _LAZY_SLOTS:
                    store = getattr(owner, slot, None)
                    if store is not None and not store:
                        setattr(owner, slot, None)


def _write(
    model: ir.Model, path: Path, data_name: str | None, progress: bool | None, declared: set[str] | None = None
) -> None:
    with _value_info_of(model, declared), _no_metadata_left_behind(model), shared_reads():
        _write_all(model, path, data_name, progress, declared)
    set_aside = model.meta.get(value_types.SET_ASIDE)
    if set_aside:
        value_types.restore_file(path, set_aside)


def _write_all(model: ir.Model, path: Path, data_name: str | None, progress: bool | None, declared: set[str] | None) -> None:
    try:
        if data_name is not None:
            _write_with_external_data(model, path, data_name, progress, declared)
        else:
            _inline_external(model)
            streaming.save(model, path, declared)
    except streaming.ProtobufTooLarge as e:
        what = "its graph alone (weights aside)" if data_name is not None else "the converted model"
        advice = "no .onnx file can hold it" if data_name is not None else "save with external data (--external-data yes)"
        raise InputError(f"{path.name}: {what} is larger than protobuf's 2 GB limit for one .onnx file; {advice}") from e


def _write_with_external_data(
    model: ir.Model, path: Path, data_name: str, progress: bool | None, declared: set[str] | None
) -> None:
    """Tensors of at least 1 kB go to `data_name` beside `path`; the model keeps its own."""
    initialized = [value for graph in all_graphs(model) for value in graph.initializers.values()]
    tensors = [value.const_value for value in initialized]
    written = sum(
        size for tensor in tensors if tensor is not None and (size := tensor_nbytes(tensor)) >= _EXTERNAL_TENSOR_MIN_BYTES
    )
    bar = Progress.auto("writing weights", float(written), unit="B", enabled=progress)

    def callback(tensor: ir.TensorProtocol, info: ir.external_data.CallbackInfo) -> None:
        bar.advance(float(tensor.nbytes))

    try:
        ir.external_data.unload_from_model(
            _KnownGraphs(model),  # type: ignore[arg-type] - what unload_from_model reads of a model
            path.parent,
            data_name,
            size_threshold_bytes=_EXTERNAL_TENSOR_MIN_BYTES,
            max_in_flight_bytes=256 << 20,
            callback=callback,
        )
        streaming.save(model, path, declared)
    finally:  # the model keeps its own tensors, not the file's
        for value, tensor in zip(initialized, tensors, strict=True):
            value.const_value = tensor
    bar.close()


class _KnownGraphs:
    """`model` with its graphs listed by :func:`mixprec.graphs.all_graphs`, which finds the
    subgraphs from the nodes that own any (`ir.Model.graphs` visits every node of every graph)."""

    def __init__(self, model: ir.Model) -> None:
        self._model = model

    def graphs(self) -> list[ir.Graph]:
        return all_graphs(self._model)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - whatever the model has
        return getattr(self._model, name)


def _inline_external(model: ir.Model) -> None:
    """Read external tensors (initializers and Constant attributes, everywhere) into memory, for
    a save without external data."""
    slots = list(external_slots(model))
    total = sum(slot.tensor.nbytes for slot in slots)
    if total > _PROTOBUF_LIMIT:
        raise InputError(
            f"the model keeps {total / 1e9:.1f} GB of weights in external data: too large for one "
            ".onnx file (protobuf's 2 GB limit); save with external data (--external-data yes)"
        )
    for slot in slots:
        array = read_external(slot.tensor)
        slot.replace(ir.Tensor(slot.tensor.numpy() if array is None else array, name=slot.tensor.name))


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
    folder = path.parent
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
    parent = destination.parent
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
    """Names of the external data files a saved model refers to (in its folder). Only data
    files named after the model can be ours (`<name>.data`, `<name>.<pid>-<token>.data`): when
    there are none, the model is not parsed (a second of work for a large graph)."""
    if not model_path.is_file():
        return set()
    parent = model_path.parent
    prefix = f"{model_path.name}."
    if not any(entry.name.startswith(prefix) and entry.name.endswith(".data") for entry in parent.iterdir()):
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
    parent = destination.parent
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


class StagedModel:
    """A model written into a staging folder beside its destination: :meth:`publish` moves it
    (and its data file) into place atomically, :meth:`discard` removes it. Until one of them
    runs, the destination is untouched.

    Attributes:
        path: The staged model file (for checks).
    """

    def __init__(
        self,
        model: ir.Model,
        destination: str | os.PathLike,
        *,
        external_data: bool | None = None,
        progress: bool | None = False,
        declared: set[str] | None = None,
    ) -> None:
        self.destination = check_output_path(destination)
        self._parent = self.destination.parent
        self._previous = _data_files_of(self.destination)
        _remove_leftovers(self.destination, self._previous)
        if external_data is None:
            external_data = wants_external_data(model)
        token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._data_name = f"{self.destination.name}.{token}.data" if external_data else None
        self._staging = Path(tempfile.mkdtemp(prefix=f".{self.destination.name}.mixprec-{token}-", dir=self._parent))
        self.path = self._staging / self.destination.name
        try:
            _write(model, self.path, self._data_name, progress, declared)
        except BaseException:
            self.discard()
            raise

    def publish(self) -> Path:
        """Move the staged model into place (the atomic switch from the old pair to the new
        one) and remove what the old model left that is ours."""
        try:
            if self._data_name is not None and (self._staging / self._data_name).exists():
                os.replace(self._staging / self._data_name, self._parent / self._data_name)
            os.replace(self.path, self.destination)
        finally:
            self.discard()
        current = {self._data_name} if self._data_name is not None else set()  # what the new model refers to
        name = self.destination.name
        for old in self._previous - current:  # the old pair's data file, if it was one of ours
            if old == f"{name}.data" or _OUR_DATA.match(old.removeprefix(f"{name}.")):
                (self._parent / old).unlink(missing_ok=True)
        _remove_leftovers(self.destination, current)
        return self.destination

    def discard(self) -> None:
        """Remove the staging folder (nothing is published)."""
        shutil.rmtree(self._staging, ignore_errors=True)


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
    staged = StagedModel(model, destination, external_data=external_data, progress=progress, declared=declared)
    try:
        yield staged.path
    except BaseException:
        staged.discard()
        raise
    staged.publish()


def save_model(
    model: ir.Model,
    destination: str | os.PathLike,
    *,
    external_data: bool | None = None,
    check: Callable[[Path], None] | None = None,
    progress: bool | None = False,
    declared: set[str] | None = None,
) -> Path:
    """Save atomically; `check(staged_path)` may raise to prevent publishing. `declared`: as
    for :func:`staged_save` (a conversion's output keeps only the types its input declared)."""
    with staged_save(model, destination, external_data=external_data, progress=progress, declared=declared) as staged:
        if check is not None:
            check(staged)
    return Path(destination)
