"""Per-output numeric comparison of a candidate run against a reference run.

Floating-point outputs (any width, including float16, bfloat16 and float8) are
upcast to float64 (complex to complex128) and compared numerically. Integer, bool
and string outputs are compared exactly: for them ``within()`` ignores the
tolerances, and the error fields describe the element-wise mismatches (integers and
bools by their numeric difference, strings by a 0/1 mismatch indicator).

Error statistics are computed over the positions where both reference and
candidate are finite. Positions where the candidate is non-finite but the
reference is finite are counted in ``new_nonfinite``; positions where the reference
is non-finite must hold the same non-finite value in the candidate (NaN matches
NaN, +inf matches +inf), otherwise they count in ``nonfinite_mismatches``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from mixprec.dtypes import is_float_dtype
from mixprec.errors import RunError

logger = logging.getLogger(__name__)

_TINY = float(np.finfo(np.float64).tiny)

# Upper-left convex hull of the points (|reference|, |error|): see OutputComparison.
Envelope = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class OutputComparison:
    """Comparison of one output (possibly merged over several batches).

    Attributes:
        name: Output name.
        shape: Reference shape (after merging batches of different shapes, differing
            dimensions are ``None``).
        candidate_shape: Candidate shape, same convention.
        reference_dtype: Reference dtype name.
        candidate_dtype: Candidate dtype name.
        num_elements: Number of reference elements.
        num_finite: Number of positions finite on both sides (the error statistics'
            population).
        max_abs_error: Max ``|c - r|`` over positions where both are finite.
        max_rel_error: Max ``|c - r| / max(|r|, tiny)`` over the same positions
            (``tiny`` is the smallest normal float64).
        mean_abs_error: Mean ``|c - r|`` over the same positions.
        cosine: Cosine similarity of the finite positions; 1.0 when identical
            (including all zeros), 0.0 when exactly one side is all zeros. After a
            merge, the lowest per-batch value. NaN for unequal string outputs.
        nan_count: NaNs in the candidate.
        inf_count: Infinities in the candidate.
        new_nonfinite: Elements non-finite in the candidate but finite in the reference.
        nonfinite_mismatches: Elements non-finite in the reference whose candidate
            value is not the same non-finite value.
        mismatches: Elements that differ at all (NaN equals NaN).
        exact: Whether the output is compared exactly (not floating point).
        shapes_match: Whether reference and candidate shapes were equal in every batch.
        envelope: Internal. Upper-left convex hull of the points
            ``(|r|, |c - r|)``; it decides the allclose rule exactly for any
            ``atol``/``rtol`` and merges across batches.
        reference_absmax: Max ``|r|`` over the compared positions (the output's scale).
    """

    name: str
    shape: tuple[int | None, ...]
    candidate_shape: tuple[int | None, ...]
    reference_dtype: str
    candidate_dtype: str
    num_elements: int
    num_finite: int
    max_abs_error: float
    max_rel_error: float
    mean_abs_error: float
    cosine: float
    nan_count: int
    inf_count: int
    new_nonfinite: int
    nonfinite_mismatches: int
    mismatches: int
    exact: bool
    shapes_match: bool
    envelope: Envelope = field(default=(), repr=False, compare=False)
    reference_absmax: float = 0.0

    @property
    def scaled_error(self) -> float:
        """``max |c - r| / max |r|``: the error relative to the output's own scale (unlike
        ``max_rel_error``, not blown up by reference values near zero)."""
        if self.reference_absmax > 0:
            return self.max_abs_error / self.reference_absmax
        return 0.0 if self.max_abs_error == 0 else math.inf

    def within(self, atol: float, rtol: float) -> bool:
        """Whether every element satisfies ``|c - r| <= atol + rtol * |r|``.

        This is the ``numpy.allclose(c, r, rtol, atol, equal_nan=True)`` rule, with
        infinities required to match exactly. Exactly compared outputs (int, bool,
        string) must be equal regardless of the tolerances. Always false when the
        shapes differ.

        Args:
            atol: Absolute tolerance.
            rtol: Relative tolerance (relative to the reference).

        Returns:
            True when all elements are within tolerance.
        """
        if not self.shapes_match or self.new_nonfinite or self.nonfinite_mismatches:
            return False
        if self.exact:
            return self.mismatches == 0
        return all(err <= atol + rtol * ref for ref, err in self.envelope)

    def merge(self, other: OutputComparison) -> OutputComparison:
        """Combine with the comparison of the same output on another batch.

        Args:
            other: Comparison of the same output name.

        Returns:
            A comparison covering both batches: maxima of maxima, sums of counts,
            mean weighted by ``num_finite``, lowest cosine.

        Raises:
            RunError: The names differ.
        """
        if other.name != self.name:
            raise RunError(f"cannot merge comparisons of {self.name!r} and {other.name!r}")
        finite = self.num_finite + other.num_finite
        mean = (
            (self.mean_abs_error * self.num_finite + other.mean_abs_error * other.num_finite)
            / finite
            if finite
            else 0.0
        )
        return replace(
            self,
            shape=_merge_shapes(self.shape, other.shape),
            candidate_shape=_merge_shapes(self.candidate_shape, other.candidate_shape),
            num_elements=self.num_elements + other.num_elements,
            num_finite=finite,
            max_abs_error=max(self.max_abs_error, other.max_abs_error),
            max_rel_error=max(self.max_rel_error, other.max_rel_error),
            mean_abs_error=mean,
            cosine=_min_nan(self.cosine, other.cosine),
            nan_count=self.nan_count + other.nan_count,
            inf_count=self.inf_count + other.inf_count,
            new_nonfinite=self.new_nonfinite + other.new_nonfinite,
            nonfinite_mismatches=self.nonfinite_mismatches + other.nonfinite_mismatches,
            mismatches=self.mismatches + other.mismatches,
            exact=self.exact or other.exact,
            shapes_match=self.shapes_match and other.shapes_match,
            envelope=_envelope_of_points(self.envelope + other.envelope),
            reference_absmax=max(self.reference_absmax, other.reference_absmax),
        )


def compare_outputs(
    reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]
) -> list[OutputComparison]:
    """Compare every reference output with the candidate output of the same name.

    Args:
        reference: Reference outputs by name (usually the FP32 model's).
        candidate: Candidate outputs by name; extra names are ignored.

    Returns:
        One comparison per reference output, in the reference's order.

    Raises:
        RunError: A reference output is missing from the candidate.
    """
    results: list[OutputComparison] = []
    for name, ref in reference.items():
        if name not in candidate:
            raise RunError(
                f"output {name!r} is missing from the candidate outputs "
                f"(candidate has: {', '.join(sorted(candidate)) or 'nothing'})"
            )
        results.append(compare_arrays(name, np.asarray(ref), np.asarray(candidate[name])))
    return results


def compare_arrays(name: str, reference: np.ndarray, candidate: np.ndarray) -> OutputComparison:
    """Compare one reference array with one candidate array.

    Args:
        name: Output name for the result.
        reference: Reference values.
        candidate: Candidate values.

    Returns:
        The comparison.
    """
    numeric = _is_inexact(reference.dtype) or _is_inexact(candidate.dtype)
    cand_nan, cand_inf = _nonfinite_counts(candidate) if numeric else (0, 0)
    base = {
        "name": name,
        "shape": tuple(reference.shape),
        "candidate_shape": tuple(candidate.shape),
        "reference_dtype": str(reference.dtype),
        "candidate_dtype": str(candidate.dtype),
        "num_elements": int(reference.size),
        "nan_count": cand_nan,
        "inf_count": cand_inf,
        "exact": not numeric,
    }
    if reference.shape != candidate.shape:
        return OutputComparison(
            **base,
            max_abs_error=math.inf,
            max_rel_error=math.inf,
            mean_abs_error=math.inf,
            num_finite=0,
            cosine=math.nan,
            new_nonfinite=0,
            nonfinite_mismatches=0,
            mismatches=int(max(reference.size, candidate.size)),
            shapes_match=False,
        )
    if numeric:
        return _compare_numeric(base, reference, candidate)
    return _compare_exact(base, reference, candidate)


def _compare_numeric(base: dict, reference: np.ndarray, candidate: np.ndarray) -> OutputComparison:
    is_complex = np.iscomplexobj(reference) or np.iscomplexobj(candidate)
    wide = np.complex128 if is_complex else np.float64
    ref = reference.astype(wide).ravel()
    cand = candidate.astype(wide).ravel()

    ref_finite = np.isfinite(ref)
    cand_finite = np.isfinite(cand)
    both = ref_finite & cand_finite
    new_nonfinite = int(np.count_nonzero(ref_finite & ~cand_finite))
    ref_bad = ~ref_finite
    if ref_bad.any():
        r_bad, c_bad = ref[ref_bad], cand[ref_bad]
        same = (r_bad == c_bad) | (np.isnan(r_bad) & np.isnan(c_bad))
        nonfinite_mismatches = int(np.count_nonzero(~same))
    else:
        nonfinite_mismatches = 0

    r, c = ref[both], cand[both]
    err = np.abs(c - r)
    mag = np.abs(r)
    if err.size:
        max_abs = float(err.max())
        with np.errstate(over="ignore"):  # an error beside a zero reference: infinitely relative
            max_rel = float((err / np.maximum(mag, _TINY)).max())
        mean_abs = float(err.mean())
    else:
        max_abs = max_rel = mean_abs = 0.0
    mismatches = int(np.count_nonzero(err != 0)) + new_nonfinite + nonfinite_mismatches
    return OutputComparison(
        **base,
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        mean_abs_error=mean_abs,
        num_finite=int(err.size),
        cosine=_cosine(r, c),
        new_nonfinite=new_nonfinite,
        nonfinite_mismatches=nonfinite_mismatches,
        mismatches=mismatches,
        shapes_match=True,
        envelope=_envelope(mag, err),
        reference_absmax=float(mag.max()) if mag.size else 0.0,
    )


def _compare_exact(base: dict, reference: np.ndarray, candidate: np.ndarray) -> OutputComparison:
    ref = reference.ravel()
    cand = candidate.ravel()
    if ref.dtype.kind in "biu" and cand.dtype.kind in "biu":
        # Python-int-free exact difference: int64 range is enough for ONNX int outputs
        # except extreme uint64 values, which float64 still orders correctly.
        r = ref.astype(np.float64) if ref.dtype.kind == "u" else ref.astype(np.int64)
        c = cand.astype(np.float64) if cand.dtype.kind == "u" else cand.astype(np.int64)
        diff = np.abs((c - r).astype(np.float64))
        mismatches = int(np.count_nonzero(ref != cand))
        rf, cf = r.astype(np.float64), c.astype(np.float64)
        cosine = _cosine(rf, cf)
    else:
        unequal = ref != cand
        diff = np.asarray(unequal, dtype=np.float64)
        mismatches = int(np.count_nonzero(unequal))
        rf = np.ones_like(diff)
        cosine = 1.0 if mismatches == 0 else math.nan
    if diff.size:
        max_abs = float(diff.max())
        max_rel = float((diff / np.maximum(np.abs(rf), _TINY)).max())
        mean_abs = float(diff.mean())
    else:
        max_abs = max_rel = mean_abs = 0.0
    return OutputComparison(
        **base,
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        mean_abs_error=mean_abs,
        num_finite=int(diff.size),
        cosine=cosine,
        new_nonfinite=0,
        nonfinite_mismatches=0,
        mismatches=mismatches,
        shapes_match=True,
        reference_absmax=float(np.abs(rf).max()) if rf.size else 0.0,
    )


def _is_inexact(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.complexfloating) or is_float_dtype(dtype)


def nonfinite_count(array: np.ndarray) -> int:
    """NaN and infinite elements of a float or complex array (0 for other types)."""
    if not _is_inexact(array.dtype):
        return 0
    nan, inf = _nonfinite_counts(array)
    return nan + inf


def _nonfinite_counts(array: np.ndarray) -> tuple[int, int]:
    wide = array.astype(np.complex128 if np.iscomplexobj(array) else np.float64)
    return int(np.count_nonzero(np.isnan(wide))), int(np.count_nonzero(np.isinf(wide)))


def _cosine(r: np.ndarray, c: np.ndarray) -> float:
    if np.array_equal(r, c):
        return 1.0  # exactly, not up to the rounding of the norms
    norm_r = float(np.linalg.norm(r))
    norm_c = float(np.linalg.norm(c))
    if norm_r == 0.0 and norm_c == 0.0:
        return 1.0
    if norm_r == 0.0 or norm_c == 0.0:
        return 0.0
    dot = np.vdot(r, c)
    cos = float(np.real(dot)) / (norm_r * norm_c)
    return float(min(1.0, max(-1.0, cos)))


def _envelope(mag: np.ndarray, err: np.ndarray) -> Envelope:
    """Upper-left convex hull of the points ``(mag_i, err_i)``.

    ``max_i(err_i - rtol * mag_i)`` is attained on this hull for every ``rtol >= 0``,
    so the hull decides ``all(err_i <= atol + rtol * mag_i)`` exactly. It usually has
    a handful of vertices. Computed by quickhull on the points that can matter.
    """
    if err.size == 0:
        return ()
    # Endpoints: max error (smallest magnitude among ties) and smallest magnitude
    # (largest error among ties).
    e_max = err.max()
    top = np.flatnonzero(err == e_max)
    right = (float(mag[top].min()), float(e_max))
    m_min = mag.min()
    low = np.flatnonzero(mag == m_min)
    left = (float(m_min), float(err[low].max()))
    if left == right:
        return (left,)
    # Only points left of `right` and above `left`'s error can be hull vertices.
    keep = (mag < right[0]) & (err > left[1])
    chain = _quickhull(mag[keep], err[keep], left, right)
    return (left, *chain, right)


def _quickhull(
    x: np.ndarray, y: np.ndarray, a: tuple[float, float], b: tuple[float, float]
) -> list[tuple[float, float]]:
    """Upper-hull vertices strictly above the segment ``a``-``b``, ordered by x."""
    chain: list[tuple[float, float]] = []
    # Explicit stack (no recursion limit): a task is a vertex to emit or a segment
    # with its candidate points; segments are pushed right-first so output is ordered.
    stack: list[object] = [(x, y, a, b)]
    while stack:
        task = stack.pop()
        if len(task) == 2:  # type: ignore[arg-type]
            chain.append(task)  # type: ignore[arg-type]
            continue
        px, py, pa, pb = task  # type: ignore[misc]
        if px.size == 0:
            continue
        # Twice the signed triangle area: positive when the point is above pa->pb.
        dist = (pb[0] - pa[0]) * (py - pa[1]) - (pb[1] - pa[1]) * (px - pa[0])
        above = dist > 0
        if not above.any():
            continue
        px, py, dist = px[above], py[above], dist[above]
        i = int(np.argmax(dist))
        pc = (float(px[i]), float(py[i]))
        stack.append((px, py, pc, pb))
        stack.append(pc)
        stack.append((px, py, pa, pc))
    return chain


def _envelope_of_points(points: Iterable[tuple[float, float]]) -> Envelope:
    pts = list(points)
    if not pts:
        return ()
    arr = np.asarray(pts, dtype=np.float64)
    return _envelope(arr[:, 0], arr[:, 1])


def _merge_shapes(a: tuple[int | None, ...], b: tuple[int | None, ...]) -> tuple[int | None, ...]:
    if a == b:
        return a
    if len(a) != len(b):
        return ()
    return tuple(x if x == y else None for x, y in zip(a, b))


def _min_nan(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return min(a, b)


def merge(a: Sequence[OutputComparison], b: Sequence[OutputComparison]) -> list[OutputComparison]:
    """Merge two per-output comparison lists (e.g. of two batches) by output name.

    Args:
        a: Comparisons of one batch (or an earlier merge).
        b: Comparisons of another batch.

    Returns:
        Merged comparisons in ``a``'s order; outputs only in ``b`` are appended.
    """
    by_name = {c.name: c for c in a}
    for comp in b:
        by_name[comp.name] = by_name[comp.name].merge(comp) if comp.name in by_name else comp
    return list(by_name.values())


@dataclass
class ComparisonAccumulator:
    """Accumulates per-output comparisons over batches.

    Example:
        >>> acc = ComparisonAccumulator()
        >>> for batch in batches:
        ...     acc.add(compare_outputs(run(ref, batch), run(cand, batch)))
        >>> acc.results
    """

    results: list[OutputComparison] = field(default_factory=list)
    batches: int = 0

    def add(self, comparisons: Sequence[OutputComparison]) -> None:
        """Merge the comparisons of one more batch.

        Args:
            comparisons: Result of :func:`compare_outputs` for the batch.
        """
        self.results = merge(self.results, comparisons)
        self.batches += 1

    def all_within(self, atol: float, rtol: float) -> bool:
        """Whether every output so far is within tolerance (see ``OutputComparison.within``).

        Args:
            atol: Absolute tolerance.
            rtol: Relative tolerance.

        Returns:
            True when all outputs pass (vacuously true with no batches).
        """
        return all(c.within(atol, rtol) for c in self.results)
