"""onnxruntime sessions: create them from model files and run them on numpy feeds."""

from __future__ import annotations

import ctypes
import logging
import re
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

from mixprec.dtypes import is_float_dtype
from mixprec.errors import InputError, ModelLoadError, RunError

logger = logging.getLogger(__name__)

_OPT_LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

# Above this many inputs a session runs past the Python wrapper's feed check (_run_many_inputs).
_MANY_INPUTS = 256
# ORT type strings whose tensors numpy cannot exchange with onnxruntime directly.
_BFLOAT16 = "tensor(bfloat16)"
_FLOAT_TYPES: dict[str, np.dtype] = {
    "tensor(float16)": np.dtype(np.float16),
    "tensor(float)": np.dtype(np.float32),
    "tensor(double)": np.dtype(np.float64),
    _BFLOAT16: np.dtype(ml_dtypes.bfloat16),
}


def make_session(
    model_path: str | os.PathLike[str],
    *,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    graph_optimization: str = "basic",
    intra_op_threads: int | None = None,
    config_entries: Mapping[str, str] | None = None,
) -> ort.InferenceSession:
    """Create an inference session from a model file.

    The model is always loaded from its path (never from bytes), so models with
    external data and models over 2 GB work.

    Args:
        model_path: Path of the ``.onnx`` file.
        providers: Execution providers in priority order; each must be available in
            this onnxruntime build (ORT would otherwise fall back to CPU silently).
        graph_optimization: ``"disable"``, ``"basic"``, ``"extended"`` or ``"all"``.
        intra_op_threads: Threads per op; ``None`` lets onnxruntime decide.
        config_entries: Session config entries (``session.disable_quant_qdq``: ``1``).

    Returns:
        The session.

    Raises:
        InputError: Unknown optimization level, unavailable provider, or bad thread count.
        ModelLoadError: The model file does not exist.
        RunError: onnxruntime rejected the model; the message names the file
            and holds onnxruntime's first error line (which usually names the node).
    """
    path = Path(model_path)
    if graph_optimization not in _OPT_LEVELS:
        raise InputError(
            f"graph_optimization must be one of {', '.join(_OPT_LEVELS)}, "
            f"got {graph_optimization!r}"
        )
    if isinstance(providers, str):
        providers = (providers,)
    available = ort.get_available_providers()
    missing = [p for p in providers if p not in available]
    if missing:
        raise InputError(
            f"execution provider {missing[0]} is not available in this onnxruntime build "
            f"(available: {', '.join(available)})"
        )
    if intra_op_threads is not None and intra_op_threads < 0:
        raise InputError(f"intra_op_threads must be >= 0, got {intra_op_threads}")
    if not path.is_file():
        raise ModelLoadError(f"model file does not exist: {path}")

    options = ort.SessionOptions()
    options.graph_optimization_level = _OPT_LEVELS[graph_optimization]
    # onnxruntime's errors come back as exceptions (with the message); its log would print them
    # twice, and for the sizes the generated-input ladder expects to fail.
    options.log_severity_level = 2 if logger.isEnabledFor(logging.DEBUG) else 4
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    for key, value in (config_entries or {}).items():
        options.add_session_config_entry(key, value)
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises several pybind exception types
        raise RunError(f"onnxruntime cannot load {path}: {_first_line(exc)}") from exc
    logger.debug(
        "session for %s: providers=%s optimization=%s",
        path,
        session.get_providers(),
        graph_optimization,
    )
    return session


def run_session(
    session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Run a session once.

    Feeds not among the session's inputs are ignored. A floating-point feed whose
    dtype differs from a floating-point input (e.g. float32 data for a float16 input)
    is cast to the input's dtype, so one set of float32 data can feed both a
    reference and a converted model. bfloat16 inputs and outputs are exchanged as
    ``ml_dtypes.bfloat16`` arrays.

    Args:
        session: The session.
        feeds: Arrays by input name.

    Returns:
        Outputs by name, in the session's output order.

    Raises:
        InputError: A session input is missing from ``feeds``.
        RunError: onnxruntime failed; the message holds its first error line.
    """
    inputs = session.get_inputs()
    outputs = session.get_outputs()
    output_names = [o.name for o in outputs]
    prepared: dict[str, np.ndarray] = {}
    for meta in inputs:
        if meta.name not in feeds:
            raise InputError(
                f"no data for model input {meta.name!r} "
                f"(data has: {', '.join(sorted(feeds)) or 'nothing'})"
            )
        prepared[meta.name] = _conform_feed(meta.name, np.asarray(feeds[meta.name]), meta.type)

    uses_bf16 = any(m.type == _BFLOAT16 for m in (*inputs, *outputs))
    try:
        if uses_bf16:
            results = _run_with_ort_values(session, prepared, output_names, inputs)
        elif len(prepared) > _MANY_INPUTS:
            results = _run_many_inputs(session, prepared, output_names)
        else:
            results = session.run(output_names, prepared)
    except (InputError, RunError):
        raise
    except Exception as exc:  # onnxruntime raises several pybind exception types
        raise RunError(f"onnxruntime run failed: {_first_line(exc)}") from exc
    return {name: as_array(name, result) for name, result in zip(output_names, results)}


def as_array(name: str, output: object) -> np.ndarray:
    """An output as one array, whatever its ONNX type: a tensor as it is; a map as its values
    in key order; a sequence as its elements stacked (flattened and joined where their shapes
    differ); an empty optional as an empty array. Two runs of one model give arrays that
    compare element by element (a classifier's sequence of per-class maps becomes
    [samples, classes])."""
    if isinstance(output, np.ndarray):
        return output
    if output is None:
        return np.zeros((0,), np.float32)
    if isinstance(output, dict):
        return np.asarray([output[key] for key in sorted(output)])
    if isinstance(output, (list, tuple)):
        if not output:
            return np.zeros((0,), np.float32)
        items = [as_array(name, item) for item in output]
        if all(item.shape == items[0].shape for item in items):
            return np.stack(items)
        return np.concatenate([item.ravel() for item in items])
    raise RunError(f"output {name!r}: onnxruntime returned a {type(output).__name__}, not a tensor, sequence or map")


def _run_many_inputs(session: ort.InferenceSession, feeds: dict[str, np.ndarray], output_names: list[str]) -> list[np.ndarray]:
    """Run without the Python wrapper's feed check, which compares every input name with a list
    of the feed names (quadratic: over a minute at 100,000 inputs; IOBinding's bind_input is
    quadratic too). Every input was checked against `feeds` in `run_session` already; the C++
    session runs a 100,000-input model in 0.3 s."""
    return session._sess.run(output_names, feeds, None)  # noqa: SLF001


def _conform_feed(name: str, array: np.ndarray, ort_type: str) -> np.ndarray:
    target = _FLOAT_TYPES.get(ort_type)
    if target is not None and array.dtype != target and is_float_dtype(array.dtype):
        logger.debug("casting feed %r from %s to %s", name, array.dtype, target)
        return array.astype(target)
    return array


def _run_with_ort_values(
    session: ort.InferenceSession,
    feeds: dict[str, np.ndarray],
    output_names: list[str],
    inputs: Sequence[ort.NodeArg],
) -> list[np.ndarray]:
    """Run through OrtValues: numpy has no bfloat16 type that onnxruntime accepts."""
    types = {m.name: m.type for m in inputs}
    ort_feeds: dict[str, ort.OrtValue] = {}
    for name, array in feeds.items():
        if types[name] == _BFLOAT16:
            if array.dtype != np.dtype(ml_dtypes.bfloat16):
                raise RunError(f"input {name!r} is bfloat16; got {array.dtype} data")
            ort_feeds[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                np.ascontiguousarray(array).reshape(array.shape).view(np.uint16), onnx.TensorProto.BFLOAT16
            )
        else:
            ort_feeds[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array).reshape(array.shape))
    values = session.run_with_ort_values(output_names, ort_feeds)
    return [_ort_value_to_numpy(name, value) for name, value in zip(output_names, values)]


def _ort_value_to_numpy(name: str, value: ort.OrtValue) -> np.ndarray:
    if value.data_type() != _BFLOAT16:
        return value.numpy()
    if value.device_name().lower() != "cpu":
        raise RunError(f"bfloat16 output {name!r} is not on the CPU")
    shape = tuple(value.shape())
    nbytes = value.tensor_size_in_bytes()
    if nbytes == 0:
        return np.zeros(shape, dtype=ml_dtypes.bfloat16)
    buffer = (ctypes.c_uint8 * nbytes).from_address(value.data_ptr())
    bits = np.frombuffer(buffer, dtype=np.uint16).copy()
    return bits.view(ml_dtypes.bfloat16).reshape(shape)


# onnxruntime's failed-check messages carry the C++ source location and function signature
# before what went wrong: "<file>:<line> <signature> <condition> was false. <message>".
_SOURCE_LOCATION = re.compile(r"/onnxruntime_src/\S+:\d+ (?:.*? was false\. )?")


def _first_line(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        if line.strip():
            return _SOURCE_LOCATION.sub("", line.strip())
    return type(exc).__name__
