"""Precision planning: decide, for every node, whether it computes in the 16-bit type.

The planner is pure analysis: it reads a typed model (see :mod:`mixprec.analysis.typeinfo`) and
returns a :class:`PrecisionPlan`; it never edits the model. Decisions follow a small lattice over
FP32 values:

* ``LOW``  the value is produced in the 16-bit type;
* ``HIGH`` the value stays FP32;
* ``WIDE`` the value stays FP32 and may hold values the 16-bit type cannot represent
  (out-of-range constants and what data movement makes of them): it is never narrowed;
* ``TINY`` the value's meaningful values flush to zero in the 16-bit type (a constant, a value
  measured on data, or data movement of those). A flushed element is at most half the smallest
  subnormal, within the rounding of a 16-bit sum: a node that only adds it (the
  ``additive_inputs`` op fact: a bias, a summand) converts as if it were not there. Any other
  reader computes in FP32, and the FP32 ends there: data movement passes ``TINY`` on, and the
  output of a product (``scaling_inputs``) of values that fit is small enough for its 16-bit
  readers to take a Cast of it;
* ``FLEX`` the value can be had in either type without extra error (constants, graph inputs,
  tensors generated from attributes, and follow ops over those): its consumers decide.

A forward pass in topological order (subgraphs before the node that owns them) decides every
node from the states of its inputs by the first of the rules of :mod:`mixprec.plan.rules` that
decides it, so decisions do not depend on visit order; a backward pass then resolves ``FLEX``
producers from what their consumers need; the cast placement (:mod:`mixprec.plan.placement`)
then re-decides the follow nodes of each FP32 island by cast cost.

Each node's schema binds its inputs and outputs to type variables; converting a node lowers the
type variables that are FP32 and admit the 16-bit type at the node's opset, except pinned ones.

The plan's data types are in :mod:`mixprec.plan.model`, what the planner knows of ops in
:mod:`mixprec.plan.templates`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx_ir as ir

from mixprec.analysis.constants import (
    FLUSH_WORDS, ConstantRange, constant_range, constant_ranges, is_constant, overflows_only_below,
)
from mixprec.analysis.norm_bounds import affine_bound, output_bound
from mixprec.analysis.qdq import quantizes_float_chain
from mixprec.dtypes import is_fp32_tensor
from mixprec.graphs import (
    all_nodes,
    default_domain_version,
    function_graphs,
    is_default_domain,
    subgraphs_of,
    unique_names,
)
from mixprec.plan.load_folding import LoadFolding
from mixprec.plan.model import Category, Decision, NodeFacts, NodeMatcher, Precision, PrecisionPlan, State, Storage
from mixprec.plan.placement import PlannerView, min_cut_islands
from mixprec.plan.readings import Inputs, PolicyClass, classify, read_inputs, weight_heavy
from mixprec.plan.rules import Action, Rule, Ruling, decide, rules_for
from mixprec.plan.templates import OpTemplate, node_facts, op_template
from mixprec.policy.opfacts import Carrier, OpFacts, op_facts
from mixprec.policy.profiles import RuntimeProfile, constant_folding, load_runtime
from mixprec.policy.table import Policy, format_op_name, normalize_domain

__all__ = ["plan_precision"]

# How many ops that move values a saturating constant may pass through to its readers.
_SATURATION_HOPS = 16


class Planner:
    """The planner's state over one model: value states, decisions so far, evidence.

    It is the context the rules read (:class:`mixprec.plan.rules.PlanContext`).
    """

    def __init__(
        self,
        model: ir.Model,
        policy: Policy,
        exclude: NodeMatcher,
        keep_io_types: bool,
        forced: Mapping[ir.Node, tuple[Category, str]] | None = None,
        wide_values: Mapping[ir.Value, str] | None = None,
        runtime: RuntimeProfile | None = None,
        keys: Mapping[ir.Node, str] | None = None,
        safe_values: Mapping[ir.Value, str] | None = None,
    ) -> None:
        self.model = model
        self.runtime = runtime if runtime is not None else load_runtime("onnx")
        # How the runtime folds the nodes computed from constants alone when it loads the model
        # (None where its table does not say), what of this model it folds (`start`), and the
        # values and nodes it folds once every node is decided.
        self.folding = constant_folding(self.runtime)
        self.load_folding: LoadFolding | None = None
        self.folded: frozenset[ir.Value] = frozenset()
        self.folded_nodes: frozenset[ir.Node] = frozenset()
        self.forced = dict(forced or {})
        self.wide_values = dict(wide_values or {})
        self.policy = policy
        self.target = policy.target
        self.exclude = exclude
        self.keep_io_types = keep_io_types
        self.state: dict[ir.Value, State] = {}
        self.decisions: dict[ir.Node, Decision] = {}
        self.lowered: dict[ir.Node, frozenset[str]] = {}
        self.facts: dict[ir.Node, NodeFacts] = {}
        self.storage: dict[ir.Value, Storage] = {}
        self.constant_notes: dict[ir.Value, str] = {}
        self.saturated: set[ir.Value] = set()
        # (node, input index) where an attention mask reads a saturated fill through ops moving it.
        self.moved_mask_reads: list[tuple[ir.Node, int]] = []
        # FP32 values a 16-bit copy holds safely (bounded op outputs, ranges measured on data),
        # with the evidence: they do not hold the follow ops they feed in FP32.
        self.bounded: dict[ir.Value, str] = dict(safe_values or {})
        self.flex_nodes: list[ir.Node] = []
        self.lowered_for_consumers: list[ir.Node] = []  # flexible nodes all of whose consumers were 16-bit
        # TINY values made from constants by data movement: like constants, their readers decide.
        self.tiny_flex: set[ir.Value] = set()
        # Values kept FP32 for carrying an input that must not be narrowed -> that input's origin.
        self.carried: dict[ir.Value, ir.Value] = {}
        # Evidence for generated values that flush to zero (a ConstantOfShape fill value).
        self.fill_notes: dict[ir.Value, str] = {}
        self.main_outputs = frozenset(model.graph.outputs)
        self.sub_outputs: set[ir.Value] = set()
        self.order = all_nodes(model)
        # The FP32 tensor values the graphs and nodes read and write, each value's type read once
        # when planning starts (`start`).
        self.fp32: frozenset[ir.Value] = frozenset()
        # The caller's keys as they are (100k nodes: a copy is 5 MB); nothing here changes them.
        self.keys = keys if isinstance(keys, dict) else dict(keys) if keys is not None else unique_names(self.order)
        self.graphs = [model.graph, *function_graphs(model)]
        self.owners: set[ir.Node] = set()  # nodes with subgraphs (control flow)
        for node in self.order:
            subgraphs = subgraphs_of(node) if node.attributes else []
            if subgraphs:
                self.owners.add(node)
                self.graphs.extend(subgraphs)
        self.has_control_flow = bool(self.owners)
        self.has_functions = bool(model.functions)
        self.opsets = dict(model.opset_imports)
        self._templates: dict[tuple, OpTemplate] = {}
        # Per (op, domain, node version, graph, arity): the template and the rules that may
        # decide its nodes (`rules.rules_for`), found on first use.
        self._node_templates: dict[tuple, tuple[OpTemplate, tuple[Rule, ...] | None]] = {}
        # Policy classes without a condition, per (domain, op, rule): the same for all the op's nodes.
        self._static_classes: dict[tuple[str, str, int], PolicyClass] = {}
        # Node facts by template and type-variable binding, shared by the nodes that have them.
        self._known_facts: dict[tuple, NodeFacts] = {}
        # Per node being decided: its policy class and what its inputs hold (read once).
        self._classes: dict[ir.Node, PolicyClass] = {}
        self._inputs: dict[ir.Node, Inputs] = {}
        # Decisions are immutable and repeat across nodes: one shared object per distinct one.
        self._decisions: dict[tuple[Precision, Category, str], Decision] = {}

    # -- states ---------------------------------------------------------------------------
    def constant_range(self, value: ir.Value) -> ConstantRange | None:
        """The range of a constant's values against the 16-bit type."""
        return constant_range(value, self.target)

    def _constant_state(self, value: ir.Value) -> State:
        rng = self.constant_range(value)
        if rng is not None and rng.overflow:
            return State.FLEX if self.saturates(value) else State.WIDE
        if rng is not None and rng.significant_flush:
            return State.TINY
        return State.FLEX

    def saturates(self, value: ir.Value) -> bool:
        """Whether a constant beyond the 16-bit range may saturate to its largest finite
        magnitude (recorded in `saturated`): see `_saturates_where_read`."""
        if value in self.saturated:
            return True
        if self._saturates_where_read(value):
            self.saturated.add(value)
            return True
        return False

    def _saturates_where_read(self, value: ir.Value) -> bool:
        """Whether every reader of the constant is an input the policy saturates (a clip bound;
        an attention mask input, for a fill below the 16-bit range), directly or through ops that
        only move values between constants (Where(mask, 0, -3.4e38) -> Expand -> an attention
        bias): then its 16-bit copy saturates. The moving ops are flexible then, so they stay FP32
        where their readers do, and an FP32 reader reads the exact value."""
        frontier, seen = [value], 0
        below: bool | None = None
        moved_reads: list[tuple[ir.Node, int]] = []
        while frontier:
            current = frontier.pop()
            if current.is_graph_output():
                return False
            for consumer, index in current.uses():
                rule = self.policy.rule_for(consumer.domain, consumer.op_type)
                if rule is not None and index in rule.saturate_inputs:
                    continue
                if rule is not None and index in rule.mask_inputs:
                    if below is None:
                        below = overflows_only_below(value, self.target)
                    if not below:
                        return False
                    if current is not value:
                        moved_reads.append((consumer, index))
                    continue
                if not self._moves_constants(consumer, current):
                    return False
                seen += 1
                if seen > _SATURATION_HOPS:
                    return False
                frontier.extend(out for out in consumer.outputs if out is not None)
        self.moved_mask_reads.extend(moved_reads)
        return True

    @staticmethod
    def _moves_constants(node: ir.Node, value: ir.Value) -> bool:
        """Whether the node only moves values (its op's integer-semantics carrier is "movement"),
        its FP32 inputs besides `value` are constants, and its outputs are FP32 (not a Cast to
        another type)."""
        if op_facts(node.domain, node.op_type).carrier is not Carrier.MOVEMENT:
            return False
        others = (v for v in node.inputs if v is not None and v is not value and is_fp32_tensor(v))
        outputs = [out for out in node.outputs if out is not None]
        return all(map(is_constant, others)) and all(map(is_fp32_tensor, outputs))

    def _init_graph(self, graph: ir.Graph, *, main: bool) -> None:
        for value in graph.inputs:
            if is_fp32_tensor(value):
                if main and not self.keep_io_types:
                    self.state[value] = State.LOW
                else:
                    self.state[value] = State.FLEX
        for value in graph.initializers.values():
            if is_fp32_tensor(value) and value not in self.state:
                self.state[value] = self._constant_state(value)
        if not main:
            self.sub_outputs.update(v for v in graph.outputs if v is not None)

    def measured_state(self, value: ir.Value) -> State:
        """WIDE or TINY for a value measured beyond the 16-bit range, by what its evidence says."""
        return State.TINY if getattr(self.wide_values[value], "flushes", False) else State.WIDE

    def is_flexible(self, value: ir.Value) -> bool:
        """Whether the value is a constant or made from constants by data movement alone."""
        return value in self.tiny_flex or is_constant(value)

    def value_state(self, value: ir.Value) -> State:
        """The lattice state of an FP32 value (outer-scope and unseen values on first use)."""
        state = self.state.get(value)
        if state is not None:
            return state if value not in self.wide_values else self.measured_state(value)
        # Outer-scope values not seen yet, values without a producer, unknown cases.
        if is_constant(value):
            state = self._constant_state(value)
        else:
            state = State.HIGH
        self.state[value] = state
        return state

    # -- facts --------------------------------------------------------------------------
    def _opset(self, node: ir.Node) -> int | None:
        if node.version is not None:
            return node.version
        graph = node.graph
        opsets = getattr(graph, "opset_imports", None) or self.opsets
        domain = normalize_domain(node.domain)
        version = default_domain_version(opsets) if domain == "" else opsets.get(domain)
        if version is None:
            version = self.opsets.get(domain)
        return version

    def _template(self, node: ir.Node, opset: int | None) -> OpTemplate:
        """The op's template (cached per op, opset and arity)."""
        key = (node.op_type, node.domain, opset, len(node.inputs), len(node.outputs))
        template = self._templates.get(key)
        if template is None:
            template = self._templates[key] = op_template(node, opset, self.policy, self.runtime)
        return template

    def _node_template(self, node: ir.Node) -> tuple[tuple, OpTemplate]:
        """The node's template and its key in `_node_templates` (what decides the node's opset:
        its op, domain, version and graph, and its arity)."""
        key = (node.op_type, node.domain, node.version, node.graph, len(node.inputs), len(node.outputs))
        found = self._node_templates.get(key)
        if found is None:
            found = self._node_templates[key] = (self._template(node, self._opset(node)), None)
        return key, found[0]

    def _rules(self, key: tuple, node: ir.Node, facts: NodeFacts) -> tuple[Rule, ...]:
        """The rules that may decide the nodes of template `key` (found once, from `node`'s facts)."""
        template, rules = self._node_templates[key]
        if rules is None:
            rules = rules_for(node, facts, self)
            self._node_templates[key] = (template, rules)
        return rules

    def is_control_flow(self, node: ir.Node) -> bool:
        """Whether the node owns subgraphs."""
        return node in self.owners

    def is_function_call(self, node: ir.Node) -> bool:
        """Whether the node calls a function of the model."""
        functions = self.model.functions
        return bool(functions) and (node.domain, node.op_type, node.overload) in functions

    def touches_fp32(self, node: ir.Node) -> bool:
        """Whether the node reads or writes FP32 values (inputs it takes as they are aside)."""
        facts = self.facts.get(node)
        flexible = facts.flexible if facts is not None else frozenset()
        fp32 = self.fp32
        for value in node.outputs:
            if value in fp32:
                return True
        for index, value in enumerate(node.inputs):
            if value in fp32 and index not in flexible:
                return True
        return False

    def _read_fp32(self) -> frozenset[ir.Value]:
        """The FP32 tensor values the graphs and nodes read and write (each type read once)."""
        values: set[ir.Value | None] = set()
        for graph in self.graphs:
            values.update(graph.inputs, graph.outputs, graph.initializers.values())
        for node in self.order:
            values.update(node.inputs, node.outputs)
        values.discard(None)
        return frozenset(filter(is_fp32_tensor, values))

    # -- forward pass -------------------------------------------------------------------
    def start(self) -> None:
        """Prepare the name matcher, the FP32 values, and the states of graph inputs and constants."""
        self.fp32 = self._read_fp32()
        names = {node.name for node in self.order if node.name} if self.exclude.patterns else set()
        self.exclude.prepare(names)
        # The constants' ranges, measured together (each graph's initializers are read below).
        fp32 = self.fp32
        constant_ranges((v for g in self.graphs for v in g.initializers.values() if v in fp32), self.target)
        if self.folding is not None:
            constants = (v for g in self.graphs for v in g.initializers.values() if is_constant(v))
            self.load_folding = LoadFolding(
                self.folding, self.target, constants, fp32, self.owners, self.constant_range, self._opset
            )
        self._init_graph(self.model.graph, main=True)
        for graph in self.graphs[1:]:
            # Subgraphs and function bodies keep their signatures: inputs are flexible, outputs
            # stay FP32.
            self._init_graph(graph, main=False)

    def run(self) -> PrecisionPlan:
        """Plan the model: forward pass, backward resolution, cast placement, storage."""
        self.start()
        for node in self.order:
            self.decide(node)
        self._resolve_flex()
        self._keep_masks_exact()
        self._place_casts()
        if self.load_folding is not None:
            self.folded, self.folded_nodes = self.load_folding.folded(self.order, self.decisions)
        self._decide_storage()
        return self.view()

    def _decision(self, precision: Precision, category: Category, reason: str) -> Decision:
        key = (precision, category, reason)
        decision = self._decisions.get(key)
        if decision is None:
            decision = self._decisions[key] = Decision(precision, category, reason)
        return decision

    def node_facts(self, node: ir.Node) -> NodeFacts:
        """The node's facts before the rules (recorded for the rules that read neighbours')."""
        facts = node_facts(node, self._node_template(node)[1], self.fp32, self._known_facts)
        self.facts[node] = facts
        return facts

    def classify(self, node: ir.Node, facts: NodeFacts) -> PolicyClass:
        """The node's policy class (see `readings.classify`), evaluated once per node (once per
        op for a policy rule without a condition)."""
        rule = facts.rule
        if rule is not None and rule.condition is None:
            key = (node.domain, node.op_type, id(rule))
            found = self._static_classes.get(key)
            if found is None:
                found = self._static_classes[key] = classify(node, facts)
            return found
        found = self._classes.get(node)
        if found is None:
            found = self._classes[node] = classify(node, facts)
        return found

    def inputs(self, node: ir.Node, facts: NodeFacts) -> Inputs:
        """What the node's inputs hold (see `readings.read_inputs`), read once per node; constants
        that saturate are recorded."""
        found = self._inputs.get(node)
        if found is None:
            found = self._inputs[node] = read_inputs(node, facts, self, self._wide_evidence)
            self.saturated.update(found.saturated)
        return found

    def decide(self, node: ir.Node) -> Ruling:
        """Decide one node by the first rule that decides it, and record what it implies."""
        key, template = self._node_template(node)
        facts = self.facts[node] = node_facts(node, template, self.fp32, self._known_facts)
        ruling = decide(node, facts, self, self._rules(key, node, facts))
        self._classes.pop(node, None)
        inputs = self._inputs.pop(node, None)
        if ruling.facts is not None:
            facts = ruling.facts
        elif inputs is not None:
            facts = inputs.facts
        self.facts[node] = facts
        self._apply(node, facts, ruling)
        if self.load_folding is not None:
            self.load_folding.note(node, ruling.category is Category.FOLDED)
        return ruling

    # -- constants the runtime folds when it loads the model (see `load_folding`) --------
    def opset_of(self, node: ir.Node) -> int | None:
        """The opset version the node's op is taken at."""
        return self._opset(node)

    def folds_at_load(self, node: ir.Node) -> bool:
        """Whether the runtime computes the node once, when it loads the model, from constants
        that fit the 16-bit type or what was computed from such alone."""
        return self.load_folding is not None and self.load_folding.folds_at_load(node)

    def _apply(self, node: ir.Node, facts: NodeFacts, ruling: Ruling) -> None:
        for value, note in ruling.evidence:
            self.constant_notes[value] = note
        for value, note in ruling.fill:
            self.fill_notes[value] = note
        if ruling.action is Action.KEEP:
            self._keep(node, ruling.category, ruling.reason, ruling.state)
        elif ruling.action is Action.LOWER:
            self._lower(node, facts, ruling.category, ruling.reason)
        else:
            self._flex(node, facts, tiny=ruling.tiny)
        if ruling.carries is None and ruling.scaled is None:
            return
        fp32_outputs = [out for out in node.outputs if out in self.fp32]
        if ruling.carries is not None:
            origin = self.carried.get(ruling.carries, ruling.carries)
            self.carried.update(dict.fromkeys(fp32_outputs, origin))
        if ruling.scaled is not None:
            for out in fp32_outputs:
                self.bounded.setdefault(out, ruling.scaled)

    def _keep(self, node: ir.Node, category: Category, reason: str, out_state: State) -> None:
        touches = self.touches_fp32(node)
        precision = Precision.FP32 if touches else Precision.NONE
        if not touches:
            category, reason = Category.NO_FLOAT, "no FP32 values"
        self.decisions[node] = self._decision(precision, category, reason)
        self.lowered[node] = frozenset()
        fact = op_facts(node.domain, node.op_type)
        bounded = out_state is State.HIGH and is_default_domain(node.domain) and fact.bounded
        for out in node.outputs:
            if out in self.fp32:
                self.state[out] = out_state
                if bounded:
                    self.bounded[out] = f"{node.op_type} output: within a fixed small interval"
        if out_state is State.HIGH and fact.normalizes is not None and node.outputs and node.outputs[0] in self.fp32:
            self._bound_normalized(node, fact)

    def normalized_output_fits(self, node: ir.Node) -> bool:
        """Whether a normalization's output, through the constant scale and shift after it, is
        bounded within the 16-bit range (see `analysis.norm_bounds`); True for other ops."""
        fact = op_facts(node.domain, node.op_type)
        if fact.normalizes is None or not node.outputs:
            return True
        return self._normalized_bounds(node, fact) is not None

    def _normalized_bounds(self, node: ir.Node, fact: OpFacts) -> tuple[float, float] | None:
        """A normalization's largest output magnitude and the largest through the constant scale
        and shift after it, where that fits the 16-bit range; else None."""
        bound = output_bound(node, fact, self._absmax)
        if bound is None:
            return None
        worst = affine_bound(node.outputs[0], bound, self._absmax)
        return (bound, worst) if worst <= self.target.limits.max else None

    def _bound_normalized(self, node: ir.Node, fact: OpFacts) -> None:
        """A normalization's output whose size its group and constant scale and bias bound
        within the 16-bit range: a 16-bit copy of it is safe (see `analysis.norm_bounds`)."""
        bounds = self._normalized_bounds(node, fact)
        if bounds is not None:
            bound, worst = bounds
            self.bounded[node.outputs[0]] = (
                f"{node.op_type} output: at most {bound:.4g} in magnitude (the square root of its group "
                f"size times its scale, plus its bias), and at most {worst:.4g} through the constant "
                "scale and shift after it"
            )

    def _absmax(self, value: ir.Value) -> float | None:
        """A constant's largest magnitude (None for other values and constants that overflow)."""
        rng = self.constant_range(value) if is_constant(value) else None
        return rng.absmax if rng is not None and not rng.overflow else None

    def _lower(self, node: ir.Node, facts: NodeFacts, category: Category, reason: str) -> None:
        self.decisions[node] = self._decision(Precision.LOW, category, reason)
        self.lowered[node] = frozenset(facts.lowerable)
        output_vars = facts.sig.output_vars if facts.sig is not None else ()
        dtype_source = facts.rule is not None and facts.rule.dtype_attribute is not None
        for index, out in enumerate(node.outputs):
            if out not in self.fp32:
                continue
            if dtype_source:
                lowered = index == 0
            else:
                var = output_vars[index] if index < len(output_vars) else None
                lowered = var is not None and var in facts.lowerable
            self.state[out] = State.LOW if lowered else State.HIGH

    def _flex(self, node: ir.Node, facts: NodeFacts, *, tiny: bool = False) -> None:
        """Provisional: resolved by the backward pass. `tiny`: the outputs hold values that
        flush to zero in 16 bits (a TINY constant or data movement of one)."""
        self.decisions[node] = self._decision(Precision.FP32, Category.CONSUMERS, "pending")
        self.lowered[node] = frozenset(facts.lowerable)
        self.flex_nodes.append(node)
        for index, out in enumerate(node.outputs):
            if out in self.fp32:
                flexible = self._output_var_lowerable(facts, index)
                self.state[out] = (State.TINY if tiny else State.FLEX) if flexible else State.HIGH
                if flexible and tiny:
                    self.tiny_flex.add(out)

    @staticmethod
    def _output_var_lowerable(facts: NodeFacts, index: int) -> bool:
        if facts.rule is not None and facts.rule.dtype_attribute is not None:
            return index == 0
        if facts.sig is None or index >= len(facts.sig.output_vars):
            return False
        var = facts.sig.output_vars[index]
        return var is not None and var in facts.lowerable

    def _wide_evidence(self, value: ir.Value) -> str:
        note = self.constant_notes.get(value) or self.wide_values.get(value)
        if note is not None:
            return note
        rng = self.constant_range(value)
        carried = self.carried.get(value)
        if rng is not None:
            note = rng.describe(self.target)
        elif carried is not None:
            note = f"carries {carried.name!r}: {self._wide_evidence(carried)}"
        elif value in self.fill_notes:
            note = self.fill_notes[value]
        else:
            producer = value.producer()
            origin = producer.name or producer.op_type if producer is not None else "?"
            if self.state.get(value) is State.TINY:
                note = f"may hold values that {FLUSH_WORDS} in {self.target.short_name} (underflow, from {origin})"
            else:
                note = f"may hold values beyond the {self.target.short_name} range (from {origin})"
        self.constant_notes[value] = note
        return note

    # -- backward pass ------------------------------------------------------------------
    def demands(self, value: ir.Value) -> set[State]:
        """What the consumers of an FP32 value need: LOW and/or HIGH."""
        wanted: set[State] = set()
        for use in value.uses():
            consumer, index = use.node, use.idx
            facts = self.facts.get(consumer)
            if facts is None:
                wanted.add(State.HIGH)
                continue
            if index in facts.flexible:
                # Read as it is. A Cast retargeted to 16 bits vanishes where its input is 16-bit;
                # one kept FP32 reads a constant exactly only from an FP32 copy (a computed value
                # it upcasts is its 16-bit producer's to round, as at any boundary).
                if index == 0 and _copies_input(facts):
                    precision = self.decisions[consumer].precision
                    if precision is Precision.LOW:
                        wanted.add(State.LOW)
                    elif precision is Precision.FP32 and self.is_flexible(value):
                        wanted.add(State.HIGH)
                continue
            decision = self.decisions[consumer]
            if decision.precision is Precision.LOW:
                var = facts.sig.input_vars[index] if facts.sig and index < len(facts.sig.input_vars) else None
                wanted.add(State.LOW if var is not None and var in self.lowered[consumer] else State.HIGH)
            else:
                wanted.add(State.HIGH)
        if value in self.main_outputs:
            wanted.add(State.HIGH if self.keep_io_types else State.LOW)
        if value in self.sub_outputs:
            wanted.add(State.HIGH)
        return wanted

    def _keep_masks_exact(self) -> None:
        """A 16-bit attention reading a saturated mask fill through ops that stayed FP32 (another
        reader of theirs computes in FP32) would read a Cast of float32's lowest: -inf, whose
        fully masked rows give NaN that 0-weighted values carry on. Such a reader stays FP32."""
        for node, index in self.moved_mask_reads:
            value = node.inputs[index] if index < len(node.inputs) else None
            if value is None or self.decisions[node].precision is not Precision.LOW:
                continue
            if self.state.get(value) is State.LOW:
                continue  # the ops moving the fill converted: it reads the saturated 16-bit value
            reason = f"reads the mask fill {value.name!r} in FP32 (a 16-bit cast of it would be -inf)"
            self.decisions[node] = self._decision(Precision.FP32, Category.CONSTANT_RANGE, reason)
            self.lowered[node] = frozenset()
            for out in node.outputs:
                if out in self.fp32:
                    self.state[out] = State.HIGH

    def _resolve_flex(self) -> None:
        for node in reversed(self.flex_nodes):
            facts = self.facts[node]
            wanted: set[State] = set()
            for index, out in enumerate(node.outputs):
                if is_fp32_tensor(out) and (self.state.get(out) is State.FLEX or out in self.tiny_flex):
                    wanted |= self.demands(out)
            op_name = format_op_name(node.domain, node.op_type)
            if wanted == {State.LOW}:
                self._lower(node, facts, Category.CONSUMERS, f"{op_name}: all consumers compute in {self.target.short_name}")
                self.lowered_for_consumers.append(node)
            elif not wanted and quantizes_float_chain(node, self.runtime.name, self.target):
                # A QuantizeLinear has no float output: in 16 bits it lets the ops before it
                # (back to their DequantizeLinear) convert without a Cast.
                self._lower(node, facts, Category.CONSUMERS, f"{op_name}: reads a chain of ops computed in {self.target.short_name}")
            elif weight_heavy(node, facts):
                self._lower(
                    node,
                    facts,
                    Category.CONSUMERS,
                    f"{op_name}: reads a large constant, stored in {self.target.short_name}; "
                    "its output is cast for FP32 consumers",
                )
            elif State.LOW in wanted and self._reads_only_low(node):
                # In FP32 it would convert its 16-bit input and its 16-bit consumers would need
                # a cast back: in 16 bits only its FP32 consumers need one (shared).
                self._lower(
                    node, facts, Category.CONSUMERS,
                    f"{op_name}: reads {self.target.short_name} values and some consumers compute in "
                    f"{self.target.short_name}; its output is cast for FP32 consumers",
                )
                self.lowered_for_consumers.append(node)
            else:
                why = "some consumers compute in FP32" if State.HIGH in wanted else "no 16-bit consumer"
                self._keep(node, Category.CONSUMERS, f"{op_name}: {why}", State.HIGH)

    def _reads_only_low(self, node: ir.Node) -> bool:
        """Whether every FP32 input of `node` is a 16-bit value (and it has one)."""
        inputs = [v for v in node.inputs if v is not None and v in self.fp32]
        return bool(inputs) and all(self.state.get(v) is State.LOW for v in inputs)

    # -- cast placement -----------------------------------------------------------------
    def view(self) -> PrecisionPlan:
        """The decisions so far as a plan (shares the planner's dictionaries)."""
        return PrecisionPlan(
            target=self.target, keep_io_types=self.keep_io_types, decisions=self.decisions,
            lowered_vars=self.lowered, facts=self.facts, storage=self.storage,
            constant_notes=self.constant_notes, saturated=self.saturated, order=self.order,
            graphs=self.graphs, keys=self.keys, fp32=self.fp32, folded=self.folded, folded_nodes=self.folded_nodes,
        )

    def _placement_view(self) -> PlannerView:
        """What the cast placement reads of the planner."""
        plan = self.view()
        return PlannerView(
            plan=plan,
            model_inputs=frozenset(self.model.graph.inputs),
            main_outputs=self.main_outputs,
            sub_outputs=frozenset(self.sub_outputs),
            op_types=frozenset((key[0], key[1]) for key in self._templates),
            runtime=self.runtime.name,
            is_weight_heavy=lambda node: weight_heavy(node, self.facts[node]),
            fp32=self.fp32,
            folded=frozenset(self.load_folding.inputs) if self.load_folding is not None else frozenset(),
        )

    def _place_casts(self) -> None:
        """Re-decide the follow-class nodes and normalizations of each island by cast cost
        (minimum cut)."""
        changed = False
        for island, assignment, before, after in min_cut_islands(self._placement_view()):
            anchor = self.keys.get(island.nodes[0]) or island.nodes[0].op_type
            why = (
                f"the cheapest cast placement for the {len(island.nodes)} node(s) around "
                f"{anchor!r}: {before[0]} -> {after[0]} casts, {before[1]:,} -> {after[1]:,} bytes per inference"
            )
            for node in island.nodes:
                low = assignment[node]
                if low == (self.decisions[node].precision is Precision.LOW):
                    continue
                facts = self.facts[node]
                op_name = format_op_name(node.domain, node.op_type)
                if low:
                    for out in node.outputs:
                        self.bounded.pop(out, None)
                    self._lower(node, facts, Category.CAST_COST, f"{op_name} in {self.target.short_name}: {why}")
                else:
                    self._keep(node, Category.CAST_COST, f"{op_name} in FP32: {why}", State.HIGH)
            changed = True
        if changed:
            self._settle_flexible()

    def _settle_flexible(self) -> None:
        """Flexible nodes decided 16-bit for their consumers before the placement keep FP32
        where consumers now compute in FP32: a Constant where any does (its FP32 value serves
        it; 16-bit readers get a stored copy), other nodes (a Cast to FP32 of a 16-bit value:
        the upcast they need) where all do. Consumers first, as they were decided."""
        for node in self.lowered_for_consumers:
            if self.decisions[node].precision is not Precision.LOW:
                continue
            wanted: set[State] = set()
            for out in node.outputs:
                if is_fp32_tensor(out):
                    wanted |= self.demands(out)
            if State.HIGH in wanted and (node.op_type == "Constant" or wanted == {State.HIGH}):
                op_name = format_op_name(node.domain, node.op_type)
                self._keep(node, Category.CONSUMERS, f"{op_name}: some consumers compute in FP32", State.HIGH)

    def _decide_storage(self) -> None:
        for graph in self.graphs:
            for value in graph.initializers.values():
                if not is_fp32_tensor(value) or value.is_graph_input():
                    continue
                self.storage[value] = self._storage_for(value)
        for node in self.order:
            if node.op_type == "Constant" and is_default_domain(node.domain) and node.outputs:
                out = node.outputs[0]
                if is_fp32_tensor(out) and self.decisions[node].precision is not Precision.LOW:
                    wanted = self.demands(out)
                    if State.LOW in wanted and self.state.get(out) not in (State.WIDE, State.TINY):
                        self.storage[out] = Storage.BOTH

    def _storage_for(self, value: ir.Value) -> Storage:
        wanted = self.demands(value)
        if self.state.get(value) is State.WIDE and value not in self.saturated:
            note = self._wide_evidence(value)
            self.constant_notes[value] = note
            return Storage.FP32
        if wanted == {State.LOW}:
            return Storage.LOW
        if State.LOW in wanted:
            return Storage.BOTH
        return Storage.FP32


def _copies_input(facts: NodeFacts) -> bool:
    """Whether the node is a Cast: its output holds its input's values in the type its `to`
    attribute names (retargeted with its consumers)."""
    rule = facts.rule
    return rule is not None and rule.dtype_attribute == "to"


def plan_precision(
    model: ir.Model,
    policy: Policy,
    *,
    exclude_nodes: Sequence[str] | NodeMatcher = (),
    keep_io_types: bool = True,
    forced_fp32: Mapping[ir.Node, tuple[Category, str]] | None = None,
    wide_values: Mapping[ir.Value, str] | None = None,
    runtime: RuntimeProfile | None = None,
    keys: Mapping[ir.Node, str] | None = None,
    safe_values: Mapping[ir.Value, str] | None = None,
) -> PrecisionPlan:
    """Decide the precision of every node of a typed model.

    Args:
        model: The FP32 model, with types filled in (see `infer_types`). Not modified.
        policy: The op policy for the target type.
        exclude_nodes: Node names or regular expressions (`re.search`) of nodes kept FP32.
        keep_io_types: Keep the model's FP32 inputs and outputs in FP32.
        forced_fp32: Nodes that analyses (integer semantics, ...) keep FP32, with category and
            evidence.
        wide_values: FP32 values known (e.g. measured on data) to leave the 16-bit range, with
            evidence: they are never narrowed, and nodes producing them stay FP32.
        runtime: The runtime profile whose kernels the converted nodes must have (default: the
            ONNX schema alone).
        keys: The nodes' stable keys, when already known (default: `node_keys(model)`).
        safe_values: FP32 values known (e.g. measured on data) to fit the 16-bit type, with
            evidence: like bounded op outputs, they do not hold the follow ops they feed in FP32.

    Returns:
        The plan.
    """
    matcher = exclude_nodes if isinstance(exclude_nodes, NodeMatcher) else NodeMatcher(exclude_nodes)
    return Planner(model, policy, matcher, keep_io_types, forced_fp32, wide_values, runtime, keys, safe_values).run()
