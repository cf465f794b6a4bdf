"""PyTorch modules in: export with the dynamo exporter into an `onnx_ir` model, in memory.

`export_module` runs ``torch.onnx.export(..., dynamo=True)``, whose result already holds an
`onnx_ir.Model`: no serialize/parse round trip. The opset suits the target type (bfloat16
needs 22 for Conv and pooling). When the dynamo exporter fails for another reason than
data-dependent control flow, the TorchScript exporter is tried and exports what
``torch.onnx.export(..., dynamo=False)`` exports (the result says so, and names the first of the
tracer's warnings: a traced condition keeps the branch the example inputs take); a
data-dependent branch the dynamo exporter finds is an `ExportError` naming the module and the
line, because tracing it would bake one branch into the graph silently. The exporters' own
output (hundreds of lines on failure) goes to the log at debug level.

Node names become the module paths the exporter records (``/encoder/layers.0/self_attn/MatMul``),
so reports and plan files read like the model's code.

torch is imported only here, and only when a module is exported.
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import re
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.dtypes import LowPrecision
from mixprec.errors import ExportError, InputError
from mixprec.graphs import FreshNames, all_nodes
from mixprec.io import value_types

logger = logging.getLogger(__name__)

# Export at this opset unless told otherwise: bfloat16 Conv and pooling need 22, and at 23 the
# exporter writes RMSNormalization (and the normalization then computes in 16 bits with FP32
# accumulation: a tiny Llama goes from 15.5 to 6.5 casts per layer). A runtime whose profile
# states a lower highest opset (TensorRT) caps it.
_MODULE_OPSET = 23
_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
# The TorchScript exporter's highest opset.
_TORCHSCRIPT_MAX_OPSET = 20


@dataclass
class ExportedModule:
    """A module exported to ONNX, with the inputs it was exported on.

    Attributes:
        model: The exported model (FP32).
        exporter: "dynamo" or "torchscript" (the fallback).
        feeds: The example inputs as the model's input feeds (name -> array).
        seconds: Time the export took.
        notes: What a report should say about the export.
    """

    model: ir.Model
    exporter: str
    feeds: dict[str, np.ndarray]
    seconds: float
    notes: list[str] = field(default_factory=list)


def require_torch() -> Any:
    """Import torch, or a one-line error saying how to install it."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise InputError(
            "converting a PyTorch module needs torch: pip install torch (CPU builds suffice)"
        ) from None
    return torch


def export_module(
    module: Any,
    example_inputs: Sequence[Any] | Mapping[str, Any] | Any,
    target: LowPrecision,
    *,
    dynamic_shapes: Any = None,
    opset: int | None = None,
    max_opset: int | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> ExportedModule:
    """Export `module` on `example_inputs` (a tuple of positional inputs, a dict of keyword
    inputs, or one tensor) for conversion to `target`, at `opset` (default 23, or `max_opset`,
    the deployment runtime's highest, when lower).

    Raises:
        ExportError: Neither exporter can export the module (one line; the trace is logged).
        InputError: torch is missing, or `module` is not a torch module.
    """
    torch = require_torch()
    if not isinstance(module, torch.nn.Module):
        raise InputError(f"expected a torch.nn.Module, got {type(module).__name__}")
    args, kwargs = _split_inputs(example_inputs, torch)
    name = type(module).__name__
    if opset is None:
        opset = _MODULE_OPSET if max_opset is None else min(_MODULE_OPSET, max_opset)
    module.eval()
    start = time.perf_counter()
    notes: list[str] = []
    dynamo_error: Exception | None = None
    try:
        program = _quietly(
            lambda: torch.onnx.export(
                module, args, kwargs=kwargs or None, dynamo=True, dynamic_shapes=dynamic_shapes,
                opset_version=opset, input_names=input_names, output_names=output_names,
                verbose=False, report=False,
            )
        )
        model, exporter = program.model, "dynamo"
    except Exception as error:  # noqa: BLE001 - the exporters raise assorted types
        logger.debug("dynamo export of %s failed:\n%s", name, "".join(traceback.format_exception(error)))
        branch = _data_dependent(error)
        if branch is not None:
            raise ExportError(
                f"{name}: the exporter cannot follow data-dependent control flow ({branch}); "
                "write the branch with torch.where or torch.cond, or export the module yourself"
            ) from None
        dynamo_error = error
    if dynamo_error is not None:  # outside the handler: the fallback's errors do not chain to it
        model, warned = _torchscript_export(
            torch, module, args, kwargs, name, min(opset, _TORCHSCRIPT_MAX_OPSET), input_names, output_names,
            dynamo_error,
        )
        exporter = "torchscript"
        notes.append(
            f"the dynamo exporter failed ({_first_line(dynamo_error)}); exported with the TorchScript exporter"
            + ("; its model has the example inputs' static shapes (dynamic_shapes apply to the dynamo exporter)"
               if dynamic_shapes is not None else "")
        )
        if warned:
            notes.append(
                f"the TorchScript tracer warned {len(warned)} time(s), first at {warned[0]}: "
                "a traced condition keeps the branch the example inputs take"
            )
    seconds = time.perf_counter() - start
    renamed = _name_by_module_path(model)
    feeds = _feeds(model, args, kwargs, torch)
    notes.insert(0, f"exported {name} with the {exporter} exporter at opset {_opset(model)} in {seconds:.1f} s"
                 + (f"; {renamed} node(s) named by module path" if renamed else ""))
    return ExportedModule(model, exporter, feeds, seconds, notes)


def run_module(
    module: Any, feeds: Mapping[str, np.ndarray], example_inputs: Any, input_names: Sequence[str]
) -> list[np.ndarray]:
    """Run `module` in FP32 on `feeds` (the exported model's inputs by name, `input_names` in
    the model's order, arranged like `example_inputs`); its outputs, flattened in the order the
    exporter lists them.

    Raises:
        InputError: A feed is missing.
    """
    torch = require_torch()
    args, kwargs = _split_inputs(example_inputs, torch)
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    missing = [name for name in input_names if name not in feeds]
    if missing:
        raise InputError(f"the batch has no data for model input {missing[0]!r}")
    values = iter(feeds[name] for name in input_names)
    rebuilt = [torch.from_numpy(_contiguous(next(values))) if isinstance(x, torch.Tensor) else x for x in leaves]
    args, kwargs = torch.utils._pytree.tree_unflatten(rebuilt, spec)
    with torch.no_grad():
        outputs = module(*args, **kwargs)
    flat, _ = torch.utils._pytree.tree_flatten(outputs)
    return [t.detach().float().numpy() if t.is_floating_point() else t.detach().numpy() for t in flat if isinstance(t, torch.Tensor)]


# -- helpers -----------------------------------------------------------------------------------


def _split_inputs(example_inputs: Any, torch: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputError(
        f"example_inputs must be a tensor, a tuple of inputs or a dict of keyword inputs, got "
        f"{type(example_inputs).__name__}"
    )


def _quietly(call: Any) -> Any:
    """Run an exporter call with its printed output and torch's warnings sent to the debug log."""
    buffer = io.StringIO()
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            return call()
    finally:
        torch_logger.setLevel(level)
        if buffer.getvalue():
            logger.debug("exporter output:\n%s", buffer.getvalue())


def _causes(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return chain


def _data_dependent(error: BaseException) -> str | None:
    """Where data-dependent control flow stopped the export (``file:line``), or None."""
    for cause in _causes(error):
        kind = type(cause).__name__
        if "DataDependent" in kind or "data-dependent" in str(cause):
            frames = [f for f in traceback.extract_tb(cause.__traceback__) if "/torch/" not in f.filename]
            for line in str(cause).splitlines():  # the exporter names the user line it stopped at
                match = re.search(r'File "([^"]+)", line (\d+)', line)
                if match and "/torch/" not in match[1]:
                    return f"{match[1]}:{match[2]}"
            if frames:
                return f"{frames[-1].filename}:{frames[-1].lineno}"
            return _first_line(cause)
    return None


def _torchscript_export(
    torch: Any, module: Any, args: tuple, kwargs: dict, name: str, opset: int,
    input_names: Sequence[str] | None, output_names: Sequence[str] | None, dynamo_error: BaseException,
) -> tuple[ir.Model, list[str]]:
    """Export as ``torch.onnx.export(..., dynamo=False)`` does; the model and where the tracer
    warned (``file:line (message)``). Every warning goes to the debug log, none is raised."""
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _quietly(
                lambda: torch.onnx.export(
                    module, args, buffer, kwargs=kwargs or None, dynamo=False, opset_version=opset,
                    input_names=input_names, output_names=output_names,
                )
            )
    except Exception as error:  # noqa: BLE001
        logger.debug("TorchScript export of %s failed:\n%s", name, "".join(traceback.format_exception(error)))
        dynamo, torchscript = _first_line(dynamo_error), _first_line(error)
        errors = (
            f"both exporters: {dynamo}" if dynamo == torchscript
            else f"dynamo exporter: {dynamo}; TorchScript exporter: {torchscript}"
        )
        raise ExportError(
            f"{name}: cannot export to ONNX: {errors} (the exporters' traces are in the log at debug level)"
        ) from None
    warned = []
    for warning in caught:
        where = f"{Path(warning.filename).name}:{warning.lineno} ({str(warning.message).split('. ')[0]})"
        logger.debug("TorchScript export of %s: %s: %s", name, warning.category.__name__, where)
        if issubclass(warning.category, torch.jit.TracerWarning):
            warned.append(where)
    return value_types.deserialize(onnx.load_from_string(buffer.getvalue())), warned


def _first_line(error: BaseException) -> str:
    """The first line of the innermost cause (the exporter wraps the real error in pages of
    advice), without terminal colour codes."""
    innermost = _causes(error)[-1]
    for line in str(innermost).splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        if line:
            return f"{type(innermost).__name__}: {line[:300]}" if innermost is not error else line[:300]
    return type(innermost).__name__


def _opset(model: ir.Model) -> int | None:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx"))


def _name_by_module_path(model: ir.Model) -> int:
    """Name nodes after the module path the exporter recorded (``/layers.0/attn/MatMul``)."""
    nodes = all_nodes(model)
    fresh = FreshNames()
    renamed = 0
    for node in nodes:
        scopes = node.metadata_props.get(_SCOPES_KEY)
        path = None
        if scopes:
            try:
                parts = [p for p in ast.literal_eval(scopes) if isinstance(p, str)]
            except (ValueError, SyntaxError):
                parts = []
            path = "/".join(_local_names(parts[1:-1])) if parts else None  # drop the root and the aten op
        if path is None:
            node.name = fresh(node.name or node.op_type)
            continue
        node.name = fresh(f"/{path}/{node.op_type}" if path else f"/{node.op_type}")
        renamed += 1
    return renamed


def _local_names(scopes: Sequence[str]) -> list[str]:
    """Each scope's own part: the exporter records qualified names (``encoder``,
    ``encoder.layers.0``, ``encoder.layers.0.self_attn``) -> ``encoder``, ``layers.0``, ``self_attn``."""
    names: list[str] = []
    previous = ""
    for scope in scopes:
        if not scope:
            continue
        names.append(scope[len(previous) + 1 :] if previous and scope.startswith(previous + ".") else scope)
        previous = scope
    return names


def _feeds(model: ir.Model, args: tuple, kwargs: dict, torch: Any) -> dict[str, np.ndarray]:
    """The example inputs as feeds of the model's inputs (the exporter flattens them in order)."""
    leaves, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    inputs = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
    if len(tensors) != len(inputs):
        raise ExportError(
            f"the exported model has {len(inputs)} input(s) but the example inputs hold {len(tensors)} "
            "tensor(s) (an unused input was dropped?): pass only the inputs the module uses"
        )
    return {v.name: t.detach().cpu().numpy() for v, t in zip(inputs, tensors)}  # type: ignore[misc]


def _contiguous(array: np.ndarray) -> np.ndarray:
    """`array` in C order, a scalar kept one (numpy's ascontiguousarray gives it shape [1])."""
    return np.ascontiguousarray(array).reshape(np.shape(array))
