"""A self-contained HTML page for a conversion :class:`~mixprec.report.Report`.

The page needs nothing but a browser (no network, scripts or fonts from elsewhere): a header with
the counts, weights and casts; the graph's nodes coloured by precision, inserted Casts marked (a
layered drawing as inline SVG, laid out by :mod:`mixprec.report.layout`, or for large graphs a
strip with one cell per node); the per-output errors; optionally a per-node error chart; the
nodes kept FP32 with their reasons and the constants kept FP32 for their range. The footer names
the graph layout used.

    from mixprec.report import write_html_report
    write_html_report(result.report, "report.html")
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from mixprec.io import write_text_atomic
from mixprec.report.contents import Report, input_scale_text
from mixprec.validate.results import shape_text
from mixprec.report.svg import (
    MAX_ERROR_BARS,
    Page,
    PerNodeError,
    errors_svg,
    esc,
    graph_section,
    num,
    share_bar,
)

# Longest tables (FP32 nodes): rows beyond this are left to the JSON report.
MAX_TABLE_ROWS = 5000


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
    write_text_atomic(target, text)
    return target


def render_html_report(
    report: Report, *, per_node_errors: Sequence[PerNodeError] | None = None
) -> str:
    """The HTML page for `report`, as text."""
    page = Page(report)
    graph, layout = graph_section(report, page)
    parts = [_head(report), _header(report, page), graph, _outputs_section(report)]
    if per_node_errors is not None:
        parts.append(_errors_section(per_node_errors, page))
    parts += [_fp32_section(report), _ops_section(report), _foot(layout)]
    return "".join(parts)


def _mb(n: int | None) -> str:
    if n is None:
        return "unknown"
    if n < 1e6:
        return f"{n / 1e3:.1f} kB"
    return f"{n / 1e6:.2f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _speed_note(report: Report) -> str:
    """The cost model's estimate of the speed against FP32, casts included (empty without one)."""
    if report.estimated_speedup is None:
        return ""
    return (
        f'<div class="note" id="estimated-speedup">estimated speed {report.estimated_speedup:.2f}&#215; '
        f"the FP32 model's on {esc(report.cost_device or '')} (traffic, matrix FLOPs and launches per "
        f"op, dimensions that are not static as {report.symbolic_dim}; not measured)"
        + (f"; {esc(report.cost_limitation)}" if report.cost_limitation else "")
        + "</div>"
    )


def _cast_bytes(n: int | None) -> str:
    if n is None:
        return "bytes moved per inference unknown (shapes not static)"
    return f"{_mb(n)} moved per inference"


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
svg .cm{fill:#6a1b9a;stroke:#fff;stroke-width:1}
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


def _foot(layout: str) -> str:
    """The page's end; `layout` names the graph layout used ("" when none)."""
    used = f' &#183; <span id="graph-layout">layout: {esc(layout)}</span>' if layout else ""
    return (
        f'<footer class="note">Generated by mixprec{used}.</footer></main>'
        f"<script>{_JS}</script></body></html>\n"
    )


def _head(report: Report) -> str:
    title = f"mixprec report: {Path(report.source).name if report.source else 'model'} ({report.target})"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body><main>"
    )


def _header(report: Report, page: Page) -> str:
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
            f'<p class="sub"><b>{esc(report.source)}</b> &#8594; {esc(report.output or "(in memory)")}'
            f" &#183; target <b>{esc(report.target)}</b> &#183; "
            f"keep_io_types={esc(report.keep_io_types)}</p>"
        ),
        '<div class="cards">',
        '<div class="card"><h3>Nodes</h3><table>',
        f'<tr><td>in {esc(report.target)}</td><td class="n" id="count-low">{low}</td></tr>',
        f'<tr><td>in FP32</td><td class="n" id="count-fp32">{fp32}</td></tr>',
        f'<tr><td>no float compute</td><td class="n" id="count-none">{none}</td></tr>',
        f'<tr><td>total</td><td class="n" id="count-total">{total}</td></tr></table></div>',
        '<div class="card"><h3>Float nodes converted</h3>',
        f'<div class="big" id="share-converted">{share:.1f}%</div>',
        share_bar(low, fp32, none, page),
        "</div>",
        '<div class="card"><h3>Weights</h3>',
        f'<div class="big">{esc(_mb(before))} &#8594; {esc(_mb(after))}</div>',
        (
            f'<div class="note" id="weight-bytes">{before:,} &#8594; {after:,} bytes '
            f"({saved:.0f}% smaller); {report.constants_lowered} stored in {esc(report.target)}, "
            f"{report.constants_duplicated} duplicated</div></div>"
        ),
        '<div class="card"><h3>Casts</h3>',
        f'<div class="big" id="casts-runtime">{report.casts_runtime} at run time</div>',
        f'<div class="note">{esc(_cast_bytes(report.cast_bytes_per_inference))}'
        + (
            f" ({report.cast_elements_per_inference:,} elements)"
            if report.cast_elements_per_inference is not None
            else ""
        )
        + f"; {report.casts_inserted} inserted"
        + (f" ({report.casts_folded} of constants, folded when the model loads)" if report.casts_folded else "")
        + f", {report.casts_removed} redundant removed</div>"
        + _speed_note(report)
        + "</div>",
        *_quantization_card(report),
        '<div class="card"><h3>Validation</h3>',
        (
            f"<div>checker <b>{esc(v.checker)}</b></div><div>runtime <b>{esc(v.runtime)}</b>"
            f" ({v.seconds:.2f} s, {v.batches} batch{'es' if v.batches != 1 else ''})</div></div>"
        ),
        "</div>",
    ]
    notes = [*report.notes, *v.notes]
    if report.type_inference_warning:
        out.append(
            f'<p class="warn">Type inference incomplete: {esc(report.type_inference_warning)}</p>'
        )
    if notes:
        out.append('<ul class="note">' + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    out.append("</header>")
    return "".join(out)


def _quantization_card(report: Report) -> list[str]:
    q = report.quantization
    if q is None:
        return []
    qdq = ", ".join(f"{n} {esc(op)}" for op, n in q.qdq_nodes.items())
    wrapped = ", ".join(f"{esc(op)} {n}" for op, n in q.quantized_ops.items()) or "none"
    share = f"{q.float_low_share:.1%}" if q.float_low_share is not None else "&#8211;"
    return [
        '<div class="card" id="quantization"><h3>Quantized (QDQ)</h3>',
        f'<div class="big">{share}</div>',
        f'<div class="note">of the {q.float_low + q.float_fp32} float ops outside quantized groups in '
        f"{esc(report.target)}; {qdq}; ops between them: {wrapped} ({q.quantized_low} with a "
        f"{esc(report.target)} float side)"
        + (f"; {len(q.folded)} constant DequantizeLinear folded into float constants" if q.folded else "")
        + (f"; {len(q.on_integers)} data-movement group(s) written on integers" if q.on_integers else "")
        + "</div></div>",
    ]


# ---------------------------------------------------------------------------------------------
# Errors


def _outputs_section(report: Report) -> str:
    v = report.validation
    out = ['<section id="outputs"><h2>Output errors against the FP32 model</h2>']
    outputs = v.outputs or v.real_outputs  # a real run alone where no emulated model was built
    if not outputs:
        out.append(
            f'<p class="note">No numeric comparison (runtime: {esc(v.runtime)}).</p></section>'
        )
        return "".join(out)
    out.append(
        '<table class="data sortable"><thead><tr><th>output</th><th class="n">max abs error</th>'
        '<th class="n">max error / max |FP32|</th><th class="n">NaN</th><th class="n">Inf</th>'
        '<th class="n">new non-finite</th><th>within tolerance</th></tr></thead><tbody>'
    )
    for o in outputs:
        bad = o.within_tolerance is False or o.new_nonfinite > 0
        within = "\u2014" if o.within_tolerance is None else ("yes" if o.within_tolerance else "NO")
        errors = (
            f"{_num_cell(o.max_abs_error)}{_num_cell(o.scaled_error if o.scaled_error is not None else o.max_rel_error)}"
            if o.shapes is None else f'<td colspan="2">{esc(shape_text(o.shapes))}</td>'
        )
        out.append(
            f"<tr{_BAD if bad or o.shapes is not None else ''}><td>{esc(o.name)}</td>{errors}"
            f"{_num_cell(o.nan_count)}{_num_cell(o.inf_count)}{_num_cell(o.new_nonfinite)}"
            f"<td>{within}</td></tr>"
        )
    out.append(
        f'</tbody></table><p class="note">{v.batches} batch{"es" if v.batches != 1 else ""}; '
        f"runtime {esc(v.runtime)}.</p>"
    )
    if v.input_scales:
        overflows = any(check.finite is False for check in v.input_scales)
        out.append(
            f'<p class="{"warn" if overflows else "note"}" id="input-scale">Input scale: '
            f"{esc(input_scale_text(v.input_scales, report.target))}</p>"
        )
        out.extend(f'<p class="note">{esc(check.origin)}</p>' for check in v.input_scales if check.origin)
    out.append("</section>")
    return "".join(out)


_BAD = ' class="bad"'


def _num_cell(x: float) -> str:
    if isinstance(x, int):
        return f'<td class="n" data-v="{x}">{x:,}</td>'
    key = "1e308" if math.isnan(x) or x == math.inf else ("-1e308" if x == -math.inf else repr(x))
    return f'<td class="n" data-v="{key}">{num(x)}</td>'


def _errors_section(errors: Sequence[PerNodeError], page: Page) -> str:
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
    out.append(errors_svg(rows, bars, page))
    worst = sorted(range(n), key=lambda i: _sort_key(rows[i][2]), reverse=True)[:20]
    out.append(
        '<h2>Worst nodes</h2><table class="data sortable"><thead><tr><th class="n">#</th>'
        '<th>node</th><th>op</th><th>precision</th><th class="n">error</th></tr></thead><tbody>'
    )
    for i in worst:
        name, op, err = rows[i]
        letter = page.precision_of(name)
        out.append(
            f'<tr><td class="n" data-v="{i}">{i}</td><td>{esc(name)}</td><td>{esc(op)}</td>'
            f"<td>{esc(page.labels.get(letter, '?') if letter else '?')}</td>{_num_cell(err)}</tr>"
        )
    out.append("</tbody></table></section>")
    return "".join(out)


def _sort_key(x: float) -> float:
    return math.inf if math.isnan(x) else x


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
            out.append(f"<tr><td>{esc(category)}</td>{_num_cell(count)}</tr>")
        out.append("</tbody></table>")
    if kept:
        out.append(
            '<p class="note">Click a column heading to sort.</p><div class="scroll tall">'
            '<table class="data sortable" id="fp32-nodes"><thead><tr><th>node</th><th>op</th>'
            "<th>category</th><th>reason</th></tr></thead><tbody>"
        )
        for k in kept[:MAX_TABLE_ROWS]:
            out.append(
                f"<tr><td>{esc(k.name)}</td><td>{esc(k.op_type)}</td><td>{esc(k.category)}</td>"
                f"<td>{esc(k.reason)}</td></tr>"
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
            out.append(f"<tr><td>{esc(name)}</td><td>{esc(note)}</td></tr>")
        out.append("</tbody></table>")
    else:
        out.append(f'<p class="note">No constant is out of the {esc(report.target)} range.</p>')
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
            f'<thead><tr><th>op</th><th class="n">in {esc(report.target)}</th>'
            '<th class="n">in FP32</th></tr></thead><tbody>'
        )
    ]
    for op in ops:
        out.append(
            f"<tr><td>{esc(op)}</td>{_num_cell(report.low_by_op.get(op, 0))}"
            f"{_num_cell(report.fp32_by_op.get(op, 0))}</tr>"
        )
    out.append("</tbody></table></section>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
