"""QuantizeLinear / DequantizeLinear in forms onnxruntime's CPU provider runs, for the emulation.

The emulation model (:mod:`mixprec.validate.emulate`) computes in float32 on the CPU provider,
but keeps each Q/DQ node at the model's opset with its integer types; the provider lacks some of
those forms (DequantizeLinear and QuantizeLinear of the opset-28 schema in onnxruntime 1.32).
Whether it has one is read from its own kernel registry
(:func:`mixprec.runtime.kernels.cpu_has_kernel`); a node it lacks becomes:

  1. a DequantizeLinear of constants: its values, computed in FP32 as the kernel would
     (an initializer with the output's name);
  2. otherwise the `com.microsoft` op of the same arithmetic (per tensor or per axis), which the
     provider serves at every default-domain opset, where it has a kernel for the node's types
     and the node quantizes in no blocks;
  3. otherwise it stays, and loading the emulation model fails with onnxruntime's own message.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import is_constant
from mixprec.graphs import default_domain_version, is_default_domain
from mixprec.passes.fold_dequantize import fold_node
from mixprec.policy.opfacts import op_facts
from mixprec.policy.profiles import load_runtime
from mixprec.policy.schemas import Signature, signature
from mixprec.runtime.kernels import cpu_has_kernel

__all__ = ["cpu_quantization_forms"]

_CONTRIB = "com.microsoft"
_CONTRIB_ATTRIBUTES = frozenset({"axis"})


def cpu_quantization_forms(model: ir.Model) -> int:
    """Rewrite (in place) the Q/DQ nodes the CPU provider has no kernel for; how many were."""
    opset = default_domain_version(model.opset_imports)
    rewritten = 0
    for graph in model.graphs():
        for node in list(graph):
            kind = op_facts(node.domain, node.op_type).quantization
            if kind is None or not is_default_domain(node.domain):
                continue
            if _lacks_cpu_kernel(node, opset) and _rewrite(model, graph, node, kind):
                rewritten += 1
    return rewritten


def _lacks_cpu_kernel(node: ir.Node, opset: int | None) -> bool:
    """Whether the CPU provider has no kernel for the node's schema and types (False when the
    schema or a type is unknown)."""
    version = node.version or opset
    sig = signature(node.op_type, "", version, len(node.inputs), len(node.outputs)) if version else None
    bindings = _bindings(node, sig) if sig is not None else None
    if sig is None or bindings is None:
        return False
    return not cpu_has_kernel("", node.op_type, sig.since_version, bindings)


def _rewrite(model: ir.Model, graph: ir.Graph, node: ir.Node, kind: str) -> bool:
    """Fold a DequantizeLinear of constants, else make the node the contrib op; whether it was
    rewritten."""
    if kind == "dequantize" and all(v is None or is_constant(v) for v in node.inputs):
        fold_node(graph, node)
        return True
    if _to_contrib(node):
        model.opset_imports.setdefault(_CONTRIB, 1)
        return True
    return False


def _bindings(node: ir.Node, sig: Signature) -> dict[str, str] | None:
    """Type variable -> type string of the node's inputs and outputs (None: a type is unknown)."""
    found: dict[str, str] = {}
    pairs = [*zip(node.inputs, sig.input_vars), *zip(node.outputs, sig.output_vars)]
    for value, var in pairs:
        if value is None or var is None:
            continue
        if value.dtype is None:
            return None
        found[var] = f"tensor({value.dtype.name.lower()})"
    return found


def _to_contrib(node: ir.Node) -> bool:
    """Make the node the `com.microsoft` op of the same arithmetic, if the provider runs it."""
    block = node.attributes.get("block_size")
    if block is not None and block.as_int() > 0:
        return False
    sig = load_runtime("ort-cpu").signature(_CONTRIB, node.op_type, 1, len(node.inputs), len(node.outputs))
    bindings = _bindings(node, sig) if sig is not None else None
    if bindings is None or not cpu_has_kernel(_CONTRIB, node.op_type, 1, bindings):
        return False
    if op_facts("", node.op_type).quantization == "quantize" and (len(node.inputs) < 3 or node.inputs[2] is None):
        # Without a zero point the contrib op yields uint8: give it the output's type explicitly.
        dtype = node.outputs[0].dtype
        assert dtype is not None
        zero = ir.Value(
            name=f"{node.outputs[0].name}_zero_point", type=ir.TensorType(dtype), shape=ir.Shape(()),
            const_value=ir.tensor(np.zeros((), dtype.numpy())),
        )
        node.graph.initializers.add(zero)  # type: ignore[union-attr]
        if len(node.inputs) < 3:
            node.resize_inputs(3)
        node.replace_input_with(2, zero)
    for name in [n for n in node.attributes if n not in _CONTRIB_ATTRIBUTES]:
        node.attributes.pop(name)
    node.domain = _CONTRIB
    node.version = None
    return True
