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
