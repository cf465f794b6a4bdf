"""Run ONNX models on OpenVINO's CPU plugin, at a chosen inference precision.

onnxruntime's CPU provider has almost no bfloat16 compute kernels, so mixprec checks
bfloat16 models by emulation (:mod:`mixprec.validate.emulate`). OpenVINO's CPU plugin
computes in bfloat16 for real on processors with AVX512-BF16 or AMX, which makes it a
second opinion on what a converted model does on hardware. ``openvino`` is an
optional dependency: importing this module does not import it;
:func:`openvino_available` and :class:`OpenVinoSession` do.

Precision modes (:class:`OpenVinoSession` ``precision=``; ``"default"``: no hint, what a user's
``compile_model(model, "CPU")`` gets):

``"f32"``
    ``INFERENCE_PRECISION_HINT=f32``. On a processor with bfloat16 support the CPU
    plugin's default hint is ``bf16``: without this hint an FP32 model silently runs its
    convolutions, matrix products, pooling, normalizations etc. in bfloat16. The hint
    only stops OpenVINO from *lowering* FP32 ops; it does not upcast a model's own
    16-bit ops (see the evidence below), so on a bfloat16 graph it behaves like
    ``"model"``.
``"bf16"``
    ``INFERENCE_PRECISION_HINT=bf16``: OpenVINO's automatic mixed precision (its
    default on such processors). Applied to a mixed-precision graph it also lowers the
    ops that the converter deliberately kept in FP32 (LayerNormalization, Softmax...).
    On a processor without bfloat16 support OpenVINO silently keeps f32;
    :attr:`OpenVinoSession.inference_precision` reports what was applied.
``"model"``
    ``EXECUTION_MODE_HINT=ACCURACY`` (accuracy over speed): OpenVINO neither lowers nor
    raises precision and runs each op in the element type the ONNX graph gives it, as
    far as the plugin has kernels for that type (see float16 below). The compiled model
    then reports ``INFERENCE_PRECISION_HINT`` as ``dynamic`` (2026.4), ``undefined``
    (2024.2) or ``f32`` (2024.0). Setting ``INFERENCE_PRECISION_HINT`` to "no
    precision" directly gives the same runtime precisions, but its spelling changed:
    2026.4 takes ``dynamic`` (and ``undefined``), 2024.2 only ``undefined``, 2024.0
    neither ("Wrong value ... for property key INFERENCE_PRECISION_HINT"); the
    execution-mode hint works on all three.

Evidence (OpenVINO 2026.4, also checked on 2024.0 and 2024.2; AMD EPYC with
AVX512-BF16, no AVX512-FP16/AMX), from the ``runtimePrecision`` of each executed node
of ``compiled.get_runtime_model()`` (:meth:`OpenVinoSession.executed_precisions`):

* FP32 demo CNN: default hint -> Convolution, Pooling, Interpolate, Reduce and
  FullyConnected run ``bf16`` (only the final Softmax stays f32); hint ``f32`` -> all
  ``f32``.
* mixprec bfloat16 demo transformer (opset 22, LayerNormalization and Softmax kept
  FP32 by the converter): ``"model"`` and ``"f32"`` -> FullyConnected/MatMul/Eltwise in
  ``bf16``, MVN (LayerNormalization), Softmax and two Eltwise in ``f32``, as written
  in the graph; ``"bf16"`` -> MVN and Softmax in ``bf16`` too. ``"model"``, ``"f32"``
  and ``INFERENCE_PRECISION_HINT=dynamic`` give bit-identical outputs on the bfloat16
  demo CNN and transformer; ``"bf16"`` differs (max abs diff 0.008 and 0.047).

Reading 16-bit ONNX graphs with OpenVINO's ONNX frontend (same setup):

* bfloat16 graphs read and compile: bfloat16 initializers, ``Cast(to=BFLOAT16)``,
  bfloat16 Conv/BatchNormalization/MaxPool/AveragePool/Resize/Gemm at opset 22, and
  bfloat16 MatMul/LayerNormalization/Softmax/Erf graphs; the kernels really are bf16
  (``brgconv_avx512_bf16``, ``jit_avx512_bf16``).
* float16 graphs read too, but this CPU has no float16 arithmetic: the plugin converts
  float16 to f32 when compiling, so ``"model"``/``"f32"`` compute a float16 graph in
  FP32 and the default ``"bf16"`` hint computes it in bfloat16. Asking for
  ``INFERENCE_PRECISION_HINT=f16`` silently gives ``bf16``.
* The ONNX frontend rejects BatchNormalization whose mean/variance type differs from
  the data type (legal ONNX since opset 15, and what mixprec writes when a variance
  does not fit in float16): "Input element types do not match".
* OpenVINO 2024.2 fails to compile the float16 demo transformer ("could not create a
  primitive descriptor"); 2024.0 and 2026.4 compile it.

Data exchange: OpenVINO's Python API shows bfloat16 tensors as numpy *float16* arrays
holding bfloat16 bit patterns, and converts float32 (or ``ml_dtypes.bfloat16``) feeds
for a bfloat16 input by value to float16, whose bits it then reads as bfloat16:
silently wrong inputs. This module therefore writes bfloat16 inputs as bit patterns
(rounded to nearest even by ``ml_dtypes``) and decodes bfloat16 outputs the same way.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx

from mixprec.errors import InputError, ModelLoadError, RunError
from mixprec.runtime.isolated import Worker, answer_channel

logger = logging.getLogger(__name__)

__all__ = ["PRECISIONS", "OpenVinoSession", "openvino_available"]

# Compile-time properties for each precision mode (values are OpenVINO's string forms).
PRECISIONS: dict[str, dict[str, str]] = {
    "f32": {"INFERENCE_PRECISION_HINT": "f32"},
    "bf16": {"INFERENCE_PRECISION_HINT": "bf16"},
    "model": {"EXECUTION_MODE_HINT": "ACCURACY"},
    "default": {},
}

# One stream, latency mode: a single synchronous request uses all cores for one
# inference, as an onnxruntime session does.
_LATENCY_CONFIG: dict[str, str] = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"}

_DEVICE = "CPU"

# Each model is read and compiled in a child process first: OpenVINO's ONNX frontend can crash
# the process on a graph it mishandles (a segfault reading onnx-asr's WeSpeaker front end, a
# Scan over frames with a DFT). The child lives on between sessions.
_PROBE = Worker("mixprec.runtime.openvino", "OpenVINO")
_PROBE_TIMEOUT_S = 600.0
_in_child = False  # True in that child: it reads models itself


@functools.cache
def openvino_available() -> bool:
    """Whether the ``openvino`` package can be imported (imports it on first call)."""
    try:
        import openvino  # noqa: F401
    except Exception:  # a broken install fails with more than ImportError
        return False
    return True


@functools.cache
def _core() -> Any:
    ov = _openvino()
    return ov.Core()


def _openvino() -> Any:
    try:
        import openvino as ov
    except Exception as exc:
        raise RunError(
            "openvino is not installed or cannot be imported (pip install openvino)"
        ) from exc
    return ov


class OpenVinoSession:
    """A model file compiled for OpenVINO's CPU plugin.

    Args:
        model_path: Path of the ``.onnx`` file (external data is found next to it).
        precision: ``"f32"``, ``"bf16"``, ``"model"`` or ``"default"``; see the module docstring.
        num_threads: Inference threads; ``None`` lets OpenVINO use all cores.

    Raises:
        InputError: Unknown precision or bad thread count.
        ModelLoadError: The model file does not exist.
        RunError: openvino is missing, or OpenVINO cannot read or compile the
            model; the one-line message names the file.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        precision: str = "model",
        num_threads: int | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise InputError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}"
            )
        if num_threads is not None and num_threads < 1:
            raise InputError(f"num_threads must be >= 1, got {num_threads}")
        self.path = Path(model_path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file does not exist: {self.path}")
        self.precision = precision
        self._ov = _openvino()
        crash = None if _in_child else _crash_of(self.path, precision)
        if crash is not None:
            raise RunError(f"OpenVINO cannot read or compile {self.path}: {crash} doing so in a child process")
        config = {**_LATENCY_CONFIG, **PRECISIONS[precision]}
        if num_threads is not None:
            config["INFERENCE_NUM_THREADS"] = str(num_threads)
        model = self._read()
        try:
            self._compiled = _core().compile_model(model, _DEVICE, config)
        except Exception as exc:
            raise RunError(
                f"OpenVINO cannot compile {self.path}: {_summary(exc)}"
            ) from exc
        self._request = self._compiled.create_infer_request()
        graph_inputs, graph_outputs = _graph_io_names(self.path)
        self._inputs = {_port_name(p, graph_inputs): p for p in self._compiled.inputs}
        self._outputs = [(_port_name(p, graph_outputs), p) for p in self._compiled.outputs]
        logger.debug(
            "OpenVINO session for %s: precision=%s, hint=%s",
            self.path,
            precision,
            self.inference_precision,
        )

    def _read(self) -> Any:
        # Only the ONNX frontend: Core.read_model would also try the other frontends
        # on a file that is not ONNX, which print parse errors to stderr.
        from openvino.frontend import FrontEndManager

        try:
            frontend = FrontEndManager().load_by_framework("onnx")
            return frontend.convert(frontend.load(str(self.path)))
        except Exception as exc:
            raise RunError(f"OpenVINO cannot read {self.path}: {_summary(exc)}") from exc

    @property
    def input_names(self) -> list[str]:
        """Model input names, in order."""
        return list(self._inputs)

    @property
    def output_names(self) -> list[str]:
        """Model output names, in order."""
        return [name for name, _ in self._outputs]

    @property
    def inference_precision(self) -> str:
        """The inference precision the plugin applied (``f32``, ``bf16``, ``dynamic``...)."""
        value = self._compiled.get_property("INFERENCE_PRECISION_HINT")
        return value.get_type_name() if hasattr(value, "get_type_name") else str(value)

    def executed_precisions(self) -> Counter[tuple[str, str]]:
        """How many executed nodes of each (layer type, runtime precision) there are.

        Reads the plugin's runtime graph (after fusion), leaving out inputs, outputs
        and constants: ``("Convolution", "bf16")`` counts convolutions that ran in bf16.
        """
        counts: Counter[tuple[str, str]] = Counter()
        for op in self._compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            layer = info["layerType"].astype(str) if "layerType" in info else op.get_type_name()
            if layer in ("Input", "Output", "Parameter", "Result", "Const"):
                continue
            prec = info["runtimePrecision"].astype(str) if "runtimePrecision" in info else "?"
            counts[(layer, prec)] += 1
        return counts

    def _set_inputs(self, feeds: Mapping[str, np.ndarray]) -> None:
        for name, port in self._inputs.items():
            if name not in feeds:
                raise InputError(
                    f"no data for model input {name!r} "
                    f"(data has: {', '.join(sorted(feeds)) or 'nothing'})"
                )
            tensor = _to_tensor(self._ov, name, np.asarray(feeds[name]), port.get_element_type())
            try:
                self._request.set_tensor(port, tensor)
            except Exception as exc:
                raise RunError(f"OpenVINO refused input {name!r} of {self.path}: {_summary(exc)}") from exc

    def _infer(self) -> None:
        try:
            self._request.infer()
        except Exception as exc:
            raise RunError(f"OpenVINO run of {self.path} failed: {_summary(exc)}") from exc

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one inference.

        Floating-point feeds are converted to each input's element type (float32 data
        can feed float16 and bfloat16 inputs; bfloat16 rounds to nearest even); other
        feeds are cast to the input's type. Feeds not among the inputs are ignored.

        Returns:
            Outputs by name in the model's order; floating-point outputs (including
            float16 and bfloat16) as float32 arrays, the others in their own type.

        Raises:
            InputError: An input is missing from ``feeds``.
            RunError: OpenVINO failed.
        """
        self._set_inputs(feeds)
        self._infer()
        return {
            name: _from_tensor(self._request.get_tensor(port)) for name, port in self._outputs
        }

    def latency(
        self,
        feeds: Mapping[str, np.ndarray],
        *,
        warmup: int = 3,
        repeat: int = 20,
        budget: float | None = None,
    ) -> float:
        """Median wall time in seconds of one synchronous inference on ``feeds``.

        Inputs are converted once, before timing; each timed call is one ``infer()`` of
        the single request (one stream), outputs left in OpenVINO's buffers. With ``budget``
        (seconds), timing stops once that much time was spent and at least 3 runs were made
        (at most ``repeat``): a large model is not run dozens of times for a ratio.
        """
        if warmup < 0 or repeat < 1 or (budget is not None and budget <= 0):
            raise InputError(f"need warmup >= 0, repeat >= 1 and budget > 0, got {warmup}, {repeat}, {budget}")
        self._set_inputs(feeds)
        for _ in range(warmup):
            self._infer()
        times: list[float] = []
        while len(times) < repeat:
            start = time.perf_counter()
            self._infer()
            times.append(time.perf_counter() - start)
            if budget is not None and len(times) >= min(3, repeat) and sum(times) >= budget:
                break
        return statistics.median(times)


def _graph_io_names(path: Path) -> tuple[set[str], set[str]]:
    """The ONNX graph's input (initializers excluded) and output names (weights unread)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}
    return {i.name for i in graph.input if i.name not in initializers}, {o.name for o in graph.output}


def _port_name(port: Any, graph_names: set[str]) -> str:
    """The ONNX name of a port. OpenVINO gives a port every tensor name it merged into it (a
    graph input read only by a Cast also carries the Cast's output name): the graph's own name
    is the one to use."""
    names = set(port.get_names())
    own = sorted(names & graph_names)
    if own:
        return own[0]
    return str(port.get_any_name()) if names else ""


def _to_tensor(ov: Any, name: str, array: np.ndarray, element_type: Any) -> Any:
    array = np.ascontiguousarray(array).reshape(array.shape)  # a scalar stays one (not shape [1])
    if element_type == ov.Type.bf16:
        if not (np.issubdtype(array.dtype, np.floating) or array.dtype == ml_dtypes.bfloat16):
            raise InputError(f"input {name!r} is bfloat16; got {array.dtype} data")
        bits = array.astype(ml_dtypes.bfloat16).view(np.uint16)
        tensor = ov.Tensor(ov.Type.bf16, ov.Shape(list(array.shape)))
        # OpenVINO's numpy view of a bf16 tensor has dtype float16: write raw bits.
        tensor.data.view(np.uint16)[...] = bits
        return tensor
    target = np.dtype(element_type.to_dtype())
    if array.dtype != target:
        logger.debug("casting feed %r from %s to %s", name, array.dtype, target)
        array = array.astype(target)
    return ov.Tensor(array)


def _from_tensor(tensor: Any) -> np.ndarray:
    type_name = tensor.get_element_type().get_type_name()
    data = tensor.data
    if type_name == "bf16":
        return data.view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    if np.issubdtype(data.dtype, np.floating):
        return data.astype(np.float32)
    return data.copy()


def _crash_of(path: Path, precision: str) -> str | None:
    """How OpenVINO dies (a signal, a hang) reading and compiling `path` in a child process;
    None where it does not (its errors are found again in this process, with their text) or
    no child can run."""
    answer = _PROBE.request([str(path.resolve()), precision], _PROBE_TIMEOUT_S)
    if isinstance(answer, tuple):
        message, death = answer
        return message if death in ("signal", "hung") else None
    return None


def _serve() -> None:
    """The child's loop: read and compile each `[path, precision]` line's model, answer with a
    JSON line."""
    global _in_child  # noqa: PLW0603 - this process is the child from now on
    _in_child = True
    channel = answer_channel()  # OpenVINO logs warnings to standard output
    for line in sys.stdin:
        path, precision = json.loads(line)
        try:
            OpenVinoSession(path, precision=precision)
        except Exception as exc:  # noqa: BLE001 - any failure is an answer, not a crash
            answer = {"ok": False, "error": _summary(exc)}
        else:
            answer = {"ok": True}
        print(json.dumps(answer), file=channel, flush=True)


def _summary(exc: BaseException) -> str:
    """One line out of OpenVINO's multi-line error text."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    noise = ("Exception from ", "Check ", "FrontEnd API failed", "While validating")
    useful = [line for line in lines if not line.startswith(noise)]
    if "Summary:" in useful:
        cut = useful.index("Summary:")
        summary = "; ".join(line.lstrip("- ") for line in useful[cut + 1 :])
        detail = [
            line
            for line in useful[:cut]
            if not line.startswith(("--", "Model wasn't fully converted"))
        ]
        return f"{summary} ({detail[-1]})" if detail else summary
    if useful:
        return useful[-1]
    return lines[-1] if lines else type(exc).__name__


if __name__ == "__main__":
    _serve()
