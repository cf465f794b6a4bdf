"""A self-contained HTML page for a conversion :class:`~mixprec.report.Report`.

The page needs nothing but a browser (no network, scripts or fonts from elsewhere): a header with
the counts, weights and casts; the graph's nodes coloured by precision (a layered drawing of the
graph as inline SVG, or for large graphs a strip with one cell per node); the per-output errors;
optionally a per-node error chart; the nodes kept FP32 with their reasons and the constants kept
FP32 for their range.

    from mixprec.report_html import write_html_report
    write_html_report(result.report, "report.html")
"""

from __future__ import annotations

import contextlib
import html
import math
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from mixprec.errors import InputError
from mixprec.report import NodeGraph, Report

# Graphs with at most this many nodes are drawn as a layered graph; larger ones as a strip.
FULL_GRAPH_MAX_NODES = 3000
# Up to this many nodes, the drawn nodes are boxes labelled with their op type.
LABELLED_MAX_NODES = 400
# Longest tables (FP32 nodes): rows beyond this are left to the JSON report.
MAX_TABLE_ROWS = 5000
# Strip cells that carry their own tooltip (FP32 nodes); beyond this they are merged in runs.
MAX_STRIP_TOOLTIPS = 20000
# The layered drawing is split into side-by-side columns until it is no taller than this, as
# long as the columns fit the width.
_DRAWING_WIDTH = 1090
_DRAWING_HEIGHT = 900
# Bars in the per-node error chart; more nodes share a bar (its height is their worst error).
MAX_ERROR_BARS = 500

_COLOURS = {"l": "#2f6fd0", "f": "#e8710a", "n": "#b3bac3"}
_NONFINITE = "#c62828"
_NEUTRAL = "#6b7785"

PerNodeError = tuple[str, str, float]


def write_html_report(
    report: Report,
    path: str | os.PathLike,
    *,
    per_node_errors: Sequence[PerNodeError] | None = None,
) -> Path:
    """Write `report` as one self-contained HTML file at `path` (atomically: a temporary file in
    the same folder, then renamed).

    Args:
        report: A conversion report (`ConversionResult.report`). The graph drawing needs its
            per-node listing (`report.graph`, filled in by `mixprec.convert`); without one the
            page shows the counts only.
        path: The .html file to write.
        per_node_errors: Optional (node name, op type, error) tuples, in graph order, from a
            per-node accuracy measurement; drawn as a bar chart. None leaves the section out.

    Returns:
        The path written.
    """
    target = Path(path)
    text = render_html_report(report, per_node_errors=per_node_errors)
    _write_atomic(target, text)
    return target


def render_html_report(
    report: Report, *, per_node_errors: Sequence[PerNodeError] | None = None
) -> str:
    """The HTML page for `report`, as text."""
    page = _Page(report)
    parts = [
        _head(report),
        _header(report, page),
        _graph_section(report, page),
        _outputs_section(report),
    ]
    if per_node_errors is not None:
        parts.append(_errors_section(per_node_errors, page))
    parts += [_fp32_section(report), _ops_section(report), _FOOT]
    return "".join(parts)


class _Page:
    """Labels shared by the sections."""

    def __init__(self, report: Report) -> None:
        self.target = report.target
        self.labels = {"l": report.target, "f": "FP32", "n": "no float compute"}
        graph = report.graph
        self.graph = graph if graph is not None and len(graph) else None
        self._by_name: dict[str, int] | None = None

    def precision_of(self, name: str) -> str | None:
        if self.graph is None:
            return None
        if self._by_name is None:
            self._by_name = {n: i for i, n in enumerate(self.graph.names) if n}
        index = self._by_name.get(name)
        return None if index is None else self.graph.precision[index]


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _mb(n: int | None) -> str:
    if n is None:
        return "unknown"
    if n < 1e6:
        return f"{n / 1e3:.1f} kB"
    return f"{n / 1e6:.2f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _cast_bytes(n: int | None) -> str:
    if n is None:
        return "bytes moved per inference unknown (shapes not static)"
    return f"{_mb(n)} moved per inference"


def _num(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.3g}"


# ---------------------------------------------------------------------------------------------
# Page frame


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2430;
background:#f6f7f9}
main{max-width:1240px;margin:0 auto;padding:16px 20px 40px}
h1{font-size:22px;margin:4px 0 2px}h2{font-size:17px;margin:26px 0 8px}
.sub{color:#5a6472;margin:0 0 12px;word-break:break-all}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:10px 16px 14px;
margin-top:14px}
section>h2:first-child{margin-top:4px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:8px 12px;min-width:190px}
.card h3{font-size:12px;text-transform:uppercase;letter-spacing:.04em;color:#5a6472;margin:0 0 4px}
.card table td{padding:1px 8px 1px 0;border:0}
.big{font-size:20px;font-weight:600}
table{border-collapse:collapse}
table.data{width:100%;font-size:13px}
table.data th,table.data td{border-bottom:1px solid #e5e8ec;padding:3px 8px;text-align:left;
vertical-align:top}
table.data th{background:#eef1f4;position:sticky;top:0}
table.sortable th{cursor:pointer;user-select:none}
table.sortable th:after{content:" \\2195";color:#9aa3ad;font-size:11px}
table.data .n,.card .n{text-align:right;font-variant-numeric:tabular-nums}
tr.bad td{background:#fdecea}
.scroll{overflow:auto;max-height:78vh;border:1px solid #e5e8ec;border-radius:4px;background:#fff}
.scroll>svg{display:block;margin:0 auto}
.tall{max-height:60vh}
.legend{display:flex;flex-wrap:wrap;gap:16px;align-items:center;margin:4px 0 8px}
.legend span{display:inline-flex;align-items:center;gap:6px}
.sw{display:inline-block;width:14px;height:14px;border-radius:3px}
.note{color:#5a6472;font-size:13px}
.warn{color:#9a3412}
code{font-size:12px;background:#eef1f4;padding:0 3px;border-radius:3px}
svg text{font:11px system-ui,sans-serif}
svg .pl{fill:#2f6fd0}svg .pf{fill:#e8710a}svg .pn{fill:#b3bac3}
svg .tl,svg .tf{fill:#fff}svg .tn{fill:#1d2430}
svg .bf{stroke:#7c2d12;stroke-width:1.5}
svg .e{fill:none;stroke:#9aa3ad;stroke-width:1}
svg .eb{fill:none;stroke:#e8710a;stroke-width:1.4;stroke-dasharray:4 2}
svg .ax{stroke:#5a6472;stroke-width:1}
svg .gr{stroke:#e5e8ec;stroke-width:1}
"""

# Click a column heading to sort (numbers by their data-v value); no other script on the page.
_JS = """
document.querySelectorAll('table.sortable').forEach(function(t){
  t.querySelectorAll('th').forEach(function(th,i){
    th.addEventListener('click',function(){
      var body=t.tBodies[0],rows=Array.prototype.slice.call(body.rows);
      var asc=th.getAttribute('data-dir')!=='asc';th.setAttribute('data-dir',asc?'asc':'desc');
      rows.sort(function(a,b){
        var x=a.cells[i],y=b.cells[i];
        var u=x.getAttribute('data-v'),v=y.getAttribute('data-v');
        var r=(u!==null&&v!==null)?(parseFloat(u)-parseFloat(v)):
          x.textContent.localeCompare(y.textContent);
        return asc?r:-r;});
      rows.forEach(function(r){body.appendChild(r);});});});});
"""

_FOOT = f'<p class="note">Generated by mixprec.</p></main><script>{_JS}</script></body></html>\n'


def _head(report: Report) -> str:
    title = f"mixprec report: {Path(report.source).name if report.source else 'model'} ({report.target})"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body><main>"
    )


def _header(report: Report, page: _Page) -> str:
    counts = report.nodes_by_precision
    low, fp32, none = counts.get("low", 0), counts.get("fp32", 0), counts.get("none", 0)
    total = low + fp32 + none
    floats = low + fp32
    share = 100.0 * low / floats if floats else 0.0
    before, after = report.weight_bytes_before, report.weight_bytes_after
    saved = 100.0 * (1 - after / before) if before else 0.0
    v = report.validation
    out = [
        "<header><h1>mixprec conversion report</h1>",
        (
            f'<p class="sub"><b>{_e(report.source)}</b> &#8594; {_e(report.output or "(in memory)")}'
            f" &#183; target <b>{_e(report.target)}</b> &#183; "
            f"keep_io_types={_e(report.keep_io_types)}</p>"
        ),
        '<div class="cards">',
        '<div class="card"><h3>Nodes</h3><table>',
        f'<tr><td>in {_e(report.target)}</td><td class="n" id="count-low">{low}</td></tr>',
        f'<tr><td>in FP32</td><td class="n" id="count-fp32">{fp32}</td></tr>',
        f'<tr><td>no float compute</td><td class="n" id="count-none">{none}</td></tr>',
        f'<tr><td>total</td><td class="n" id="count-total">{total}</td></tr></table></div>',
        '<div class="card"><h3>Float nodes converted</h3>',
        f'<div class="big" id="share-converted">{share:.1f}%</div>',
        _share_bar(low, fp32, none, page),
        "</div>",
        '<div class="card"><h3>Weights</h3>',
        f'<div class="big">{_e(_mb(before))} &#8594; {_e(_mb(after))}</div>',
        (
            f'<div class="note" id="weight-bytes">{before:,} &#8594; {after:,} bytes '
            f"({saved:.0f}% smaller); {report.constants_lowered} stored in {_e(report.target)}, "
            f"{report.constants_duplicated} duplicated</div></div>"
        ),
        '<div class="card"><h3>Casts</h3>',
        f'<div class="big" id="casts-runtime">{report.casts_runtime} at run time</div>',
        f'<div class="note">{_e(_cast_bytes(report.cast_bytes_per_inference))}'
        + (
            f" ({report.cast_elements_per_inference:,} elements)"
            if report.cast_elements_per_inference is not None
            else ""
        )
        + f"; {report.casts_inserted} inserted, {report.casts_removed} redundant removed</div></div>",
        '<div class="card"><h3>Validation</h3>',
        (
            f"<div>checker <b>{_e(v.checker)}</b></div><div>runtime <b>{_e(v.runtime)}</b>"
            f" ({v.seconds:.2f} s, {v.batches} batch{'es' if v.batches != 1 else ''})</div></div>"
        ),
        "</div>",
    ]
    notes = [*report.notes, *v.notes]
    if report.type_inference_warning:
        out.append(
            f'<p class="warn">Type inference incomplete: {_e(report.type_inference_warning)}</p>'
        )
    if notes:
        out.append('<ul class="note">' + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    out.append("</header>")
    return "".join(out)


def _share_bar(low: int, fp32: int, none: int, page: _Page) -> str:
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
            f"<title>{count} {_e(page.labels[letter])}</title></rect>"
        )
        x += w
    parts.append("</svg>")
    return "".join(parts)


def _legend(page: _Page, *, boundary: bool) -> str:
    items = [
        f'<span><i class="sw" style="background:{_COLOURS[k]}"></i>{_e(label)}</span>'
        for k, label in (
            ("l", f"{page.target} (16-bit compute)"),
            ("f", "FP32"),
            ("n", "no float compute (integer, shape, bool)"),
        )
    ]
    if boundary:
        items.append(
            '<span><svg width="28" height="10"><path class="eb" d="M0 5H28"/></svg>'
            f"edge between a {_e(page.target)} and an FP32 node (a Cast may sit there)</span>"
        )
    return '<div class="legend">' + "".join(items) + "</div>"


# ---------------------------------------------------------------------------------------------
# Graph


def _svg_open(width: float, height: float, label: str) -> str:
    return (
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{_e(label)}">'
    )


def _tooltip(graph: NodeGraph, i: int, page: _Page) -> str:
    letter = graph.precision[i]
    name = graph.names[i] or f"(unnamed #{i})"
    return _e(
        f"{name}\n{graph.op_types[i]}: {page.labels.get(letter, letter)}\n"
        f"{graph.categories[graph.category[i]]}: {graph.reasons[graph.reason[i]]}"
    )


def _layer_of(graph: NodeGraph) -> list[int]:
    """Longest-path layer of every node (0 for nodes fed only by graph inputs and constants)."""
    layers = [0] * len(graph)
    for i, preds in enumerate(graph.inputs):
        best = -1
        for p in preds:
            if p < i and layers[p] > best:
                best = layers[p]
        layers[i] = best + 1
    return layers


def _graph_section(report: Report, page: _Page) -> str:
    graph = page.graph
    out = ['<section id="graph"><h2>Graph: nodes by precision</h2>']
    if graph is None and report.graph is not None:
        out.append("<p class=\"note\">The model has no nodes.</p></section>")
        return "".join(out)
    if graph is None:
        out.append(
            '<p class="note">This report has no per-node listing (reports made by '
            "<code>mixprec.convert</code> have one), so the graph is not drawn.</p></section>"
        )
        return "".join(out)
    n = len(graph)
    full = n <= FULL_GRAPH_MAX_NODES
    out.append(_legend(page, boundary=full))
    layers = _layer_of(graph)
    if full:
        out.append(
            f'<p class="note">{n} nodes in {max(layers) + 1} layers (longest path from the inputs), '
            "top to bottom; hover a node for its name, op, precision and reason.</p>"
        )
        out.append('<div class="scroll">' + _dag_svg(graph, layers, page) + "</div>")
    else:
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
        out.append(_depth_svg(graph, layers, page))
    out.append("</section>")
    return "".join(out)


def _dag_svg(graph: NodeGraph, layers: list[int], page: _Page) -> str:
    """Layers top to bottom, one row per layer (wrapped when wide); a deep graph continues in
    further columns to the right, like a newspaper."""
    n = len(graph)
    labelled = n <= LABELLED_MAX_NODES
    if labelled:
        box_w, box_h, step_x, step_y, per_row = 96, 22, 104, 44, 10
    else:
        box_w, box_h, step_x, step_y, per_row = 11, 11, 15, 24, 70
    margin, gap = 8, (36 if labelled else 14)
    by_layer: list[list[int]] = [[] for _ in range(max(layers) + 1)]
    for i, layer in enumerate(layers):
        by_layer[layer].append(i)

    # Rows, each ordered by the mean position of its nodes' producers (one downward sweep).
    centre = [0.0] * n

    def barycentre(i: int) -> tuple[float, int]:
        preds = [p for p in graph.inputs[i] if p < i]
        return (sum(centre[p] for p in preds) / len(preds) if preds else -1e9, i)

    rows: list[list[int]] = []
    for nodes in by_layer:
        nodes.sort(key=barycentre)
        for start in range(0, len(nodes), per_row):
            chunk = nodes[start : start + per_row]
            rows.append(chunk)
            for k, i in enumerate(chunk):
                centre[i] = k - (len(chunk) - 1) / 2

    # As many columns as fit _DRAWING_WIDTH, until the drawing is no taller than _DRAWING_HEIGHT.
    def split(count: int) -> list[list[list[int]]]:
        per_column = -(-len(rows) // count)
        return [rows[j : j + per_column] for j in range(0, len(rows), per_column)]

    def drawing_width(columns: list[list[list[int]]]) -> int:
        return sum(max(len(r) for r in c) * step_x for c in columns) + gap * (len(columns) - 1)

    columns = split(1)
    count = 1
    while len(columns[0]) * step_y > _DRAWING_HEIGHT and count < len(rows):
        count += 1
        candidate = split(count)
        if drawing_width(candidate) > _DRAWING_WIDTH:
            break
        columns = candidate

    x_of = [0.0] * n
    y_of = [0.0] * n
    column_of = [0] * n
    left = float(margin)
    for c, column in enumerate(columns):
        column_w = max(len(r) for r in column) * step_x
        for r, row in enumerate(column):
            x0 = left + (column_w - len(row) * step_x) / 2 + (step_x - box_w) / 2
            for k, i in enumerate(row):
                x_of[i] = x0 + k * step_x
                y_of[i] = margin + r * step_y
                column_of[i] = c
        left += column_w + gap
    width = round(left - gap + margin)
    height = round(margin * 2 + max(len(c) for c in columns) * step_y - (step_y - box_h))

    normal: list[str] = []
    boundary: list[str] = []
    precision = graph.precision
    stub = (step_y - box_h) / 2
    for i, preds in enumerate(graph.inputs):
        x2, y2 = x_of[i] + box_w / 2, y_of[i]
        for p in preds:
            if p >= i:
                continue
            x1, y1 = x_of[p] + box_w / 2, y_of[p] + box_h
            if column_of[p] == column_of[i] and y1 < y2:
                ym = (y1 + y2) / 2 if y2 - y1 <= step_y else y2 - stub
                segment = (
                    f"M{x1:.0f} {y1:.0f}C{x1:.0f} {ym:.0f} {x2:.0f} {ym:.0f} {x2:.0f} {y2:.0f}"
                )
            else:
                # Continues in another column: a stub out of the producer and one into the node.
                segment = (
                    f"M{x1:.0f} {y1:.0f}v{stub * 0.8:.0f}m-3 -3l3 3 3 -3"
                    f"M{x2:.0f} {y2 - stub * 0.8:.0f}V{y2:.0f}"
                )
            if {precision[p], precision[i]} == {"l", "f"}:
                boundary.append(segment)
            else:
                normal.append(segment)
    out = [_svg_open(width, height, "graph nodes by precision")]
    if normal:
        out.append(f'<path class="e" d="{"".join(normal)}"/>')
    if boundary:
        out.append(f'<path class="eb" d="{"".join(boundary)}"/>')
    chars = max(3, (box_w - 8) // 6)
    for i in range(n):
        letter = precision[i]
        cls = f"p{letter}" + (" bf" if letter == "f" else "")
        x, y = x_of[i], y_of[i]
        if labelled:
            op = graph.op_types[i]
            label = op if len(op) <= chars else op[: chars - 1] + "\u2026"
            out.append(
                f"<g><title>{_tooltip(graph, i, page)}</title>"
                f'<rect x="{x:.0f}" y="{y:.0f}" width="{box_w}" height="{box_h}" rx="4" '
                f'class="{cls}"/><text x="{x + box_w / 2:.0f}" y="{y + box_h / 2 + 4:.0f}" '
                f'text-anchor="middle" class="t{letter}">{_e(label)}</text></g>'
            )
        else:
            out.append(
                f'<rect x="{x:.0f}" y="{y:.0f}" width="{box_w}" height="{box_h}" rx="2" '
                f'class="{cls}"><title>{_tooltip(graph, i, page)}</title></rect>'
            )
    out.append("</svg>")
    return "".join(out)


def _strip_svg(graph: NodeGraph, page: _Page) -> str:
    n = len(graph)
    cell = 6 if n <= 40000 else 4
    pitch = cell + 1
    cols = 1080 // pitch
    rows = -(-n // cols)
    width, height = cols * pitch + 1, rows * pitch + 1
    precision = graph.precision
    individual = precision.count("f") <= MAX_STRIP_TOOLTIPS
    out = [_svg_open(width, height, "nodes by precision")]
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
                tip = _e(
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


def _depth_svg(graph: NodeGraph, layers: list[int], page: _Page) -> str:
    depth = max(layers) + 1
    columns = min(depth, 560)
    counts = [[0, 0, 0] for _ in range(columns)]
    slot = {"l": 0, "f": 1, "n": 2}
    for i, layer in enumerate(layers):
        counts[layer * columns // depth][slot[graph.precision[i]]] += 1
    plot_w, plot_h = 1080, 90
    bar_w = plot_w / columns
    out = [_svg_open(plot_w + 2, plot_h + 2, "precision by depth")]
    for c, (low, fp32, none) in enumerate(counts):
        total = low + fp32 + none
        if not total:
            continue
        first, last = -(-c * depth // columns), -(-(c + 1) * depth // columns) - 1
        tip = _e(
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


# ---------------------------------------------------------------------------------------------
# Errors


def _outputs_section(report: Report) -> str:
    v = report.validation
    out = ['<section id="outputs"><h2>Output errors against the FP32 model</h2>']
    if not v.outputs:
        out.append(
            f'<p class="note">No numeric comparison (runtime: {_e(v.runtime)}).</p></section>'
        )
        return "".join(out)
    out.append(
        '<table class="data sortable"><thead><tr><th>output</th><th class="n">max abs error</th>'
        '<th class="n">max error / max |FP32|</th><th class="n">NaN</th><th class="n">Inf</th>'
        '<th class="n">new non-finite</th><th>within tolerance</th></tr></thead><tbody>'
    )
    for o in v.outputs:
        bad = o.within_tolerance is False or o.new_nonfinite > 0
        within = "\u2014" if o.within_tolerance is None else ("yes" if o.within_tolerance else "NO")
        out.append(
            f"<tr{_BAD if bad else ''}><td>{_e(o.name)}</td>"
            f"{_num_cell(o.max_abs_error)}{_num_cell(o.scaled_error if o.scaled_error is not None else o.max_rel_error)}"
            f"{_num_cell(o.nan_count)}{_num_cell(o.inf_count)}{_num_cell(o.new_nonfinite)}"
            f"<td>{within}</td></tr>"
        )
    out.append(
        f'</tbody></table><p class="note">{v.batches} batch{"es" if v.batches != 1 else ""}; '
        f"runtime {_e(v.runtime)}.</p></section>"
    )
    return "".join(out)


_BAD = ' class="bad"'


def _num_cell(x: float) -> str:
    if isinstance(x, int):
        return f'<td class="n" data-v="{x}">{x:,}</td>'
    key = "1e308" if math.isnan(x) or x == math.inf else ("-1e308" if x == -math.inf else repr(x))
    return f'<td class="n" data-v="{key}">{_num(x)}</td>'


def _errors_section(errors: Sequence[PerNodeError], page: _Page) -> str:
    out = [
        '<section id="node-errors"><h2>Error per node</h2>',
    ]
    rows = [(str(name), str(op), float(err)) for name, op, err in errors]
    n = len(rows)
    if not n:
        out.append('<p class="note">No per-node errors were given.</p></section>')
        return "".join(out)
    bars = min(n, MAX_ERROR_BARS)
    out.append(
        f'<p class="note">{n:,} nodes in the order given'
        + (f", {-(-n // bars)} nodes per bar at most (height: the worst)" if bars < n else "")
        + "; bars coloured by the node's precision, non-finite errors in red.</p>"
    )
    out.append(_errors_svg(rows, bars, page))
    worst = sorted(range(n), key=lambda i: _sort_key(rows[i][2]), reverse=True)[:20]
    out.append(
        '<h2>Worst nodes</h2><table class="data sortable"><thead><tr><th class="n">#</th>'
        '<th>node</th><th>op</th><th>precision</th><th class="n">error</th></tr></thead><tbody>'
    )
    for i in worst:
        name, op, err = rows[i]
        letter = page.precision_of(name)
        out.append(
            f'<tr><td class="n" data-v="{i}">{i}</td><td>{_e(name)}</td><td>{_e(op)}</td>'
            f"<td>{_e(page.labels.get(letter, '?') if letter else '?')}</td>{_num_cell(err)}</tr>"
        )
    out.append("</tbody></table></section>")
    return "".join(out)


def _sort_key(x: float) -> float:
    return math.inf if math.isnan(x) else x


def _errors_svg(rows: list[PerNodeError], bars: int, page: _Page) -> str:
    n = len(rows)
    left, right, top, bottom = 64, 12, 10, 26
    plot_w, plot_h = 1000, 220
    finite = [abs(e) for _, _, e in rows if math.isfinite(e)]
    positive = [e for e in finite if e > 0]
    vmax = max(finite) if finite else 0.0
    use_log = bool(positive) and vmax / min(positive) > 1e3
    if use_log:
        lo = math.floor(math.log10(min(positive)))
        hi = math.ceil(math.log10(vmax))
        hi = hi if hi > lo else lo + 1

        def scale(v: float) -> float:
            return 0.0 if v <= 0 else max(0.0, (math.log10(v) - lo) / (hi - lo))

        step = max(1, -(-(hi - lo) // 6))
        ticks = [(10.0**k, f"1e{k}") for k in range(lo, hi + 1, step)]
    else:
        top_value = vmax if vmax > 0 else 1.0

        def scale(v: float) -> float:
            return max(0.0, v / top_value)

        ticks = [(top_value * k / 4, _num(top_value * k / 4)) for k in range(5)]
    width, height = left + plot_w + right, top + plot_h + bottom
    out = [_svg_open(width, height, "error per node")]
    for value, label in ticks:
        y = top + plot_h * (1 - scale(value))
        out.append(
            f'<line class="gr" x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(label)}</text>'
        )
    bar_w = plot_w / bars
    for b in range(bars):
        first, stop = b * n // bars, (b + 1) * n // bars
        worst = max(range(first, stop), key=lambda i: _bar_key(rows[i][2]))
        name, op, err = rows[worst]
        if math.isfinite(err):
            h = plot_h * min(1.0, scale(abs(err)))
            colour = _COLOURS.get(page.precision_of(name) or "", _NEUTRAL)
        else:
            h, colour = plot_h, _NONFINITE
        h = max(h, 1.0)
        if stop - first == 1:
            tip = f"#{first} {name} ({op}): error {_num(err)}"
        else:
            tip = f"nodes #{first}\u2013{stop - 1}: worst {name} ({op}): error {_num(err)}"
        out.append(
            f'<rect x="{left + b * bar_w:.2f}" y="{top + plot_h - h:.1f}" '
            f'width="{max(bar_w * 0.85, 0.8):.2f}" height="{h:.1f}" fill="{colour}">'
            f"<title>{_e(tip)}</title></rect>"
        )
    out.append(
        f'<line class="ax" x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}"/>'
        f'<line class="ax" x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" '
        f'y2="{top + plot_h}"/>'
        f'<text x="{left}" y="{height - 8}">first node</text>'
        f'<text x="{left + plot_w}" y="{height - 8}" text-anchor="end">last node ({n - 1})</text>'
        f'<text x="{left + plot_w / 2:.0f}" y="{height - 8}" text-anchor="middle">'
        f"{'log scale' if use_log else 'linear scale'}</text></svg>"
    )
    return "".join(out)


def _bar_key(x: float) -> float:
    return math.inf if not math.isfinite(x) else abs(x)


# ---------------------------------------------------------------------------------------------
# FP32 nodes, constants, ops


def _fp32_section(report: Report) -> str:
    kept = report.kept_fp32
    out = [f'<section id="fp32"><h2>Nodes kept in FP32 ({len(kept):,})</h2>']
    if report.fp32_by_category:
        out.append(
            '<table class="data" style="width:auto"><thead><tr><th>because</th>'
            '<th class="n">nodes</th></tr></thead><tbody>'
        )
        for category, count in sorted(report.fp32_by_category.items(), key=lambda x: -x[1]):
            out.append(f"<tr><td>{_e(category)}</td>{_num_cell(count)}</tr>")
        out.append("</tbody></table>")
    if kept:
        out.append(
            '<p class="note">Click a column heading to sort.</p><div class="scroll tall">'
            '<table class="data sortable" id="fp32-nodes"><thead><tr><th>node</th><th>op</th>'
            "<th>category</th><th>reason</th></tr></thead><tbody>"
        )
        for k in kept[:MAX_TABLE_ROWS]:
            out.append(
                f"<tr><td>{_e(k.name)}</td><td>{_e(k.op_type)}</td><td>{_e(k.category)}</td>"
                f"<td>{_e(k.reason)}</td></tr>"
            )
        out.append("</tbody></table></div>")
        if len(kept) > MAX_TABLE_ROWS:
            out.append(
                f'<p class="note">{len(kept) - MAX_TABLE_ROWS:,} more FP32 nodes are listed in the '
                "JSON report (--report).</p>"
            )
    else:
        out.append('<p class="note">Every node with FP32 compute was converted.</p>')
    constants = report.constants_kept_for_range
    out.append(f"<h2>Constants kept FP32 for their range ({len(constants):,})</h2>")
    if constants:
        out.append(
            '<table class="data" id="range-constants"><thead><tr><th>constant</th><th>evidence</th>'
            "</tr></thead><tbody>"
        )
        for name, note in list(constants.items())[:MAX_TABLE_ROWS]:
            out.append(f"<tr><td>{_e(name)}</td><td>{_e(note)}</td></tr>")
        out.append("</tbody></table>")
    else:
        out.append(f'<p class="note">No constant is out of the {_e(report.target)} range.</p>')
    out.append("</section>")
    return "".join(out)


def _ops_section(report: Report) -> str:
    ops = sorted(
        set(report.low_by_op) | set(report.fp32_by_op),
        key=lambda op: (-(report.low_by_op.get(op, 0) + report.fp32_by_op.get(op, 0)), op),
    )
    if not ops:
        return ""
    out = [
        (
            '<section id="ops"><h2>Ops</h2><table class="data sortable" style="width:auto">'
            f'<thead><tr><th>op</th><th class="n">in {_e(report.target)}</th>'
            '<th class="n">in FP32</th></tr></thead><tbody>'
        )
    ]
    for op in ops:
        out.append(
            f"<tr><td>{_e(op)}</td>{_num_cell(report.low_by_op.get(op, 0))}"
            f"{_num_cell(report.fp32_by_op.get(op, 0))}</tr>"
        )
    out.append("</tbody></table></section>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------


def _write_atomic(path: Path, text: str) -> None:
    folder = path.parent
    if not folder.is_dir():
        raise InputError(f"{path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
