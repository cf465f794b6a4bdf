"""The cost model on the search's data (:mod:`mixprec.analysis.cost_model`, shapes of the first batch):
FLOPs of the nodes, what keeping each FP32 costs on the runtime, and the FP32 share of a plan."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.shape_inference

from mixprec.analysis.cost_model import computes_elementwise, float_elements, flops_of, node_time
from mixprec.io import value_types
from mixprec.plan.estimate import BOUNDARIES
from mixprec.graphs import node_keys
from mixprec.plan.model import Precision, PrecisionPlan
from mixprec.policy.costs import RuntimeCost

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class NodeCosts:
    """Per node key: FLOPs (nodes with a formula and known shapes), and the estimated time that
    computing the node in FP32 instead of 16 bits adds on the runtime's device."""

    flops: dict[str, float]
    fp32_penalty: dict[str, float]


def node_costs(proto: onnx.ModelProto, batch: Mapping[str, np.ndarray], cost: RuntimeCost) -> NodeCosts:
    """The cost model on the shapes this batch gives the model's values."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    sizes: dict[str, int] = {}  # symbolic dimension -> the batch's size for it
    for value in model.graph.input:
        array = batch.get(value.name)
        if array is None or not value.type.HasField("tensor_type"):
            continue
        shape = value.type.tensor_type.shape
        for dim, size in zip(shape.dim, np.shape(array)):
            if dim.dim_param:
                sizes.setdefault(dim.dim_param, int(size))
        shape.ClearField("dim")
        for size in np.shape(array):
            shape.dim.add().dim_value = int(size)
    # Shape inference keeps the symbolic dims an exporter wrote into value_info: give them the
    # batch's sizes (a name is one size throughout the graph).
    for value in (*model.graph.value_info, *model.graph.output):
        if value.type.HasField("tensor_type"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param in sizes:
                    dim.dim_value = sizes[dim.dim_param]
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
        ir_model = value_types.deserialize(inferred)
    except Exception as e:  # noqa: BLE001 - shape inference raises assorted types
        logger.debug("shape inference for the cost model failed: %s", e)
        return NodeCosts({}, {})
    names = node_keys(ir_model)
    flops: dict[str, float] = {}
    penalty: dict[str, float] = {}
    for node, key in names.items():
        found = flops_of(node)
        if found is not None:
            flops[key] = found
        elements = float_elements(node, None)
        elementwise = computes_elementwise(node.domain, node.op_type)
        penalty[key] = node_time(elements, found, False, cost) - node_time(elements, found, True, cost, elementwise=elementwise)
    return NodeCosts(flops, penalty)


def fp32_share(plan: PrecisionPlan, flops: Mapping[str, float]) -> tuple[float, float | None]:
    """FP32 share of the nodes that compute floats (control-flow and function-call nodes aside,
    and those the runtime computes once, when it loads the model)."""
    names = plan.keys
    low = fp32 = 0
    low_flops = fp32_flops = 0.0
    known = False
    for node in plan.order:
        decision = plan.decisions[node]
        if decision.precision is Precision.NONE or decision.category in BOUNDARIES or node in plan.folded_nodes:
            continue
        cost = flops.get(names[node])
        if decision.precision is Precision.FP32:
            fp32 += 1
            fp32_flops += cost or 0.0
        else:
            low += 1
            low_flops += cost or 0.0
        known = known or cost is not None
    share = fp32 / (low + fp32) if low + fp32 else 0.0
    total = low_flops + fp32_flops
    return share, (fp32_flops / total if known and total > 0 else None)
