"""Runtime targets: converted models load and run on the runtime they are deployed to.

PyTorch exports (TorchScript exporter: decomposed LayerNorm/RMSNorm, GRUs) and an
onnxruntime-optimized BERT are converted per runtime profile, then loaded the way users load
them: onnxruntime with its default session options, in a child process.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

import torch_models  # tests/ is on sys.path via conftest.py

import mixprec
from mixprec.cli import main
from mixprec.runtime import isolated
from mixprec.runtime.isolated import run_isolated

RNG = np.random.default_rng(0)


def _fp32_outputs(path: Path, feeds: dict) -> dict:
    outcome = run_isolated(path, feeds)
    assert outcome.ok, outcome.error
    return outcome.outputs


def _loads_as_users_load_it(path: Path, feeds: dict, target: str) -> dict | None:
    """Default session options in a child: fp16 must run; bf16 may only lack CPU kernels."""
    outcome = run_isolated(path, feeds)
    if target == "bf16":
        assert outcome.ok or outcome.missing_kernel, outcome.error  # never a type error or a crash
        return outcome.outputs
    assert outcome.ok, outcome.error
    return outcome.outputs


@pytest.fixture(scope="module")
def norm_mlp(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("norm")
    example = torch.randn(2, 5, 32)
    return {
        opset: torch_models.export_torchscript(
            torch_models.NormMLP(), example, folder / f"norm{opset}.onnx", opset, {0: "b", 1: "t"}
        )
        for opset in (14, 17)
    }


@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_decomposed_norms_are_one_block_and_load_with_default_options(norm_mlp, target: str, tmp_path: Path) -> None:
    source = norm_mlp[14]
    out = tmp_path / f"{target}.onnx"
    result = mixprec.convert(source, out, target_dtype=target, opset=14)  # pinned: no upgrade to fuse
    decisions = {n.name: d for n, d in result.plan.decisions.items()}
    block = [name for name, d in decisions.items() if d.category.value == "normalization block"]
    # LayerNorm: 2 ReduceMean, Sub, Pow, Add, Sqrt, Div, Mul, Add; RMSNorm: Pow, ReduceMean, Add,
    # Sqrt, Div, Mul, Mul: every node of each block decided together, FP32.
    assert len(block) == 16, block
    assert {decisions[n].precision.value for n in block} == {"fp32"}
    assert "fusing it into LayerNormalization needs opset 17" in decisions["/ln/Sub"].reason
    assert result.report.low_by_op["MatMul"] == 3
    feeds = {"x": RNG.normal(size=(2, 5, 32)).astype(np.float32)}
    got = _loads_as_users_load_it(out, feeds, target)
    if got is not None:
        np.testing.assert_allclose(got["y"], _fp32_outputs(source, feeds)["y"], atol=2e-2, rtol=2e-2)


def test_decomposed_norms_upgrade_the_opset_to_fuse(norm_mlp, tmp_path: Path) -> None:
    # Not pinned: the model is upgraded to opset 23, where both blocks fuse (the runtime has
    # LayerNormalization and RMSNormalization kernels), instead of staying FP32 with casts.
    out = tmp_path / "auto.onnx"
    result = mixprec.convert(norm_mlp[14], out, target_dtype="fp16")
    assert any("opset upgraded to 23" in n for n in result.report.notes), result.report.notes
    assert result.report.low_by_op.get("LayerNormalization") == 1 and result.report.low_by_op.get("RMSNormalization") == 1
    assert "normalization block" not in result.report.fp32_by_category
    assert result.report.casts_runtime == 2
    feeds = {"x": RNG.normal(size=(2, 5, 32)).astype(np.float32)}
    got = _loads_as_users_load_it(out, feeds, "fp16")
    assert got is not None
    np.testing.assert_allclose(got["y"], _fp32_outputs(norm_mlp[14], feeds)["y"], atol=2e-2, rtol=2e-2)


def test_decomposed_norms_fuse_where_the_opset_allows(norm_mlp, tmp_path: Path) -> None:
    # Upgraded to 23: the LayerNorm fuses into LayerNormalization, the RMSNorm into
    # RMSNormalization, both with FP32 statistics (stash_type=1) and no Cast inside.
    out = tmp_path / "fused.onnx"
    result = mixprec.convert(norm_mlp[14], out, target_dtype="fp16", opset=23, runtime="onnx")
    assert any("fused 2 decomposed normalization(s)" in n for n in result.report.notes)
    model = onnx.load(str(out))
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["LayerNormalization"] == 1 and ops["RMSNormalization"] == 1
    assert not {"ReduceMean", "Sqrt", "Pow"} & set(ops)
    for node in model.graph.node:
        if node.op_type.endswith("Normalization"):
            assert next(a.i for a in node.attribute if a.name == "stash_type") == 1
    assert result.report.nodes_by_precision.get("fp32", 0) == 0
    assert result.report.casts_runtime == 2  # the model's input and output only
    feeds = {"x": RNG.normal(size=(3, 7, 32)).astype(np.float32)}
    np.testing.assert_allclose(
        _fp32_outputs(out, feeds)["y"], _fp32_outputs(norm_mlp[14], feeds)["y"], atol=1e-2, rtol=1e-2
    )


@pytest.fixture(scope="module")
def two_gru(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gru")
    return torch_models.export_torchscript(
        torch_models.TwoGRU(), torch.randn(2, 8, 20), folder / "gru.onnx", 14, {0: "b", 2: "t"}
    )


@pytest.mark.slow  # a bisection over trial conversions, each loaded in the child: seconds
def test_runtime_crash_is_caught_in_the_child_and_repaired(two_gru: Path, tmp_path: Path) -> None:
    feeds = {"x": RNG.normal(size=(2, 8, 20)).astype(np.float32)}
    naive = tmp_path / "naive.onnx"
    mixprec.convert(two_gru, naive, target_dtype="fp16", validate="none")
    crash = run_isolated(naive, feeds)
    if crash.ok:
        pytest.skip("this onnxruntime runs fp16 GRUs without crashing: nothing to repair")
    assert crash.crashed and "SIGSEGV" in crash.error  # the converter itself survived

    out = tmp_path / "repaired.onnx"
    result = mixprec.convert(two_gru, out, target_dtype="fp16")
    kept = {k.name: k for k in result.report.kept_fp32 if k.category == "runtime fails on it"}
    assert kept and all(k.op_type == "GRU" for k in kept.values()), kept
    assert "crashes" in next(iter(kept.values())).reason
    assert result.report.low_by_op.get("Conv") == 1  # the rest still converts
    assert any("trial conversion" in n for n in result.report.notes)
    np.testing.assert_allclose(
        _loads_as_users_load_it(out, feeds, "fp16")["y"], _fp32_outputs(two_gru, feeds)["y"], atol=1e-2, rtol=1e-2
    )


def test_gru_model_converts_to_bf16_without_type_errors(two_gru: Path, tmp_path: Path) -> None:
    out = tmp_path / "bf16.onnx"
    result = mixprec.convert(two_gru, out, target_dtype="bf16")
    assert result.report.low_by_op.get("Conv") == 1  # upgraded to opset 22 on the way
    assert any("opset upgraded from 14 to 22" in n for n in result.report.notes)
    _loads_as_users_load_it(out, {"x": RNG.normal(size=(2, 8, 20)).astype(np.float32)}, "bf16")


def test_repair_search_finds_the_failing_nodes(norm_mlp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search itself, independent of any onnxruntime bug: a runtime that rejects one node
    in 16 bits gets exactly that node kept FP32, with its error as the reason."""
    real = isolated.run_isolated

    def picky_runtime(path, feeds=None, **kwargs):  # type: ignore[no-untyped-def]
        model = onnx.load(str(path), load_external_data=False)
        types = {i.name: i.data_type for i in model.graph.initializer}
        for node in model.graph.node:
            if node.name == "/fc2/MatMul" and types.get(node.input[1]) == onnx.TensorProto.FLOAT16:
                return isolated.RuntimeOutcome(False, False, f"INVALID_GRAPH in {node.name}", False, None, 0.0)
        return real(path, feeds, **kwargs)

    monkeypatch.setattr("mixprec.validate.staged.run_isolated", picky_runtime)
    monkeypatch.setattr("mixprec.pipeline.repair.run_isolated", picky_runtime)
    result = mixprec.convert(norm_mlp[17], tmp_path / "out.onnx", target_dtype="fp16", runtime="onnx")
    kept = {k.name: k.reason for k in result.report.kept_fp32 if k.category == "runtime fails on it"}
    assert list(kept) == ["/fc2/MatMul"]
    assert "fails on the model with this node in 16 bits: INVALID_GRAPH in /fc2/MatMul" in kept["/fc2/MatMul"]
    assert result.report.low_by_op["MatMul"] == 2


@pytest.mark.slow
def test_onnxruntime_optimized_bert_converts_its_contrib_ops(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    source = torch_models.export_optimized_bert(tmp_path / "bert.onnx")
    contrib = Counter(n.op_type for n in onnx.load(str(source)).graph.node if n.domain == "com.microsoft")
    assert {"Attention", "SkipLayerNormalization", "EmbedLayerNormalization", "BiasGelu"} <= set(contrib)

    out = tmp_path / "bert.fp16.onnx"
    result = mixprec.convert(source, out, target_dtype="fp16", runtime="ort-cuda")
    for op, count in contrib.items():
        assert result.report.low_by_op.get(op) == count, (op, result.report.low_by_op)
    assert result.report.nodes_by_precision.get("fp32", 0) == 0
    ids = RNG.integers(0, 100, size=(2, 12)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    got, expected = _loads_as_users_load_it(out, feeds, "fp16"), _fp32_outputs(source, feeds)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], atol=2e-2, rtol=2e-2)

    # On the CPU provider's table the same ops have no float16 kernel: nothing heavy converts,
    # the report says why and suggests weights-only.
    cpu = mixprec.convert(source, tmp_path / "cpu.onnx", target_dtype="fp16", runtime="ort-cpu")
    reasons = {k.op_type: k.reason for k in cpu.report.kept_fp32}
    assert reasons["Attention"] == "no float16 kernel for com.microsoft::Attention(1) on CPUExecutionProvider"
    assert any("--weights-only" in n for n in cpu.report.notes)


def test_weights_only_halves_the_file_and_computes_in_fp32(norm_mlp, tmp_path: Path) -> None:
    source = norm_mlp[17]
    out = tmp_path / "weights.onnx"
    result = mixprec.convert(source, out, target_dtype="fp16", weights_only=True, runtime="ort-cpu")
    assert result.report.nodes_by_precision.get("low", 0) == 0
    assert result.report.weight_bytes_after < 0.6 * result.report.weight_bytes_before
    # Every weight matrix is stored in float16; vectors under 1,024 elements are not worth a Cast.
    stored = onnx.load(str(out)).graph.initializer
    large = [t for t in stored if np.prod(t.dims) >= 1024]
    assert large and all(t.data_type == onnx.TensorProto.FLOAT16 for t in large)
    feeds = {"x": RNG.normal(size=(2, 5, 32)).astype(np.float32)}
    np.testing.assert_allclose(_fp32_outputs(out, feeds)["y"], _fp32_outputs(source, feeds)["y"], atol=5e-3, rtol=5e-3)


def test_policy_command_shows_the_classes_in_effect(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "--to", "fp16", "--runtime", "ort-cpu"]) == 0
    text = capsys.readouterr().out
    section = text.split("fp32 (no kernel)")[1]
    assert "MatMul" in section and "no float16 kernel on CPUExecutionProvider" in section
    assert main(["policy", "--to", "bf16", "--runtime", "ort-cuda"]) == 0
    text = capsys.readouterr().out
    low = text.split("\nlow (")[1].split("\n\n")[0]
    assert "MatMul" in low and "Conv" in low
    assert "MaxPool" in text.split("fp32 (no kernel)")[1]  # CUDA has no bfloat16 MaxPool


def test_report_json_names_the_runtime(norm_mlp, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    code = main(["convert", str(norm_mlp[17]), str(tmp_path / "o.onnx"), "--to", "bf16", "--runtime", "ort-cuda", "--report", str(report)])
    assert code == 0
    data = json.loads(report.read_text())
    assert data["runtime"] == "ort-cuda"
    assert data["validation"]["numerics"].startswith("checked")


@pytest.mark.slow
def test_a_model_openvino_fails_to_compile_is_repaired(tmp_path: Path) -> None:
    # A tiny VITS (transformers, random weights, noise scales 0): OpenVINO 2026.4's CPU plugin
    # fails to compile its bfloat16 form on AMX machines ("2 passes ... can't be merged", in the
    # duration predictor's flows) while it runs the FP32 one. The repair keeps FP32 the fewest
    # nodes that make it compile; the written model runs there. Where OpenVINO compiles the first
    # conversion, the written model must run all the same.
    pytest.importorskip("openvino")
    from transformers import VitsConfig, VitsModel  # noqa: PLC0415

    from mixprec.validate.staged import openvino_runs  # noqa: PLC0415

    torch.manual_seed(0)
    config = VitsConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, ffn_dim=128, flow_size=32, spectrogram_bins=65,
        upsample_initial_channel=64, upsample_rates=[4, 4], upsample_kernel_sizes=[8, 8], resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1, 3]], prior_encoder_num_flows=2, posterior_encoder_num_wavenet_layers=2,
        duration_predictor_num_flows=2, vocab_size=40, noise_scale=0.0, noise_scale_duration=0.0,
    )
    ids = torch.randint(1, 40, (1, 20))
    source = tmp_path / "vits.onnx"
    torch.onnx.export(VitsModel(config).eval(), (ids,), str(source), input_names=["input_ids"], opset_version=17, dynamo=False)
    feeds = {"input_ids": ids.numpy()}
    out = tmp_path / "vits_bf16.onnx"
    result = mixprec.convert(source, out, target_dtype="bf16", runtime="openvino", data=[feeds])
    assert openvino_runs(out, feeds, quantized=False)
    repaired = [n for n in result.report.notes if n.startswith("OpenVINO fails on the first conversion")]
    kept = [d for d in result.report.kept_fp32 if d.category == "runtime fails on it"]
    assert bool(repaired) == bool(kept)
    assert all(d.reason.startswith("OpenVINO's CPU plugin fails on the model with this node in 16 bits") for d in kept)
