"""Run a model file with chosen intermediate values of its main graph as outputs.

onnxruntime only returns graph outputs, so a temporary copy of the model lists the wanted values
as its outputs. The copy never holds the weights in its protobuf: the model is read without its
external data, embedded float weights of 1 KiB or more are moved once into a data file in a
temporary folder, and the original external data files are hard-linked into that folder
(copied when a link is impossible, e.g. across file systems and with a read-only model folder),
because onnxruntime only reads external data that lies beside the model file. Each chunk's model
is then a small file that onnxruntime loads from its path.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx.shape_inference

from mixprec.errors import ModelLoadError
from mixprec.runtime import sessions
from mixprec.runtime.batches import Batch

logger = logging.getLogger(__name__)

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
        elem_types: The main graph's value types (ONNX element type, 0 for non-tensors), when
            already known (a typed model of the same file): no shape inference runs then.

    Raises:
        ModelLoadError: The file is missing, unreadable, or its external data is missing.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        elem_types: Mapping[str, int | None] | None = None,
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
            self.elem_types = self._infer_elem_types(elem_types)
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

    def _infer_elem_types(self, known: Mapping[str, int | None] | None) -> dict[str, int | None]:
        if known is None:
            return elem_types(self.proto, source=str(self.path))
        types = dict(known)
        for tensor in self.proto.graph.initializer:
            types[tensor.name] = tensor.data_type
        for node in self.proto.graph.node:
            for out in node.output:
                types.setdefault(out, None)
        return types

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
            RunError: onnxruntime cannot load or run the model.
            InputError: A batch lacks a model input.
        """
        names = list(dict.fromkeys(names))
        if not names:
            for feeds in batches:
                yield feeds, {}
            return
        path = self._write_chunk_model(names)
        try:
            session = sessions.make_session(
                path, providers=self.providers, graph_optimization="disable"
            )
            try:
                for feeds in batches:
                    results = sessions.run_session(session, feeds)
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


