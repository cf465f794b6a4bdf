"""The inline SVG pictures of the HTML report: the graph coloured by precision (a layered
drawing from :mod:`mixprec.report.layout`, or for large graphs a strip with one cell per node and
a chart of precision by depth), the share bar and the per-node error chart."""

from __future__ import annotations

import html
import math
from collections import Counter
from collections.abc import Callable, Sequence

from mixprec.report.layout import (
    BUILT_IN,
    FoldedGraph,
    GraphLayout,
    fold_constants,
    layout_graph,
    longest_path_layers,
)
from mixprec.report.contents import NodeGraph, Report

# Graphs with at most this many drawn nodes (constant producers folded) are drawn as a layered
# graph; larger ones as a strip.
FULL_GRAPH_MAX_NODES = 3000
# Strip cells that carry their own tooltip (FP32 nodes); beyond this they are merged in runs.
MAX_STRIP_TOOLTIPS = 20000
# Bars in the per-node error chart; more nodes share a bar (its height is their worst error).
MAX_ERROR_BARS = 500

_COLOURS = {"l": "#2f6fd0", "f": "#e8710a", "n": "#b3bac3"}
_NONFINITE = "#c62828"
_NEUTRAL = "#6b7785"

PerNodeError = tuple[str, str, float]


class Page:
    """Labels shared by the sections."""

    def __init__(self, report: Report) -> None:
        self.target = report.target
        self.labels = {"l": report.target, "f": "FP32", "n": "no float compute"}
        graph = report.graph
        self.graph = graph if graph is not None and len(graph) else None
        self._by_name: dict[str, int] | None = None

    def precision_of(self, name: str) -> str | None:
        """The precision letter of the node called `name` (None if unknown)."""
        if self.graph is None:
            return None
        if self._by_name is None:
            self._by_name = {n: i for i, n in enumerate(self.graph.names) if n}
        index = self._by_name.get(name)
        return None if index is None else self.graph.precision[index]


def esc(value: object) -> str:
    """HTML-escaped text (quotes too)."""
    return html.escape(str(value), quote=True)


def num(x: float) -> str:
    """A short number, NaN and infinities spelled out."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}"


def svg_open(width: float, height: float, label: str) -> str:
    return (
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{esc(label)}">'
    )


def share_bar(low: int, fp32: int, none: int, page: Page) -> str:
    """A bar split by the node counts of each precision."""
    total = low + fp32 + none
    width, height = 240, 12
    if not total:
        return ""
    parts = [f'<svg width="{width}" height="{height}" role="img">']
    x = 0.0
    for letter, count in (("l", low), ("f", fp32), ("n", none)):
        if not count:
            continue
        w = width * count / total
        parts.append(
            f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" class="p{letter}">'
            f"<title>{count} {esc(page.labels[letter])}</title></rect>"
        )
        x += w
    parts.append("</svg>")
    return "".join(parts)


def _diamond(x: float, y: float, size: float, tip: str) -> str:
    return (
        f'<path class="cm" d="M{x:.1f} {y - size:.1f}l{size:.1f} {size:.1f}l{-size:.1f} '
        f'{size:.1f}l{-size:.1f} {-size:.1f}z"><title>{esc(tip)}</title></path>'
    )


def _legend(page: Page, *, boundary: bool) -> str:
    items = [
        f'<span><i class="sw" style="background:{_COLOURS[k]}"></i>{esc(label)}</span>'
        for k, label in (
            ("l", f"{page.target} (16-bit compute)"),
            ("f", "FP32"),
            ("n", "no float compute (integer, shape, bool)"),
        )
    ]
    if boundary:
        items.append(
            '<span><svg width="28" height="10"><path class="eb" d="M0 5H28"/></svg>'
            f"edge between a {esc(page.target)} and an FP32 node</span>"
        )
        items.append(
            '<span><svg width="12" height="12"><path class="cm" d="M6 1l5 5-5 5-5-5z"/></svg>'
            "Cast inserted by the conversion (on an edge, or at a node's corner: on a model "
            "input or output)</span>"
        )
    return '<div class="legend">' + "".join(items) + "</div>"


def _tooltip(graph: NodeGraph, i: int, page: Page, folded: int = 0) -> str:
    letter = graph.precision[i]
    name = graph.names[i] or f"(unnamed #{i})"
    text = (
        f"{name}\n{graph.op_types[i]}: {page.labels.get(letter, letter)}\n"
        f"{graph.categories[graph.category[i]]}: {graph.reasons[graph.reason[i]]}"
    )
    if folded:
        plural = "s" if folded != 1 else ""
        text += f"\n{folded} constant input{plural} (weights, shapes), not drawn"
    return esc(text)


def layer_of(graph: NodeGraph) -> list[int]:
    """Longest-path layer of every node (0 for nodes fed only by graph inputs and constants)."""
    layers = [0] * len(graph)
    for i, preds in enumerate(graph.inputs):
        best = -1
        for p in preds:
            if p < i and layers[p] > best:
                best = layers[p]
        layers[i] = best + 1
    return layers


def graph_section(report: Report, page: Page) -> tuple[str, str]:
    """The graph section, and which layout drew the graph ("" when none was drawn)."""
    graph = page.graph
    out = ['<section id="graph"><h2>Graph: nodes by precision</h2>']
    if graph is None and report.graph is not None:
        out.append('<p class="note">The model has no nodes.</p></section>')
        return "".join(out), ""
    if graph is None:
        out.append(
            '<p class="note">This report has no per-node listing (reports made by '
            "<code>mixprec.convert</code> have one), so the graph is not drawn.</p></section>"
        )
        return "".join(out), ""
    folded = fold_constants(graph)
    used = ""
    if len(folded) <= FULL_GRAPH_MAX_NODES:
        layout = layout_graph(folded)
        used = layout.engine + (f" ({layout.note})" if layout.engine == BUILT_IN else "")
        depth = max(longest_path_layers(folded).values(), default=-1) + 1
        constants = (
            f" {folded.constants:,} nodes that compute only from constants (Constant nodes, "
            "weights) are folded into their consumers."
            if folded.constants
            else ""
        )
        out.append(_legend(page, boundary=True))
        out.append(
            f'<p class="note">{len(folded):,} nodes, {depth} deep (longest path from the '
            f"inputs), top to bottom; hover a node for its name, op, precision and reason."
            f"{constants}</p>"
        )
        out.append('<div class="scroll">' + _dag_svg(graph, folded, layout, page) + "</div>")
    else:
        n = len(graph)
        out.append(_legend(page, boundary=False))
        out.append(
            f'<p class="note">{n:,} nodes: too many to draw as a graph. Each cell is one node, in '
            "topological order, left to right and wrapping; runs of the same precision are merged "
            "(hover for the nodes and ops in a run; FP32 nodes have their own tooltip).</p>"
        )
        out.append('<div class="scroll tall">' + _strip_svg(graph, page) + "</div>")
        out.append(
            '<h2>Precision by depth</h2><p class="note">Share of the nodes in each layer (longest '
            "path from the inputs) by precision, shallow to deep.</p>"
        )
        out.append(_depth_svg(graph, layer_of(graph), page))
    out.append("</section>")
    return "".join(out), used


def _dag_svg(graph: NodeGraph, folded: FoldedGraph, layout: GraphLayout, page: Page) -> str:
    """The laid-out nodes as boxes coloured by precision, the edges between them, and a marker
    on every Cast the conversion inserted."""
    size = 6.0 if layout.labelled else 3.5
    normal, boundary, markers = _dag_edges(graph, layout, page, size)
    out = [svg_open(layout.width, layout.height, "graph nodes by precision")]
    if normal:
        out.append(f'<path class="e" d="{"".join(normal)}"/>')
    if boundary:
        out.append(f'<path class="eb" d="{"".join(boundary)}"/>')
    for i in folded.nodes:
        out.append(_dag_box(graph, layout, page, i, folded.folded[i]))
        markers.extend(_dag_node_markers(graph, layout, i, size))
    out.extend(markers)
    out.append("</svg>")
    return "".join(out)


def _dag_edges(
    graph: NodeGraph, layout: GraphLayout, page: Page, size: float
) -> tuple[list[str], list[str], list[str]]:
    """The edge paths, split into ordinary ones and those between a 16-bit and an FP32 node,
    and a Cast marker (of `size`) on every edge the conversion put a Cast on."""
    precision = graph.precision
    casts_known = len(graph.cast_inputs) == len(graph)
    normal: list[str] = []
    boundary: list[str] = []
    markers: list[str] = []
    for edge in layout.edges:
        p, i = edge.source, edge.target
        (boundary if {precision[p], precision[i]} == {"l", "f"} else normal).append(edge.path)
        if casts_known and p in graph.cast_inputs[i]:
            markers.append(_diamond(*edge.mid, size, _edge_cast_tip(graph, page, p, i)))
    return normal, boundary, markers


def _edge_cast_tip(graph: NodeGraph, page: Page, p: int, i: int) -> str:
    """The tooltip of the Cast marker on the edge from node `p` to node `i`."""
    precision = graph.precision
    return (
        f"Cast between {graph.names[p] or graph.op_types[p]} "
        f"({page.labels[precision[p]]}) and {graph.names[i] or graph.op_types[i]} "
        f"({page.labels[precision[i]]})"
    )


def _dag_box(graph: NodeGraph, layout: GraphLayout, page: Page, i: int, folded: int) -> str:
    """Node `i` as a box coloured by its precision (labelled with its op type when the layout
    is labelled), with its tooltip; `folded` constant inputs are mentioned in the tooltip."""
    box_w, box_h = layout.box_w, layout.box_h
    letter = graph.precision[i]
    cls = f"p{letter}" + (" bf" if letter == "f" else "")
    x, y = layout.x[i], layout.y[i]
    tip = _tooltip(graph, i, page, folded)
    if not layout.labelled:
        return (
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{box_w:g}" height="{box_h:g}" rx="2" '
            f'class="{cls}"><title>{tip}</title></rect>'
        )
    chars = max(3, int(box_w - 8) // 6)
    op = graph.op_types[i]
    label = op if len(op) <= chars else op[: chars - 1] + "\u2026"
    return (
        f'<g><title>{tip}</title><rect x="{x:.0f}" y="{y:.0f}" width="{box_w:g}" '
        f'height="{box_h:g}" rx="4" class="{cls}"/><text x="{x + box_w / 2:.0f}" '
        f'y="{y + box_h / 2 + 4:.0f}" text-anchor="middle" class="t{letter}">'
        f"{esc(label)}</text></g>"
    )


def _dag_node_markers(graph: NodeGraph, layout: GraphLayout, i: int, size: float) -> list[str]:
    """Cast markers at node `i`'s corners: top left for a Cast of a model input into it, bottom
    right for a Cast of its output to a model output."""
    name = graph.names[i] or graph.op_types[i]
    x, y = layout.x[i], layout.y[i]
    markers = []
    if len(graph.cast_inputs) == len(graph) and -1 in graph.cast_inputs[i]:
        markers.append(_diamond(x, y, size, f"Cast of a model input into {name}"))
    if len(graph.cast_outputs) == len(graph) and graph.cast_outputs[i]:
        markers.append(
            _diamond(
                x + layout.box_w, y + layout.box_h, size,
                f"Cast of {name}'s output to a model output",
            )
        )
    return markers


def _strip_svg(graph: NodeGraph, page: Page) -> str:
    n = len(graph)
    cell = 6 if n <= 40000 else 4
    pitch = cell + 1
    cols = 1080 // pitch
    rows = -(-n // cols)
    width, height = cols * pitch + 1, rows * pitch + 1
    precision = graph.precision
    individual = precision.count("f") <= MAX_STRIP_TOOLTIPS
    out = [svg_open(width, height, "nodes by precision")]
    for r in range(rows):
        start, stop = r * cols, min(n, (r + 1) * cols)
        i = start
        while i < stop:
            letter = precision[i]
            j = i + 1
            if not (letter == "f" and individual):
                while j < stop and precision[j] == letter:
                    j += 1
            x, y = 1 + (i - start) * pitch, 1 + r * pitch
            w = (j - i) * pitch - 1
            if j - i == 1:
                tip = _tooltip(graph, i, page)
            else:
                ops = Counter(graph.op_types[i:j]).most_common(4)
                tip = esc(
                    f"nodes {i}\u2013{j - 1}: {j - i} \u00d7 {page.labels[letter]}\n"
                    + ", ".join(f"{op} {c}" for op, c in ops)
                )
            out.append(
                f'<rect x="{x}" y="{y}" width="{w}" height="{cell}" class="p{letter}">'
                f"<title>{tip}</title></rect>"
            )
            i = j
    out.append("</svg>")
    return "".join(out)


def _depth_svg(graph: NodeGraph, layers: list[int], page: Page) -> str:
    depth = max(layers) + 1
    columns = min(depth, 560)
    counts = [[0, 0, 0] for _ in range(columns)]
    slot = {"l": 0, "f": 1, "n": 2}
    for i, layer in enumerate(layers):
        counts[layer * columns // depth][slot[graph.precision[i]]] += 1
    plot_w, plot_h = 1080, 90
    bar_w = plot_w / columns
    out = [svg_open(plot_w + 2, plot_h + 2, "precision by depth")]
    for c, (low, fp32, none) in enumerate(counts):
        total = low + fp32 + none
        if not total:
            continue
        first, last = -(-c * depth // columns), -(-(c + 1) * depth // columns) - 1
        tip = esc(
            f"layer{'s' if last > first else ''} {first}{f'–{last}' if last > first else ''}: "
            f"{total} nodes: {low} {page.target}, {fp32} FP32, {none} no float compute"
        )
        y = 1.0
        for letter, count in (("f", fp32), ("l", low), ("n", none)):
            if not count:
                continue
            h = plot_h * count / total
            out.append(
                f'<rect x="{1 + c * bar_w:.1f}" y="{y:.1f}" width="{max(bar_w - 0.3, 0.7):.1f}" '
                f'height="{h:.1f}" class="p{letter}"><title>{tip}</title></rect>'
            )
            y += h
    out.append("</svg>")
    return "".join(out)


# The per-node error chart's margins around its plot, and the plot's size.
_ERR_LEFT, _ERR_RIGHT, _ERR_TOP, _ERR_BOTTOM = 64, 12, 10, 26
_ERR_PLOT_W, _ERR_PLOT_H = 1000, 220

_Scale = Callable[[float], float]


def errors_svg(rows: Sequence[PerNodeError], bars: int, page: Page) -> str:
    """Per-node errors as bars (the worst of the nodes sharing a bar), log scale when they span
    more than three decades."""
    scale, ticks, use_log = _error_scale(rows)
    width, height = _ERR_LEFT + _ERR_PLOT_W + _ERR_RIGHT, _ERR_TOP + _ERR_PLOT_H + _ERR_BOTTOM
    out = [svg_open(width, height, "error per node")]
    out.extend(_error_gridline(value, label, scale) for value, label in ticks)
    bar_w = _ERR_PLOT_W / bars
    out.extend(_error_bar(rows, b, bars, bar_w, scale, page) for b in range(bars))
    out.append(_error_axes(len(rows), height, use_log))
    return "".join(out)


def _error_scale(rows: Sequence[PerNodeError]) -> tuple[_Scale, list[tuple[float, str]], bool]:
    """The chart's scale (error -> share of the plot height), its ticks (value, label), and
    whether it is logarithmic (when the finite nonzero errors span more than three decades)."""
    finite = [abs(e) for _, _, e in rows if math.isfinite(e)]
    positive = [e for e in finite if e > 0]
    vmax = max(finite) if finite else 0.0
    if positive and vmax / min(positive) > 1e3:
        return (*_log_scale(min(positive), vmax), True)
    return (*_linear_scale(vmax), False)


def _log_scale(smallest: float, vmax: float) -> tuple[_Scale, list[tuple[float, str]]]:
    """A log scale over whole decades from `smallest` to `vmax`, with at most seven ticks."""
    lo = math.floor(math.log10(smallest))
    hi = math.ceil(math.log10(vmax))
    hi = hi if hi > lo else lo + 1

    def scale(v: float) -> float:
        return 0.0 if v <= 0 else max(0.0, (math.log10(v) - lo) / (hi - lo))

    step = max(1, -(-(hi - lo) // 6))
    return scale, [(10.0**k, f"1e{k}") for k in range(lo, hi + 1, step)]


def _linear_scale(vmax: float) -> tuple[_Scale, list[tuple[float, str]]]:
    """A linear scale from 0 to `vmax` (to 1 when `vmax` is not positive), five ticks."""
    top_value = vmax if vmax > 0 else 1.0

    def scale(v: float) -> float:
        return max(0.0, v / top_value)

    return scale, [(top_value * k / 4, num(top_value * k / 4)) for k in range(5)]


def _error_gridline(value: float, label: str, scale: _Scale) -> str:
    """A horizontal grid line at `value` with its `label` left of the plot."""
    y = _ERR_TOP + _ERR_PLOT_H * (1 - scale(value))
    return (
        f'<line class="gr" x1="{_ERR_LEFT}" x2="{_ERR_LEFT + _ERR_PLOT_W}" '
        f'y1="{y:.1f}" y2="{y:.1f}"/>'
        f'<text x="{_ERR_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{esc(label)}</text>'
    )


def _error_bar(
    rows: Sequence[PerNodeError], b: int, bars: int, bar_w: float, scale: _Scale, page: Page
) -> str:
    """Bar `b` of `bars` (each `bar_w` wide): the worst error of the nodes it covers, coloured
    by that node's precision (red when not finite), at least 1 pixel high."""
    n = len(rows)
    first, stop = b * n // bars, (b + 1) * n // bars
    worst = max(range(first, stop), key=lambda i: _bar_key(rows[i][2]))
    name, op, err = rows[worst]
    if math.isfinite(err):
        h = _ERR_PLOT_H * min(1.0, scale(abs(err)))
        colour = _COLOURS.get(page.precision_of(name) or "", _NEUTRAL)
    else:
        h, colour = _ERR_PLOT_H, _NONFINITE
    h = max(h, 1.0)
    if stop - first == 1:
        tip = f"#{first} {name} ({op}): error {num(err)}"
    else:
        tip = f"nodes #{first}\u2013{stop - 1}: worst {name} ({op}): error {num(err)}"
    return (
        f'<rect x="{_ERR_LEFT + b * bar_w:.2f}" y="{_ERR_TOP + _ERR_PLOT_H - h:.1f}" '
        f'width="{max(bar_w * 0.85, 0.8):.2f}" height="{h:.1f}" fill="{colour}">'
        f"<title>{esc(tip)}</title></rect>"
    )


def _error_axes(n: int, height: int, use_log: bool) -> str:
    """The chart's axes, their labels (first and last of `n` nodes, the scale) and the closing
    tag."""
    left, top, plot_w, plot_h = _ERR_LEFT, _ERR_TOP, _ERR_PLOT_W, _ERR_PLOT_H
    return (
        f'<line class="ax" x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}"/>'
        f'<line class="ax" x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" '
        f'y2="{top + plot_h}"/>'
        f'<text x="{left}" y="{height - 8}">first node</text>'
        f'<text x="{left + plot_w}" y="{height - 8}" text-anchor="end">last node ({n - 1})</text>'
        f'<text x="{left + plot_w / 2:.0f}" y="{height - 8}" text-anchor="middle">'
        f"{'log scale' if use_log else 'linear scale'}</text></svg>"
    )


def _bar_key(x: float) -> float:
    return math.inf if not math.isfinite(x) else abs(x)
