"""Model-local functions inlined into the graphs that call them, as runtimes do when they load
a model (onnxruntime, TensorRT's parser and OpenVINO's frontend all do).

Kept, a function converts inside its body behind an FP32 signature: a Cast at each of its
inputs and outputs, and a body whose shapes and neighbours the analyses do not see (a
decomposed normalization inside is not fused, a reduction's size is unknown). Inlined, its
nodes are planned with the rest of the graph.

Some exporters (jax2onnx) import the domains of the functions a function calls at the
standard opset's version and the model at 1: a runtime finds a function by domain and name
alone, while the inliner requires each domain at one version. Each function domain is given one
version first; once inlined, no node of those domains is left.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as ir_passes

from mixprec.graphs import all_nodes, forget_structure

__all__ = ["inline_functions"]


def inline_functions(model: ir.Model) -> int:
    """Inline every call of a model-local function, in place, and drop the functions; the
    number of functions the model had.

    Raises:
        ValueError: The inliner refuses (a function's body imports a standard domain at another
            version than the model).
    """
    count = len(model.functions)
    if not count:
        return 0
    local = {function.domain for function in model.functions.values()}
    _align_function_domains(model)
    try:
        ir_passes.InlinePass()(model)
        ir_passes.RemoveUnusedFunctionsPass()(model)
    finally:
        forget_structure(model)
    used = {node.domain for node in all_nodes(model)} | {function.domain for function in model.functions.values()}
    for domain in local - used:
        model.opset_imports.pop(domain, None)  # the domain of functions no node calls any more
    return count


def _align_function_domains(model: ir.Model) -> None:
    """Give each domain of the model's functions one version in every opset import: the
    model's where it declares one, else the first function's."""
    local = {function.domain for function in model.functions.values()}
    versions = {domain: model.opset_imports[domain] for domain in local if domain in model.opset_imports}
    for function in model.functions.values():
        for domain, version in function.opset_imports.items():
            if domain in local:
                versions.setdefault(domain, version)
    for imports in (model.opset_imports, *(f.opset_imports for f in model.functions.values())):
        for domain in local & imports.keys():
            imports[domain] = versions[domain]
