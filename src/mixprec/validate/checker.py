"""The ONNX checker, run on a file path (so models with external data beyond 2 GB work)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx.checker

from mixprec.errors import ValidationFailure
from mixprec.graphs import default_domain_version, graph_protos
from mixprec.io.onnx_file import FileChecks
from mixprec.io.onnx_file import checker_error as onnx_checker_error
from mixprec.policy.profiles import onnxruntime_onnx_domain_ops

__all__ = ["RUNTIME_OPS_DOMAIN", "Judgement", "check_model_file", "checker_error", "input_problem", "judged_again"]

# The domain onnxruntime's own ONNX-domain ops are moved to for the checker (see `checker_error`).
RUNTIME_OPS_DOMAIN = "mixprec.onnxruntime_onnx_domain"

ModelSource = str | Path | onnx.ModelProto


@dataclass(frozen=True)
class Judgement:
    """The checker's verdict on a model judged again (see :func:`judged_again`).

    Attributes:
        error: The checker's first error line, or None.
        apart: onnxruntime's own ONNX-domain ops the model has, judged apart.
    """

    error: str | None
    apart: tuple[str, ...] = ()


def checker_error(model: ModelSource, *, full_check: bool = True, order: Sequence[int] | None = None) -> str | None:
    """The ONNX checker's first error line (`full_check`: with strict type inference), or None.

    Where the model as it is fails (or `order` is given), it is judged again
    (:func:`judged_again`)."""
    error = onnx_checker_error(model, full_check=full_check) if order is None else None
    if order is None and error is None:
        return None
    return judged_again(model, error, full_check=full_check, order=order).error


def judged_again(
    model: ModelSource, error: str | None, *, full_check: bool = True, order: Sequence[int] | None = None
) -> Judgement:
    """The checker's verdict on `model`, whose plain check found `error`, judged as onnxruntime
    runs it: its main graph's nodes in `order` (indices into its nodes: the load sorted them),
    and ops onnxruntime registers in the ONNX domain that ONNX does not define
    (:func:`mixprec.policy.profiles.onnxruntime_onnx_domain_ops`) in a domain of their own, so
    that the rest of the model is judged as the checker would (their arity and attributes go
    unchecked; in function bodies they stay: onnxruntime crashes on them there). A copy of the
    model's protobuf is judged, inline weights included; external initializers stand as typed
    graph inputs (the load checks their files). `error` stands where neither applies."""
    proto = _proto(model)
    apart = _relabel_runtime_ops(proto)
    if order is not None:
        nodes = list(proto.graph.node)
        del proto.graph.node[:]
        proto.graph.node.extend(nodes[index] for index in order)
    elif not apart:
        return Judgement(error)
    _external_as_inputs(proto.graph)
    return Judgement(onnx_checker_error(proto, full_check=full_check), apart)


def _proto(model: ModelSource) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return copy
    return onnx.load(str(model), load_external_data=False)


def _external_as_inputs(graph: onnx.GraphProto) -> None:
    """Initializers stored in external data become typed graph inputs: a protobuf judged in
    memory has no folder to find their files in."""
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return
    inputs = {value.name for value in graph.input}
    kept = [t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external if t.name not in inputs
    )


def _graph_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of a graph and of its subgraphs, at any depth."""
    return [node for body in graph_protos(graph) for node in body.node]


def _relabel_runtime_ops(proto: onnx.ModelProto) -> tuple[str, ...]:
    """Move onnxruntime's own ONNX-domain ops of the model's graphs to
    :data:`RUNTIME_OPS_DOMAIN`; the ops moved."""
    own = onnxruntime_onnx_domain_ops(default_domain_version({o.domain: o.version for o in proto.opset_import}))
    if not own:
        return ()
    found = [node for node in _graph_nodes(proto.graph) if node.domain in ("", "ai.onnx") and node.op_type in own]
    for node in found:
        node.domain = RUNTIME_OPS_DOMAIN
    if found:
        proto.opset_import.append(onnx.helper.make_opsetid(RUNTIME_OPS_DOMAIN, 1))
    return tuple(sorted({node.op_type for node in found}))


def input_problem(model: ModelSource, order: Sequence[int] | None = None) -> str | None:
    """Why an input model is not valid ONNX, or None (`order`: see :func:`checker_error`).

    The structural checker decides (cycles, undefined inputs, unknown ops, opsets, IR
    version). Strict type inference also runs; when only it objects, the model counts as
    valid if onnxruntime loads it with default options (ONNX's own inference of some function
    ops, MeanVarianceNormalization for one, rejects models onnx ships as tests).
    """
    strict = checker_error(model, full_check=True, order=order)
    if strict is None:
        return None  # the common case: one pass
    problem = checker_error(model, full_check=False, order=order)
    if problem is not None:
        return problem
    from mixprec.runtime.isolated import run_isolated  # noqa: PLC0415

    if isinstance(model, onnx.ModelProto):
        with tempfile.TemporaryDirectory(prefix="mixprec-input-") as tmp:
            path = Path(tmp) / "input.onnx"
            onnx.save(model, str(path))
            outcome = run_isolated(path)
    else:
        outcome = run_isolated(model)
    return None if outcome.ok else strict


def check_model_file(
    path: str | Path, original: Callable[[], str | None] | None = None, checks: FileChecks | None = None
) -> str | None:
    """Run the full ONNX checker on a saved converted model.

    Args:
        path: The converted model.
        original: Returns the checker's error for the FP32 model, or None if it passes; asked
            only when the converted model fails.
        checks: A child already running the full checker on `path`: its answer is taken.

    Returns:
        None when the model passes; the error when the FP32 model fails the same way (the
        conversion did not cause it).

    Raises:
        ValidationFailure: The converted model is invalid and the FP32 model is not.
    """
    error = checks.checker_problem(lambda: onnx_checker_error(path)) if checks is not None else onnx_checker_error(path)
    if error is not None:
        error = judged_again(path, error).error  # onnxruntime's own ONNX-domain ops judged apart
    if error is None:
        return None
    if original is not None:
        original_error = original()
        if original_error is not None and original_error == error:
            return error
    raise ValidationFailure(f"the converted model fails the ONNX checker: {error}")
