"""Cast placement by cost: a minimum cut over the follow-class nodes between fixed-precision ones.

The planner's passes decide a follow-class node from its neighbours ("widest input", then "what
the consumers need"), which puts every Cast next to the node that forced it. Here the nodes whose
precision only those rules decided ("free" nodes) are decided again, together, by cost:

* a Cast costs the bytes it reads and writes (elements x (4 + 2)) plus a kernel launch on the
  runtime's device (`mixprec.policy.costs`); one Cast per (value, type) serves every consumer,
  so a value's cost counts once whatever its number of consumers;
* a free node computed in FP32 moves 2 more bytes per element it reads and writes than in 16 bits;
* numerics bound the choice exactly as the passes do: a value that may hold what the 16-bit type
  cannot (the output of an FP32 op that is neither bounded nor measured to fit, and whatever
  arithmetic computes from it) is never narrowed where an FP32 consumer would see the difference:
  an arithmetic node reading it stays FP32, and a data-movement node may read it in 16 bits only
  when everything it feeds computes in 16 bits (which would round the same values anyway).

Fixed 16-bit nodes are the source, fixed FP32 nodes the sink; the minimum cut is the cheapest
assignment (hyperedges model the shared Cast of a value). Of the minimum cuts, the one with the
most 16-bit nodes is taken: deterministic and independent of node order. A component's new
assignment is kept only when it has no more casts and moves no more cast bytes than the passes'
one, so the cut never trades a Cast for compute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import onnx_ir as ir

from mixprec.analysis.constants import is_constant
from mixprec.analysis.cost_model import (
    CAST_BYTES_PER_ELEMENT,
    FP32_EXTRA_BYTES_PER_ELEMENT,
    SYMBOLIC_DIM,
    guessed_elements,
)
from mixprec.analysis.qdq import role as qdq_role
from mixprec.dtypes import is_fp32_tensor
from mixprec.plan.model import Category, Precision, PrecisionPlan
from mixprec.policy.costs import runtime_cost
from mixprec.policy.opfacts import op_facts
from mixprec.policy.table import OpClass

__all__ = ["Island", "PlannerView", "min_cut_islands"]

_INF = 1 << 256  # beyond any sum of byte costs (Python integers do not overflow)
_CAST_BYTES = CAST_BYTES_PER_ELEMENT
_FP32_EXTRA_BYTES = FP32_EXTRA_BYTES_PER_ELEMENT
_UNKNOWN_ELEMENTS = SYMBOLIC_DIM * SYMBOLIC_DIM  # tensors of unknown shape: one consistent guess
_FREE_CATEGORIES = frozenset({Category.FOLLOW, Category.CONSUMERS})


class _Network:
    """A flow network with integer capacities (Dinic's algorithm, its levels counted back from the
    sink: a phase searches no farther than the source)."""

    def __init__(self, nodes: int = 0) -> None:
        # node 0: the source (16 bits), node 1: the sink (FP32), then `nodes` more
        self.heads: list[list[int]] = [[] for _ in range(nodes + 2)]
        self.to: list[int] = []
        self.cap: list[int] = []

    def node(self) -> int:
        self.heads.append([])
        return len(self.heads) - 1

    def edge(self, a: int, b: int, capacity: int, back: int = 0) -> None:
        """An edge a -> b (and, with `back` > 0, b -> a of that capacity, sharing its slots)."""
        if a == b or capacity <= 0:
            return
        e = len(self.to)
        self.heads[a].append(e)
        self.heads[b].append(e + 1)
        self.to += (b, a)
        self.cap += (capacity, max(back, 0))

    def max_flow(self) -> int:
        """The maximum flow from the source to the sink (stops once it reaches `_INF`)."""
        flow = 0
        while flow < _INF:
            dist = self._distances()
            if dist[0] < 0:
                break
            cursor = [0] * len(self.heads)
            while flow < _INF:
                pushed = self._push(dist, cursor)
                if not pushed:
                    break
                flow += pushed
        return flow

    def _distances(self) -> list[int]:
        """Residual distances to the sink, searched backwards from it until the source is found
        (-1: unreached); only nodes nearer than the source matter to the phase's paths."""
        heads, to, cap = self.heads, self.to, self.cap
        dist = [-1] * len(heads)
        dist[1] = 0
        frontier = [1]
        d = 0
        while frontier and dist[0] < 0:
            d += 1
            reached = []
            for b in frontier:
                for e in heads[b]:
                    a = to[e]  # edge e ^ 1 goes a -> b
                    if dist[a] < 0 and cap[e ^ 1] > 0:
                        dist[a] = d
                        reached.append(a)
            frontier = reached
        return dist

    def _push(self, dist: list[int], cursor: list[int]) -> int:
        """One augmenting path from the source along edges one step nearer the sink (iterative
        depth-first search; dead ends are dropped for the phase)."""
        heads, to, cap = self.heads, self.to, self.cap
        path: list[int] = []
        a = 0
        while a != 1:
            adjacent = heads[a]
            i, n, want = cursor[a], len(adjacent), dist[a] - 1
            while i < n and not (cap[adjacent[i]] > 0 and dist[to[adjacent[i]]] == want):
                i += 1
            cursor[a] = i
            if i < n:
                path.append(adjacent[i])
                a = to[adjacent[i]]
                continue
            if not path:
                return 0
            dist[a] = -1  # dead end
            a = to[path.pop() ^ 1]
            cursor[a] += 1
        amount = min([cap[e] for e in path])
        for e in path:
            cap[e] -= amount
            cap[e ^ 1] += amount
        return amount

    def reaching_sink(self) -> set[int]:
        """Nodes from which the sink is reachable in the residual network."""
        seen = {1}
        queue = deque([1])
        while queue:
            b = queue.popleft()
            for e in self.heads[b]:
                a = self.to[e]  # the reverse of edge e goes a -> b with capacity cap[e ^ 1]
                if a not in seen and self.cap[e ^ 1] > 0:
                    seen.add(a)
                    queue.append(a)
        return seen


@dataclass
class Island:
    """One connected set of free nodes, decided together (in graph order)."""

    nodes: list[ir.Node]


def _needs_cast(spec: tuple, low: tuple[bool, ...]) -> bool:
    """Whether a value (see `_Islands.problem`; its first field is not read) needs a Cast under an
    assignment `low` (True: 16-bit): a 16-bit one produced with an FP32 reader, or an FP32 one
    with a 16-bit reader (one Cast serves every reader of its type)."""
    _, producer, consumers, fixed_low, fixed_high = spec
    if low[producer] if producer >= 0 else producer == -1:
        return fixed_high or not all(low[c] for c in consumers)
    return fixed_low or any(low[c] for c in consumers)


def _casts(values: tuple, low: tuple[bool, ...]) -> tuple[int, int]:
    """(casts, cast bytes) of an island's values (see `_Islands.problem`) under an assignment."""
    count = size = 0
    for spec in values:
        if _needs_cast(spec, low):
            count += 1
            size += spec[0] * _CAST_BYTES
    return count, size


def _next_to_qdq(node: ir.Node) -> bool:
    """Whether the node reads a DequantizeLinear's output or feeds a QuantizeLinear."""
    for value in node.inputs:
        producer = value.producer() if value is not None else None
        if producer is not None and qdq_role(producer) == "dequantize":
            return True
    return any(qdq_role(use.node) == "quantize" for value in node.outputs for use in value.uses())


def _free_values(node: ir.Node, fact) -> tuple[list[ir.Value], list[ir.Value]] | None:  # noqa: ANN001
    """The node's FP32 inputs that follow its precision (flexible ones and constants aside) and
    its FP32 outputs; None when an FP32 input or output does not follow it (bound to a type
    variable that cannot be lowered)."""
    sig, lowerable, flexible = fact.sig, fact.lowerable, fact.flexible
    input_vars, output_vars = sig.input_vars, sig.output_vars
    inputs: list[ir.Value] = []
    for index, value in enumerate(node.inputs):
        if index in flexible or not is_fp32_tensor(value):
            continue
        var = input_vars[index] if index < len(input_vars) else None
        if var is None or var not in lowerable:
            return None
        if not is_constant(value):  # type: ignore[arg-type]
            inputs.append(value)  # type: ignore[arg-type]
    outputs: list[ir.Value] = []
    for index, value in enumerate(node.outputs):
        if not is_fp32_tensor(value):
            continue
        var = output_vars[index] if index < len(output_vars) else None
        if var is None or var not in lowerable:
            return None
        outputs.append(value)
    return inputs, outputs


@dataclass(frozen=True)
class PlannerView:
    """What the cast placement reads of the planner after its forward and backward passes.

    Attributes:
        plan: The decisions so far.
        model_inputs: The main graph's inputs.
        main_outputs: The main graph's outputs.
        sub_outputs: The outputs of subgraphs and function bodies (returned as they are, FP32).
        op_types: The (op type, domain) pairs the model uses.
        runtime: The runtime profile's name (its costs price a Cast).
        is_weight_heavy: Whether a node was lowered for the large constant it reads (kept as
            decided).
    """

    plan: PrecisionPlan
    model_inputs: frozenset[ir.Value]
    main_outputs: frozenset[ir.Value]
    sub_outputs: frozenset[ir.Value]
    op_types: frozenset[tuple[str, str]]
    runtime: str
    is_weight_heavy: Callable[[ir.Node], bool]


class _Islands:
    """The free nodes of a planner, their islands, and each island as plain data."""

    def __init__(self, planner: PlannerView) -> None:
        self.planner = planner
        self.view = planner.plan
        self.free: dict[ir.Node, int] = {}
        # Free nodes the forward pass kept FP32 for an FP32 input that may not fit the 16-bit type
        # (an output of an FP32 node neither bounded nor measured, or what such nodes compute
        # from it): "follows FP32 input".
        self.reads_tainted: set[ir.Node] = set()
        self.inputs: dict[ir.Node, list[ir.Value]] = {}
        self.outputs: dict[ir.Node, list[ir.Value]] = {}
        self._elements: dict[int, int] = {}  # id(shape) -> elements (the values keep their shapes alive)
        self.model_inputs = planner.model_inputs
        decisions = planner.plan.decisions
        self.quantized = any(op_facts(domain, op).quantization for op, domain in planner.op_types)
        for node in planner.plan.order:
            found = self._free_node_values(node)
            if found is None:
                continue
            self.free[node] = len(self.free)
            self.inputs[node], self.outputs[node] = found
            decision = decisions[node]
            if decision.category is Category.FOLLOW and decision.precision is Precision.FP32:
                self.reads_tainted.add(node)

    def _free_node_values(self, node: ir.Node) -> tuple[list[ir.Value], list[ir.Value]] | None:
        """The node's free FP32 inputs and outputs (:func:`_free_values`) when it is a free node:
        decided by the follow rules alone, a lowerable follow-class op without a dtype attribute,
        no part of a Q/DQ group and not kept for its weight; None otherwise."""
        decision = self.view.decisions[node]
        if decision.category not in _FREE_CATEGORIES or decision.precision is Precision.NONE:
            return None
        fact = self.view.facts[node]
        rule = fact.rule
        if (
            rule is None or rule.op_class is not OpClass.FOLLOW or rule.dtype_attribute is not None
            or fact.sig is None or not fact.lowerable
        ):
            return None
        if self.quantized and (qdq_role(node) is not None or _next_to_qdq(node)):
            return None  # Q/DQ pairs have rules of their own (mixprec.plan.qdq_pairs)
        found = _free_values(node, fact)
        if found is None or self.planner.is_weight_heavy(node):
            return None
        return found

    def elements(self, value: ir.Value) -> int:
        """Estimated elements of `value`: every dimension that is not static as `SYMBOLIC_DIM`, an
        unknown shape as `_UNKNOWN_ELEMENTS` (costs must exist for every value of an island);
        remembered per shape object (equal static shapes share one)."""
        shape = value.shape
        if shape is None:
            return _UNKNOWN_ELEMENTS
        found = self._elements.get(id(shape))
        if found is None:
            guessed = guessed_elements(shape)
            found = self._elements[id(shape)] = guessed if guessed is not None else _UNKNOWN_ELEMENTS
        return found

    def groups(self) -> list[list[ir.Node]]:
        """Islands: free nodes connected through a value one produces or they read (one Cast of
        it serves them all), in graph order."""
        parent = list(range(len(self.free)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        free = self.free
        # Each value once, however many free nodes read it: its free readers and its producer
        # join one island (a value with N readers costs N, not N squared).
        inputs = self.inputs
        values = dict.fromkeys(chain.from_iterable(inputs[node] for node in free))
        for value in values:
            members = [j for u in value.uses() if (j := free.get(u.node)) is not None]
            producer = value.producer()
            if producer is not None and (j := free.get(producer)) is not None:
                members.append(j)
            if len(members) < 2:
                continue
            root = find(members[0])
            for j in members[1:]:
                other = find(j)
                if other != root:
                    parent[other] = root
        out: dict[int, list[ir.Node]] = {}
        for node, index in free.items():
            out.setdefault(find(index), []).append(node)
        return list(out.values())

    def problem(self, nodes: list[ir.Node], greedy: tuple[bool, ...]) -> tuple[tuple, tuple[int, int]] | None:
        """The island as plain data (local indices in graph order), with the (casts, bytes) of the
        passes' assignment `greedy`; None when that assignment has no Cast (nothing to improve).
        Repeated structures (the layers of a network) give equal problems, solved once.

        Nodes: (elements read and written, constraint, readers) with constraint 0 (none),
        1 (stays FP32: arithmetic on a value 16 bits may not hold) or 2 (16-bit only if each
        reader is: local indices, -1 for a fixed FP32 reader). Values: (elements, producer index
        or -1 / -2 for a fixed 16-bit / FP32 producer, free reader indices, a fixed reader wants
        16 bits, a fixed reader wants FP32).
        """
        ids = {node: i for i, node in enumerate(nodes)}
        inputs, outputs = self.inputs, self.outputs
        values = dict.fromkeys(chain.from_iterable(chain(inputs[node], outputs[node]) for node in nodes))
        described = [self._describe(value, ids) for value in values]
        if not any(_needs_cast(spec, greedy) for spec in described):
            return None  # sized only where there is something to improve
        value_specs = [(self.elements(value), *rest) for value, *rest in described]
        before = _casts(value_specs, greedy)
        specs = [self._node_spec(node, ids) for node in nodes]
        return (tuple(specs), tuple(value_specs)), before

    def _describe(self, value: ir.Value, ids: dict[ir.Node, int]) -> tuple:
        """(value, producer index or -1 / -2 for a fixed 16-bit / FP32 producer, free reader
        indices, a fixed reader wants 16 bits, a fixed reader wants FP32)."""
        planner, facts = self.planner, self.view.facts
        input_is_lowered, output_is_lowered = self.view.input_is_lowered, self.view.output_is_lowered
        keep_io_types, main_outputs, sub_outputs = self.view.keep_io_types, planner.main_outputs, planner.sub_outputs
        producer = value.producer()
        if producer in ids:
            origin = ids[producer]
        elif producer is None:
            origin = -2 if keep_io_types or value not in self.model_inputs else -1
        else:
            origin = -1 if output_is_lowered(producer, producer.outputs.index(value)) else -2
        free_readers: set[int] = set()
        wants_low = wants_high = False
        for use in value.uses():
            consumer, index = use.node, use.idx
            fact = facts.get(consumer)
            if fact is not None and index in fact.flexible:
                continue  # read as it is (Shape, CastLike's input): no Cast either way
            j = ids.get(consumer)
            if j is not None:
                free_readers.add(j)
            elif input_is_lowered(consumer, index):
                wants_low = True
            else:
                wants_high = True
        if value in sub_outputs:
            wants_high = True  # a subgraph returns it as it is, in FP32
        if value in main_outputs:
            if keep_io_types:
                wants_high = True
            else:
                wants_low = True
        return value, origin, tuple(sorted(free_readers)), wants_low, wants_high

    def _node_spec(self, node: ir.Node, ids: dict[ir.Node, int]) -> tuple:
        """(elements it reads and writes, constraint, readers): constraint 0 free, 1 FP32 (an
        FP32 input that may not fit), 2 16-bit only when all `readers` are."""
        elements, facts = self.elements, self.view.facts
        inputs, outputs = self.inputs[node], self.outputs[node]
        touched = sum(map(elements, inputs)) + sum(map(elements, outputs))
        if node not in self.reads_tainted:
            return touched, 0, ()
        if not op_facts(node.domain, node.op_type).value_preserving:
            return touched, 1, ()
        keep_io_types = self.view.keep_io_types
        main_outputs, sub_outputs = self.planner.main_outputs, self.planner.sub_outputs
        readers: set[int] = set()
        for value in outputs:
            for use in value.uses():
                fact = facts.get(use.node)
                if fact is not None and use.idx in fact.flexible:
                    continue
                j = ids.get(use.node)
                readers.add(j if j is not None else (-1 if not self.view.input_is_lowered(use.node, use.idx) else -3))
            if (value in main_outputs and keep_io_types) or value in sub_outputs:
                readers.add(-1)
        readers.discard(-3)  # fixed 16-bit readers allow it
        return touched, 2, tuple(sorted(readers))


def min_cut_islands(
    planner: PlannerView,
) -> list[tuple[Island, dict[ir.Node, bool], tuple[int, int], tuple[int, int]]]:
    """Decide the free nodes of `planner` (the planner after its forward and backward passes)
    by minimum cut. Returns, per island whose assignment changes, the
    island, the new assignment (node -> 16-bit) and the (casts, bytes) before and after."""
    islands = _Islands(planner)
    if not islands.free:
        return []
    decisions = planner.plan.decisions
    launch = round(runtime_cost(planner.runtime).launch_bytes)
    changes = []
    # Repeated layers give equal problems: each is solved once. A cut priced with launches that
    # trades cast bytes for fewer casts is not kept (cast bytes may not grow); the cut priced by
    # bytes alone is tried next.
    solved_problems: dict[tuple, tuple[tuple[bool, ...], tuple[int, int]] | None] = {}  # (problem, greedy)
    for nodes in islands.groups():
        greedy = tuple(decisions[n].precision is Precision.LOW for n in nodes)
        found = islands.problem(nodes, greedy)
        if found is None:
            continue
        problem, before = found
        key = (problem, greedy)
        if key not in solved_problems:
            solved_problems[key] = _best_cut(problem, greedy, before, launch)
        solved = solved_problems[key]
        if solved is not None:
            assignment, after = solved
            changes.append((Island(nodes), dict(zip(nodes, assignment)), before, after))
    return changes


def _best_cut(
    problem: tuple, greedy: tuple[bool, ...], before: tuple[int, int], launch: int
) -> tuple[tuple[bool, ...], tuple[int, int]] | None:
    """The first minimum cut (with launches priced, then without) that changes the passes'
    assignment without more casts or more cast bytes, and its (casts, bytes); None if neither.

    When the cut priced with (positive) launches is the passes' assignment, the cut by bytes alone
    is not solved: one it would keep (no more casts, bytes no more) costs no more with launches
    either, so it is a minimum cut there too and lies within the passes' 16-bit nodes, which in
    turn cost no more by bytes alone and so lie within its own: it is the passes' assignment."""
    for price in dict.fromkeys((launch, 0)):
        solved = _solve(problem, price)
        if solved == greedy and price > 0:
            return None
        if solved is None or solved == greedy:
            continue
        after = _casts(problem[1], solved)
        if after[0] <= before[0] and after[1] <= before[1] and after != before:
            return solved, after
    return None


def _solve(problem: tuple, launch: int) -> tuple[bool, ...] | None:
    """The minimum-cost assignment (True: 16-bit) with the most 16-bit nodes (None: infeasible);
    each Cast costs its bytes and `launch`."""
    nodes, values = problem
    net = _Network(len(nodes))  # free node i is network node i + 2
    for n, spec in enumerate(nodes, 2):
        _add_node_edges(net, n, spec)
    for spec in values:
        _add_value_edges(net, spec, launch)
    if net.max_flow() >= _INF:
        return None
    high = net.reaching_sink()
    return tuple(n not in high for n in range(2, len(nodes) + 2))


def _add_node_edges(net: _Network, n: int, spec: tuple) -> None:
    """The edges of free node `n` (network id: its local index + 2) with its spec (elements,
    constraint, readers; see `_Islands.problem`): its FP32 compute cost, and what its constraint
    forbids."""
    touched, constraint, readers = spec
    net.edge(0, n, touched * _FP32_EXTRA_BYTES)  # cut when the node stays FP32
    if constraint == 1:
        net.edge(n, 1, _INF)
    elif constraint == 2:
        for reader in readers:
            net.edge(n, 1 if reader < 0 else reader + 2, _INF)


def _add_value_edges(net: _Network, spec: tuple, launch: int) -> None:
    """The edges of one value (see `_Islands.problem`): its shared upcast and downcast, each
    costing its bytes and `launch`."""
    elements, producer_index, consumers_index, fixed_low_reader, fixed_high_reader = spec
    cost = elements * _CAST_BYTES + launch
    producer = producer_index + 2 if producer_index >= 0 else (0 if producer_index == -1 else 1)
    consumers = [c + 2 for c in consumers_index]
    if producer > 1 and len(consumers) == 1 and not (fixed_low_reader or fixed_high_reader):
        net.edge(producer, consumers[0], cost, cost)  # one Cast whichever of the two is 16-bit
        return
    if producer != 1:  # a 16-bit producer with an FP32 reader: one upcast
        _add_upcast(net, producer, consumers, fixed_high_reader, cost)
    if producer != 0:  # an FP32 producer with a 16-bit reader: one downcast
        _add_downcast(net, producer, consumers, fixed_low_reader, cost)


def _add_upcast(net: _Network, producer: int, consumers: list[int], fixed_high_reader: bool, cost: int) -> None:
    """The upcast of a value: cut when its producer is 16-bit and a reader FP32 (a fixed one, or
    one of `consumers`: directly when it is the only one, else through a shared auxiliary node)."""
    if fixed_high_reader:
        if producer != 0:
            net.edge(producer, 1, cost)
    elif len(consumers) == 1:
        net.edge(producer, consumers[0], cost)
    elif consumers:
        aux = net.node()
        net.edge(producer, aux, cost)
        for c in consumers:
            net.edge(aux, c, _INF)


def _add_downcast(net: _Network, producer: int, consumers: list[int], fixed_low_reader: bool, cost: int) -> None:
    """The downcast of a value: cut when its producer is FP32 and a reader 16-bit (a fixed one, or
    one of `consumers`: directly when it is the only one, else through a shared auxiliary node)."""
    if fixed_low_reader:
        if producer != 1:
            net.edge(0, producer, cost)
    elif len(consumers) == 1:
        net.edge(consumers[0], producer, cost)
    elif consumers:
        aux = net.node()
        net.edge(aux, producer, cost)
        for c in consumers:
            net.edge(c, aux, _INF)
