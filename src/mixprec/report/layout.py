"""Where the HTML report's graph picture puts each node and edge.

Nodes that compute only from constants (Constant nodes, constant-only subgraphs) are folded into
their consumers and not drawn. The rest is laid out top to bottom in layers, by Graphviz ``dot``
when it is on PATH and the graph is small enough (run as a subprocess; its ``-Tplain`` node
positions and edge splines are drawn by :mod:`mixprec.report.svg`, so the page stays
self-contained), else by a built-in layered layout: longest-path layers, barycentre sweeps that
keep the order with the fewest crossings, long layers wrapped into rows and a deep graph split
into side-by-side columns.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import dataclass, field

from mixprec.report.contents import NodeGraph

# Up to this many drawn nodes, Graphviz dot lays the graph out. Measured with dot 2.43 and the
# iteration limits below, on generated graphs, 2 CPU cores: transformer-like blocks (three
# branches and two residual edges per 12 nodes) take 0.33 s at 1,000 nodes and 0.47 s at 1,200;
# the worst case tried, a chain with every other node also fed from a random node up to 60 back
# (about 30 placeholder nodes per node on long edges), takes 0.5 s at 400 nodes, 2.9 s at 800,
# 5.7 s at 1,000 and 8.9 s at 1,200.
DOT_MAX_NODES = 1000
# Seconds dot may take before the built-in layout is used instead.
DOT_TIMEOUT_S = 10.0
# Above this many drawn nodes, dot's crossing reduction and coordinate passes are bounded
# (mclimit, nslimit): below it they converge quickly anyway.
_DOT_BOUNDED_ABOVE = 200
# Up to this many drawn nodes, they are boxes labelled with their op type.
LABELLED_MAX_NODES = 400
# A tall drawing is split into side-by-side columns until it is no taller than this, as long as
# the columns fit the width.
DRAWING_WIDTH = 1090
DRAWING_HEIGHT = 900
# Barycentre sweeps of the built-in ordering, and the most placeholder nodes it adds on long
# edges (more would cost seconds on the largest graphs; long edges beyond it are left out of the
# ordering).
_SWEEPS = 8
_MAX_PLACEHOLDERS = 12000

DOT = "graphviz dot"
BUILT_IN = "built-in"


@dataclass
class FoldedGraph:
    """The nodes that are drawn, with constant producers folded into their consumers.

    Attributes:
        nodes: Drawn node indices, in the listing's (topological) order.
        preds: Per drawn node, its drawn producers.
        folded: Per drawn node, how many constant inputs were folded into it.
        constants: How many nodes were folded away.
    """

    nodes: list[int]
    preds: dict[int, list[int]]
    folded: dict[int, int]
    constants: int

    def __len__(self) -> int:
        return len(self.nodes)

    def edges(self) -> list[tuple[int, int]]:
        """(producer, consumer) pairs between drawn nodes."""
        return [(p, i) for i in self.nodes for p in self.preds[i]]


@dataclass
class EdgeRoute:
    """One drawn edge: an SVG path, and the point where a marker on it goes."""

    source: int
    target: int
    path: str
    mid: tuple[float, float]


@dataclass
class GraphLayout:
    """Positions of the drawn nodes (top-left corners of their boxes) and edge routes.

    `rank` numbers the rows top to bottom, `column` the side-by-side columns a tall drawing is
    split into; every edge goes from a lower rank to a higher one, and downwards within a column.
    `note` says why the built-in layout was used ("" when dot laid the graph out).
    """

    engine: str
    width: float
    height: float
    box_w: float
    box_h: float
    labelled: bool
    x: dict[int, float] = field(default_factory=dict)
    y: dict[int, float] = field(default_factory=dict)
    rank: dict[int, int] = field(default_factory=dict)
    column: dict[int, int] = field(default_factory=dict)
    edges: list[EdgeRoute] = field(default_factory=list)
    note: str = ""


class _DotFailed(Exception):
    """Graphviz dot did not give a usable layout (the message says why)."""


def constant_flags(graph: NodeGraph) -> list[bool]:
    """Per node, whether it computes only from constants (a listing without the flags: only
    Constant nodes)."""
    if len(graph.constant) == len(graph):
        return [c == "1" for c in graph.constant]
    return [op == "Constant" for op in graph.op_types]


def fold_constants(graph: NodeGraph) -> FoldedGraph:
    """The drawn part of `graph`: every node but the constant producers (all nodes when nothing
    else is left)."""
    constant = constant_flags(graph)
    nodes = [i for i in range(len(graph)) if not constant[i]]
    if not nodes:
        nodes, constant = list(range(len(graph))), [False] * len(graph)
    known = len(graph.constant_inputs) == len(graph)
    preds = {i: [p for p in graph.inputs[i] if p < i and not constant[p]] for i in nodes}
    folded = {
        i: graph.constant_inputs[i] if known else sum(1 for p in graph.inputs[i] if constant[p])
        for i in nodes
    }
    return FoldedGraph(nodes, preds, folded, len(graph) - len(nodes))


def layout_graph(folded: FoldedGraph, *, use_dot: bool = True) -> GraphLayout:
    """Lay `folded` out: with Graphviz dot when asked, found on PATH and the graph has at most
    :data:`DOT_MAX_NODES` nodes; with the built-in layout otherwise or when dot fails."""
    labelled = len(folded) <= LABELLED_MAX_NODES
    if not use_dot:
        reason = "graphviz dot not used"
    elif len(folded) > DOT_MAX_NODES:
        reason = f"over {DOT_MAX_NODES:,} nodes for graphviz dot"
    elif (program := shutil.which("dot")) is None:
        reason = "graphviz dot not found"
    else:
        try:
            return _dot_layout(program, folded, labelled)
        except _DotFailed as error:
            reason = str(error)
    layout = _builtin_layout(folded, labelled)
    layout.note = reason
    return layout


def _box_size(labelled: bool) -> tuple[float, float]:
    return (96.0, 22.0) if labelled else (11.0, 11.0)


# ---------------------------------------------------------------------------------------------
# Graphviz dot


def dot_source(folded: FoldedGraph, labelled: bool) -> str:
    """The graph in the dot language: fixed-size unlabelled boxes named ``n<index>``."""
    box_w, box_h = _box_size(labelled)
    bounded = len(folded) > _DOT_BOUNDED_ABOVE
    graph_attrs = [
        "rankdir=TB",
        f"nodesep={0.12 if labelled else 0.07}",
        f"ranksep={0.3 if labelled else 0.16}",
        "margin=0",
    ]
    if bounded:
        graph_attrs += ["mclimit=0.5", "nslimit=1", "nslimit1=1"]
    lines = [
        "digraph mixprec {",
        f"graph [{', '.join(graph_attrs)}];",
        f'node [shape=box, fixedsize=true, width={box_w / 72:.4f}, height={box_h / 72:.4f}, '
        'label=""];',
        "edge [arrowhead=none];",
    ]
    lines += [f"n{i};" for i in folded.nodes]
    lines += [f"n{p} -> n{i};" for p, i in folded.edges()]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_layout(program: str, folded: FoldedGraph, labelled: bool) -> GraphLayout:
    source = dot_source(folded, labelled)
    try:
        done = subprocess.run(
            [program, "-Tplain"],
            input=source,
            capture_output=True,
            text=True,
            timeout=DOT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise _DotFailed(f"graphviz dot took over {DOT_TIMEOUT_S:g} s") from None
    except OSError as error:
        raise _DotFailed(f"graphviz dot could not run: {error.strerror or error}") from None
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
        raise _DotFailed(f"graphviz dot failed: {first[:120]}")
    try:
        return _read_plain(done.stdout, folded, labelled)
    except (ValueError, IndexError, KeyError) as error:
        raise _DotFailed(f"graphviz dot gave unreadable output ({error})") from None


def _read_plain(text: str, folded: FoldedGraph, labelled: bool) -> GraphLayout:
    """Positions from dot's ``-Tplain`` output (inches, y upwards) in pixels, y downwards. A
    tall drawing is cut between rows into bands set side by side (more bands while the drawing
    is taller than :data:`DRAWING_HEIGHT` and they fit :data:`DRAWING_WIDTH`); an edge from one
    band to another is drawn as a stub out of its producer and one into its consumer."""
    margin, gap = 8.0, 36.0 if labelled else 14.0
    box_w, box_h = _box_size(labelled)
    height, centres, splines = _parse_plain(text)
    if height is None or set(centres) != set(folded.nodes):
        raise ValueError("nodes missing")
    # From here y points downwards; boxes are given by their top-left corners.
    left = {i: x - box_w / 2 for i, (x, _) in centres.items()}
    top = {i: height - y - box_h / 2 for i, (_, y) in centres.items()}
    routes = {
        (p, i): [(x, height - y) for x, y in pts]
        for (p, i), pts in splines.items()
        if len(pts) >= 4 and (len(pts) - 1) % 3 == 0
    }
    rows = sorted({round(t, 1) for t in top.values()})
    row_index = {t: r for r, t in enumerate(rows)}
    row_of = {i: row_index[round(t, 1)] for i, t in top.items()}
    items = _band_items(left, top, routes, row_of, box_w, box_h)
    band_of_row, extents = _bands(rows, height, items, gap)

    bands = sorted(extents)
    offsets, right = _band_offsets(bands, extents, margin, gap)
    layout = GraphLayout(
        DOT,
        width=round(right - gap + margin),
        height=round(max(y1 - y0 for _, _, y0, y1 in extents.values()) + 2 * margin),
        box_w=box_w,
        box_h=box_h,
        labelled=labelled,
    )
    for i in folded.nodes:
        band = band_of_row[row_of[i]]
        dx, dy = offsets[band]
        layout.x[i], layout.y[i] = left[i] + dx, top[i] + dy
        layout.rank[i] = row_of[i]
        layout.column[i] = bands.index(band)
    stub = (0.3 if labelled else 0.16) * 72 / 2
    for p, i in folded.edges():
        spline = routes.get((p, i), [])
        layout.edges.append(_edge_route(layout, p, i, spline, offsets[band_of_row[row_of[i]]], stub))
    return layout



def _band_items(
    left: dict[int, float],
    top: dict[int, float],
    routes: dict[tuple[int, int], list[tuple[float, float]]],
    row_of: dict[int, int],
    box_w: float,
    box_h: float,
) -> list[tuple[int, int, float, float, float, float]]:
    """What each band must hold: boxes, and the splines of edges within one band, as (first row,
    last row, x0, x1, y0, y1)."""
    items = [(row_of[i], row_of[i], x, x + box_w, top[i], top[i] + box_h) for i, x in left.items()]
    items += [
        (row_of[p], row_of[i], min(x for x, _ in pts), max(x for x, _ in pts), math.inf, -math.inf)
        for (p, i), pts in routes.items()
    ]
    return items

def _edge_route(
    layout: GraphLayout, p: int, i: int, spline: list[tuple[float, float]], offset: tuple[float, float], stub: float
) -> EdgeRoute:
    """The drawn edge from `p` to `i`: stubs between columns, else dot's `spline` shifted by its
    band's `offset` (a straight curve when dot gave none)."""
    x1, y1 = layout.x[p] + layout.box_w / 2, layout.y[p] + layout.box_h
    x2, y2 = layout.x[i] + layout.box_w / 2, layout.y[i]
    if layout.column[p] != layout.column[i]:
        return EdgeRoute(p, i, *_stubs(x1, y1, x2, y2, stub))
    dx, dy = offset
    pts = [(x + dx, y + dy) for x, y in spline]
    if not pts:
        pts = [(x1, y1), (x1, y1), (x2, y2), (x2, y2)]
    return EdgeRoute(p, i, _spline_path(pts), _spline_middle(pts))


def _parse_plain(
    text: str,
) -> tuple[float | None, dict[int, tuple[float, float]], dict[tuple[int, int], list[tuple[float, float]]]]:
    """The drawing's height, node centres and edge splines of dot's ``-Tplain`` output, in
    points (y upwards); the height is None without a ``graph`` line."""
    height: float | None = None
    centres: dict[int, tuple[float, float]] = {}
    splines: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "graph":
            if not math.isclose(float(parts[1]), 1.0):
                raise ValueError(f"scale {parts[1]}")
            height = float(parts[3]) * 72
        elif parts[0] == "node":
            centres[int(parts[1][1:])] = (float(parts[2]) * 72, float(parts[3]) * 72)
        elif parts[0] == "edge":
            count = int(parts[3])
            values = [float(v) * 72 for v in parts[4 : 4 + 2 * count]]
            splines[(int(parts[1][1:]), int(parts[2][1:]))] = list(zip(values[::2], values[1::2]))
    return height, centres, splines


def _band_offsets(
    bands: list[int], extents: dict[int, tuple[float, float, float, float]], margin: float, gap: float
) -> tuple[dict[int, tuple[float, float]], float]:
    """The shift of each band when set side by side left to right, and the x after the last
    band and its gap."""
    offsets: dict[int, tuple[float, float]] = {}
    x = margin
    for b in bands:
        x0, x1, y0, _ = extents[b]
        offsets[b] = (x - x0, margin - y0)
        x += x1 - x0 + gap
    return offsets, x


def _spline_path(pts: list[tuple[float, float]]) -> str:
    """SVG path data of a chain of cubic Bézier segments (start point, then three per segment)."""
    return f"M{pts[0][0]:.1f} {pts[0][1]:.1f}" + "".join(
        f"C{a[0]:.1f} {a[1]:.1f} {b[0]:.1f} {b[1]:.1f} {c[0]:.1f} {c[1]:.1f}"
        for a, b, c in zip(pts[1::3], pts[2::3], pts[3::3])
    )


def _bands(
    rows: list[float],
    height: float,
    items: list[tuple[int, int, float, float, float, float]],
    gap: float,
) -> tuple[list[int], dict[int, tuple[float, float, float, float]]]:
    """Cut the rows (their tops) into bands of about equal height: the band of each row, and each
    band's extent (x0, x1, y0, y1) over the `items` (first row, last row, x0, x1, y0, y1) that lie
    in it."""
    chosen: tuple[list[int], dict[int, tuple[float, float, float, float]]] = ([], {})
    for count in range(1, len(rows) + 1):
        band_of_row = [min(count - 1, int(t * count / max(height, 1.0))) for t in rows]
        extents: dict[int, tuple[float, float, float, float]] = {}
        for first, last, x0, x1, y0, y1 in items:
            band = band_of_row[first]
            if band_of_row[last] != band:
                continue
            e = extents.get(band, (math.inf, -math.inf, math.inf, -math.inf))
            extents[band] = (min(e[0], x0), max(e[1], x1), min(e[2], y0), max(e[3], y1))
        width = sum(e[1] - e[0] for e in extents.values()) + gap * (len(extents) - 1)
        if count > 1 and width > DRAWING_WIDTH:
            break
        chosen = band_of_row, extents
        if max(e[3] - e[2] for e in extents.values()) <= DRAWING_HEIGHT:
            break
    return chosen


def _stubs(
    x1: float, y1: float, x2: float, y2: float, stub: float
) -> tuple[str, tuple[float, float]]:
    """An edge that continues in another column: a stub with an arrowhead out of the producer
    (bottom at x1, y1) and one into the consumer (top at x2, y2); the marker point is on the
    second."""
    path = (
        f"M{x1:.0f} {y1:.0f}v{stub * 0.8:.0f}m-3 -3l3 3 3 -3"
        f"M{x2:.0f} {y2 - stub * 0.8:.0f}V{y2:.0f}"
    )
    return path, (x2, y2 - stub * 0.4)


def _spline_middle(pts: list[tuple[float, float]]) -> tuple[float, float]:
    """The middle of a chain of cubic Bézier segments (start point, then three per segment)."""
    segments = (len(pts) - 1) // 3
    if segments % 2 == 0:
        return pts[3 * segments // 2]
    p0, p1, p2, p3 = pts[3 * (segments // 2) : 3 * (segments // 2) + 4]
    return (
        (p0[0] + 3 * p1[0] + 3 * p2[0] + p3[0]) / 8,
        (p0[1] + 3 * p1[1] + 3 * p2[1] + p3[1]) / 8,
    )


# ---------------------------------------------------------------------------------------------
# Built-in layered layout


def longest_path_layers(folded: FoldedGraph) -> dict[int, int]:
    """Layer of every drawn node: 0 without drawn producers, else one below its lowest one."""
    layer: dict[int, int] = {}
    for i in folded.nodes:
        layer[i] = 1 + max((layer[p] for p in folded.preds[i]), default=-1)
    return layer


def order_layers(layers: list[list[int]], edges: list[tuple[int, int]]) -> list[list[int]]:
    """Reorder each layer to reduce edge crossings: alternating downward and upward barycentre
    sweeps over the layers with placeholders on long edges; the order with the fewest crossings
    wins. `edges` go from a lower layer to a higher one."""
    order = [list(nodes) for nodes in layers]
    steps = _one_layer_steps(order, edges)
    up: dict[int, list[int]] = {}
    down: dict[int, list[int]] = {}
    for u, v in steps:
        down.setdefault(u, []).append(v)
        up.setdefault(v, []).append(u)

    best = [list(nodes) for nodes in order]
    best_crossings = count_crossings(order, steps)
    for sweep in range(_SWEEPS):
        if best_crossings == 0:
            break
        downward = sweep % 2 == 0
        _barycentre_sweep(order, up if downward else down, downward)
        crossings = count_crossings(order, steps)
        if crossings < best_crossings:
            best, best_crossings = [list(nodes) for nodes in order], crossings
    return [[v for v in nodes if v >= 0] for nodes in best]


def _one_layer_steps(order: list[list[int]], edges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The edges as one-layer steps: placeholders (negative ids, appended to the layers of
    `order`) split long edges, shortest edges first, while :data:`_MAX_PLACEHOLDERS` allows."""
    layer_of = {v: k for k, nodes in enumerate(order) for v in nodes}
    steps: list[tuple[int, int]] = []
    budget = _MAX_PLACEHOLDERS
    next_id = -1
    for u, v in sorted(edges, key=lambda e: layer_of[e[1]] - layer_of[e[0]]):
        span = layer_of[v] - layer_of[u]
        if span == 1:
            steps.append((u, v))
            continue
        if span - 1 > budget:
            continue
        budget -= span - 1
        previous = u
        for k in range(layer_of[u] + 1, layer_of[v]):
            order[k].append(next_id)
            steps.append((previous, next_id))
            previous, next_id = next_id, next_id - 1
        steps.append((previous, v))
    return steps


def _barycentre_sweep(order: list[list[int]], neighbours: dict[int, list[int]], downward: bool) -> None:
    """Sort each layer of `order` in place by the mean position of its nodes' `neighbours` in
    the layer before it (`downward`) or after it."""
    indices = range(1, len(order)) if downward else range(len(order) - 2, -1, -1)
    for k in indices:
        fixed = order[k - 1] if downward else order[k + 1]
        position = {v: p for p, v in enumerate(fixed)}
        stretch = len(fixed) / max(len(order[k]), 1)
        keys: dict[int, tuple[float, int]] = {}
        for here, v in enumerate(order[k]):
            linked = [position[w] for w in neighbours.get(v, ()) if w in position]
            # Without a neighbour on that side a node keeps its relative place.
            centre = sum(linked) / len(linked) if linked else here * stretch
            keys[v] = (centre, here)
        order[k].sort(key=keys.__getitem__)


def count_crossings(order: list[list[int]], edges: list[tuple[int, int]]) -> int:
    """Crossings between the edges of adjacent layers (edges spanning more layers are skipped),
    counted as inversions with a Fenwick tree."""
    position = {v: p for nodes in order for p, v in enumerate(nodes)}
    layer_of = {v: k for k, nodes in enumerate(order) for v in nodes}
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for u, v in edges:
        if u in layer_of and v in layer_of and layer_of[v] == layer_of[u] + 1:
            by_layer.setdefault(layer_of[u], []).append((position[u], position[v]))
    total = 0
    for k, pairs in by_layer.items():
        size = len(order[k + 1])
        tree = [0] * (size + 1)
        pairs.sort()
        for seen, (_, target) in enumerate(pairs):
            at_most = 0
            j = target + 1
            while j > 0:
                at_most += tree[j]
                j -= j & -j
            total += seen - at_most
            j = target + 1
            while j <= size:
                tree[j] += 1
                j += j & -j
    return total


def _builtin_layout(folded: FoldedGraph, labelled: bool) -> GraphLayout:
    """Layers top to bottom, one row per layer (wrapped when wide); a deep graph continues in
    further columns to the right, like a newspaper."""
    box_w, box_h = _box_size(labelled)
    step_x, step_y, per_row = (104, 44, 10) if labelled else (15, 24, 70)
    margin, gap = 8, (36 if labelled else 14)
    layer = longest_path_layers(folded)
    by_layer: list[list[int]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for i in folded.nodes:
        by_layer[layer[i]].append(i)
    rows = [
        nodes[start : start + per_row]
        for nodes in order_layers(by_layer, folded.edges())
        for start in range(0, len(nodes), per_row)
    ]

    # As many columns as fit DRAWING_WIDTH, until the drawing is no taller than DRAWING_HEIGHT.
    def split(count: int) -> list[list[list[int]]]:
        per_column = -(-len(rows) // count)
        return [rows[j : j + per_column] for j in range(0, len(rows), per_column)]

    def drawing_width(columns: list[list[list[int]]]) -> int:
        return sum(max(len(r) for r in c) * step_x for c in columns) + gap * (len(columns) - 1)

    columns = split(1) if rows else [[[]]]
    count = 1
    while len(columns[0]) * step_y > DRAWING_HEIGHT and count < len(rows):
        count += 1
        candidate = split(count)
        if drawing_width(candidate) > DRAWING_WIDTH:
            break
        columns = candidate

    layout = GraphLayout(BUILT_IN, 0, 0, box_w, box_h, labelled)
    left = float(margin)
    rank = 0
    for c, column in enumerate(columns):
        column_w = max(len(r) for r in column) * step_x
        for r, row in enumerate(column):
            x0 = left + (column_w - len(row) * step_x) / 2 + (step_x - box_w) / 2
            for k, i in enumerate(row):
                layout.x[i] = x0 + k * step_x
                layout.y[i] = margin + r * step_y
                layout.rank[i] = rank
                layout.column[i] = c
            rank += 1
        left += column_w + gap
    layout.width = round(left - gap + margin)
    layout.height = round(margin * 2 + max(len(c) for c in columns) * step_y - (step_y - box_h))

    stub = (step_y - box_h) / 2
    for p, i in folded.edges():
        x1, y1 = layout.x[p] + box_w / 2, layout.y[p] + box_h
        x2, y2 = layout.x[i] + box_w / 2, layout.y[i]
        if layout.column[p] == layout.column[i]:
            ym = (y1 + y2) / 2 if y2 - y1 <= step_y else y2 - stub
            path = f"M{x1:.0f} {y1:.0f}C{x1:.0f} {ym:.0f} {x2:.0f} {ym:.0f} {x2:.0f} {y2:.0f}"
            mid = _spline_middle([(x1, y1), (x1, ym), (x2, ym), (x2, y2)])
            layout.edges.append(EdgeRoute(p, i, path, mid))
        else:
            layout.edges.append(EdgeRoute(p, i, *_stubs(x1, y1, x2, y2, stub)))
    return layout
