"""The conversion report: the data (:mod:`~mixprec.report.contents`), the HTML page
(:mod:`~mixprec.report.html`) and the graph layout it draws (:mod:`~mixprec.report.layout`)."""

from __future__ import annotations

from mixprec.report.html import render_html_report, write_html_report
from mixprec.report.contents import (
    KeptNode,
    NodeGraph,
    OutputError,
    Report,
    Validation,
    build_report,
    count_nodes,
    node_graph,
)

__all__ = [
    "KeptNode",
    "NodeGraph",
    "OutputError",
    "Report",
    "Validation",
    "build_report",
    "count_nodes",
    "node_graph",
    "render_html_report",
    "write_html_report",
]
