"""Tests for mixprec.validate.compare."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from mixprec.errors import ValidationError
from mixprec.validate.compare import (
    ComparisonAccumulator,
    compare_arrays,
    compare_outputs,
    merge,
)


def test_known_errors() -> None:
    ref = np.array([1.0, -2.0, 4.0, 0.0], np.float32)
    cand = np.array([1.5, -2.0, 3.0, 0.25], np.float16)
    (c,) = compare_outputs({"y": ref}, {"y": cand})
    assert c.name == "y" and c.shape == (4,) and c.candidate_dtype == "float16"
    assert c.max_abs_error == 1.0
    assert c.mean_abs_error == pytest.approx((0.5 + 0 + 1 + 0.25) / 4)
    # 0.25 / tiny for the zero reference dominates the relative error.
    assert c.max_rel_error == pytest.approx(0.25 / np.finfo(np.float64).tiny)
    expected_cos = float(ref @ cand.astype(np.float32)) / (
        np.linalg.norm(ref) * np.linalg.norm(cand.astype(np.float32))
    )
    assert c.cosine == pytest.approx(expected_cos)
    assert c.mismatches == 3 and c.nan_count == 0 and c.new_nonfinite == 0
    assert not c.exact and c.shapes_match


@pytest.mark.parametrize("seed", range(5))
def test_within_matches_numpy_allclose(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(500) * 10.0 ** rng.integers(-3, 3, 500)
    cand = (ref + rng.standard_normal(500) * 1e-3 * (1 + np.abs(ref))).astype(np.float32)
    c = compare_arrays("y", ref, cand)
    for atol in (0.0, 1e-5, 1e-4, 1e-3, 1e-2, 1.0):
        for rtol in (0.0, 1e-4, 1e-3, 1e-2, 0.1):
            expected = np.allclose(cand.astype(np.float64), ref, rtol=rtol, atol=atol)
            assert c.within(atol, rtol) == expected, (atol, rtol)
    assert c.within(0.0, 0.0) is False and c.within(10.0, 0.0) is True


def test_nonfinite_handling() -> None:
    ref = np.array([np.nan, np.inf, 1.0, 2.0, -np.inf], np.float64)
    same = np.array([np.nan, np.inf, 1.0, 2.0, -np.inf], np.float32)
    c = compare_arrays("y", ref, same)
    assert (c.nan_count, c.inf_count, c.new_nonfinite, c.nonfinite_mismatches) == (1, 2, 0, 0)
    assert c.max_abs_error == 0.0 and c.cosine == 1.0 and c.within(0.0, 0.0)

    worse = np.array([1.0, -np.inf, np.nan, np.inf, -np.inf], np.float32)
    c = compare_arrays("y", ref, worse)
    assert c.nan_count == 1 and c.inf_count == 3
    assert c.new_nonfinite == 2  # positions 2 and 3
    assert c.nonfinite_mismatches == 2  # nan->1.0, +inf->-inf
    assert c.mismatches == 4
    assert c.max_abs_error == 0.0  # no position is finite on both sides with an error
    assert not c.within(1e9, 1e9)


def test_identical_and_zero_arrays() -> None:
    zeros = np.zeros((2, 3), np.float32)
    c = compare_arrays("z", zeros, zeros.astype(ml_dtypes.bfloat16))
    assert c.cosine == 1.0 and c.max_abs_error == 0.0 and c.max_rel_error == 0.0
    assert c.within(0.0, 0.0)
    c = compare_arrays("z", zeros, np.ones((2, 3), np.float32))
    assert c.cosine == 0.0 and c.max_abs_error == 1.0
    empty = np.zeros((0, 4), np.float32)
    c = compare_arrays("e", empty, empty)
    assert c.within(0.0, 0.0) and c.num_elements == 0 and c.cosine == 1.0


def test_bfloat16_candidate_upcast() -> None:
    ref = np.array([1.0, 3.14159265], np.float32)
    cand = ref.astype(ml_dtypes.bfloat16)
    c = compare_arrays("y", ref, cand)
    assert c.max_abs_error == abs(3.140625 - float(ref[1]))
    assert c.within(0.0, 2.0**-8) and not c.within(0.0, 2.0**-12)


def test_shape_mismatch() -> None:
    c = compare_arrays("y", np.zeros((2, 3)), np.zeros((3, 2)))
    assert not c.shapes_match and c.candidate_shape == (3, 2)
    assert not c.within(math.inf, math.inf)
    assert math.isinf(c.max_abs_error)


def test_exact_outputs() -> None:
    ids = compare_arrays("ids", np.array([1, 5, 7]), np.array([1, 2, 7], np.int32))
    assert ids.exact and ids.mismatches == 1 and ids.max_abs_error == 3.0
    assert not ids.within(10.0, 10.0)  # integers are compared exactly
    assert compare_arrays("ids", np.array([4, 5]), np.array([4, 5])).within(0.0, 0.0)

    mask = compare_arrays("m", np.array([True, False, True]), np.array([True, True, True]))
    assert mask.exact and mask.mismatches == 1 and mask.max_abs_error == 1.0
    assert mask.mean_abs_error == pytest.approx(1 / 3)

    words = np.array(["a", "b"], dtype=object)
    c = compare_arrays("s", words, np.array(["a", "c"], dtype=object))
    assert c.exact and c.mismatches == 1 and not c.within(1.0, 1.0)
    assert math.isnan(c.cosine)
    assert compare_arrays("s", words, words.copy()).within(0.0, 0.0)


def test_missing_output_is_named() -> None:
    with pytest.raises(ValidationError, match="'logits'"):
        compare_outputs({"logits": np.zeros(2)}, {"other": np.zeros(2)})


def test_merge_over_batches_equals_whole() -> None:
    rng = np.random.default_rng(7)
    ref = rng.standard_normal((6, 50))
    cand = ref + rng.standard_normal((6, 50)) * 1e-3 * np.abs(ref)
    cand[2, 7] = np.nan
    acc = ComparisonAccumulator()
    for row in range(6):
        acc.add(
            compare_outputs({"y": ref[row], "n": np.arange(3)}, {"y": cand[row], "n": np.arange(3)})
        )
    merged = {c.name: c for c in acc.results}
    whole = compare_arrays("y", ref, cand)
    y = merged["y"]
    assert acc.batches == 6 and y.num_elements == 300 and y.num_finite == 299
    assert y.max_abs_error == whole.max_abs_error
    assert y.max_rel_error == whole.max_rel_error
    assert y.mean_abs_error == pytest.approx(whole.mean_abs_error, rel=1e-12)
    assert y.nan_count == 1 and y.new_nonfinite == 1
    assert y.cosine <= whole.cosine + 1e-12  # worst batch
    assert y.shape == (50,)
    ok = cand.copy()
    ok[2, 7] = ref[2, 7]
    acc_ok = ComparisonAccumulator()
    for row in range(6):
        acc_ok.add(compare_outputs({"y": ref[row]}, {"y": ok[row]}))
    for atol in (0.0, 1e-5, 1e-3):
        for rtol in (0.0, 1e-4, 1e-3, 2e-3):
            assert acc_ok.all_within(atol, rtol) == np.allclose(ok, ref, rtol=rtol, atol=atol)

    a = compare_outputs({"y": np.zeros(2)}, {"y": np.zeros(2)})
    b = compare_outputs({"y": np.zeros(3)}, {"y": np.ones(3)})
    (m,) = merge(a, b)
    assert m.shape == (None,) and m.max_abs_error == 1.0 and m.mean_abs_error == pytest.approx(0.6)
    with pytest.raises(ValidationError):
        a[0].merge(compare_arrays("z", np.zeros(1), np.zeros(1)))


def test_scaled_error_is_relative_to_the_output_scale() -> None:
    # A reference value near zero makes the elementwise relative error enormous; the error
    # relative to the output's largest magnitude stays meaningful, also across batches.
    ref = {"y": np.array([1e-30, 2.0, -4.0], np.float32)}
    cand = {"y": np.array([1e-3, 2.0, -3.9], np.float32)}
    (c,) = compare_outputs(ref, cand)
    assert c.max_rel_error > 1e20
    assert c.scaled_error == pytest.approx(0.1 / 4.0, rel=1e-5)
    (d,) = compare_outputs({"y": np.array([8.0], np.float32)}, {"y": np.array([8.0], np.float32)})
    assert c.merge(d).scaled_error == pytest.approx(0.1 / 8.0, rel=1e-5)


def _cancelling_model(offset: float) -> "onnx.ModelProto":
    """Two matrix products around h + offset - offset: exact in FP32, but a 16-bit sum with a
    large offset keeps only a few bits of h (catastrophic cancellation that no range check
    sees: every value fits)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"]),
            helper.make_node("Add", ["h", "c"], ["s"]),
            helper.make_node("Sub", ["s", "c"], ["d"]),
            helper.make_node("MatMul", ["d", "w2"], ["y"]),
        ],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])],
        [
            numpy_helper.from_array(np.array(offset, np.float32), "c"),
            numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float32), "w1"),
            numpy_helper.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float32), "w2"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_an_error_beyond_rounding_is_pointed_out_without_a_tolerance(tmp_path, target: str) -> None:  # noqa: ANN001
    """Without a tolerance nothing fails, but an output further from FP32 than rounding explains
    gets a note that says by how much, on which inputs, and what to do; one that only rounds
    gets none."""
    import mixprec

    noisy = mixprec.convert(_cancelling_model(1000.0), tmp_path / "noisy.onnx", target_dtype=target, validate="run")
    notes = [n for n in noisy.report.validation.notes if "more than" in n]
    assert len(notes) == 1 and "output 'y'" in notes[0] and "generated random inputs" in notes[0]
    assert "--data" in notes[0] and "mixprec tune" in notes[0]
    quiet = mixprec.convert(_cancelling_model(0.5), tmp_path / "quiet.onnx", target_dtype=target, validate="run")
    assert quiet.report.validation.outputs and not [n for n in quiet.report.validation.notes if "more than" in n]
