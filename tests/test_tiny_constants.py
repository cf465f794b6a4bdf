"""Constants that flush to zero in float16 ("tiny" constants: biases and layer scales of 1e-8).

A flushed value is at most half the smallest subnormal, within the rounding of a 16-bit sum: where
it is only added (a Conv/Gemm bias, an Add operand, a normalization's bias) it keeps nothing FP32.
Where it multiplies (a layer scale), the node reading it stays FP32 and nothing else does. Golden
tests on small graphs, then MobileNetV3-, EfficientNet- and ConvNeXt-style PyTorch modules whose
biases and layer scales hold 1e-8 (and 1e-6, torchvision's layer-scale init): their Convs convert,
and their accuracy equals that of converting with the flush rule off.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx.defs
import onnx.helper as oh
import onnx_ir as ir
import pytest
from helpers import FLOAT, FLOAT16, NodeSig, check_full, convert, initializer_types, run, sigs_of
from onnx import numpy_helper

import mixprec
from mixprec.analysis.constants import ConstantRange
from mixprec.errors import PolicyError
from mixprec.plan import planner as plan_module
from mixprec.policy.opfacts import ALL_INPUTS, all_op_facts, op_facts, parse_op_facts
from mixprec.validate.emulate import emulate_low_precision

TINY = 1e-9  # flushes to zero in float16 (below half its smallest subnormal, 2.98e-8)
H = "float16"


# -- the op facts ------------------------------------------------------------------------------


def test_additive_and_scaling_inputs_name_inputs_of_the_schemas() -> None:
    conv = op_facts("", "Conv")
    assert conv.adds(2) and not conv.adds(0) and conv.scales(0) and conv.scales(1)
    assert op_facts("", "Sum").adds(7) and op_facts("", "Einsum").scales(3)
    assert op_facts("", "Div").scales(0) and not op_facts("", "Div").scales(1)
    for (domain, op), facts in all_op_facts().items():
        additive, scaling = facts.additive_inputs, facts.scaling_inputs
        if ALL_INPUTS not in (additive, scaling):
            assert not set(additive) & set(scaling), op  # an input is added or scales, not both
        for inputs in (additive, scaling):
            if inputs != ALL_INPUTS and onnx.defs.has(op, domain):
                count = len(onnx.defs.get_schema(op, domain).inputs)
                assert set(inputs) <= set(range(count)), (op, inputs)


@pytest.mark.parametrize("value", [[], [-1], "some", [True], 2])
def test_bad_input_sets_are_refused(value: object) -> None:
    with pytest.raises(PolicyError, match="additive_inputs"):
        parse_op_facts({"Add": {"additive_inputs": value}}, "facts.toml")


# -- golden: small graphs -----------------------------------------------------------------------


def _model(
    nodes: list, inits: dict[str, np.ndarray], shape: list[int], out_shape: list[int], opset: int = 17
) -> onnx.ModelProto:
    graph = oh.make_graph(
        nodes, "g",
        [oh.make_tensor_value_info("x", FLOAT, shape)],
        [oh.make_tensor_value_info("y", FLOAT, out_shape)],
        [numpy_helper.from_array(np.asarray(a, np.float32), name) for name, a in inits.items()],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", opset)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _reasons(result: mixprec.ConversionResult) -> list[str]:
    notes = list(result.report.constants_kept_for_range.values())
    return [d.reason for d in result.plan.decisions.values()] + notes


def _feeds(shape: list[int], seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).normal(size=shape).astype(np.float32)}


def test_conv_with_a_flushing_bias_converts() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 3, 3, 3)).astype(np.float32) * 0.3
    bias = np.full(4, TINY, np.float32) * np.array([1, -1, 2, 1], np.float32)
    model = _model(
        [oh.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), oh.make_node("Relu", ["c"], ["y"])],
        {"w": w, "b": bias}, [1, 3, 8, 8], [1, 4, 8, 8],
    )
    result, out = convert(model, keep_io_types=False)
    check_full(out)
    assert sigs_of(out, "Conv") == [NodeSig("Conv", (H, H, H), (H,))]
    assert initializer_types(out) == {"w": FLOAT16, "b": FLOAT16}
    assert result.report.kept_fp32 == [] and result.report.casts_inserted == 0
    feeds = _feeds([1, 3, 8, 8])
    expected = run(model, feeds)[0]
    actual = run(out, {"x": feeds["x"].astype(np.float16)})[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-2, atol=1e-2)


def _scaled_residual(scale: np.ndarray) -> onnx.ModelProto:
    """Conv -> Mul by a per-channel scale -> Add to the Conv's output -> Conv."""
    rng = np.random.default_rng(1)
    w1 = rng.normal(size=(4, 3, 3, 3)).astype(np.float32) * 0.3
    w2 = rng.normal(size=(2, 4, 1, 1)).astype(np.float32) * 0.3
    return _model(
        [
            oh.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1], name="conv1"),
            oh.make_node("Mul", ["c", "gamma"], ["m"], name="scale"),
            oh.make_node("Add", ["c", "m"], ["r"], name="residual"),
            oh.make_node("Relu", ["r"], ["a"], name="relu"),
            oh.make_node("Conv", ["a", "w2"], ["y"], name="conv2"),
        ],
        {"w1": w1, "b1": np.array([0.1, -0.2, 0.05, 0.3]), "w2": w2, "gamma": scale.reshape(4, 1, 1)},
        [1, 3, 8, 8], [1, 2, 8, 8],
    )


def test_mul_by_a_flushing_constant_keeps_only_that_mul_fp32() -> None:
    model = _scaled_residual(np.array([TINY, 2 * TINY, -TINY, TINY], np.float32))
    result, out = convert(model)
    check_full(out)
    precision = {n.name: d.precision.value for n, d in result.plan.decisions.items()}
    assert precision == {"conv1": "low", "scale": "fp32", "residual": "low", "relu": "low", "conv2": "low"}
    (kept,) = result.report.kept_fp32
    assert "flush to zero" in kept.reason and "gamma" in kept.reason
    assert initializer_types(out)["gamma"] == FLOAT
    # The residual Add reads the FP32 product through one Cast; the Mul reads conv1's output through another.
    assert sigs_of(out, "Add") == [NodeSig("Add", (H, H), (H,))]
    assert not any("beyond" in reason for reason in _reasons(result))
    feeds = _feeds([1, 3, 8, 8])
    np.testing.assert_allclose(run(out, feeds)[0], run(model, feeds)[0], rtol=1e-2, atol=1e-2)


def test_a_layer_scale_measured_on_data_keeps_only_its_mul_fp32() -> None:
    """With calibration data the product is measured: it flushes too, so the Mul stays FP32
    (its evidence is the measurement) and the residual Add it feeds converts."""
    model = _scaled_residual(np.array([TINY, 2 * TINY, -TINY, TINY], np.float32))
    result, out = convert(model, data=[_feeds([1, 3, 8, 8], seed) for seed in range(2)])
    precision = {n.name: d.precision.value for n, d in result.plan.decisions.items()}
    assert precision == {"conv1": "low", "scale": "fp32", "residual": "low", "relu": "low", "conv2": "low"}
    (kept,) = result.report.kept_fp32
    assert kept.category == "range measured on data" and "flush to zero" in kept.reason
    feeds = _feeds([1, 3, 8, 8], 5)
    np.testing.assert_allclose(run(out, feeds)[0], run(model, feeds)[0], rtol=1e-2, atol=1e-2)


def test_torchvision_layer_scale_init_is_no_flush() -> None:
    """1e-6 is a float16 subnormal: stored with a coarser step, it does not flush."""
    model = _scaled_residual(np.full(4, 1e-6, np.float32))
    result, _ = convert(model)
    assert result.report.kept_fp32 == []


def test_a_reshaped_flushing_scale_keeps_only_the_product_fp32() -> None:
    """A layer scale reshaped in the graph: data movement passes the flush on to the Mul."""
    rng = np.random.default_rng(2)
    model = _model(
        [
            oh.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([0], np.int64))),
            oh.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
            oh.make_node("Unsqueeze", ["gamma", "axes"], ["g"], name="unsqueeze"),
            oh.make_node("Mul", ["h", "g"], ["m"], name="scale"),
            oh.make_node("Add", ["h", "m"], ["r"], name="residual"),
            oh.make_node("MatMul", ["r", "w"], ["y"], name="out"),
        ],
        {"w": rng.normal(size=(4, 4)) * 0.5, "gamma": np.full(4, -TINY)},
        [3, 4], [3, 4],
    )
    result, out = convert(model)
    check_full(out)
    precision = {n.name: d.precision.value for n, d in result.plan.decisions.items() if n.name}
    assert precision == {"proj": "low", "unsqueeze": "fp32", "scale": "fp32", "residual": "low", "out": "low"}
    assert not any("beyond" in reason for reason in _reasons(result))
    feeds = _feeds([3, 4])
    np.testing.assert_allclose(run(out, feeds)[0], run(model, feeds)[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("op", ["LayerNormalization", "BatchNormalization", "Gemm", "Add"])
def test_flushing_additive_inputs_convert(op: str) -> None:
    rng = np.random.default_rng(3)
    beta = np.full(4, TINY, np.float32)
    inits: dict[str, np.ndarray] = {"w": rng.normal(size=(4, 4)) * 0.5}
    if op == "LayerNormalization":
        node = oh.make_node(op, ["h", "scale", "beta"], ["y"], epsilon=1e-5)
        inits |= {"scale": np.ones(4), "beta": beta}
    elif op == "BatchNormalization":
        node = oh.make_node(op, ["h", "scale", "beta", "mean", "var"], ["y"])
        inits |= {"scale": np.ones(4), "beta": beta, "mean": np.zeros(4), "var": np.ones(4)}
    elif op == "Gemm":
        node = oh.make_node(op, ["h", "w", "beta"], ["y"])
        inits["beta"] = beta
    else:
        node = oh.make_node(op, ["h", "beta"], ["y"])
        inits["beta"] = beta
    model = _model([oh.make_node("MatMul", ["x", "w"], ["h"]), node], inits, [3, 4], [3, 4])
    result, out = convert(model)
    check_full(out)
    assert result.report.low_by_op.get(op) == 1, result.report.kept_fp32
    assert initializer_types(out)["beta"] == FLOAT16
    feeds = _feeds([3, 4])
    np.testing.assert_allclose(run(out, feeds)[0], run(model, feeds)[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("guard", ["Div", "Sqrt-Div", "Log"])
def test_an_epsilon_that_guards_against_zero_stays_fp32(guard: str) -> None:
    """`h / (norm + 1e-12)`: the sum is zero where the norm underflows in 16 bits, and a flushed
    epsilon no longer guards the division, so the addition keeps its FP32 epsilon."""
    rng = np.random.default_rng(4)
    inits = {"w": rng.normal(size=(4, 4)) * 1e-3, "eps": np.full(1, 1e-12)}
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"]), oh.make_node("Mul", ["h", "h"], ["sq"]),
             oh.make_node("ReduceSum", ["sq"], ["ss"], keepdims=1)]
    if guard == "Log":
        nodes += [oh.make_node("Add", ["ss", "eps"], ["guarded"]), oh.make_node("Log", ["guarded"], ["y"])]
    else:
        norm = "ss"
        if guard == "Sqrt-Div":
            nodes.append(oh.make_node("Sqrt", ["ss"], ["norm"]))
            norm = "norm"
        nodes += [oh.make_node("Add", [norm, "eps"], ["guarded"]), oh.make_node("Div", ["h", "guarded"], ["y"])]
    model = _model(nodes, inits, [3, 4], [3, 4] if guard != "Log" else [1, 1])
    result, out = convert(model)
    check_full(out)
    kept = {k.op_type: k.reason for k in result.report.kept_fp32}
    assert "flush to zero" in kept["Add"] and "beyond" not in kept["Add"]
    assert initializer_types(out)["eps"] == FLOAT
    emulated = emulate_low_precision(out)
    for x in (_feeds([3, 4])["x"], np.zeros((3, 4), np.float32)):  # a zero row: only eps guards it
        got, expected = run(emulated, {"x": x})[0], run(model, {"x": x})[0]
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * max(1.0, float(np.abs(expected).max())))


@pytest.mark.parametrize("reader", ["Log", "Div", "Relu"])
def test_a_clip_bound_that_flushes_saturates_only_where_it_guards_nothing(reader: str) -> None:
    """`log(clip(mel, 1e-9, 1e9))`, as log-mel front ends write it: in float16 the lower bound
    flushes to 0 and silent frames give log(0) = -inf, so the Clip keeps its FP32 bounds where
    its output reaches a logarithm or divisor; before a Relu the flushed bound changes nothing
    and the Clip converts (its upper bound saturates to the float16 maximum either way)."""
    rng = np.random.default_rng(5)
    inits = {"w": np.abs(rng.normal(size=(4, 4))), "lo": np.array(TINY), "hi": np.array(1e9)}
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"]), oh.make_node("Clip", ["h", "lo", "hi"], ["c"])]
    if reader == "Div":
        nodes.append(oh.make_node("Div", ["x", "c"], ["y"]))
    else:
        nodes.append(oh.make_node(reader, ["c"], ["y"]))
    model = _model(nodes, inits, [3, 4], [3, 4])
    result, out = convert(model)
    check_full(out)
    clip = next(d for n, d in result.plan.decisions.items() if n.op_type == "Clip")
    guards = reader != "Relu"
    assert (clip.precision.value == "fp32") == guards, clip
    if guards:
        assert "flush to zero" in clip.reason and initializer_types(out)["lo"] == FLOAT
    x = np.abs(_feeds([3, 4])["x"]) + 0.5
    x[1] = 0.0  # silence: only the bound keeps the log finite
    got, expected = run(out, {"x": x})[0], run(model, {"x": x})[0]
    assert np.isfinite(got).all() == np.isfinite(expected).all()
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)


def test_a_flushing_fill_value_is_no_overflow() -> None:
    """ConstantOfShape filled with 1e-9 and added: converts, and no reason calls it out of range."""
    rng = np.random.default_rng(4)
    model = _model(
        [
            oh.make_node("MatMul", ["x", "w"], ["h"]),
            oh.make_node("Shape", ["h"], ["s"]),
            oh.make_node(
                "ConstantOfShape", ["s"], ["f"], value=numpy_helper.from_array(np.array([TINY], np.float32))
            ),
            oh.make_node("Add", ["h", "f"], ["a"]),
            oh.make_node("Mul", ["a", "f"], ["y"], name="product"),
        ],
        {"w": rng.normal(size=(4, 4)) * 0.5},
        [3, 4], [3, 4],
    )
    result, out = convert(model)
    check_full(out)
    decisions = {n.op_type: d for n, d in result.plan.decisions.items()}
    assert decisions["MatMul"].precision.value == "low"
    # The Add could convert (the fill value is only added); the Mul reading it stays FP32.
    assert decisions["Add"].category.value != "out-of-range constant"
    assert decisions["Mul"].precision.value == "fp32" and "fill value" in decisions["Mul"].reason
    assert not any("beyond" in reason for reason in _reasons(result))
    feeds = _feeds([3, 4])
    # The product is TINY times the Add's output: its float16 rounding, scaled by TINY.
    np.testing.assert_allclose(run(out, feeds)[0], run(model, feeds)[0], rtol=1e-2, atol=1e-2 * TINY)


# -- PyTorch modules ----------------------------------------------------------------------------

torch = pytest.importorskip("torch")
nn = torch.nn


def _cbn(i: int, o: int, k: int = 1, s: int = 1, groups: int = 1, act: type | None = nn.Hardswish) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(i, o, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(o),
        act() if act is not None else nn.Identity(),
    )


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduced: int, act: type = nn.ReLU, gate: type = nn.Hardsigmoid) -> None:
        super().__init__()
        self.fc1, self.act = nn.Conv2d(channels, reduced, 1), act()
        self.fc2, self.gate = nn.Conv2d(reduced, channels, 1), gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(self.act(self.fc1(x.mean((2, 3), keepdim=True)))))


class _InvertedResidual(nn.Module):
    def __init__(self, i: int, expanded: int, o: int, stride: int, se: bool, act: type) -> None:
        super().__init__()
        self.residual = stride == 1 and i == o
        layers = [_cbn(i, expanded, act=act)] if expanded != i else []
        layers += [_cbn(expanded, expanded, 3, stride, expanded, act=act)]
        if se:
            layers.append(_SqueezeExcite(expanded, max(8, expanded // 4)))
        layers.append(_cbn(expanded, o, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class MobileNetV3Like(nn.Module):
    """torchvision's MobileNetV3-Small layout, narrower: hardswish, SE blocks with hardsigmoid."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        settings = [(16, 16, 16, 2, True, nn.ReLU), (16, 64, 24, 2, False, nn.ReLU), (24, 72, 24, 1, False, nn.ReLU),
                    (24, 96, 40, 2, True, nn.Hardswish), (40, 120, 40, 1, True, nn.Hardswish),
                    (40, 144, 48, 1, True, nn.Hardswish)]  # fmt: skip
        self.features = nn.Sequential(_cbn(3, 16, 3, 2), *(_InvertedResidual(*s) for s in settings), _cbn(48, 96))
        self.classifier = nn.Sequential(nn.Linear(96, 128), nn.Hardswish(), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


class _MBConv(nn.Module):
    def __init__(self, i: int, o: int, expand: int, stride: int) -> None:
        super().__init__()
        mid = i * expand
        self.residual = stride == 1 and i == o
        layers = [_cbn(i, mid, act=nn.SiLU)] if expand != 1 else []
        layers += [
            _cbn(mid, mid, 3, stride, mid, act=nn.SiLU),
            _SqueezeExcite(mid, max(1, i // 4), nn.SiLU, nn.Sigmoid),
            _cbn(mid, o, act=None),
        ]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class EfficientNetLike(nn.Module):
    """torchvision's EfficientNet-B0 layout, shorter: MBConv with SiLU and sigmoid SE."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        blocks = [_MBConv(16, 16, 1, 1), _MBConv(16, 24, 6, 2), _MBConv(24, 24, 6, 1), _MBConv(24, 40, 6, 2),
                  _MBConv(40, 40, 6, 1)]  # fmt: skip
        self.features = nn.Sequential(_cbn(3, 16, 3, 2, act=nn.SiLU), *blocks, _cbn(40, 128, act=nn.SiLU))
        self.classifier = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


class _LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _CNBlock(nn.Module):
    """torchvision's ConvNeXt block: depthwise 7x7, LayerNorm, MLP, layer scale (init 1e-6)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(self.norm(self.dwconv(x).permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        return x + self.layer_scale * y


class ConvNeXtLike(nn.Module):
    """torchvision's ConvNeXt layout, two stages of three blocks."""

    def __init__(self, classes: int = 10, dims: tuple[int, int] = (24, 48)) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), _LayerNorm2d(dims[0], eps=1e-6))]
        layers += [_CNBlock(dims[0]) for _ in range(3)]
        layers += [nn.Sequential(_LayerNorm2d(dims[0], eps=1e-6), nn.Conv2d(dims[0], dims[1], 2, 2))]
        layers += [_CNBlock(dims[1]) for _ in range(3)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.LayerNorm(dims[1], eps=1e-6), nn.Linear(dims[1], classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


MODULES = {"mobilenet_v3": MobileNetV3Like, "efficientnet": EfficientNetLike, "convnext": ConvNeXtLike}


def _tiny(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Values of magnitude 1e-8 to 2.5e-8 (all flush to zero in float16), random signs."""
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return sign * 1e-8 * (1 + 1.5 * torch.rand(shape, generator=gen))


def _with_tiny_parameters(module: nn.Module, seed: int = 0) -> nn.Module:
    """Trained-looking statistics, with every other bias (BatchNorm shifts, which the TorchScript
    exporter folds into the Conv bias, SE and classifier biases) and the layer scales of every
    other ConvNeXt block decayed to ~1e-8; the other layer scales keep torchvision's 1e-6."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        biased = [m for m in module.modules() if isinstance(m, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)) and m.bias is not None]
        for i, m in enumerate(biased):
            if isinstance(m, nn.BatchNorm2d):
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            if i % 2 == 0:
                m.bias.copy_(_tiny(m.bias.shape, gen))
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.zero_()  # the folded Conv bias is the tiny shift itself
        blocks = [m for m in module.modules() if isinstance(m, _CNBlock)]
        for block in blocks[::2]:
            block.layer_scale.copy_(_tiny(block.layer_scale.shape, gen))
    return module.eval()


def _module(name: str) -> nn.Module:
    torch.manual_seed(0)
    return _with_tiny_parameters(MODULES[name]())


def _images(batch: int = 8, size: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, 3, size, size)).astype(np.float32)


def _export(module: nn.Module, path: Path) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, (torch.from_numpy(_images(2)),), str(path), dynamo=False, opset_version=17,
            input_names=["x"], output_names=["logits"], dynamic_axes={"x": {0: "batch"}},
        )
    return onnx.load(str(path))


def _no_flush_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner with the flush-to-zero rule off: flushing constants count as representable."""
    original = plan_module.constant_range

    def representable(value: ir.Value, target: object) -> ConstantRange | None:
        found = original(value, target)  # type: ignore[arg-type]
        if found is None or not found.significant_flush:
            return found
        return ConstantRange(found.absmax, found.overflow, 0, 0.0, False)

    monkeypatch.setattr(plan_module, "constant_range", representable)


def _accuracy(fp32: onnx.ModelProto, converted: onnx.ModelProto, images: np.ndarray) -> tuple[float, float]:
    """(max |logit difference| / max |logit|, top-1 agreement) of the emulated float16 model
    against FP32."""
    expected = run(fp32, {"x": images})[0]
    actual = run(emulate_low_precision(converted), {"x": images})[0]
    error = float(np.abs(actual - expected).max() / np.abs(expected).max())
    return error, float(np.mean(actual.argmax(1) == expected.argmax(1)))


def _flush_only_constants(model: onnx.ModelProto) -> set[str]:
    names = set()
    for init in model.graph.initializer:
        array = numpy_helper.to_array(init)
        if array.dtype == np.float32 and array.size:
            low = array.astype(np.float16)
            if np.isfinite(low).all() and ((low == 0) & (array != 0)).any():
                names.add(init.name)
    return names


@pytest.mark.parametrize("name", list(MODULES))
def test_cnn_with_flushing_biases_and_layer_scales(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module(name)
    fp32 = _export(module, tmp_path / f"{name}.onnx")
    tiny = _flush_only_constants(fp32)
    assert len(tiny) >= 3, tiny  # the export holds constants that flush to zero in float16
    convs = sum(1 for n in fp32.graph.node if n.op_type == "Conv")

    result, converted = convert(fp32, runtime="ort-cuda")
    check_full(converted)
    low_convs = result.report.low_by_op.get("Conv", 0)
    assert low_convs >= 0.95 * convs, (low_convs, convs, result.report.format_text(40))
    # Only products of a flushing layer scale stay FP32 (one Mul per such ConvNeXt block).
    kept = {k.op_type for k in result.report.kept_fp32 if k.category == "out-of-range constant"}
    assert kept <= {"Mul"}, result.report.format_text(40)
    # No reason calls an underflow an overflow.
    reasons = _reasons(result)
    assert not [r for r in reasons if "beyond" in r and any(t in r for t in tiny)], reasons
    assert not [r for r in reasons if "beyond the fp16 range" in r]

    images = _images(16, seed=1)
    error, top1 = _accuracy(fp32, converted, images)
    _no_flush_rule(monkeypatch)
    reference_result, reference = convert(fp32, runtime="ort-cuda")
    assert reference_result.report.low_by_op.get("Conv", 0) == convs
    reference_error, reference_top1 = _accuracy(fp32, reference, images)
    # The same accuracy as converting the flushing constants too (within float16 noise).
    assert error <= 1.25 * reference_error + 1e-4, (error, reference_error)
    assert top1 >= reference_top1 - 1 / 16, (top1, reference_top1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODULES))
def test_convert_module_calibrates_and_converts_the_convs(name: str) -> None:
    """The dynamo export (BatchNormalization kept, biases as they are), calibrated on the
    example inputs: measured products of a flushing layer scale stay FP32, nothing else does."""
    module = _module(name)
    images = torch.from_numpy(_images(4, seed=2))
    result = mixprec.convert_module(module, (images,), target_dtype="fp16")
    convs = sum(1 for n in result.model.graph if n.op_type == "Conv")
    assert result.report.low_by_op.get("Conv", 0) >= 0.95 * convs, result.report.format_text(40)
    assert {k.op_type for k in result.report.kept_fp32 if "range" in k.category} <= {"Mul"}
    (output,) = result.report.validation.module_outputs
    assert output.nan_count == 0 and output.scaled_error < 1e-2, output


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_constant_ranges_measured_together_equal_one_at_a_time(tmp_path: Path, target: str) -> None:
    """The planner measures many constants at once (small ones in batches, read from their
    external file with one open file): every range equals the one-tensor measurement, for
    overflow, flush, infinities, NaN, empty tensors and tensors larger than a batch."""
    from mixprec.analysis.constants import constant_ranges, measured_range, tensor_range
    from mixprec.dtypes import parse_low_precision

    low = parse_low_precision(target)
    rng = np.random.default_rng(0)
    specials = np.array([0.0, 1e-8, -1e-9, 3e-8, 7e5, -7e5, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 1e-40, 3e38], np.float32)
    arrays = []
    for _ in range(400):
        a = (rng.standard_normal(int(rng.integers(0, 40))) * 10.0 ** int(rng.integers(-10, 6))).astype(np.float32)
        if a.size and rng.random() < 0.5:
            a[rng.integers(0, a.size, 3)] = rng.choice(specials, 3)
        arrays.append(a)
    arrays.append(np.concatenate([rng.standard_normal(70000), [1e-9, 1e6]]).astype(np.float32))
    graph = oh.make_graph(
        [oh.make_node("Identity", ["x"], ["y"])], "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(a, f"c{i}") for i, a in enumerate(arrays)],
    )
    path = tmp_path / "m.onnx"
    onnx.save(oh.make_model(graph), str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    values = list(ir.load(path).graph.initializers.values())
    assert all(isinstance(v.const_value, ir.ExternalTensor) for v in values if v.const_value.size)
    constant_ranges(values, low)
    for value, array in zip(values, arrays):
        assert measured_range(value, low) == tensor_range(ir.Tensor(array), low), value.name


def test_a_constant_read_from_a_truncated_data_file_is_an_error_not_short_data(tmp_path: Path) -> None:
    from mixprec.analysis.constants import iter_chunks

    (tmp_path / "w.data").write_bytes(np.arange(10, dtype=np.float32).tobytes())
    whole = ir.ExternalTensor("w.data", offset=8, length=32, dtype=ir.DataType.FLOAT, shape=ir.Shape([8]), name="w", base_dir=tmp_path)
    np.testing.assert_array_equal(np.concatenate(list(iter_chunks(whole))), np.arange(2, 10, dtype=np.float32))
    cut = ir.ExternalTensor("w.data", offset=8, length=40, dtype=ir.DataType.FLOAT, shape=ir.Shape([10]), name="w", base_dir=tmp_path)
    with pytest.raises(OSError, match="shorter than declared"):
        list(iter_chunks(cut))


def test_a_clone_gets_the_measured_ranges_and_a_replaced_constant_forgets_its_own() -> None:
    from mixprec.analysis.constants import constant_ranges, copy_ranges, measured_range, replace_constant
    from mixprec.dtypes import parse_low_precision

    low = parse_low_precision("float16")
    graph = oh.make_graph(
        [oh.make_node("Add", ["x", "w"], ["y"])], "g",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(np.array([1e-9, 2.0, 7e5], np.float32), "w")],
    )
    model = ir.serde.deserialize_model(oh.make_model(graph))
    w = model.graph.initializers["w"]
    constant_ranges([w], low)
    found = measured_range(w, low)
    assert found is not None and found.overflow == 1 and found.flushed == 1
    clone = model.clone()
    copy_ranges(model, clone)
    assert measured_range(clone.graph.initializers["w"], low) == found
    replace_constant(w, ir.Tensor(np.ones(3, np.float32)))
    assert measured_range(w, low) is None and measured_range(clone.graph.initializers["w"], low) == found


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_constants_measured_together_overflow_where_a_cast_makes_them_inf(target: str) -> None:
    """The batched range reading counts as overflowing exactly the elements a cast to the 16-bit
    type makes inf: from half a step past its largest value (ties go up from an odd
    significand), not the largest value itself, and never an inf or NaN already there."""
    from mixprec.analysis.constants import constant_ranges, measured_range  # noqa: PLC0415
    from mixprec.dtypes import parse_low_precision  # noqa: PLC0415

    low = parse_low_precision(target)
    edge = np.float32(low.limits.overflow_from)
    below = np.nextafter(edge, np.float32(0))
    samples = {
        "edge": np.array([edge, -edge, below], np.float32),
        "below": np.array([below, -below, low.limits.max], np.float32),
        "nonfinite": np.array([np.inf, np.nan, 1.0], np.float32),
        "random": np.random.default_rng(0).normal(0, float(edge) / 2, 10_000).astype(np.float32),
    }
    values = {name: ir.Value(name=name, const_value=ir.Tensor(array)) for name, array in samples.items()}
    constant_ranges(values.values(), low)
    for name, array in samples.items():
        with np.errstate(over="ignore", invalid="ignore"):
            cast = array.astype(low.numpy_dtype).astype(np.float32)
        expected = int((np.isfinite(array) & np.isinf(cast)).sum())
        assert measured_range(values[name], low).overflow == expected, name
    assert measured_range(values["edge"], low).overflow == 2 and measured_range(values["below"], low).overflow == 0
