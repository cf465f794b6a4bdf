"""A tiny HF-style transformer in PyTorch, for the torch.onnx.export round trip tests.

Imported only by tests that have already done ``pytest.importorskip("torch")``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

VOCAB = 50
HIDDEN = 32
HEADS = 2
LAYERS = 2
FFN = 64
MAX_POSITIONS = 64
LN_EPS = 1e-12


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        # Sizes read from the tensor: exports as Shape/Gather/Concat/Reshape (or Shape slices).
        b, s = x.size(0), x.size(1)
        return x.view(b, s, self.num_heads, -1).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores + additive_mask
        probs = torch.softmax(scores, dim=-1)
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        context = context.view(x.shape[0], x.shape[1], -1)
        return self.dense(context)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = SelfAttention()
        self.ln1 = nn.LayerNorm(HIDDEN, eps=LN_EPS)
        self.up = nn.Linear(HIDDEN, FFN)
        self.act = nn.GELU()
        self.down = nn.Linear(FFN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN, eps=LN_EPS)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attention(x, additive_mask))
        return self.ln2(x + self.down(self.act(self.up(x))))


class TinyEncoder(nn.Module):
    """Embeddings + LayerNorm + LAYERS post-LN encoder layers + a tied-free LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.word = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(MAX_POSITIONS, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN, eps=LN_EPS)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        positions = torch.arange(seq, dtype=torch.long, device=input_ids.device).unsqueeze(0)
        x = self.ln(self.word(input_ids) + self.position(positions))
        # Exactly as HF: 0 where attended, finfo(float32).min where masked.
        additive = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(
            torch.float32
        ).min
        for layer in self.layers:
            x = layer(x, additive)
        return self.head(x)


def make_model(seed: int = 0) -> TinyEncoder:
    torch.manual_seed(seed)
    model = TinyEncoder().eval()
    # Non-trivial LayerNorm affine parameters, so a broken LayerNorm shows in the logits.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    return model


def export(model: nn.Module, path: Path, *, dynamo: bool, opset: int | None = None) -> Path:
    """Export `model` with dynamic batch and sequence axes; returns `path`.

    `opset` applies to the legacy TorchScript exporter (default 17, the first with
    LayerNormalization; 14 gives a decomposed LayerNorm); the dynamo exporter picks its own.
    """
    ids = torch.randint(0, VOCAB, (2, 5), dtype=torch.long)
    mask = torch.ones(2, 5, dtype=torch.long)
    names = ["input_ids", "attention_mask"]
    if dynamo:
        batch = torch.export.Dim("batch", min=1, max=64)
        seq = torch.export.Dim("seq", min=2, max=MAX_POSITIONS)
        torch.onnx.export(
            model,
            (ids, mask),
            str(path),
            dynamo=True,
            input_names=names,
            output_names=["logits"],
            dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
            external_data=False,
            verbose=False,
        )
    else:
        axes = {0: "batch", 1: "seq"}
        torch.onnx.export(
            model,
            (ids, mask),
            str(path),
            dynamo=False,
            input_names=names,
            output_names=["logits"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes},
            opset_version=opset or 17,
        )
    return path


class NormMLP(nn.Module):
    """Linear layers around a LayerNorm and an RMSNorm written out by hand (LLaMA style)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.ln = nn.LayerNorm(64, eps=1e-5)
        self.fc2 = nn.Linear(64, 32)
        self.rms_weight = nn.Parameter(torch.rand(32) + 0.5)
        self.fc3 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.ln(self.fc1(x))))
        h = self.rms_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return self.fc3(h)


class TwoGRU(nn.Module):
    """A Conv1d front end and two stacked GRUs (a speech-enhancement shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.gru1 = nn.GRU(16, 32, batch_first=True)
        self.gru2 = nn.GRU(32, 32, batch_first=True)
        self.fc = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x).transpose(1, 2)
        y, _ = self.gru1(y)
        y, _ = self.gru2(y)
        return self.fc(y)


def export_torchscript(module: nn.Module, example: torch.Tensor, path: Path, opset: int, dynamic: dict) -> Path:
    """Export with the TorchScript exporter (the one that decomposes LayerNorm below opset 17)."""
    import warnings  # noqa: PLC0415

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(), (example,), str(path), input_names=["x"], output_names=["y"],
            opset_version=opset, dynamo=False, dynamic_axes={"x": dynamic},
        )
    return path


def export_optimized_bert(path: Path) -> Path:
    """A tiny BERT from `transformers` (random weights, no download), exported and fused by
    onnxruntime.transformers' optimizer into com.microsoft ops (Attention, SkipLayerNorm, ...)."""
    import warnings  # noqa: PLC0415

    from onnxruntime.transformers.optimizer import optimize_model  # noqa: PLC0415
    from transformers import BertConfig, BertModel  # noqa: PLC0415

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
    )
    config._attn_implementation = "eager"  # the attention pattern the optimizer fuses
    bert = BertModel(config).eval()

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> tuple:
            out = self.bert(input_ids=ids, attention_mask=mask, token_type_ids=types)
            return out.last_hidden_state, out.pooler_output

    ids = torch.randint(0, 100, (2, 16))
    raw = path.with_name("bert_raw.onnx")
    axes = {0: "batch", 1: "seq"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Wrapped().eval(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(raw),
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["last_hidden_state", "pooler_output"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes},
            opset_version=14, dynamo=False,
        )
        optimize_model(str(raw), model_type="bert", num_heads=4, hidden_size=64).save_model_to_file(str(path))
    return path
