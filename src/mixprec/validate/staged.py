"""Validation of a staged converted model: checker, the runtime as users run it, numerics.

* The full ONNX checker always.
* onnxruntime with its default session options, in a child process (`isolated`): the model
  must load (level `load`) and, at level `run`, run on the first batch. A crash or a failure
  the FP32 model does not have raises :class:`RuntimeRejection`, which the conversion answers
  by keeping the responsible nodes FP32 (the `repair` step, :mod:`mixprec.pipeline.repair`).
* Numerics (level `run`) on the emulated model (`emulate`): each 16-bit value computed in FP32
  and rounded, because onnxruntime's CPU provider has no bfloat16 kernels and computes most
  float16 ops in FP32, which hides overflow. When they cannot be measured, the result says
  `numerics not checked: <why>`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.analysis.input_indices import fixed_input_dims, with_fixed_dims, with_index_limits
from mixprec.analysis.qdq import has_qdq, quantizes_at_run_time
from mixprec.dtypes import LowPrecision, is_float_dtype
from mixprec.errors import BeyondTolerance, InputError, MixprecError, RunError, ValidationFailure
from mixprec.host import host_cpu
from mixprec.graphs import is_default_domain, subgraphs_of
from mixprec.io import graph_only_proto, uses_external_data, without_staging
from mixprec.io.onnx_file import FileChecks, first_line
from mixprec.policy.opfacts import op_facts
from mixprec.policy.profiles import load_runtime
from mixprec.policy.quantized_groups import quantized_groups
from mixprec.validate.results import InputScale, OutputError, Validation, shape_text
from mixprec.validate import compare
from mixprec.validate.branches import unrun_branches
from mixprec.runtime import sessions
from mixprec.runtime import data as data_mod
from mixprec.validate.checker import check_model_file
from mixprec.validate.recurrent import low_recurrent_nodes
from mixprec.runtime.isolated import RuntimeOutcome, run_isolated

Batch = Mapping[str, np.ndarray]
# Sizes tried for symbolic dimensions of generated inputs until the FP32 model runs.
_DIM_LADDER = (2, 16, 128, 1024, 4096)
# A generated input larger than this is not tried.
_MAX_GENERATED_ELEMENTS = 1 << 23  # all generated inputs of one try together
# Leading (batch) dimensions of generated inputs stay this small while the others grow.
_GENERATED_BATCH = 2
_PASS_DATA = "pass --data"
# Seconds of timed runs per model for the latency ratio on a real runtime (at least 3 runs).
_LATENCY_BUDGET_S = 2.0
# Magnitudes of inputs that models commonly take unnormalized. Generated inputs are standard
# normal; after the numeric check they are scaled to each of these in turn (largest |x| of
# every float input), to show whether the converted model stays finite where the FP32 one does.
# First they are all zero (what silence, a black image or padding give: a guard against log(0)
# or x/0 must hold there).
_INPUT_MAGNITUDES = (
    (0.0, "silence, a black image, padding"), (255.0, "8-bit pixel values"), (32767.0, "16-bit audio samples"),
)
# Where the converted model overflows at such a magnitude, the node where that starts is located
# (two runs per chunk of intermediate values) for main graphs up to this many nodes.
_ORIGIN_MAX_NODES = 200


class RuntimeRejection(ValidationFailure):
    """onnxruntime (or, with `openvino`, OpenVINO's CPU plugin) fails or crashes on the
    converted model where it runs the FP32 model.

    Carries what a repair needs: the runtime's outcome and the feeds it ran on.
    """

    def __init__(self, outcome: RuntimeOutcome, feeds: Batch | None = None, *, openvino: bool = False) -> None:
        where = "on OpenVINO's CPU plugin" if openvino else "in onnxruntime (default session options)"
        super().__init__(f"the converted model fails {where}: {without_staging(outcome.error or '')}")
        self.outcome = outcome
        self.feeds = feeds
        self.openvino = openvino


# From this many nodes on, the full checker of a staged model runs in a child.
CHECKER_CHILD_MIN_NODES = 20_000


def start_output_checker(level: str, nodes: int) -> FileChecks | None:
    """The full checker of a model about to be staged, started in a child at a level that
    checks and for a graph of `nodes` large enough to gain from it: name the staged file to it
    (:meth:`FileChecks.check_file`) and pass it to :func:`validate_staged`."""
    return FileChecks.start(None, checker="full") if level != "none" and nodes >= CHECKER_CHILD_MIN_NODES else None


def validate_staged(
    path: Path,
    reference: Path | None,
    target: LowPrecision,
    level: str,
    data: str | os.PathLike | Iterable[Batch] | None,
    max_batches: int,
    tolerance: tuple[float, float] | None,
    original_checker_error: Callable[[], str | None] | None = None,
    *,
    weights_large: bool = False,
    runtime: str = "onnx",
    model: ir.Model | None = None,
    checks: FileChecks | None = None,
    traced: Path | None = None,
) -> Validation:
    """Check a staged converted model; raise ValidationFailure to stop it being published.

    `runtime`: the target runtime's profile name; `openvino` (when installed) also runs both
    models on OpenVINO's CPU plugin for real (bfloat16 arithmetic on AVX512-BF16/AMX).
    `model`: the staged model in memory, typed: the emulation starts from a copy of it instead
    of reading the file and inferring its types again. `checks`: the full checker already
    running on `path` in a child (:func:`start_output_checker`). `traced`: the FP32 model that
    names the converted one's values where `reference` does not (its functions inlined), to
    locate where non-finite values start.
    """
    result = Validation()
    if level == "none":
        result.numerics = "not checked: validation off"
        return result
    inherited = check_model_file(path, original_checker_error, checks)
    if inherited is None:
        result.checker = "passed"
    else:
        result.checker = "fails as the FP32 model does"
        result.notes.append(f"the FP32 model fails the ONNX checker the same way: {inherited}")
    if level == "checker":
        result.numerics = "not checked: validation level 'checker' (auto picks it above 50,000 nodes)"
        result.notes.append("onnxruntime load check not run at validation level 'checker'")
        return result
    if level == "load":
        _load_check(path, reference, target, result, weights_large)
        result.numerics = "not checked: validation level 'load' (auto picks it above 5,000 nodes or 1 GiB); use --validate run"
        return result
    _run_check(path, reference, target, data, max_batches, tolerance, result, runtime, model, traced)
    return result


def _graph_only(path: Path, name: str) -> Path:
    """The model with its weights as graph inputs: loads without reading gigabytes."""
    out = path.with_name(name)
    onnx.save(graph_only_proto(path), str(out))
    return out


def _load_check(path: Path, reference: Path | None, target: LowPrecision, result: Validation, weights_large: bool) -> None:
    if weights_large:
        result.notes.append("onnxruntime load check on the graph with weights as inputs")
    if _runtime_check(path, reference, target, result, weights_large=weights_large).ok:
        result.runtime = "loaded"


def loads_as_validated(outcome: RuntimeOutcome, target: LowPrecision) -> bool:
    """Whether the runtime check accepts the outcome: the model ran, or it is a bfloat16 model
    whose graph resolved and only lacks CPU kernels (onnxruntime's CPU provider has no bfloat16
    compute; the model is for another provider)."""
    return outcome.ok or (outcome.missing_kernel and target is LowPrecision.BFLOAT16)


_MISSING_KERNEL = re.compile(r"Could not find an implementation for (\w+)\((\d+)\)")


def _opset_gap(error: str, model: ir.Model | None) -> str | None:
    """Why onnxruntime, standing in for another runtime, fails where the cause is the model's
    opset, not its types: it has a kernel of the default-domain op its error names at older
    opsets only (its random-number ops end at 21, where a bfloat16 conversion for OpenVINO
    declares 22); None for any other error."""
    found = _MISSING_KERNEL.search(error)
    if found is None or model is None:
        return None
    op, version = found.group(1), int(found.group(2))
    cpu = load_runtime("ort-cpu")
    if not cpu.knows("", op) or cpu.runs_at("", op, version):
        return None
    if not any(node.op_type == op and is_default_domain(node.domain) for g in model.graphs() for node in g):
        return None
    return (
        f"onnxruntime has no kernel of {op} at opset {version} (only at older ones): its load of the "
        "converted model, which stands in for the target runtime's, was not checked"
    )


def _runtime_check(
    path: Path, reference: Path | None, target: LowPrecision, result: Validation, *,
    feeds: Batch | None = None, weights_large: bool = False, stand_in: ir.Model | None = None,
) -> RuntimeOutcome:
    """Load (and with `feeds` run) the converted model as users do, in the child process;
    record the outcome; raise RuntimeRejection when only the converted model fails. `stand_in`:
    the converted model, where onnxruntime stands in for another runtime (see `_opset_gap`)."""
    outcome = run_isolated(_graph_only(path, "graph_only.onnx") if weights_large else path, feeds)
    result.notes.append(
        f"onnxruntime CPU session with default graph optimizations in a child process: {outcome.seconds:.2f} s"
    )
    if outcome.ok:
        return outcome
    if outcome.death == "start":
        result.notes.append(f"{outcome.error}: the load with onnxruntime's default options was not checked")
        return outcome
    if loads_as_validated(outcome, target):
        result.runtime = "no cpu kernels"
        result.notes.append(
            "onnxruntime's CPU provider has no bfloat16 kernels: the graph resolved, but kernel "
            f"assignment and its fused form were not checked ({without_staging(outcome.error or '')})"
        )
        return outcome
    gap = _opset_gap(outcome.error or "", stand_in)
    if gap is not None:
        result.notes.append(gap)
        return outcome
    ref = reference
    if ref is not None and weights_large:
        ref = _graph_only(ref, "reference_graph_only.onnx")
    reference_outcome = run_isolated(ref, feeds) if ref is not None else None
    if reference_outcome is not None and not reference_outcome.ok:
        result.runtime = "reference-fails"
        result.notes.append(f"onnxruntime fails on the FP32 model too: {reference_outcome.error}")
        return outcome
    raise RuntimeRejection(outcome, feeds)


def _run_check(
    path: Path,
    reference: Path | None,
    target: LowPrecision,
    data: str | os.PathLike | Iterable[Batch] | None,
    max_batches: int,
    tolerance: tuple[float, float] | None,
    result: Validation,
    runtime: str = "onnx",
    model: ir.Model | None = None,
    traced: Path | None = None,
) -> None:
    stand_in = model if load_runtime(runtime).engine != "onnxruntime" else None
    batches, reference_session = _reference_batches_or_check(path, reference, target, data, max_batches, result)
    if not batches or reference is None:  # no batches without a reference model
        return
    random, why = _random_outputs(model, reference_session, batches[0])
    if random:  # compared no further
        result.notes.append(why)
        batches = [(feeds, {k: v for k, v in expected.items() if k not in random}) for feeds, expected in batches]
        if not batches[0][1]:
            checked = _runtime_check(path, reference, target, result, feeds=batches[0][0], stand_in=stand_in)
            if checked.ok:
                result.runtime = "ran" if checked.ran else "loaded"
            _unchecked(result, f"not checked: {why}")
            return
    quantized = quantized_model(model)
    # The converted model as users run it: default optimizations, first batch, own process.
    outcome = _runtime_check(path, reference, target, result, feeds=batches[0][0], stand_in=stand_in)
    not_on_openvino = None
    if runtime == "openvino":
        not_on_openvino = _openvino_check(
            path, reference, batches, tolerance, result, target, generated=data is None, quantized=quantized,
            skip=frozenset(random),
        )
    elif outcome.ran and outcome.outputs is not None:
        result.real_runtime = "onnxruntime CPU (batch 1)"
        result.real_outputs = output_errors(compare.compare_outputs(batches[0][1], outcome.outputs), tolerance)
        config, converted = None, outcome.outputs
        if quantized:
            config, converted = _judge_without_qdq_rewriting(
                path, runtime, target, batches[0], tolerance, result
            ) or (config, converted)
        _judge_against_fp32_run_alike(reference, batches[0], converted, config, target, tolerance, result)
    executed = f"; {result.real_executed}" if result.real_executed else ""
    try:
        candidate = _emulated_session(path, target, model, result)
    except RunError as e:  # the emulated model cannot be built: the real run alone judges
        why = f"the emulated {target.value} model could not be built ({first_line(e)})"
        if not result.real_outputs:
            more = f"; not on OpenVINO: {not_on_openvino}" if not_on_openvino is not None else ""
            _unchecked(result, f"not checked: {why}{more}")
            return
        result.runtime = "ran"
        result.batches = len(batches) if runtime == "openvino" else 1  # OpenVINO runs every batch
        result.numerics = (
            f"checked on {result.batches} batch(es) for real on {result.real_runtime}{executed}; not emulated: {why}"
        )
        if tolerance is not None:
            _raise_beyond_tolerance(result, tolerance, None)
        else:
            _note_large_errors(result, target, generated=data is None, quantized=quantized, model=model)
        return
    merged, nonfinite_feeds = _compare_emulated(candidate, batches, result)
    result.runtime = "ran and emulated" if outcome.ran or result.real_outputs else "emulated"
    real = f" and for real on {result.real_runtime}{executed}" if result.real_outputs else ""
    result.numerics = f"checked on {result.batches} batch(es) (emulated {target.value}{real})"
    if not_on_openvino is not None:
        _unchecked(result, f"{result.numerics}; not on OpenVINO: {not_on_openvino}")
    result.outputs = output_errors(merged, tolerance)
    for c in merged:
        if c.new_nonfinite:
            result.notes.append(
                f"output {c.name!r} has {c.new_nonfinite} non-finite value(s) where the FP32 model has none"
            )
    origin = None
    if nonfinite_feeds is not None:
        origin = _nan_origin_note(traced or reference, path, nonfinite_feeds, target)
        result.notes.append(origin)
    elif data is None:
        nodes = len(model.graph) if model is not None else _ORIGIN_MAX_NODES + 1
        result.input_scales = _input_scales(
            reference_session, candidate, batches[0], traced or reference, path, target, nodes
        )
    if tolerance is not None:
        _raise_beyond_tolerance(result, tolerance, origin)
    else:
        _note_large_errors(result, target, generated=data is None, quantized=quantized, model=model)
    if model is not None:
        result.notes.extend(unrun_branches(reference, model, [feeds for feeds, _ in batches]))


def _random_outputs(
    model: ir.Model | None, session: object, batch: tuple[Batch, dict[str, np.ndarray]]
) -> tuple[set[str], str]:
    """The outputs of the model that depend on random numbers (downstream of RandomNormalLike,
    Bernoulli and the like: `random` in the op facts; not through shape-only ops), unless a
    second run of the FP32 model gives each of them again bit for bit (a noise scaled to 0):
    no comparison tells rounding from chance there, so they are not compared; and why."""
    if model is None:
        return set(), ""
    ops, random = _random_reach(model.graph, functions=model.functions)
    outputs = {v.name for v in model.graph.outputs if v in random} & batch[1].keys()
    if not outputs:
        return set(), ""
    try:
        again = sessions.run_session(session, batch[0])
    except RunError:
        again = {}
    if all(_identical(batch[1][name], again.get(name)) for name in outputs):
        return set(), ""
    every = "every output of the FP32 model depends" if outputs == batch[1].keys() else (
        f"output(s) {', '.join(sorted(outputs))} of the FP32 model depend"
    )
    return outputs, (
        f"{every} on random numbers ({', '.join(sorted(ops))}; two runs on the same inputs differ): "
        "no comparison tells rounding from chance there, so they are not compared (a model exported "
        "without sampling, or with its noise scale at 0, can be)"
    )


def _random_reach(
    graph: ir.Graph, random: set[ir.Value] | None = None, functions: Mapping[tuple, ir.Function] | None = None
) -> tuple[set[str], set[ir.Value]]:
    """The random ops in `graph` (subgraphs and called model-local functions included) and the
    values computed from their outputs, `random` (values of outer scopes a subgraph reads
    count too). A node owning a subgraph, or calling a function, that draws random numbers or
    computes an output from them counts as one."""
    ops: set[str] = set()
    random = set() if random is None else random
    functions = functions or {}
    for node in graph:
        fact = op_facts(node.domain, node.op_type)
        inner: set[str] = set()
        reached = False
        for sub in subgraphs_of(node):
            inner |= _random_reach(sub, random, functions)[0]
            reached = reached or any(v in random for v in sub.outputs)
        function = functions.get((node.domain, node.op_type, node.overload))
        if function is not None:
            inner |= {n.op_type for n in function if op_facts(n.domain, n.op_type).random}
        ops |= inner
        if fact.random:
            ops.add(node.op_type)
        if fact.random or inner or reached or (
            not fact.shape_only and any(v in random for v in node.inputs if v is not None)
        ):
            random.update(v for v in node.outputs if v is not None)
    return ops, random


def _identical(first: np.ndarray, again: np.ndarray | None) -> bool:
    """Whether a second run gave the same array bit for bit (NaNs in the same places)."""
    if again is None:
        return False
    try:
        first, again = np.asarray(first), np.asarray(again)
        if first.shape != again.shape:
            return False
        return bool(np.array_equal(first, again, equal_nan=first.dtype.kind in "fc"))
    except (TypeError, ValueError):  # sequences of different lengths
        return False


# Session config of the CPU provider's run with its QDQ rewriting (integer kernels, bias
# quantization) off: the quantized groups run as written.
_QDQ_REWRITING_OFF = {"session.disable_quant_qdq": "1"}


def _judge_without_qdq_rewriting(
    path: Path, runtime: str, target: LowPrecision, batch: tuple[Batch, dict[str, np.ndarray]],
    tolerance: tuple[float, float] | None, result: Validation,
) -> tuple[dict[str, str], dict[str, np.ndarray]] | None:
    """Where the CPU provider's default run of a quantized model is further from the FP32 model
    than rounding explains and `runtime` computes its quantized groups in float (`float_dequantize`
    in `policy/tables/quantized_groups.toml`: not the CPU provider's integer kernels), run it once
    more with the provider's QDQ rewriting off. When that run is closer, it is the real figure for
    `runtime` (that rewriting is the CPU provider's own, not `runtime`'s), and a note says why the
    default one differs. Returns the config and outputs of the run taken, or None."""
    default = _beyond_rounding(result.real_outputs, target)
    if default is None or not quantized_groups(runtime).float_dequantize:
        return None
    outcome = run_isolated(path, batch[0], config=_QDQ_REWRITING_OFF)
    if not outcome.ran or outcome.outputs is None:
        return None
    as_written = output_errors(compare.compare_outputs(batch[1], outcome.outputs), tolerance)
    best = max((o.scaled_error or 0.0 for o in as_written if o.shapes is None), default=None)
    if best is None or best >= default:
        return None
    result.notes.append(
        f"onnxruntime's CPU provider with default options differs from the FP32 model by up to "
        f"{default:.2%}, with its QDQ rewriting off (session.disable_quant_qdq) by up to {best:.2%}: "
        f"the difference is that rewriting, which fits quantized groups to its own integer kernels "
        f"(it quantizes a float bias beside an integer weight again, with the product of the two "
        f"{target.short_name} scales); {runtime} dequantizes constants in float instead, so the "
        "second figures are its real ones"
    )
    result.real_runtime = "onnxruntime CPU (batch 1, QDQ rewriting off)"
    result.real_outputs = as_written
    return dict(_QDQ_REWRITING_OFF), outcome.outputs


def _judge_against_fp32_run_alike(
    reference: Path, batch: tuple[Batch, dict[str, np.ndarray]], converted: dict[str, np.ndarray],
    config: dict[str, str] | None, target: LowPrecision, tolerance: tuple[float, float] | None,
    result: Validation,
) -> None:
    """Where the real figures are beyond rounding, run the FP32 model the same way (same
    provider, options and `config`, in the child). When the runtime moves the FP32 model itself
    beyond rounding from its plain run (its own rewriting: integer kernels that quantize a float
    bias again, fused Q/DQ groups), the real figures compare the converted model with that run,
    so they measure the conversion alone, and a note gives the runtime's own difference."""
    if _beyond_rounding(result.real_outputs, target) is None:
        return
    outcome = run_isolated(reference, batch[0], config=config)
    if not outcome.ran or outcome.outputs is None:
        return
    fp32 = {k: v for k, v in outcome.outputs.items() if k in batch[1]}  # those still compared
    own = _beyond_rounding(output_errors(compare.compare_outputs(batch[1], fp32), None), target)
    if own is None:
        return
    alike = output_errors(compare.compare_outputs(fp32, converted), tolerance)
    how = "with its QDQ rewriting off" if config else "with default options"
    result.notes.append(
        f"onnxruntime's CPU provider {how} runs the FP32 model itself up to {own:.2%} away from its "
        "plain run (graph optimizations off): that is the runtime's own rewriting, not the "
        "conversion, so the real figures compare the converted model with the FP32 model run the "
        "same way"
    )
    result.real_runtime = f"{(result.real_runtime or '').removesuffix(')')}, against the FP32 model run the same way)"
    result.real_outputs = alike


# Without a tolerance, an output further from the FP32 model than this many times the 16-bit
# type's epsilon (of its largest value) is pointed out: ten roundings' worth (float16 ~1%,
# bfloat16 ~8%); a conversion that only rounds stays well within it.
_NOTABLE_ERROR_EPS = 10


def _beyond_rounding(outputs: Iterable[OutputError], target: LowPrecision) -> float | None:
    """The largest scaled error among `outputs` where it is more than the target's rounding
    explains (:data:`_NOTABLE_ERROR_EPS` epsilons), else None."""
    worst = max((o.scaled_error for o in outputs if o.scaled_error is not None and o.shapes is None), default=None)
    return worst if worst is not None and worst > _NOTABLE_ERROR_EPS * target.limits.eps else None


def quantized_model(model: ir.Model | None) -> bool:
    """Whether the model quantizes or dequantizes anywhere, dynamic quantization of its
    activations included (False when it is not in memory)."""
    return model is not None and any(
        has_qdq(graph) or any(quantizes_at_run_time(node) for node in graph) for graph in model.graphs()
    )


def _note_large_errors(
    result: Validation,
    target: LowPrecision,
    *,
    generated: bool,
    quantized: bool = False,
    model: ir.Model | None = None,
) -> None:
    """Say where an output differs from the FP32 model by more than rounding explains (no
    tolerance was given, so nothing failed), and what to do about it (`model`: the converted
    model, whose 16-bit recurrent nodes' rounding compounds over time steps)."""
    reshaped = next((out for out in (*result.outputs, *result.real_outputs) if out.shapes is not None), None)
    if reshaped is not None:
        result.notes.append(
            f"output {reshaped.name!r} comes out in another shape than the FP32 model's ({shape_text(reshaped.shapes)}): "
            f"a length or count computed from values that {target.value} rounds differently (a duration, "
            "a number of detections); `mixprec tune --data ... --tolerance ...` finds the ops to keep FP32"
        )
    for out in (*result.outputs, *result.real_outputs):
        if _beyond_rounding([out], target) is not None:
            inputs = "generated random inputs" if generated else "the data given"
            if quantized:
                why = (
                    f"more than {target.value} rounding alone explains; in a quantized model one "
                    f"{target.value} rounding can move a value to the next quantization step, and "
                    "steps add up over layers: judge by the task's output"
                )
            elif recurrent := low_recurrent_nodes(model, out.name):
                named = ", ".join(recurrent[:3]) + (f" and {len(recurrent) - 3} more" if len(recurrent) > 3 else "")
                verb = "rounds its" if len(recurrent) == 1 else "round their"
                why = (
                    f"more than one {target.value} rounding per op: {named} {verb} hidden state to "
                    f"{target.value} at every time step, and that rounding compounds over the sequence"
                )
            elif 0 < (largest := _reference_peak(out) or 0.0) < target.limits.tiny:
                why = (
                    f"its FP32 values are at most {largest:.2g}, below the {target.value} normal range "
                    f"({target.limits.tiny:.2g}), where a 16-bit value keeps few bits or flushes to 0"
                )
            else:
                why = f"more than {target.value} rounding explains"
            result.notes.append(
                f"output {out.name!r} differs from the FP32 model by up to {out.scaled_error:.1%} of its "
                f"largest value on {inputs} ({why})"
                + ("; --data measures ranges and checks on real inputs" if generated else "")
                + "; `mixprec tune --data ... --tolerance ...` finds the fewest ops to keep FP32"
            )
            return  # the first such output: one note


def _reference_peak(out: OutputError) -> float | None:
    """The largest |FP32 value| of an output (its error over its scaled error); None where the
    error is 0 or the FP32 output is all zero."""
    return out.max_abs_error / out.scaled_error if out.scaled_error and math.isfinite(out.scaled_error) else None


def _reference_batches_or_check(
    path: Path,
    reference: Path | None,
    target: LowPrecision,
    data: str | os.PathLike | Iterable[Batch] | None,
    max_batches: int,
    result: Validation,
) -> tuple[list[tuple[Batch, dict[str, np.ndarray]]], object]:
    """The batches with the FP32 model's outputs, and the FP32 model's session; when there are
    no batches (no reference model, it does not load, no data), run only the runtime check,
    record why and return no batches."""
    if reference is None:
        if _runtime_check(path, reference, target, result).ok:
            result.runtime = "loaded"
        _unchecked(result, f"not checked: no FP32 reference model; {_PASS_DATA}")
        return [], None
    try:
        reference_session = sessions.make_session(reference, graph_optimization="disable")
    except RunError as e:
        _runtime_check(path, reference, target, result)
        result.runtime = "reference-fails"
        _unchecked(result, f"not checked: the FP32 model does not load in onnxruntime ({e})")
        return [], None
    batches = list(_reference_batches(data, reference, reference_session, max_batches, result))
    if not batches:
        _runtime_check(path, reference, target, result)
    return batches, reference_session


def _emulated_session(path: Path, target: LowPrecision, model: ir.Model | None, result: Validation) -> object:
    """Save the emulated converted model beside `path` and open an onnxruntime session on it."""
    from mixprec.validate.emulate import emulate_low_precision  # noqa: PLC0415

    candidate_path = path.with_name("emulated.onnx")
    # The typed model in memory when its weights are all in memory (its external tensors would
    # point at the input's data file); else the staged file.
    in_memory = model is not None and not uses_external_data(model)
    onnx.save(emulate_low_precision(model if in_memory else onnx.load(str(path))), str(candidate_path))
    result.notes.append(
        f"{target.value} numerics measured on an emulated model (FP32 compute, {target.short_name} rounding)"
    )
    try:
        return sessions.make_session(candidate_path, graph_optimization="disable")
    except RunError as e:
        raise ValidationFailure(f"the emulated converted model does not load in onnxruntime: {e}") from e


def _compare_emulated(
    candidate: object, batches: list[tuple[Batch, dict[str, np.ndarray]]], result: Validation
) -> tuple[list[compare.OutputComparison], Batch | None]:
    """Run the emulated model on every batch: the merged comparisons with the FP32 outputs and
    the first batch with new non-finite outputs (None if none)."""
    merged: list | None = None
    nonfinite_feeds = None
    for feeds, expected in batches:
        try:
            actual = sessions.run_session(candidate, feeds)
        except RunError as e:
            raise ValidationFailure(f"the converted model fails to run in onnxruntime: {e}") from e
        comparison = compare.compare_outputs(expected, actual)
        if nonfinite_feeds is None and any(c.new_nonfinite for c in comparison):
            nonfinite_feeds = feeds
        merged = comparison if merged is None else compare.merge(merged, comparison)
        result.batches += 1
    return merged or [], nonfinite_feeds


def _input_scales(
    reference_session: object, candidate: object, batch: tuple[Batch, dict[str, np.ndarray]],
    reference: Path, path: Path, target: LowPrecision, nodes: int,
) -> list[InputScale]:
    """The generated `batch` (feeds, FP32 outputs) scaled to each of :data:`_INPUT_MAGNITUDES`
    in turn (0 first: all zeros) and run by the emulated converted model, until a magnitude
    above 0 gains non-finite values; where one does, by the FP32 model too: where that one
    stays finite, the converted one fails there (and, for a main graph of at most
    :data:`_ORIGIN_MAX_NODES` nodes, the node where non-finite values start is located), else
    it is not judged. Empty when the model has no float input."""
    feeds, unscaled = batch
    baseline = _nonfinite(unscaled)
    checks: list[InputScale] = []
    for magnitude, meaning in _INPUT_MAGNITUDES:
        scaled, names = _scaled_float_inputs(feeds, magnitude)
        if not names:
            break
        try:
            actual = sessions.run_session(candidate, scaled)  # type: ignore[arg-type]
        except RunError as e:
            actual, failure = None, e
        if actual is not None and _nonfinite(actual) <= baseline:
            checks.append(InputScale(magnitude, meaning, True, inputs=names))
            continue
        try:
            expected = sessions.run_session(reference_session, scaled)  # type: ignore[arg-type]
        except RunError:
            expected = None
        if expected is None or _nonfinite(expected) > baseline:  # the FP32 model fails there too
            checks.append(InputScale(magnitude, meaning, None, inputs=names))
        elif actual is None:
            origin = f"the emulated converted model does not run there: {failure}"
            checks.append(InputScale(magnitude, meaning, False, origin, inputs=names, ran=False))
        else:
            origin = _nan_origin_note(reference, path, scaled, target) if nodes <= _ORIGIN_MAX_NODES else None
            checks.append(InputScale(magnitude, meaning, False, origin, inputs=names))
        if magnitude > 0:
            break  # larger inputs only overflow more
    return checks


def _nonfinite(outputs: Mapping[str, np.ndarray]) -> int:
    """Non-finite elements of the float outputs."""
    return sum(compare.nonfinite_count(np.asarray(array)) for array in outputs.values())


def _scaled_float_inputs(feeds: Batch, magnitude: float) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """`feeds` with every float input scaled so that its largest |x| is `magnitude` (0: all
    zeros), and the names of the inputs scaled (none: no input is a float tensor with a
    non-zero value)."""
    scaled = dict(feeds)
    names = []
    for name, array in feeds.items():
        if isinstance(array, np.ndarray) and is_float_dtype(array.dtype) and array.size:
            peak = float(np.max(np.abs(array.astype(np.float32))))
            if peak > 0 and math.isfinite(peak):
                # Zeros of the input's own sign would be -0.0 where it was negative: +0 alike.
                values = np.zeros_like(array) if magnitude == 0 else array.astype(np.float32) * (magnitude / peak)
                scaled[name] = values.astype(array.dtype)
                names.append(name)
    return scaled, tuple(names)


def _raise_beyond_tolerance(result: Validation, tolerance: tuple[float, float], origin: str | None) -> None:
    """Raise ValidationFailure when an emulated or real output is beyond the tolerance."""
    failing = [o.name for o in (*result.outputs, *result.real_outputs) if o.within_tolerance is False]
    if failing:
        raise BeyondTolerance(
            f"output {failing[0]!r} differs from the FP32 model beyond atol={tolerance[0]}, "
            f"rtol={tolerance[1]}" + (f"; {origin}" if origin else ""),
            result,
        )


def _unchecked(result: Validation, why: str) -> None:
    """The numeric check was due but could not run: say so (the CLI exits 5)."""
    result.numerics = why
    result.numerics_unchecked = True


def output_errors(comparisons: Iterable[compare.OutputComparison], tolerance: tuple[float, float] | None) -> list[OutputError]:
    """The report's form of output comparisons (`within_tolerance` only with a tolerance)."""
    return [
        OutputError(
            c.name, float(c.max_abs_error), float(c.max_rel_error), int(c.nan_count), int(c.inf_count),
            int(c.new_nonfinite), c.within(*tolerance) if tolerance is not None else None,
            scaled_error=float(c.scaled_error),
            shapes=None if c.shapes_match else (tuple(c.shape), tuple(c.candidate_shape)),
        )
        for c in comparisons
    ]


# OpenVINO runtime layer types that carry a model's matrix and convolution arithmetic.
_OPENVINO_COMPUTE_LAYERS = frozenset({
    "Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul", "Gemm",
    "ScaledDotProductAttention", "RNNSeq", "RNNCell",
})
# Precision names OpenVINO's runtime model uses for each target type.
_OPENVINO_PRECISION = {"bfloat16": "bf16", "float16": "f16"}


def _openvino_check(
    path: Path,
    reference: Path,
    batches: list[tuple[Batch, dict[str, np.ndarray]]],
    tolerance: tuple[float, float] | None,
    result: Validation,
    target: LowPrecision,
    generated: bool,
    quantized: bool = False,
    skip: frozenset[str] = frozenset(),
) -> str | None:
    """Run the converted model on OpenVINO's CPU plugin in its own element types, beside the
    FP32 model at f32, and record the real errors (outputs in `skip` aside: computed from random
    numbers), what precision OpenVINO executed and the latency ratio. Returns why the real run
    was not checked (None when it was, or OpenVINO is not installed)."""
    from mixprec.runtime import openvino as openvino_runner  # noqa: PLC0415

    if not openvino_runner.openvino_available():
        result.notes.append("openvino is not installed (pip install openvino): its real run was not checked")
        return None
    try:
        fp32 = openvino_runner.OpenVinoSession(reference, precision="f32")
    except MixprecError as e:
        return f"OpenVINO cannot load the FP32 model ({e}), so the converted one was not run there"
    try:
        expected = [fp32.run(feeds) for feeds, _ in batches]
    except MixprecError as e:
        if generated:
            return f"OpenVINO cannot run the FP32 model on generated inputs ({e}); {_PASS_DATA}"
        return f"OpenVINO cannot run the FP32 model on the data ({e})"
    try:
        converted = _openvino_session(openvino_runner, path, result, quantized=quantized)
        actual = [converted.run(feeds) for feeds, _ in batches]
    except RunError as e:
        # The FP32 model ran there: the repair keeps FP32 the nodes OpenVINO fails on.
        failure = RuntimeOutcome(False, False, str(e), False, None, 0.0)
        raise RuntimeRejection(failure, batches[0][0], openvino=True) from e
    except MixprecError as e:
        raise ValidationFailure(f"OpenVINO cannot run the converted model: {e}") from e
    merged = None
    try:
        for fp32_outputs, outputs in zip(expected, actual):
            comparison = compare.compare_outputs({k: v for k, v in fp32_outputs.items() if k not in skip}, outputs)
            merged = comparison if merged is None else compare.merge(merged, comparison)
    except MixprecError as e:
        raise ValidationFailure(f"OpenVINO's outputs of the converted model do not match the FP32 model's: {e}") from e
    feeds = batches[0][0]
    try:
        ratio: float | None = converted.latency(feeds, warmup=1, budget=_LATENCY_BUDGET_S) / max(
            fp32.latency(feeds, warmup=1, budget=_LATENCY_BUDGET_S), 1e-9
        )
    except MixprecError as e:
        ratio = None
        result.notes.append(f"OpenVINO's latency was not measured: {e}")
    counts = converted.executed_precisions()
    executed = _executed_compute(counts)
    mode = "model types" if converted.precision == "model" else "default options"
    result.real_runtime = f"OpenVINO CPU ({mode})"
    result.real_executed = executed or "no matrix or convolution layers"
    result.real_outputs = output_errors(merged or [], tolerance)
    result.speed_ratio = ratio
    wanted = _OPENVINO_PRECISION[target.value]
    layers = {precision for (layer, precision) in counts if layer in _OPENVINO_COMPUTE_LAYERS}
    if layers and wanted not in layers:
        cpu = host_cpu()
        why = f"this CPU has {cpu.missing(target.value)}" if not cpu.computes(target.value) else "its own choice"
        result.notes.append(
            f"OpenVINO computed every matrix and convolution layer in {'/'.join(sorted(layers))}, not "
            f"{wanted} ({why}): its real run shows that the model runs there, not {target.value} "
            f"arithmetic; the emulated figures are the {target.value} ones"
        )
    return None


def openvino_runs(path: Path, feeds: Batch, *, quantized: bool) -> bool:
    """Whether OpenVINO's CPU plugin compiles and runs the model as validation does (its own
    element types; a quantized model also with the default options)."""
    from mixprec.runtime import openvino as openvino_runner  # noqa: PLC0415

    try:
        _openvino_session(openvino_runner, path, Validation(), quantized=quantized).run(feeds)
    except MixprecError:
        return False
    return True


def _openvino_session(openvino_runner: Any, path: Path, result: Validation, *, quantized: bool) -> Any:
    """The converted model on OpenVINO in its own element types; for a quantized model that only
    this compilation fails for (OpenVINO's low-precision transformations under
    EXECUTION_MODE_HINT=ACCURACY), with OpenVINO's default options, as users compile it, and a
    note saying so."""
    try:
        return openvino_runner.OpenVinoSession(path, precision="model")
    except RunError as strict:
        if not quantized:
            raise
        session = openvino_runner.OpenVinoSession(path, precision="default")  # raises when it fails too
        why = without_staging(str(strict)).split(": ", 1)[-1].rstrip(".")
        result.notes.append(
            "OpenVINO compiles the converted model with its default options but not in its own element types "
            f"(EXECUTION_MODE_HINT=ACCURACY: {why}); its real run "
            f"used the default options (inference precision {session.inference_precision})"
        )
        return session


def _executed_compute(counts: Mapping[tuple[str, str], int]) -> str:
    """E.g. "matrix/convolution layers ran in bf16: 12, f32: 1"."""
    by_precision: dict[str, int] = {}
    for (layer, precision), count in counts.items():
        if layer in _OPENVINO_COMPUTE_LAYERS:
            by_precision[precision] = by_precision.get(precision, 0) + count
    if not by_precision:
        return ""
    return "matrix/convolution layers ran in " + ", ".join(f"{p}: {n}" for p, n in sorted(by_precision.items()))


def _reference_batches(
    data: str | os.PathLike | Iterable[Batch] | None,
    reference: Path,
    session: object,
    max_batches: int,
    result: Validation,
) -> Iterator[tuple[Batch, dict[str, np.ndarray]]]:
    """(feeds, FP32 outputs) per batch; generated inputs grow until the FP32 model runs."""
    if data is not None:
        yield from _data_batches(data, session, max_batches, result)
    else:
        yield from _generated_batch(reference, session, result)


def _data_batches(
    data: str | os.PathLike | Iterable[Batch], session: object, max_batches: int, result: Validation
) -> Iterator[tuple[Batch, dict[str, np.ndarray]]]:
    """(feeds, FP32 outputs) of the user's batches, up to `max_batches`; none once the FP32
    model fails on one."""
    names = [i.name for i in session.get_inputs()]  # type: ignore[attr-defined]
    iterator = data_mod.load_batches(data, names) if isinstance(data, (str, os.PathLike)) else iter(data)
    for index, feeds in enumerate(iterator):
        if index >= max_batches:
            return
        try:
            expected = sessions.run_session(session, feeds)  # type: ignore[arg-type]
        except RunError as e:
            result.runtime = "reference-fails"
            _unchecked(result, f"not checked: the FP32 model fails on the data ({e})")
            return
        yield feeds, expected


def _generated_batch(reference: Path, session: object, result: Validation) -> Iterator[tuple[Batch, dict[str, np.ndarray]]]:
    """One generated batch and its FP32 outputs: symbolic dimensions grow along the ladder until
    the FP32 model runs (memory bounded; see `_climb`).
    Leading dimensions take 2; when no size runs that way, the ladder is climbed again with 1
    (a model whose batch must match a fixed size elsewhere, e.g. a recurrent state of batch 1).
    A key/value cache's head size, where its attention op fixes it, and a feature size the weights
    reading it fix are given first; if no size runs that way, the ladder alone is tried again."""
    proto = onnx.load(str(reference), load_external_data=False)
    specs = with_index_limits(data_mod.input_specs(proto), proto)
    fixed_dims = fixed_input_dims(proto)
    switches = _branch_switches(proto)
    del proto
    told: list[str] = []  # the first attempt's failures, told when every attempt fails
    for fixed in ([fixed_dims, {}] if fixed_dims else [{}]):
        try:
            found, largest_batch, errors = _climbs(with_fixed_dims(specs, fixed), reference, session)
        except InputError as e:
            _unchecked(result, f"not checked: {e}; {_PASS_DATA}")
            return
        if found is not None:
            feeds, expected, size, batch, lowest_int = found
            if lowest_int:
                result.notes.append(
                    "generated integer inputs are at least 1 (0/1 masks all ones): with zeros, an output of "
                    "the FP32 model is non-finite everywhere (every position masked, or ids of 0 as padding)"
                )
            void = _void_outputs(expected)
            if void:
                result.notes.append(
                    f"the FP32 model's output(s) {', '.join(map(repr, void))} hold no finite value on the generated "
                    f"inputs: nothing is compared there; {_PASS_DATA}"
                )
            for name, (value, why) in fixed.items():
                result.notes.append(f"generated inputs give dimension {name!r} {value}: {why}")
            if size != _DIM_LADDER[0] or largest_batch != _GENERATED_BATCH:
                why = "smaller ones fail in the FP32 model" if largest_batch == _GENERATED_BATCH else (
                    f"with {_GENERATED_BATCH} the FP32 model fails"
                )
                result.notes.append(f"generated inputs use {size} for symbolic dimensions ({batch} for leading ones; {why})")
            yield feeds, expected
            yield from _switched_batch(reference, feeds, switches, session, result)
            return
        told = told or errors
    result.runtime = "reference-fails"
    why = told[-1].split(": ", 1)[1] if told else "inputs too large to generate"
    _unchecked(result, f"not checked: the FP32 model fails on generated inputs ({why}); {_PASS_DATA}")


def generated_batches(reference: Path) -> list[Batch]:
    """The batches validation generates for the FP32 model at `reference` (the same each run),
    or none where it cannot (the model fails on every size tried)."""
    try:
        session = sessions.make_session(reference, graph_optimization="disable")
    except RunError:
        return []
    return [feeds for feeds, _ in _generated_batch(reference, session, Validation())]


def _branch_switches(proto: onnx.ModelProto) -> list[str]:
    """Boolean graph inputs that are the condition of a main-graph If: the switch of a merged
    decoder (optimum's use_cache_branch), whose other branch a generated batch never takes."""
    defaults = {t.name for t in proto.graph.initializer}  # inputs with a default are not generated
    flags = {
        i.name for i in proto.graph.input
        if i.type.tensor_type.elem_type == onnx.TensorProto.BOOL and i.name not in defaults
    }
    return sorted({
        node.input[0] for node in proto.graph.node
        if node.op_type == "If" and is_default_domain(node.domain) and node.input and node.input[0] in flags
    })


def _switched_batch(
    reference: Path, feeds: Batch, switches: Sequence[str], session: object, result: Validation
) -> Iterator[tuple[Batch, dict[str, np.ndarray]]]:
    """The generated batch again with each branch switch negated, so that both branches of the
    Ifs they steer run; nothing where there is no switch, or where the FP32 model fails that way
    (noted). Run first in the child process, as each generated size is (`_climb`): the other
    branch may crash onnxruntime."""
    switches = [name for name in switches if name in feeds]
    if not switches:
        return
    switched = {**feeds, **{name: np.logical_not(feeds[name]) for name in switches}}
    trial = run_isolated(reference, switched, keep_outputs=False, graph_optimization="disable")
    if trial.death in ("signal", "hung"):
        result.notes.append(f"generated inputs with {', '.join(switches)} negated: {_CRASH} ({trial.error})")
        return
    try:
        expected = sessions.run_session(session, switched)  # type: ignore[arg-type]
    except RunError as e:
        result.notes.append(f"generated inputs with {', '.join(switches)} negated fail in the FP32 model ({e})")
        return
    yield switched, expected


def _climbs(
    specs: Sequence[data_mod.InputSpec], reference: Path, session: object
) -> tuple[tuple[Batch, dict[str, np.ndarray], int, int, int] | None, int, list[str]]:
    """`_climb` with leading dimensions at most 2, then (when no size runs and there is a
    leading dimension to shrink) at most 1: the first run found, the largest batch it was
    climbed with, and the failures to tell (the usual batch's; batch 1's when that one had
    none). Raises InputError as `_climb` does."""
    first_climb: list[str] = []
    errors: list[str] = []
    for largest_batch in (_GENERATED_BATCH, 1):
        found, errors = _climb(specs, reference, session, largest_batch, stop_at=first_climb[-1:])
        if found is not None:
            return found, largest_batch, []
        first_climb = first_climb or errors
        if not _batch_sized(specs):
            break  # no leading dimension to shrink: a second climb would repeat the first
    return None, _GENERATED_BATCH, first_climb or errors


# How a failed size of generated inputs reads when onnxruntime crashed on the FP32 model.
_CRASH = "onnxruntime crashes on the FP32 model"


def _climb(
    specs: Sequence[data_mod.InputSpec], reference: Path, session: object, largest_batch: int, stop_at: Sequence[str]
) -> tuple[tuple[Batch, dict[str, np.ndarray], int, int, int] | None, list[str]]:
    """Generated inputs of growing sizes, leading dimensions at most `largest_batch`, until the
    FP32 model runs: (feeds, FP32 outputs, size, batch, the smallest integer drawn), or None,
    and the failures ("size: error") met on the way. Integers are drawn from 1 where that leaves
    fewer outputs without a finite value than zeros do (:func:`_without_zero_ints`). Each size is run first in the child process (`run_isolated`): a
    generated length of 0 or 1 can make onnxruntime itself die on the FP32 model (SIGFPE), and
    a size it dies or hangs on is a failed size (after a hang, the last); otherwise the size
    runs in this process, in a session of the same optimization level. A size failing with the error of `stop_at` (the same failure as
    another batch, a crash aside) ends the climb, as do inputs above the element cap; sizes
    that give the same shapes as the last are skipped. Raises InputError when inputs cannot be
    generated."""
    errors: list[str] = []
    stop = {error.split(": ", 1)[1] for error in stop_at if not error.split(": ", 1)[1].startswith(_CRASH)}
    tried: dict[str, tuple[int, ...]] | None = None
    for size in _DIM_LADDER:
        batch = min(size, largest_batch)
        shapes = data_mod.generated_shapes(specs, dim_value=size, batch_value=batch)
        if shapes == tried:
            continue  # no symbolic dimension grows: the same inputs again
        tried = shapes
        if sum(math.prod(shape) for shape in shapes.values()) > _MAX_GENERATED_ELEMENTS:
            break  # checked before allocating: memory stays bounded
        feeds = data_mod.generate_inputs(specs, seed=0, dim_value=size, batch_value=batch)
        trial = run_isolated(reference, feeds, keep_outputs=False, graph_optimization="disable")
        if trial.death in ("signal", "hung"):
            errors.append(f"{size}: {_CRASH}: {trial.error}")
            if trial.death == "hung":
                break
            continue
        try:
            outputs = sessions.run_session(session, feeds)  # type: ignore[arg-type]
        except (RunError, InputError) as e:
            message = str(e)
        else:
            void = _void_outputs(outputs)
            shifted = _without_zero_ints(specs, reference, session, size, batch, len(void)) if void else None
            if shifted is not None:  # e.g. every position masked: ids of 0 often mark padding
                return (*shifted, size, batch, 1), errors
            return (feeds, outputs, size, batch, 0), errors
        errors.append(f"{size}: {message}")
        if message in stop:
            break  # the batch is not the cause
    return None, errors


def _void_outputs(outputs: Mapping[str, np.ndarray]) -> list[str]:
    """The float outputs of the FP32 model that hold elements and not one finite value."""
    return [
        name for name, a in ((name, np.asarray(v)) for name, v in outputs.items())
        if is_float_dtype(a.dtype) and a.size and not np.isfinite(a.astype(np.float32)).any()
    ]


def _without_zero_ints(
    specs: Sequence[data_mod.InputSpec], reference: Path, session: object, size: int, batch: int, void: int
) -> tuple[Batch, dict[str, np.ndarray]] | None:
    """The generated inputs with no integer 0 (0/1 masks all ones) and the FP32 outputs, where
    the model has integer inputs and runs on them with fewer than `void` float outputs holding
    no finite value; else None."""
    if not any(np.issubdtype(np.dtype(s.dtype), np.integer) for s in specs):
        return None
    feeds = data_mod.generate_inputs(specs, seed=0, dim_value=size, batch_value=batch, lowest_int=1)
    if run_isolated(reference, feeds, keep_outputs=False, graph_optimization="disable").death is not None:
        return None
    try:
        outputs = sessions.run_session(session, feeds)  # type: ignore[arg-type]
    except (RunError, InputError):
        return None
    return (feeds, outputs) if len(_void_outputs(outputs)) < void else None


def _batch_sized(specs: Sequence[data_mod.InputSpec]) -> bool:
    """Whether a generated input has a leading dimension that takes the batch size."""
    return any(len(s.shape or ()) >= 2 and not (isinstance(s.shape[0], int) and s.shape[0] >= 0) for s in specs)


def _nan_origin_note(reference: Path, converted: Path, feeds: Batch, target: LowPrecision) -> str:
    """A note naming the node where new non-finite values start (see `find_nan_origin`)."""
    from mixprec.validate.nan_origin import find_nan_origin  # noqa: PLC0415

    try:
        origin = find_nan_origin(reference, converted, feeds, target=target)
    except MixprecError as e:
        return f"could not locate where the non-finite values start: {e}"
    if origin is None:
        return "the non-finite values could not be traced to a main-graph node"
    return f"non-finite values start at {origin.describe()}"
