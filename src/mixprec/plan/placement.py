"""Cast placement by cost: a minimum cut over the free nodes between fixed-precision ones.

The planner's passes decide a follow-class node from its neighbours ("widest input", then "what
the consumers need"), which puts every Cast next to the node that forced it. Here the nodes whose
precision only those rules decided ("free" nodes) are decided again, together, by cost; so are
the low-class ops the policy lowered that are not compute-bound (normalizations), which only
save traffic in 16 bits:

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain, compress, repeat

import onnx_ir as ir

from mixprec.analysis.constants import is_constant
from mixprec.analysis.cost_model import (
    CAST_BYTES_PER_ELEMENT,
    FP32_EXTRA_BYTES_PER_ELEMENT,
    SYMBOLIC_DIM,
    guessed_elements,
)
from mixprec.analysis.qdq import role as qdq_role
from mixprec.plan.model import Category, NodeFacts, Precision, PrecisionPlan
from mixprec.policy.costs import runtime_cost
from mixprec.policy.opfacts import op_facts
from mixprec.policy.table import OpClass

__all__ = ["Island", "PlannerView", "min_cut_islands"]

_INF = 1 << 256  # beyond any sum of byte costs (Python integers do not overflow)
_CAST_BYTES = CAST_BYTES_PER_ELEMENT
_FP32_EXTRA_BYTES = FP32_EXTRA_BYTES_PER_ELEMENT
_UNKNOWN_ELEMENTS = SYMBOLIC_DIM * SYMBOLIC_DIM  # tensors of unknown shape: one consistent guess
_FREE_CATEGORIES = frozenset({Category.FOLLOW, Category.CONSUMERS})
_NO_INPUTS: frozenset[int] = frozenset()


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
        heads, to = self.heads, self.to
        e = len(to)
        heads[a].append(e)
        heads[b].append(e + 1)
        to += (b, a)
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
        if fixed_high:
            return True
        for c in consumers:  # loops, not all() over a generator: this runs once per value
            if not low[c]:
                return True
        return False
    if fixed_low:
        return True
    for c in consumers:
        if low[c]:
            return True
    return False


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


def _free_values(
    node: ir.Node, fact, fp32: frozenset[ir.Value], folded: frozenset[ir.Value] = frozenset()  # noqa: ANN001
) -> tuple[list[ir.Value], list[ir.Value]] | None:
    """The node's FP32 inputs that follow its precision (flexible ones, constants and values
    folded when the model loads aside) and its FP32 outputs (of `fp32`, the model's FP32
    tensor values); None when an FP32 input or output does not follow it (bound to a type
    variable that cannot be lowered)."""
    sig, lowerable, flexible = fact.sig, fact.lowerable, fact.flexible
    input_vars, output_vars = sig.input_vars, sig.output_vars
    inputs: list[ir.Value] = []
    for index, value in enumerate(node.inputs):
        if index in flexible or value not in fp32:
            continue
        var = input_vars[index] if index < len(input_vars) else None
        if var is None or var not in lowerable:
            return None
        if value not in folded and not is_constant(value):  # type: ignore[arg-type]
            inputs.append(value)  # type: ignore[arg-type]
    outputs: list[ir.Value] = []
    for index, value in enumerate(node.outputs):
        if value not in fp32:
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
        fp32: The model's FP32 tensor values.
        folded: Values the runtime computes once when it loads the model (constants, and what
            nodes compute from them alone): like constants, their Casts cost nothing per run.
    """

    plan: PrecisionPlan
    model_inputs: frozenset[ir.Value]
    main_outputs: frozenset[ir.Value]
    sub_outputs: frozenset[ir.Value]
    op_types: frozenset[tuple[str, str]]
    runtime: str
    is_weight_heavy: Callable[[ir.Node], bool]
    fp32: frozenset[ir.Value]
    folded: frozenset[ir.Value] = frozenset()


def _join(parent: list[int], root: int, other: int) -> int:
    """Merge the set of `other` into that of `root` (a root) in a union-find whose roots are the
    smallest members, so a node's parent never follows it; the merged set's root. Paths are
    halved on the way."""
    while (up := parent[other]) != other:
        parent[other] = other = parent[up]
    if other < root:
        parent[root] = other
        return other
    if root < other:
        parent[other] = root
    return root


def _root(parent: list[int], node: int) -> int:
    """The root of `node`'s set in the union-find of `_join`."""
    while (up := parent[node]) != node:
        parent[node] = node = parent[up]
    return node


class _Islands:
    """The free nodes of a planner, their islands, and each island as plain data.

    Free nodes are numbered in graph order; `nodes`, `low` and `touched` are indexed by number.
    Islands are joined as the nodes are found (each value a free node reads joins its free
    readers and its free producer), so no second walk over the values is needed.
    """

    def __init__(self, planner: PlannerView) -> None:
        self.planner = planner
        self.view = planner.plan
        self.facts = planner.plan.facts
        self.model_inputs = planner.model_inputs
        self.graph_outputs = planner.main_outputs | planner.sub_outputs  # see `_output_wants`
        self.quantized = any(op_facts(domain, op).quantization for op, domain in planner.op_types)
        self.free: dict[ir.Node, int] = {}  # free node -> its number
        self.nodes: list[ir.Node] = []
        self.low: list[bool] = []  # the passes' assignment (True: 16-bit)
        self.touched: list[list[ir.Value]] = []  # the free FP32 inputs, then outputs
        # Free nodes the forward pass kept FP32 for an FP32 input that may not fit the 16-bit type
        # (an output of an FP32 node neither bounded nor measured, or what such nodes compute
        # from it): "follows FP32 input"; number -> its free outputs.
        self.tainted_outputs: dict[int, list[ir.Value]] = {}
        self.flexible: dict[ir.Node, frozenset[int]] = {}  # free node -> inputs read as they are
        self.flexible_reads: list[tuple[int, ir.Value]] = []  # (free node, value it reads so)
        self.parent: list[int] = []  # union-find of the islands
        self.anchors: dict[ir.Value, int] = {}  # value a free node reads -> a node of its island
        self._elements: dict[int, int] = {}  # id(shape) -> elements (the values keep their shapes alive)
        self.is_weight_heavy = planner.is_weight_heavy
        decisions, facts = planner.plan.decisions, self.facts
        free, low, touched, parent = self.free, self.low, self.touched, self.parent
        for node in planner.plan.order:
            decision = decisions[node]
            if decision.precision is Precision.NONE or not (
                decision.category in _FREE_CATEGORIES
                or (decision.category is Category.POLICY and decision.precision is Precision.LOW)
            ):
                continue  # not decided by the follow rules alone, nor lowered by the policy
            fact = facts[node]
            found = self._free_node_values(node, fact)
            if found is None:
                continue
            inputs, outputs = found
            k = free[node] = len(parent)
            parent.append(k)
            low.append(decision.precision is Precision.LOW)
            touched.append(inputs + outputs)
            tainted = decision.category is Category.FOLLOW and decision.precision is Precision.FP32
            if tainted or fact.flexible:
                self._note_tainted_or_flexible(k, node, tainted, fact.flexible, outputs)
            self._join_reads(k, inputs, outputs)
        self.nodes = list(free)

    def _free_node_values(
        self, node: ir.Node, fact: NodeFacts
    ) -> tuple[list[ir.Value], list[ir.Value]] | None:
        """The FP32 inputs and outputs (:func:`_free_values`) of a free node: a lowerable
        follow-class op the follow rules alone decided, or a low-class op that is not
        compute-bound (a normalization: in 16 bits between FP32 neighbours it saves less traffic
        than its two casts move), without a dtype attribute, no part of a Q/DQ group and not kept
        for its weight; None otherwise."""
        rule = fact.rule
        if (
            rule is None or rule.dtype_attribute is not None or fact.sig is None or not fact.lowerable
            or not (rule.op_class is OpClass.FOLLOW or (rule.op_class is OpClass.LOW and not rule.compute_bound))
        ):
            return None
        if self.quantized and (qdq_role(node) is not None or _next_to_qdq(node)):
            return None  # Q/DQ pairs have rules of their own (mixprec.plan.qdq_pairs)
        found = _free_values(node, fact, self.planner.fp32, self.planner.folded)
        if found is None or self.is_weight_heavy(node):
            return None
        return found

    def _note_tainted_or_flexible(
        self, k: int, node: ir.Node, tainted: bool, flexible: frozenset[int], outputs: list[ir.Value],
    ) -> None:
        """Note what free node `k` needs beyond the common case: it follows an FP32 input that may
        not fit (`tainted`), or it reads some inputs as they are (`flexible`)."""
        if tainted:
            self.tainted_outputs[k] = outputs
        if flexible:
            self.flexible[node] = flexible
            self.flexible_reads += ((k, node.inputs[i]) for i in flexible if i < len(node.inputs))

    def _join_reads(self, k: int, inputs: list[ir.Value], outputs: list[ir.Value]) -> None:
        """Join free node `k` with the islands of the values it reads (the producer if free, the
        free readers before it) and of its outputs that a free node read before it came."""
        anchors, parent, free, root = self.anchors, self.parent, self.free, k
        for value in inputs:
            anchor = anchors.setdefault(value, k)
            if anchor == k:  # its first free reader: joins its producer if that is free
                anchor = free.get(value.producer())  # type: ignore[arg-type]
                if anchor is None:
                    continue
            root = _join(parent, root, anchor)
        for value in outputs:
            anchor = anchors.get(value)  # a free node before it read it (order not topological)
            if anchor is not None:
                root = _join(parent, root, anchor)

    def _size(self, values: dict[ir.Value, int]) -> None:
        """Map each of `values` to its estimated elements: every dimension that is not static as
        `SYMBOLIC_DIM`, an unknown shape as `_UNKNOWN_ELEMENTS` (costs must exist for every value
        of an island); remembered per shape object (equal static shapes share one)."""
        known = self._elements
        for value in values:
            shape = value.shape
            if shape is None:
                values[value] = _UNKNOWN_ELEMENTS
                continue
            found = known.get(id(shape))
            if found is None:
                guessed = guessed_elements(shape)
                found = known[id(shape)] = guessed if guessed is not None else _UNKNOWN_ELEMENTS
            values[value] = found

    def groups(self) -> list[list[int]]:
        """Islands (their free node numbers, in graph order): free nodes connected through a value
        one produces or they read, in any input (one Cast of it serves them all)."""
        parent, anchors = self.parent, self.anchors
        for k, value in self.flexible_reads:  # joins a value only some free node reads as FP32
            anchor = anchors.get(value)
            if anchor is not None:
                _join(parent, _root(parent, k), anchor)
        for k, up in enumerate(parent):
            parent[k] = parent[up]  # `up` precedes k: its parent is already its root
        out: dict[int, list[int]] = {}
        for k, root in enumerate(parent):
            out.setdefault(root, []).append(k)
        return list(out.values())

    def problem(
        self, members: list[int], greedy: tuple[bool, ...]
    ) -> tuple[tuple, tuple[int, int]] | None:
        """The island of free nodes `members` as plain data (local indices in graph order), with
        the (casts, bytes) of the passes' assignment `greedy`; None when that assignment has no
        Cast (nothing to improve). Repeated structures (the layers of a network) give equal
        problems, solved once.

        Nodes: (elements read and written, constraint, readers) with constraint 0 (none),
        1 (stays FP32: arithmetic on a value 16 bits may not hold) or 2 (16-bit only if each
        reader is: local indices, -1 for a fixed FP32 reader). Values: (elements, producer index
        or -1 / -2 for a fixed 16-bit / FP32 producer, free reader indices, a fixed reader wants
        16 bits, a fixed reader wants FP32).
        """
        nodes = list(map(self.nodes.__getitem__, members))
        ids = dict(zip(nodes, range(len(nodes))))
        # value -> its elements (filled once the island has a Cast to improve)
        values = dict.fromkeys(chain.from_iterable(map(self.touched.__getitem__, members)), 0)
        described = self._describe(values, ids)
        casts = list(map(_needs_cast, described, repeat(greedy)))
        if not any(casts):
            return None  # sized only where there is something to improve
        self._size(values)
        value_specs = [(size, *spec[1:]) for size, spec in zip(values.values(), described)]
        before = casts.count(True), sum(compress(values.values(), casts)) * _CAST_BYTES
        return (tuple(self._node_specs(members, ids, values)), tuple(value_specs)), before

    def _describe(self, values: Iterable[ir.Value], ids: dict[ir.Node, int]) -> list[tuple]:
        """Per value: (value, producer index or -1 / -2 for a fixed 16-bit / FP32 producer, free
        reader indices, a fixed reader wants 16 bits, a fixed reader wants FP32)."""
        facts, flexible, no_inputs = self.facts, self.flexible, _NO_INPUTS
        input_is_lowered, graph_outputs = self.view.input_is_lowered, self.graph_outputs
        described: list[tuple] = []
        append = described.append
        for value in values:
            producer = value.producer()
            origin = ids.get(producer)  # type: ignore[arg-type]
            if origin is None:
                origin = self._fixed_origin(value, producer)
            readers: list[int] = []
            wants_low = wants_high = False
            for consumer, index in value.uses():
                j = ids.get(consumer)
                if j is None:
                    fact = facts.get(consumer)
                    if fact is not None and index in fact.flexible:
                        continue  # read as it is (Shape, CastLike's input): no Cast either way
                    if input_is_lowered(consumer, index):
                        wants_low = True
                    else:
                        wants_high = True
                elif not flexible or index not in flexible.get(consumer, no_inputs):
                    readers.append(j)
            if value in graph_outputs:
                wants_low, wants_high = self._output_wants(value, wants_low, wants_high)
            free_readers = tuple(sorted(set(readers))) if len(readers) > 1 else tuple(readers)
            append((value, origin, free_readers, wants_low, wants_high))
        return described

    def _fixed_origin(self, value: ir.Value, producer: ir.Node | None) -> int:
        """-1 / -2: `value` comes in 16 bits / FP32 from outside the island (a fixed node or a
        graph input)."""
        if producer is None:
            return -2 if self.view.keep_io_types or value not in self.model_inputs else -1
        return -1 if self.view.output_is_lowered(producer, producer.outputs.index(value)) else -2

    def _output_wants(self, value: ir.Value, wants_low: bool, wants_high: bool) -> tuple[bool, bool]:
        """(wants 16 bits, wants FP32) of a graph output `value` given its readers' ones."""
        if value in self.planner.sub_outputs:
            wants_high = True  # a subgraph returns it as it is, in FP32
        if value in self.planner.main_outputs:
            if self.view.keep_io_types:
                wants_high = True
            else:
                wants_low = True
        return wants_low, wants_high

    def _node_specs(
        self, members: list[int], ids: dict[ir.Node, int], sizes: dict[ir.Value, int]
    ) -> list[tuple]:
        """Per node: (elements it reads and writes, constraint, readers): constraint 0 free, 1 FP32
        (an FP32 input that may not fit), 2 16-bit only when all `readers` are."""
        size, touched, tainted = sizes.__getitem__, self.touched, self.tainted_outputs
        specs = []
        for k in members:
            elements = sum(map(size, touched[k]))
            specs.append(self._tainted_spec(k, elements, ids) if k in tainted else (elements, 0, ()))
        return specs

    def _tainted_spec(self, k: int, touched: int, ids: dict[ir.Node, int]) -> tuple:
        """The spec of free node `k`, which follows an FP32 input that may not fit (see
        `_node_specs`)."""
        node = self.nodes[k]
        if not op_facts(node.domain, node.op_type).value_preserving:
            return touched, 1, ()
        facts, keep_io_types = self.facts, self.view.keep_io_types
        main_outputs, sub_outputs = self.planner.main_outputs, self.planner.sub_outputs
        readers: set[int] = set()
        for value in self.tainted_outputs[k]:
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
    if not islands.nodes:
        return []
    low, free_nodes = islands.low, islands.nodes
    launch = round(runtime_cost(planner.runtime).launch_bytes)
    changes = []
    # Repeated layers give equal problems: each is solved once. A cut priced with launches that
    # trades cast bytes for fewer casts is not kept (cast bytes may not grow); the cut priced by
    # bytes alone is tried next.
    solved_problems: dict[tuple, tuple[tuple[bool, ...], tuple[int, int]] | None] = {}  # (problem, greedy)
    for members in islands.groups():
        greedy = tuple(map(low.__getitem__, members))
        found = islands.problem(members, greedy)
        if found is None:
            continue
        problem, before = found
        key = (problem, greedy)  # hashed once if seen before, twice if not (large ones hash slowly)
        try:
            solved = solved_problems[key]
        except KeyError:
            solved = solved_problems[key] = _best_cut(problem, greedy, before, launch)
        if solved is not None:
            assignment, after = solved
            nodes = list(map(free_nodes.__getitem__, members))
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
    edge = net.edge
    for n, (touched, constraint, readers) in enumerate(nodes, 2):
        edge(0, n, touched * _FP32_EXTRA_BYTES)  # cut when the node stays FP32
        if constraint:
            _add_constraint_edges(net, n, constraint, readers)
    for spec in values:
        elements, origin, readers, fixed_low_reader, fixed_high_reader = spec
        if origin >= 0 and len(readers) == 1 and not (fixed_low_reader or fixed_high_reader):
            cost = elements * _CAST_BYTES + launch
            edge(origin + 2, readers[0] + 2, cost, cost)  # one Cast whichever of the two is 16-bit
        else:
            _add_value_edges(net, spec, launch)
    if net.max_flow() >= _INF:
        return None
    high = net.reaching_sink()
    return tuple(n not in high for n in range(2, len(nodes) + 2))


def _add_constraint_edges(net: _Network, n: int, constraint: int, readers: tuple[int, ...]) -> None:
    """The edges that forbid what free node `n`'s constraint forbids (network id: its local index
    + 2; constraint and readers as in `_Islands.problem`)."""
    if constraint == 1:
        net.edge(n, 1, _INF)
    elif constraint == 2:
        for reader in readers:
            net.edge(n, 1 if reader < 0 else reader + 2, _INF)


def _add_value_edges(net: _Network, spec: tuple, launch: int) -> None:
    """The edges of one value (see `_Islands.problem`): its shared upcast and downcast, each
    costing its bytes and `launch` (`_solve` gives a free node's output that one free node alone
    reads a single edge instead)."""
    elements, producer_index, consumers_index, fixed_low_reader, fixed_high_reader = spec
    cost = elements * _CAST_BYTES + launch
    producer = producer_index + 2 if producer_index >= 0 else (0 if producer_index == -1 else 1)
    consumers = [c + 2 for c in consumers_index]
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
