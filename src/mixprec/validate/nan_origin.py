"""Where non-finite values start: the first node of a converted model that overflows.

:func:`find_nan_origin` runs the FP32 reference and the converted model on one batch,
exposing intermediate values a chunk at a time (see
:class:`mixprec.runtime.intermediates.IntermediateRunner`), and walks the converted model's main
graph in topological order. The origin is the first node whose output holds a non-finite value
at a position where the FP32 value is finite.

By default the converted model runs *emulated* (:mod:`mixprec.validate.emulate`: every 16-bit
value computed in FP32 and rounded through its 16-bit type). onnxruntime's CPU provider has no
bfloat16 kernels, and for most float16 ops (MatMul, Gemm, Mul, Add, ...) it computes in FP32
and drops the float16 round trip between them, so a float16 overflow often does not show
there, or shows only where a value is materialized in float16 (a graph output, a data-movement
op such as Reshape); the emulation rounds every 16-bit value as a 16-bit runtime does.

Values are paired by node name (conversion and emulation keep node names; a node output
renamed by the emulation pairs with the reference node's output), then by value name; an
inserted ``Cast`` pairs with the value it casts. When the first offending node is such an
inserted Cast (or an emulation rounding), the origin is the node that produced the value; if
that node computes in FP32 in the converted model, its output overflows when *cast* to 16 bits
(``via_cast``). Only nodes upstream of the graph outputs that gained non-finite values are
considered, so a harmless infinity elsewhere is not blamed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from mixprec.runtime.intermediates import IntermediateRunner, elem_types
from mixprec.dtypes import LowPrecision, parse_low_precision
from mixprec.errors import InputError, ModelLoadError
from mixprec.graphs import is_default_domain

logger = logging.getLogger(__name__)

_FLOAT_ELEM_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.DOUBLE,
    }
)


@dataclass(frozen=True)
class NanOrigin:
    """The first node whose output becomes non-finite in the converted model.

    Attributes:
        node: Node name (in the FP32 model when it exists there).
        op_type: Its op type.
        output: The FP32 model's name of the offending output.
        dtype: The type of that output in the converted model (before a cast, if any).
        new_nonfinite: Elements non-finite in the converted run but finite in FP32.
        fp32_absmax: Largest finite magnitude of that output in the FP32 run.
        inputs: (input name, FP32 abs-max or None when unknown) for the node's inputs.
        via_cast: The node computes in FP32; its output overflows when cast to the 16-bit
            type for its consumers.
        target: The 16-bit type.
    """

    node: str
    op_type: str
    output: str
    dtype: str
    new_nonfinite: int
    fp32_absmax: float
    inputs: tuple[tuple[str, float | None], ...]
    via_cast: bool
    target: str

    def describe(self) -> str:
        """One line for the report."""
        limit = parse_low_precision(self.target).limits.max
        where = (
            f"its output {self.output!r} becomes non-finite when cast to {self.target}"
            if self.via_cast
            else f"output {self.output!r} ({self.dtype}) is non-finite"
        )
        ins = ", ".join(
            f"{name!r} {'?' if absmax is None else format(absmax, '.3g')}"
            for name, absmax in self.inputs
        )
        return (
            f"{self.op_type} node {self.node!r}: {where} at {self.new_nonfinite} position(s) where "
            f"FP32 is finite (FP32 absmax {self.fp32_absmax:.3g}, {self.target} max {limit:.6g}); "
            f"FP32 absmax of its inputs: {ins or 'none'}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "node": self.node,
            "op_type": self.op_type,
            "output": self.output,
            "dtype": self.dtype,
            "new_nonfinite": self.new_nonfinite,
            "fp32_absmax": self.fp32_absmax,
            "inputs": [list(i) for i in self.inputs],
            "via_cast": self.via_cast,
            "target": self.target,
        }


def _as_float(array: np.ndarray) -> np.ndarray | None:
    """The array upcast to float32/64, or None when it is not floating point."""
    array = np.asarray(array)
    if array.dtype == np.float64:
        return array
    if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
        return array.astype(np.float32)
    return None


def _new_nonfinite(reference: np.ndarray, candidate: np.ndarray) -> int:
    """Elements non-finite in `candidate` where `reference` is finite."""
    ref, cand = _as_float(reference), _as_float(candidate)
    if ref is None or cand is None:
        return 0
    if ref.shape == cand.shape:
        return int(np.count_nonzero(np.isfinite(ref) & ~np.isfinite(cand)))
    if np.isfinite(ref).all():  # shapes differ (should not): compare whole tensors
        return int(np.count_nonzero(~np.isfinite(cand)))
    return 0


def _run_once(
    runner: IntermediateRunner, names: Sequence[str], feeds: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Values `names` on one batch (the session is closed before returning)."""
    result: dict[str, np.ndarray] = {}
    for _, outputs in runner.run(names, [feeds]):
        result = outputs
    return result


def _absmax(array: np.ndarray) -> float:
    values = _as_float(array)
    if values is None or values.size == 0:
        return 0.0
    magnitude = np.abs(values)
    return float(np.max(magnitude, where=np.isfinite(magnitude), initial=0.0))


class _Graph:
    """Index of a model's main graph (proto, no weights)."""

    def __init__(self, runner: IntermediateRunner) -> None:
        graph = runner.proto.graph
        self.runner = runner
        self.nodes = list(graph.node)
        self.producer: dict[str, tuple[int, int]] = {}
        for index, node in enumerate(self.nodes):
            for slot, out in enumerate(node.output):
                if out:
                    self.producer[out] = (index, slot)
        self.by_name: dict[str, int] = {}
        duplicated: set[str] = set()
        for index, node in enumerate(self.nodes):
            if node.name in self.by_name:
                duplicated.add(node.name)
            elif node.name:
                self.by_name[node.name] = index
        for name in duplicated:
            del self.by_name[name]
        self.inputs = set(runner.input_names)
        self.outputs = [v.name for v in graph.output]

    def node_inputs(self, node: onnx.NodeProto) -> list[str]:
        """Inputs, including outer-scope values read by its subgraphs."""
        names = [n for n in node.input if n]
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                for inner in sub.node:
                    names.extend(self.node_inputs(inner))
        return names

    def ancestors(self, outputs: Sequence[str]) -> set[int]:
        """Indices of the nodes the given values depend on."""
        seen: set[int] = set()
        stack = [self.producer[o][0] for o in outputs if o in self.producer]
        while stack:
            index = stack.pop()
            if index in seen:
                continue
            seen.add(index)
            for name in self.node_inputs(self.nodes[index]):
                producer = self.producer.get(name)
                if producer is not None and producer[0] not in seen:
                    stack.append(producer[0])
        return seen


def find_nan_origin(
    reference_path: str | os.PathLike,
    converted_path: str | os.PathLike,
    feeds: Mapping[str, np.ndarray],
    *,
    target: str | LowPrecision,
    emulate: bool = True,
    max_outputs_per_run: int = 256,
    providers: Sequence[str] = ("CPUExecutionProvider",),
) -> NanOrigin | None:
    """Name the first node whose output is non-finite in the converted model but not in FP32.

    Args:
        reference_path: The FP32 model file.
        converted_path: The converted model file.
        feeds: One input batch on which the converted model produces non-finite outputs.
        target: The 16-bit type of the conversion.
        emulate: Run the emulated version of the converted model (default; see the module
            docstring for why). False runs the converted model itself.
        max_outputs_per_run: At most this many intermediate values are outputs of one session.
        providers: onnxruntime execution providers.

    Returns:
        The origin, or None when no graph output gains non-finite values or no main-graph node
        output can be blamed (e.g. they start inside a subgraph).

    Raises:
        ModelLoadError: A model cannot be read.
        InputError: `feeds` lacks a model input.
        RunError: onnxruntime cannot load or run a model.
    """
    target = parse_low_precision(target)
    tmp = Path(tempfile.mkdtemp(prefix="mixprec-nan-"))
    try:
        candidate_path = Path(converted_path)
        if emulate:
            from mixprec.validate.emulate import emulate_low_precision_file  # noqa: PLC0415

            candidate_path = emulate_low_precision_file(converted_path, tmp / "emulated.onnx")
        with (
            IntermediateRunner(reference_path, providers=providers) as ref_runner,
            IntermediateRunner(candidate_path, providers=providers) as cand_runner,
        ):
            converted_types = (
                _node_output_types(converted_path) if emulate else _types_of(cand_runner)
            )
            return _search(
                _Graph(ref_runner),
                _Graph(cand_runner),
                feeds,
                target,
                converted_types,
                max_outputs_per_run,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _search(
    ref: _Graph,
    cand: _Graph,
    feeds: Mapping[str, np.ndarray],
    target: LowPrecision,
    converted_types: dict[str, list[int | None]],
    max_outputs: int,
) -> NanOrigin | None:
    # 1. Which graph outputs gain non-finite values?
    affected = _affected_outputs(ref, cand, feeds)
    if not affected:
        logger.debug("no output gains non-finite values; nothing to locate")
        return None
    upstream = cand.ancestors(affected)

    # 2. Pair candidate values with FP32 values.
    counterpart = _counterpart_finder(ref, cand)
    entries = _paired_values(ref, cand, upstream, counterpart)

    # 3. Compare chunk by chunk, in topological order; stop at the first hit.
    ref_absmax: dict[str, float] = {
        n: _absmax(np.asarray(feeds[n])) for n in ref.inputs if n in feeds
    }
    step = max_outputs if max_outputs > 0 else len(entries) or 1
    for start in range(0, len(entries), step):
        hit = _first_new_nonfinite(ref, cand, entries[start : start + step], feeds, ref_absmax)
        if hit is not None:
            index, ref_name, count = hit
            return _origin(
                ref,
                cand,
                index,
                ref_name,
                count,
                ref_absmax,
                feeds,
                target,
                counterpart,
                converted_types,
            )
    return None


def _affected_outputs(ref: _Graph, cand: _Graph, feeds: Mapping[str, np.ndarray]) -> list[str]:
    """The outputs of both models where the candidate has non-finite values the FP32 model has not."""
    shared_outputs = [o for o in cand.outputs if o in set(ref.outputs)]
    if not shared_outputs:
        raise InputError("the converted model shares no output name with the FP32 model")
    ref_out = _run_once(ref.runner, shared_outputs, feeds)
    cand_out = _run_once(cand.runner, shared_outputs, feeds)
    return [
        o
        for o in shared_outputs
        if o in ref_out and o in cand_out and _new_nonfinite(ref_out[o], cand_out[o])
    ]


def _counterpart_finder(ref: _Graph, cand: _Graph) -> Callable[[str], str | None]:
    """A memoized map from a candidate value to the FP32 value it stands for (None if none):
    the same output of the same-named node, the same name, or through inserted Casts."""
    memo: dict[str, str | None] = {}

    def counterpart(name: str, depth: int = 0) -> str | None:
        if name in memo:
            return memo[name]
        result: str | None = None
        producer = cand.producer.get(name)
        if producer is None:
            result = name if name in ref.inputs else None
        else:
            node = cand.nodes[producer[0]]
            ref_index = ref.by_name.get(node.name) if node.name else None
            ref_node = ref.nodes[ref_index] if ref_index is not None else None
            if (
                ref_node is not None
                and ref_node.op_type == node.op_type
                and producer[1] < len(ref_node.output)
            ):
                result = ref_node.output[producer[1]] or None
            elif name in ref.producer:
                result = name
            elif (
                node.op_type == "Cast"
                and is_default_domain(node.domain)
                and node.input
                and depth < 64
            ):
                result = counterpart(node.input[0], depth + 1)
        memo[name] = result
        return result

    return counterpart


def _paired_values(
    ref: _Graph, cand: _Graph, upstream: set[int], counterpart: Callable[[str], str | None]
) -> list[tuple[int, str, str]]:
    """(candidate node index, candidate value, FP32 value) for the float outputs of the
    `upstream` candidate nodes that have an FP32 float counterpart, in topological order."""
    entries: list[tuple[int, str, str]] = []
    float_values = set(cand.runner.node_outputs(_FLOAT_ELEM_TYPES))
    for index, node in enumerate(cand.nodes):
        if index not in upstream:
            continue
        for out in node.output:
            if out in float_values:
                partner = counterpart(out)
                if (
                    partner is not None
                    and ref.runner.elem_types.get(partner, onnx.TensorProto.FLOAT)
                    == onnx.TensorProto.FLOAT
                ):
                    entries.append((index, out, partner))
    return entries


def _first_new_nonfinite(
    ref: _Graph,
    cand: _Graph,
    part: list[tuple[int, str, str]],
    feeds: Mapping[str, np.ndarray],
    ref_absmax: dict[str, float],
) -> tuple[int, str, int] | None:
    """Run one chunk of paired values in both models (recording the FP32 values' largest
    magnitudes); the first candidate node index, FP32 value and count of new non-finite values."""
    cand_names = [c for _, c, _ in part]
    ref_names = [r for _, _, r in part if r not in ref.inputs]
    cand_values = _run_once(cand.runner, cand_names, feeds)
    ref_values = _run_once(ref.runner, ref_names, feeds)
    for name, array in ref_values.items():
        ref_absmax[name] = _absmax(array)
    for index, cand_name, ref_name in part:
        if cand_name not in cand_values:
            continue
        reference = ref_values.get(ref_name)
        if reference is None and ref_name in feeds:
            reference = np.asarray(feeds[ref_name])
        if reference is None:
            continue
        count = _new_nonfinite(reference, cand_values[cand_name])
        if count:
            return index, ref_name, count
    return None


def _walk_up_casts(ref: _Graph, cand: _Graph, node: onnx.NodeProto) -> tuple[onnx.NodeProto, int, bool]:
    """From a candidate node that the FP32 model lacks, up through inserted Casts: the node
    reached, the output slot that feeds the Casts, and whether any Cast was passed."""
    current, slot, walked = node, 0, False
    while ref.by_name.get(current.name) is None and current.op_type == "Cast" and current.input:
        producer = cand.producer.get(current.input[0])
        if producer is None:
            break
        current, slot, walked = cand.nodes[producer[0]], producer[1], True
    return current, slot, walked


def _origin_node(
    ref: _Graph, cand: _Graph, node: onnx.NodeProto, counterpart: Callable[[str], str | None]
) -> tuple[onnx.NodeProto, int, bool, list[str]]:
    """The FP32 node to blame for candidate `node` (else `node` itself), its output slot,
    whether it was reached through inserted Casts, and its FP32 input names."""
    current, slot, walked = _walk_up_casts(ref, cand, node)
    ref_index = ref.by_name.get(current.name) if current.name else None
    if ref_index is not None and ref.nodes[ref_index].op_type == current.op_type:
        origin = ref.nodes[ref_index]
        return origin, slot, walked, [n for n in origin.input if n]
    input_names = [p for n in node.input if n and (p := counterpart(n)) is not None]
    return node, 0, False, input_names


def _input_absmax(
    ref: _Graph, input_names: list[str], ref_absmax: dict[str, float], feeds: Mapping[str, np.ndarray]
) -> tuple[tuple[str, float | None], ...]:
    """(name, FP32 abs-max) of the inputs, running the FP32 model for those not yet measured
    (constants are read; None: unknown)."""
    missing = [n for n in input_names if n not in ref_absmax and n in ref.producer]
    if missing:
        values = _run_once(ref.runner, missing, feeds)
        ref_absmax.update({k: _absmax(v) for k, v in values.items()})
    return tuple((n, ref_absmax.get(n, _constant_absmax(ref, n))) for n in input_names)


def _origin(
    ref: _Graph,
    cand: _Graph,
    index: int,
    ref_output: str,
    count: int,
    ref_absmax: dict[str, float],
    feeds: Mapping[str, np.ndarray],
    target: LowPrecision,
    counterpart: Callable[[str], str | None],
    converted_types: dict[str, list[int | None]],
) -> NanOrigin:
    """Build the origin for candidate node `index`, walking up through inserted Casts."""
    origin, slot, walked, input_names = _origin_node(ref, cand, cand.nodes[index], counterpart)
    types = converted_types.get(origin.name, [])
    elem = types[slot] if slot < len(types) else None
    via_cast = walked and elem == onnx.TensorProto.FLOAT
    dtype = _type_name(elem) if elem else target.value
    inputs = _input_absmax(ref, input_names, ref_absmax, feeds)
    return NanOrigin(
        node=origin.name,
        op_type=origin.op_type,
        output=ref_output,
        dtype=dtype,
        new_nonfinite=count,
        fp32_absmax=ref_absmax.get(ref_output, 0.0),
        inputs=inputs,
        via_cast=via_cast,
        target=target.value,
    )


def _type_name(elem: int) -> str:
    try:
        return onnx.helper.tensor_dtype_to_string(elem).removeprefix("TensorProto.").lower()
    except (KeyError, ValueError):
        return str(elem)


def _types_of(runner: IntermediateRunner) -> dict[str, list[int | None]]:
    """Node name -> element types of its outputs (None: unknown)."""
    return {
        node.name: [runner.elem_types.get(o) if o else None for o in node.output]
        for node in runner.proto.graph.node
        if node.name
    }


def _node_output_types(path: str | os.PathLike) -> dict[str, list[int | None]]:
    """Node name -> output element types of a model file (read without its weights)."""
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf raises assorted types
        raise ModelLoadError(f"{path}: cannot be loaded: {e}") from e
    for tensor in proto.graph.initializer:  # types only: drop the data
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    known = elem_types(proto, source=str(path))
    return {
        node.name: [known.get(o) if o else None for o in node.output]
        for node in proto.graph.node
        if node.name
    }


def _constant_absmax(ref: _Graph, name: str) -> float | None:
    """Abs-max of an FP32 initializer or Constant output (None when not a float constant)."""
    from onnx import numpy_helper  # noqa: PLC0415

    graph = ref.runner.proto.graph
    tensor = next((t for t in graph.initializer if t.name == name), None)
    if tensor is None:
        producer = ref.producer.get(name)
        if producer is not None:
            node = ref.nodes[producer[0]]
            if node.op_type == "Constant":
                tensor = next(
                    (a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None
                )
    if tensor is None or tensor.data_type not in _FLOAT_ELEM_TYPES:
        return None
    try:
        array = numpy_helper.to_array(tensor, base_dir=str(ref.runner.workdir))
    except Exception as e:  # noqa: BLE001 - unreadable data: report the range as unknown
        logger.debug("cannot read constant %s: %s", name, e)
        return None
    return _absmax(array)
