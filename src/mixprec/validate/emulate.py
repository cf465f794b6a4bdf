"""Emulated low-precision execution for runtimes without 16-bit kernels.

:func:`emulate_low_precision` rewrites a mixed-precision model so that every
float16/bfloat16 tensor is held in float32, and every value that was 16-bit is
rounded through its 16-bit type right after it is produced
(``Cast(to=16-bit)`` then ``Cast(to=FLOAT)``). Running the result gives the numerics
of a runtime that computes each 16-bit op in float32 and rounds its result, which
onnxruntime's CPU provider can run for bfloat16 too (it has bfloat16 ``Cast``
kernels but almost no bfloat16 compute kernels).

Details of the rewrite:

* Graph inputs and outputs that were 16-bit become FLOAT: feed float32 data; the
  inputs are rounded to the 16-bit type on entry, as a caller casting its data would.
* 16-bit initializers and ``Constant``/``ConstantOfShape`` tensors are converted to
  float32 exactly (values unchanged; they need no rounding).
* ``Cast(to=16-bit)`` keeps its rounding and gets a ``Cast(to=FLOAT)`` after it;
  ``CastLike`` to a 16-bit type becomes that pair; element-type attributes
  (``dtype_attribute`` in the op facts, ``policy/tables/opfacts.toml``: ``dtype`` of
  ``RandomNormal*``, ``RandomUniform*``, ``EyeLike``, ``Bernoulli``, ``output_dtype`` of
  ``DequantizeLinear``) that name a 16-bit type become FLOAT and the output is rounded.
* Outputs of ops that only move or select 16-bit values (``value_preserving`` in the
  op facts: ``Reshape``, ``Concat``, ``Relu``, ``Max`` and similar), of control flow
  (``If``/``Loop``/``Scan``: their bodies round) and 16-bit sequence/optional values are
  retyped but not re-rounded: their values are already exactly representable.
* QuantizeLinear / DequantizeLinear forms the CPU provider lacks (the opset-28 schema, say)
  become forms it has (:mod:`mixprec.validate.qdq_forms`).
* Model-local functions are inlined first (onnxruntime inlines them too): ONNX
  functions are untyped, so their 16-bit values are only known after inlining.

Element types come from the model's value infos completed by ONNX type inference;
a value whose type stays unknown (e.g. from a custom-domain op) is left unrounded
and reported in a warning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.errors import InputError, ModelLoadError, RunError
from mixprec.graphs import FreshNames, default_domain_version, is_default_domain, model_names
from mixprec.io import value_types, weight_free_proto
from mixprec.passes.functions import inline_functions
from mixprec.policy.opfacts import NO_FACTS, op_facts
from mixprec.validate.qdq_forms import cpu_quantization_forms
from mixprec.validate.recurrent import RECURRENT_OPS, round_state_each_step, steps_by_itself

logger = logging.getLogger(__name__)

ModelLike = onnx.ModelProto | ir.Model | str | os.PathLike

_FLOAT = ir.DataType.FLOAT
_LOW = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_SUFFIX = {ir.DataType.FLOAT16: "fp16", ir.DataType.BFLOAT16: "bf16"}

# Ops whose 16-bit outputs need no rounding besides the value-preserving ones: control flow
# (its bodies round) and constants (their tensors are converted exactly).
_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
_CONSTANTS = frozenset({"Constant", "ConstantOfShape"})

# Above this many bytes of initializers, emulate_low_precision_file writes external data.
_EXTERNAL_DATA_THRESHOLD = 1 << 30


def emulate_low_precision(model: ModelLike) -> onnx.ModelProto:
    """Return an all-float32 copy of a mixed-precision model that rounds like 16-bit.

    See the module docstring for the rewrite rules. The caller's model is never
    modified. Pass large models (over 2 GB, or with external data) to
    :func:`emulate_low_precision_file` instead: a ``ModelProto`` cannot hold them.

    Args:
        model: A ``ModelProto``, an ``onnx_ir.Model`` (cloned first; its tensors are
            shared, not copied), or a model path (loaded with its external data).

    Returns:
        The emulation model. Its 16-bit graph inputs and outputs are now float32.

    Raises:
        ModelLoadError: A path cannot be loaded.
        RunError: The model cannot be rewritten (e.g. functions cannot be inlined).
    """
    ir_model = _load_copy(model)
    _emulate_in_place(ir_model)
    return value_types.to_proto(ir_model)


def emulate_low_precision_file(
    model_path: str | os.PathLike[str], output_path: str | os.PathLike[str]
) -> Path:
    """Write the emulation model of a model file, streaming large weights.

    Initializers are loaded lazily and written to ``<output name>.data`` external
    data when the source uses external data or holds over 1 GiB of initializers.

    Args:
        model_path: Source model file.
        output_path: Destination ``.onnx`` file (must differ from the source).

    Returns:
        The destination path.

    Raises:
        InputError: The destination would overwrite the source or its external data.
        ModelLoadError: The source cannot be loaded.
        RunError: The model cannot be rewritten.
    """
    src = Path(model_path)
    dst = Path(output_path)
    if not src.is_file():
        raise ModelLoadError(f"model file does not exist: {src}")
    if dst.resolve() == src.resolve():
        raise InputError(f"output path {dst} is the input model; choose another path")
    try:
        ir_model = value_types.load(src)
    except Exception as exc:  # protobuf and onnx_ir raise assorted types
        raise ModelLoadError(f"cannot load model {src}: {exc}") from exc
    return emulate_into_file(ir_model, dst)


def emulate_into_file(ir_model: ir.Model, output_path: str | os.PathLike[str]) -> Path:
    """Rewrite `ir_model` in place into its emulation model and save it at `output_path`
    (external data as :func:`emulate_low_precision_file` decides). For a model that is not
    needed afterwards: no copy, no reload."""
    dst = Path(output_path)
    external = [t for t in _initializer_tensors(ir_model) if isinstance(t, ir.ExternalTensor)]
    _emulate_in_place(ir_model)

    total = sum(t.nbytes for t in _initializer_tensors(ir_model))
    external_data: str | None = None
    if external or total > _EXTERNAL_DATA_THRESHOLD:
        external_data = f"{dst.name}.data"
        target = (dst.parent / external_data).resolve()
        if any(Path(t.path).resolve() == target for t in external):
            raise InputError(
                f"external data file {target} is used by the source model; choose another "
                "output name"
            )
    dst.parent.mkdir(parents=True, exist_ok=True)
    value_types.save(ir_model, dst, external_data=external_data, size_threshold_bytes=1024)
    logger.info("wrote emulation model %s", dst)
    return dst


def _initializer_tensors(model: ir.Model) -> list[ir.TensorProtocol]:
    return [
        v.const_value
        for graph in model.graphs()
        for v in graph.initializers.values()
        if v.const_value is not None
    ]


def _load_copy(model: ModelLike) -> ir.Model:
    if isinstance(model, onnx.ModelProto):
        return value_types.deserialize(model, owned=False)
    if isinstance(model, ir.Model):
        return value_types.carry(model, model.clone())
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise ModelLoadError(f"model file does not exist: {path}")
        try:
            proto = onnx.load(str(path), load_external_data=True)
        except Exception as exc:  # protobuf and onnx raise assorted types
            raise ModelLoadError(f"cannot load model {path}: {exc}") from exc
        return value_types.deserialize(proto)
    raise InputError(
        f"expected an onnx.ModelProto, onnx_ir.Model or path, got {type(model).__name__}"
    )


def _emulate_in_place(model: ir.Model) -> None:
    _inline_functions(model)
    _infer_types(model)
    names = _Names(*model_names(model))
    rounded = 0
    untyped: dict[str, set[str]] = {}  # op -> outputs of unknown element type
    opset = default_domain_version(model.opset_imports)
    for graph in list(model.graphs()):
        rounded += _emulate_graph(graph, graph is model.graph, names, untyped, opset)
    non_tensor = model.meta.get(value_types.SET_ASIDE, {})  # maps: nothing to round
    unknown = sorted(op for op, outputs in untyped.items() if not outputs <= non_tensor.keys())
    if unknown:
        logger.warning(
            "emulation: the element type of some outputs of %s is unknown; those values "
            "are not rounded to 16-bit",
            ", ".join(unknown),
        )
    if rounded and default_domain_version(model.opset_imports) is None:
        model.opset_imports[""] = 13
    forms = cpu_quantization_forms(model)
    _cpu_opset(model)
    logger.info("emulation: %d values rounded through 16-bit, %d Q/DQ nodes in CPU forms", rounded, forms)


def _cpu_opset(model: ir.Model) -> None:
    """Declare the opset onnxruntime's CPU provider runs the model at, where it has no kernel
    of some op at the model's (:func:`mixprec.passes.opset.cpu_runnable_opset`)."""
    from mixprec.passes.opset import cpu_runnable_opset, set_default_opset  # noqa: PLC0415

    version = cpu_runnable_opset(model)
    if version is not None:
        set_default_opset(model, version)
        logger.info("emulation: opset %d declared for onnxruntime's CPU provider", version)


def _infer_types(model: ir.Model) -> None:
    """Fill in missing value types with ONNX type inference (no-op when all are known).

    Main-graph initializers are handed to inference as typed inputs, so weight data is never
    serialized. Unlike onnx_ir's ShapeInferencePass, whole types
    are merged, so sequence and optional values keep their kind.
    """
    if all(
        value.type is not None
        for graph in model.graphs()
        for node in graph
        for value in node.outputs
        if value.name
    ):
        return
    try:
        inferred = onnx.shape_inference.infer_shapes(
            weight_free_proto(model, max_inline_bytes=-1), check_type=False, strict_mode=False, data_prop=False
        )
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError) as exc:
        logger.warning("emulation: ONNX type inference failed (%s); using declared types", exc)
        return
    inferred_model = value_types.deserialize(inferred)
    for original, result in zip(model.graphs(), inferred_model.graphs()):
        found = ir.convenience.create_value_mapping(result)
        for name, value in ir.convenience.create_value_mapping(original).items():
            other = found.get(name)
            if other is None:
                continue
            if value.type is None and other.type is not None:
                value.type = other.type
            if value.shape is None and other.shape is not None:
                value.shape = other.shape


def _inline_functions(model: ir.Model) -> None:
    try:
        inline_functions(model)
    except InputError as exc:  # the functions cannot be inlined: no emulated model
        raise RunError(str(exc)) from exc


@dataclass(frozen=True)
class _Names:
    """Fresh value and node names, unique across the whole model."""

    value: FreshNames
    node: FreshNames


def _emulate_graph(
    graph: ir.Graph, is_main: bool, names: _Names, untyped: dict[str, set[str]], opset: int | None
) -> int:
    """Rewrite one graph (not its subgraphs; `opset`: the model's default-domain opset); return
    the number of rounding points."""
    rounded = 0
    original_nodes = list(graph)
    for init in graph.initializers.values():
        tensor = init.const_value
        if tensor is not None and tensor.dtype in _LOW:
            init.const_value = _float32_tensor(tensor)
        _retype(init)

    entry_nodes: list[ir.Node] = []
    for value in graph.inputs:
        low = _low_dtype(value)
        _retype(value)
        # Subgraph inputs receive values that were rounded where they were produced.
        if low is not None and is_main and value.name and value.uses():
            entry_nodes.extend(_round_graph_input(graph, value, low, names))
            rounded += 1
    if entry_nodes:
        first = next(iter(graph), None)
        if first is None:
            graph.extend(entry_nodes)
        else:
            graph.insert_before(first, entry_nodes)

    for node in original_nodes:
        rounded += _emulate_node(graph, node, names, untyped, opset)

    for value in graph.outputs:  # includes outputs that name outer-scope values
        _retype(value)
    return rounded


def _emulate_cast(graph: ir.Graph, node: ir.Node, names: _Names) -> int:
    """A Cast to 16-bit keeps its rounding and gets a Cast to FLOAT after it; others are
    retyped. Returns the number of rounding points."""
    to = ir.DataType(node.attributes["to"].value)
    out = node.outputs[0]
    if to in _LOW:
        out.type = ir.TensorType(to)  # a new type object: the model may share types with its original
        _append_cast_to_float(graph, node, out, to, names)
        return 1
    _retype(out)
    return 0


def _emulate_cast_like(graph: ir.Graph, node: ir.Node, names: _Names, untyped: dict[str, set[str]]) -> int:
    """A CastLike to 16-bit becomes a Cast pair; others are retyped. Returns the number of
    rounding points."""
    out = node.outputs[0]
    low = _low_dtype(out)  # the target's type: inputs may be retyped already
    if low is not None:
        _replace_cast_like(graph, node, low, names)
        return 1
    if out.type is None:
        untyped.setdefault("CastLike", set()).add(out.name)
    _retype(out)
    return 0


def _float_dtype_attribute(node: ir.Node, attribute: str | None) -> ir.DataType | None:
    """Make the element-type attribute `attribute` FLOAT where it names a 16-bit type; the
    16-bit type it named, else None."""
    if attribute is None:
        return None
    attr = node.attributes.get(attribute)
    # An element type (an int); the "value" tensors of constants were converted before.
    if attr is None or attr.type != ir.AttributeType.INT:
        return None
    dtype = ir.DataType(attr.value)
    if dtype not in _LOW:
        return None
    node.attributes[attr.name] = ir.AttrInt64(attr.name, _FLOAT)
    return dtype


def _emulate_node(
    graph: ir.Graph, node: ir.Node, names: _Names, untyped: dict[str, set[str]], opset: int | None
) -> int:
    """Rewrite one node for emulation; return the number of rounding points."""
    op = node.op_type if is_default_domain(node.domain) else None
    facts = op_facts("", op) if op is not None else NO_FACTS
    if op in _CONSTANTS:
        _convert_tensor_attributes(node)
    if op == "Cast" and "to" in node.attributes:
        return _emulate_cast(graph, node, names)
    if op == "CastLike":
        return _emulate_cast_like(graph, node, names, untyped)
    attr_low = _float_dtype_attribute(node, facts.dtype_attribute)
    skip_rounding = facts.value_preserving or op in _CONTROL_FLOW or op in _CONSTANTS
    state_low = _state_type(node) if op in RECURRENT_OPS else None
    rounded = _round_outputs(graph, node, op, attr_low, skip_rounding, names, untyped)
    if state_low is not None and steps_by_itself(node, opset):
        round_state_each_step(graph, node, state_low, opset, names.value, names.node)
    return rounded


def _state_type(node: ir.Node) -> ir.DataType | None:
    """A recurrent node's 16-bit type, read from its outputs before they become FLOAT (Y may be
    omitted)."""
    return next((low for out in node.outputs if out.name and (low := _low_dtype(out)) is not None), None)


def _round_outputs(
    graph: ir.Graph,
    node: ir.Node,
    op: str | None,
    attr_low: ir.DataType | None,
    skip_rounding: bool,
    names: _Names,
    untyped: dict[str, set[str]],
) -> int:
    """Retype the node's outputs to FLOAT and round those that were 16-bit (unless
    `skip_rounding`); outputs without a type take `attr_low`, else are noted in `untyped`.
    Returns the number of rounding points."""
    rounded = 0
    for out in node.outputs:
        if not out.name:
            continue  # omitted optional output
        if out.type is None:
            if attr_low is None:
                if op in _CONSTANTS:
                    continue  # type follows the (converted) tensor attribute
                untyped.setdefault(f"{node.domain + '::' if node.domain else ''}{node.op_type}", set()).add(out.name)
                continue
            out.type = ir.TensorType(attr_low)
        low = _low_dtype(out)
        _retype(out)
        if low is None or skip_rounding:
            continue
        _append_rounding(graph, node, out, low, names)
        rounded += 1
    return rounded


def _low_dtype(value: ir.Value) -> ir.DataType | None:
    """The 16-bit float type of a tensor value, else None."""
    if isinstance(value.type, ir.TensorType) and value.type.dtype in _LOW:
        return value.type.dtype
    return None


def _retype(value: ir.Value) -> None:
    new_type = _float_type(value.type)
    if new_type is not None:
        value.type = new_type


def _float_type(value_type: ir.TypeProtocol | None) -> ir.TypeProtocol | None:
    """``value_type`` with 16-bit element types replaced by FLOAT; None if unchanged."""
    if isinstance(value_type, ir.TensorType):
        return ir.TensorType(_FLOAT) if value_type.dtype in _LOW else None
    if isinstance(value_type, ir.SparseTensorType):
        return ir.SparseTensorType(_FLOAT) if value_type.dtype in _LOW else None
    if isinstance(value_type, ir.SequenceType):
        inner = _float_type(value_type.elem_type)
        return None if inner is None else ir.SequenceType(inner)
    if isinstance(value_type, ir.OptionalType):
        inner = _float_type(value_type.elem_type)
        return None if inner is None else ir.OptionalType(inner)
    return None


def _float32_tensor(tensor: ir.TensorProtocol) -> ir.Tensor:
    array = np.asarray(tensor.numpy()).astype(np.float32)
    return ir.Tensor(array, name=tensor.name, doc_string=tensor.doc_string)


def _convert_tensor_attributes(node: ir.Node) -> None:
    for name, attr in list(node.attributes.items()):
        if attr.type == ir.AttributeType.TENSOR and attr.value.dtype in _LOW:
            node.attributes[name] = ir.AttrTensor(name, _float32_tensor(attr.value))
        elif attr.type == ir.AttributeType.SPARSE_TENSOR and attr.value.dtype in _LOW:
            raise RunError(
                f"node {node.name!r}: 16-bit sparse tensor constants are not supported "
                "by the emulation"
            )


def _make_value(name: str, dtype: ir.DataType, like: ir.Value) -> ir.Value:
    shape = None if like.shape is None else ir.Shape(like.shape)
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=shape)


def _cast(value: ir.Value, to: ir.DataType, out: ir.Value, base: str, names: _Names) -> ir.Node:
    return ir.Node(
        "", "Cast", [value], [ir.AttrInt64("to", to)], outputs=[out], name=names.node(base)
    )


def _redirect(old: ir.Value, new: ir.Value) -> None:
    """Make every consumer of ``old`` (subgraphs included) and its graph output use ``new``.

    ONNX forbids a subgraph output that is an outer-scope value, so only the owning
    graph's outputs can refer to ``old``.
    """
    old.replace_all_uses_with(new, replace_graph_outputs=True)


def _append_rounding(
    graph: ir.Graph, node: ir.Node, value: ir.Value, low: ir.DataType, names: _Names
) -> None:
    """Round ``value`` (now FLOAT) through ``low``; consumers see the rounded value.

    The rounded value takes over the original name (so graph outputs keep theirs);
    the unrounded one is renamed.
    """
    name = value.name or "value"
    value.name = names.value(f"{name}_fp32")
    as_low = _make_value(names.value(f"{name}_{_SUFFIX[low]}"), low, value)
    rounded = _make_value(name, _FLOAT, value)
    _redirect(value, rounded)
    base = f"{node.name or node.op_type}_round_{_SUFFIX[low]}"
    graph.insert_after(
        node,
        [
            _cast(value, low, as_low, base, names),
            _cast(as_low, _FLOAT, rounded, f"{base}_back", names),
        ],
    )


def _append_cast_to_float(
    graph: ir.Graph, node: ir.Node, value: ir.Value, low: ir.DataType, names: _Names
) -> None:
    """After ``Cast(to=low)``, add ``Cast(to=FLOAT)``; the float value takes the name."""
    name = value.name or "value"
    value.name = names.value(f"{name}_{_SUFFIX[low]}")
    as_float = _make_value(name, _FLOAT, value)
    _redirect(value, as_float)
    graph.insert_after(
        node, _cast(value, _FLOAT, as_float, f"{node.name or 'Cast'}_to_fp32", names)
    )


def _replace_cast_like(graph: ir.Graph, node: ir.Node, low: ir.DataType, names: _Names) -> None:
    """Replace ``CastLike(x, like)`` (to 16-bit) by ``Cast(x, to=low)`` + ``Cast(to=FLOAT)``."""
    out = node.outputs[0]
    name = out.name or "value"
    as_low = _make_value(names.value(f"{name}_{_SUFFIX[low]}"), low, out)
    out.name = names.value(f"{name}_castlike")
    as_float = _make_value(name, _FLOAT, out)
    _redirect(out, as_float)
    base = node.name or "CastLike"
    graph.insert_after(
        node,
        [
            _cast(node.inputs[0], low, as_low, f"{base}_as_cast", names),
            _cast(as_low, _FLOAT, as_float, f"{base}_to_fp32", names),
        ],
    )
    graph.remove(node, safe=True)


def _round_graph_input(
    graph: ir.Graph, value: ir.Value, low: ir.DataType, names: _Names
) -> list[ir.Node]:
    """Nodes rounding a (now FLOAT) main-graph input; its consumers use the result.

    The input keeps its name. A graph output that is the input itself stays unrounded.
    """
    name = value.name or "input"
    as_low = _make_value(names.value(f"{name}_{_SUFFIX[low]}"), low, value)
    rounded = _make_value(names.value(f"{name}_rounded"), _FLOAT, value)
    for user, index in list(value.uses()):
        user.replace_input_with(index, rounded)
    base = f"{name}_round_{_SUFFIX[low]}"
    return [
        _cast(value, low, as_low, base, names),
        _cast(as_low, _FLOAT, rounded, f"{base}_back", names),
    ]
