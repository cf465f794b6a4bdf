"""Small but realistic FP32 ONNX models for tests, examples and benchmarks.

The graphs mimic what the PyTorch ONNX exporter emits (dynamic shape arithmetic,
additive ``finfo(float32).min`` attention masks, Erf-based GELU, unfused
BatchNormalization) so that conversion passes see the patterns they meet in the
wild. Weights are random but deterministic for a given ``seed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mixprec.errors import InputError

__all__ = ["DEMO_MODELS", "small_cnn", "transformer_block"]

_MIN_OPSET = 13


class _GraphBuilder:
    """Accumulates nodes and initializers with unique, readable names."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._counts: dict[str, int] = {}

    def _unique(self, base: str) -> str:
        n = self._counts.get(base, 0)
        self._counts[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def const(self, name: str, value: np.ndarray | float | Sequence[int]) -> str:
        """Adds an initializer and returns its name."""
        arr = np.asarray(value)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        name = self._unique(name)
        self.initializers.append(numpy_helper.from_array(arr, name))
        return name

    def weight(self, name: str, shape: Sequence[int], scale: float) -> str:
        """Adds a normally distributed float32 initializer."""
        data = (self.rng.standard_normal(tuple(shape)) * scale).astype(np.float32)
        return self.const(name, data)

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        name: str | None = None,
        *,
        output: str | None = None,
        **attrs: object,
    ) -> str:
        """Adds a single-output node and returns the output name."""
        node_name = self._unique(name or op_type)
        out = output or f"{node_name}_out"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=node_name, **attrs))
        return out


def _check_opset(opset: int) -> None:
    max_opset = onnx.defs.onnx_opset_version()
    if not _MIN_OPSET <= opset <= max_opset:
        raise InputError(f"opset must be in [{_MIN_OPSET}, {max_opset}], got {opset}")


def _make_model(graph: onnx.GraphProto, opset: int) -> onnx.ModelProto:
    opsets = [helper.make_opsetid("", opset)]
    # The lowest IR version for the opset keeps the models loadable by older runtimes.
    return helper.make_model(
        graph,
        opset_imports=opsets,
        producer_name="mixprec.demo_models",
        ir_version=helper.find_min_ir_version_for(opsets),
    )


def _layer_norm(g: _GraphBuilder, x: str, d: int, eps: float, opset: int, prefix: str) -> str:
    """LayerNormalization over the last axis (decomposed below opset 17, as exporters do)."""
    scale = g.const(f"{prefix}.weight", (1.0 + 0.05 * g.rng.standard_normal(d)).astype(np.float32))
    bias = g.const(f"{prefix}.bias", (0.02 * g.rng.standard_normal(d)).astype(np.float32))
    if opset >= 17:
        return g.op(
            "LayerNormalization", [x, scale, bias], f"{prefix}/LayerNorm", axis=-1, epsilon=eps
        )
    mean = g.op("ReduceMean", [x], f"{prefix}/ReduceMean", axes=[-1], keepdims=1)
    centered = g.op("Sub", [x, mean], f"{prefix}/Sub")
    sq = g.op("Pow", [centered, g.const("two", np.float32(2.0))], f"{prefix}/Pow")
    var = g.op("ReduceMean", [sq], f"{prefix}/ReduceMean", axes=[-1], keepdims=1)
    std = g.op("Sqrt", [g.op("Add", [var, g.const("ln_eps", np.float32(eps))], f"{prefix}/Add")])
    normed = g.op("Div", [centered, std], f"{prefix}/Div")
    return g.op("Add", [g.op("Mul", [normed, scale], f"{prefix}/Mul"), bias], f"{prefix}/Add")


def transformer_block(
    seq_len: int | None = None,
    d_model: int = 64,
    n_heads: int = 4,
    seed: int = 0,
    *,
    vocab_size: int = 256,
    max_positions: int = 128,
    opset: int = 17,
) -> onnx.ModelProto:
    """Builds a BERT-style encoder layer with embeddings and an LM head.

    Args:
        seq_len: Fixed sequence length, or None for a dynamic ``seq`` dimension.
        d_model: Hidden size; must be divisible by ``n_heads``.
        n_heads: Number of attention heads.
        seed: Seed for the deterministic random weights.
        vocab_size: Size of the token vocabulary (embedding rows and logits).
        max_positions: Rows of the learned position embedding (max sequence length).
        opset: Default-domain opset; LayerNormalization is decomposed below 17.

    Returns:
        FP32 model with inputs ``input_ids`` / ``attention_mask`` (int64
        ``[batch, seq]``, mask 1 = keep) and output ``logits``
        (float32 ``[batch, seq, vocab_size]``).

    Raises:
        InputError: If the sizes or the opset are invalid.
    """
    _check_opset(opset)
    if d_model <= 0 or n_heads <= 0 or d_model % n_heads:
        raise InputError(f"d_model ({d_model}) must be a positive multiple of n_heads ({n_heads})")
    if seq_len is not None and not 0 < seq_len <= max_positions:
        raise InputError(f"seq_len must be in [1, {max_positions}], got {seq_len}")
    d_head = d_model // n_heads
    d_ff = 4 * d_model
    g = _GraphBuilder(np.random.default_rng(seed))
    seq_dim: int | str = "seq" if seq_len is None else seq_len
    w_scale = 1.0 / math.sqrt(d_model)

    # Embeddings: token Gather + learned positions from Range(0, seq).
    tok = g.op(
        "Gather",
        [g.weight("embeddings.word", [vocab_size, d_model], 0.5), "input_ids"],
        "embeddings/word/Gather",
        axis=0,
    )
    ids_shape = g.op("Shape", ["input_ids"], "embeddings/Shape")
    seq_scalar = g.op(
        "Gather", [ids_shape, g.const("idx1", np.int64(1))], "embeddings/Gather_seq", axis=0
    )
    positions = g.op(
        "Range",
        [g.const("zero_i64", np.int64(0)), seq_scalar, g.const("one_i64", np.int64(1))],
        "embeddings/Range",
    )
    pos = g.op(
        "Gather",
        [g.weight("embeddings.position", [max_positions, d_model], 0.1), positions],
        "embeddings/position/Gather",
        axis=0,
    )
    x = g.op("Add", [tok, pos], "embeddings/Add")
    x = _layer_norm(g, x, d_model, 1e-12, opset, "embeddings.LayerNorm")

    # Extended attention mask, exactly as transformers' get_extended_attention_mask exports.
    mask_f = g.op("Cast", ["attention_mask"], "mask/Cast", to=TensorProto.FLOAT)
    inv = g.op("Sub", [g.const("one_f", np.float32(1.0)), mask_f], "mask/Sub")
    neg = g.op("Mul", [inv, g.const("finfo_min", np.float32(np.finfo(np.float32).min))], "mask/Mul")
    ext_mask = g.op(
        "Unsqueeze", [neg, g.const("axes_1_2", np.array([1, 2], np.int64))], "mask/Unsqueeze"
    )

    # Dynamic [batch, seq, heads, d_head] shape from Shape/Gather/Unsqueeze/Concat.
    x_shape = g.op("Shape", [x], "attn/Shape")
    axes0 = g.const("axes_0", np.array([0], np.int64))
    b_1d = g.op(
        "Unsqueeze",
        [g.op("Gather", [x_shape, g.const("idx0", np.int64(0))], "attn/Gather_b", axis=0), axes0],
        "attn/Unsqueeze_b",
    )
    s_1d = g.op(
        "Unsqueeze",
        [g.op("Gather", [x_shape, "idx1"], "attn/Gather_s", axis=0), axes0],
        "attn/Unsqueeze_s",
    )
    heads_shape = g.op(
        "Concat",
        [
            b_1d,
            s_1d,
            g.const("n_heads", np.array([n_heads], np.int64)),
            g.const("d_head", np.array([d_head], np.int64)),
        ],
        "attn/Concat_heads",
        axis=0,
    )
    merged_shape = g.op(
        "Concat",
        [b_1d, s_1d, g.const("d_model", np.array([d_model], np.int64))],
        "attn/Concat_merged",
        axis=0,
    )

    def linear(inp: str, d_in: int, d_out: int, prefix: str) -> str:
        y = g.op(
            "MatMul",
            [inp, g.weight(f"{prefix}.weight", [d_in, d_out], 1.0 / math.sqrt(d_in))],
            f"{prefix}/MatMul",
        )
        return g.op("Add", [y, g.weight(f"{prefix}.bias", [d_out], 0.02)], f"{prefix}/Add")

    def to_heads(inp: str, prefix: str, perm: list[int]) -> str:
        r = g.op("Reshape", [inp, heads_shape], f"{prefix}/Reshape")
        return g.op("Transpose", [r], f"{prefix}/Transpose", perm=perm)

    q = to_heads(linear(x, d_model, d_model, "attn.query"), "attn.query", [0, 2, 1, 3])
    k_t = to_heads(linear(x, d_model, d_model, "attn.key"), "attn.key", [0, 2, 3, 1])
    v = to_heads(linear(x, d_model, d_model, "attn.value"), "attn.value", [0, 2, 1, 3])
    scores = g.op("MatMul", [q, k_t], "attn/MatMul_qk")
    scores = g.op(
        "Div", [scores, g.const("sqrt_d_head", np.float32(math.sqrt(d_head)))], "attn/Div"
    )
    scores = g.op("Add", [scores, ext_mask], "attn/Add_mask")
    probs = g.op("Softmax", [scores], "attn/Softmax", axis=-1)
    ctx = g.op("MatMul", [probs, v], "attn/MatMul_pv")
    ctx = g.op("Transpose", [ctx], "attn/Transpose_ctx", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, merged_shape], "attn/Reshape_ctx")
    attn_out = linear(ctx, d_model, d_model, "attn.output")
    x = _layer_norm(
        g, g.op("Add", [attn_out, x], "attn/Add_residual"), d_model, 1e-12, opset, "attn.LayerNorm"
    )

    # MLP with GELU as exported by PyTorch (approximate='none') at opset 17.
    h = linear(x, d_model, d_ff, "mlp.fc1")
    erf = g.op(
        "Erf",
        [g.op("Div", [h, g.const("sqrt2", np.float32(math.sqrt(2.0)))], "mlp/gelu/Div")],
        "mlp/gelu/Erf",
    )
    gelu = g.op("Mul", [h, g.op("Add", [erf, "one_f"], "mlp/gelu/Add")], "mlp/gelu/Mul")
    gelu = g.op("Mul", [gelu, g.const("half", np.float32(0.5))], "mlp/gelu/Mul_half")
    mlp_out = linear(gelu, d_ff, d_model, "mlp.fc2")
    x = _layer_norm(
        g, g.op("Add", [mlp_out, x], "mlp/Add_residual"), d_model, 1e-12, opset, "mlp.LayerNorm"
    )

    g.op(
        "MatMul",
        [x, g.weight("lm_head.weight", [d_model, vocab_size], w_scale)],
        "lm_head/MatMul",
        output="logits",
    )

    graph = helper.make_graph(
        g.nodes,
        "transformer_block",
        inputs=[
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", seq_dim]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", seq_dim]),
        ],
        outputs=[
            helper.make_tensor_value_info(
                "logits", TensorProto.FLOAT, ["batch", seq_dim, vocab_size]
            )
        ],
        initializer=g.initializers,
    )
    return _make_model(graph, opset)


def small_cnn(seed: int = 0, *, num_classes: int = 10, opset: int = 17) -> onnx.ModelProto:
    """Builds a small image classifier with unfused BatchNormalization and a Resize.

    The first BatchNormalization has one channel whose running variance is
    ``1e8`` (outside the float16 range) while the others are realistic.

    Args:
        seed: Seed for the deterministic random weights.
        num_classes: Number of output classes.
        opset: Default-domain opset.

    Returns:
        FP32 model with input ``image`` (float32 ``[N, 3, 32, 32]``) and outputs
        ``logits`` and ``probs`` (float32 ``[N, num_classes]``).

    Raises:
        InputError: If the opset is invalid.
    """
    _check_opset(opset)
    g = _GraphBuilder(np.random.default_rng(seed))

    def conv_bn_relu(
        inp: str, c_in: int, c_out: int, prefix: str, big_var_channel: int | None
    ) -> str:
        fan_in = c_in * 9
        w = g.weight(f"{prefix}.conv.weight", [c_out, c_in, 3, 3], math.sqrt(2.0 / fan_in))
        b = g.weight(f"{prefix}.conv.bias", [c_out], 0.01)
        y = g.op(
            "Conv",
            [inp, w, b],
            f"{prefix}/Conv",
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[1, 1],
        )
        gamma = (1.0 + 0.1 * g.rng.standard_normal(c_out)).astype(np.float32)
        beta = (0.1 * g.rng.standard_normal(c_out)).astype(np.float32)
        mean = (0.2 * g.rng.standard_normal(c_out)).astype(np.float32)
        var = g.rng.uniform(0.5, 2.0, c_out).astype(np.float32)
        if big_var_channel is not None:
            var[big_var_channel] = 1e8
            mean[big_var_channel] = 3.0e3
        y = g.op(
            "BatchNormalization",
            [
                y,
                g.const(f"{prefix}.bn.weight", gamma),
                g.const(f"{prefix}.bn.bias", beta),
                g.const(f"{prefix}.bn.running_mean", mean),
                g.const(f"{prefix}.bn.running_var", var),
            ],
            f"{prefix}/BatchNormalization",
            epsilon=1e-5,
            momentum=0.9,
        )
        return g.op("Relu", [y], f"{prefix}/Relu")

    x = conv_bn_relu("image", 3, 16, "block1", big_var_channel=5)
    x = g.op("MaxPool", [x], "block1/MaxPool", kernel_shape=[2, 2], strides=[2, 2])  # 16x16
    x = conv_bn_relu(x, 16, 32, "block2", big_var_channel=None)
    # nn.Upsample(scale_factor=2, mode="nearest") as exported by PyTorch.
    x = g.op(
        "Resize",
        [x, "", g.const("resize_scales", np.array([1.0, 1.0, 2.0, 2.0], np.float32))],
        "upsample/Resize",
        mode="nearest",
        coordinate_transformation_mode="asymmetric",
        nearest_mode="floor",
    )  # 32x32
    x = g.op("AveragePool", [x], "pool/AveragePool", kernel_shape=[2, 2], strides=[2, 2])  # 16x16
    x = g.op("GlobalAveragePool", [x], "pool/GlobalAveragePool")
    x = g.op("Flatten", [x], "head/Flatten", axis=1)
    g.op(
        "Gemm",
        [
            x,
            g.weight("head.fc.weight", [num_classes, 32], 1.0 / math.sqrt(32)),
            g.weight("head.fc.bias", [num_classes], 0.01),
        ],
        "head/Gemm",
        output="logits",
        transB=1,
    )
    g.op("Softmax", ["logits"], "head/Softmax", output="probs", axis=1)

    graph = helper.make_graph(
        g.nodes,
        "small_cnn",
        inputs=[helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 32, 32])],
        outputs=[
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", num_classes]),
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", num_classes]),
        ],
        initializer=g.initializers,
    )
    return _make_model(graph, opset)


DEMO_MODELS: dict[str, Callable[[], onnx.ModelProto]] = {
    "transformer": transformer_block,
    "cnn": small_cnn,
}
