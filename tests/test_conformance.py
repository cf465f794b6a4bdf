"""The ONNX backend node test cases as a conformance suite for the converter.

The full suite (about 1,880 cases, 50 s here) runs with the slow tests; the fast subset runs
every 30th case.
"""

from __future__ import annotations

import pytest

from conformance import run_all, tally

SAMPLE = 30


@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.slow, id="all"), pytest.param(SAMPLE, id="sample")])
def results(request):  # type: ignore[no-untyped-def]
    every = request.param
    return every, run_all(every=every)


def test_every_case_converts_to_a_valid_model_that_matches(results) -> None:  # type: ignore[no-untyped-def]
    every, results = results
    print("\n" + tally(results))
    ran = [r for r in results if r.status == "run"]
    assert len(ran) > 1000 // every, "the onnx package should ship about 1,080 runnable FP32 cases"
    failures = [
        f"{r.name}: fp16={r.fp16} bf16={r.bf16} fp16_io={r.fp16_io} {r.detail}"
        for r in ran
        if r.fp16 != "ok" or r.bf16 != "ok" or r.fp16_io not in ("ok", "lossy-io")
    ]
    assert not failures, "\n".join(failures[:20])


def test_a_large_share_of_cases_really_convert(results) -> None:  # type: ignore[no-untyped-def]
    every, results = results
    ran = [r for r in results if r.status == "run"]
    with_fp32_io = sum(1 for r in ran if r.converted16 > 0)
    with_16bit_io = sum(1 for r in ran if r.converted_io > 0)
    # With FP32 inputs and outputs kept, single elementwise ops stay FP32 (two casts would cost
    # more than they save); compute-heavy ops convert. With 16-bit I/O most cases convert.
    assert with_fp32_io >= 200 // every
    assert with_16bit_io >= 0.75 * len(ran)
