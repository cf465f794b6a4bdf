"""The `repair` step: when onnxruntime fails (or crashes) on the converted model where it runs
the FP32 one, keep FP32 the fewest converted nodes that make it load and run, and plan again.

The FP32 reference is prepared once more (the conversion rewrote its own model in place); the
trials plan and rewrite copies of that preparation (no reload per trial) and run each in a child
process as users run it (:func:`mixprec.validate.repair.find_culprits`
picks them). Where the runtime's error names a node, its neighbourhood is searched first.
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx_ir as ir

from mixprec.errors import ValidationFailure
from mixprec.io import save_model, wants_external_data, without_staging
from mixprec.pipeline.planning import Planned
from mixprec.pipeline.steps import Rewritten
from mixprec.plan.model import Category, Precision, PrecisionPlan
from mixprec.runtime.isolated import run_isolated
from mixprec.validate.repair import find_culprits
from mixprec.validate.staged import RuntimeRejection, loads_as_validated, openvino_runs, quantized_model

if TYPE_CHECKING:
    from mixprec.pipeline.runner import Prepared

logger = logging.getLogger(__name__)

# Hops around a node the runtime's error names within which its culprits are looked for first.
NEAR_HOPS = 4


@dataclass(frozen=True)
class Repaired:
    """The plan with the culprits kept FP32, its rewritten model, and what the report says."""

    planned: Planned
    rewritten: Rewritten
    kept: tuple[str, ...]
    note: str


def repair(rejection: RuntimeRejection, prepared: Prepared, rejected: PrecisionPlan) -> Repaired:
    """Keep FP32 the fewest nodes converted by `rejected` that make onnxruntime load (and run)
    the model; raise the rejection when there is nothing to search, ValidationFailure when even
    every converted node FP32 fails."""
    from mixprec.pipeline.runner import prepare  # noqa: PLC0415 - the runner calls this step

    source = prepared.reference.path
    converted = [prepared.keys[n] for n in rejected.order if rejected.decisions[n].precision is Precision.LOW]
    if source is None or not converted:
        raise rejection
    outcome, target = rejection.outcome, prepared.target
    # The input passed its checks already; trials only plan and rewrite the typed model.
    config = prepared.config.with_options(ranges=prepared.analysis.ranges, progress=False, allow_invalid=True)
    trials = prepare(source, config)
    what = "crashes on" if outcome.crashed else "fails on"
    error = without_staging(outcome.error or "")
    runtime = "OpenVINO's CPU plugin" if rejection.openvino else "onnxruntime (CPU provider, default options)"
    reason = f"{runtime} {what} the model with this node in 16 bits: {error}"
    quantized = quantized_model(trials.model)

    def runs(path: Path) -> bool:
        if rejection.openvino:
            return openvino_runs(path, rejection.feeds or {}, quantized=quantized)
        return loads_as_validated(run_isolated(path, rejection.feeds), target)

    def fails(kept: frozenset[str]) -> bool:
        model, _ = trials.rewrite(dict.fromkeys(kept, (Category.RUNTIME_FAILURE, reason)))
        with tempfile.TemporaryDirectory(prefix="mixprec-repair-") as tmp:
            path = Path(tmp) / "trial.onnx"
            # Written as the output is (the inferred types of intermediate values left out):
            # whether the runtime fails may depend on which shapes the file declares.
            save_model(model, path, external_data=wants_external_data(model), declared=trials.typed.declared)
            return not runs(path)

    logger.warning("%s; searching for the nodes to keep FP32", rejection)
    near = near_named_nodes(trials.model, trials.keys, outcome.error or "", converted)
    if near and not fails(frozenset(near)):
        # The runtime's error names a node: its neighbourhood held FP32 loads, so the culprits
        # are among those few (the rest stays converted).
        culprits = find_culprits(near, fails)
    else:
        culprits = find_culprits(converted, fails)
    if culprits.names is None:
        raise ValidationFailure(f"{rejection}; it fails even with every converted node FP32") from rejection
    planned, rewritten = trials.replan(dict.fromkeys(culprits.names, (Category.RUNTIME_FAILURE, reason)))
    note = (
        f"{'OpenVINO' if rejection.openvino else 'onnxruntime'} {what} the first conversion ({error}); kept {len(culprits.names)} node(s) "
        f"FP32 after {culprits.trials} trial conversion(s): {', '.join(culprits.names[:5])}"
        + (" ..." if len(culprits.names) > 5 else "")
    )
    return Repaired(planned, rewritten, culprits.names, note)


def _names(name: str, text: str) -> bool:
    """Whether `text` mentions the node `name` as a whole name (`Conv_1` is not in `Conv_12`)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None


def _neighbours(node: ir.Node) -> list[ir.Node]:
    """The producers of a node's inputs and the readers of its outputs."""
    found = [p for v in node.inputs if v is not None and (p := v.producer()) is not None]
    found += [use.node for out in node.outputs for use in out.uses()]
    return found


def near_named_nodes(model: ir.Model, keys: Mapping[ir.Node, str], error: str, converted: Sequence[str]) -> list[str]:
    """The converted nodes (keys, in `converted`'s order) within `NEAR_HOPS` edges of a
    main-graph node whose name the runtime's error mentions (a failing fused node is named
    after the node its pattern starts from); [] when it names none."""
    named = [node for node in model.graph if len(node.name) >= 3 and _names(node.name, error)]
    if not named:
        return []
    near: set[ir.Node] = set(named)
    frontier = list(named)
    for _ in range(NEAR_HOPS):
        reached = [other for node in frontier for other in _neighbours(node) if other not in near]
        near.update(reached)
        frontier = list(dict.fromkeys(reached))
    wanted = {keys[node] for node in near if node in keys}
    return [key for key in converted if key in wanted]
