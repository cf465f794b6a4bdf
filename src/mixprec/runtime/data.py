"""Model input data: input signatures, random inputs, and batches read from disk.

Supported on-disk layouts for :func:`load_batches`:

* a single ``.npz`` file (one batch; keys are input names);
* a directory of ``.npz`` files (one batch each, in file-name order);
* a directory in the ONNX test layout, ``test_data_set_N/input_K.pb``, or one
  ``test_data_set_N`` directory itself (``TensorProto`` files).
"""

from __future__ import annotations

import ast
import functools
import logging
import os
import re
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper

from mixprec.dtypes import is_float_dtype
from mixprec.errors import InputError

logger = logging.getLogger(__name__)

Shape = tuple[int | str | None, ...]

_TEST_SET_RE = re.compile(r"^test_data_set_(\d+)$")
_INPUT_PB_RE = re.compile(r"^input_(\d+)\.pb$")
_OUTPUT_PB_RE = re.compile(r"^output_(\d+)\.pb$")

# Range of generated integer values: [0, _INT_HIGH) is a valid index, length and 0/1 mask.
_INT_HIGH = 2


@dataclass(frozen=True)
class InputSpec:
    """Signature of one graph input.

    Attributes:
        name: Input name.
        dtype: Numpy dtype of the tensor (of the element tensors for sequence/optional
            inputs); ``bfloat16`` and other narrow types are ``ml_dtypes`` dtypes.
            ``object`` for strings and unknown types.
        shape: Dimensions: ``int`` for fixed, ``str`` for symbolic, ``None`` for unknown.
            ``None`` instead of a tuple when the rank is unknown, and for sequence and
            optional inputs.
        kind: ``"tensor"``, or ``"sequence"``, ``"optional"``, ``"map"``,
            ``"sparse_tensor"``, ``"unknown"`` (no element type) for inputs that cannot
            be generated.
        index_limit: Generated integers stay below it (token ids over their embedding, see
            :func:`mixprec.analysis.input_indices.with_index_limits`); None: ``[0, 2)``.
    """

    name: str
    dtype: np.dtype
    shape: Shape | None
    kind: str = "tensor"
    index_limit: int | None = None


def input_specs(model: onnx.ModelProto | ir.Model) -> list[InputSpec]:
    """Return the graph inputs that are not initializers, in graph order.

    Args:
        model: An ONNX ``ModelProto`` or an ``onnx_ir.Model``.

    Returns:
        One :class:`InputSpec` per runtime input.
    """
    if isinstance(model, onnx.ModelProto):
        init_names = {t.name for t in model.graph.initializer}
        init_names.update(t.values.name for t in model.graph.sparse_initializer)
        return [
            _spec_from_type_proto(vi.name, vi.type)
            for vi in model.graph.input
            if vi.name not in init_names
        ]
    if not isinstance(model, ir.Model):
        raise InputError(f"expected an onnx.ModelProto or onnx_ir.Model, got {type(model)!r}")
    graph = model.graph
    return [_spec_from_ir_value(value) for value in graph.inputs if value.name not in graph.initializers]


def _spec_from_type_proto(name: str, type_proto: onnx.TypeProto) -> InputSpec:
    field = type_proto.WhichOneof("value")
    if field == "tensor_type":
        tensor_type = type_proto.tensor_type
        dtype = _np_dtype(tensor_type.elem_type)
        if dtype is None:
            return InputSpec(name, np.dtype(object), shape_from_proto(tensor_type), "unknown")
        return InputSpec(name, dtype, shape_from_proto(tensor_type), "tensor")
    if field in ("sequence_type", "optional_type"):
        inner = getattr(type_proto, field).elem_type
        inner_spec = _spec_from_type_proto(name, inner)
        return InputSpec(name, inner_spec.dtype, None, field.removesuffix("_type"))
    if field == "sparse_tensor_type":
        sparse = type_proto.sparse_tensor_type
        dtype = _np_dtype(sparse.elem_type)
        return InputSpec(
            name,
            np.dtype(object) if dtype is None else dtype,
            shape_from_proto(sparse),
            "sparse_tensor",
        )
    if field == "map_type":
        return InputSpec(name, np.dtype(object), None, "map")
    return InputSpec(name, np.dtype(object), None, "unknown")


def shape_from_proto(
    tensor_type: onnx.TypeProto.Tensor | onnx.TypeProto.SparseTensor,
) -> Shape | None:
    """Dimensions of a tensor type: ``int`` fixed, ``str`` named, ``None`` unknown; None
    without a shape."""
    if not tensor_type.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for dim in tensor_type.shape.dim:
        which = dim.WhichOneof("value")
        if which == "dim_value":
            dims.append(int(dim.dim_value))
        elif which == "dim_param" and dim.dim_param:
            dims.append(dim.dim_param)
        else:
            dims.append(None)
    return tuple(dims)


def _np_dtype(elem_type: int) -> np.dtype | None:
    """Numpy dtype of an ONNX element type; ``None`` when undefined or unknown."""
    if elem_type == onnx.TensorProto.UNDEFINED:
        return None
    if elem_type == onnx.TensorProto.BFLOAT16:
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError):
        return None


def _spec_from_ir_value(value: ir.Value) -> InputSpec:
    name = value.name or ""
    value_type = value.type
    if value_type is None:
        return InputSpec(name, np.dtype(object), None, "unknown")
    shape: Shape | None = None
    if value.shape is not None:
        shape = tuple(
            dim if isinstance(dim, int) else (dim.value if dim.value else None)
            for dim in value.shape
        )
    kind = "tensor"
    if value_type.dtype == ir.DataType.UNDEFINED:
        kind = "unknown"
    elif isinstance(value_type, ir.SequenceType):
        kind = "sequence"
    elif isinstance(value_type, ir.OptionalType):
        kind = "optional"
    elif isinstance(value_type, ir.SparseTensorType):
        kind = "sparse_tensor"
    elif not isinstance(value_type, ir.TensorType):
        kind = "unknown"
    try:
        dtype = np.dtype(value_type.dtype.numpy())
    except (TypeError, ValueError, NotImplementedError, AttributeError):
        dtype = np.dtype(object)
    if kind in ("sequence", "optional"):
        shape = None  # not a tensor shape
    return InputSpec(name, dtype, shape, kind)


def generated_shapes(
    specs: Sequence[InputSpec], *, dim_value: int = 2, batch_value: int | None = None
) -> dict[str, tuple[int, ...]]:
    """The shapes :func:`generate_inputs` gives the inputs, computed without allocating.

    Symbolic and unknown dimensions take `dim_value`; with `batch_value`, the leading
    dimension of inputs of rank >= 2 (and every dimension sharing its name) takes it instead,
    so that growing sizes grow the feature dimensions, not the batch. A dimension written as
    arithmetic of others ('past_sequence_length + sequence_length', the length of a decoder's
    attention mask as optimum exports it) takes the value of that arithmetic, so that inputs
    sized by it agree with the others.

    Raises:
        InputError: An input is not a tensor or has unknown rank, or a size is negative.
    """
    if dim_value < 0 or (batch_value is not None and batch_value < 0):
        raise InputError(f"dimension sizes must be >= 0, got {dim_value} and {batch_value}")
    for spec in specs:
        if spec.kind != "tensor":
            raise InputError(
                f"cannot generate data for input {spec.name!r}: {spec.kind} inputs are "
                "not supported; provide the data in a file"
            )
        if spec.shape is None:
            raise InputError(
                f"cannot generate data for input {spec.name!r}: its rank is unknown; "
                "provide the data in a file"
            )
    batch_names: set[str] = set()
    if batch_value is not None:
        batch_names = {
            s.shape[0] for s in specs  # type: ignore[misc]
            if len(s.shape) >= 2 and isinstance(s.shape[0], str) and _dim_expression(s.shape[0]) is None  # type: ignore[arg-type]
        }

    def named(name: str) -> int:
        return batch_value if batch_value is not None and name in batch_names else dim_value

    def size(dim: int | str | None, index: int, rank: int) -> int:
        if isinstance(dim, int) and dim >= 0:
            return dim
        expression = _dim_expression(dim) if isinstance(dim, str) else None
        if expression is not None:
            try:
                value = _evaluate(expression, named)
            except RecursionError:  # nested deeper than the reading allowed
                value = None
            # A size the arithmetic makes negative or far larger than its names: the usual one.
            if value is not None and 0 <= value <= _EXPRESSION_GROWTH * max(dim_value, batch_value or 0, 1):
                return value
        elif batch_value is not None and (dim in batch_names or (dim is None and index == 0 and rank >= 2)):
            return batch_value
        return dim_value

    return {
        spec.name: tuple(size(d, i, len(spec.shape)) for i, d in enumerate(spec.shape))  # type: ignore[arg-type]
        for spec in specs
    }


# A dimension written as arithmetic takes its value up to this many times the generated size.
_EXPRESSION_GROWTH = 1024


@functools.lru_cache(maxsize=1024)
def _dim_expression(dim: str) -> ast.expr | None:
    """The integer arithmetic (+, -, *, //, parentheses) of dimension names and numbers that
    `dim` writes, or None for a plain name or anything else."""
    try:
        tree = ast.parse(dim.strip(), mode="eval").body
        arithmetic = not isinstance(tree, ast.Name) and _is_arithmetic(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # not Python, or nested too deep
        return None
    return tree if arithmetic else None


_DIM_OPERATORS: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
}


def _is_arithmetic(node: ast.expr) -> bool:
    if isinstance(node, ast.BinOp):
        return type(node.op) in _DIM_OPERATORS and _is_arithmetic(node.left) and _is_arithmetic(node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.USub) and _is_arithmetic(node.operand)
    return isinstance(node, ast.Name) or (isinstance(node, ast.Constant) and type(node.value) is int)


def _evaluate(node: ast.expr, named: Callable[[str], int]) -> int | None:
    """The value of a dimension's arithmetic, each name at `named`'s size; None on a division
    by zero."""
    if isinstance(node, ast.Name):
        return named(node.id)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp):
        operand = _evaluate(node.operand, named)
        return None if operand is None else -operand
    left, right = _evaluate(node.left, named), _evaluate(node.right, named)  # type: ignore[attr-defined]
    if left is None or right is None or (right == 0 and isinstance(node.op, ast.FloorDiv)):  # type: ignore[attr-defined]
        return None
    return _DIM_OPERATORS[type(node.op)](left, right)  # type: ignore[attr-defined]


def generate_inputs(
    specs: Sequence[InputSpec], *, seed: int = 0, dim_value: int = 2, batch_value: int | None = None,
    lowest_int: int = 0,
) -> dict[str, np.ndarray]:
    """Generate deterministic random inputs.

    Each input gets its own random stream derived from ``seed`` and its name, so an
    input's data does not depend on the other inputs. Floats are standard normal
    (drawn in float32, then cast to the input dtype), integers are uniform in
    ``[0, 2)`` so they are valid indices, lengths and 0/1 masks (token ids: over the table
    they index, see ``InputSpec.index_limit``), booleans are uniform, strings are decimal
    digits.

    Args:
        specs: Input signatures, e.g. from :func:`input_specs`.
        seed: Random seed.
        dim_value: Size used for symbolic and unknown dimensions.
        batch_value: Size of the leading dimensions instead (see :func:`generated_shapes`).
        lowest_int: The smallest integer drawn where the range allows it (1: no id is 0, which
            often marks padding; a 0/1 mask is all ones).

    Returns:
        Arrays by input name.

    Raises:
        InputError: An input is not a tensor, has unknown rank or dtype, or
            a size is negative.
    """
    shapes = generated_shapes(specs, dim_value=dim_value, batch_value=batch_value)
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode("utf-8"))])
        feeds[spec.name] = _random_array(spec, shapes[spec.name], rng, lowest_int)
    return feeds


def _random_array(spec: InputSpec, shape: tuple[int, ...], rng: np.random.Generator, lowest_int: int = 0) -> np.ndarray:
    dtype = np.dtype(spec.dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.complexfloating):
        real = rng.standard_normal(shape, dtype=np.float32)
        imag = rng.standard_normal(shape, dtype=np.float32)
        return (real + 1j * imag).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        high = spec.index_limit or _INT_HIGH  # token ids over the whole embedding
        return rng.integers(min(lowest_int, high - 1), high, size=shape).astype(dtype)
    if _is_ml_int(dtype):  # int4/uint4/int2...: stay within the type's range
        high = min(_INT_HIGH, int(ml_dtypes.iinfo(dtype).max) + 1)
        return rng.integers(0, high, size=shape).astype(dtype)
    if dtype == np.dtype(object):  # ONNX STRING
        digits = rng.integers(0, _INT_HIGH, size=shape)
        return digits.astype(str).astype(object)
    if is_float_dtype(dtype):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    raise InputError(f"cannot generate data for input {spec.name!r}: unsupported dtype {dtype}")


def _is_ml_int(dtype: np.dtype) -> bool:
    try:
        ml_dtypes.iinfo(dtype)
    except (ValueError, TypeError):
        return False
    return True


def load_batches(
    path: str | os.PathLike[str], input_names: Sequence[str]
) -> Iterator[dict[str, np.ndarray]]:
    """Stream input batches from an ``.npz`` file or a directory.

    The layout is checked immediately (a missing path fails at the call), files are
    read lazily, one batch at a time. A batch may hold a subset of ``input_names``.

    Args:
        path: An ``.npz`` file, a directory of ``.npz`` files, a directory of
            ``test_data_set_N`` directories, or one ``test_data_set_N`` directory.
        input_names: The model's runtime input names, in graph order (the K-th
            ``input_K.pb`` maps to the K-th name unless the tensor is named after an
            input).

    Returns:
        An iterator of ``{input name: array}``.

    Raises:
        InputError: The path is missing, holds no batches, or a file is unreadable or
            names an unknown input (raised while iterating for file contents).
    """
    root = Path(path)
    names = list(input_names)
    if not root.exists():
        raise InputError(f"input data path does not exist: {root}")
    if root.is_file():
        if root.suffix.lower() != ".npz":
            raise InputError(f"unsupported input data file (expected .npz): {root}")
        return _iter_npz([root], names)
    if not root.is_dir():
        raise InputError(f"input data path is neither a file nor a directory: {root}")
    if _pb_files(root, _INPUT_PB_RE):
        return _iter_test_sets([root], names)
    return _directory_batches(root, names)


def _directory_batches(root: Path, names: list[str]) -> Iterator[dict[str, np.ndarray]]:
    """The batches of a directory of ``.npz`` files or of ``test_data_set_N`` directories (not
    both).

    Raises:
        InputError: The directory cannot be listed, holds both kinds or neither.
    """
    try:
        entries = sorted(root.iterdir(), key=lambda p: p.name)
    except OSError as exc:
        raise InputError(f"cannot list input data directory {root}: {exc}") from exc
    test_sets = sorted(
        (p for p in entries if p.is_dir() and _TEST_SET_RE.match(p.name)),
        key=lambda p: int(_TEST_SET_RE.match(p.name).group(1)),  # type: ignore[union-attr]
    )
    npz_files = [p for p in entries if p.is_file() and p.suffix.lower() == ".npz"]
    if test_sets and npz_files:
        raise InputError(
            f"input data directory {root} holds both test_data_set_N directories and "
            ".npz files; pass one of them"
        )
    if test_sets:
        return _iter_test_sets(test_sets, names)
    if npz_files:
        return _iter_npz(npz_files, names)
    raise InputError(
        f"no input batches in {root}: expected .npz files or test_data_set_N/input_K.pb"
    )


def _iter_npz(files: list[Path], input_names: list[str]) -> Iterator[dict[str, np.ndarray]]:
    known = set(input_names)
    for file in files:
        try:
            with np.load(file, allow_pickle=False) as archive:
                if not isinstance(archive, np.lib.npyio.NpzFile):
                    raise InputError(f"not an .npz archive: {file}")
                batch = {key: archive[key] for key in archive.files}
        except InputError:
            raise
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
            raise InputError(f"cannot read input data file {file}: {exc}") from exc
        unknown = sorted(set(batch) - known)
        if unknown:
            raise InputError(
                f"input data file {file} has array {unknown[0]!r}, which is not a model "
                f"input (inputs: {', '.join(input_names)})"
            )
        logger.debug("loaded batch %s (%d arrays)", file, len(batch))
        yield batch


def _iter_test_sets(dirs: list[Path], input_names: list[str]) -> Iterator[dict[str, np.ndarray]]:
    for directory in dirs:
        files = _pb_files(directory, _INPUT_PB_RE)
        if not files:
            raise InputError(f"no input_K.pb files in {directory}")
        yield _read_pb_set(files, input_names, "input")


def load_expected_outputs(
    test_data_set_dir: str | os.PathLike[str], output_names: Sequence[str]
) -> dict[str, np.ndarray]:
    """Read ``output_K.pb`` files of one ONNX ``test_data_set_N`` directory.

    Args:
        test_data_set_dir: The ``test_data_set_N`` directory.
        output_names: The model's output names in graph order.

    Returns:
        Expected arrays by output name.

    Raises:
        InputError: The directory is missing, has no ``output_K.pb`` files, or a file
            is unreadable or cannot be matched to an output.
    """
    directory = Path(test_data_set_dir)
    if not directory.is_dir():
        raise InputError(f"test data directory does not exist: {directory}")
    files = _pb_files(directory, _OUTPUT_PB_RE)
    if not files:
        raise InputError(f"no output_K.pb files in {directory}")
    return _read_pb_set(files, list(output_names), "output")


def _pb_files(directory: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    found: list[tuple[int, Path]] = []
    try:
        for entry in directory.iterdir():
            match = pattern.match(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), entry))
    except OSError as exc:
        raise InputError(f"cannot list directory {directory}: {exc}") from exc
    return sorted(found)


def _read_pb_set(
    files: list[tuple[int, Path]], names: list[str], role: str
) -> dict[str, np.ndarray]:
    known = set(names)
    result: dict[str, np.ndarray] = {}
    for index, file in files:
        tensor = _read_tensor_proto(file)
        if tensor.name in known:
            name = tensor.name
        elif index < len(names):
            name = names[index]
        else:
            raise InputError(
                f"{file}: cannot match {role} #{index} (tensor name {tensor.name!r}) to a "
                f"model {role}; the model has {len(names)} {role}s"
            )
        if name in result:
            raise InputError(f"{file}: {role} {name!r} is given by more than one file")
        try:
            result[name] = numpy_helper.to_array(tensor, base_dir=str(file.parent))
        except Exception as exc:  # onnx raises assorted types for bad tensors
            raise InputError(f"cannot decode tensor in {file}: {exc}") from exc
    return result


def _read_tensor_proto(file: Path) -> onnx.TensorProto:
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {file}: {exc}") from exc
    tensor = onnx.TensorProto()
    try:
        tensor.ParseFromString(data)
    except Exception as exc:  # protobuf DecodeError
        raise InputError(f"{file} is not a serialized onnx.TensorProto: {exc}") from exc
    if tensor.data_type == onnx.TensorProto.UNDEFINED:
        raise InputError(
            f"{file} is not a tensor (sequence, map and optional values are not supported)"
        )
    return tensor
