"""Export Flax models with jax2onnx, run inside a venv that has them (see bench/README.md §8).

    bench/out/jax-venv/bin/python bench/export_jax.py OUT_DIR

Writes, with fixed seeds: a two-layer Flax encoder (LayerNorm, multi-head attention, GELU MLP;
opset 21, and with a symbolic batch at opsets 17 and 23; with each block a local function, at
opset 21), a small CNN (Conv, BatchNorm,
AvgPool, SiLU; symbolic batch, opset 21) and a LLaMA-style block (RMSNorm, rotary embedding,
causal mask, SiLU-gated MLP; opset 23). jax2onnx writes Flax's LayerNorm and RMSNorm out
(variance as the mean of squares less the squared mean, epsilon cast like the input).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import onnx
from flax import nnx
from jax2onnx import onnx_function, to_onnx


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):  # noqa: ANN001, ANN204
        h = self.ln1(x)
        x = x + self.attn(h, h, h)
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


@onnx_function
class FunctionBlock(Block):
    """The block written as an ONNX function of the model (jax2onnx's `onnx_function`)."""


class Encoder(nnx.Module):
    def __init__(
        self, rngs: nnx.Rngs, vocab: int = 100, d: int = 64, heads: int = 4, layers: int = 2, block: type = Block
    ) -> None:
        self.emb = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([block(d, heads, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, 10, rngs=rngs)

    def __call__(self, tokens):  # noqa: ANN001, ANN204
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return nnx.softmax(self.head(self.ln(x).mean(axis=1)), axis=-1)


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.c1 = nnx.Conv(3, 16, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)
        self.c2 = nnx.Conv(16, 32, (3, 3), strides=(2, 2), rngs=rngs)
        self.bn2 = nnx.BatchNorm(32, use_running_average=True, rngs=rngs)
        self.fc = nnx.Linear(32, 5, rngs=rngs)

    def __call__(self, x):  # noqa: ANN001, ANN204
        x = nnx.relu(self.bn1(self.c1(x)))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nnx.silu(self.bn2(self.c2(x)))
        return self.fc(x.mean(axis=(1, 2)))


class LlamaBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d: int = 64, heads: int = 4) -> None:
        self.n1, self.n2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
        self.q, self.k, self.v, self.o = (nnx.Linear(d, d, use_bias=False, rngs=rngs) for _ in range(4))
        self.up = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
        self.gate = nnx.Linear(d, 2 * d, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, use_bias=False, rngs=rngs)
        self.heads = heads

    def rope(self, x):  # noqa: ANN001, ANN201
        _, t, _, dh = x.shape
        angle = jnp.arange(t)[:, None] / (10000 ** (jnp.arange(0, dh, 2) / dh))[None, :]
        cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def __call__(self, x):  # noqa: ANN001, ANN204
        b, t, d = x.shape
        h = self.n1(x)
        q, k, v = (proj(h).reshape(b, t, self.heads, d // self.heads) for proj in (self.q, self.k, self.v))
        q, k = self.rope(q), self.rope(k)
        s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d // self.heads)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(jnp.float32).min)
        a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d)
        x = x + self.o(a)
        h = self.n2(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    encoder = Encoder(nnx.Rngs(0))
    exports = {
        "jax_encoder_op21": (encoder, [tokens], 21),
        "jax_encoder_dyn_op17": (encoder, [jax.ShapeDtypeStruct(("B", 16), jnp.int32)], 17),
        "jax_encoder_dyn_op23": (encoder, [jax.ShapeDtypeStruct(("B", 16), jnp.int32)], 23),
        # Each block a local function, with a symbolic batch (the model's functions keep FP32
        # signatures unless inlined).
        "jax_fn_encoder_dyn_op21": (
            Encoder(nnx.Rngs(3), block=FunctionBlock), [jax.ShapeDtypeStruct(("B", 16), jnp.int32)], 21
        ),
        "jax_cnn_op21": (CNN(nnx.Rngs(1)), [("B", 32, 32, 3)], 21),
        "jax_llama_op23": (LlamaBlock(nnx.Rngs(2)), [jax.ShapeDtypeStruct((1, 16, 64), jnp.float32)], 23),
    }
    for name, (module, inputs, opset) in exports.items():
        onnx.save(to_onnx(module, inputs, model_name=name, opset=opset), out / f"{name}.onnx")
        print(out / f"{name}.onnx")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
