"""Generate FP32 ONNX benchmark models for mixprec.

Two families:

* ``--llama PRESET``: LLaMA-style decoder-only language models (RMSNorm, RoPE,
  GQA attention with a causal ``finfo.min`` mask, SwiGLU MLP) whose weights live
  in one external data file. Weights are streamed to disk in chunks, so the
  generator's peak RSS stays far below the model size (a 12.8 GB model needs
  well under 1 GB).
* ``--nodes N``: "wide" graphs with about N small nodes (hidden size 16) in a
  realistic op mix, for measuring per-node overhead.

Examples::

    python bench/make_models.py --llama tiny --nodes 2000
    python bench/make_models.py --llama 1.1b --out /data/models
    python bench/make_models.py --llama tiny --hidden 1024 --layers 4 --vocab 32000
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

LOG = logging.getLogger("make_models")

OPSET = 17
IR_VERSION = 8
ALIGN = 4096  # External tensors start on page boundaries (mmap friendly).
INT64_MAX = np.iinfo(np.int64).max
FINFO_MIN = np.float32(np.finfo(np.float32).min)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture hyper-parameters of a LLaMA-style decoder."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    tied_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        """Per-head dimension."""
        return self.hidden // self.heads

    def validate(self) -> None:
        """Raises ValueError if the sizes are inconsistent."""
        if self.hidden % self.heads or self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"inconsistent attention sizes: {self}")

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Returns (name, shape, kind) of every weight in file order; kind: 'normal' or 'norm'."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        shapes: list[tuple[str, tuple[int, ...], str]] = [
            ("model.embed_tokens.weight", (self.vocab, h), "normal")
        ]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            shapes += [
                (f"{p}.input_layernorm.weight", (h,), "norm"),
                (f"{p}.self_attn.q_proj.weight", (h, h), "normal"),
                (f"{p}.self_attn.k_proj.weight", (h, kv), "normal"),
                (f"{p}.self_attn.v_proj.weight", (h, kv), "normal"),
                (f"{p}.self_attn.o_proj.weight", (h, h), "normal"),
                (f"{p}.post_attention_layernorm.weight", (h,), "norm"),
                (f"{p}.mlp.gate_proj.weight", (h, self.mlp), "normal"),
                (f"{p}.mlp.up_proj.weight", (h, self.mlp), "normal"),
                (f"{p}.mlp.down_proj.weight", (self.mlp, h), "normal"),
            ]
        shapes.append(("model.norm.weight", (h,), "norm"))
        if not self.tied_embeddings:
            shapes.append(("lm_head.weight", (h, self.vocab), "normal"))
        return shapes

    def num_params(self) -> int:
        """Total number of weight parameters."""
        return sum(math.prod(shape) for _, shape, _ in self.weight_shapes())


LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(hidden=64, layers=2, heads=4, kv_heads=2, mlp=176, vocab=512),
    # TinyLlama-1.1B geometry (untied LM head).
    "1.1b": LlamaConfig(hidden=2048, layers=22, heads=32, kv_heads=4, mlp=5632, vocab=32000),
    # Llama-3.2-3B geometry (tied embeddings, large vocabulary).
    "3.2b": LlamaConfig(
        hidden=3072,
        layers=28,
        heads=24,
        kv_heads=8,
        mlp=8192,
        vocab=128256,
        tied_embeddings=True,
        rope_theta=500000.0,
    ),
}


class ExternalWeightWriter:
    """Streams random float32 tensors into one external data file.

    Each tensor is generated and written in chunks, so memory use is bounded by
    the chunk size, and is referenced by a TensorProto that holds only the
    location/offset/length of its bytes.
    """

    def __init__(self, fh: BinaryIO, location: str, seed: int, chunk_elems: int) -> None:
        self._fh = fh
        self._location = location
        self._rng = np.random.default_rng(seed)
        self._chunk = chunk_elems
        self.offset = 0

    def add(self, name: str, shape: Sequence[int], kind: str, scale: float = 0.02) -> TensorProto:
        """Writes one tensor and returns its external TensorProto."""
        pad = (-self.offset) % ALIGN
        if pad:
            self._fh.write(b"\0" * pad)
            self.offset += pad
        total = math.prod(shape)
        remaining = total
        while remaining:
            n = min(remaining, self._chunk)
            chunk = self._rng.standard_normal(n, dtype=np.float32)
            chunk *= np.float32(scale)
            if kind == "norm":
                chunk += np.float32(1.0)
            self._fh.write(chunk.data)  # Native little-endian float32, as ONNX requires.
            remaining -= n
        length = total * 4
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self._location),
            ("offset", str(self.offset)),
            ("length", str(length)),
        ):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.offset += length
        return tensor


class _Nodes:
    """Small helper that names nodes and collects small inline constants."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.consts: list[TensorProto] = []
        self._const_names: dict[str, str] = {}
        self._n = 0

    def const(self, name: str, value: np.ndarray | float | Sequence[int]) -> str:
        if name not in self._const_names:
            arr = np.asarray(value)
            if arr.dtype == np.float64:
                arr = arr.astype(np.float32)
            self.consts.append(numpy_helper.from_array(arr, name))
            self._const_names[name] = name
        return name

    def __call__(
        self,
        op: str,
        inputs: Sequence[str],
        name: str,
        *,
        output: str | None = None,
        **attrs: object,
    ) -> str:
        self._n += 1
        out = output or f"{name}_output_0"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=name, **attrs))
        return out


def i64(values: Sequence[int]) -> np.ndarray:
    """Returns an int64 array (shape constants)."""
    return np.array(values, np.int64)


def build_llama_graph(cfg: LlamaConfig, weights: dict[str, TensorProto]) -> onnx.ModelProto:
    """Builds the decoder graph; ``weights`` maps weight names to (external) initializers."""
    g = _Nodes()
    h, nh, nkv, dh = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
    n_rep = nh // nkv

    # Shape arithmetic as emitted by the exporter: batch/seq from Shape(input_ids).
    ids_shape = g("Shape", ["input_ids"], "/model/Shape")
    b = g(
        "Unsqueeze",
        [
            g("Gather", [ids_shape, g.const("c_idx0", np.int64(0))], "/model/Gather_b", axis=0),
            g.const("c_axes0", i64([0])),
        ],
        "/model/Unsqueeze_b",
    )
    seq = g("Gather", [ids_shape, g.const("c_idx1", np.int64(1))], "/model/Gather_s", axis=0)
    s = g("Unsqueeze", [seq, "c_axes0"], "/model/Unsqueeze_s")
    q_shape = g(
        "Concat",
        [b, s, g.const("c_heads", i64([nh])), g.const("c_head_dim", i64([dh]))],
        "/model/Concat_q_shape",
        axis=0,
    )
    kv_shape = g(
        "Concat",
        [b, s, g.const("c_kv_heads", i64([nkv])), "c_head_dim"],
        "/model/Concat_kv_shape",
        axis=0,
    )
    rep_shape = g(
        "Concat",
        [b, "c_kv_heads", g.const("c_n_rep", i64([n_rep])), s, "c_head_dim"],
        "/model/Concat_rep_shape",
        axis=0,
    )
    rep_merged = g("Concat", [b, "c_heads", s, "c_head_dim"], "/model/Concat_rep_merged", axis=0)
    out_shape = g(
        "Concat", [b, s, g.const("c_hidden", i64([h]))], "/model/Concat_out_shape", axis=0
    )

    # Rotary embedding tables: cos/sin of positions * inv_freq, [1, 1, seq, head_dim].
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
    pos = g(
        "Range",
        [g.const("c_zero", np.int64(0)), seq, g.const("c_one", np.int64(1))],
        "/rotary/Range",
    )
    pos = g("Cast", [pos], "/rotary/Cast", to=TensorProto.FLOAT)
    pos = g("Unsqueeze", [pos, g.const("c_axes1", i64([1]))], "/rotary/Unsqueeze")
    freqs = g("Mul", [pos, g.const("rotary.inv_freq", inv_freq.astype(np.float32))], "/rotary/Mul")
    emb = g("Concat", [freqs, freqs], "/rotary/Concat", axis=-1)
    axes01 = g.const("c_axes01", i64([0, 1]))
    cos = g("Unsqueeze", [g("Cos", [emb], "/rotary/Cos"), axes01], "/rotary/Unsqueeze_cos")
    sin = g("Unsqueeze", [g("Sin", [emb], "/rotary/Sin"), axes01], "/rotary/Unsqueeze_sin")

    # Causal mask: triu(full((s, s), finfo.min), 1) -> [1, 1, s, s], added to the scores.
    ss = g("Concat", [s, s], "/model/Concat_mask_shape", axis=0)
    full = g(
        "ConstantOfShape",
        [ss],
        "/model/ConstantOfShape",
        value=numpy_helper.from_array(np.array([FINFO_MIN], np.float32)),
    )
    causal = g("Trilu", [full, g.const("c_one", np.int64(1))], "/model/Trilu", upper=1)
    causal = g("Unsqueeze", [causal, axes01], "/model/Unsqueeze_mask")

    half = dh // 2
    start_half, end_max, last_axis = (
        g.const("c_half", i64([half])),
        g.const("c_max", i64([INT64_MAX])),
        g.const("c_axis_m1", i64([-1])),
    )
    zero_1d = g.const("c_zero_1d", i64([0]))
    two = g.const("c_two", np.float32(2.0))
    eps = g.const("c_rms_eps", np.float32(cfg.rms_eps))
    scale = g.const("c_sqrt_head_dim", np.float32(math.sqrt(dh)))

    def rms_norm(x: str, weight: str, p: str) -> str:
        var = g(
            "ReduceMean", [g("Pow", [x, two], f"{p}/Pow")], f"{p}/ReduceMean", axes=[-1], keepdims=1
        )
        std = g("Sqrt", [g("Add", [var, eps], f"{p}/Add")], f"{p}/Sqrt")
        return g("Mul", [weight, g("Div", [x, std], f"{p}/Div")], f"{p}/Mul")

    def rope(x: str, p: str) -> str:
        x1 = g("Slice", [x, zero_1d, start_half, last_axis], f"{p}/Slice_1")
        x2 = g("Slice", [x, start_half, end_max, last_axis], f"{p}/Slice_2")
        rotated = g("Concat", [g("Neg", [x2], f"{p}/Neg"), x1], f"{p}/Concat", axis=-1)
        return g(
            "Add",
            [g("Mul", [x, cos], f"{p}/Mul_cos"), g("Mul", [rotated, sin], f"{p}/Mul_sin")],
            f"{p}/Add",
        )

    def heads(x: str, shape: str, p: str) -> str:
        return g(
            "Transpose",
            [g("Reshape", [x, shape], f"{p}/Reshape")],
            f"{p}/Transpose",
            perm=[0, 2, 1, 3],
        )

    def repeat_kv(x: str, p: str) -> str:
        if n_rep == 1:
            return x
        x = g("Unsqueeze", [x, g.const("c_axes2", i64([2]))], f"{p}/Unsqueeze")
        x = g("Expand", [x, rep_shape], f"{p}/Expand")
        return g("Reshape", [x, rep_merged], f"{p}/Reshape")

    x = g(
        "Gather", ["model.embed_tokens.weight", "input_ids"], "/model/embed_tokens/Gather", axis=0
    )
    for i in range(cfg.layers):
        p, w = f"/model/layers.{i}", f"model.layers.{i}"
        hs = rms_norm(x, f"{w}.input_layernorm.weight", f"{p}/input_layernorm")
        q = heads(
            g("MatMul", [hs, f"{w}.self_attn.q_proj.weight"], f"{p}/self_attn/q_proj/MatMul"),
            q_shape,
            f"{p}/self_attn/q",
        )
        k = heads(
            g("MatMul", [hs, f"{w}.self_attn.k_proj.weight"], f"{p}/self_attn/k_proj/MatMul"),
            kv_shape,
            f"{p}/self_attn/k",
        )
        v = heads(
            g("MatMul", [hs, f"{w}.self_attn.v_proj.weight"], f"{p}/self_attn/v_proj/MatMul"),
            kv_shape,
            f"{p}/self_attn/v",
        )
        q, k = rope(q, f"{p}/self_attn/rotary_q"), rope(k, f"{p}/self_attn/rotary_k")
        k, v = repeat_kv(k, f"{p}/self_attn/repeat_k"), repeat_kv(v, f"{p}/self_attn/repeat_v")
        k_t = g("Transpose", [k], f"{p}/self_attn/Transpose_k", perm=[0, 1, 3, 2])
        scores = g(
            "Div", [g("MatMul", [q, k_t], f"{p}/self_attn/MatMul_qk"), scale], f"{p}/self_attn/Div"
        )
        scores = g("Add", [scores, causal], f"{p}/self_attn/Add_mask")
        probs = g("Softmax", [scores], f"{p}/self_attn/Softmax", axis=-1)
        ctx = g("MatMul", [probs, v], f"{p}/self_attn/MatMul_pv")
        ctx = g("Transpose", [ctx], f"{p}/self_attn/Transpose_ctx", perm=[0, 2, 1, 3])
        ctx = g("Reshape", [ctx, out_shape], f"{p}/self_attn/Reshape_ctx")
        attn = g("MatMul", [ctx, f"{w}.self_attn.o_proj.weight"], f"{p}/self_attn/o_proj/MatMul")
        x = g("Add", [x, attn], f"{p}/Add_attn")
        hs = rms_norm(x, f"{w}.post_attention_layernorm.weight", f"{p}/post_attention_layernorm")
        gate = g("MatMul", [hs, f"{w}.mlp.gate_proj.weight"], f"{p}/mlp/gate_proj/MatMul")
        up = g("MatMul", [hs, f"{w}.mlp.up_proj.weight"], f"{p}/mlp/up_proj/MatMul")
        silu = g(
            "Mul", [gate, g("Sigmoid", [gate], f"{p}/mlp/act_fn/Sigmoid")], f"{p}/mlp/act_fn/Mul"
        )
        down = g(
            "MatMul",
            [g("Mul", [silu, up], f"{p}/mlp/Mul"), f"{w}.mlp.down_proj.weight"],
            f"{p}/mlp/down_proj/MatMul",
        )
        x = g("Add", [x, down], f"{p}/Add_mlp")
    x = rms_norm(x, "model.norm.weight", "/model/norm")
    if cfg.tied_embeddings:
        head_w = g("Transpose", ["model.embed_tokens.weight"], "/lm_head/Transpose", perm=[1, 0])
    else:
        head_w = "lm_head.weight"
    g("MatMul", [x, head_w], "/lm_head/MatMul", output="logits")

    graph = helper.make_graph(
        g.nodes,
        "llama_decoder",
        inputs=[helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"])],
        outputs=[helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", cfg.vocab])],
        initializer=[*weights.values(), *g.consts],
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="mixprec.bench.make_models",
    )


def make_llama(cfg: LlamaConfig, out_dir: Path, name: str, seed: int, chunk_mb: int) -> Path:
    """Writes ``<name>.onnx`` plus ``<name>.onnx.data`` and returns the model path."""
    cfg.validate()
    model_path = out_dir / f"{name}.onnx"
    data_name = f"{name}.onnx.data"
    weights: dict[str, TensorProto] = {}
    with open(out_dir / data_name, "wb") as fh:
        writer = ExternalWeightWriter(
            fh, data_name, seed, chunk_elems=max(1, chunk_mb * 2**20 // 4)
        )
        for wname, shape, kind in cfg.weight_shapes():
            weights[wname] = writer.add(wname, shape, kind)
    onnx.save(build_llama_graph(cfg, weights), model_path)
    return model_path


# Nodes of one layer of `build_llama_graph` (RMSNorm written out, rotary, attention, SwiGLU MLP)
# and of the graph around the layers.
_DECODER_LAYER_NODES = 58
_DECODER_OTHER_NODES = 11


def decoder_config(n_nodes: int) -> LlamaConfig:
    """The LLaMA-style decoder with tiny dimensions (hidden 16) and as many layers as make about
    `n_nodes` nodes: a real architecture's graph shape at any node count."""
    layers = max(1, round((n_nodes - _DECODER_OTHER_NODES) / _DECODER_LAYER_NODES))
    return LlamaConfig(hidden=16, layers=layers, heads=2, kv_heads=1, mlp=32, vocab=64)


def make_wide(n_nodes: int, out_dir: Path, seed: int, hidden: int = 16, seq: int = 8) -> Path:
    """Writes a graph with about ``n_nodes`` small nodes and returns its path."""
    rng = np.random.default_rng(seed)
    g = _Nodes()
    heads, dh = 4, hidden // 4
    shape4 = g.const("c_shape4", np.array([0, seq, heads, dh], np.int64))
    shape3 = g.const("c_shape3", np.array([0, seq, 2 * hidden], np.int64))
    inits: list[TensorProto] = []

    def w(name: str, shape: tuple[int, ...], base: float = 0.0) -> str:
        arr = base + rng.standard_normal(shape) * (
            1.0 / math.sqrt(shape[0]) if len(shape) > 1 else 0.05
        )
        inits.append(numpy_helper.from_array(arr.astype(np.float32), name))
        return name

    x = "x"
    nodes_per_block = 14
    for i in range(max(1, round(n_nodes / nodes_per_block))):
        p = f"/block{i}"
        hdn = g(
            "Add",
            [
                g("MatMul", [x, w(f"b{i}.fc.w", (hidden, hidden))], f"{p}/MatMul"),
                w(f"b{i}.fc.b", (hidden,)),
            ],
            f"{p}/Add",
        )
        hdn = g("Relu", [hdn], f"{p}/Relu")
        hdn = g(
            "LayerNormalization",
            [hdn, w(f"b{i}.ln.w", (hidden,), 1.0), w(f"b{i}.ln.b", (hidden,))],
            f"{p}/LayerNorm",
            axis=-1,
            epsilon=1e-5,
        )
        t = g(
            "Transpose",
            [g("Reshape", [hdn, shape4], f"{p}/Reshape")],
            f"{p}/Transpose",
            perm=[0, 2, 1, 3],
        )
        sm = g("Softmax", [t], f"{p}/Softmax", axis=-1)
        cat = g("Concat", [g("Mul", [sm, t], f"{p}/Mul"), t], f"{p}/Concat", axis=-1)
        back = g("Transpose", [cat], f"{p}/Transpose_back", perm=[0, 2, 1, 3])
        proj = g(
            "MatMul",
            [
                g("Reshape", [back, shape3], f"{p}/Reshape_back"),
                w(f"b{i}.proj.w", (2 * hidden, hidden)),
            ],
            f"{p}/MatMul_proj",
        )
        proj = g("Mul", [proj, w(f"b{i}.gamma", (hidden,), 0.1)], f"{p}/Mul_gamma")
        x = g("Add", [x, proj], f"{p}/Add_residual")
    g(
        "LayerNormalization",
        [x, w("final.ln.w", (hidden,), 1.0), w("final.ln.b", (hidden,))],
        "/final/LayerNorm",
        output="y",
        axis=-1,
        epsilon=1e-5,
    )
    graph = helper.make_graph(
        g.nodes,
        f"wide_{n_nodes}",
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, hidden])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", seq, hidden])],
        initializer=[*inits, *g.consts],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="mixprec.bench.make_models",
    )
    path = out_dir / f"wide_{n_nodes}.onnx"
    onnx.save(model, path)
    return path


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux.


def _files_mb(model_path: Path) -> tuple[float, float]:
    data = model_path.with_name(model_path.name + ".data")
    return model_path.stat().st_size / 2**20, (
        data.stat().st_size / 2**20 if data.exists() else 0.0
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--llama",
        action="append",
        default=[],
        choices=sorted(LLAMA_PRESETS),
        help="LLaMA-style preset to generate (repeatable)",
    )
    ap.add_argument(
        "--nodes",
        action="append",
        default=[],
        type=int,
        help="wide graph with ~N nodes (repeatable)",
    )
    ap.add_argument(
        "--decoder",
        action="append",
        default=[],
        type=int,
        help="a LLaMA-style decoder with tiny dimensions and as many layers as give ~N nodes (repeatable)",
    )
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "out", help="output directory"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--name", help="file stem for the LLaMA model (default: llama_<preset>[_<overrides>])"
    )
    ap.add_argument("--chunk-mb", type=int, default=64, help="weight generation chunk size (MiB)")
    ap.add_argument(
        "--check",
        action="store_true",
        help="run onnx.checker on each written model (path based, also for large models)",
    )
    over = ap.add_argument_group("LLaMA overrides (applied to every --llama preset)")
    for flag in ("hidden", "layers", "heads", "kv-heads", "mlp", "vocab"):
        over.add_argument(f"--{flag}", type=int)
    args = ap.parse_args(argv)
    if not args.llama and not args.nodes and not args.decoder:
        ap.error("nothing to do: give --llama, --nodes and/or --decoder")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    overrides = {
        k: getattr(args, k)
        for k in ("hidden", "layers", "heads", "kv_heads", "mlp", "vocab")
        if getattr(args, k) is not None
    }
    rows: list[tuple[str, str, float, float, float]] = []
    for preset in args.llama:
        cfg = dataclasses.replace(LLAMA_PRESETS[preset], **overrides)
        name = f"llama_{preset}" + "".join(f"_{k}{v}" for k, v in sorted(overrides.items()))
        if args.name:
            name = args.name if len(args.llama) == 1 else f"{args.name}_{preset}"
        LOG.info(
            "generating %s: %s, %.1fM params, %.2f GB fp32",
            name,
            cfg,
            cfg.num_params() / 1e6,
            cfg.num_params() * 4 / 1e9,
        )
        t0 = time.perf_counter()
        path = make_llama(cfg, args.out, name, args.seed, args.chunk_mb)
        rows.append((name, str(path), *_files_mb(path), time.perf_counter() - t0))
    for n in args.decoder:
        t0 = time.perf_counter()
        path = make_llama(decoder_config(n), args.out, f"decoder_{n}", args.seed, args.chunk_mb)
        nodes = len(onnx.load(path, load_external_data=False).graph.node)
        rows.append((f"decoder_{n} ({nodes} nodes)", str(path), *_files_mb(path), time.perf_counter() - t0))
    for n in args.nodes:
        t0 = time.perf_counter()
        path = make_wide(n, args.out, args.seed)
        rows.append(
            (
                f"wide_{n} ({len(onnx.load(path, load_external_data=False).graph.node)} nodes)",
                str(path),
                *_files_mb(path),
                time.perf_counter() - t0,
            )
        )
    if args.check:
        for _, path, *_ in rows:
            onnx.checker.check_model(path)
            LOG.info("checker ok: %s", path)
    width = max(len(r[0]) for r in rows)
    print(f"{'model':<{width}} {'graph MiB':>10} {'data MiB':>10} {'seconds':>8}  path")
    for name, path, graph_mb, data_mb, secs in rows:
        print(f"{name:<{width}} {graph_mb:>10.2f} {data_mb:>10.1f} {secs:>8.2f}  {path}")
    print(f"generator peak RSS: {_peak_rss_mb():.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
