"""Accuracy-aware precision search: keep the fewest nodes FP32 that meet an accuracy target.

:func:`tune` localises the error instead of searching blindly:

1. **Default plan.** The model is converted once with the default plan (as `convert` would).
   Its 16-bit nodes are the *candidates*.
2. **One probe run ranks every candidate.** A copy of the FP32 model gets, beside each
   candidate, a duplicate of it fed with the candidate's FP32 inputs rounded through the 16-bit
   type (only the inputs the plan lowers: activations and weights), its outputs rounded too, and
   the normalised error ``max|dup - ref| / max|ref|`` against the original (FP32) node computed
   in-graph and exposed as a scalar output. Each duplicate sees exact FP32 inputs, so its error
   is the node's *own* contribution: error made upstream does not leak in. Subgraph candidates
   are probed inside their If/Loop/Scan bodies (an If's branches output every error, the other
   branch zeros; a loop's errors leave as scan outputs and are reduced outside). One run of this
   model over the data gives both the FP32 reference outputs and the error of every candidate,
   without storing any intermediate value: everything stays inside onnxruntime's run, whose
   memory is released value by value. Rounding is emulated with Cast pairs, so this works for
   bfloat16 on any CPU.
3. **Bisection on the ranking.** Candidates are ranked by their error (ties: fewer FLOPs, then
   graph order). Keeping the top-k candidates FP32 is one full conversion (through the plan
   mechanism) plus one full evaluation on the data. k=0 (the default plan) is evaluated first,
   then k=n (every candidate FP32) as the feasibility check, then bisection finds the smallest
   passing k: at most ``2 + ceil(log2 n)`` evaluations. When a few candidates stand out (own
   error above 10 times the median: ordinary rounding gives every node about the same), the
   first split is at their count instead of the middle: usually the answer, proved in one or
   two more evaluations, at worst one evaluation more than plain bisection. Deterministic.

Evaluations run the converted model *emulated* by default (FP32 compute, every 16-bit value
rounded, :mod:`mixprec.validate.emulate`), as `convert`'s validation does: onnxruntime's CPU
provider has no bfloat16 kernels and computes most float16 ops in FP32, which would hide
float16 rounding and overflow. ``emulate=False`` runs float16 models for real.

Limits: the ranking measures each node's local error, so error made in one node and amplified
far downstream (a sharp softmax, say) ranks the node where the amplification shows, if it is a
candidate; the bisection still finds a passing set, only a larger one. Candidates inside
model-local function bodies are not probed (they rank last).

Modules: :mod:`~mixprec.tune.search` (the search), :mod:`~mixprec.tune.probe` (the probe model),
:mod:`~mixprec.tune.candidates` (the candidates and their ranking), :mod:`~mixprec.tune.metrics`
(outputs against the tolerance), :mod:`~mixprec.tune.flops` (FLOPs and FP32 shares),
:mod:`~mixprec.tune.inputs` (input batches), :mod:`~mixprec.tune.results` (what `tune` returns).
"""

from __future__ import annotations

from mixprec.tolerance import Tolerance
from mixprec.tune.probe import ProbeBuilder
from mixprec.tune.results import Evaluation, OutputMetrics, TuneResult
from mixprec.tune.search import Batch, Metric, tune

_ProbeBuilder = ProbeBuilder  # the builder of the probe model (mixprec.tune.probe)

__all__ = ["Batch", "Evaluation", "Metric", "OutputMetrics", "Tolerance", "TuneResult", "tune"]
