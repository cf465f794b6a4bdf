"""Which branches of the main graph's If nodes the checked batches ran.

The numeric check compares outputs, so a branch that no batch took was never run in 16 bits:
its numerics are unchecked, and the report says so (`unrun_branches`). The conditions are read
from the FP32 reference model, run with them as outputs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.analysis.constants import is_constant
from mixprec.errors import MixprecError
from mixprec.graphs import is_default_domain, walk_nodes
from mixprec.runtime.batches import Batch
from mixprec.runtime.intermediates import IntermediateRunner

logger = logging.getLogger(__name__)

_LOW = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_BRANCHES = (("then_branch", True), ("else_branch", False))


def _computes_in_16_bits(graph: ir.Graph) -> int:
    """How many nodes of `graph` (subgraphs included) give a 16-bit float output."""
    return sum(
        1 for node in walk_nodes(graph)
        if any(v is not None and v.dtype in _LOW for v in node.outputs)
    )


def unrun_branches(reference: Path, model: ir.Model, batches: Sequence[Batch]) -> list[str]:
    """Notes, one per If node of `model`'s main graph whose condition was the same on every
    batch, naming the branch no batch took when that branch computes in 16 bits. Conditions
    that are constants (a branch that never runs anywhere) are not noted; an If whose condition
    the reference does not hold by name, or a failed run, gives no note (logged)."""
    untaken: dict[str, tuple[ir.Node, dict[bool, int]]] = {}
    for node in model.graph:
        if not (is_default_domain(node.domain) and node.op_type == "If") or not node.inputs:
            continue
        condition = node.inputs[0]
        if condition is None or not condition.name or is_constant(condition):
            continue
        sizes = {}
        for attr_name, taken in _BRANCHES:
            attr = node.attributes.get(attr_name)
            if attr is not None:
                sizes[taken] = _computes_in_16_bits(attr.as_graph())
        if any(sizes.values()):
            untaken[condition.name] = (node, sizes)
    if not untaken or not batches:
        return []
    seen: dict[str, set[bool]] = {name: set() for name in untaken}
    try:
        types = {name: onnx.TensorProto.BOOL for name in untaken}
        with IntermediateRunner(reference, elem_types=types) as runner:
            for _feeds, values in runner.run(list(untaken), batches):
                for name, value in values.items():
                    seen[name].update(bool(v) for v in np.asarray(value).reshape(-1))
    except MixprecError as e:
        logger.info("If conditions not read: %s", e)
        return []
    notes = []
    for name, (node, sizes) in untaken.items():
        if len(seen[name]) != 1:
            continue  # both branches ran, or the condition was not read
        (took,) = seen[name]
        count = sizes.get(not took, 0)
        if count:
            ran, idle = ("then", "else") if took else ("else", "then")
            notes.append(
                f"If {node.name or name!r} took only its {ran} branch on the {len(batches)} batch(es): "
                f"its {idle} branch ({count} node(s) in 16 bits) did not run, so its numerics are not "
                "checked; --data with inputs that take it checks it"
            )
    return notes
