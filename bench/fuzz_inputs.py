"""A longer seeded run of the input fuzzing in tests/test_fuzz.py, with a tally.

Every case runs `mixprec convert` in-process on a broken, mutated or hostile model and is
classified: exit code, whether stderr's last line is one clean `mixprec: ...` line, whether a
traceback was printed, whether an output exists without exit 0/5, leftovers beside it.

    python bench/fuzz_inputs.py [--cases 2000] [--seed 0] [--validate checker]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_fuzz import _hostile_models, _mutations  # noqa: E402

from mixprec.cli import main  # noqa: E402


def run(cases: int, seed: int, validate: str) -> Counter[str]:
    tally: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="mixprec-fuzz-") as tmp:
        folder = Path(tmp) / "models"
        folder.mkdir()
        models = {**_hostile_models(folder), **_mutations(folder, cases, seed)}
        for index, (name, path) in enumerate(models.items()):
            out_dir = Path(tmp) / "out" / str(index)
            out_dir.mkdir(parents=True)
            output = out_dir / "out.onnx"
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    code = main(["convert", str(path), str(output), "--validate", validate])
                except BaseException as e:  # noqa: BLE001 - a crash of the CLI itself is a finding
                    code = -1
                    print(f"escaped: {type(e).__name__}: {e}", file=err)
            text = err.getvalue().strip()
            last = text.splitlines()[-1] if text else ""
            tally["cases"] += 1
            tally[f"exit {code}"] += 1
            tally["tracebacks"] += "Traceback" in text
            tally["clean last line"] += last.startswith("mixprec: ") and "\n" not in last
            tally["written without exit 0/5"] += output.exists() and code not in (0, 5)
            tally["leftovers"] += any(p.name != "out.onnx" for p in out_dir.iterdir())
            if code == -1 or "Traceback" in text:
                print(f"{name}: {last[:200]}", file=sys.stderr)
    return tally


def main_(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validate", default="checker", choices=["checker", "load", "run", "auto"])
    args = parser.parse_args(argv)
    start = time.perf_counter()
    tally = run(args.cases, args.seed, args.validate)
    for key, value in sorted(tally.items()):
        print(f"{key:28} {value}")
    print(f"{'seconds':28} {time.perf_counter() - start:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
