"""The conversion report as data: what runs in which precision, why, what it cost, how it
validated.

A :class:`Report` renders as JSON (machine) and as a text table (human); the HTML page is
:mod:`mixprec.report.html`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx_ir as ir

from mixprec.analysis.constants import constant_range
from mixprec.analysis.cost_model import CAST_BYTES_PER_ELEMENT, SYMBOLIC_DIM, cast_time
from mixprec.passes.functions import inlining_obstacle
from mixprec.plan.estimate import PlanEstimate, estimate_plan
from mixprec.report.quantized import QuantizedSummary, quantized_summary
from mixprec.validate.results import InputScale, OutputError, Validation, shape_text
from mixprec.graphs import has_subgraphs, walk_nodes
from mixprec.passes.rewrite import CastRecord, RewriteStats
from mixprec.passes.opset import first_opset_admitting, stranded_ops, stranding_note
from mixprec.plan.model import Category, Precision, PrecisionPlan, Storage
from mixprec.policy.costs import RuntimeCost, runtime_cost
from mixprec.policy.profiles import RuntimeProfile
from mixprec.policy.table import normalize_domain


@dataclass
class KeptNode:
    """A node that still computes in FP32, and why."""

    name: str
    op_type: str
    category: str
    reason: str


@dataclass
class NodeGraph:
    """Every planned node, compact and column-wise: entry ``i`` of each column is node ``i`` of
    the plan's topological order (function bodies, then the main graph; subgraph nodes before
    their owner). Used to draw the graph (:mod:`mixprec.report.layout`); about 60 bytes per node.

    Attributes:
        names: Node names ("" for unnamed nodes).
        op_types: Op types.
        precision: One letter per node: "l" 16-bit, "f" FP32, "n" no FP32 compute.
        category: Per node, an index into `categories`.
        reason: Per node, an index into `reasons`.
        inputs: Per node, the indices of the nodes producing its inputs (Casts inserted by the
            conversion are looked through), without repeats.
        categories: The distinct category texts.
        reasons: The distinct reason texts.
        constant: One letter per node: "1" when it computes only from constants (a Constant
            node, or one fed only by initializers and such nodes), else "0". The drawing folds
            these into their consumers. Empty when not known.
        constant_inputs: Per node, how many of its inputs are constants (initializers or outputs
            of constant nodes).
        cast_inputs: Per node, the entries of `inputs` whose value reaches it through a Cast
            inserted by the conversion; -1 for a model input or stored constant cast on its way in.
        cast_outputs: Per node, how many of its outputs leave the graph (as model outputs)
            through a Cast inserted by the conversion.
    """

    names: list[str]
    op_types: list[str]
    precision: str
    category: list[int]
    reason: list[int]
    inputs: list[list[int]]
    categories: list[str]
    reasons: list[str]
    constant: str = ""
    constant_inputs: list[int] = field(default_factory=list)
    cast_inputs: list[list[int]] = field(default_factory=list)
    cast_outputs: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class Report:
    """Everything mixprec did to one model."""

    source: str
    output: str | None
    target: str
    keep_io_types: bool
    nodes_by_precision: dict[str, int]
    low_by_op: dict[str, int]
    fp32_by_op: dict[str, int]
    fp32_by_category: dict[str, int]
    kept_fp32: list[KeptNode]
    casts_inserted: int
    casts_runtime: int
    cast_elements_per_inference: int | None
    cast_bytes_per_inference: int | None
    casts_removed: int
    constants_lowered: int
    constants_duplicated: int
    constants_kept_for_range: dict[str, str]
    weight_bytes_before: int
    weight_bytes_after: int
    type_inference_warning: str | None = None
    runtime: str = "onnx"
    notes: list[str] = field(default_factory=list)
    validation: Validation = field(default_factory=Validation)
    seconds: dict[str, float] = field(default_factory=dict)
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # CPU time of this process per step
    # Per-node listing for drawing; left out of to_dict()/to_json() unless asked for.
    graph: NodeGraph | None = field(default=None, repr=False, compare=False)
    # Estimates of the cost model (mixprec.analysis.cost_model): bytes the casts move per inference
    # with symbolic dimensions taken as `symbolic_dim`, and the share of the matrix and
    # convolution FLOPs that runs in 16 bits.
    cast_bytes_estimate: int | None = None
    low_compute_share: float | None = None
    symbolic_dim: int = SYMBOLIC_DIM
    # The cost model's time of the converted model against the FP32 one on the runtime's device
    # class (`cost_device`): FP32 time / converted time, casts included.
    estimated_speedup: float | None = None
    cost_device: str | None = None
    cost_limitation: str | None = None  # what the host lacks that 16-bit speed needs
    # QDQ models: Q/DQ nodes, the ops between them and the float ops outside (None otherwise).
    quantization: QuantizedSummary | None = None
    # FP32 nodes the runtime computes once, when it loads the model, from constants alone (a
    # weight dequantized from int8): no float compute per inference; counted apart, not listed.
    fp32_folded_at_load: int = 0
    # Casts of constants and of what the runtime folds when it loads the model: folded with them
    # (not in `casts_runtime`).
    casts_folded: int = 0

    def to_dict(self, *, include_graph: bool = False) -> dict[str, Any]:
        """JSON-ready form (`include_graph`: add the compact per-node listing)."""
        stored = self.__dict__.get("_graph")
        self.__dict__["_graph"] = None  # asdict() reads every field: neither copy nor build it
        try:
            data = asdict(self)
        finally:
            self.__dict__["_graph"] = stored
        if include_graph:
            graph = self.graph
            data["graph"] = asdict(graph) if graph is not None else None
        else:
            del data["graph"]
        return data

    def defer_graph(self, plan: PrecisionPlan) -> None:
        """Let `graph` be the listing of `plan` (:func:`node_graph`), built on first use: most
        conversions never draw it. The listing reads the plan and the rewritten model when first
        used; the pipeline never edits either after the report is built, and a caller that edits
        the converted model (`ConversionResult.model`) should read `graph` first."""
        self.__dict__["_graph"] = _PendingGraph(plan)

    def to_json(self, indent: int = 2) -> str:
        """JSON text."""
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def format_text(self, max_rows: int = 25) -> str:
        """A readable summary for the terminal."""
        lines = self._summary_lines()
        lines.extend(self._estimate_lines())
        lines.extend(self._breakdown_lines(max_rows))
        lines.extend(self._validation_lines())
        lines.extend(self._closing_lines())
        return "\n".join(lines)

    def _summary_lines(self) -> list[str]:
        """The header, node, weight and cast lines."""
        counts = self.nodes_by_precision
        # Integer kernels (QLinearConv, ...) read FP32 scales only: they are no float nodes.
        integer = self.fp32_by_category.get(Category.INTEGER_KERNEL.value, 0)
        folded = self.fp32_folded_at_load
        fp32 = counts.get("fp32", 0) - integer - folded
        total_float = counts.get("low", 0) + fp32
        share = 100.0 * counts.get("low", 0) / total_float if total_float else 0.0
        return [
            f"mixprec: {self.source} -> {self.output or '(in memory)'}  [{self.target}, "
            f"runtime {self.runtime}, keep_io_types={self.keep_io_types}]",
            f"  nodes: {counts.get('low', 0)} in {self.target}, {fp32} in fp32 "
            f"({share:.1f}% of float nodes converted), {counts.get('none', 0)} without FP32 compute"
            + (f", {integer} computing on integers (FP32 scales only)" if integer else "")
            + (f", {folded} computed from constants when the model loads" if folded else ""),
            f"  weights: {_mb(self.weight_bytes_before)} -> {_mb(self.weight_bytes_after)}"
            f"  ({self.constants_lowered} stored in {self.target}, "
            f"{self.constants_duplicated} duplicated)",
            f"  casts: {self.casts_runtime} at run time"
            + self._cast_traffic_text()
            + (f", {self.casts_folded} of constants folded when the model loads" if self.casts_folded else "")
            + f", {self.casts_removed} redundant removed",
        ]

    def _cast_traffic_text(self) -> str:
        """The bytes the casts move per inference, measured or estimated ("" when unknown)."""
        if self.cast_bytes_per_inference is not None:
            return f" ({_mb(self.cast_bytes_per_inference)} moved per inference)"
        if self.cast_bytes_estimate is not None:
            return (
                f" (about {_mb(self.cast_bytes_estimate)} moved per inference with named symbolic "
                f"dimensions taken as {self.symbolic_dim})"
            )
        return ""

    def _estimate_lines(self) -> list[str]:
        """The cost model's compute share and speed, and the quantization summary."""
        lines = []
        if self.low_compute_share is not None:
            lines.append(
                f"  compute: {self.low_compute_share:.1%} of the estimated matrix and convolution FLOPs "
                f"(ops of known shape) in {self.target}"
            )
        if self.estimated_speedup is not None:
            lines.append(
                f"  speed: about {self.estimated_speedup:.2f}x the FP32 model's speed on {self.cost_device} "
                "(cost model: traffic, matrix FLOPs and launches per op, casts included, dimensions "
                f"that are not static as {self.symbolic_dim}; an estimate, not a measurement)"
                + (f"; {self.cost_limitation}" if self.cost_limitation else "")
            )
        if self.quantization is not None:
            lines.append(self.quantization.format_line(self.target))
        return lines

    def _breakdown_lines(self, max_rows: int) -> list[str]:
        """Ops per precision, FP32 reasons, the FP32 nodes and constants kept for range."""
        lines = []
        if self.low_by_op:
            ops = ", ".join(f"{op} {n}" for op, n in sorted(self.low_by_op.items(), key=lambda x: -x[1]))
            lines.append(f"  {self.target} ops: {ops}")
        if self.fp32_by_category:
            cats = ", ".join(f"{c} {n}" for c, n in sorted(self.fp32_by_category.items(), key=lambda x: -x[1]))
            lines.append(f"  fp32 because: {cats}")
        if self.kept_fp32:
            lines.append("  fp32 nodes:")
            width = min(48, max(len(k.name) for k in self.kept_fp32[:max_rows]))
            for kept in self.kept_fp32[:max_rows]:
                lines.append(f"    {kept.name[:width]:<{width}}  {kept.op_type:<18} {kept.reason}")
            if len(self.kept_fp32) > max_rows:
                lines.append(f"    ... {len(self.kept_fp32) - max_rows} more (see --report)")
        for name, note in list(self.constants_kept_for_range.items())[:max_rows]:
            lines.append(f"  kept FP32 for range: {name}: {note}")
        return lines

    def _validation_lines(self) -> list[str]:
        """The checks run after conversion and the per-output errors."""
        v = self.validation
        lines = [
            f"  validation: checker {v.checker}, runtime {v.runtime} ({v.seconds:.2f} s)",
            f"  numerics: {v.numerics}",
        ]
        groups = [("emulated" if v.real_outputs else "", v.outputs)]
        if v.real_outputs:
            groups.append((f"real, {v.real_runtime}", v.real_outputs))
        for label, outputs in groups:
            lines.extend(_output_error_line(out, label) for out in outputs)
        for out in v.module_outputs:
            lines.append(
                f"    {out.name} (vs the PyTorch module, {v.module_batches} batch(es)): max abs "
                f"{out.max_abs_error:.3g}{_relative_text(out)}, nan {out.nan_count}, inf {out.inf_count}"
            )
        if v.speed_ratio is not None:
            lines.append(f"    latency on {v.real_runtime}: {v.speed_ratio:.2f}x the FP32 model's")
        if v.input_scales:
            lines.append(f"  input scale: {input_scale_text(v.input_scales, self.target)}")
            lines.extend(f"    {check.origin}" for check in v.input_scales if check.origin)
        return lines

    def _closing_lines(self) -> list[str]:
        """Notes, step times and the type inference warning."""
        lines = [f"  note: {n}" for n in [*self.notes, *self.validation.notes]]
        if self.seconds:
            steps = ", ".join(f"{name} {s:.2f}" for name, s in self.seconds.items() if name != "total")
            lines.append(f"  time: {self.seconds.get('total', 0.0):.2f} s ({steps})")
        if self.type_inference_warning:
            lines.append(f"  warning: type inference incomplete: {self.type_inference_warning}")
        return lines


def input_scale_text(checks: Sequence[InputScale], target: str) -> str:
    """E.g. "generated inputs (x) set to 0 (silence, a black image, padding): finite; scaled to
    |x| up to 255 (8-bit pixel values): finite; to 32767 (16-bit audio samples): inf/NaN where
    FP32 is finite; if real inputs ..." """
    names = checks[0].inputs
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    parts = []
    scaled = False  # "scaled to |x| up to" said once
    for check in checks:
        if check.magnitude == 0:
            what = "set to 0"
        else:
            what = f"{'to' if scaled else 'scaled to |x| up to'} {check.magnitude:g}"
            scaled = True
        parts.append(f"{what} ({check.meaning}): {_scale_outcome(check)}")
    text = f"generated inputs ({shown}) " + "; ".join(parts)
    zero = next((check for check in checks if check.finite is False and check.magnitude == 0), None)
    if zero is not None:
        where = "the node named below" if zero.origin and zero.ran else "the nodes where inf/NaN start"
        text += f"; if real inputs can be all zero, keep {where} FP32 (--exclude-node)"
    if any(check.finite is False and check.magnitude > 0 for check in checks):
        text += (
            f"; if real inputs are that large, pass --data with them: values beyond the {target} "
            "range then stay FP32"
        )
    return text


def _scale_outcome(check: InputScale) -> str:
    if check.finite is None:
        if check.magnitude == 0:
            return "not judged (FP32 is not finite there either, or does not run)"
        return "not judged (FP32 overflows there too, or does not run)"
    if check.finite:
        return "finite"
    return "inf/NaN where FP32 is finite" if check.ran else "the converted model fails where FP32 runs"


class _PendingGraph:
    """The plan a report's per-node listing is built from, until it is first read."""

    __slots__ = ("plan",)

    def __init__(self, plan: PrecisionPlan) -> None:
        self.plan = plan


def _get_graph(report: Report) -> NodeGraph | None:
    """`Report.graph`: the per-node listing, built now when deferred (:meth:`Report.defer_graph`)."""
    graph = report.__dict__.get("_graph")
    if isinstance(graph, _PendingGraph):
        graph = report.__dict__["_graph"] = node_graph(graph.plan)
    return graph


def _set_graph(report: Report, graph: NodeGraph | None) -> None:
    report.__dict__["_graph"] = graph


# A property over the dataclass field (the field keeps `graph` in __init__, fields() and asdict()).
Report.graph = property(_get_graph, _set_graph, doc="Per-node listing for drawing (None: none).")  # type: ignore[assignment]


def _relative_text(out: OutputError) -> str:
    """An output's error relative to the FP32 output's largest magnitude ("" when unknown)."""
    return "" if out.scaled_error is None else f" ({out.scaled_error:.2%} of max |FP32|)"


def _output_error_line(out: OutputError, label: str) -> str:
    """One output's agreement with the FP32 model (`label`: which run, "" for the only one)."""
    flag = "" if out.within_tolerance is None else ("  ok" if out.within_tolerance else "  OUT OF TOLERANCE")
    error = f"max abs {out.max_abs_error:.3g}{_relative_text(out)}" if out.shapes is None else shape_text(out.shapes)
    return f"    {out.name}{f' ({label})' if label else ''}: {error}, nan {out.nan_count}, inf {out.inf_count}{flag}"



def _mb(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e6:.2f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def build_report(
    *,
    model: ir.Model,
    plan: PrecisionPlan,
    stats: RewriteStats,
    source: str,
    output: str | None,
    weight_bytes_before: int,
    weight_bytes_after: int,
    type_inference_warning: str | None,
    profile: RuntimeProfile | None = None,
    notes: Sequence[str] = (),
    validation: Validation | None = None,
) -> Report:
    """Summarise a finished conversion (`profile`: the runtime it was converted for; `notes`:
    what the steps said; `validation`: what the checks found)."""
    target = plan.target
    counts = _count_decisions(plan)
    # Casts of constants, and of values folded when the model loads, are folded with them.
    runtime = [c for c in stats.casts if c.runtime and not c.of_constant]
    folded_casts = sum(1 for c in stats.casts if c.runtime and c.of_constant)
    elements, cast_bytes, cast_estimate = _cast_traffic(runtime)
    opset_note = _newer_opset_note(model, plan, profile)
    notes = [*([opset_note] if opset_note is not None else []), *notes]
    saturated_note = _saturated_note(plan)
    if saturated_note is not None:
        notes.append(saturated_note)
    cost = runtime_cost(profile.name if profile is not None else None, target.value)
    # Casts of stored constants are folded by the runtime when it loads the model: no time.
    estimate = estimate_plan(plan, [c.guessed_elements for c in runtime], cost)
    interface_note = _interface_casts_note(model, plan, runtime, estimate, cost) if plan.keep_io_types else None
    if interface_note is not None:
        notes.append(interface_note)
    report = Report(
        runtime=profile.name if profile is not None else "onnx",
        source=source,
        output=output,
        target=target.value,
        keep_io_types=plan.keep_io_types,
        nodes_by_precision={precision.value: n for precision, n in counts.by_precision.items()},
        low_by_op=dict(counts.low_by_op),
        fp32_by_op=dict(counts.fp32_by_op),
        fp32_by_category={category.value: n for category, n in counts.by_category.items()},
        kept_fp32=counts.kept,
        fp32_folded_at_load=counts.folded_fp32,
        casts_folded=folded_casts,
        casts_inserted=len(stats.casts),
        casts_runtime=len(runtime),
        cast_elements_per_inference=elements,
        cast_bytes_per_inference=cast_bytes,
        casts_removed=stats.removed_casts,
        constants_lowered=stats.constants_lowered,
        constants_duplicated=stats.constants_duplicated,
        constants_kept_for_range={v.name or "": note for v, note in plan.constant_notes.items()},
        weight_bytes_before=weight_bytes_before,
        weight_bytes_after=weight_bytes_after,
        type_inference_warning=type_inference_warning,
        notes=notes,
        cast_bytes_estimate=cast_estimate,
        low_compute_share=estimate.low_flops_share,
        estimated_speedup=round(estimate.speedup, 3) if estimate.speedup is not None else None,
        cost_device=cost.device,
        cost_limitation=cost.limitation,
        quantization=quantized_summary(plan),
        validation=validation if validation is not None else Validation(),
    )
    report.defer_graph(plan)
    return report


@dataclass
class _DecisionCounts:
    """A plan's decisions counted by precision, op type and FP32 category (by enum member, a str
    hashed as its value, reported by value), and the FP32 nodes listed in the report."""

    by_precision: Counter[Precision] = field(default_factory=Counter)
    low_by_op: Counter[str] = field(default_factory=Counter)
    fp32_by_op: Counter[str] = field(default_factory=Counter)
    by_category: Counter[Category] = field(default_factory=Counter)
    kept: list[KeptNode] = field(default_factory=list)
    folded_fp32: int = 0  # FP32 nodes the runtime folds when it loads the model (not in the others)


def _count_decisions(plan: PrecisionPlan) -> _DecisionCounts:
    """Count the plan's decisions in plan order."""
    counts = _DecisionCounts()
    for node in plan.order:
        decision = plan.decisions[node]
        precision = decision.precision
        counts.by_precision[precision] += 1
        if precision is Precision.LOW:
            counts.low_by_op[node.op_type] += 1
        elif precision is Precision.FP32 and node in plan.folded_nodes:
            counts.folded_fp32 += 1
        elif precision is Precision.FP32:
            category = decision.category
            counts.fp32_by_op[node.op_type] += 1
            counts.by_category[category] += 1
            if category not in (Category.NO_FLOAT, Category.INTEGER_KERNEL):
                counts.kept.append(KeptNode(plan.keys[node], node.op_type, category.value, decision.reason))
    return counts


# Casts made for the model's FP32 inputs and outputs alone are pointed out from this share of the
# estimated time on.
_INTERFACE_SHARE = 0.2


def _interface_casts_note(
    model: ir.Model, plan: PrecisionPlan, runtime: list[CastRecord], estimate: PlanEstimate, cost: RuntimeCost
) -> str | None:
    """Where the Casts made for the model's FP32 inputs and outputs alone (a decoder's key/value
    cache, read and written at every step) take much of the estimated time: their share, and
    the option that gives the model 16-bit inputs and outputs. A cast of an input that nodes
    also read in FP32 does not count: with a 16-bit input it would only change direction."""
    read_in_fp32 = {
        value.name for value in model.graph.inputs
        if any(consumer in plan.decisions and index not in plan.facts[consumer].flexible for consumer, index in value.uses())
    }
    interface = [c for c in runtime if c.at_interface and not c.of_constant and c.value not in read_in_fp32]
    if not interface or estimate.time <= 0:
        return None
    share = sum(cast_time(c.guessed_elements or 0, cost) for c in interface) / estimate.time
    if share < _INTERFACE_SHARE:
        return None
    names = ", ".join(c.value for c in interface[:3]) + (f" and {len(interface) - 3} more" if len(interface) > 3 else "")
    count = sum(1 for c in runtime if not c.of_constant)
    return (
        f"{len(interface)} of the {count} run-time casts only convert the model's FP32 inputs and outputs "
        f"({names}) and take {share:.0%} of the estimated time; --io-16bit (keep_io_types=False) gives the "
        f"model {plan.target.value} inputs and outputs instead, which the caller then feeds and reads"
    )


def _cast_traffic(runtime: list[CastRecord]) -> tuple[int | None, int | None, int | None]:
    """Elements and bytes the run-time casts move per inference (None unless every cast's count
    is known), and the bytes estimated with symbolic dimensions guessed."""
    known = [c.elements for c in runtime]
    elements = sum(e for e in known if e is not None) if runtime and all(e is not None for e in known) else None
    cast_bytes = None
    if elements is not None:
        cast_bytes = sum((c.elements or 0) * CAST_BYTES_PER_ELEMENT for c in runtime)
    estimates = [c.estimated_elements for c in runtime]
    cast_estimate = (
        sum(e * CAST_BYTES_PER_ELEMENT for e in estimates if e is not None)
        if all(e is not None for e in estimates) else None
    )
    return elements, cast_bytes, cast_estimate


def _saturated_note(plan: PrecisionPlan) -> str | None:
    """The constants beyond the 16-bit range stored at its largest finite magnitude, where every
    reader gives the same result with it (a clip bound, an attention mask fill)."""
    target = plan.target
    names = sorted(
        v.name or "" for v in plan.saturated
        if _stored_low(plan, v) and (rng := constant_range(v, target)) is not None and rng.overflow
    )
    if not names:
        return None
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (
        f"{len(names)} constant(s) beyond the {target.value} range stored at its largest finite "
        f"magnitude ({target.limits.max:g}), where their readers give the same result with it "
        f"(a clip bound; an attention mask fill: masked keys keep a softmax weight of 0, only a row "
        f"whose every key is masked, as at padded positions, comes out otherwise): {shown}"
    )


def _stored_low(plan: PrecisionPlan, value: ir.Value) -> bool:
    """Whether a constant is stored in the 16-bit type (an initializer, or a Constant node's)."""
    if plan.storage.get(value) in (Storage.LOW, Storage.BOTH):
        return True
    producer = value.producer()
    decision = plan.decisions.get(producer) if producer is not None else None
    return decision is not None and producer.op_type == "Constant" and decision.precision is Precision.LOW


def _newer_opset_note(model: ir.Model, plan: PrecisionPlan, profile: RuntimeProfile | None) -> str | None:
    """A note when FP32 nodes of the default domain would admit the target type at a later opset."""
    target = plan.target
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    newer = [
        version
        for node in plan.order
        if plan.decisions[node].category is Category.SCHEMA and normalize_domain(node.domain) == ""
        and (profile is None or profile.runs_in("", node.op_type, target.type_str))
        and (version := first_opset_admitting(node.op_type, opset, target.type_str)) is not None
    ]
    if not newer:
        return None
    version = max(newer)
    stranded = stranded_ops(model, version, profile) if profile is not None else []
    if model.functions:
        obstacle = inlining_obstacle(model)
        advice = (
            f"but the ONNX version converter drops local functions, and they cannot be inlined: {obstacle}"
            if obstacle is not None else
            "convert with --inline-functions: the ONNX version converter, which upgrades a model, drops local functions"
        )
    elif stranded and profile is not None:
        advice = f"but {stranding_note(stranded, version, profile)}"
    else:
        advice = f"convert with --opset {version}"
    return (
        f"{len(newer)} node(s) have no {target.value} type in their schema at opset {opset}; "
        f"opset {version} admits them ({advice})"
    )


def node_graph(plan: PrecisionPlan) -> NodeGraph:
    """The compact per-node listing of a plan (call after the rewrite or before: inserted Casts
    are looked through)."""
    index = {node: i for i, node in enumerate(plan.order)}
    keys = plan.keys
    letters = {Precision.LOW: "l", Precision.FP32: "f", Precision.NONE: "n"}
    categories: dict[Category, int] = {}
    reasons: dict[str, int] = {}
    names, op_types, precision, category, reason, inputs = [], [], [], [], [], []
    constant: list[bool] = []
    constant_inputs: list[int] = []
    cast_inputs: list[list[int]] = []
    cast_outputs: list[int] = []
    cast_to_output = _cast_to_model_output(plan, index)
    for node in plan.order:
        decision = plan.decisions[node]
        names.append(keys[node])
        op_types.append(node.op_type)
        precision.append(letters[decision.precision])
        category.append(categories.setdefault(decision.category, len(categories)))
        reason.append(reasons.setdefault(decision.reason, len(reasons)))
        preds, cast_from, constants, only_constants = _node_inputs(node, index, constant)
        inputs.append(preds)
        constant.append(only_constants)
        constant_inputs.append(constants)
        cast_inputs.append(cast_from)
        cast_outputs.append(sum(value in cast_to_output for value in node.outputs))
    return NodeGraph(
        names, op_types, "".join(precision), category, reason, inputs,
        categories=[c.value for c in categories], reasons=list(reasons),
        constant="".join("1" if c else "0" for c in constant),
        constant_inputs=constant_inputs, cast_inputs=cast_inputs, cast_outputs=cast_outputs,
    )


def _node_inputs(
    node: ir.Node, index: dict[ir.Node, int], constant: list[bool]
) -> tuple[list[int], list[int], int, bool]:
    """Where `node`'s inputs come from, given the planned nodes' `index` and the constant flags
    of the nodes listed so far: its producers (planned node indices, each once), the sources of
    inputs reached through an inserted Cast (-1 for a model input or stored value), how many
    inputs are constant, and whether all are (never for a node with subgraphs)."""
    preds: list[int] = []
    cast_from: list[int] = []
    constants = 0
    only_constants = not has_subgraphs(node)
    for value in node.inputs:
        if value is None:
            continue
        source, through_cast, stored = _trace_input(value, index)
        if source is not None and source not in preds:
            preds.append(source)
        origin = -1 if source is None else source
        if through_cast and origin not in cast_from:
            cast_from.append(origin)
        if stored or _listed_constant(source, constant):
            constants += 1
        else:
            only_constants = False
    return preds, cast_from, constants, only_constants


def _listed_constant(source: int | None, constant: list[bool]) -> bool:
    """Whether planned node `source` is already listed as constant. A source later in the order
    (reached through a Cast the rewrite shared) is not known to be constant yet: it counts as
    computed."""
    return source is not None and source < len(constant) and constant[source]


def _trace_input(value: ir.Value, index: dict[ir.Node, int]) -> tuple[int | None, bool, bool]:
    """Where input `value` comes from, through nodes the rewrite inserted: the planned node
    producing it (or None), whether an inserted Cast sits on the way, and whether it is a stored
    constant (an initializer that is not a model input, or an inserted Constant)."""
    through_cast = False
    current: ir.Value | None = value
    for _ in range(4):
        producer = current.producer() if current is not None else None
        if producer is None:
            stored = (
                current is not None and current.is_initializer() and not current.is_graph_input()
            )
            return None, through_cast, stored
        found = index.get(producer)
        if found is not None:
            return found, through_cast, False
        if producer.op_type == "Constant" and not producer.inputs:
            return None, through_cast, True
        through_cast = through_cast or producer.op_type == "Cast"
        current = producer.inputs[0] if producer.inputs else None
    return None, through_cast, False


def _cast_to_model_output(plan: PrecisionPlan, index: dict[ir.Node, int]) -> set[ir.Value]:
    """The values an inserted Cast turns into an output of their graph."""
    found: set[ir.Value] = set()
    for graph in plan.graphs:
        for out in graph.outputs:
            producer = out.producer()
            if producer is not None and producer not in index and producer.op_type == "Cast" and producer.inputs:
                source = producer.inputs[0]
                if source is not None:
                    found.add(source)
    return found


def count_nodes(model: ir.Model) -> int:
    """Nodes in the model, subgraphs included."""
    return sum(1 for _ in walk_nodes(model.graph))
