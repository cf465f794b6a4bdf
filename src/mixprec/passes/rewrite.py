"""Apply a :class:`~mixprec.plan.model.PrecisionPlan` to the model it was made for.

Rewrite rules, in the order they run:

1. Every FP32 value produced by a 16-bit node, and (without `keep_io_types`) every FP32 model
   input, becomes 16-bit.
2. Ops whose output type is an attribute and that were lowered get the attribute retargeted
   (`Cast.to`, `EyeLike`/`Random*` `dtype`, the tensor of `Constant`/`ConstantOfShape`).
3. FP32 constants used only by 16-bit compute are stored in the 16-bit type (cast lazily at save,
   read in chunks); constants used by both get a 16-bit copy when small, else one Cast.
4. Wherever a consumer needs another type than its input has, it reads the output of a Cast;
   there is at most one Cast per (value, type), shared by every consumer, placed right after the
   producer in the producer's graph (so subgraphs can read it from the outer scope).
5. Graph outputs get their required type (FP32 with `keep_io_types`; subgraph outputs always keep
   theirs) through a Cast that takes over the output's name.
6. Casts made redundant (a Cast to the type its input already has) are removed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Set
from dataclasses import dataclass, field, replace

import numpy as np
import onnx_ir as ir

from mixprec.analysis.constants import constant_tensor, is_constant, iter_chunks, read_array
from mixprec.analysis.cost_model import estimated_elements, guessed_elements, tensor_elements
from mixprec.plan.model import Precision, PrecisionPlan, Storage
from mixprec.dtypes import LowPrecision, is_fp32_tensor
from mixprec.graphs import FreshNames, keep_structure, static_shape
from mixprec.io.views import float32_values

logger = logging.getLogger(__name__)

FLOAT = ir.DataType.FLOAT
# Shared constants up to this many bytes are duplicated in 16 bits instead of cast at run time.
_DUPLICATE_MAX_BYTES = 64 * 1024
# Weights of at most this many elements are cast whole (larger ones in bounded chunks).
_WHOLE_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class CastRecord:
    """One Cast inserted by the rewrite."""

    value: str
    to: str
    elements: int | None
    runtime: bool  # False: the cast was done offline on a constant
    estimated_elements: int | None = None  # named symbolic dimensions estimated (analysis.cost_model)
    guessed_elements: int | None = None  # every dimension that is not static guessed (analysis.cost_model)
    of_constant: bool = False  # a Cast of a constant, or of a value folded when loaded: folded when loaded
    at_interface: bool = False  # made for the main graph's FP32 inputs or outputs alone (keep_io_types)


@dataclass
class RewriteStats:
    """What the rewrite did."""

    casts: list[CastRecord] = field(default_factory=list)
    removed_casts: int = 0
    retargeted: list[str] = field(default_factory=list)
    constants_lowered: int = 0
    constants_duplicated: int = 0


def cast_tensor_lazily(
    tensor: ir.TensorProtocol, target: LowPrecision, *, saturate: bool = False, name: str | None = None
) -> ir.LazyTensor:
    """A lazy 16-bit copy of an FP32 tensor, converted in chunks when it is first read."""
    shape = tuple(int(d) for d in tensor.shape)
    load = _CastLoad(tensor, target, saturate, shape, name or tensor.name)
    return ir.LazyTensor(load, dtype=target.ir_dtype, shape=static_shape(shape), name=name or tensor.name)


def _same_shape(shape: ir.Shape | None) -> ir.Shape | None:
    """The shape for a value of the same shape: a frozen one is shared (values share them
    already, see `typeinfo`), a mutable one copied."""
    if shape is None or shape.frozen:
        return shape
    return shape.copy()


class _CastLoad:
    """The function of a lazy 16-bit copy: one small object per weight (a closure costs a
    function and a cell per captured name, ~0.5 kB on each of tens of thousands of weights)."""

    __slots__ = ("name", "saturate", "shape", "target", "tensor")

    def __init__(
        self, tensor: ir.TensorProtocol, target: LowPrecision, saturate: bool, shape: tuple[int, ...], name: str | None
    ) -> None:
        self.tensor, self.target, self.saturate, self.shape, self.name = tensor, target, saturate, shape, name

    def __call__(self) -> ir.TensorProtocol:
        return ir.Tensor(self.array(), name=self.name)

    def tobytes(self) -> bytes:
        """The 16-bit copy's bytes in this machine's order (a writer's fast path on
        little-endian machines: no tensor object for each of tens of thousands of small weights)."""
        return self.array().tobytes()

    def array(self) -> np.ndarray:
        """The 16-bit copy as an array."""
        limit = self.target.limits.max
        if math.prod(self.shape) <= _WHOLE_ELEMENTS:  # the common small weight: one read, one cast
            tensor = self.tensor
            inline_float = tensor.dtype == ir.DataType.FLOAT and not isinstance(tensor, ir.ExternalTensor)
            whole = float32_values(tensor) if inline_float else read_array(tensor)
            if self.saturate:
                whole = np.clip(whole, -limit, limit)
            return whole.astype(self.target.numpy_dtype).reshape(self.shape)
        out = np.empty(math.prod(self.shape), dtype=self.target.numpy_dtype)
        offset = 0
        for chunk in iter_chunks(self.tensor):
            if self.saturate:
                chunk = np.clip(chunk, -limit, limit)
            out[offset : offset + chunk.size] = chunk.astype(out.dtype)
            offset += chunk.size
        return out.reshape(self.shape)


class _Rewriter:
    def __init__(self, model: ir.Model, plan: PrecisionPlan) -> None:
        self.model = model
        self.plan = plan
        self.target = plan.target
        self.low = plan.target.ir_dtype
        self.stats = RewriteStats()
        self.cache: dict[tuple[ir.Value, ir.DataType], ir.Value] = {}
        self.created: set[ir.Value] = set()  # outputs of the Casts this rewrite inserted
        order = plan.order
        nodes: set[str | None] = {node.name for node in order}
        values: set[str | None] = {v.name for node in order for v in node.outputs}
        for graph in plan.graphs:
            values.update([v.name for v in graph.inputs])
            values.update(graph.initializers)
        nodes.discard(None)
        nodes.discard("")
        values.discard(None)
        values.discard("")
        self.value_names, self.node_names = FreshNames(values), FreshNames(nodes)  # type: ignore[arg-type]
        # FP32 values of the original model (as the planner read them, when it did), and which
        # of them end up 16-bit.
        self.fp32: Set[ir.Value] = plan.fp32 if plan.fp32 is not None else _fp32_values(plan)
        self.lowered: set[ir.Value] = set()

    # -- analysis of final types ----------------------------------------------------------
    def _collect_lowered(self) -> None:
        """The values that end up 16-bit: model inputs (without `keep_io_types`), constants
        stored in 16 bits and the lowered outputs of 16-bit nodes."""
        plan, fp32 = self.plan, self.fp32
        if not plan.keep_io_types:
            self.lowered.update(v for v in self.model.graph.inputs if v in fp32)
        for value, storage in plan.storage.items():
            if storage is Storage.LOW and value.const_value is not None:
                self.lowered.add(value)
        decisions, lowered = plan.decisions, self.lowered
        for node in plan.order:
            if decisions[node].precision is not Precision.LOW:
                continue
            for index, out in enumerate(node.outputs):
                if out in fp32 and plan.output_is_lowered(node, index):
                    lowered.add(out)

    # -- casts ----------------------------------------------------------------------------
    def cast_of(self, value: ir.Value, dtype: ir.DataType) -> ir.Value:
        value = _through_noop_casts(value)  # Rule 6 removes them: cast their input instead
        key = (value, dtype)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        short = "fp32" if dtype == FLOAT else self.target.short_name
        base = value.name or "value"
        tensor = constant_tensor(value) if is_constant(value) else None
        if tensor is not None and dtype == self.low and tensor.nbytes <= _DUPLICATE_MAX_BYTES:
            copy = self._duplicate_constant(value, tensor, f"{base}_{short}")
            if copy is not None:
                self.stats.constants_duplicated += 1
                self.stats.casts.append(CastRecord(base, short, tensor.size, runtime=False))
                self.cache[key] = copy
                return copy
        out = ir.Value(
            name=self.value_names(f"{base}_{short}"),
            type=ir.TensorType(dtype),
            shape=_same_shape(value.shape),
        )
        node = ir.Node(
            "",
            "Cast",
            [value],
            attributes=[ir.AttrInt64("to", dtype)],
            outputs=[out],
            name=self.node_names(f"{base}_cast_{short}"),
        )
        self._place_after_definition(value, node)
        self.stats.casts.append(
            CastRecord(
                base, short, tensor_elements(value.shape), runtime=True,
                estimated_elements=estimated_elements(value.shape), guessed_elements=guessed_elements(value.shape),
                of_constant=tensor is not None or value in self.plan.folded,
                at_interface=value.is_graph_input() and value.graph is self.model.graph and value.const_value is None,
            )
        )
        self.cache[key] = out
        self.created.add(out)
        return out

    def _duplicate_constant(self, value: ir.Value, tensor: ir.TensorProtocol, name: str) -> ir.Value | None:
        """A 16-bit copy of a small shared constant, instead of a Cast at run time."""
        array = cast_tensor_lazily(tensor, self.target, saturate=value in self.plan.saturated).numpy()
        copy_tensor = ir.Tensor(array, name=self.value_names(name))
        if value.const_value is not None and value.graph is not None:
            copy = ir.Value(
                name=copy_tensor.name,
                type=ir.TensorType(self.low),
                shape=ir.Shape(tensor.shape),
                const_value=copy_tensor,
            )
            value.graph.register_initializer(copy)
            return copy
        producer = value.producer()
        if producer is None or producer.graph is None:
            return None
        copy = ir.Value(name=copy_tensor.name, type=ir.TensorType(self.low), shape=ir.Shape(tensor.shape))
        node = ir.Node(
            "",
            "Constant",
            [],
            attributes=[ir.AttrTensor("value", copy_tensor)],
            outputs=[copy],
            name=self.node_names(f"{copy_tensor.name}_constant"),
        )
        producer.graph.insert_after(producer, node)
        return copy

    def _seed_cache_with_existing_casts(self) -> None:
        """The model's own Casts between FP32 and the 16-bit type (as they stand after
        retargeting) serve as the shared Cast of their input to that type; not one whose output
        nothing reads (it would become the input of nodes that never read it, and converting
        the result again would decide them differently)."""
        for node in self.plan.order:
            if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or not node.inputs:
                continue
            source, out = node.inputs[0], node.outputs[0]
            if not out.uses() and not out.is_graph_output():
                continue
            to = node.attributes.get("to")
            if source is None or to is None or source not in self.fp32:
                continue
            dtype = ir.DataType(to.as_int())
            # FP32 -> 16-bit (a retargeted Cast of an FP32 value) or 16-bit -> FP32.
            if dtype != ({FLOAT, self.low} - {self._actual(source)}).pop() or (source, dtype) in self.cache:
                continue
            if (out in self.lowered) != (dtype == self.low):
                continue
            producer = source.producer()
            home = producer.graph if producer is not None else source.graph
            if home is None or node.graph is not home:
                continue
            # Move it next to its input so that every consumer of the input can use it.
            home.remove(node)
            self._place_after_definition(source, node)
            self.cache[(source, dtype)] = out

    def _place_after_definition(self, value: ir.Value, node: ir.Node) -> None:
        """Insert `node` right after the producer of `value` (or first, for graph inputs)."""
        producer = value.producer()
        if producer is not None and producer.graph is not None:
            producer.graph.insert_after(producer, node)
            return
        graph = value.graph or self.model.graph
        first = next(iter(graph), None)
        if first is None:
            graph.append(node)
        else:
            graph.insert_before(first, node)

    def _actual(self, value: ir.Value) -> ir.DataType:
        return self.low if value in self.lowered else FLOAT

    # -- rewrite steps ------------------------------------------------------------------
    def _retarget(self, node: ir.Node) -> None:
        """Rule 2: ops whose output type is an attribute."""
        facts = self.plan.facts[node]
        rule = facts.rule
        if rule is None or rule.dtype_attribute is None:
            return
        decision = self.plan.decisions[node]
        attr_name = rule.dtype_attribute
        if decision.precision is not Precision.LOW:
            if attr_name == "dtype":
                self._keep_fp32_dtype(node)
            return
        if attr_name in ("to", "dtype"):
            node.attributes[attr_name] = ir.AttrInt64(attr_name, self.low)
        elif node.op_type == "Constant":
            if not self._lower_constant_node(node):
                return
        else:  # ConstantOfShape
            self._lower_fill_value(node)
        self.stats.retargeted.append(node.name or node.op_type)

    def _keep_fp32_dtype(self, node: ir.Node) -> None:
        """Keep an FP32 node's output FP32 (an explicit `dtype`) even where it followed an input
        that is now 16-bit."""
        source = node.inputs[0] if node.inputs else None
        if (
            node.outputs
            and is_fp32_tensor(node.outputs[0])
            and node.attributes.get("dtype") is None
            and source is not None
            and source in self.lowered
        ):
            node.attributes["dtype"] = ir.AttrInt64("dtype", FLOAT)

    def _lower_constant_node(self, node: ir.Node) -> bool:
        """Store a Constant node's tensor in the 16-bit type; False when it has none to read."""
        tensor = constant_tensor(node.outputs[0])
        if tensor is None:
            return False
        saturate = node.outputs[0] in self.plan.saturated
        array = np.asarray(cast_tensor_lazily(tensor, self.target, saturate=saturate).numpy())
        node.attributes.clear()
        node.attributes["value"] = ir.AttrTensor("value", ir.Tensor(array, name=tensor.name))
        self.stats.constants_lowered += 1  # a weight held in a Constant node
        return True

    def _lower_fill_value(self, node: ir.Node) -> None:
        """Give a ConstantOfShape node its fill value (zero when absent) in the 16-bit type."""
        attr = node.attributes.get("value")
        fill = attr.as_tensor().numpy() if attr is not None else np.zeros([1], np.float32)
        node.attributes["value"] = ir.AttrTensor(
            "value", ir.Tensor(np.asarray(fill).astype(self.target.numpy_dtype))
        )

    def _lower_constants(self) -> None:
        """Rule 3."""
        for value, storage in self.plan.storage.items():
            if storage is not Storage.LOW or value.const_value is None:
                continue
            value.const_value = cast_tensor_lazily(
                value.const_value, self.target, saturate=value in self.plan.saturated, name=value.name
            )
            value.type = ir.TensorType(self.low)  # a new type object: a copy of the model may share the old one
            self.stats.constants_lowered += 1

    def _fix_inputs(self, node: ir.Node) -> None:
        """Rule 4: each FP32 input gets the type the plan computes it in (flexible inputs are
        taken as they are where the schema admits the 16-bit type)."""
        fp32, lowered, low, plan = self.fp32, self.lowered, self.low, self.plan
        facts = plan.facts.get(node)
        sig = facts.sig if facts is not None else None
        input_vars = sig.input_vars if sig is not None else ()
        lowered_vars = plan.lowered_vars[node] if facts is not None and plan.decisions[node].precision is Precision.LOW else ()
        for index, value in enumerate(node.inputs):
            if value is None or value not in fp32:
                continue
            var = input_vars[index] if index < len(input_vars) else None
            if facts is None:
                required = FLOAT
            elif index in facts.flexible:
                if var is None or self.target.type_str in sig.allowed.get(var, ()):  # type: ignore[union-attr]
                    continue  # takes its input as it is
                required = FLOAT
            else:
                required = low if var is not None and var in lowered_vars else FLOAT
            if (low if value in lowered else FLOAT) != required:
                node.replace_input_with(index, self.cast_of(value, required))

    def _fix_outputs(self, graph: ir.Graph, required: ir.DataType) -> None:
        """Rule 5."""
        for position, value in enumerate(list(graph.outputs)):
            if value is None or value not in self.fp32 or self._actual(value) == required:
                continue
            name = value.name
            made = len(self.stats.casts)  # a record added from here on is a Cast made for this output
            cast = self.cast_of(value, required)
            if cast not in self.created or cast.is_graph_output():
                # The shared Cast is the model's own or already names an output: this output
                # gets a Cast of its own.
                del self.cache[(value, required)]
                made = len(self.stats.casts)
                cast = self.cast_of(value, required)
            if cast.producer() is None:
                continue
            if len(self.stats.casts) > made and graph is self.model.graph:
                self.stats.casts[-1] = replace(self.stats.casts[-1], at_interface=True)  # made for this output alone
            # The Cast's output takes over the model-facing name.
            value.name = self.value_names(f"{name}_{self.target.short_name if value in self.lowered else 'fp32'}")
            cast.name = name
            graph.outputs[position] = cast

    def _remove_noop_casts(self) -> None:
        """Rule 6."""
        for node in self.plan.order:
            if not _is_noop_cast(node):
                continue
            source, out = node.inputs[0], node.outputs[0]
            out.replace_all_uses_with(source)
            if node.graph is not None:
                node.graph.remove(node, safe=True)
            self.stats.removed_casts += 1

    def _ensure_default_opset(self) -> None:
        """Inserted Casts live in the default domain; models of other domains may lack it."""
        if not self.stats.casts:
            return
        default = 13 if self.model.ir_version >= 7 else 9
        if "" not in self.model.opset_imports and "ai.onnx" not in self.model.opset_imports:
            self.model.opset_imports[""] = default
        for function in self.model.functions.values():
            if "" not in function.opset_imports and "ai.onnx" not in function.opset_imports:
                function.opset_imports[""] = self.model.opset_imports.get("", default)

    def run(self) -> RewriteStats:
        self._collect_lowered()
        plan = self.plan
        for node in plan.order:
            self._retarget(node)
        self._lower_constants()
        for value in self.lowered:
            if value.const_value is None:
                value.type = ir.TensorType(self.low)  # a new type object: a copy of the model may share the old one
            elif value.is_graph_input() and value.dtype == FLOAT:
                # An overridable initializer of a model whose inputs become 16-bit.
                value.const_value = cast_tensor_lazily(value.const_value, self.target, name=value.name)
                value.type = ir.TensorType(self.low)  # a new type object: a copy of the model may share the old one
        self._seed_cache_with_existing_casts()
        for node in plan.order:
            self._fix_inputs(node)
        self._fix_outputs(self.model.graph, FLOAT if plan.keep_io_types else self.low)
        for graph in plan.graphs[1:]:
            self._fix_outputs(graph, FLOAT)
        self._remove_noop_casts()
        self._ensure_default_opset()
        for graph in plan.graphs:
            keep_structure(graph)  # only Casts and Constants were added or removed: no subgraph owners
        return self.stats


def _fp32_values(plan: PrecisionPlan) -> set[ir.Value]:
    """The FP32 graph inputs, initializers and node inputs and outputs of the plan's model (for
    a plan that does not carry the planner's)."""
    fp32: set[ir.Value] = set()
    seen: set[ir.Value] = set()
    for graph in plan.graphs:
        for value in (*graph.inputs, *graph.initializers.values()):
            if is_fp32_tensor(value):
                fp32.add(value)
    for node in plan.order:
        for value in node.outputs:  # each output once: its own type is read once
            if is_fp32_tensor(value):
                fp32.add(value)
    for node in plan.order:
        for value in node.inputs:  # outer-scope and graph-input values not seen yet
            if value is not None and value not in fp32 and value not in seen:
                seen.add(value)
                if is_fp32_tensor(value):
                    fp32.add(value)
    return fp32


def _is_noop_cast(node: ir.Node) -> bool:
    """A Cast to its input's own type (removable unless its output is a graph output)."""
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or not node.inputs:
        return False
    source, to = node.inputs[0], node.attributes.get("to")
    if source is None or to is None or source.dtype is None or source.dtype != ir.DataType(to.as_int()):
        return False
    return not node.outputs[0].is_graph_output()


def _through_noop_casts(value: ir.Value) -> ir.Value:
    producer = value.producer()
    while producer is not None and _is_noop_cast(producer):
        value = producer.inputs[0]  # type: ignore[assignment]
        producer = value.producer()
    return value


def apply_plan(model: ir.Model, plan: PrecisionPlan) -> RewriteStats:
    """Rewrite `model` in place according to `plan` (made for this very model object)."""
    return _Rewriter(model, plan).run()
