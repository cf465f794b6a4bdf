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
from mixprec.report.layer_order import longest_path_layers, order_layers

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
    boxes = _plain_boxes(text, folded, box_w, box_h)
    items = _band_items(boxes.left, boxes.top, boxes.routes, boxes.row_of, box_w, box_h)
    band_of_row, extents = _bands(boxes.rows, boxes.height, items, gap)

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
    band_of = {i: band_of_row[boxes.row_of[i]] for i in folded.nodes}
    _place_in_bands(layout, boxes, band_of, offsets, bands)
    stub = (0.3 if labelled else 0.16) * 72 / 2
    for p, i in folded.edges():
        spline = boxes.routes.get((p, i), [])
        layout.edges.append(_edge_route(layout, p, i, spline, offsets[band_of[i]], stub))
    return layout


@dataclass
class _PlainBoxes:
    """The boxes and edge routes of dot's output, in points with y downwards.

    Attributes:
        left: Per node, the x of its box's left side.
        top: Per node, the y of its box's top.
        routes: Per edge (producer, consumer), its spline points.
        rows: The distinct box tops (rounded to 0.1), top to bottom.
        row_of: Per node, the index of its row in `rows`.
        height: The drawing's height.
    """

    left: dict[int, float]
    top: dict[int, float]
    routes: dict[tuple[int, int], list[tuple[float, float]]]
    rows: list[float]
    row_of: dict[int, int]
    height: float


def _plain_boxes(text: str, folded: FoldedGraph, box_w: float, box_h: float) -> _PlainBoxes:
    """Read dot's ``-Tplain`` `text` into boxes of `box_w` by `box_h` (top-left corners, y
    downwards) grouped into rows, and edge routes; ValueError when a drawn node is missing."""
    height, centres, splines = _parse_plain(text)
    if height is None or set(centres) != set(folded.nodes):
        raise ValueError("nodes missing")
    left = {i: x - box_w / 2 for i, (x, _) in centres.items()}
    top = {i: height - y - box_h / 2 for i, (_, y) in centres.items()}
    rows = sorted({round(t, 1) for t in top.values()})
    row_index = {t: r for r, t in enumerate(rows)}
    row_of = {i: row_index[round(t, 1)] for i, t in top.items()}
    return _PlainBoxes(left, top, _flipped_routes(splines, height), rows, row_of, height)


def _flipped_routes(
    splines: dict[tuple[int, int], list[tuple[float, float]]], height: float
) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """The well-formed `splines` (a start point, then three points per Bézier segment) with y
    turned downwards in a drawing of `height`."""
    return {
        (p, i): [(x, height - y) for x, y in pts]
        for (p, i), pts in splines.items()
        if len(pts) >= 4 and (len(pts) - 1) % 3 == 0
    }


def _place_in_bands(
    layout: GraphLayout,
    boxes: _PlainBoxes,
    band_of: dict[int, int],
    offsets: dict[int, tuple[float, float]],
    bands: list[int],
) -> None:
    """Put each node of `band_of` (node -> its band) into `layout`: its box shifted by its
    band's offset, its row as rank and its band's position in `bands` as column."""
    for i, band in band_of.items():
        dx, dy = offsets[band]
        layout.x[i], layout.y[i] = boxes.left[i] + dx, boxes.top[i] + dy
        layout.rank[i] = boxes.row_of[i]
        layout.column[i] = bands.index(band)


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


def _builtin_layout(folded: FoldedGraph, labelled: bool) -> GraphLayout:
    """Layers top to bottom, one row per layer (wrapped when wide); a deep graph continues in
    further columns to the right, like a newspaper."""
    box_w, box_h = _box_size(labelled)
    grid = _Grid.of(labelled)
    columns = _newspaper_columns(_wrapped_layers(folded, grid.per_row), grid)
    layout = GraphLayout(BUILT_IN, 0, 0, box_w, box_h, labelled)
    left = _place_columns(layout, columns, grid)
    layout.width = round(left - grid.gap + grid.margin)
    layout.height = round(
        grid.margin * 2 + max(len(c) for c in columns) * grid.step_y - (grid.step_y - box_h)
    )
    stub = (grid.step_y - box_h) / 2
    layout.edges.extend(_builtin_edge(layout, p, i, grid.step_y, stub) for p, i in folded.edges())
    return layout


@dataclass(frozen=True)
class _Grid:
    """Spacing of the built-in layout: the pitch of boxes across (`step_x`) and down
    (`step_y`), the most boxes in a row, the margin around the drawing and the gap between
    columns."""

    step_x: int
    step_y: int
    per_row: int
    margin: int
    gap: int

    @staticmethod
    def of(labelled: bool) -> _Grid:
        """The spacing for labelled boxes or for small unlabelled ones."""
        step_x, step_y, per_row = (104, 44, 10) if labelled else (15, 24, 70)
        return _Grid(step_x, step_y, per_row, 8, 36 if labelled else 14)


def _wrapped_layers(folded: FoldedGraph, per_row: int) -> list[list[int]]:
    """The rows of the drawing: the longest-path layers in their crossing-reduced order, each
    wrapped into rows of at most `per_row` nodes."""
    layer = longest_path_layers(folded)
    by_layer: list[list[int]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for i in folded.nodes:
        by_layer[layer[i]].append(i)
    return [
        nodes[start : start + per_row]
        for nodes in order_layers(by_layer, folded.edges())
        for start in range(0, len(nodes), per_row)
    ]


def _newspaper_columns(rows: list[list[int]], grid: _Grid) -> list[list[list[int]]]:
    """The rows split into as many columns as fit :data:`DRAWING_WIDTH`, until the drawing is
    no taller than :data:`DRAWING_HEIGHT` (one empty row when there are no rows)."""
    columns = _split_rows(rows, 1) if rows else [[[]]]
    count = 1
    while len(columns[0]) * grid.step_y > DRAWING_HEIGHT and count < len(rows):
        count += 1
        candidate = _split_rows(rows, count)
        if _columns_width(candidate, grid) > DRAWING_WIDTH:
            break
        columns = candidate
    return columns


def _split_rows(rows: list[list[int]], count: int) -> list[list[list[int]]]:
    """`rows` cut into `count` columns of equal length (the last may be shorter, or missing
    when the rows run out)."""
    per_column = -(-len(rows) // count)
    return [rows[j : j + per_column] for j in range(0, len(rows), per_column)]


def _columns_width(columns: list[list[list[int]]], grid: _Grid) -> int:
    """The width of `columns` set side by side: each as wide as its widest row, gaps between."""
    widths = sum(max(len(r) for r in c) * grid.step_x for c in columns)
    return widths + grid.gap * (len(columns) - 1)


def _place_columns(layout: GraphLayout, columns: list[list[list[int]]], grid: _Grid) -> float:
    """Put the nodes of `columns` into `layout`, each row centred in its column and ranked top
    to bottom, column after column; return the x after the last column and its gap."""
    step_x = grid.step_x
    left = float(grid.margin)
    rank = 0
    for c, column in enumerate(columns):
        column_w = max(len(r) for r in column) * step_x
        for r, row in enumerate(column):
            x0 = left + (column_w - len(row) * step_x) / 2 + (step_x - layout.box_w) / 2
            for k, i in enumerate(row):
                layout.x[i] = x0 + k * step_x
                layout.y[i] = grid.margin + r * grid.step_y
                layout.rank[i] = rank
                layout.column[i] = c
            rank += 1
        left += column_w + grid.gap
    return left


def _builtin_edge(layout: GraphLayout, p: int, i: int, step_y: int, stub: float) -> EdgeRoute:
    """The edge from `p` to `i`: a curve within a column (bending just above the consumer when
    it skips rows), else stubs out of the producer and into the consumer."""
    x1, y1 = layout.x[p] + layout.box_w / 2, layout.y[p] + layout.box_h
    x2, y2 = layout.x[i] + layout.box_w / 2, layout.y[i]
    if layout.column[p] != layout.column[i]:
        return EdgeRoute(p, i, *_stubs(x1, y1, x2, y2, stub))
    ym = (y1 + y2) / 2 if y2 - y1 <= step_y else y2 - stub
    path = f"M{x1:.0f} {y1:.0f}C{x1:.0f} {ym:.0f} {x2:.0f} {ym:.0f} {x2:.0f} {y2:.0f}"
    mid = _spline_middle([(x1, y1), (x1, ym), (x2, ym), (x2, y2)])
    return EdgeRoute(p, i, path, mid)
