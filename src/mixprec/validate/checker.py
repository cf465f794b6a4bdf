"""The ONNX checker, run on a file path (so models with external data beyond 2 GB work)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx
import onnx.checker

from mixprec.errors import ValidationFailure
from mixprec.graphs import graph_protos
from mixprec.io.onnx_file import FileChecks
from mixprec.io.onnx_file import checker_error as onnx_checker_error
from mixprec.policy.profiles import onnxruntime_onnx_domain_ops

__all__ = ["RUNTIME_OPS_DOMAIN", "check_model_file", "checker_error", "input_problem", "judged_again", "runtime_ops_of"]

# The domain onnxruntime's own ONNX-domain ops are moved to for the checker (see `checker_error`).
RUNTIME_OPS_DOMAIN = "mixprec.onnxruntime_onnx_domain"

ModelSource = str | Path | onnx.ModelProto


def checker_error(model: ModelSource, *, full_check: bool = True, order: Sequence[int] | None = None) -> str | None:
    """The ONNX checker's first error line (`full_check`: with strict type inference), or None.

    `order`: the main graph's nodes are judged in this order (indices into the model's nodes;
    the load sorted them). Ops onnxruntime registers in the ONNX domain that ONNX does not
    define (:func:`mixprec.policy.profiles.onnxruntime_onnx_domain_ops`) are not the checker's
    to judge: where the model has such ops, they are judged in a domain of their own and the
    rest of the model as the checker would. Either way a copy of the model's protobuf (weights
    inline, external data not read) is checked, only where the model as it is fails."""
    error = onnx_checker_error(model, full_check=full_check) if order is None else None
    if order is None and error is None:
        return None
    return judged_again(model, error, full_check=full_check, order=order)


def judged_again(
    model: ModelSource, error: str | None, *, full_check: bool = True, order: Sequence[int] | None = None
) -> str | None:
    """The checker's verdict on `model` (whose plain check found `error`) with its nodes in
    `order` and onnxruntime's own ONNX-domain ops judged apart; `error` where neither applies."""
    judged = _judged_form(model, order)
    return error if judged is None else onnx_checker_error(judged, full_check=full_check)


def runtime_ops_of(model: ModelSource) -> list[str]:
    """The ops of `model` onnxruntime registers in the ONNX domain that ONNX does not define."""
    proto = _proto(model)
    own = _own_ops(proto)
    return sorted({node.op_type for owner in (proto, *proto.functions) for node in _runtime_op_nodes(owner, own)})


def _proto(model: ModelSource) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return copy
    return onnx.load(str(model), load_external_data=False)


def _judged_form(model: ModelSource, order: Sequence[int] | None) -> onnx.ModelProto | None:
    """The protobuf the checker judges in place of `model`: its main graph's nodes in `order`,
    onnxruntime's own ONNX-domain ops in :data:`RUNTIME_OPS_DOMAIN`; None when neither
    applies."""
    proto = _proto(model)
    changed = False
    if order is not None:
        nodes = list(proto.graph.node)
        del proto.graph.node[:]
        proto.graph.node.extend(nodes[index] for index in order)
        changed = True
    return proto if _relabel_runtime_ops(proto) or changed else None


def _own_ops(proto: onnx.ModelProto) -> frozenset[str]:
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    return onnxruntime_onnx_domain_ops(opset)


def _runtime_op_nodes(proto: onnx.ModelProto | onnx.FunctionProto, own: frozenset[str]) -> list[onnx.NodeProto]:
    """The nodes of onnxruntime's own ONNX-domain ops in a model's graphs or a function's body."""
    roots = proto.node if isinstance(proto, onnx.FunctionProto) else proto.graph.node
    nodes = list(roots)
    nodes += [n for node in roots for attr in node.attribute for graph in _graphs_of(attr) for n in graph.node]
    return [node for node in nodes if node.domain in ("", "ai.onnx") and node.op_type in own]


def _graphs_of(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    bodies = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
    return [graph for body in bodies for graph in graph_protos(body)]


def _relabel_runtime_ops(proto: onnx.ModelProto) -> bool:
    """Move onnxruntime's own ONNX-domain ops of the model and its functions to
    :data:`RUNTIME_OPS_DOMAIN` (declared where they are); whether there were any."""
    own = _own_ops(proto)
    if not own:
        return False
    found = False
    for owner in (proto, *proto.functions):
        nodes = _runtime_op_nodes(owner, own)
        for node in nodes:
            node.domain = RUNTIME_OPS_DOMAIN
        if nodes:
            owner.opset_import.append(onnx.helper.make_opsetid(RUNTIME_OPS_DOMAIN, 1))
            found = True
    return found


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
        error = judged_again(path, error)  # onnxruntime's own ONNX-domain ops judged apart
    if error is None:
        return None
    if original is not None:
        original_error = original()
        if original_error is not None and original_error == error:
            return error
    raise ValidationFailure(f"the converted model fails the ONNX checker: {error}")
