"""Fingerprints of converted models, to show that a change to the converter keeps its outputs.

Converts a corpus (the demo models, the `onnx` package's light CNNs and every fourth backend node test case, and
random graphs) for float16 and bfloat16 and prints, per case, a hash of the converted graph
(nodes, attributes, input/output types, initializer bytes; the producer version and the
value_info of intermediate values, which only some versions write, are left out) as JSON.
Run it with two versions of mixprec on the import path and compare:

    PYTHONPATH=/path/to/old/src python tools/output_fingerprints.py > old.json
    python tools/output_fingerprints.py > new.json
    python tools/output_fingerprints.py --diff old.json new.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import hashlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import onnx


def _corpus() -> list[tuple[str, onnx.ModelProto]]:
    from mixprec import demo_models  # noqa: PLC0415

    cases = [(f"demo/{name}", factory()) for name, factory in sorted(demo_models.DEMO_MODELS.items())]
    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    for path in sorted((root / "light").glob("*.onnx")):
        cases.append((f"light/{path.stem}", onnx.load(str(path))))
    from onnx.backend.test.case.node import collect_testcases  # noqa: PLC0415

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        node_cases = collect_testcases()
    cases.extend((f"node/{case.name}", case.model) for case in node_cases[::4])
    return cases


def _clear_value_info(graph: onnx.GraphProto) -> None:
    del graph.value_info[:]
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                _clear_value_info(attr.g)
            for sub in attr.graphs:
                _clear_value_info(sub)


def _fingerprint(proto: onnx.ModelProto) -> str:
    proto.producer_version = ""
    _clear_value_info(proto.graph)  # inferred intermediate types: written by some versions only
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()[:16]


def fingerprints() -> dict[str, str]:
    """Case -> fingerprint of the converted model (or the error's first line)."""
    import mixprec  # noqa: PLC0415

    results: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, proto in _corpus():
            for target in ("float16", "bfloat16"):
                out = Path(tmp) / "out.onnx"
                try:
                    mixprec.convert(proto, out, target_dtype=target, runtime="onnx", validate="checker")
                    results[f"{name}:{target}"] = _fingerprint(onnx.load(str(out)))
                except Exception as e:  # noqa: BLE001 - the outcome is what is compared
                    results[f"{name}:{target}"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"), help="compare two fingerprint files")
    args = parser.parse_args()
    if args.diff:
        old, new = (json.loads(Path(p).read_text()) for p in args.diff)
        changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        for key in changed:
            print(f"{key}: {old.get(key)} -> {new.get(key)}")
        print(f"{len(old)} cases, {len(changed)} differ")
        return 1 if changed else 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    json.dump(fingerprints(), sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
