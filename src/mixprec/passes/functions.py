"""Model-local functions inlined into the graphs that call them, as runtimes do when they load
a model (onnxruntime, TensorRT's parser and OpenVINO's frontend all do).

Kept, a function converts inside its body behind an FP32 signature: a Cast at each of its
inputs and outputs, and a body whose shapes and neighbours the analyses do not see (a
decomposed normalization inside is not fused, a reduction's size is unknown). Inlined, its
nodes are planned with the rest of the graph.

Some exporters (jax2onnx) import the domains of the functions a function calls at the
standard opset's version and the model at 1: a runtime finds a function by domain and name
alone, while the inliner requires each domain at one version. Each domain that holds nothing but
functions is given one version first; once inlined, no node of those domains is left.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as ir_passes

from mixprec.errors import InputError
from mixprec.graphs import all_nodes, forget_structure

__all__ = ["inline_functions", "inlining_obstacle"]


def inlining_obstacle(model: ir.Model) -> str | None:
    """Why the model's local functions cannot be inlined (a body imports a domain other than a
    function domain at another version than the model: its nodes mean something else in the
    caller's graph), or None."""
    return _obstacle(model, _aligned_domains(model))


def inline_functions(model: ir.Model) -> int:
    """Inline every call of a model-local function, in place, and drop the functions; the
    number of functions that were called.

    Raises:
        InputError: The functions cannot be inlined (:func:`inlining_obstacle`, or the
            inliner's own error), in one line.
    """
    if not model.functions:
        return 0
    aligned = _aligned_domains(model)
    obstacle = _obstacle(model, aligned)
    if obstacle is not None:
        raise InputError(f"cannot inline the model's local functions: {obstacle}")
    called = {key for node in all_nodes(model) if (key := (node.domain, node.op_type, node.overload)) in model.functions}
    local = {function.domain for function in model.functions.values()}
    _align_versions(model, aligned)
    try:
        ir_passes.InlinePass()(model)
        ir_passes.RemoveUnusedFunctionsPass()(model)
    except Exception as e:  # noqa: BLE001 - onnx_ir's passes raise their own errors (a recursive function)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"cannot inline the model's local functions: {first}") from e
    finally:
        forget_structure(model)
    used = {node.domain for node in all_nodes(model)} | {function.domain for function in model.functions.values()}
    for domain in local - used:
        model.opset_imports.pop(domain, None)  # the domain of functions no node calls any more
    return len(called)


def _aligned_domains(model: ir.Model) -> set[str]:
    """The domains of the model's functions whose every node calls one of them (no op of a
    runtime or a standard lives there): their versions name no operator set."""
    local = {function.domain for function in model.functions.values()}
    for node in all_nodes(model):
        if node.domain in local and (node.domain, node.op_type, node.overload) not in model.functions:
            local.discard(node.domain)
    return local


def _obstacle(model: ir.Model, aligned: set[str]) -> str | None:
    """A domain other than those `aligned` that a function imports at another version than the
    model (see :func:`inlining_obstacle`)."""
    for function in model.functions.values():
        for domain, version in function.opset_imports.items():
            declared = model.opset_imports.get(domain)
            if domain not in aligned and declared is not None and declared != version:
                where = f"domain {domain!r}" if domain else "the default domain"
                return f"function {function.name!r} imports {where} at version {version}, the model at {declared}"
    return None


def _align_versions(model: ir.Model, aligned: set[str]) -> None:
    """Give each of the `aligned` domains one version in every opset import: the model's where
    it declares one, else the first function's."""
    versions = {domain: model.opset_imports[domain] for domain in aligned if domain in model.opset_imports}
    for function in model.functions.values():
        for domain, version in function.opset_imports.items():
            if domain in aligned:
                versions.setdefault(domain, version)
    for imports in (model.opset_imports, *(f.opset_imports for f in model.functions.values())):
        for domain in aligned & imports.keys():
            imports[domain] = versions[domain]
