"""Which branches of the main graph's If nodes the checked batches ran.

The numeric check compares outputs, so a branch that no batch took was never run in 16 bits:
its numerics are unchecked, and the report says so (`unrun_branches`). A condition that is a
graph input is read from the batches; one the graph computes, from the FP32 reference model run
with it as an output.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.analysis.constants import is_constant
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


def _reads_inputs(value: ir.Value) -> bool:
    """Whether `value` depends on a graph input of its graph (what data can change)."""
    pending, seen = [value], {id(value)}
    while pending:
        current = pending.pop()
        if current.is_graph_input():
            return True
        producer = current.producer()
        for source in producer.inputs if producer is not None else ():
            if source is not None and id(source) not in seen:
                seen.add(id(source))
                pending.append(source)
    return False


def unrun_branches(reference: Path, model: ir.Model, batches: Sequence[Batch]) -> list[str]:
    """Notes, one per If node of `model`'s main graph whose condition was the same on every
    batch, naming the branch no batch took when that branch computes in 16 bits. Conditions
    that no graph input reaches (a branch that never runs anywhere) are not noted; conditions
    that are graph inputs are read from the batches, the others from the FP32 reference run
    with them as outputs; an If whose condition the reference does not hold by name, or a
    failed run, gives no note (logged)."""
    untaken: dict[str, list[tuple[ir.Node, dict[bool, int]]]] = {}
    for node in model.graph:
        if not (is_default_domain(node.domain) and node.op_type == "If") or not node.inputs:
            continue
        condition = node.inputs[0]
        if condition is None or not condition.name or is_constant(condition) or not _reads_inputs(condition):
            continue
        sizes = {}
        for attr_name, taken in _BRANCHES:
            attr = node.attributes.get(attr_name)
            if attr is not None:
                sizes[taken] = _computes_in_16_bits(attr.as_graph())
        if any(sizes.values()):
            untaken.setdefault(condition.name, []).append((node, sizes))
    if not untaken or not batches:
        return []
    seen: dict[str, set[bool]] = {name: set() for name in untaken}
    computed = [name for name in untaken if any(name not in feeds for feeds in batches)]
    for feeds in batches:
        for name in untaken:
            if name in feeds:
                seen[name].update(bool(v) for v in np.asarray(feeds[name]).reshape(-1))
    if computed:
        try:
            with IntermediateRunner(reference, elem_types={name: onnx.TensorProto.BOOL for name in computed}) as runner:
                for _feeds, values in runner.run(computed, batches):
                    for name, value in values.items():
                        seen[name].update(bool(v) for v in np.asarray(value).reshape(-1))
        except Exception as e:  # noqa: BLE001 - an advisory note never stops a conversion
            logger.info("If conditions not read: %s", e)
            for name in computed:
                seen[name] = set()
    notes = []
    for name, nodes in untaken.items():
        if len(seen[name]) != 1:
            continue  # both branches ran, or the condition was not read
        (took,) = seen[name]
        ran, idle = ("then", "else") if took else ("else", "then")
        for node, sizes in nodes:
            count = sizes.get(not took, 0)
            if count:
                which = repr(node.name) if node.name else f"reading condition {name!r}"
                notes.append(
                    f"If {which} took only its {ran} branch on the {len(batches)} batch(es): its {idle} "
                    f"branch ({count} node(s) in 16 bits) did not run, so its numerics are not checked; "
                    "--data with inputs that take it checks it"
                )
    return notes
