"""Generate the runtime kernel profiles shipped in ``mixprec/policy/runtimes/``.

The profiles are parsed from pinned upstream tables (see ``SOURCE.md`` in the source folder):

* ``OperatorKernels.md`` -- the kernels ONNX Runtime registers, one section per execution
  provider; it yields ``ort-cpu.json``, ``ort-cuda.json`` and ``ort-dml.json``.
* ``operators.md`` -- the onnx-tensorrt operator support matrix; it yields ``tensorrt.json``.

Usage::

    python tools/gen_runtime_profiles.py [--source DIR] [--out DIR] [--check]

``--check`` regenerates the profiles in memory and exits 1, naming the first differing file,
when the files in ``--out`` are not exactly what the generator writes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO_ROOT.parent / "shared" / "runtime-kernels"
DEFAULT_OUT = REPO_ROOT / "src" / "mixprec" / "policy" / "runtimes"

ORT_TABLE = "OperatorKernels.md"
TRT_TABLE = "operators.md"
SOURCE_NOTES = "SOURCE.md"

# Execution provider section in OperatorKernels.md -> profile name.
ORT_PROFILES = {
    "CPUExecutionProvider": "ort-cpu",
    "CUDAExecutionProvider": "ort-cuda",
    "DmlExecutionProvider": "ort-dml",
}
TRT_PROFILE = "tensorrt"
TRT_PROVIDER = "TensorrtExecutionProvider"

# Default-domain ops whose onnxruntime kernels end at an opset the table does not state: it lists
# them as "1+", yet a session of a one-node model at the next opset finds no kernel (onnxruntime
# 1.32, CPU provider: the random-number ops' schemas of opset 22, which added bfloat16, are not
# registered; Bernoulli has no kernel of its own: it runs as its function body, a RandomUniformLike).
# tests/test_random_ops.py checks each against the installed onnxruntime.
ORT_LAST_OPSET = {
    op: 21 for op in ("Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike")
}

# Type spellings used by the onnx-tensorrt matrix -> ONNX type strings.  "INF64" is a typo for
# INT64 in the pinned table; TensorRT's FP8 is the E4M3 format.
TRT_TYPES = {
    "FP32": "tensor(float)",
    "FP16": "tensor(float16)",
    "BF16": "tensor(bfloat16)",
    "FP8": "tensor(float8e4m3fn)",
    "INT4": "tensor(int4)",
    "INT8": "tensor(int8)",
    "UINT8": "tensor(uint8)",
    "INT32": "tensor(int32)",
    "INT64": "tensor(int64)",
    "INF64": "tensor(int64)",
    "BOOL": "tensor(bool)",
}
TRT_SUPPORTED = {"Y": True, "N": False}

Json = dict[str, Any]


class TableError(ValueError):
    """A source table line has a layout the parser does not know."""

    def __init__(self, path: Path, line_no: int, message: str) -> None:
        super().__init__(f"{path.name}:{line_no}: {message}")


@dataclass(frozen=True)
class Line:
    """One numbered line of a source table."""

    path: Path
    number: int
    text: str

    def error(self, message: str) -> TableError:
        """An error pointing at this line."""
        return TableError(self.path, self.number, f"{message}: {self.text[:120]!r}")


def read_lines(path: Path) -> list[Line]:
    """The lines of ``path``, numbered from 1."""
    text = path.read_text(encoding="utf-8")
    return [Line(path, n, t) for n, t in enumerate(text.splitlines(), start=1)]


# --------------------------------------------------------------------------- SOURCE.md

SOURCE_RE = re.compile(
    r"^(?P<file>[\w.-]+): (?P<repo>[\w.-]+/(?P<name>[\w.-]+)) \S+ at commit (?P<sha>[0-9a-f]{40})\b"
)


def read_sources(path: Path) -> dict[str, str]:
    """Map each table file named in ``SOURCE.md`` to ``"<file> at <repo> commit <sha>"``."""
    sources = {}
    for line in read_lines(path):
        match = SOURCE_RE.match(line.text)
        if match:
            sources[match["file"]] = f"{match['file']} at {match['name']} commit {match['sha']}"
    return sources


def source_of(sources: dict[str, str], table: str) -> str:
    """The provenance string of ``table``; fails when SOURCE.md does not pin it."""
    if table not in sources:
        raise ValueError(f"{SOURCE_NOTES} does not name the commit of {table}")
    return sources[table]


# --------------------------------------------------------------------------- shared helpers


def split_row(line: Line) -> list[str]:
    """The stripped cells of a markdown table row, without the outer pipes' empty cells."""
    cells = [cell.strip() for cell in line.text.strip().split("|")]
    if cells[0] != "":
        raise line.error("table row does not start with '|'")
    cells = cells[1:]
    while cells and cells[-1] == "":
        cells.pop()
    return cells


def profile_header(name: str, runtime: str, provider: str, source: str) -> Json:
    """The descriptive fields of a profile (everything but the kernels)."""
    return {
        "name": name,
        "runtime": runtime,
        "provider": provider,
        "source": source,
        "opset_range": None,
    }


# --------------------------------------------------------------------------- OperatorKernels.md

SECTION_RE = re.compile(r"^## Operators implemented by (\w+)\s*$")
DOMAIN_RE = re.compile(r"^\|\*\*Operator Domain:\*\* \*([\w.]+)\*\|\|\|\|\s*$")
HEADER_RE = re.compile(r"^\| Op Name \| Parameters \| OpSet Version \| Types Supported \|\s*$")
RULE_RE = re.compile(r"^\|[-|]+\|\s*$")
BLANK_ROW_RE = re.compile(r"^\|\s*\|\s*$")
VERSION_RES = (
    (re.compile(r"^(\d+)\+$"), lambda m: (int(m[1]), None)),
    (re.compile(r"^\[(\d+), (\d+)\]$"), lambda m: (int(m[1]), int(m[2]))),
    (re.compile(r"^(\d+)$"), lambda m: (int(m[1]), int(m[1]))),
)
PARAM_RE = re.compile(r"^\*(in|out)\* ([\w]+(?:\.\.\.)?):\*\*([\w(),]+)\*\*$")
TYPES_RE = re.compile(r"^\*\*(\w+)\*\* = (.+)$")
VARIANT_SEP = "<br><br>or<br><br>"


@dataclass
class Signature:
    """The formal inputs and outputs of one kernel row, or None when the table gives none."""

    inputs: list[list[str]] | None
    outputs: list[list[str]] | None


def normalize_domain(domain: str) -> str:
    """ONNX's default domain is spelled "" in the profiles."""
    return "" if domain == "ai.onnx" else domain


def parse_version(line: Line, cell: str) -> tuple[int, int | None]:
    """``"13+"`` -> (13, None); ``"[6, 12]"`` -> (6, 12); ``"13"`` -> (13, 13)."""
    for pattern, convert in VERSION_RES:
        match = pattern.match(cell)
        if match:
            return convert(match)
    raise line.error(f"unknown opset version cell {cell!r}")


def parse_variant(line: Line, variant: str) -> Signature:
    """One parameter variant: ``*in* X:**T**<br> *out* Y:**T**``."""
    inputs: list[list[str]] = []
    outputs: list[list[str]] = []
    for part in variant.split("<br>"):
        match = PARAM_RE.match(part.strip())
        if not match:
            raise line.error(f"unknown parameter {part.strip()!r}")
        direction, name, type_ = match.groups()
        (inputs if direction == "in" else outputs).append([name, type_])
    return Signature(inputs, outputs)


def parse_parameters(line: Line, cell: str) -> list[Signature]:
    """The parameter cell's signature variants (none when the cell is empty)."""
    if not cell:
        return []
    return [parse_variant(line, v) for v in cell.split(VARIANT_SEP)]


def pick_variant(variants: list[Signature], types: dict[str, list[str]]) -> Signature:
    """The variant that fits a row: among those whose type variables the row constrains, the
    one using most of them, then the one with the most inputs (ties: the first); any variant
    when none fits."""

    def variables(sig: Signature) -> set[str]:
        return {t for _, t in [*(sig.inputs or []), *(sig.outputs or [])] if not t.startswith("tensor(")}

    if not variants:
        return Signature(None, None)
    fitting = [v for v in variants if variables(v) <= set(types)] or variants
    # max keeps the first of ties
    return max(fitting, key=lambda s: (len(variables(s)), len(s.inputs or [])))


def parse_types(line: Line, cell: str) -> dict[str, list[str]]:
    """``**T** = tensor(float), tensor(int8)<br/> **T1** = ...`` -> sorted types per variable."""
    types: dict[str, list[str]] = {}
    for part in cell.split("<br/>"):
        match = TYPES_RE.match(part.strip())
        if not match:
            raise line.error(f"unknown type constraint {part.strip()!r}")
        var, listed = match.groups()
        if var in types:
            raise line.error(f"type variable {var} listed twice")
        types[var] = sorted(t.strip() for t in listed.split(", "))
    return types


class OrtTableParser:
    """Walks OperatorKernels.md and collects the kernels of each provider section."""

    def __init__(self) -> None:
        self.kernels: dict[str, dict[str, dict[str, list[Json]]]] = {}
        self.provider: str | None = None
        self.domain: str | None = None
        self.op: str | None = None
        self.variants: list[Signature] = []

    def parse(self, lines: list[Line]) -> dict[str, dict[str, dict[str, list[Json]]]]:
        """Provider -> domain -> op -> kernel entries, in table order."""
        for line in lines:
            self.feed(line)
        return self.kernels

    def feed(self, line: Line) -> None:
        """Dispatch one line to the handler of its kind."""
        section = SECTION_RE.match(line.text)
        domain = DOMAIN_RE.match(line.text)
        if section:
            self.start_section(line, section[1])
        elif domain:
            self.start_domain(line, domain[1])
        elif not line.text.startswith("|"):
            return
        elif any(p.match(line.text) for p in (HEADER_RE, RULE_RE, BLANK_ROW_RE)):
            self.op = None
        else:
            self.add_row(line)

    def start_section(self, line: Line, provider: str) -> None:
        """A ``## Operators implemented by <provider>`` heading."""
        if provider not in ORT_PROFILES:
            raise line.error(f"unknown execution provider {provider!r}")
        if provider in self.kernels:
            raise line.error(f"second section for {provider}")
        self.provider, self.domain, self.op = provider, None, None
        self.kernels[provider] = {}

    def start_domain(self, line: Line, domain: str) -> None:
        """An ``**Operator Domain:**`` row inside a provider section."""
        if self.provider is None:
            raise line.error("operator domain outside a provider section")
        self.domain, self.op = normalize_domain(domain), None
        if self.domain in self.kernels[self.provider]:
            raise line.error(f"second table for domain {domain!r}")
        self.kernels[self.provider][self.domain] = {}

    def add_row(self, line: Line) -> None:
        """A kernel row; an empty op cell continues the previous op."""
        cells = split_row(line)
        if len(cells) != 4:
            raise line.error(f"expected 4 cells, found {len(cells)}")
        if self.provider is None or self.domain is None:
            raise line.error("kernel row outside a provider/domain table")
        op, params, version, types = cells
        ops = self.kernels[self.provider][self.domain]
        if op:
            if op in ops:
                raise line.error(f"op {op} listed twice")
            self.op, self.variants = op, parse_parameters(line, params)
            ops[op] = []
        elif self.op is None or params:
            raise line.error("a continuation row must follow an op row and repeat no parameters")
        since, until = parse_version(line, version)
        row_types = parse_types(line, types)
        signature = pick_variant(self.variants, row_types)
        ops[self.op].append(
            {
                "since": since,
                "until": until,
                "inputs": signature.inputs,
                "outputs": signature.outputs,
                "types": row_types,
            }
        )


def ort_profiles(source: Path, sources: dict[str, str]) -> dict[str, Json]:
    """The ONNX Runtime profiles, keyed by profile name."""
    kernels = OrtTableParser().parse(read_lines(source / ORT_TABLE))
    missing = sorted(set(ORT_PROFILES) - set(kernels))
    if missing:
        raise ValueError(f"{ORT_TABLE} has no section for {', '.join(missing)}")
    origin = source_of(sources, ORT_TABLE)
    profiles = {}
    for provider, name in ORT_PROFILES.items():
        profile = profile_header(name, "onnxruntime", provider, origin)
        profile["kernels"] = kernels[provider]
        _end_kernels(profile["kernels"].get("", {}))
        profiles[name] = profile
    return profiles


def _end_kernels(ops: dict[str, list[Json]]) -> None:
    """Close the open-ended kernels of :data:`ORT_LAST_OPSET` at their last opset."""
    for op, last in ORT_LAST_OPSET.items():
        for entry in ops.get(op, ()):
            if entry["until"] is None and entry["since"] <= last:
                entry["until"] = last


# --------------------------------------------------------------------------- operators.md

OPSET_RANGE_RE = re.compile(r"inclusive range of opset (\d+) to opset (\d+)")
TRT_HEADER_RE = re.compile(r"^\|\s*Operator\s*\|\s*Supported\s*\|")


def trt_opset_range(lines: list[Line]) -> tuple[int, int]:
    """The overall opset range stated in the matrix's introduction."""
    for line in lines:
        match = OPSET_RANGE_RE.search(line.text)
        if match:
            return int(match[1]), int(match[2])
    raise ValueError(f"{TRT_TABLE} states no opset range")


def trt_rows(lines: list[Line]) -> Iterator[tuple[Line, list[str]]]:
    """The data rows of the support matrix with their cells (header and rule skipped)."""
    in_table = False
    for line in lines:
        if TRT_HEADER_RE.match(line.text):
            in_table = True
        elif not line.text.startswith("|"):
            in_table = in_table and not line.text.strip()  # text, not a blank, ends the table
        elif not in_table:
            raise line.error("table row outside the operator support matrix")
        elif not RULE_RE.match(line.text):
            yield line, split_row(line)


def trt_types(line: Line, cell: str) -> list[str]:
    """``"FP32, FP16, BF16"`` -> sorted ONNX type strings (a trailing comma is tolerated)."""
    names = [name.strip() for name in cell.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRT_TYPES]
    if unknown or not names:
        raise line.error(f"unknown or missing TensorRT type spelling(s) {unknown}")
    return sorted({TRT_TYPES[name] for name in names})


def trt_note(cell: str) -> str:
    """The restriction text on one line (markdown ``<br />`` breaks become spaces)."""
    return " ".join(re.sub(r"<br\s*/?>", " ", cell).split())


def trt_entry(line: Line, cells: list[str]) -> Json | None:
    """The kernel entry of one supported op; None when TensorRT does not support it.

    The matrix states op-level facts for every opset the parser takes (the profile's
    `opset_range`, a fact about the model's opset import, not about op versions): the entry
    covers every op version.
    """
    if len(cells) < 2 or len(cells) > 4 or cells[1] not in TRT_SUPPORTED:
        raise line.error("expected 'Operator | Y/N | types | restrictions'")
    if not TRT_SUPPORTED[cells[1]]:
        return None
    if len(cells) < 3:
        raise line.error("supported op without types")
    entry: Json = {
        "since": 1,
        "until": None,
        "inputs": None,
        "outputs": None,
        "types": {"*": trt_types(line, cells[2])},
    }
    note = trt_note(cells[3]) if len(cells) == 4 else ""
    if note:
        entry["note"] = note
    return entry


def _trt_dequantize_float_side(ops: dict[str, list[Json]]) -> None:
    """The matrix lists DequantizeLinear's quantized input types only; its float side (scale
    and output) is the float type a QuantizeLinear reads, since a Q/DQ pair shares one scale
    type: add QuantizeLinear's float types to DequantizeLinear's."""
    dq, q = ops.get("DequantizeLinear"), ops.get("QuantizeLinear")
    if dq is None or q is None:
        return
    floats = {t for t in q[0]["types"]["*"] if t in ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")}
    for entry in dq:
        entry["types"]["*"] = sorted(set(entry["types"]["*"]) | floats)


def trt_profile(source: Path, sources: dict[str, str]) -> Json:
    """The TensorRT profile (all ops in ONNX's default domain)."""
    lines = read_lines(source / TRT_TABLE)
    opsets = trt_opset_range(lines)
    ops: dict[str, list[Json]] = {}
    for line, cells in trt_rows(lines):
        entry = trt_entry(line, cells)
        if cells[0] in ops:
            raise line.error(f"op {cells[0]} listed twice")
        if entry is not None:
            ops[cells[0]] = [entry]
    if not ops:
        raise ValueError(f"{TRT_TABLE} lists no supported op")
    _trt_dequantize_float_side(ops)
    profile = profile_header(TRT_PROFILE, "tensorrt", TRT_PROVIDER, source_of(sources, TRT_TABLE))
    profile["opset_range"] = list(opsets)
    profile["kernels"] = {"": ops}
    return profile


# --------------------------------------------------------------------------- output


def compact(value: Any) -> str:
    """Deterministic one-line JSON."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def render(profile: Json) -> str:
    """A profile as JSON text with one line per (domain, op) entry, keys sorted, kernels last."""
    lines = ["{"]
    fields = sorted(profile, key=lambda key: (key == "kernels", key))
    for i, key in enumerate(fields):
        comma = "," if i < len(fields) - 1 else ""
        if key == "kernels":
            lines.append(f'"kernels":{{{render_domains(profile[key])}}}{comma}')
        else:
            lines.append(f"{compact(key)}:{compact(profile[key])}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_domains(domains: dict[str, dict[str, list[Json]]]) -> str:
    """The body of the ``kernels`` object: a line per domain opener and per op."""
    blocks = []
    for domain in sorted(domains):
        ops = [f"{compact(op)}:{compact(domains[domain][op])}" for op in sorted(domains[domain])]
        blocks.append(f"\n{compact(domain)}:{{\n" + ",\n".join(ops) + "\n}")
    return ",".join(blocks) + "\n"


def generate(source: Path) -> dict[str, str]:
    """File name -> file text for every profile."""
    sources = read_sources(source / SOURCE_NOTES)
    profiles = ort_profiles(source, sources)
    profiles[TRT_PROFILE] = trt_profile(source, sources)
    return {f"{name}.json": render(profile) for name, profile in sorted(profiles.items())}


def _hand_written(path: Path) -> bool:
    """Profiles without a kernel table (`"kernels": null`: onnx, openvino) are written by hand."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "kernels" in data and data["kernels"] is None


def first_difference(files: dict[str, str], out: Path) -> str | None:
    """The first file (by name) whose shipped text differs, is missing, or is unexpected."""
    shipped = {p.name for p in out.glob("*.json") if not _hand_written(p)} if out.is_dir() else set()
    for name in sorted(shipped | set(files)):
        path = out / name
        if name not in files or not path.is_file():
            return name
        if path.read_text(encoding="utf-8") != files[name]:
            return name
    return None


def write(files: dict[str, str], out: Path) -> None:
    """Write the profiles into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8", newline="\n")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="pinned tables")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="profile folder")
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    files = generate(args.source)
    if args.check:
        differing = first_difference(files, args.out)
        if differing is not None:
            print(f"{args.out / differing} is out of date; rerun {Path(__file__).name}")
            return 1
        return 0
    write(files, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
