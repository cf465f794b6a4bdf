"""PyTorch modules in: `mixprec.convert_module` exports with the dynamo exporter and converts in
one call; the converted model loads in onnxruntime with default options and matches the FP32
module it came from (fp16 for real and emulated, bf16 emulated)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

import mixprec
from mixprec.cli import main
from mixprec.errors import ExportError, InputError
from mixprec.runtime import sessions
from mixprec.runtime.isolated import run_isolated
from mixprec.validate.emulate import emulate_low_precision

torch = pytest.importorskip("torch")
nn = torch.nn


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


class MaskedEncoder(nn.Module):
    """A transformer encoder over embedded tokens with a key padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens), src_key_padding_mask=padding))


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: tracing would keep one side
            return x * 2
        return x - 1


def _trained_bn(module: nn.Module) -> nn.Module:
    """Running statistics that are not the identity (a freshly built BatchNorm folds away)."""
    gen = torch.Generator().manual_seed(0)
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return module.eval()


def _emulated_outputs(model: onnx.ModelProto | object, feeds: dict[str, np.ndarray], tmp: Path) -> dict[str, np.ndarray]:
    path = tmp / "emulated.onnx"
    onnx.save(emulate_low_precision(model), str(path))  # type: ignore[arg-type]
    return sessions.run_session(sessions.make_session(path, graph_optimization="disable"), feeds)


def _check(result: mixprec.ConversionResult, out: Path, target: str, limit: float) -> None:
    report = result.report
    validation = report.validation
    assert validation.module_outputs, validation.notes
    errors = {o.name: o.scaled_error for o in validation.module_outputs}
    assert all(o.nan_count == 0 and o.inf_count == 0 for o in validation.module_outputs)
    assert max(errors.values()) < limit, errors
    assert validation.runtime in ("ran and emulated", "emulated"), validation.runtime
    # The saved model loads in onnxruntime as users run it (default options, own process);
    # bfloat16 has no CPU kernels, so its numerics come from the emulation above.
    outcome = run_isolated(out)
    if target == "fp16":
        assert outcome.ok, outcome.error
    onnx.checker.check_model(str(out), full_check=True)
    names = [k.name for k in report.kept_fp32]
    assert not any(name.startswith("node_") for name in names), names  # module paths, not exporter ids


@pytest.mark.slow
@pytest.mark.parametrize("target,limit", [("fp16", 5e-3), ("bf16", 3e-2)])
def test_cnn_with_batchnorm(target: str, limit: float, tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = _trained_bn(SmallCNN())
    x = torch.randn(2, 3, 24, 24)
    out = tmp_path / "cnn.onnx"
    more = [{"x": np.random.default_rng(1).normal(size=(2, 3, 24, 24)).astype(np.float32)}]
    result = mixprec.convert_module(module, (x,), out, target_dtype=target, data=more)
    _check(result, out, target, limit)
    assert result.report.validation.module_batches == 2  # the example inputs, then the data
    assert result.report.low_by_op.get("Conv") == 2 and result.report.low_by_op.get("Gemm", 0) + result.report.low_by_op.get("MatMul", 0) >= 1
    assert any("dynamo exporter at opset" in n for n in result.report.notes)
    if target == "bf16":
        assert result.model.opset_imports[""] >= 22  # bfloat16 Conv exists from opset 22


@pytest.mark.slow
@pytest.mark.parametrize("target,limit", [("fp16", 1e-2), ("bf16", 5e-2)])
def test_transformer_encoder_with_padding_mask(target: str, limit: float, tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = MaskedEncoder().eval()
    tokens = torch.randint(0, 100, (2, 12))
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 8:] = True  # the second sequence is padded
    out = tmp_path / "encoder.onnx"
    result = mixprec.convert_module(module, (tokens, padding), out, target_dtype=target)
    _check(result, out, target, limit)
    assert result.report.low_by_op.get("MatMul", 0) + result.report.low_by_op.get("Gemm", 0) >= 8


def _tiny_llama():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicCache

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config).eval()

    class WithCache(nn.Module):
        """input_ids, attention mask and the past keys/values as plain tensors in; logits and
        the present keys/values out."""

        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask, past_keys, past_values):  # type: ignore[no-untyped-def]
            cache = DynamicCache(config=config)
            for layer, (k, v) in enumerate(zip(past_keys, past_values)):
                cache.update(k, v, layer)
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            layers = out.past_key_values.layers
            return out.logits, [layer.keys for layer in layers], [layer.values for layer in layers]

    return WithCache().eval(), config


def _llama_inputs(config, new: int, past: int, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    ids = torch.randint(0, config.vocab_size, (1, new), generator=gen)
    mask = torch.ones(1, past + new, dtype=torch.int64)
    keys = [torch.randn(1, heads, past, dim, generator=gen) for _ in range(config.num_hidden_layers)]
    values = [torch.randn(1, heads, past, dim, generator=gen) for _ in range(config.num_hidden_layers)]
    return ids, mask, keys, values


@pytest.mark.slow
@pytest.mark.parametrize("target", ["fp16", "bf16"])
def test_tiny_llama_with_kv_cache(target: str, tmp_path: Path) -> None:
    module, config = _tiny_llama()
    Dim = torch.export.Dim
    seq, past, total = Dim("seq", min=1, max=128), Dim("past", min=1, max=128), Dim("total", min=2, max=256)
    layers = config.num_hidden_layers
    dynamic = {
        "input_ids": {1: seq}, "attention_mask": {1: total},
        "past_keys": [{2: past}] * layers, "past_values": [{2: past}] * layers,
    }
    out = tmp_path / "llama.onnx"
    result = mixprec.convert_module(
        module, _llama_inputs(config, 3, 5, seed=1), out, target_dtype=target, dynamic_shapes=dynamic
    )
    _check(result, out, target, 3e-2 if target == "bf16" else 5e-3)
    report = result.report
    matmuls = sum(1 for n in result.model.graph if n.op_type == "MatMul")
    assert report.low_by_op.get("MatMul", 0) == matmuls  # every projection and attention product
    # Exported at opset 23: RMSNorm is one RMSNormalization op computing in 16 bits (FP32
    # accumulation), not a decomposed block kept FP32 with casts around it.
    assert "normalization block" not in report.fp32_by_category
    assert report.low_by_op.get("RMSNormalization", 0) == 2 * layers + 1
    # Rotary embeddings (RotaryEmbedding at opset 23) compute in 16 bits: the small cos/sin
    # tables are cast, not the queries and keys.
    assert report.low_by_op.get("RotaryEmbedding", 0) == 2 * layers
    assert report.casts_runtime <= 9 * layers, report.casts_runtime

    # Another sequence length and cache length than the export's: the next-token argmax of the
    # converted model agrees with the module.
    from mixprec.frontends.torch_module import run_module

    ids, mask, keys, values = _llama_inputs(config, 6, 9, seed=2)
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    feeds.update({f"past_keys_{i}": k.numpy() for i, k in enumerate(keys)})
    feeds.update({f"past_values_{i}": v.numpy() for i, v in enumerate(values)})
    inputs = [v.name for v in result.model.graph.inputs if v.name not in result.model.graph.initializers]
    expected = run_module(module, feeds, (ids, mask, keys, values), inputs)[0]
    actual = _emulated_outputs(result.model, feeds, tmp_path)[result.model.graph.outputs[0].name]
    assert actual.shape == expected.shape == (1, 6, config.vocab_size)
    agreement = float((actual.argmax(-1) == expected.argmax(-1)).mean())
    assert agreement >= 5 / 6, agreement


@pytest.mark.slow
def test_data_dependent_branch_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ExportError) as info:
        mixprec.convert_module(Branchy(), (torch.randn(2, 3),), tmp_path / "b.onnx")
    message = str(info.value)
    assert "\n" not in message and "Branchy" in message and "data-dependent" in message
    assert "test_convert_module.py:" in message  # the line of the branch
    assert not (tmp_path / "b.onnx").exists()


@pytest.mark.slow
def test_cli_converts_a_factory_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "make.py"
    script.write_text(textwrap.dedent("""
        import torch

        def build():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
            return model.eval(), (torch.randn(3, 8),)
    """))
    out = tmp_path / "seq.onnx"
    assert main(["convert", f"{script}:build", str(out), "--to", "bf16"]) == 0
    printed = capsys.readouterr().out
    assert "vs the PyTorch module" in printed and out.is_file()
    assert main(["convert", f"{script}:missing", str(tmp_path / "x.onnx")]) == 2
    assert "defines no function 'missing'" in capsys.readouterr().err


def test_importing_mixprec_does_not_import_torch() -> None:
    code = "import sys, mixprec, mixprec.cli, mixprec.api; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_torch_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(InputError, match="pip install torch"):
        mixprec.convert_module(object(), ())


@pytest.mark.slow
def test_torchscript_fallback_when_dynamo_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only when the dynamo exporter fails (here made to fail) does the TorchScript exporter run;
    the report says so and the result still converts and matches the module."""
    original = torch.onnx.export

    def dynamo_fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("dynamo"):
            raise RuntimeError("no ONNX function for aten::made_up_op")
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", dynamo_fails)
    torch.manual_seed(0)
    module = _trained_bn(SmallCNN())
    out = tmp_path / "cnn.onnx"
    result = mixprec.convert_module(module, (torch.randn(2, 3, 24, 24),), out, target_dtype="fp16")
    notes = " ".join(result.report.notes)
    assert "the dynamo exporter failed (no ONNX function for aten::made_up_op)" in notes
    assert "exported with the TorchScript exporter" in notes
    _check(result, out, "fp16", 5e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "body,expected",
    [
        ("def build():\n    raise RuntimeError('no weights here')\n", "RuntimeError: no weights here"),
        ("def build():\n    return 1, 2\n", "expected a torch.nn.Module, got int"),
        ("def build():\n    return None\n", "must return (module, example_inputs)"),
        ("import no_such_module_anywhere\n", "ModuleNotFoundError"),
        ("def build(:\n", "SyntaxError"),
    ],
)
def test_bad_factory_files_are_one_line_and_write_nothing(
    body: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "make.py"
    script.write_text(body)
    out = tmp_path / "out.onnx"
    assert main(["convert", f"{script}:build", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.onnx")]


class _Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        assert scale.dim() == 0, scale.shape
        return x * scale


def test_run_module_hands_a_scalar_input_over_as_one() -> None:
    from mixprec.frontends.torch_module import run_module  # noqa: PLC0415

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    (out,) = run_module(_Scaled(), {"x": x, "scale": np.array(2.0, np.float32)}, (torch.zeros(2, 3), torch.tensor(1.0)), ["x", "scale"])
    np.testing.assert_array_equal(out, 2 * x)
