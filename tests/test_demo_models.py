"""Tests for the demo model builders in :mod:`mixprec.demo_models`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mixprec.demo_models import DEMO_MODELS, small_cnn, transformer_block
from mixprec.errors import InputError


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run_transformer(sess: ort.InferenceSession, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    (logits,) = sess.run(["logits"], {"input_ids": ids, "attention_mask": mask})
    return logits


@pytest.mark.parametrize("name", sorted(DEMO_MODELS))
def test_demo_model_passes_full_checker(name: str) -> None:
    model = DEMO_MODELS[name]()
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 17
    for init in model.graph.initializer:
        if init.data_type in (
            onnx.TensorProto.FLOAT16,
            onnx.TensorProto.BFLOAT16,
            onnx.TensorProto.DOUBLE,
        ):
            pytest.fail(f"unexpected non-fp32 float initializer {init.name}")


@pytest.mark.parametrize("name", sorted(DEMO_MODELS))
def test_demo_model_is_deterministic(name: str) -> None:
    assert DEMO_MODELS[name]().SerializeToString() == DEMO_MODELS[name]().SerializeToString()


@pytest.mark.parametrize("seq_len", [None, 12])
def test_transformer_runs_with_finite_outputs(seq_len: int | None) -> None:
    model = transformer_block(seq_len=seq_len, d_model=64, n_heads=4, seed=1)
    onnx.checker.check_model(model, full_check=True)
    rng = np.random.default_rng(0)
    batch, seq = 3, 12
    ids = rng.integers(0, 256, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    mask[1, 8:] = 0  # Right padding in one sequence.
    logits = _run_transformer(_session(model), ids, mask)
    assert logits.shape == (batch, seq, 256)
    assert logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert float(np.std(logits)) > 1e-3


def test_transformer_dynamic_seq_accepts_other_lengths() -> None:
    sess = _session(transformer_block())
    for seq in (1, 5, 33):
        ids = np.arange(seq, dtype=np.int64)[None, :] % 256
        logits = _run_transformer(sess, ids, np.ones_like(ids))
        assert logits.shape == (1, seq, 256)
        assert np.isfinite(logits).all()


def test_transformer_attention_mask_is_wired() -> None:
    sess = _session(transformer_block())
    ids = np.array([[5, 17, 42, 99, 7, 3]], dtype=np.int64)
    full = np.ones_like(ids)
    masked = full.copy()
    masked[0, 3] = 0
    out_full = _run_transformer(sess, ids, full)
    out_masked = _run_transformer(sess, ids, masked)
    # Token 0 attends to token 3 only when it is not masked.
    assert not np.allclose(out_full[0, 0], out_masked[0, 0], atol=1e-4)
    # Masking token 3 is the same as replacing it: token 3's content no longer matters.
    replaced = ids.copy()
    replaced[0, 3] = 200
    out_replaced = _run_transformer(sess, replaced, masked)
    np.testing.assert_allclose(out_masked[0, 0], out_replaced[0, 0], rtol=1e-5, atol=1e-5)


def test_transformer_mask_uses_finfo_min() -> None:
    model = transformer_block()
    values = [onnx.numpy_helper.to_array(t) for t in model.graph.initializer if not t.dims]
    assert any(v.dtype == np.float32 and v == np.finfo(np.float32).min for v in values)
    ops = {n.op_type for n in model.graph.node}
    assert {
        "Erf",
        "LayerNormalization",
        "Softmax",
        "Shape",
        "Concat",
        "Reshape",
        "Transpose",
    } <= ops
    ln_eps = [
        a.f
        for n in model.graph.node
        if n.op_type == "LayerNormalization"
        for a in n.attribute
        if a.name == "epsilon"
    ]
    assert ln_eps and all(e == pytest.approx(1e-12) for e in ln_eps)


def test_transformer_below_opset_17_decomposes_layer_norm() -> None:
    model = transformer_block(opset=13)
    onnx.checker.check_model(model, full_check=True)
    assert "LayerNormalization" not in {n.op_type for n in model.graph.node}
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    ref = _run_transformer(_session(transformer_block()), ids, np.ones_like(ids))
    got = _run_transformer(_session(model), ids, np.ones_like(ids))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_cnn_runs_with_finite_outputs() -> None:
    model = small_cnn(seed=3)
    onnx.checker.check_model(model, full_check=True)
    sess = _session(model)
    image = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    logits, probs = sess.run(["logits", "probs"], {"image": image})
    assert logits.shape == (4, 10) and probs.shape == (4, 10)
    assert np.isfinite(logits).all() and np.isfinite(probs).all()
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)


def test_cnn_has_unfused_bn_with_huge_variance() -> None:
    model = small_cnn()
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("BatchNormalization") == 2 and "Resize" in ops
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    var = inits["block1.bn.running_var"]
    assert var.max() == pytest.approx(1e8)
    assert np.sort(var)[-2] < 10.0  # The other channels are realistic.


def test_invalid_arguments_raise_input_error() -> None:
    with pytest.raises(InputError):
        transformer_block(d_model=30, n_heads=4)
    with pytest.raises(InputError):
        small_cnn(opset=9)


# --- bench/ scripts (smoke tests on the smallest configurations) -------------------------------

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load_bench_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here.
    spec.loader.exec_module(module)
    return module


def test_bench_tiny_llama_loads_in_onnxruntime(tmp_path: Path) -> None:
    make_models = _load_bench_module("make_models")
    cfg = make_models.LLAMA_PRESETS["tiny"]
    path = make_models.make_llama(cfg, tmp_path, "llama_tiny", seed=0, chunk_mb=1)
    data = tmp_path / "llama_tiny.onnx.data"
    assert data.stat().st_size >= cfg.num_params() * 4
    proto = onnx.load(str(path), load_external_data=False)
    assert all(
        t.data_location == onnx.TensorProto.EXTERNAL
        for t in proto.graph.initializer
        if len(t.dims) >= 1 and t.name.startswith(("model.", "lm_head"))
    )
    onnx.checker.check_model(str(path), full_check=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.array([[1, 5, 9, 2]], dtype=np.int64)
    (logits,) = sess.run(None, {"input_ids": ids})
    assert logits.shape == (1, 4, cfg.vocab) and np.isfinite(logits).all()
    # Causal mask: earlier positions do not see a later token.
    (other,) = sess.run(None, {"input_ids": np.array([[1, 5, 9, 7]], dtype=np.int64)})
    np.testing.assert_allclose(logits[0, :3], other[0, :3], rtol=1e-5, atol=1e-6)
    assert not np.allclose(logits[0, 3], other[0, 3])


def test_bench_wide_graph_has_requested_size(tmp_path: Path) -> None:
    make_models = _load_bench_module("make_models")
    path = make_models.make_wide(500, tmp_path, seed=0)
    model = onnx.load(str(path))
    assert abs(len(model.graph.node) - 500) <= 20
    onnx.checker.check_model(model, full_check=True)
    (y,) = _session(model).run(None, {"x": np.ones((2, 8, 16), np.float32)})
    assert y.shape == (2, 8, 16) and np.isfinite(y).all()


@pytest.mark.slow  # runs the benchmark script's child processes
def test_bench_convert_reports_rows_without_crashing(tmp_path: Path) -> None:
    make_models = _load_bench_module("make_models")
    model = make_models.make_wide(60, tmp_path, seed=0)
    out_json = tmp_path / "results.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench_convert.py"),
            str(model),
            "--tools",
            "floor,mixprec",
            "--timeout",
            "120",
            "--json",
            str(out_json),
            "--tmp",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out_json.read_text())["models"][0]["results"]
    assert [r["tool"] for r in results] == ["floor", "mixprec"]
    assert results[0]["status"] == "ok" and results[0]["peak_rss_mib"] > 0
    assert results[1]["status"] == "ok", results[1].get("error")
    assert results[1]["peak_rss_mib"] > 0 and results[1]["extra"]["steps"]["cpu_seconds"]["total"] > 0
    assert not [
        p for p in tmp_path.iterdir() if p.name.startswith("mixprec_bench_")
    ]  # Temp dir removed.
