"""Normalization scales folded into the weights of the matrix products that read them
(`mixprec.passes.norm_scales`): the scale is not rounded to 16 bits on its own, the outputs get
closer to FP32, and nothing folds where the identity `(n * g) @ W == n @ (g * W)` does not hold
or the folded weights would not fit the type."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from helpers import check_full, convert, run
from mixprec.cli import main as cli_main
from mixprec.validate.emulate import emulate_low_precision

HIDDEN, OUT = 64, 32
_SHAPES = {"q": [8, OUT], "k": [8, OUT], "p": [8, OUT], "r": [8, HIDDEN], "qt": [HIDDEN, OUT]}


def _weights(seed: int = 0, gamma_scale: float = 1.0, weight_scale: float = 0.05) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # Scales just short of halfway between two float16 numbers: rounding loses ~4.9e-4 of each.
    gamma = (1.0 + (rng.integers(0, 512, HIDDEN) + 0.49) / 1024).astype(np.float32) * gamma_scale
    return {
        "g": gamma,
        "wq": (rng.standard_normal((HIDDEN, OUT)) * weight_scale).astype(np.float32),
        "wk": (rng.standard_normal((OUT, HIDDEN)) * weight_scale).astype(np.float32),
        "b": (rng.standard_normal(HIDDEN) * 0.1).astype(np.float32),
    }


def _model(body: list[onnx.NodeProto], outputs: list[str], weights: dict[str, np.ndarray], opset: int = 23) -> onnx.ModelProto:
    graph = onnx.helper.make_graph(
        body,
        "norm",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [8, HIDDEN])],
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, _SHAPES[name]) for name in outputs],
        [numpy_helper.from_array(array, name) for name, array in weights.items()],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def _rms_into_products(weights: dict[str, np.ndarray], extra: list[onnx.NodeProto] = (), outputs: tuple[str, ...] = ()) -> onnx.ModelProto:
    used = {k: v for k, v in weights.items() if k != "b"}
    body = [
        onnx.helper.make_node("RMSNormalization", ["x", "g"], ["y"], axis=-1, epsilon=1e-5, stash_type=1),
        onnx.helper.make_node("MatMul", ["y", "wq"], ["q"]),
        onnx.helper.make_node("Gemm", ["y", "wk"], ["k"], transB=1),
        *extra,
    ]
    return _model(body, ["q", "k", *outputs], used)


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _assert_unfolded(stored: np.ndarray, original: np.ndarray, name: str = "") -> None:
    """The stored scale is the original one in its stored type (16-bit where the normalization
    converts, FP32 where the cast placement keeps it FP32): nothing was multiplied out of it."""
    np.testing.assert_array_equal(stored, original.astype(stored.dtype), err_msg=name)


def _error(original: onnx.ModelProto, converted: onnx.ModelProto, seeds: int = 16) -> float:
    """Root-mean-square error of the emulated 16-bit model's outputs relative to the FP32
    outputs' root mean square, averaged over outputs and input batches."""
    emulated = emulate_low_precision(converted)
    errors = []
    for seed in range(seeds):
        feeds = {"x": np.random.default_rng(100 + seed).standard_normal((8, HIDDEN)).astype(np.float32) * 3}
        for got, want in zip(run(emulated, feeds), run(original, feeds)):
            errors.append(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))
    return float(np.mean(errors))


def test_scale_moves_into_matmul_and_gemm_weights_and_the_error_falls() -> None:
    weights = _weights()
    model = _rms_into_products(weights)
    result, out = convert(model)
    check_full(out)
    stored = _initializers(out)
    g, wq, wk = weights["g"], weights["wq"], weights["wk"]
    assert stored["g"].dtype == np.float16 and np.all(stored["g"] == 1)
    np.testing.assert_array_equal(stored["wq"], (g[:, None] * wq).astype(np.float16))
    np.testing.assert_array_equal(stored["wk"], (wk * g[None, :]).astype(np.float16))
    assert any("folded the scales of 1 normalization(s) into the weights of 2" in n for n in result.report.notes)
    _, kept = convert(model, fold_norm_scales=False)
    assert np.array_equal(_initializers(kept)["g"], g.astype(np.float16))
    folded_error, kept_error = _error(model, out), _error(model, kept)
    assert folded_error < 0.85 * kept_error, (folded_error, kept_error)  # measured 0.73-0.75


def test_bfloat16_folds_too() -> None:
    weights = _weights(seed=1)
    model = _rms_into_products(weights)
    _, out = convert(model, target_dtype="bfloat16")
    check_full(out)
    _, kept = convert(model, target_dtype="bfloat16", fold_norm_scales=False)
    assert _error(model, out) < 0.95 * _error(model, kept)  # measured 0.87-0.90


def test_no_fold_where_another_node_reads_the_normalized_value() -> None:
    weights = _weights()
    model = _rms_into_products(weights, [onnx.helper.make_node("Add", ["y", "x"], ["r"])], ("r",))
    result, out = convert(model)
    _assert_unfolded(_initializers(out)["g"], weights["g"])
    assert not any("folded the scales" in n for n in result.report.notes)


def test_no_fold_where_a_weight_is_shared() -> None:
    weights = _weights()
    body = [
        onnx.helper.make_node("RMSNormalization", ["x", "g"], ["y"], axis=-1, stash_type=1),
        onnx.helper.make_node("MatMul", ["y", "wq"], ["q"]),
        onnx.helper.make_node("MatMul", ["x", "wq"], ["p"]),
    ]
    _, out = convert(_model(body, ["q", "p"], {"g": weights["g"], "wq": weights["wq"]}))
    stored = _initializers(out)
    np.testing.assert_array_equal(stored["g"], weights["g"].astype(np.float16))
    np.testing.assert_array_equal(stored["wq"], weights["wq"].astype(np.float16))


def test_layer_normalization_folds_without_bias_only() -> None:
    weights = _weights()
    without = _model(
        [
            onnx.helper.make_node("LayerNormalization", ["x", "g"], ["y"], axis=-1),
            onnx.helper.make_node("MatMul", ["y", "wq"], ["q"]),
        ],
        ["q"], {"g": weights["g"], "wq": weights["wq"]}, opset=17,
    )
    _, out = convert(without)
    check_full(out)
    assert np.all(_initializers(out)["g"] == 1)
    with_bias = _model(
        [
            onnx.helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1),
            onnx.helper.make_node("MatMul", ["y", "wq"], ["q"]),
        ],
        ["q"], {"g": weights["g"], "b": weights["b"], "wq": weights["wq"]}, opset=17,
    )
    _, out = convert(with_bias)
    np.testing.assert_array_equal(_initializers(out)["g"], weights["g"].astype(np.float16))


def test_no_fold_where_the_folded_weights_would_leave_the_float16_range() -> None:
    # 300 x up to ~200: beyond half the float16 maximum; bfloat16 has room.
    weights = _weights(gamma_scale=300.0, weight_scale=50.0)
    model = _rms_into_products(weights)
    _, out = convert(model)
    np.testing.assert_array_equal(_initializers(out)["g"], weights["g"].astype(np.float16))
    _, out = convert(model, target_dtype="bfloat16")
    assert np.all(_initializers(out)["g"].astype(np.float32) == 1)


def test_cli_keeps_the_scales_when_asked(tmp_path) -> None:  # noqa: ANN001
    weights = _weights()
    source = tmp_path / "norm.onnx"
    onnx.save(_rms_into_products(weights), source)
    for flags, folded in (([], True), (["--keep-norm-scales"], False)):
        target = tmp_path / f"out{len(flags)}.onnx"
        assert cli_main(["convert", str(source), str(target), "--runtime", "onnx", "--validate", "checker", *flags]) == 0
        scale = _initializers(onnx.load(target))["g"]
        assert bool(np.all(scale == 1)) is folded


def test_folded_weights_are_computed_chunk_by_chunk_from_external_data(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # A weight in an external file, read in chunks that cut rows apart: every chunk is scaled
    # along the right axis, and the whole tensor equals the FP32 product.
    import onnx_ir as ir  # noqa: PLC0415

    from mixprec.analysis import constants  # noqa: PLC0415

    monkeypatch.setattr(constants, "_CHUNK_BYTES", 4 * 37)
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((3, 8, 6)).astype(np.float32)
    (tmp_path / "w.bin").write_bytes(weight.tobytes())
    source = ir.ExternalTensor("w.bin", 0, weight.nbytes, ir.DataType.FLOAT, shape=ir.Shape(weight.shape), name="w", base_dir=tmp_path)
    for axis, size in ((1, 8), (2, 6), (0, 3)):
        gamma = rng.uniform(0.5, 2.0, size).astype(np.float32)
        shape = [1, 1, 1]
        shape[axis] = size
        expected = weight * gamma.reshape(shape)
        scaled = constants.ScaledTensor(source, gamma, axis)
        chunks = list(constants.iter_chunks(scaled))
        assert len(chunks) > 1
        np.testing.assert_array_equal(np.concatenate(chunks).reshape(weight.shape), expected)
        np.testing.assert_array_equal(scaled.numpy(), expected)


def _rms_then(readers: list[onnx.NodeProto], outputs: list[str], weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    norm = onnx.helper.make_node("RMSNormalization", ["x", "g"], ["y"], name="norm", axis=-1, stash_type=1)
    return _model([norm, *readers], outputs, weights)


def test_no_fold_where_the_identity_does_not_hold() -> None:
    weights = _weights()
    g, wq = weights["g"], weights["wq"]
    square = (np.random.default_rng(4).standard_normal((HIDDEN, HIDDEN)) * 0.05).astype(np.float32)
    cases = {
        # The normalized value is a model output as well.
        "graph output": _model(
            [onnx.helper.make_node("RMSNormalization", ["x", "g"], ["r"], axis=-1), onnx.helper.make_node("MatMul", ["r", "wq"], ["q"])],
            ["q", "r"], {"g": g, "wq": wq},
        ),
        # Gemm transposes the normalized value: it contracts over tokens, the scale would land
        # on the output's rows.
        "transA": _rms_then([onnx.helper.make_node("Gemm", ["y", "b"], ["qt"], transA=1)], ["qt"], {"g": g, "b": square[:8, :OUT].copy()}),
        # The normalized value is the right-hand operand of the MatMul.
        "input B": _rms_then([onnx.helper.make_node("MatMul", ["sq", "y"], ["r"])], ["r"], {"g": g, "sq": square[:8, :8].copy()}),
    }
    for name, model in cases.items():
        result, out = convert(model)
        assert not any("folded the scales" in n for n in result.report.notes), name
        _assert_unfolded(_initializers(out)["g"], g, name)
    # A normalization kept FP32 keeps its FP32 scale: nothing rounds it.
    _, excluded = convert(_rms_then([onnx.helper.make_node("MatMul", ["y", "wq"], ["q"])], ["q"], {"g": g, "wq": wq}), exclude_nodes=["norm"])
    stored = _initializers(excluded)
    assert stored["g"].dtype == np.float32 and np.array_equal(stored["g"], g)
    np.testing.assert_array_equal(stored["wq"], wq.astype(np.float16))


def test_skip_simplified_layer_normalization_folds_its_gamma() -> None:
    # onnxruntime's contrib op: gamma is input 2 (op facts), output 0 is the normalized value,
    # output 3 (input + skip) does not involve gamma and may be read anywhere.
    weights = _weights()
    g, wq = weights["g"], weights["wq"]
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node(
                "SkipSimplifiedLayerNormalization", ["x", "s", "g"], ["y", "", "", "sum"], domain="com.microsoft", epsilon=1e-5,
            ),
            onnx.helper.make_node("MatMul", ["y", "wq"], ["q"]),
        ],
        "skip",
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [8, HIDDEN]) for n in ("x", "s")],
        [onnx.helper.make_tensor_value_info("q", onnx.TensorProto.FLOAT, [8, OUT]), onnx.helper.make_tensor_value_info("sum", onnx.TensorProto.FLOAT, [8, HIDDEN])],
        [numpy_helper.from_array(g, "g"), numpy_helper.from_array(wq, "wq")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.microsoft", 1)])
    result, out = convert(model, runtime="ort-cuda")
    stored = _initializers(out)
    assert np.all(stored["g"] == 1), result.report.format_text()
    np.testing.assert_array_equal(stored["wq"], (g[:, None] * wq).astype(np.float16))


def test_folded_model_runs_in_onnxruntime_as_users_run_it() -> None:
    # The scale folds into the float16 weights; the validation runs the result with default
    # session options in a child process and compares it with the FP32 model.
    import mixprec  # noqa: PLC0415

    weights = _weights()
    model = _rms_into_products(weights)
    data = [{"x": np.random.default_rng(s).standard_normal((8, HIDDEN)).astype(np.float32)} for s in range(3)]
    result = mixprec.convert(model, runtime="ort-cuda", validate="run", data=data, calibrate=False)
    assert any("folded the scales of 1 normalization(s)" in n for n in result.report.notes)
    validation = result.report.validation
    assert validation.runtime.startswith("ran") and validation.batches == 3
    real = validation.real_outputs
    assert [o.name for o in real] == ["q", "k"] and all(o.nan_count == 0 and o.inf_count == 0 for o in real)
    # Scale stored as ones, the float16 weights holding it (measured 3.6e-4 of max |FP32|).
    assert max(o.scaled_error for o in real) < 2e-3


def test_scale_folds_into_fp32_weights_of_products_kept_fp32() -> None:
    """A float16 normalization (its input comes from a float16 product) whose readers are kept
    FP32: its scale folds into their FP32 weights, multiplied in FP32 and not rounded."""
    weights = _weights()
    w0 = (np.random.default_rng(7).standard_normal((HIDDEN, HIDDEN)) * 0.1).astype(np.float32)
    body = [
        onnx.helper.make_node("MatMul", ["x", "w0"], ["x0"], name="pre"),
        onnx.helper.make_node("RMSNormalization", ["x0", "g"], ["y"], axis=-1, epsilon=1e-5, stash_type=1, name="norm"),
        onnx.helper.make_node("MatMul", ["y", "wq"], ["q"], name="q"),
        onnx.helper.make_node("Gemm", ["y", "wk"], ["k"], transB=1, name="k"),
    ]
    model = _model(body, ["q", "k"], {"w0": w0, "g": weights["g"], "wq": weights["wq"], "wk": weights["wk"]})
    result, out = convert(model, exclude_nodes=["q", "k"])
    assert any("folded the scales of 1 normalization(s)" in n for n in result.report.notes)
    stored = _initializers(out)
    assert stored["g"].dtype == np.float16 and np.all(stored["g"] == 1)
    assert stored["wq"].dtype == np.float32 and stored["wk"].dtype == np.float32
    np.testing.assert_array_equal(stored["wq"], weights["g"][:, None] * weights["wq"])
    np.testing.assert_array_equal(stored["wk"], weights["wk"] * weights["g"][None, :])
    check_full(out)
