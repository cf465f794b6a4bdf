"""The search: a default conversion, one probe run that ranks the candidates, bisection."""

from __future__ import annotations

import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.config import CalibrationConfig, Config, OutputConfig, ValidationConfig
from mixprec.dtypes import LowPrecision
from mixprec.errors import InputError, MixprecError
from mixprec.io import value_types, wants_external_data
from mixprec.pipeline import Prepared, prepare
from mixprec.plan.file import PlanFile, fp32_plan, load_plan
from mixprec.policy.costs import runtime_cost
from mixprec.tolerance import Tolerance
from mixprec.tune.inputs import read_batches
from mixprec.tune.candidates import (
    Candidate,
    candidates_of,
    evaluation_bound,
    own_error,
    outlier_count,
    rank_error,
)
from mixprec.tune.flops import NodeCosts, fp32_share, node_costs
from mixprec.tune.metrics import output_metrics
from mixprec.tune.probe import ProbeBuilder
from mixprec.tune.results import Evaluation, OutputMetrics, TuneResult

logger = logging.getLogger(__name__)

Batch = Mapping[str, np.ndarray]
Metric = Callable[[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]], bool]

# Option groups tune sets itself: it owns the data, the check and what is shown.
_OWN_GROUPS = frozenset({"calibration", "validation", "output"})


def tune(
    model_path: str | os.PathLike | onnx.ModelProto,
    data: str | os.PathLike | Sequence[str | os.PathLike] | Batch | Iterable[Batch] | None,
    *,
    target_dtype: str | LowPrecision | None = None,
    tolerance: Tolerance | None = None,
    metric: Metric | None = None,
    max_batches: int = 4,
    progress: bool = False,
    output: str | os.PathLike | None = None,
    emulate: bool = True,
    config: Config | None = None,
    **convert_options: Any,
) -> TuneResult:
    """Find the smallest set of nodes to keep FP32 so that the converted model meets a tolerance.

    See :mod:`mixprec.tune` for the method.

    Args:
        model_path: The FP32 model (a path, or a `ModelProto`).
        data: Input batches: a `.npz` file, a folder of them or of `test_data_set_N`, a list of
            such paths, one batch dict, or an iterable of them. None: the batches a
            conversion's check generates (a weak check).
        target_dtype: "float16"/"fp16" or "bfloat16"/"bf16" (default: the config's, float16).
        tolerance: What every output must meet.
        metric: Optional `metric(reference, candidate) -> bool` over lists (one per batch) of
            output dicts; must hold too. At least one of `tolerance` and `metric` is required.
        max_batches: Use at most this many batches.
        progress: Print one progress line per step on stderr.
        output: Write the final converted model here, only if it meets the tolerance.
        emulate: Measure float16 candidates on the emulated model (default, as validation
            does); False runs them in onnxruntime for real. bfloat16 is emulated, except with
            `runtime="openvino"` (and openvino installed), where every candidate runs on
            OpenVINO's CPU plugin for real.
        config: The conversion options (`mixprec.Config`) every candidate is converted with;
            its data, validation and output options are tune's own and are ignored.
        **convert_options: `convert`'s keyword options for ops, nodes, I/O and the runtime
            (e.g. `exclude_nodes`, `fp32_ops`, `keep_io_types`, `opset`, `policy_file`, and
            `plan` as a starting plan), applied on top of `config`.

    Returns:
        The result; `met` tells whether the tolerance was met.

    Raises:
        InputError: Bad arguments or data.
        MixprecError: The model cannot be loaded or converted.
    """
    start = time.perf_counter()
    owned = sorted(name for name in convert_options if Config.groups_of([name]) & _OWN_GROUPS)
    if owned:
        raise InputError(f"tune sets {owned[0]!r} itself; it cannot be passed to tune")
    config = (config or Config()).with_options(**convert_options)
    if target_dtype is not None:
        config = config.with_options(target_dtype=target_dtype)
    if tolerance is None and metric is None:
        raise InputError("tune needs a tolerance or a metric")
    if tolerance is not None and tolerance.empty and metric is None:
        raise InputError("the tolerance sets no criterion (atol, rtol, min_cosine or topk_agreement)")
    if max_batches < 1:
        raise InputError(f"max_batches must be >= 1, got {max_batches}")
    say = _Say(progress)
    with tempfile.TemporaryDirectory(prefix="mixprec-tune-") as tmp:
        search = _Search(Path(tmp), config, tolerance, metric, emulate, say)
        result = search.run(model_path, data, max_batches, output)
    return _replace_seconds(result, time.perf_counter() - start)


def _replace_seconds(result: TuneResult, seconds: float) -> TuneResult:
    return replace(result, seconds=round(seconds, 3))


class _Say:
    """Progress lines on stderr."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        if not self.enabled:
            logger.info("%s", message)
            return
        sys.stderr.write(f"mixprec tune: {message}\n")
        sys.stderr.flush()


@dataclass
class _Converted:
    """One candidate conversion: the rewritten model, its plan, and the file it was saved to."""

    model: ir.Model
    plan: Any  # PrecisionPlan
    path: Path


@dataclass
class _Outcome:
    met: bool
    outputs: tuple[OutputMetrics, ...]
    conversion: _Converted
    note: str | None = None


class _Search:
    def __init__(
        self,
        workdir: Path,
        config: Config,
        tolerance: Tolerance | None,
        metric: Metric | None,
        emulate: bool,
        say: _Say,
    ) -> None:
        self.workdir = workdir
        self.target = config.ops.target
        self.tolerance = tolerance
        self.metric = metric
        self.emulate = emulate or self.target is LowPrecision.BFLOAT16
        self.say = say
        base = config.nodes.plan
        self.base: PlanFile | None = load_plan(base) if base is not None else None
        # Every candidate converts with no validation, no data and no progress of its own.
        self.config = config.replace(
            calibration=CalibrationConfig(), validation=ValidationConfig(level="none"), output=OutputConfig()
        )
        self.prepared: Prepared | None = None
        self.notes: list[str] = []
        self.history: list[Evaluation] = []
        self.reference: list[dict[str, np.ndarray]] = []
        self.batches: list[dict[str, np.ndarray]] = []
        self._count = 0

    # -- setup ---------------------------------------------------------------------------------
    def _fp32_model(self, model: str | os.PathLike | onnx.ModelProto) -> Path:
        """The FP32 model as a file (upgraded first when `opset` is given)."""
        from mixprec.io import load_model  # noqa: PLC0415
        from mixprec.passes.functions import inline_as_asked  # noqa: PLC0415
        from mixprec.pipeline.steps import op_named  # noqa: PLC0415
        from mixprec.policy.profiles import load_runtime  # noqa: PLC0415
        from mixprec.passes.opset import default_opset, upgrade_opset  # noqa: PLC0415

        opset = self.config.io.opset  # stays pinned: no candidate moves past it
        if isinstance(model, ir.Model):
            raise InputError("tune takes a model path or an onnx.ModelProto, not an onnx_ir.Model")
        path = None if isinstance(model, onnx.ModelProto) else Path(model)
        if path is not None and opset is None:
            load_model(path)  # clear errors for a missing or broken file
            return path
        ir_model, _ = load_model(model)
        current = default_opset(ir_model)
        if opset is not None and current is not None and current < opset:
            # the version converter drops local functions
            inline_as_asked(ir_model, self.config.io.inline_functions, op_named(load_runtime(self.config.runtime)))
            ir_model = upgrade_opset(ir_model, opset)
            self.notes.append(f"opset upgraded from {current} to {opset}")
        path = self.workdir / "fp32.onnx"
        value_types.save(ir_model, path)
        return path

    # -- conversion and evaluation ---------------------------------------------------------------
    def _convert(self, names: Sequence[str]) -> _Converted:
        """Plan and rewrite a clean copy of the typed model with `names` kept FP32 (no reload,
        no type inference)."""
        assert self.prepared is not None
        self._count += 1
        model, plan = self.prepared.rewrite(plan=fp32_plan(names, self.base))
        return _Converted(model, plan, self.workdir / f"candidate-{self._count}.onnx")

    def _evaluate(self, conversion: _Converted) -> _Outcome:
        """Run a converted model (emulated unless told otherwise) and compare with the reference."""
        try:
            candidate = self._run_candidate(conversion.model, conversion.path)
        except MixprecError as e:
            return _Outcome(False, (), conversion, f"converted model failed to run: {e}")
        finally:
            for leftover in self.workdir.glob(f"{conversion.path.stem}.*"):
                leftover.unlink(missing_ok=True)
        metrics = output_metrics(self.reference, candidate, self.tolerance)
        met = all(m.passed for m in metrics if m.checked)
        if met and self.metric is not None:
            met = bool(self.metric(self.reference, candidate))
        return _Outcome(met, metrics, conversion)

    def _run_candidate(self, model: ir.Model, path: Path) -> list[dict[str, np.ndarray]]:
        """Save the candidate (its emulation model, when emulating: built in place, the
        candidate is not needed afterwards) and run it on the batches."""
        from mixprec.runtime import openvino, sessions  # noqa: PLC0415
        from mixprec.validate.emulate import emulate_into_file  # noqa: PLC0415

        if self.config.runtime == "openvino" and openvino.openvino_available():
            # The deployment runtime computes for real (bfloat16 on AVX512-BF16/AMX): judge
            # candidates by what it produces, not by the emulation.
            value_types.save(model, path, external_data=f"{path.name}.data" if wants_external_data(model) else None)
            session = openvino.OpenVinoSession(path, precision="model")
            return [session.run(feeds) for feeds in self.batches]
        if self.emulate:
            emulate_into_file(model, path)
        else:
            value_types.save(model, path, external_data=f"{path.name}.data" if wants_external_data(model) else None)
        session = sessions.make_session(path, graph_optimization="disable")
        return [sessions.run_session(session, feeds) for feeds in self.batches]

    def _step(self, ranked: Sequence[Candidate], k: int, bound: int, conversion: _Converted | None = None) -> _Outcome:
        t = time.perf_counter()
        if conversion is None:
            conversion = self._convert([c.name for c in ranked[:k]])
        outcome = self._evaluate(conversion)
        self.history.append(Evaluation(k, outcome.met, round(time.perf_counter() - t, 3), outcome.note))
        if outcome.note:
            self.notes.append(f"{k} candidate(s) FP32: {outcome.note}")
        self.say(
            f"evaluation {len(self.history)}/{bound}: {k} of {len(ranked)} candidate(s) FP32: "
            + ("meets the tolerance" if outcome.met else "fails")
        )
        return outcome

    def _check_tolerance_outputs(self, model_path: Path) -> None:
        """Raise InputError when the tolerance names an output the model does not have."""
        if self.tolerance is not None and self.tolerance.outputs:
            proto_outputs = {o.name for o in onnx.load(str(model_path), load_external_data=False).graph.output}
            unknown = [n for n in self.tolerance.outputs if n not in proto_outputs]
            if unknown:
                raise InputError(f"tolerance names output {unknown[0]!r}, which the model does not have")

    def _fewest_fp32(
        self, ranked: Sequence[Candidate], guess: int, bound: int, default: _Converted
    ) -> tuple[_Outcome, int]:
        """The best outcome and how many of the `ranked` candidates it keeps FP32: none when the
        default conversion meets the tolerance, else a bisection between none and all (first
        split at `guess`, the ranking's outliers, when between); all when even that fails."""
        n = len(ranked)
        best = self._step(ranked, 0, bound, conversion=default)
        best_k = 0
        if not best.met and n:
            full = self._step(ranked, n, bound)
            best, best_k = full, n
            if full.met:
                lo, hi = 0, n
                while hi - lo > 1:
                    # The first split is at the outliers of the ranking when there are any.
                    mid = guess if lo < guess < hi else (lo + hi) // 2
                    guess = 0
                    outcome = self._step(ranked, mid, bound)
                    if outcome.met:
                        hi, best, best_k = mid, outcome, mid
                    else:
                        lo = mid
        return best, best_k

    # -- main ----------------------------------------------------------------------------------
    def run(self, model: Any, data: Any, max_batches: int, output: str | os.PathLike | None) -> TuneResult:
        model_path = self._fp32_model(model)
        self.batches = read_batches(data, model_path, max_batches, self.notes)
        self._check_tolerance_outputs(model_path)
        # Measured ranges shape every candidate plan: values that leave the 16-bit range stay
        # FP32 from the start instead of being found by the search.
        from mixprec.analysis.calibrate import calibrate  # noqa: PLC0415

        self.say("measuring FP32 ranges")
        try:
            self.config = self.config.with_options(ranges=calibrate(model_path, self.batches))
        except MixprecError as e:
            self.notes.append(f"calibration skipped: {e}")
        self.say(f"default conversion to {self.target.value}")
        self.prepared = prepare(model_path, self.config)
        default = self._convert([])
        candidates = candidates_of(default.plan)
        self.say(f"{len(candidates)} candidate node(s); probe run over {len(self.batches)} batch(es)")
        with tempfile.TemporaryDirectory(prefix="mixprec-probe-") as folder:
            probed, costs = self._probe(self._probe_source(model_path, Path(folder)), candidates)
        errors = {c.name: own_error(c, probed[c.name]) for c in candidates if c.name in probed}
        flops = costs.flops
        # Largest own error first; among equal errors the node cheapest to keep FP32 on the
        # runtime (the cost model's estimate) first; nodes that only move values after every
        # node that rounds; unprobed nodes last, in graph order.
        ranked = sorted(
            candidates,
            key=lambda c: (
                rank_error(errors.get(c.name)),
                costs.fp32_penalty.get(c.name, 0.0) if c.name in errors else 0.0,
                c.index,
            ),
        )
        n = len(ranked)
        guess = outlier_count([errors.get(c.name) for c in ranked])
        bound = evaluation_bound(n, guess)
        best, best_k = self._fewest_fp32(ranked, guess, bound, default)
        # The final model through the whole pipeline, for its report (and file, when met).
        from mixprec.api import convert_with_config  # noqa: PLC0415

        output_path = Path(output) if output is not None and best.met else None
        final = convert_with_config(
            model_path, output_path,
            self.config.with_options(
                validate="checker" if output_path is not None else "none",
                plan=fp32_plan([c.name for c in ranked[:best_k]], self.base),
            ),
        )
        share, share_flops = fp32_share(final.plan, flops)
        default_share, default_share_flops = fp32_share(default.plan, flops)
        contributions = tuple(
            (c.name, c.op_type, float(errors[c.name]) if errors.get(c.name) is not None else math.nan)
            for c in ranked
        )
        if not best.met:
            self.say("the tolerance cannot be met" + (" even with every candidate FP32" if n else ""))
        return TuneResult(
            met=best.met,
            target=self.target,
            tolerance=self.tolerance,
            plan=final.plan,
            model=final.model,
            output_path=output_path,
            fp32_nodes=tuple(c.name for c in ranked[:best_k]),
            outputs=best.outputs,
            evaluations=len(self.history),
            max_evaluations=bound,
            candidates=n,
            contributions=contributions,
            fp32_share_nodes=share,
            fp32_share_flops=share_flops,
            default_fp32_share_nodes=default_share,
            default_fp32_share_flops=default_share_flops,
            history=tuple(self.history),
            notes=tuple(self.notes),
            report=final.report,
        )

    # -- the probe -------------------------------------------------------------------------------
    def _probe_source(self, model_path: Path, folder: Path) -> Path:
        """The FP32 model the probe is built on: the input, unless the conversion changed it
        before planning (an opset upgrade: bfloat16 Cast needs 13; fused normalizations; folded
        dequantizations); then the prepared model, whose node keys are the candidates' own."""
        assert self.prepared is not None
        prepared = self.prepared
        if prepared.unchanged is not None:
            return model_path
        path = folder / "prepared.onnx"
        external = wants_external_data(prepared.model)
        value_types.save(prepared.model, path, external_data="prepared.onnx.data" if external else None)
        return path

    def _probe(
        self, model_path: Path, candidates: Sequence[Candidate]
    ) -> tuple[dict[str, float], NodeCosts]:
        """Run the probe model: keep the reference outputs; return per-candidate errors and the
        cost model's figures per node."""
        from mixprec.runtime.intermediates import IntermediateRunner  # noqa: PLC0415
        from mixprec.runtime import sessions as runner  # noqa: PLC0415

        with IntermediateRunner(model_path) as exposer:
            assert self.prepared is not None
            cost = runtime_cost(self.prepared.profile.name, self.prepared.target.value)
            costs = node_costs(exposer.proto, self.batches[0], cost)
            reference_names = [o.name for o in exposer.proto.graph.output]
            errors: dict[str, float] = {}
            try:
                probe = value_types.deserialize(exposer.proto, owned=False)
                outputs = ProbeBuilder(probe, self.target, candidates).build()
                path = exposer.workdir / "probe.onnx"
                onnx.save(value_types.to_proto(probe), str(path))
                session = runner.make_session(path, graph_optimization="disable")
                for feeds in self.batches:
                    results = runner.run_session(session, feeds)
                    self.reference.append({name: results[name] for name in reference_names})
                    for out_name, cand_name in outputs.items():
                        value = float(np.asarray(results[out_name]).reshape(-1)[0])
                        value = math.inf if math.isnan(value) else value
                        errors[cand_name] = max(errors.get(cand_name, 0.0), value)
                del session
            except Exception as e:  # noqa: BLE001 - any probe failure falls back to a plain run
                note = f"the error probe failed ({e}); candidates are ranked by graph order"
                logger.warning("%s", note)
                self.notes.append(note)
                errors = {}
                self.reference = []
                session = runner.make_session(model_path, graph_optimization="disable")
                self.reference = [runner.run_session(session, feeds) for feeds in self.batches]
        missing = [c.name for c in candidates if c.name not in errors]
        if errors and missing:
            self.notes.append(
                f"{len(missing)} candidate(s) could not be probed (e.g. {missing[0]!r}); they rank last"
            )
        return errors, costs
