"""The corpus's task rules (bench/corpus.py) judge what their packages would: a decision that
flips is a disagreement, one within the margin of its threshold is not; a word matched to
another table cell is a disagreement, a box that moves within its cell is not. These run on
made-up model outputs, without the corpus."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import corpus  # noqa: E402


def _maps(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"note": rng.uniform(0, 1, (2, 172, 88)), "onset": rng.uniform(0, 1, (2, 172, 88))}


def test_note_decisions_agree_only_where_no_clear_cell_flips() -> None:
    ref = _maps()
    assert corpus._pitch_agree(ref, {k: v.copy() for k, v in ref.items()})[0]

    near = {k: v.copy() for k, v in ref.items()}
    near["note"][0, 0, 0], ref["note"][0, 0, 0] = 0.31, 0.29  # within 0.02 of the frame threshold
    assert corpus._pitch_agree(ref, near)[0]

    flipped = {k: v.copy() for k, v in ref.items()}
    flipped["onset"][1, 5, 7], ref["onset"][1, 5, 7] = 0.2, 0.9  # a clear onset lost
    ok, detail = corpus._pitch_agree(ref, flipped)
    assert not ok and "onset: 1/" in detail


def test_note_frames_and_onsets_have_the_package_thresholds() -> None:
    """0.4 against 0.2 crosses the frame threshold (0.3), not the onset threshold (0.5)."""
    ref = {"note": np.full((1, 4, 88), 0.05), "onset": np.full((1, 4, 88), 0.05)}
    for key, agrees in (("note", False), ("onset", True)):
        moved = {k: v.copy() for k, v in ref.items()}
        before = {k: v.copy() for k, v in ref.items()}
        before[key][0, 1, 2], moved[key][0, 1, 2] = 0.4, 0.2
        assert corpus._pitch_agree(before, moved)[0] is agrees, key


def _table_run(boxes: np.ndarray, tokens: list[int]):
    """A runner giving SLANet's two outputs for the structure `tokens` (then "eos") and `boxes`."""
    steps = 501
    probs = np.full((1, steps, 30), 1e-3, np.float32)
    for k, t in enumerate([*tokens, 29]):
        probs[0, k, t] = 1.0
    out_boxes = np.zeros((1, steps, 4), np.float32)
    out_boxes[0, : len(boxes)] = boxes

    def run(feeds):
        assert set(feeds) == {"x"}  # the word boxes are the matcher's, not the model's
        return {"p2o.fill_constant_15.tmp_0.1": out_boxes, "softmax_1.tmp_0": probs}

    return run


# Two rows of two cells ("<tr>" = 2, "</tr>" = 4; cells "<td></td>" = 28, and "<td" = 8, which
# "colspan" and ">" follow), boxes as fractions of a 200 x 100 image; each word inside a cell, in
# pixels.
_TOKENS = [2, 28, 8, 14, 11, 4, 2, 28, 28, 4]
_CELLS = np.array([[0, 0, 0, 0], [0.1, 0.1, 0.4, 0.4], [0.4, 0.1, 0.7, 0.4], [0, 0, 0, 0], [0, 0, 0, 0],
                   [0, 0, 0, 0], [0, 0, 0, 0], [0.1, 0.4, 0.4, 0.7], [0.4, 0.4, 0.7, 0.7], [0, 0, 0, 0]])
_SIZE = np.array([200.0, 100.0, 200.0, 100.0])
_WORDS = np.array([[24, 15, 40, 30], [90, 15, 100, 30], [24, 45, 40, 60], [90, 45, 120, 60]], np.float64)


def _sample() -> dict[str, np.ndarray]:
    return {"x": np.zeros((1, 3, 488, 488), np.float32), "words": _WORDS, "size": _SIZE}


def test_table_words_are_matched_to_the_cells_the_structure_opens() -> None:
    tokens, cells, matched = corpus._table_decode(_table_run(_CELLS, _TOKENS), _sample())
    assert tokens == [*_TOKENS, 29]  # cut after the end token
    assert len(cells) == 4 and matched == [0, 1, 2, 3]
    assert np.allclose(cells[0], [20, 10, 80, 40])  # pixels: x by the width, y by the height


@pytest.mark.parametrize(
    ("shift", "agree"),
    [(0.01, True), (0.3, False)],  # 2 pixels within the cell; a whole cell to the right
)
def test_table_agreement_is_the_cell_each_word_lands_in(shift: float, agree: bool) -> None:
    ref = corpus._table_decode(_table_run(_CELLS, _TOKENS), _sample())
    moved = _CELLS.copy()
    moved[1, [0, 2]] += shift  # the first cell of the first row moves right
    got = corpus._table_decode(_table_run(moved, _TOKENS), _sample())
    ok, detail = corpus._table_agree(ref, got)
    assert ok is agree, detail


def test_a_different_table_structure_disagrees() -> None:
    ref = corpus._table_decode(_table_run(_CELLS, _TOKENS), _sample())
    got = corpus._table_decode(_table_run(_CELLS, [*_TOKENS[:5], 4]), _sample())
    ok, detail = corpus._table_agree(ref, got)
    assert not ok and "structure differs from token 6" in detail


def test_speech_features_agree_within_a_share_of_their_spread_and_never_lose_finiteness() -> None:
    """Log-mel features: an error of 1% of their standard deviation agrees, 5% does not, and a
    -inf where the FP32 features are finite (a silent frame's log(0)) never does."""
    ref = np.random.default_rng(0).normal(-8.0, 4.0, size=(2, 64, 100))
    spread = ref.std()
    assert corpus._features_agree([ref], [ref + 0.01 * spread])[0]
    ok, detail = corpus._features_agree([ref], [ref + 0.05 * spread])
    assert not ok and "5.00% of the features' standard deviation" in detail
    silent = ref.copy()
    silent[0, :, :10] = -np.inf
    ok, detail = corpus._features_agree([ref], [silent])
    assert not ok and "640 non-finite" in detail
    # Samples: 0.3 s of digital silence first, and a shorter second row padded with zeros.
    samples = corpus._asr_samples()
    assert len(samples) == 2
    for sample in samples:
        waves, lens = sample["waveforms"], sample["waveforms_lens"]
        assert waves.dtype == np.float32 and np.abs(waves).max() <= 1.0 and lens[1] < waves.shape[1]
        assert not waves[:, :4800].any() and not waves[1, lens[1]:].any() and waves[:, 4800:lens[1]].any()
