"""The pieces of `mixprec.tune` alone: candidates and their ranking, the outlier count and the
evaluation bound, the fewest-FP32 search driven by a fake evaluator (no conversion), the
per-output metrics, the input batches and the result's text and JSON forms."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto, numpy_helper

import mixprec
from mixprec.dtypes import LowPrecision
from mixprec.errors import InputError
from mixprec.tolerance import Tolerance
from mixprec.tune.candidates import (
    Candidate,
    candidates_of,
    evaluation_bound,
    outlier_count,
    rank_error,
)
from mixprec.tune.inputs import read_batches
from mixprec.tune.metrics import output_metrics, passes, topk_agreement
from mixprec.tune.results import Evaluation, OutputMetrics, TuneResult
from mixprec.tune.search import _Converted, _Outcome, _Say, _Search
from mixprec.validate.compare import compare_arrays

F32 = TensorProto.FLOAT


def small_model() -> onnx.ModelProto:
    """x -> MatMul -> Relu -> {ArgMax (int64 output), ReduceSum (kept FP32 by policy)}."""
    nodes = [
        oh.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        oh.make_node("Relu", ["h"], ["r"], name="relu"),
        oh.make_node("ArgMax", ["r"], ["idx"], name="am", axis=1, keepdims=0),
        oh.make_node("ReduceSum", ["r"], ["s"], name="rs", keepdims=0),
    ]
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", F32, [2, 4])],
        [oh.make_tensor_value_info("idx", TensorProto.INT64, [2]), oh.make_tensor_value_info("s", F32, [])],
        [numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "w")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _convert(**options: object) -> mixprec.ConversionResult:
    return mixprec.convert(copy.deepcopy(small_model()), validate="none", runtime="onnx", **options)


# -- candidates -----------------------------------------------------------------------------------


def test_candidates_are_the_16_bit_nodes_with_their_lowered_io() -> None:
    """MatMul, Relu and ArgMax compute in 16 bits (ReduceSum stays FP32 by policy): MatMul lowers
    both inputs, the float outputs are rounded, ArgMax's int64 output is exact."""
    found = {c.name: c for c in candidates_of(_convert().plan)}
    assert list(found) == ["mm", "relu", "am"]
    assert found["mm"] == Candidate("mm", "MatMul", 0, frozenset({0, 1}), ((0, "round"),))
    assert found["relu"].lowered_inputs == frozenset({0}) and found["relu"].outputs == ((0, "round"),)
    assert found["am"].outputs == ((0, "exact"),)
    assert [c.index for c in found.values()] == [0, 1, 2]


def test_excluded_node_is_no_candidate() -> None:
    """A node the plan keeps FP32 is not a candidate."""
    names = [c.name for c in candidates_of(_convert(exclude_nodes=["relu"]).plan)]
    assert "relu" not in names and "rs" not in names and "mm" in names


def test_rank_error_sorts_largest_first_unknown_last() -> None:
    assert sorted([None, 0.1, 3.0, 0.0, math.inf], key=rank_error) == [math.inf, 3.0, 0.1, 0.0, None]


@pytest.mark.parametrize(
    ("errors", "expected"),
    [
        ([100.0, 1.0, 1.0, 1.0, 1.0], 1),
        ([50.0, 40.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2),
        ([1.0, 1.0, 1.0], 0),  # no outlier
        ([10.0, 1.0, 1.0], 0),  # exactly 10x the median is not above it
        ([10.001, 1.0, 1.0], 1),
        ([math.inf, 1.0, 1.0, None], 1),  # infinite error counts, unknown ignored
        ([5.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1], 1),  # zeros do not pull the median to 0
        ([0.0, 0.0], 0),
        ([None, None], 0),
        ([], 0),
    ],
)
def test_outlier_count(errors: list[float | None], expected: int) -> None:
    assert outlier_count(errors) == expected


@pytest.mark.parametrize(
    ("candidates", "guess", "expected"),
    [(0, 0, 1), (1, 0, 2), (2, 0, 3), (5, 0, 5), (8, 0, 5), (9, 0, 6), (9, 3, 7), (1000, 2, 13)],
)
def test_evaluation_bound(candidates: int, guess: int, expected: int) -> None:
    """k=0, k=n, ceil(log2 n) bisection steps, one more for an outlier split."""
    assert evaluation_bound(candidates, guess) == expected


# -- the fewest-FP32 search, with a fake evaluator ------------------------------------------------


class _FakeSearch(_Search):
    """`_Search` whose conversion records the FP32 names and whose evaluation asks `meets(k)`."""

    def __init__(self, meets: Callable[[int], bool]) -> None:  # no model, no config
        self.meets = meets
        self.history: list[Evaluation] = []
        self.notes: list[str] = []
        self.say = _Say(False)
        self.converted: list[tuple[str, ...]] = []

    def _convert(self, names):  # type: ignore[no-untyped-def, override]
        self.converted.append(tuple(names))
        return _Converted(None, tuple(names), Path("candidate.onnx"))  # type: ignore[arg-type]

    def _evaluate(self, conversion: _Converted) -> _Outcome:
        return _Outcome(self.meets(len(conversion.plan)), (), conversion)


def _ranked(n: int) -> list[Candidate]:
    return [Candidate(f"n{i}", "Add", i, frozenset(), ()) for i in range(n)]


def _search(n: int, guess: int, meets: Callable[[int], bool]) -> tuple[_FakeSearch, _Outcome, int]:
    search = _FakeSearch(meets)
    default = _Converted(None, (), Path("default.onnx"))  # type: ignore[arg-type]
    best, best_k = search._fewest_fp32(_ranked(n), guess, evaluation_bound(n, guess), default)
    return search, best, best_k


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 13])
def test_fewest_fp32_finds_the_threshold_within_the_bound(n: int) -> None:
    """With a monotone evaluator (met iff k >= t) the search returns k = t for every t and
    every outlier guess, keeps the top-k of the ranking, and stays within the bound."""
    for t in range(n + 1):
        for guess in range(n + 1):
            search, best, best_k = _search(n, guess, lambda k, t=t: k >= t)
            assert best_k == t and best.met
            assert best.conversion.plan == tuple(f"n{i}" for i in range(t))
            assert len(search.history) <= evaluation_bound(n, guess)
            assert [e.fp32_candidates for e in search.history][:2] == ([0] if t == 0 else [0, n])


def test_fewest_fp32_default_met_needs_one_evaluation() -> None:
    """When the default plan meets the tolerance nothing is converted."""
    search, best, best_k = _search(5, 2, lambda k: True)
    assert best_k == 0 and best.met
    assert [e.fp32_candidates for e in search.history] == [0]
    assert search.converted == []


def test_fewest_fp32_order_and_first_split_at_the_guess() -> None:
    """k=0 (the given default conversion), then k=n, then the outliers' count, then bisection."""
    search, _, best_k = _search(16, 3, lambda k: k >= 3)
    ks = [e.fp32_candidates for e in search.history]
    assert ks[:3] == [0, 16, 3]
    assert best_k == 3
    assert ks == [0, 16, 3, 1, 2]
    assert search.converted[0] == tuple(f"n{i}" for i in range(16))  # k=0 was not converted again


def test_fewest_fp32_never_met_keeps_all_after_two_evaluations() -> None:
    """Even all FP32 fails: the result is k=n (the most accurate tried), not met."""
    search, best, best_k = _search(6, 2, lambda k: False)
    assert (best_k, best.met) == (6, False)
    assert [e.fp32_candidates for e in search.history] == [0, 6]


def test_fewest_fp32_no_candidates() -> None:
    search, best, best_k = _search(0, 0, lambda k: False)
    assert (best_k, best.met, len(search.history)) == (0, False, 1)


def test_fewest_fp32_non_monotone_still_returns_a_passing_k() -> None:
    """Whatever the evaluator does, the returned outcome is one that met (k=n did)."""
    passing = {2, 5, 8}
    search, best, best_k = _search(8, 0, lambda k: k in passing)
    assert best.met and best_k in passing
    assert best_k == min(e.fp32_candidates for e in search.history if e.met)


# -- metrics ------------------------------------------------------------------------------------


def test_topk_agreement_over_batches() -> None:
    """Share of rows whose argmax agrees, pooled over batches; ints, a last axis of 1 and
    shape mismatches are left out."""
    ref = [
        {"p": np.array([[1.0, 0.0], [0.0, 1.0]]), "i": np.array([[1, 2]]), "one": np.ones((3, 1)), "m": np.ones((2, 2))},
        {"p": np.array([[0.0, 1.0], [0.0, 1.0]])},
    ]
    cand = [
        {"p": np.array([[1.0, 0.0], [1.0, 0.0]]), "i": np.array([[2, 1]]), "one": np.ones((3, 1)), "m": np.ones((3, 2))},
        {"p": np.array([[0.0, 1.0], [0.0, 1.0]])},
    ]
    assert topk_agreement(ref, cand) == {"p": 0.75}


def test_passes_allclose_cosine_and_topk() -> None:
    """Each set criterion must hold; an unset one is not checked."""
    c = compare_arrays("y", np.array([1.0, 100.0]), np.array([1.05, 101.0]))
    assert passes(Tolerance(atol=0.06, rtol=0.0095), c, None)
    assert not passes(Tolerance(atol=0.06, rtol=0.009), c, None)  # 1 > 0.06 + 0.9
    assert passes(None, c, None)
    assert passes(Tolerance(min_cosine=0.999), c, None)
    assert not passes(Tolerance(min_cosine=1.0), c, None)
    assert not passes(Tolerance(topk_agreement=0.9), c, 0.5)
    assert passes(Tolerance(topk_agreement=0.5), c, 0.5)
    assert passes(Tolerance(topk_agreement=0.9), c, None)  # no agreement measured for this output


def test_passes_fails_new_nonfinite_and_int_mismatch_regardless_of_tolerance() -> None:
    nan = compare_arrays("y", np.array([1.0, 2.0]), np.array([1.0, np.nan]))
    assert not passes(None, nan, None)
    ints = compare_arrays("i", np.array([1, 2]), np.array([1, 3]))
    assert not passes(Tolerance(atol=10.0), ints, None)
    assert passes(None, compare_arrays("i", np.array([1, 2]), np.array([1, 2])), None)


def test_output_metrics_merges_batches_and_marks_checked_outputs() -> None:
    """Max error over both batches; an output outside `tolerance.outputs` is not checked."""
    ref = [{"y": np.array([1.0, 2.0], np.float32), "i": np.array([1, 2])}, {"y": np.array([4.0, 8.0], np.float32), "i": np.array([3, 4])}]
    cand = [{"y": np.array([1.0, 2.5], np.float32), "i": np.array([1, 2])}, {"y": np.array([4.0, 8.1], np.float32), "i": np.array([3, 5])}]
    metrics = {m.name: m for m in output_metrics(ref, cand, Tolerance(atol=0.6, outputs=("y",)))}
    assert set(metrics) == {"y", "i"}
    y, i = metrics["y"], metrics["i"]
    assert y.max_abs_error == pytest.approx(0.5)
    assert y.max_rel_error == pytest.approx(0.25)
    assert y.passed and y.checked and y.new_nonfinite == 0
    assert not i.passed and not i.checked
    failing = {m.name: m for m in output_metrics(ref, cand, Tolerance(atol=0.4))}
    assert not failing["y"].passed and failing["i"].checked


# -- input batches ------------------------------------------------------------------------------


def _two_input_model(tmp_path: Path) -> Path:
    """Inputs a [2, 3] and b [3]; w is an initializer also listed as a graph input."""
    graph = oh.make_graph(
        [oh.make_node("Add", ["a", "b"], ["c"]), oh.make_node("Mul", ["c", "w"], ["y"])], "g",
        [oh.make_tensor_value_info("a", F32, [2, 3]), oh.make_tensor_value_info("b", F32, [3]),
         oh.make_tensor_value_info("w", F32, [3])],
        [oh.make_tensor_value_info("y", F32, [2, 3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "w")],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    return path


def test_read_batches_without_data_generates_one_batch(tmp_path: Path) -> None:
    notes: list[str] = []
    [batch] = read_batches(None, _two_input_model(tmp_path), 4, notes)
    assert {k: v.shape for k, v in batch.items()} == {"a": (2, 3), "b": (3,)}
    assert len(notes) == 1 and "generated" in notes[0]


def test_read_batches_takes_at_most_max_batches(tmp_path: Path) -> None:
    feeds = [{"a": np.full((2, 3), i, np.float32), "b": np.zeros(3, np.float32)} for i in range(5)]
    notes: list[str] = []
    batches = read_batches(feeds, _two_input_model(tmp_path), 2, notes)
    assert [float(b["a"][0, 0]) for b in batches] == [0.0, 1.0]
    assert notes == []


def test_read_batches_rejects_missing_input_and_empty_data(tmp_path: Path) -> None:
    """The initializer w needs no data; a runtime input does."""
    path = _two_input_model(tmp_path)
    with pytest.raises(InputError, match="no data for model input 'b'"):
        read_batches({"a": np.zeros((2, 3), np.float32), "w": np.zeros(3, np.float32)}, path, 4, [])
    with pytest.raises(InputError, match="holds no batches"):
        read_batches([], path, 4, [])


# -- results ------------------------------------------------------------------------------------


def _result(**overrides: object) -> TuneResult:
    converted = _convert()
    fields: dict[str, object] = {
        "met": True,
        "target": LowPrecision.FLOAT16,
        "tolerance": Tolerance(atol=0.01),
        "plan": converted.plan,
        "model": converted.model,
        "output_path": None,
        "fp32_nodes": ("mm",),
        "outputs": (
            OutputMetrics("s", 0.001, 0.0005, 0.999999, None, 0, passed=True),
            OutputMetrics("idx", 0.0, 0.0, 1.0, 0.5, 0, passed=False),
            OutputMetrics("z", math.inf, math.inf, 0.5, None, 2, passed=False, checked=False),
        ),
        "evaluations": 3,
        "max_evaluations": 5,
        "candidates": 3,
        "contributions": (("mm", "MatMul", 0.25), ("relu", "Relu", 0.001), ("am", "ArgMax", math.nan)),
        "fp32_share_nodes": 0.5,
        "fp32_share_flops": None,
        "default_fp32_share_nodes": 0.25,
        "default_fp32_share_flops": 0.1,
        "history": (Evaluation(0, False, 0.1), Evaluation(3, True, 0.2), Evaluation(1, True, 0.3, "slow")),
        "notes": ("calibration skipped: x",),
        "seconds": 1.5,
    }
    fields.update(overrides)
    return TuneResult(**fields)  # type: ignore[arg-type]


def test_format_text() -> None:
    """Verdict, shares (no FLOPs part when unknown), kept nodes, top contributions, outputs
    with their status, notes."""
    lines = _result().format_text(top=2).splitlines()
    assert lines[0] == (
        "tolerance (atol=0.01, rtol=0) met with 1 of 3 candidate node(s) kept FP32; "
        "3 evaluation(s) (bound 5)"
    )
    assert lines[1] == "FP32 share: 50.0% of nodes (default plan: 25.0%, 10.0%)"
    assert lines[2] == "kept FP32: mm"
    assert lines[3] == "largest own errors (normalised):"
    assert lines[4].split() == ["0.25", "MatMul", "mm"]
    assert lines[5].split() == ["0.001", "Relu", "relu"]
    assert lines[6] == "outputs:"  # only the top 2 contributions
    assert lines[7].endswith(": ok") and lines[7].startswith("  s: max abs 0.001")
    assert lines[8] == "  idx: max abs 0, max rel 0, cosine 1.000000, top-1 agreement 0.5000: FAILS"
    assert lines[9].endswith(": not checked")
    assert lines[10] == "note: calibration skipped: x"
    assert len(lines) == 11


def test_format_text_not_met_metric_and_truncated_fp32_list() -> None:
    text = _result(met=False, tolerance=None, fp32_nodes=("a", "b", "c"), fp32_share_flops=0.125).format_text(top=2)
    lines = text.splitlines()
    assert lines[0].startswith("tolerance (metric) NOT met with 3 of 3")
    assert lines[1] == "FP32 share: 50.0% of nodes, 12.5% of FLOPs (default plan: 25.0%, 10.0%)"
    assert lines[2] == "kept FP32: a, b ..."


def test_to_dict_is_json_with_nonfinite_as_strings() -> None:
    result = _result()
    data = json.loads(json.dumps(result.to_dict()))
    assert data["met"] is True and data["target"] == "float16"
    assert data["tolerance"] == "atol=0.01, rtol=0"
    assert data["contributions"][2] == ["am", "ArgMax", "nan"]
    assert data["outputs"][2]["max_abs_error"] == "inf" and data["outputs"][2]["checked"] is False
    assert data["history"][2] == {"fp32_candidates": 1, "met": True, "seconds": 0.3, "note": "slow"}
    assert data["fp32_share_flops"] is None and data["estimated_speedup"] is None
    assert data["plan"]["target"] == "float16"
    assert set(data["plan"]["nodes"]) == {"mm", "relu", "am", "rs"}
    assert data["notes"] == ["calibration skipped: x"] and data["seconds"] == 1.5


def test_flops_are_counted_where_value_info_names_the_batch_dimensions() -> None:
    """Exporters write value_info with symbolic dims ("batch_size", "sequence_length"); after an
    op shape inference does not know (a runtime's own op) it keeps them, so the data's sizes are
    given to every value of those names."""
    from onnx import TensorProto, helper, numpy_helper

    from mixprec.policy.costs import runtime_cost
    from mixprec.tune.flops import node_costs

    dims = ["batch_size", "sequence_length", 16]
    graph = helper.make_graph(
        [helper.make_node("Act", ["x"], ["h"], name="act", domain="example.ops"),
         helper.make_node("MatMul", ["h", "w"], ["y"], name="proj")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", "sequence_length", 8])],
        [numpy_helper.from_array(np.ones((16, 8), np.float32), "w")],
        value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT, dims)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.ops", 1)])
    costs = node_costs(model, {"x": np.zeros((2, 5, 16), np.float32)}, runtime_cost("ort-cuda"))
    assert costs.flops["proj"] == 2 * 2 * 5 * 16 * 8
    assert model.graph.value_info[0].type.tensor_type.shape.dim[0].dim_param == "batch_size"  # a copy was changed
