"""onnxruntime in a child process, as users run it: default session options, crashes contained.

A converted model can crash the runtime outright (a segfault in a graph optimizer, an abort in
a kernel) or fail only once the runtime's default graph optimizations fuse it. The session is
created in a child Python process with onnxruntime's default options; a crash comes back as an
outcome naming the signal instead of killing the converter.

The child (`python -m mixprec.runtime.isolated`) lives on between checks and answers one JSON
request per line: `[MODEL]` or `[MODEL, FEEDS.npz, OUT.npz]` (`""` for both: load only; `""` for
OUT.npz: run without sending the outputs back),
optionally followed by session config entries (`{"session.disable_quant_qdq": "1"}`) for a
diagnosis beside the default run, and `mixprec.graph_optimization` for another level than the
default one.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

# The request's config entry that sets the graph optimization level (taken out before the
# entries reach onnxruntime).
_LEVEL_KEY = "mixprec.graph_optimization"
# A session that takes longer than this to create and run once counts as hung.
_TIMEOUT_S = 600.0
# onnxruntime's wording when no kernel matches a node's types (not a type error in the graph).
_MISSING_KERNEL_MARKERS = ("Could not find an implementation for", "NOT_IMPLEMENTED")


@dataclass(frozen=True)
class RuntimeOutcome:
    """What happened when onnxruntime loaded (and ran) a model in a child process.

    Attributes:
        loaded: The session was created.
        ran: The model ran on the feeds (False when no feeds were given).
        error: onnxruntime's first error line, or how the child died.
        crashed: The child died from a signal (segfault, abort) or hung.
        outputs: The outputs by name when it ran (bfloat16 as float32).
        seconds: Wall time of the child, Python start included.
        death: How the child ended when `crashed`: "signal", "hung", "exit" (it exited without
            answering) or "start" (it could not be started).
    """

    loaded: bool
    ran: bool
    error: str | None
    crashed: bool
    outputs: dict[str, np.ndarray] | None
    seconds: float
    death: str | None = None

    @property
    def ok(self) -> bool:
        """Loaded, and ran when asked to."""
        return self.error is None

    @property
    def missing_kernel(self) -> bool:
        """Failed only because the provider has no kernel for some node's types."""
        return self.error is not None and not self.crashed and any(m in self.error for m in _MISSING_KERNEL_MARKERS)


class Worker:
    """One long-lived child process serving a runtime's requests (JSON lines on stdin/stdout),
    so that each check pays for a session, not for starting Python and importing the runtime.
    A crash kills only the child; the next request starts a new one.

    Args:
        module: The module the child runs (`python -m MODULE`): it answers each request line.
        runtime: The runtime's name, for the messages.
    """

    def __init__(self, module: str = "mixprec.runtime.isolated", runtime: str = "onnxruntime") -> None:
        self.module = module
        self.runtime = runtime
        self.process: subprocess.Popen[str] | None = None
        atexit.register(self.stop)

    def _start(self) -> subprocess.Popen[str]:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
        return self.process

    def stop(self) -> None:
        """End the child (at exit, or after a timeout)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def request(self, arguments: list[str | dict[str, str]], timeout: float) -> dict | tuple[str, str]:
        """The child's JSON answer, or how it died: (message, "signal" | "hung" | "exit" | "start")."""
        try:
            process = self._start()
        except OSError as e:
            return f"the {self.runtime} child process cannot be started ({e})", "start"
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(json.dumps(arguments) + "\n")
            process.stdin.flush()
        except OSError:
            pass  # it died: poll() below says how
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        answer = _last_json(line)
        if answer is not None:
            return answer
        if not ready:
            self.stop()
            return f"{self.runtime} hung (no answer in {timeout:.0f} s)", "hung"
        if line:  # something other than an answer (the child writes answers alone; see `answer_channel`)
            self.stop()
            return f"the {self.runtime} child answered something else: {line.strip()[:200]}", "exit"
        code = process.wait()
        self.process = None
        if code < 0:
            return f"{self.runtime} crashed ({signal.Signals(-code).name})", "signal"
        return f"{self.runtime} child exited with code {code}", "exit"


_WORKER = Worker()


def run_isolated(
    model_path: str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray] | None = None,
    *,
    timeout: float = _TIMEOUT_S,
    config: Mapping[str, str] | None = None,
    keep_outputs: bool = True,
    graph_optimization: str = "all",
) -> RuntimeOutcome:
    """Create an onnxruntime CPU session for `model_path` in a child process, with default
    options plus the session `config` entries, and with `feeds` run it once (its outputs come
    back unless `keep_outputs` is False: whether it runs is the question). `graph_optimization`
    other than "all" (the default options) mirrors a session of that level in this process."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mixprec-child-") as tmp:
        arguments: list[str | dict[str, str]] = [str(Path(model_path).resolve())]
        out_path = Path(tmp) / "outputs.npz"
        if feeds is not None:
            feeds_path = Path(tmp) / "feeds.npz"
            np.savez(feeds_path, **{k: np.asarray(v) for k, v in feeds.items()})
            arguments += [str(feeds_path), str(out_path) if keep_outputs else ""]
        else:
            arguments += ["", ""]
        entries = dict(config or {})
        if graph_optimization != "all":
            entries[_LEVEL_KEY] = graph_optimization
        if entries:
            arguments.append(entries)
        answer = _WORKER.request(arguments, timeout)
        seconds = time.perf_counter() - start
        if isinstance(answer, tuple):
            message, death = answer
            return RuntimeOutcome(False, False, message, True, None, seconds, death)
        outputs = None
        if answer.get("ran") and out_path.is_file():
            # String outputs are object arrays; the file is this process's own.
            with np.load(out_path, allow_pickle=True) as archive:
                outputs = {name: archive[name] for name in archive.files}
        return RuntimeOutcome(
            bool(answer.get("loaded")), bool(answer.get("ran")), answer.get("error"), False, outputs, seconds
        )


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _child(argv: list[str | dict[str, str]]) -> dict:
    from mixprec.errors import MixprecError  # noqa: PLC0415
    from mixprec.runtime import sessions  # noqa: PLC0415

    status: dict = {"loaded": False, "ran": False, "error": None}
    paths = [a for a in argv if isinstance(a, str)]
    config = dict(next((a for a in argv if isinstance(a, dict)), {}))
    level = config.pop(_LEVEL_KEY, "all")  # "all": onnxruntime's default options
    try:
        session = sessions.make_session(paths[0], graph_optimization=level, config_entries=config or None)
    except MixprecError as e:
        status["error"] = str(e)
        return status
    status["loaded"] = True
    if len(paths) < 3 or not paths[1]:
        return status  # load only
    try:
        with np.load(paths[1], allow_pickle=True) as archive:  # string inputs are object arrays
            feeds = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as e:
        status["error"] = f"the feeds cannot be read: {e}"
        return status
    try:
        outputs = sessions.run_session(session, feeds)
    except MixprecError as e:
        status["error"] = str(e)
        return status
    if paths[2]:
        np.savez(paths[2], **{k: _savable(v) for k, v in outputs.items()})
    status["ran"] = True
    return status


def _savable(array: np.ndarray) -> np.ndarray:
    """bfloat16 (an ml_dtypes type numpy cannot save) as float32."""
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def answer_channel() -> TextIO:
    """In a child: the stream its answers go to (the original standard output), with anything
    else written to standard output (a runtime's own logging) sent to standard error instead."""
    channel = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    return channel


def _serve() -> None:
    """The child's loop: one JSON request per line, one JSON answer per line."""
    channel = answer_channel()
    for line in sys.stdin:
        print(json.dumps(_child(json.loads(line))), file=channel, flush=True)


if __name__ == "__main__":
    _serve()
