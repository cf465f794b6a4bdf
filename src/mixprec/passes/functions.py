"""Model-local functions inlined into the graphs that call them, as runtimes do when they load
a model (onnxruntime, TensorRT's parser and OpenVINO's frontend all do).

Kept, a function converts inside its body behind an FP32 signature: a Cast at each of its
inputs and outputs, and a body whose shapes and neighbours the analyses do not see (a
decomposed normalization inside is not fused, a reduction's size is unknown). Inlined, its
nodes are planned with the rest of the graph.

Conversion inlines them unless asked to keep them, where nothing stands in the way
(:func:`inlining_obstacle`) and where inlining would not copy many bytes of constants held in
bodies that run from several calls (:func:`inlining_growth`).

Some exporters (jax2onnx) import the domains of the functions a function calls at the
standard opset's version and the model at 1: a runtime finds a function by domain and name
alone, while the inliner requires each domain at one version. Each domain that holds nothing but
functions is given one version first; once inlined, no node of those domains is left.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import onnx_ir as ir
import onnx_ir.passes.common as ir_passes

from mixprec.errors import InputError
from mixprec.graphs import all_graphs, all_nodes, forget_structure, walk_nodes

__all__ = ["COPY_LIMIT", "inline_as_asked", "inline_functions", "inlining_growth", "inlining_obstacle"]

# Bytes of constants that inlining may copy (a body holding them, run from several calls) before
# conversion keeps the functions unless asked to inline them.
COPY_LIMIT = 64 << 20


def inline_as_asked(
    model: ir.Model, mode: bool | None, is_op: Callable[[str, str], bool] | None = None
) -> str | None:
    """Inline the model's local functions in place where `mode` asks: True always (an
    InputError says why it cannot), False never, None (the default) where nothing stands in the
    way (:func:`inlining_obstacle`, :func:`inlining_growth`) and no function has the name of an
    op (`is_op(domain, name)`: the runtime runs its own kernel in place of such a function).
    Functions no node calls are dropped (they keep an opset upgrade from running). What was
    done, as a note, or None where nothing was (or an obstacle stopped it: the plan's note on
    the functions says why, where their bodies convert)."""
    if mode is False or not model.functions:
        return None
    if mode is None:
        if not any(node.op_identifier() in model.functions for node in walk_nodes(model.graph)):
            count, local = len(model.functions), {function.domain for function in model.functions.values()}
            model.functions.clear()
            _drop_function_domains(model, local)
            return f"dropped {count} local function(s) that no node of the graph calls"
        if inlining_obstacle(model) is not None:
            return None
        reason = _shadowing(model, is_op) or inlining_growth(model)
        if reason is not None:
            return f"local functions kept, each converting inside its FP32 signature: {reason}"
    count = inline_functions(model)
    return (
        f"inlined {count} local function(s) into the graphs that call them, as runtimes do when they "
        "load the model (--keep-functions keeps them)"
    )


def _shadowing(model: ir.Model, is_op: Callable[[str, str], bool] | None) -> str | None:
    """A function named like an op (which the runtime runs in its place), named, or None."""
    if is_op is None:
        return None
    for domain, name, _ in model.functions:
        if is_op(domain, name):
            return f"function {domain + '::' if domain else ''}{name} has the name of an op, which the runtime runs in its place"
    return None


def inlining_obstacle(model: ir.Model) -> str | None:
    """Why the model's local functions cannot be inlined, or None: functions that call each
    other in a cycle, a call that passes a graph or more inputs than its function declares (the
    inliner takes neither), or a body importing a domain other than a function domain at another
    version than the model (its nodes would mean something else in the caller's graph)."""
    return _cycle(model) or _unfit_call(model) or _obstacle(model, _aligned_domains(model))


def inlining_growth(model: ir.Model) -> str | None:
    """Why inlining would bloat the model, or None: the constants held in bodies that run from
    more than one call would be copied once per call, more than :data:`COPY_LIMIT` bytes."""
    runs = _runs(model)
    copied = 0
    for key, function in model.functions.items():
        if runs.get(key, 0) > 1:
            held = sum(_constant_bytes(node) for node in walk_nodes(function))
            copied += held * (runs[key] - 1)
    if copied <= COPY_LIMIT:
        return None
    return f"inlining would copy {copied / 2**20:.1f} MiB of constants held in bodies that several calls run"


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
    inputs = [value.name for value in model.graph.inputs]
    outputs = [value.name for value in model.graph.outputs]
    _align_versions(model, aligned)
    try:
        ir_passes.InlinePass()(model)
        ir_passes.RemoveUnusedFunctionsPass()(model)
    except Exception as e:  # noqa: BLE001 - onnx_ir's passes raise their own errors (a recursive function)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"cannot inline the model's local functions: {first}") from e
    finally:
        forget_structure(model)
    _keep_interface_names(model.graph, inputs, outputs)
    _unique_value_names(model)
    _drop_function_domains(model, local)
    return len(called)


def _drop_function_domains(model: ir.Model, local: set[str]) -> None:
    """Drop the imports of the `local` function domains that no node or function uses any more."""
    used = {node.domain for node in all_nodes(model)} | {function.domain for function in model.functions.values()}
    for domain in local - used - {"", "ai.onnx"}:  # the standard domain stays imported
        model.opset_imports.pop(domain, None)


def _keep_interface_names(graph: ir.Graph, inputs: list[str | None], outputs: list[str | None]) -> None:
    """Give the graph's inputs and outputs their names again: a body that returns one of its
    inputs hands the caller's value the name of the call's output. An output whose value must
    keep another name (a graph input, an initializer, an earlier output) is copied by an
    Identity under its own."""
    for value, name in zip(graph.inputs, inputs):
        value.name = name
    named: set[int] = set()  # values already named as an output
    for index, name in enumerate(outputs):
        value = graph.outputs[index]
        if value.name != name:
            if value.is_graph_input() or value.is_initializer() or id(value) in named:
                copy = ir.node("Identity", [value], name=f"{name}_output")
                copy.outputs[0].name = name
                copy.outputs[0].type, copy.outputs[0].shape = value.type, value.shape
                graph.append(copy)
                graph.outputs[index] = value = copy.outputs[0]
            else:
                value.name = name
        named.add(id(value))


def _unique_value_names(model: ir.Model) -> None:
    """Rename values so that no name is given twice across a graph and its subgraphs (bodies
    inlined into a graph may take a name a later subgraph defines); the main graph's inputs,
    outputs and initializers keep theirs."""
    graph = model.graph
    fixed = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
    seen = {value.name for value in fixed}
    pinned = {id(value) for value in fixed}
    counter = 0
    for g in all_graphs(model):
        values = [*g.inputs, *g.initializers.values(), *(out for node in g for out in node.outputs)]
        for value in values:
            if id(value) in pinned or not value.name:
                continue
            if value.name in seen:
                base = value.name
                while f"{base}__{counter}" in seen:
                    counter += 1
                value.name = f"{base}__{counter}"
            seen.add(value.name)


def _calls(graph: ir.Graph | ir.Function, functions: Mapping[ir.OperatorIdentifier, ir.Function]) -> Counter:
    """How many times each local function is called in `graph` (its subgraphs included)."""
    return Counter(key for node in walk_nodes(graph) if (key := node.op_identifier()) in functions)


def _cycle(model: ir.Model) -> str | None:
    """Functions that call each other in a cycle, named, or None."""
    callees = {key: _calls(function, model.functions) for key, function in model.functions.items()}
    state: dict[ir.OperatorIdentifier, int] = {}  # 1: on the path, 2: done

    def visit(key: ir.OperatorIdentifier, path: list[ir.OperatorIdentifier]) -> list[ir.OperatorIdentifier] | None:
        state[key] = 1
        for callee in callees[key]:
            if state.get(callee) == 1:
                return [*path, key, callee]
            if callee not in state and (found := visit(callee, [*path, key])) is not None:
                return found
        state[key] = 2
        return None

    for key in model.functions:
        if key not in state and (found := visit(key, [])) is not None:
            return "functions call each other in a cycle: " + " -> ".join(f"{d}::{n}" if d else n for d, n, _ in found)
    return None


def _unfit_call(model: ir.Model) -> str | None:
    """A call the inliner refuses (a graph passed as an attribute, more inputs than the
    function declares), named, or None."""
    for node in all_nodes(model):
        function = model.functions.get(node.op_identifier())
        if function is None:
            continue
        attributes = [*node.attributes.values(), *function.attributes.values()]
        if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in attributes):
            return f"node {node.name!r} passes a graph to function {function.name!r}"
        if len(node.inputs) > len(function.inputs):
            return f"node {node.name!r} passes {len(node.inputs)} inputs to function {function.name!r}, which takes {len(function.inputs)}"
        if len(node.outputs) > len(function.outputs):
            return f"node {node.name!r} takes {len(node.outputs)} outputs of function {function.name!r}, which has {len(function.outputs)}"
    return None


def _runs(model: ir.Model) -> dict[ir.OperatorIdentifier, int]:
    """How many times each function's body runs once inlined: its calls in the model's graphs,
    and in each calling function as many times as that one runs (no cycle: see :func:`_cycle`)."""
    functions = model.functions
    runs: Counter = _calls(model.graph, functions)
    callees = {key: _calls(function, functions) for key, function in functions.items()}
    callers = Counter(callee for counts in callees.values() for callee in counts)
    ready = [key for key in functions if not callers[key]]
    while ready:  # callers before callees
        key = ready.pop()
        for callee, count in callees[key].items():
            runs[callee] += runs[key] * count
            callers[callee] -= 1
            if not callers[callee]:
                ready.append(callee)
    return dict(runs)


def _constant_bytes(node: ir.Node) -> int:
    """The bytes of the tensor a Constant node holds (0 for other nodes)."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return 0
    attr = node.attributes.get("value")
    if attr is None or attr.is_ref() or attr.type is not ir.AttributeType.TENSOR:
        return 0  # a value the caller passes is the caller's
    return attr.value.nbytes


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
    first: dict[str, tuple[str, int]] = {}  # a domain the model does not import -> its first importer
    for function in model.functions.values():
        for domain, version in function.opset_imports.items():
            if domain in aligned:
                continue
            where = f"domain {domain!r}" if domain else "the default domain"
            declared = model.opset_imports.get(domain)
            if declared is not None and declared != version:
                return f"function {function.name!r} imports {where} at version {version}, the model at {declared}"
            if declared is None:
                other, at = first.setdefault(domain, (function.name, version))
                if at != version:
                    return f"functions {other!r} and {function.name!r} import {where} at versions {at} and {version}"
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
