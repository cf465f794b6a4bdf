"""The TorchScript fallback of `mixprec.convert_module`: it exports what
``torch.onnx.export(..., dynamo=False)`` exports (tracer warnings are noted, not raised), and when
both exporters fail the one-line error gives each exporter's own first error once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import mixprec
from mixprec.errors import ExportError

torch = pytest.importorskip("torch")


def _dynamo_fails(monkeypatch: pytest.MonkeyPatch, message: str, torchscript: str | None = None) -> None:
    """Make the dynamo exporter fail with `message` (and the TorchScript one with `torchscript`)."""
    original = torch.onnx.export

    def export(*args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("dynamo"):
            raise RuntimeError(message)
        if torchscript is not None:
            raise ValueError(torchscript)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", export)


class _TracedBranch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a Python bool of a tensor: the tracer warns and keeps one branch
            return x * 2
        return x - 1


def test_tracer_warnings_are_noted_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    _dynamo_fails(monkeypatch, "no ONNX function for aten::made_up_op")
    x = torch.ones(2, 3)
    result = mixprec.convert_module(_TracedBranch(), (x,), target_dtype="fp16")
    notes = " ".join(result.report.notes)
    assert "exported with the TorchScript exporter" in notes
    assert "the TorchScript tracer warned 1 time(s), first at test_torch_fallback.py:" in notes
    assert "Python boolean" in notes
    (output,) = result.report.validation.module_outputs
    assert output.max_abs_error == 0.0  # x * 2 of ones: exact in float16


@pytest.mark.parametrize("same", [False, True])
def test_both_exporters_failing_is_one_line_with_each_error_once(
    same: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dynamo, torchscript = "aten::made_up_op has no ONNX function", "cannot trace made_up_op"
    _dynamo_fails(monkeypatch, dynamo, dynamo if same else torchscript)
    with pytest.raises(ExportError) as info:
        mixprec.convert_module(torch.nn.Linear(3, 2), (torch.ones(1, 3),), tmp_path / "m.onnx")
    message = str(info.value)
    assert "\n" not in message and message.startswith("Linear: cannot export to ONNX: ")
    assert message.count(dynamo) == 1
    if same:
        assert f"both exporters: {dynamo}" in message
    else:
        assert f"dynamo exporter: {dynamo}; TorchScript exporter: {torchscript}" in message
    assert "--verbose" not in message and "log at debug level" in message
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.slow
def test_t5_encoder_converts_through_the_torchscript_fallback() -> None:
    """transformers' T5 encoder: the dynamo exporter fails on it (a view of a transposed
    tensor); the TorchScript exporter traces it (warning about shape comparisons in the mask
    code), and the float16 model agrees with the FP32 module."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=100)
    module = transformers.T5EncoderModel(config).eval()
    ids = torch.randint(0, 100, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # the second sequence is padded
    result = mixprec.convert_module(module, (ids, mask), target_dtype="fp16")
    notes = " ".join(result.report.notes)
    assert "exported T5EncoderModel with the" in notes, notes
    assert result.report.low_by_op.get("MatMul", 0) >= 8, result.report.format_text(30)
    (output,) = result.report.validation.module_outputs
    assert output.nan_count == 0 and output.inf_count == 0
    assert output.scaled_error < 5e-3, output
    # Every hidden state agrees with the module's, padded positions included.
    assert np.isfinite(output.max_abs_error) and output.max_abs_error < 1e-2, output
