"""Benchmark mixprec's float16 conversion against the I/O floor and other converters.

For every model, each tool runs in its own subprocess so that its peak RSS, CPU
time and wall time are measured in isolation (``os.wait4`` on the child):

* ``floor``: copy the model file and its external data file(s) with fsync, the
  least any converter that reads and rewrites the weights has to do;
* ``mixprec``: ``mixprec.convert(in, out, target_dtype="float16")`` (its default validation:
  an onnxruntime session up to 50,000 nodes, the checker above);
* ``mixprec-checker`` (with ``--tools``): the same with ``validate="checker"`` (no session);
* ``mixprec-command`` (with ``--tools``): the command as users run it, ``mixprec convert in out
  --to fp16 --validate checker`` as the console script runs it (``main()`` reading
  ``sys.argv``: one conversion, no garbage collection over the converted model);
* ``onnxconverter-common``: ``float16.convert_float_to_float16(model, keep_io_types=True)``
  (its ``..._model_path`` variant for models over 2 GB, as its docs advise);
* ``ort-float16``: ``onnxruntime.transformers.float16.convert_float_to_float16(path,
  keep_io_types=True)``;
* ``ort-onnxmodel`` (only with ``--tools``):
  ``OnnxModel(m).convert_float_to_float16(keep_io_types=True)``.

Every tool's output files are fsynced inside the timed child, as the floor's are.
Failures, timeouts, memory-limit kills and missing packages become rows of the
table instead of aborting the run.

Example::

    python bench/bench_convert.py bench/out/llama_tiny.onnx bench/out/wide_2000.onnx \\
        --check-load --json bench/out/results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LOG = logging.getLogger("bench_convert")

DEFAULT_TOOLS = ("floor", "mixprec", "onnxconverter-common", "ort-float16")
ALL_TOOLS = (*DEFAULT_TOOLS, "mixprec-checker", "mixprec-command", "ort-onnxmodel")
TWO_GB = 2**31


# --------------------------------------------------------------------------- worker side


def _external_files(model_path: Path) -> list[Path]:
    """Returns the external data files referenced by a model (without loading the weights)."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    model = onnx.load(str(model_path), load_external_data=False)
    files: dict[str, Path] = {}
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor):
            location = next(e.value for e in tensor.external_data if e.key == "location")
            files.setdefault(location, model_path.parent / location)
    return list(files.values())


def _fsync_tree(path: Path) -> None:
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(model: Any, out: Path, external: bool) -> None:
    import onnx

    if external:
        onnx.save(
            model,
            str(out),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=out.name + ".data",
        )
    else:
        onnx.save(model, str(out))


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    else:
        to_dict = getattr(obj, "to_dict", None) or getattr(obj, "as_dict", None)
        if callable(to_dict):
            try:
                obj = to_dict()
            except Exception as exc:  # noqa: BLE001 - the report is informational only
                LOG.warning("report.%s() failed: %s", to_dict.__name__, exc)
    try:
        text = json.dumps(obj, default=str)
    except (TypeError, ValueError):
        return str(obj)[:4000]
    return json.loads(text) if len(text) < 200_000 else text[:4000]


def _inspect(src: Path) -> dict[str, Any]:
    import onnx

    ext = _external_files(src)
    return {
        "external_files": [str(f) for f in ext],
        "input_bytes": src.stat().st_size + sum(f.stat().st_size for f in ext if f.exists()),
        "nodes": len(onnx.load(str(src), load_external_data=False).graph.node),
    }


class ToolUnavailableError(Exception):
    """The package that provides a tool cannot be imported."""


def _import_tool(tool: str) -> dict[str, Any]:
    """Imports what a tool needs; raises ToolUnavailableError if a package is missing."""
    try:
        if tool == "floor":
            return {}
        if tool in ("mixprec", "mixprec-checker"):
            import mixprec

            return {"mixprec": mixprec}
        if tool == "mixprec-command":
            import mixprec.cli

            return {"cli": mixprec.cli}
        import onnx

        if tool == "onnxconverter-common":
            from onnxconverter_common import float16

            return {"onnx": onnx, "float16": float16}
        if tool == "ort-float16":
            from onnxruntime.transformers import float16 as ort_float16

            return {"onnx": onnx, "float16": ort_float16}
        if tool == "ort-onnxmodel":
            from onnxruntime.transformers.onnx_model import OnnxModel

            return {"onnx": onnx, "OnnxModel": OnnxModel}
    except ImportError as exc:
        raise ToolUnavailableError(f"{type(exc).__name__}: {exc}") from exc
    raise ValueError(f"unknown tool {tool!r}")


def _run_tool(tool: str, src: Path, out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Runs one tool in this (child) process and returns its phase timings."""
    phases: dict[str, float] = {}
    info: dict[str, Any] = {}
    src_bytes = int(meta["input_bytes"])
    large = src_bytes > TWO_GB - 2**26
    # Save like the input: external data when the input has it or the output could pass 2 GB.
    external = large or bool(meta["external_files"])

    t = time.perf_counter()
    mod = _import_tool(tool)
    phases["import_s"] = time.perf_counter() - t

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name] = now - t
        t = now

    if tool == "floor":
        for f in [src, *map(Path, meta["external_files"])]:
            shutil.copyfile(f, out.parent / f.name)  # sendfile(2): no user-space copy.
        lap("copy_s")
    elif tool in ("mixprec", "mixprec-checker"):
        # mixprec-checker: the ONNX checker only, no onnxruntime session (as the other tools).
        validate = "checker" if tool == "mixprec-checker" else "auto"
        result = mod["mixprec"].convert(src, out, target_dtype="float16", validate=validate)
        lap("convert_s")
        # The report's counts only: its per-node graph and kept-node list would put seconds of
        # the bench's own JSON work on mixprec's clock at 100k nodes.
        report = result.report
        info["report"] = {
            "nodes_by_precision": report.nodes_by_precision, "casts_inserted": report.casts_inserted,
            "casts_runtime": report.casts_runtime, "fp32_by_category": report.fp32_by_category,
            "estimated_speedup": report.estimated_speedup, "validation": _jsonable(report.validation),
        }
        info["steps"] = {"seconds": result.report.seconds, "cpu_seconds": result.report.cpu_seconds}
    elif tool == "mixprec-command":
        report_path = out.parent / "report.json"
        # As the console script runs it: `main()` reads sys.argv.
        sys.argv = ["mixprec", "convert", str(src), str(out), "--to", "fp16", "--validate", "checker", "--report", str(report_path)]
        code = mod["cli"].main()
        lap("convert_s")
        if code != 0:
            raise RuntimeError(f"mixprec convert exited {code}")
        report = json.loads(report_path.read_text())
        report_path.unlink()
        info["steps"] = {"seconds": report.get("seconds"), "cpu_seconds": report.get("cpu_seconds")}
    elif tool == "onnxconverter-common":
        float16 = mod["float16"]
        if large:  # The library's documented entry point for models over 2 GB.
            info["api"] = "convert_float_to_float16_model_path"
            model = float16.convert_float_to_float16_model_path(str(src), keep_io_types=True)
        else:
            info["api"] = "convert_float_to_float16"
            model = mod["onnx"].load(str(src))
            lap("load_s")
            model = float16.convert_float_to_float16(model, keep_io_types=True)
        lap("convert_s")
        _save(model, out, external)
        lap("save_s")
    elif tool == "ort-float16":
        model = mod["float16"].convert_float_to_float16(str(src), keep_io_types=True)
        lap("convert_s")
        _save(model, out, external)
        lap("save_s")
    elif tool == "ort-onnxmodel":
        wrapped = mod["OnnxModel"](mod["onnx"].load(str(src)))
        lap("load_s")
        wrapped.convert_float_to_float16(keep_io_types=True)
        lap("convert_s")
        wrapped.save_model_to_file(str(out), use_external_data_format=external)
        lap("save_s")

    _fsync_tree(out.parent)
    lap("fsync_s")
    return {"phases": phases, **info}


def _load_check(model: Path) -> dict[str, Any]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    t = time.perf_counter()
    ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    return {"phases": {"session_s": time.perf_counter() - t}}


def worker_main(argv: Sequence[str]) -> int:
    """Child entry point: ``--worker JOB_JSON`` (keys: tool, src, out, result, model metadata)."""
    job = json.loads(argv[0])
    tool, src, result_path = job["tool"], Path(job["src"]), job["result"]
    result: dict[str, Any]
    try:
        if tool == "load":
            result = _load_check(src)
        elif tool == "inspect":
            result = _inspect(src)
        else:
            result = _run_tool(tool, src, Path(job["out"]), job)
        result["ok"] = True
    except ToolUnavailableError as exc:
        result = {"ok": False, "unavailable": True, "error": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - MemoryError, RecursionError, ... are rows
        result = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    Path(result_path).write_text(json.dumps(result, default=str))
    return 0 if result["ok"] else 1


# --------------------------------------------------------------------------- parent side


@dataclasses.dataclass
class ToolResult:
    """Measurements of one tool on one model."""

    tool: str
    status: str  # ok | error | unavailable | timeout | memory-limit | killed | skipped
    wall_s: float | None = None
    cpu_s: float | None = None
    peak_rss_mib: float | None = None
    output_mib: float | None = None
    error: str | None = None
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    load: dict[str, Any] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _run_child(
    job: dict[str, Any], timeout: float, mem_limit_mib: float | None, log_path: Path
) -> dict[str, Any]:
    """Runs this script as a worker child; returns status, wall, CPU and peak RSS of the child.

    Note: on Linux a child's ru_maxrss also covers the parent's RSS at fork time (vfork
    + exec), so this parent process deliberately stays small (no onnx import).
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)]
    reason: list[str] = []
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    done = threading.Event()

    def watchdog() -> None:
        deadline = start + timeout
        while not done.wait(0.1):
            rss = _rss_mib(proc.pid) if mem_limit_mib else None
            if rss is not None and mem_limit_mib is not None and rss > mem_limit_mib:
                reason.append(f"memory-limit: RSS {rss:.0f} MiB > {mem_limit_mib:.0f} MiB")
            elif time.perf_counter() > deadline:
                reason.append(f"timeout after {timeout:.0f} s")
            else:
                continue
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return

    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    thread.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {
        "returncode": proc.returncode,
        "reason": reason[0] if reason else None,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux.
    }


def _tree_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def _log_tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def run_tool(
    tool: str, src: Path, meta: dict[str, Any], work: Path, args: argparse.Namespace
) -> ToolResult:
    """Runs one tool (and optionally the load check) on ``src`` in a fresh child process."""
    out_dir = work / tool
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / src.name
    result_json = work / f"{tool}.result.json"
    job = {"tool": tool, "src": str(src), "out": str(out), "result": str(result_json), **meta}
    before = set(os.listdir(src.parent))
    child = _run_child(job, args.timeout, args.mem_limit_mib, work / f"{tool}.log")
    stray = sorted(set(os.listdir(src.parent)) - before)
    res = ToolResult(tool, "ok", child["wall_s"], child["cpu_s"], child["peak_rss_mib"])
    payload: dict[str, Any] = {}
    if result_json.exists():
        payload = json.loads(result_json.read_text())
    if child["reason"]:
        res.status = child["reason"].split(":")[0].split(" ")[0]
        res.error = child["reason"]
    elif child["returncode"] < 0:
        sig = -child["returncode"]
        res.status = "killed"
        res.error = f"killed by {signal.Signals(sig).name}" + (
            " (likely out of memory)" if sig == 9 else ""
        )
    elif not payload:
        res.status = "error"
        res.error = f"exit code {child['returncode']}: {_log_tail(work / f'{tool}.log')}"
    elif not payload["ok"]:
        res.status = "unavailable" if payload.get("unavailable") else "error"
        res.error = payload["error"]
        if payload.get("traceback"):
            res.extra["traceback"] = payload["traceback"]
    if stray:  # E.g. temporary files a tool created next to the input and did not remove.
        res.extra["stray_files"] = [str(src.parent / name) for name in stray]
    res.phases = payload.get("phases", {})
    res.extra.update(
        {
            k: v
            for k, v in payload.items()
            if k not in ("ok", "phases", "error", "traceback", "unavailable")
        }
    )
    if res.status == "ok":
        res.output_mib = _tree_mib(out_dir)
        if args.check_load and tool != "floor":
            res.load = _check_load(out, work, tool, args)
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)
    return res


def _check_load(model: Path, work: Path, tool: str, args: argparse.Namespace) -> dict[str, Any]:
    result_json = work / f"{tool}.load.json"
    job = {"tool": "load", "src": str(model), "result": str(result_json)}
    child = _run_child(job, args.timeout, args.mem_limit_mib, work / f"{tool}.load.log")
    payload = json.loads(result_json.read_text()) if result_json.exists() else {}
    ok = bool(payload.get("ok"))
    error = (
        None
        if ok
        else (
            child["reason"]
            or payload.get("error")
            or f"exit code {child['returncode']}: {_log_tail(work / f'{tool}.load.log')}"
        )
    )
    return {
        "ok": ok,
        "session_s": payload.get("phases", {}).get("session_s"),
        "wall_s": child["wall_s"],
        "peak_rss_mib": child["peak_rss_mib"],
        "error": error,
    }


def _inspect_model(model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Gets external data files, size and node count from a child (keeps the parent small)."""
    result_json = work / "inspect.json"
    child = _run_child(
        {"tool": "inspect", "src": str(model), "result": str(result_json)},
        args.timeout,
        None,
        work / "inspect.log",
    )
    payload = json.loads(result_json.read_text()) if result_json.exists() else {}
    if not payload.get("ok"):
        raise RuntimeError(
            payload.get("error") or child["reason"] or _log_tail(work / "inspect.log")
        )
    return {k: payload[k] for k in ("external_files", "input_bytes", "nodes")}


def _warm_cache(files: Sequence[Path]) -> None:
    buf = bytearray(2**20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _fmt(v: float | None, spec: str) -> str:
    width = int(spec.split(".")[0] or 0)
    return f"{'-':>{width}}" if v is None else format(v, spec)


def print_table(model: str, input_mib: float, nodes: int, results: Sequence[ToolResult]) -> None:
    """Prints one model's results with absolute numbers and ratios to the floor and to mixprec."""
    by = {r.tool: r for r in results}
    floor = by.get("floor")
    mix = by.get("mixprec")
    floor_ok = floor if floor and floor.status == "ok" else None
    mix_ok = mix if mix and mix.status == "ok" else None
    print(f"\n== {model}  ({input_mib:.1f} MiB, {nodes} nodes)")
    head = (
        f"{'tool':<21} {'status':<12} {'wall s':>8} {'cpu s':>8} {'RSS MiB':>9} {'out MiB':>9} "
        f"{'wall/floor':>10} {'wall/mixp':>9} {'RSS/floor':>9} {'RSS/mixp':>9} {'load s':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        wall, rss = (r.wall_s, r.peak_rss_mib) if r.status == "ok" else (None, None)
        load = "-"
        if r.load is not None:
            load = _fmt(r.load["session_s"], ".2f") if r.load["ok"] else "FAIL"
        print(
            f"{r.tool:<21} {r.status:<12} {_fmt(r.wall_s, '8.2f')} {_fmt(r.cpu_s, '8.2f')} "
            f"{_fmt(r.peak_rss_mib, '9.0f')} {_fmt(r.output_mib, '9.1f')} "
            f"{_ratio(wall, floor_ok.wall_s if floor_ok else None):>10} "
            f"{_ratio(wall, mix_ok.wall_s if mix_ok else None):>9} "
            f"{_ratio(rss, floor_ok.peak_rss_mib if floor_ok else None):>9} "
            f"{_ratio(rss, mix_ok.peak_rss_mib if mix_ok else None):>9} {load:>7}"
        )
    for r in results:
        report = r.extra.get("steps") if r.status == "ok" else None
        if isinstance(report, dict) and report.get("seconds"):
            cpu = report.get("cpu_seconds") or {}
            steps = ", ".join(
                f"{step} {wall:.2f}/{cpu[step]:.2f}" if step in cpu else f"{step} {wall:.2f}"
                for step, wall in report["seconds"].items()
            )
            print(f"  {r.tool} steps (wall/cpu s of the conversion process): {steps}")
    for r in results:
        if r.error:
            print(f"  {r.tool}: {r.error.splitlines()[0][:300] if r.error.strip() else r.error}")
        if r.extra.get("stray_files"):
            print(f"  {r.tool}: left files next to the input: {', '.join(r.extra['stray_files'])}")
        if r.load and not r.load["ok"]:
            print(f"  {r.tool} (load check): {str(r.load['error']).splitlines()[0][:300]}")


def _environment() -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for dist in ("onnx", "onnxruntime", "numpy", "onnx-ir", "mixprec", "onnxconverter-common"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    mem_total = None
    try:
        with open("/proc/meminfo") as fh:
            mem_total = int(fh.readline().split()[1]) // 1024
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "mem_total_mib": mem_total,
        "versions": versions,
    }


def _default_mem_limit() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            return int(fh.readline().split()[1]) / 1024 * 0.9
    except OSError:
        return None


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("models", nargs="+", type=Path, help="FP32 .onnx model(s)")
    ap.add_argument(
        "--tools",
        default=",".join(DEFAULT_TOOLS),
        help=f"comma-separated subset of {','.join(ALL_TOOLS)} (default: %(default)s)",
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-tool timeout in seconds")
    ap.add_argument(
        "--mem-limit-gb",
        type=float,
        default=None,
        help="kill a tool whose RSS exceeds this (default: 90%% of physical memory)",
    )
    ap.add_argument(
        "--check-load",
        action="store_true",
        help="load each output in onnxruntime (graph optimizations off), in a child process",
    )
    ap.add_argument("--json", type=Path, help="write all results to this JSON file")
    ap.add_argument(
        "--tmp", type=Path, help="directory for the temporary outputs (default: system temp)"
    )
    ap.add_argument(
        "--keep", action="store_true", help="keep the converted models (path is printed)"
    )
    ap.add_argument(
        "--no-warm",
        action="store_true",
        help="do not pre-read the input files into the page cache before the first tool",
    )
    args = ap.parse_args(argv)
    args.tool_list = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = sorted(set(args.tool_list) - set(ALL_TOOLS))
    if unknown:
        ap.error(f"unknown tool(s) {unknown}; choose from {list(ALL_TOOLS)}")
    args.mem_limit_mib = args.mem_limit_gb * 1024 if args.mem_limit_gb else _default_mem_limit()
    for m in args.models:
        if not m.is_file():
            ap.error(f"model not found: {m}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse_args(argv)
    work_root = Path(tempfile.mkdtemp(prefix="mixprec_bench_", dir=args.tmp))
    report: dict[str, Any] = {
        "environment": _environment(),
        "tools": args.tool_list,
        "timeout_s": args.timeout,
        "mem_limit_mib": args.mem_limit_mib,
        "models": [],
    }
    try:
        for i, model in enumerate(args.models):
            model = model.resolve()
            work = work_root / f"{i}_{model.stem}"
            work.mkdir()
            try:
                meta = _inspect_model(model, work, args)
            except RuntimeError as exc:
                LOG.error("skipping %s: cannot read it: %s", model, exc)
                report["models"].append({"path": str(model), "error": str(exc)})
                continue
            ext = [Path(f) for f in meta["external_files"]]
            input_mib, nodes = meta["input_bytes"] / 2**20, meta["nodes"]
            if not args.no_warm:
                _warm_cache([model, *ext])
            results = []
            for tool in args.tool_list:
                LOG.info("[%s] running %s ...", model.name, tool)
                results.append(run_tool(tool, model, meta, work, args))
                LOG.info(
                    "[%s] %s: %s (%.2f s)",
                    model.name,
                    tool,
                    results[-1].status,
                    results[-1].wall_s or 0,
                )
            print_table(model.name, input_mib, nodes, results)
            report["models"].append(
                {
                    "path": str(model),
                    "input_mib": input_mib,
                    "nodes": nodes,
                    "external_files": [str(f) for f in ext],
                    "results": [dataclasses.asdict(r) for r in results],
                }
            )
    finally:
        if args.keep:
            print(f"\noutputs kept in {work_root}")
        else:
            shutil.rmtree(work_root, ignore_errors=True)
    report["parent_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
