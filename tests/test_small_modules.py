"""Small modules alone: `mixprec.tolerance`, the per-runtime TOML reader
(`mixprec.policy.toml_tables`), the ONNX checker wrappers (`mixprec.validate.checker`), the
model views (`mixprec.io.views`) and the progress line (`mixprec.progress`)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import pytest
from onnx import TensorProto, numpy_helper

from mixprec.errors import InputError, PolicyError
from mixprec.io.views import typed_values, wants_external_data, weight_bytes, weight_free_proto
from mixprec.policy.toml_tables import parse_toml, runtime_sections
from mixprec.progress import Progress, _fmt
from mixprec.tolerance import Tolerance, as_tolerance
from mixprec.validate.checker import checker_error, input_problem

from helpers import relu_model

F32 = TensorProto.FLOAT

# -- tolerance ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"atol": -1e-3}, {"rtol": float("inf")}, {"atol": float("nan")},
        {"min_cosine": 1.5}, {"min_cosine": -1.01}, {"topk_agreement": -0.1}, {"topk_agreement": 1.01},
    ],
)
def test_tolerance_rejects_out_of_range_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(InputError, match=next(iter(kwargs))):
        Tolerance(**kwargs)


def test_tolerance_allclose_fills_the_unset_side_with_zero() -> None:
    assert Tolerance(atol=0.01).allclose == (0.01, 0.0)
    assert Tolerance(rtol=0.02).allclose == (0.0, 0.02)
    assert Tolerance(min_cosine=0.99).allclose is None


def test_tolerance_empty_describe_and_outputs() -> None:
    assert Tolerance().empty and Tolerance().describe() == "no numeric criterion"
    assert not Tolerance(topk_agreement=1.0).empty
    full = Tolerance(atol=1e-3, rtol=0.5, min_cosine=0.999, topk_agreement=0.9, outputs=["a", "b"])  # type: ignore[arg-type]
    assert full.describe() == "atol=0.001, rtol=0.5, cosine>=0.999, top-1 agreement>=0.9"
    assert full.outputs == ("a", "b")
    assert Tolerance(min_cosine=-1.0, topk_agreement=0.0).describe() == "cosine>=-1, top-1 agreement>=0"


def test_as_tolerance() -> None:
    """A pair becomes (atol, rtol); a Tolerance and None pass through; anything else is an error."""
    assert as_tolerance((1e-3, "0.01")) == Tolerance(atol=1e-3, rtol=0.01)
    same = Tolerance(min_cosine=0.9)
    assert as_tolerance(same) is same
    assert as_tolerance(None) is None
    for bad in ("abc", (1.0, 2.0, 3.0), ("x", 1.0), 0.01):
        with pytest.raises(InputError, match="pair"):
            as_tolerance(bad)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="atol"):
        as_tolerance((-1.0, 0.0))


# -- per-runtime TOML tables --------------------------------------------------------------------


def test_parse_toml_names_the_source_on_error() -> None:
    assert parse_toml('[default]\nx = 1\n', "t.toml") == {"default": {"x": 1}}
    with pytest.raises(PolicyError, match=r"^t\.toml: not valid TOML"):
        parse_toml("[default\n", "t.toml")


def test_runtime_sections_yields_checked_tables_in_order() -> None:
    document = parse_toml('[default]\na = 1\n[ort-cpu]\na = 2\nb = "x"\n', "t.toml")
    sections = list(runtime_sections(document, "t.toml", required=["a"], optional=["b"]))
    assert sections == [
        ("default", {"a": 1}, "t.toml: [default]"),
        ("ort-cpu", {"a": 2, "b": "x"}, "t.toml: [ort-cpu]"),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[ort-cpu]\na = 1\n', r"t\.toml: a \[default\] table is required"),
        ('[default]\na = 1\n[onnxruntime]\na = 1\n', r"\[onnxruntime\]: not a runtime profile \(one of .*ort-cpu"),
        ('default = 3\n', r"\[default\]: expected a table, got 3"),
        ('[default]\n', r"\[default\]: missing key 'a'"),
        ('[default]\na = 1\nzz = 2\n', r"\[default\]: unknown key 'zz'"),
        ('[default]\na = 1\n[tensorrt]\nzz = 2\n', r"\[tensorrt\]: unknown key 'zz'"),
    ],
    ids=["no-default", "unknown-runtime", "not-a-table", "missing-key", "unknown-key", "unknown-before-missing"],
)
def test_runtime_sections_rejects(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        list(runtime_sections(parse_toml(text, "t.toml"), "t.toml", required=["a"]))


# -- ONNX checker ---------------------------------------------------------------------------------


def test_checker_error_valid_and_invalid(tmp_path: Path) -> None:
    """None for a valid model (proto or file); the first error line for an undefined input."""
    assert checker_error(relu_model()) is None
    path = tmp_path / "ok.onnx"
    onnx.save(relu_model(), str(path))
    assert checker_error(path) is None
    error = checker_error(relu_model(input_name="missing"))
    assert error is not None and "missing" in error and "\n" not in error


def test_checker_error_full_check_runs_strict_type_inference() -> None:
    """A declared output type that contradicts inference fails only the full check."""
    wrong = relu_model(output_type=TensorProto.INT64)
    assert checker_error(wrong, full_check=False) is None
    assert checker_error(wrong) is not None


def test_input_problem() -> None:
    """Valid: None. Structurally invalid: the structural error. Only strict inference objects
    and onnxruntime cannot load it either: the strict error."""
    assert input_problem(relu_model()) is None
    structural = input_problem(relu_model(input_name="missing"))
    assert structural is not None and structural == checker_error(relu_model(input_name="missing"), full_check=False)
    wrong = relu_model(output_type=TensorProto.INT64)
    strict = input_problem(wrong)
    assert strict is not None and strict == checker_error(wrong)


# -- model views ----------------------------------------------------------------------------------


def _weighted_model() -> ir.Model:
    """Initializers big (400 float32 = 1600 bytes) and small (4 bytes), a Constant of 8 float32,
    and an If whose branch holds a Constant of 2 int64."""
    then_branch = oh.make_graph(
        [oh.make_node("Constant", [], ["t"], value=numpy_helper.from_array(np.array([1, 2], np.int64)))],
        "then", [], [oh.make_tensor_value_info("t", TensorProto.INT64, [2])],
    )
    else_branch = oh.make_graph(
        [oh.make_node("Constant", [], ["e"], value=numpy_helper.from_array(np.array([3, 4], np.int64)))],
        "else", [], [oh.make_tensor_value_info("e", TensorProto.INT64, [2])],
    )
    nodes = [
        oh.make_node("MatMul", ["x", "big"], ["h"], name="mm"),
        oh.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones(8, np.float32)), name="const"),
        oh.make_node("Mul", ["h", "small"], ["m"], name="mul"),
        oh.make_node("ReduceSum", ["m"], ["s"], name="rs", keepdims=0),
        oh.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
        oh.make_node("If", ["cond"], ["branch"], name="if", then_branch=then_branch, else_branch=else_branch),
    ]
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", F32, [1, 4])],
        [oh.make_tensor_value_info("m", F32, [1, 100]), oh.make_tensor_value_info("c", F32, [8]),
         oh.make_tensor_value_info("branch", TensorProto.INT64, [2])],
        [numpy_helper.from_array(np.ones((4, 100), np.float32), "big"),
         numpy_helper.from_array(np.array(2.0, np.float32), "small"),
         numpy_helper.from_array(np.array(0.0, np.float32), "zero")],
        value_info=[oh.make_tensor_value_info("h", F32, [1, 100])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return ir.from_proto(model)


def test_weight_bytes_counts_initializers_and_constants_in_subgraphs() -> None:
    assert weight_bytes(_weighted_model()) == 1600 + 4 + 4 + 8 * 4 + 2 * 8 * 2


def test_wants_external_data_above_one_gib() -> None:
    model = _weighted_model()
    assert not wants_external_data(model)
    assert wants_external_data(model, weights=(1 << 30) + 1)
    assert not wants_external_data(model, weights=1 << 30)


def test_typed_values_are_the_declared_ones() -> None:
    """h has a value_info; m is a graph output (typed); the Mul/ReduceSum intermediates carry no
    type in a freshly loaded model; initializers are not counted (their tensors carry their
    types, so a saved file needs no value_info for them)."""
    typed = typed_values(_weighted_model())
    assert {"h", "m"} <= typed
    assert not {"s", "cond", "big", "small", "zero"} & typed


def test_weight_free_proto_drops_big_weights_keeps_the_graph_and_restores_the_model() -> None:
    model = _weighted_model()
    before = ir.to_proto(model)
    proto = weight_free_proto(model)
    assert [n.op_type for n in proto.graph.node] == [n.op_type for n in before.graph.node]
    assert [i.name for i in proto.graph.initializer] == ["small", "zero"]
    big_input = next(i for i in proto.graph.input if i.name == "big")
    assert big_input.type.tensor_type.elem_type == F32
    assert [d.dim_value for d in big_input.type.tensor_type.shape.dim] == [4, 100]
    assert len(proto.SerializeToString()) < 1600
    # The model itself is untouched: the weight is an initializer again, not an input.
    assert [v.name for v in model.graph.inputs] == ["x"]
    assert set(model.graph.initializers) == {"big", "small", "zero"}
    np.testing.assert_array_equal(model.graph.initializers["big"].const_value.numpy(), np.ones((4, 100), np.float32))
    after = ir.to_proto(model)  # the same, up to the order of initializers
    assert after.graph.node == before.graph.node and after.graph.input == before.graph.input
    by_name = sorted(after.graph.initializer, key=lambda t: t.name)
    assert by_name == sorted(before.graph.initializer, key=lambda t: t.name)


# -- progress -------------------------------------------------------------------------------------


def test_progress_disabled_writes_nothing() -> None:
    stream = io.StringIO()
    progress = Progress("w", 10, enabled=False, stream=stream)
    progress.advance(10)
    progress.close()
    assert stream.getvalue() == "" and progress.done == 10


def test_progress_draws_share_and_finishes_the_line() -> None:
    stream = io.StringIO()
    progress = Progress("writing", 2000, unit="B", stream=stream, interval=3600)
    progress.advance(500)  # first draw: the last draw is long ago
    progress.advance(500)  # within the interval: no draw
    progress.advance(1000)  # done: always drawn
    progress.close()
    text = stream.getvalue()
    draws = text.split("\r")[1:]
    assert len(draws) == 3
    assert draws[0].startswith("writing:  25.0% (500/2.0kB)")
    assert draws[1].startswith("writing: 100.0% (2.0k/2.0kB)")
    assert text.endswith("\n")


def test_progress_zero_total_is_complete() -> None:
    stream = io.StringIO()
    progress = Progress("x", 0, stream=stream)
    progress.advance(0)
    assert stream.getvalue().startswith("\rx: 100.0% (0/0)")


def test_progress_auto_follows_enabled() -> None:
    assert Progress.auto("x", 1, enabled=False).enabled is False
    assert Progress.auto("x", 1, enabled=True).enabled is True


@pytest.mark.parametrize(
    ("value", "text"), [(0, "0"), (999, "999"), (1000, "1.0k"), (1500, "1.5k"), (2.5e6, "2.5M"), (3e9, "3.0G")]
)
def test_fmt(value: float, text: str) -> None:
    assert _fmt(value) == text


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux) to count file mappings")
def test_small_external_constants_are_read_without_mapping_the_data_file(tmp_path: Path) -> None:
    """Reading many small external constants (normalization scales, epsilons) maps nothing:
    onnx_ir's own `numpy()` maps the whole data file once per tensor, which costs memory per
    tensor and one of the process's limited mappings each."""
    from onnx.external_data_helper import convert_model_to_external_data  # noqa: PLC0415

    from mixprec.analysis.constants import read_array, small_constant_array  # noqa: PLC0415

    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(200)]
    nodes = [onnx.helper.make_node("Add", ["x" if i == 0 else f"y{i - 1}", f"c{i}"], [f"y{i}"]) for i in range(200)]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 5])],
        [onnx.helper.make_tensor_value_info("y199", onnx.TensorProto.FLOAT, [3, 5])],
        [numpy_helper.from_array(a, f"c{i}") for i, a in enumerate(arrays)],
    )
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    convert_model_to_external_data(proto, location="m.data", size_threshold=0)
    onnx.save(proto, str(tmp_path / "m.onnx"))
    model = ir.load(tmp_path / "m.onnx")

    def mappings() -> int:
        return sum("m.data" in line for line in Path("/proc/self/maps").read_text().splitlines())

    before = mappings()
    values = list(model.graph.initializers.values())
    for value, expected in zip(values, arrays):
        np.testing.assert_array_equal(small_constant_array(value), expected)
        np.testing.assert_array_equal(read_array(value.const_value), expected)
    assert mappings() == before
    # A save without external data reads them the same way.
    from mixprec.io import save_model  # noqa: PLC0415

    (tmp_path / "inline").mkdir()
    save_model(model, tmp_path / "inline" / "m.onnx", external_data=False)
    assert mappings() == before
    saved = onnx.load(str(tmp_path / "inline" / "m.onnx"))
    for tensor, expected in zip(saved.graph.initializer, arrays):
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), expected)


def test_a_model_changed_on_load_is_not_read_from_its_file_again(tmp_path: Path) -> None:
    """An IR 3 model (initializers listed as inputs) is changed by `load`: the preparation no
    longer claims to equal the input file, and a model loaded as it is does."""
    from mixprec.config import Config  # noqa: PLC0415
    from mixprec.pipeline import prepare  # noqa: PLC0415

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]), oh.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w],
    )
    for ir_version, expect_file in ((3, False), (8, True)):
        proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 13)])
        proto.ir_version = ir_version
        path = tmp_path / f"ir{ir_version}.onnx"
        onnx.save(proto, str(path))
        prepared = prepare(path, Config())
        assert (prepared.unchanged == path) is expect_file, ir_version
        assert [v.name for v in prepared.model.graph.inputs] == (["x"] if ir_version == 3 else ["x", "w"])
