"""The HTML report: a well-formed, self-contained page with the counts, the graph coloured by
precision, the errors and the FP32 nodes; written atomically; rendered by a real browser."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
import pytest

import mixprec
from mixprec.cli import main
from mixprec.demo_models import small_cnn, transformer_block
from mixprec.errors import InputError
from mixprec.report import (
    KeptNode,
    NodeGraph,
    OutputError,
    Report,
    Validation,
    render_html_report,
    write_html_report,
)

_VOID = {
    "area",
    "base",
    "br",
    "col",
    "embed",
    "hr",
    "img",
    "input",
    "link",
    "meta",
    "source",
    "wbr",
}
# Fill colours of 16-bit and FP32 nodes (kept in step with mixprec.report.svg._COLOURS).
_LOW_RGB = (0x2F, 0x6F, 0xD0)
_FP32_RGB = (0xE8, 0x71, 0x0A)


class _StrictParser(HTMLParser):
    """Checks that every element is closed in order; collects the text and the text by id."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: dict[str, int] = {}
        self.text: list[str] = []
        self.by_id: dict[str, list[str]] = {}
        self._ids: list[str | None] = []

    def handle_starttag(self, tag, attrs):  # type: ignore[no-untyped-def]
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if tag in _VOID:
            return
        self.stack.append(tag)
        self._ids.append(dict(attrs).get("id"))

    def handle_startendtag(self, tag, attrs):  # type: ignore[no-untyped-def]
        self.tags[tag] = self.tags.get(tag, 0) + 1

    def handle_endtag(self, tag):  # type: ignore[no-untyped-def]
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
            return
        self.stack.pop()
        self._ids.pop()

    def handle_data(self, data):  # type: ignore[no-untyped-def]
        self.text.append(data)
        for element_id in self._ids:
            if element_id is not None:
                self.by_id.setdefault(element_id, []).append(data)


def _parse(text: str) -> _StrictParser:
    parser = _StrictParser()
    parser.feed(text)
    parser.close()
    assert not parser.errors, parser.errors[:5]
    assert parser.stack == [], f"unclosed elements: {parser.stack}"
    assert text.startswith("<!DOCTYPE html>")
    return parser


def _assert_self_contained(text: str) -> None:
    lowered = text.lower()
    for needle in ("http://", "https://", "src=", "<link", "@import", "url(", "//cdn"):
        assert needle not in lowered, f"the page refers to something outside it: {needle!r}"


@pytest.fixture(scope="module", params=["transformer_block", "small_cnn"])
def converted(request: pytest.FixtureRequest) -> mixprec.ConversionResult:
    build = {"transformer_block": transformer_block, "small_cnn": small_cnn}[request.param]
    return mixprec.convert(build(), validate="run")


def test_page_is_well_formed_and_complete(
    converted: mixprec.ConversionResult, tmp_path: Path
) -> None:
    report = converted.report
    path = write_html_report(report, tmp_path / "report.html")
    text = path.read_text(encoding="utf-8")
    page = _parse(text)
    _assert_self_contained(text)
    assert page.tags.get("svg", 0) >= 2  # the share bar and the graph
    graph_nodes = text.count("<title>") - 1  # the page title
    assert graph_nodes >= len(converted.plan.order)  # one tooltip per drawn node (and more)

    counts = report.nodes_by_precision
    ids = {k: "".join(v).strip() for k, v in page.by_id.items()}
    assert ids["count-low"] == str(counts.get("low", 0))
    assert ids["count-fp32"] == str(counts.get("fp32", 0))
    assert ids["count-none"] == str(counts.get("none", 0))
    assert ids["count-total"] == str(sum(counts.values()))
    floats = counts.get("low", 0) + counts.get("fp32", 0)
    assert ids["share-converted"] == f"{100 * counts.get('low', 0) / floats:.1f}%"
    assert f"{report.weight_bytes_before:,}" in ids["weight-bytes"]
    assert f"{report.weight_bytes_after:,}" in ids["weight-bytes"]
    assert ids["casts-runtime"] == f"{report.casts_runtime} at run time"

    assert report.kept_fp32, "the demo models keep some nodes FP32"
    fp32_table = "".join(page.by_id["fp32-nodes"])
    for kept in report.kept_fp32:
        assert kept.name in fp32_table
        assert kept.reason in fp32_table
    assert report.constants_kept_for_range
    constants = "".join(page.by_id["range-constants"])
    for name, evidence in report.constants_kept_for_range.items():
        assert name in constants and evidence in constants
    outputs = "".join(page.by_id["outputs"])
    assert report.validation.outputs
    for out in report.validation.outputs:
        assert out.name in outputs
    assert "node-errors" not in page.by_id  # no per-node errors given: no section


def test_node_graph_edges_look_through_inserted_casts() -> None:
    result = mixprec.convert(transformer_block(), validate="none")
    graph = result.report.graph
    assert graph is not None and len(graph) == len(result.plan.order)
    index = {name: i for i, name in enumerate(graph.names)}
    # attn/Div runs in float16, attn/Add_mask in FP32: a Cast sits between them in the model.
    assert index["attn/Div"] in graph.inputs[index["attn/Add_mask"]]
    assert graph.precision[index["attn/Div"]] == "l"
    assert graph.precision[index["attn/Add_mask"]] == "f"
    assert index["attn/Add_mask"] in graph.inputs[index["attn/Softmax"]]
    for i, preds in enumerate(graph.inputs):
        assert all(0 <= p < i for p in preds)
    # The JSON stays as it was unless the listing is asked for.
    assert "graph" not in result.report.to_dict()
    full = json.loads(json.dumps(result.report.to_dict(include_graph=True)))
    assert full["graph"]["names"] == graph.names
    assert len(full["graph"]["precision"]) == len(graph)


def test_per_node_error_chart(tmp_path: Path) -> None:
    report = mixprec.convert(small_cnn(), validate="none").report
    assert report.graph is not None
    rng = random.Random(0)
    errors = [
        (n, op, rng.random() * 10 ** rng.uniform(-6, -1))
        for n, op in zip(report.graph.names, report.graph.op_types)
    ]
    errors[1] = (errors[1][0], errors[1][1], math.inf)
    errors[2] = (errors[2][0], errors[2][1], math.nan)
    errors[3] = (errors[3][0], errors[3][1], 0.0)
    text = write_html_report(report, tmp_path / "r.html", per_node_errors=errors).read_text()
    page = _parse(text)
    section = "".join(page.by_id["node-errors"])
    worst = max(errors[4:], key=lambda e: e[2])
    assert worst[0] in section
    assert "inf" in section and "NaN" in section
    # An empty list keeps the section, with a note; None leaves it out (checked above).
    empty = _parse(render_html_report(report, per_node_errors=[]))
    assert "No per-node errors" in "".join(empty.by_id["node-errors"])


def test_write_is_atomic_and_checks_the_folder(tmp_path: Path) -> None:
    report = mixprec.convert(small_cnn(), validate="none").report
    target = tmp_path / "report.html"
    target.write_text("old")
    write_html_report(report, target)
    assert target.read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temporary left
    with pytest.raises(InputError, match="does not exist"):
        write_html_report(report, tmp_path / "missing" / "report.html")


def test_report_without_node_listing(tmp_path: Path) -> None:
    report = _synthetic_report(50)
    report.graph = None
    text = write_html_report(report, tmp_path / "r.html").read_text()
    _parse(text)
    assert "graph is not drawn" in text


def _synthetic_report(n: int, seed: int = 0) -> Report:
    """A report of an n-node graph, as a conversion of a deep transformer-like model makes it."""
    rng = random.Random(seed)
    ops = [
        "MatMul",
        "Add",
        "Mul",
        "Reshape",
        "Transpose",
        "Softmax",
        "Shape",
        "Gather",
        "Div",
        "Erf",
    ]
    names, op_types, precision, inputs, kept = [], [], [], [], []
    for i in range(n):
        name = f"/model/layers.{i // 40}/block/op_{i}"
        op = ops[rng.randrange(len(ops))]
        letter = (
            "f"
            if op == "Softmax" or rng.random() < 0.05
            else ("n" if op in ("Shape", "Gather") else "l")
        )
        preds = (
            sorted({i - 1, *(rng.randrange(max(0, i - 60), i) for _ in range(rng.randrange(2)))})
            if i
            else []
        )
        names.append(name)
        op_types.append(op)
        precision.append(letter)
        inputs.append([p for p in preds if p >= 0])
        if letter == "f":
            kept.append(KeptNode(name, op, "policy", f"{op}: kept FP32 by the policy"))
    categories = ["policy", "follows inputs", "no FP32 compute"]
    reasons = ["kept FP32 by the policy", "follows 16-bit inputs", "no FP32 values"]
    code = {"f": 0, "l": 1, "n": 2}
    graph = NodeGraph(
        names,
        op_types,
        "".join(precision),
        [code[p] for p in precision],
        [code[p] for p in precision],
        inputs,
        categories,
        reasons,
    )
    by = {"low": precision.count("l"), "fp32": precision.count("f"), "none": precision.count("n")}
    return Report(
        source="/models/synthetic.onnx",
        output="/models/synthetic.fp16.onnx",
        target="float16",
        keep_io_types=True,
        nodes_by_precision=by,
        low_by_op={"MatMul": by["low"]},
        fp32_by_op={"Softmax": by["fp32"]},
        fp32_by_category={"policy": by["fp32"]},
        kept_fp32=kept,
        casts_inserted=10,
        casts_runtime=10,
        cast_elements_per_inference=1000,
        cast_bytes_per_inference=6000,
        casts_removed=0,
        constants_lowered=5,
        constants_duplicated=0,
        constants_kept_for_range={"mask_min": "absmax 3.4e+38 > 65504"},
        weight_bytes_before=4_000_000,
        weight_bytes_after=2_000_000,
        validation=Validation(
            "passed", "ran", 1.0, 1, [OutputError("logits", 1e-3, 1e-2, 0, 0, 0, True)]
        ),
        graph=graph,
    )


@pytest.mark.parametrize("n", [2500, 20000])
def test_large_report_is_compact(n: int, tmp_path: Path) -> None:
    """2,500 nodes: the layered drawing; 20,000: the strip. Both under 20 MB."""
    report = _synthetic_report(n)
    assert report.graph is not None
    errors = [
        (name, op, 1e-3 * (i % 97 + 1))
        for i, (name, op) in enumerate(zip(report.graph.names, report.graph.op_types))
    ]
    path = write_html_report(report, tmp_path / "big.html", per_node_errors=errors)
    size = path.stat().st_size
    assert size < 20e6, f"{size / 1e6:.1f} MB"
    text = path.read_text()
    page = _parse(text)
    _assert_self_contained(text)
    assert page.tags["svg"] >= 3
    assert ("Precision by depth" in text) == (n > 3000)


def test_cli_writes_html_only_after_a_successful_conversion(tmp_path: Path) -> None:
    source = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), str(source))
    html_path = tmp_path / "report.html"
    code = main(["convert", str(source), str(tmp_path / "cnn.fp16.onnx"), "--html", str(html_path)])
    assert code == 0
    page = _parse(html_path.read_text())
    assert "head/Softmax" in "".join(page.by_id["fp32-nodes"])

    failed = tmp_path / "failed.html"
    code = main(
        [
            "convert",
            str(source),
            str(tmp_path / "x.onnx"),
            "--tolerance",
            "0",
            "--html",
            str(failed),
        ]
    )
    assert code == 3
    assert not failed.exists() and not (tmp_path / "x.onnx").exists()


# ---------------------------------------------------------------------------------------------
# A real browser


def _chromium() -> str | None:
    if Path("/usr/bin/chromium").exists():
        return "/usr/bin/chromium"
    return shutil.which("chromium")


def _read_png(path: Path) -> np.ndarray:
    """Pixels (height, width, 3) of an 8-bit RGB or RGBA, non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
    assert header is not None
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    stride = width * bpp
    raw = zlib.decompress(b"".join(idat))
    pixels = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for r in range(height):
        kind = raw[r * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, r * (stride + 1) + 1)
        if kind == 0:
            cur = line.copy()
        elif kind == 1:  # Sub: a running sum per channel
            cur = (
                (line.reshape(-1, bpp).cumsum(axis=0, dtype=np.uint64) % 256)
                .astype(np.uint8)
                .ravel()
            )
        elif kind == 2:  # Up
            cur = line + prev
        else:  # Average, Paeth: sequential along the row
            row, up = bytearray(line.tobytes()), prev.tobytes()
            for i in range(stride):
                a = row[i - bpp] if i >= bpp else 0
                b = up[i]
                if kind == 3:
                    row[i] = (row[i] + ((a + b) >> 1)) & 255
                    continue
                c = up[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            cur = np.frombuffer(bytes(row), np.uint8)
        pixels[r] = cur
        prev = cur
    return pixels.reshape(height, width, bpp)[:, :, :3]


def _has_colour(pixels: np.ndarray, rgb: tuple[int, int, int], at_least: int = 200) -> bool:
    close = np.all(np.abs(pixels.astype(np.int16) - np.array(rgb, dtype=np.int16)) <= 6, axis=-1)
    return int(close.sum()) >= at_least


def _screenshot(
    page: Path, tmp_path: Path, size: tuple[int, int], fragment: str = ""
) -> np.ndarray:
    """The pixels of `page` rendered by headless chromium in a window of `size` (width, height),
    scrolled to `fragment` ("#id") when given."""
    shot = tmp_path / "shot.png"
    command = [
        str(_chromium()),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        f"--window-size={size[0]},{size[1]}",
        page.resolve().as_uri() + fragment,
    ]
    done = subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert shot.exists(), f"no screenshot (exit {done.returncode}): {done.stderr[-2000:]}"
    pixels = _read_png(shot)
    assert pixels.shape[:2] == (size[1], size[0])
    return pixels


def _colour_pixels(pixels: np.ndarray, rgb: tuple[int, int, int]) -> int:
    close = np.all(np.abs(pixels.astype(np.int16) - np.array(rgb, dtype=np.int16)) <= 6, axis=-1)
    return int(close.sum())


_NO_CHROMIUM = (
    "no chromium browser (Debian: apt-get install -y chromium) for the headless render check"
)


@pytest.mark.skipif(_chromium() is None, reason=_NO_CHROMIUM)
@pytest.mark.slow
def test_headless_chromium_renders_the_page(tmp_path: Path) -> None:
    result = mixprec.convert(transformer_block(), validate="run")
    report_path = write_html_report(result.report, tmp_path / "report.html")
    pixels = _screenshot(report_path, tmp_path, (1200, 900))
    flat = pixels.reshape(-1, 3)
    assert (flat != flat[0]).any(axis=1).sum() > 0.02 * len(flat), "the screenshot is blank"
    # The graph is in view: 16-bit nodes and FP32 nodes are drawn in their colours.
    assert _has_colour(pixels, _LOW_RGB), "no 16-bit (blue) node pixels in the screenshot"
    assert _has_colour(pixels, _FP32_RGB), "no FP32 (orange) node pixels in the screenshot"


def _weights_in_constant_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every initializer moved into a Constant node at the top of the graph, as
    some exporters (paddle2onnx) store weights."""
    graph = model.graph
    constants = [
        onnx.helper.make_node("Constant", [], [t.name], name=f"{t.name}_constant", value=t)
        for t in graph.initializer
    ]
    nodes = list(graph.node)
    del graph.initializer[:]
    del graph.node[:]
    graph.node.extend(constants + nodes)
    return model


@pytest.mark.skipif(_chromium() is None, reason=_NO_CHROMIUM)
@pytest.mark.skipif(
    shutil.which("dot") is None,
    reason="no Graphviz dot (Debian: apt-get install -y graphviz) to lay the graph out",
)
@pytest.mark.slow
def test_exported_model_graph_is_readable_in_chromium(tmp_path: Path) -> None:
    """A PyTorch transformer exported by torch.onnx (dynamo), its weights in Constant nodes: the
    picture draws the computing nodes (no Constant boxes), laid out by dot, with the 16-bit and
    FP32 colours both in view."""
    pytest.importorskip("torch")
    import torch_models  # noqa: PLC0415  (tests/ is on sys.path via conftest.py)

    exported = torch_models.export(
        torch_models.make_model(seed=0), tmp_path / "encoder.onnx", dynamo=True
    )
    model = _weights_in_constant_nodes(onnx.load(str(exported)))
    constants = sum(node.op_type == "Constant" for node in model.graph.node)
    assert constants >= 30, constants
    result = mixprec.convert(model, runtime="onnx")
    graph = result.report.graph
    assert graph is not None
    computing = graph.constant.count("0")
    assert computing <= len(graph) - constants
    drawn = [i for i, flag in enumerate(graph.constant) if flag == "0"]
    assert {"l", "f"} <= {graph.precision[i] for i in drawn}

    report_path = write_html_report(result.report, tmp_path / "report.html")
    text = report_path.read_text(encoding="utf-8")
    _parse(text)
    _assert_self_contained(text)
    assert "layout: graphviz dot" in text
    start = text.index('aria-label="graph nodes by precision"')
    svg = text[start : text.index("</svg>", start)]
    boxes = len(re.findall(r'<rect [^>]*class="p[lfn]', svg))
    assert boxes == computing, (boxes, computing, len(graph))
    assert ">Constant<" not in svg
    assert 'class="cm"' in svg  # the Casts between 16-bit and FP32 nodes are marked

    pixels = _screenshot(report_path, tmp_path, (1200, 1200), "#graph")
    low, fp32 = _colour_pixels(pixels, _LOW_RGB), _colour_pixels(pixels, _FP32_RGB)
    # A labelled box is 96 x 22 pixels; the header's share bar (240 x 12) is out of view and
    # could not account for this much either.
    assert low >= 10 * 1500, f"{low} 16-bit (blue) pixels"
    assert fp32 >= 3 * 1000, f"{fp32} FP32 (orange) pixels"
    assert 0.03 <= fp32 / low <= 1.0, (low, fp32)
