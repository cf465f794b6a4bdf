"""What ONNX's own tools say of a model file: the checker, and shape inference of its graph
without the weights; run in a child process beside the converting one.

The checker and inference hold the GIL, so in the converting process they add to the time
onnx_ir takes to read the input (and the report takes to build, for the output's check); a
child runs them beside it. The child imports onnx alone (this
file runs as a script, not through the package) and answers in frames on its stdout, each a
one-byte tag, an 8-byte length and the payload (on a copy of its stdout: anything else that
writes there goes to stderr):

    c   the checker's first error line ("" where the model passes)
    s   strict inference's first error line, where it objects (lenient inference follows)
    m   the inferred graph-only model, serialized
    f   why inference failed

What the child does not answer (it could not start, it died) the caller computes in process with
the same functions.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Literal, NamedTuple

import onnx
import onnx.checker
import onnx.shape_inference

__all__ = [
    "CHILD_MIN_BYTES", "FileChecks", "Inferred", "checker_error", "file_inference", "first_line",
    "forget_output_shapes", "graph_only_proto", "infer_serialized", "inferred_graph",
]

# Below this file size the child's start costs more than it hides.
CHILD_MIN_BYTES = 4 << 20

_HEADER = 9  # tag (1 byte) and payload length (8 bytes, little-endian)
_TAGS = (b"c", b"s", b"m", b"f")
_MAX_FRAME_BYTES = 2 << 30  # an inferred graph is one protobuf


def first_line(error: BaseException) -> str:
    """An exception's first message line (its type's name when it has none)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def checker_error(model: str | os.PathLike | onnx.ModelProto, *, full_check: bool = True) -> str | None:
    """The ONNX checker's first error line (`full_check`: with strict type inference), or None."""
    try:
        onnx.checker.check_model(model if isinstance(model, onnx.ModelProto) else os.fspath(model), full_check=full_check)
    except Exception as e:  # noqa: BLE001 - the checker failing on a model is a finding too
        return first_line(e)
    return None


def graph_only_proto(path: str | os.PathLike, max_inline_bytes: int = 1024) -> onnx.ModelProto:
    """A model file's graph without large initializer data: those become typed graph inputs.

    Reads the graph (never external data); enough for shape inference and for an onnxruntime
    session that proves the graph loads, at a fraction of the memory of the weights.
    """
    proto = onnx.load(os.fspath(path), load_external_data=False)
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


def forget_output_shapes(graph: onnx.GraphProto, *, nested: bool = True) -> None:
    """Drop the declared shapes of the graph outputs (subgraphs included; `nested`: whether it
    has any, else its nodes are not walked) from the copy that inference reads, so that what it
    infers for them is what the model computes."""
    for output in graph.output:
        if output.type.HasField("tensor_type"):
            output.type.tensor_type.ClearField("shape")
    if not nested:
        return
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                forget_output_shapes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    forget_output_shapes(sub)


def infer_serialized(model: bytes, *, strict: bool) -> onnx.ModelProto:
    """ONNX inference of a serialized model (`strict`: types checked, the first error raised),
    with data propagation: shapes computed in the graph (Shape -> Gather -> Concat -> Reshape)
    keep their named and static dimensions instead of a new unknown one per value. Where
    propagation objects, inference runs again without it, as the checker runs it."""
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=strict, strict_mode=strict, data_prop=True)
    except Exception:  # noqa: BLE001 - judged by inference without propagation, the checker's own
        return onnx.shape_inference.infer_shapes(model, check_type=strict, strict_mode=strict)


class Inferred(NamedTuple):
    """Inference of a serialized graph.

    Attributes:
        strict_objection: Strict inference's first error line, where it was asked for and
            objected (lenient inference then ran).
        model: The inferred model (None when inference failed).
        failure: Why inference failed.
    """

    strict_objection: str | None
    model: onnx.ModelProto | None
    failure: str | None


def inferred_graph(graph: bytes, *, strict: bool, objected: Callable[[str], None] | None = None) -> Inferred:
    """Infer a serialized graph-only model: strictly first where `strict` (on an objection,
    `objected` is told, and may raise, before lenient inference runs)."""
    objection = None
    if strict:
        try:
            return Inferred(None, infer_serialized(graph, strict=True), None)
        except Exception as e:  # noqa: BLE001 - the objection is a finding; lenient inference follows
            objection = first_line(e)
        if objected is not None:
            objected(objection)
    try:
        return Inferred(objection, infer_serialized(graph, strict=False), None)
    except Exception as e:  # noqa: BLE001 - inference is best effort
        return Inferred(objection, None, first_line(e))


def _file_graph(path: str | os.PathLike) -> bytes:
    """The serialized graph-only model of a file, with its output shapes forgotten."""
    proto = graph_only_proto(path)
    forget_output_shapes(proto.graph)
    return proto.SerializeToString()


class FileChecks:
    """The checker's answer and the inference of one model file, computed by a child process.

    Each answer is read once, in order: :meth:`checker_problem`, then :meth:`inference`.
    Where the child gives no answer, the in-process fallback the caller passes computes it.
    """

    def __init__(self, process: subprocess.Popen[bytes], *, checker: Literal["structural", "full"] | None) -> None:
        self._process = process
        self._checker = checker
        self.started = time.perf_counter()  # when the child had its file (perf_counter)

    @classmethod
    def start(
        cls,
        path: str | os.PathLike | None,
        *,
        checker: Literal["structural", "full"] | None,
        infer: bool = False,
        strict: bool = False,
    ) -> FileChecks | None:
        """Start the child on `path`, or None where the file is too small to gain from it or no
        child can start.

        Args:
            path: The model file; None: the child starts now (Python and onnx load while the
                file is written) and waits for :meth:`check_file` to name it.
            checker: `structural` or `full` (with strict type inference): the checker runs first.
            infer: Infer the file's graph.
            strict: Inference runs strictly first.
        """
        flags = [f"--{checker}"] if checker is not None else []
        flags += [flag for flag, on in (("--infer", infer), ("--strict", strict)) if on]
        if not sys.executable or getattr(sys, "frozen", False):
            return None  # no Python to run the child (an application bundle, an embedding host)
        try:
            if path is not None and os.path.getsize(path) < CHILD_MIN_BYTES:
                return None
            process = subprocess.Popen(
                [sys.executable, "-c", _CHILD_ENTRY, __file__, "-" if path is None else os.fspath(path), *flags],
                stdin=subprocess.PIPE if path is None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            )
        except (OSError, ValueError):
            return None
        return cls(process, checker=checker)

    def check_file(self, path: str | os.PathLike) -> None:
        """Name the file to a child started without one: it starts on it."""
        stdin = self._process.stdin
        if stdin is None:
            return
        self.started = time.perf_counter()
        try:
            stdin.write(os.fsencode(path))
            stdin.close()
        except OSError:
            pass  # it died: its answers are missing, and the caller's fallbacks give them

    def _frame(self) -> tuple[bytes, bytes] | None:
        """The next frame, or None where the stream ends or holds something else."""
        stdout = self._process.stdout
        if stdout is None:
            return None
        try:
            header = stdout.read(_HEADER)
            if len(header) < _HEADER or header[:1] not in _TAGS:
                return None
            size = int.from_bytes(header[1:], "little")
            if size > _MAX_FRAME_BYTES:
                return None
            payload = stdout.read(size)
        except (OSError, ValueError, MemoryError):
            return None
        return (header[:1], payload) if len(payload) == size else None

    def checker_problem(self, fallback: Callable[[], str | None]) -> str | None:
        """The checker's first error line, or None where the model passes."""
        frame = self._frame() if self._checker is not None else None
        if frame is None or frame[0] != b"c":
            return fallback()
        return frame[1].decode(errors="replace") or None

    def inference(
        self,
        fallback: Callable[[Callable[[str], None] | None], Inferred],
        objected: Callable[[str], None] | None = None,
    ) -> Inferred:
        """The inferred graph; a strict objection is told to `objected` (which may raise)
        before it is returned. The child ends here. `fallback(objected)` infers in process
        (given None where the objection was told already)."""
        try:
            objection = None
            frame = self._frame()
            if frame is not None and frame[0] == b"s":
                objection = frame[1].decode(errors="replace")
                if objected is not None:
                    objected(objection)
                frame = self._frame()
        finally:
            self.close()
        if frame is None or frame[0] not in (b"f", b"m"):
            return fallback(objected if objection is None else None)
        tag, payload = frame
        if tag == b"f":
            return Inferred(objection, None, payload.decode(errors="replace"))
        model = onnx.ModelProto()
        try:
            model.ParseFromString(payload)
        except Exception:  # noqa: BLE001 - a damaged answer: inferred here instead
            return fallback(objected if objection is None else None)
        return Inferred(objection, model, None)

    def close(self) -> None:
        """End the child (answered or not)."""
        process = self._process
        if process.poll() is None:
            process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


# The child's command: this file as a script, with the working directory off the path (a
# module of the user's there must not stand in for onnx), and its frames on a private copy of
# stdout (whatever else writes to stdout, an import's message say, goes to stderr).
_CHILD_ENTRY = (
    "import os, runpy, sys; sys.path[:1] = [] if sys.path[:1] == [''] else sys.path[:1]; "
    "sys.argv.append(str(os.dup(1))); os.dup2(2, 1); runpy.run_path(sys.argv[1], run_name='__main__')"
)


def _send(out: IO[bytes], tag: bytes, payload: bytes) -> None:
    out.write(tag + len(payload).to_bytes(_HEADER - 1, "little"))
    out.write(payload)
    out.flush()


def _child(argv: list[str]) -> None:
    """The child: `argv` is the file (`-`: named on stdin), the flags, and the descriptor of
    its frames' stream."""
    path, flags, out = argv[0], set(argv[1:-1]), os.fdopen(int(argv[-1]), "wb")
    if path == "-":
        path = os.fsdecode(sys.stdin.buffer.read())  # the whole of stdin, once the file is written
        if not path:
            return
    if "--structural" in flags or "--full" in flags:
        _send(out, b"c", (checker_error(path, full_check="--full" in flags) or "").encode())
    if "--infer" not in flags:
        return
    try:
        graph = _file_graph(path)
    except Exception as e:  # noqa: BLE001 - reported as inference's failure
        _send(out, b"f", first_line(e).encode())
        return
    inferred = inferred_graph(graph, strict="--strict" in flags)
    del graph
    if inferred.strict_objection is not None:
        _send(out, b"s", inferred.strict_objection.encode())
    if inferred.model is None:
        _send(out, b"f", (inferred.failure or "inference failed").encode())
    else:
        _send(out, b"m", inferred.model.SerializeToString())


def file_inference(path: str | os.PathLike, *, strict: bool, objected: Callable[[str], None] | None = None) -> Inferred:
    """In process: inference of the graph of a model file (see :func:`inferred_graph`)."""
    try:
        graph = _file_graph(path)
    except Exception as e:  # noqa: BLE001 - inference is best effort
        return Inferred(None, None, first_line(e))
    return inferred_graph(graph, strict=strict, objected=objected)


if __name__ == "__main__":
    _child(sys.argv[2:])  # after `-c` and this file's path
