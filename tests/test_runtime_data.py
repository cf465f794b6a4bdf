"""Tests for mixprec.runtime.data."""

from __future__ import annotations

import inspect
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from mixprec.errors import InputError
from mixprec.runtime.data import (
    InputSpec,
    generate_inputs,
    input_specs,
    load_batches,
    load_expected_outputs,
)


def _model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, [None, 4]),
            helper.make_tensor_value_info("h", TensorProto.BFLOAT16, [2]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, [5]),
            helper.make_tensor_value_info("W", TensorProto.FLOAT, [3]),
            helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT16, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(np.zeros(3, np.float32), "W")],
    )
    return helper.make_model(graph)


EXPECTED = [
    InputSpec("x", np.dtype(np.float32), ("batch", 3)),
    InputSpec("ids", np.dtype(np.int64), (None, 4)),
    InputSpec("h", np.dtype(ml_dtypes.bfloat16), (2,)),
    InputSpec("mask", np.dtype(np.bool_), (5,)),
    InputSpec("seq", np.dtype(np.float16), None, "sequence"),
]


def test_input_specs_from_proto_and_ir_agree() -> None:
    model = _model()
    assert input_specs(model) == EXPECTED
    assert input_specs(ir.from_proto(model)) == EXPECTED


def test_generate_inputs_dtypes_shapes_ranges_and_determinism() -> None:
    specs = EXPECTED[:4]
    feeds = generate_inputs(specs, seed=3, dim_value=7)
    assert list(feeds) == ["x", "ids", "h", "mask"]
    assert feeds["x"].shape == (7, 3) and feeds["x"].dtype == np.float32
    assert feeds["ids"].shape == (7, 4) and feeds["ids"].dtype == np.int64
    assert feeds["ids"].min() >= 0 and feeds["ids"].max() < 4
    assert feeds["h"].dtype == np.dtype(ml_dtypes.bfloat16) and feeds["h"].shape == (2,)
    assert feeds["mask"].dtype == np.bool_

    again = generate_inputs(specs, seed=3, dim_value=7)
    for name in feeds:
        np.testing.assert_array_equal(feeds[name], again[name])
    other_seed = generate_inputs(specs, seed=4, dim_value=7)
    assert not np.array_equal(feeds["x"], other_seed["x"])
    # An input's data does not depend on the other inputs.
    alone = generate_inputs([specs[0]], seed=3, dim_value=7)
    np.testing.assert_array_equal(alone["x"], feeds["x"])

    big = generate_inputs([InputSpec("z", np.dtype(np.float32), (100_000,))])["z"]
    assert abs(float(big.mean())) < 0.02 and abs(float(big.std()) - 1.0) < 0.02


def test_generate_inputs_rejects_non_tensors() -> None:
    with pytest.raises(InputError, match="'seq'"):
        generate_inputs(EXPECTED)
    with pytest.raises(InputError, match="'r'.*rank"):
        generate_inputs([InputSpec("r", np.dtype(np.float32), None)])


def test_npz_file_and_directory_round_trip(tmp_path: Path) -> None:
    batches = [
        {"x": np.full((2, 3), i, np.float32), "ids": np.arange(8).reshape(2, 4) + i}
        for i in range(3)
    ]
    single = tmp_path / "one.npz"
    np.savez(single, **batches[0])
    loaded = list(load_batches(single, ["x", "ids"]))
    assert len(loaded) == 1
    np.testing.assert_array_equal(loaded[0]["ids"], batches[0]["ids"])

    directory = tmp_path / "dir"
    directory.mkdir()
    for i, batch in enumerate(batches):
        np.savez(directory / f"batch_{i:02d}.npz", **batch)
    (directory / "notes.txt").write_text("ignored")
    iterator = load_batches(directory, ["x", "ids"])
    assert inspect.isgenerator(iterator)
    for i, batch in enumerate(iterator):
        assert set(batch) == {"x", "ids"}
        np.testing.assert_array_equal(batch["x"], batches[i]["x"])
    assert i == 2


def test_npz_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, x=np.zeros(2), typo=np.zeros(2))
    with pytest.raises(InputError, match=r"bad\.npz.*'typo'"):
        list(load_batches(path, ["x"]))


def _write_test_set(directory: Path, arrays: list[np.ndarray], names: list[str], role: str) -> None:
    directory.mkdir(parents=True)
    for k, (array, name) in enumerate(zip(arrays, names)):
        tensor = numpy_helper.from_array(array, name)
        (directory / f"{role}_{k}.pb").write_bytes(tensor.SerializeToString())


def test_onnx_test_data_layout_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "model_dir"
    for n in (0, 1, 10, 2):
        x = np.full((1, 2), n, np.float32)
        ids = np.array([n, n + 1], np.int64)
        # Set 1 names its tensors in reverse order to check name matching;
        # set 2 uses names that match nothing, so position decides.
        names = {1: ["ids", "x"], 2: ["a", "b"]}.get(n, ["", ""])
        arrays = [ids, x] if n == 1 else [x, ids]
        _write_test_set(root / f"test_data_set_{n}", arrays, names, "input")
    (root / "model.onnx").write_bytes(b"not read")

    batches = list(load_batches(root, ["x", "ids"]))
    assert [int(b["x"][0, 0]) for b in batches] == [0, 1, 2, 10]
    for batch in batches:
        n = int(batch["x"][0, 0])
        np.testing.assert_array_equal(batch["ids"], [n, n + 1])

    one = list(load_batches(root / "test_data_set_2", ["x", "ids"]))
    assert len(one) == 1 and one[0]["ids"].tolist() == [2, 3]


def test_expected_outputs_keep_bfloat16(tmp_path: Path) -> None:
    directory = tmp_path / "test_data_set_0"
    y = np.array([1.5, -2.0], ml_dtypes.bfloat16)
    z = np.array([[1, 2]], np.int32)
    _write_test_set(directory, [y, z], ["y", "z"], "output")
    outputs = load_expected_outputs(directory, ["y", "z"])
    assert outputs["y"].dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(outputs["y"].astype(np.float32), [1.5, -2.0])
    np.testing.assert_array_equal(outputs["z"], z)
    with pytest.raises(InputError, match="output #1"):
        load_expected_outputs(directory, ["only_one"])


def test_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(InputError, match="missing"):
        load_batches(missing, ["x"])  # raised at the call, not at first next()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="empty"):
        load_batches(empty, ["x"])
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 garbage")
    with pytest.raises(InputError, match=r"corrupt\.npz"):
        list(load_batches(corrupt, ["x"]))
    text = tmp_path / "data.csv"
    text.write_text("1,2")
    with pytest.raises(InputError, match=r"data\.csv"):
        load_batches(text, ["x"])
    bad_pb = tmp_path / "test_data_set_0"
    bad_pb.mkdir()
    (bad_pb / "input_0.pb").write_bytes(b"\xff\xff\xff")
    with pytest.raises(InputError, match="input_0.pb"):
        list(load_batches(bad_pb, ["x"]))
    with pytest.raises(InputError, match="nowhere"):
        load_expected_outputs(tmp_path / "nowhere", ["y"])


def _embedding_model() -> onnx.ModelProto:
    """Token ids reach an embedding of 50 rows through Cast, Unsqueeze and Concat (as exporters
    write them); a second integer input is a shape, a third feeds a smaller table too."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["ids"], ["ids64"], to=TensorProto.INT64),
            helper.make_node("Unsqueeze", ["ids64", "zero"], ["ids_u"]),
            helper.make_node("Concat", ["ids_u", "ids_u"], ["both"], axis=0),
            helper.make_node("Gather", ["table", "both"], ["emb"], axis=0),
            helper.make_node("Gather", ["small", "pos"], ["pe"], axis=1),
            helper.make_node("Gather", ["table", "pos"], ["pe2"], axis=0),
            helper.make_node("Reshape", ["emb", "shape"], ["out"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT32, ["b", "s"]),
            helper.make_tensor_value_info("pos", TensorProto.INT64, ["s"]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.zeros((50, 4), np.float32), "table"),
            numpy_helper.from_array(np.zeros((4, 7), np.float32), "small"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_token_ids_are_drawn_over_the_whole_embedding() -> None:
    """Integer inputs the graph uses as indices into a constant table are drawn from its whole
    size (the smallest of the tables they index), not only 0 and 1; a shape input is not."""
    from mixprec.analysis.input_indices import with_index_limits

    model = _embedding_model()
    for source in (model, ir.serde.deserialize_model(model)):
        limits = {s.name: s.index_limit for s in with_index_limits(input_specs(source), source)}
        assert limits == {"ids": 50, "pos": 7, "shape": None}
    assert all(s.index_limit is None for s in input_specs(model))  # the signature alone says nothing
    feeds = generate_inputs(with_index_limits(input_specs(model), model), seed=0, dim_value=16)
    ids = feeds["ids"]
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < 50 and len(np.unique(ids)) > 10
    assert feeds["pos"].max() < 7 and set(np.unique(feeds["shape"])) <= {0, 1}


def _cached_attention_model(head: int = 8) -> onnx.ModelProto:
    """A decoder step as onnxruntime-genai writes it: GroupQueryAttention over a packed query,
    key and value (4 query heads, 2 key/value heads) with a key/value cache whose head size is
    a named dimension, "kv_cache_dim", then an output projection."""
    heads, kv_heads = 4, 2
    packed = (heads + 2 * kv_heads) * head
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Shape", ["past_key"], ["past_shape"], start=2, end=3),
        helper.make_node("Shape", ["query"], ["seq_shape"], start=1, end=2),
        helper.make_node("Shape", ["query"], ["batch_shape"], start=0, end=1),
        helper.make_node("Add", ["past_shape", "seq_shape"], ["total64"]),
        helper.make_node("Cast", ["total64"], ["total_sequence_length"], to=TensorProto.INT32),
        helper.make_node("Sub", ["total_sequence_length", "one"], ["last"]),
        helper.make_node("Expand", ["last", "batch_shape"], ["seqlens_k"]),
        helper.make_node(
            "GroupQueryAttention",
            ["query", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
            ["attn", "present.key", "present.value"], domain="com.microsoft", name="layer0/attn",
            num_heads=heads, kv_num_heads=kv_heads,
        ),
        helper.make_node("MatMul", ["attn", "w_out"], ["out"]),
    ]
    cache = ["batch", kv_heads, "past_sequence_length", "kv_cache_dim"]
    graph = helper.make_graph(
        nodes, "decoder_step",
        [
            helper.make_tensor_value_info("query", TensorProto.FLOAT, ["batch", "sequence_length", packed]),
            helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
            helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache),
        ],
        [
            helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "sequence_length", 16]),
            helper.make_tensor_value_info("present.key", TensorProto.FLOAT, ["batch", 2, "total", "kv_cache_dim"]),
        ],
        [
            numpy_helper.from_array(rng.standard_normal((heads * head, 16)).astype(np.float32), "w_out"),
            numpy_helper.from_array(np.array([1], np.int32), "one"),
        ],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def test_a_key_value_cache_takes_the_head_size_its_attention_computes_with() -> None:
    """A cache dimension named "kv_cache_dim" is the head size, which the packed query fixes:
    (4 + 2 * 2) heads of 8 in 64; no size of the generated-input ladder is 8."""
    from mixprec.analysis.input_indices import cache_head_sizes, with_fixed_dims

    model = _cached_attention_model()
    assert cache_head_sizes(model) == {"kv_cache_dim": (8, "layer0/attn")}
    specs = {s.name: s.shape for s in with_fixed_dims(input_specs(model), cache_head_sizes(model))}
    assert specs["past_key"] == ("batch", 2, "past_sequence_length", 8)
    assert specs["query"] == ("batch", "sequence_length", 64)


def _multi_head_model(value_width: int, key_dim: str | int, value_dim: str | int) -> onnx.ModelProto:
    """com.microsoft MultiHeadAttention, 4 heads over a 64-wide query and key, with a cache."""
    graph = helper.make_graph(
        [helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "", "", "pk", "pv"], ["y", "pk_out", "pv_out"],
                          domain="com.microsoft", num_heads=4, name="mha")],
        "g",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, ["b", "s", 64]),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, ["b", "s", 64]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, ["b", "s", value_width]),
            helper.make_tensor_value_info("pk", TensorProto.FLOAT, ["b", 4, "p", key_dim]),
            helper.make_tensor_value_info("pv", TensorProto.FLOAT, ["b", 4, "p", value_dim]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def test_the_head_size_of_onnx_attention_and_multi_head_attention_caches() -> None:
    """ONNX Attention (opset 23) with 3-D key and value of different head sizes, and
    com.microsoft MultiHeadAttention: each cache takes its own head size; a cache of static
    size binds nothing."""
    from mixprec.analysis.input_indices import cache_head_sizes

    attention = helper.make_graph(
        [helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "k_out", "v_out"],
                          q_num_heads=4, kv_num_heads=2, name="attn")],
        "g",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, ["b", "s", 64]),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, ["b", "s", 32]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, ["b", "s", 48]),
            helper.make_tensor_value_info("pk", TensorProto.FLOAT, ["b", 2, "p", "key_dim"]),
            helper.make_tensor_value_info("pv", TensorProto.FLOAT, ["b", 2, "p", "value_dim"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(attention, opset_imports=[helper.make_opsetid("", 23)])
    assert cache_head_sizes(model) == {"key_dim": (16, "attn"), "value_dim": (24, "attn")}

    assert cache_head_sizes(_multi_head_model(64, "head", 16)) == {"head": (16, "mha")}


def test_a_decoder_step_with_a_named_cache_dimension_is_checked_on_generated_inputs(tmp_path: Path) -> None:
    """The FP32 model runs only with the cache's head size (onnxruntime: "Input 'past_key'
    dimension 3 should match the packed KV head dimension"): converted without data, its
    numerics are checked, and the report says which size the generated cache took."""
    import onnxruntime as ort

    import mixprec

    model = _cached_attention_model()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ladder = {"query": (2, 16, 64), "past_key": (2, 2, 16, 16), "past_value": (2, 2, 16, 16)}
    with pytest.raises(Exception, match="head"):  # the ladder's own size for every name fails
        session.run(None, {k: np.ones(v, np.float32) for k, v in ladder.items()})

    result = mixprec.convert(model, tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda")
    validation = result.report.validation
    assert not validation.numerics_unchecked, validation.numerics
    assert result.report.low_by_op.get("GroupQueryAttention") == 1
    assert any("dimension 'kv_cache_dim' 8" in note and "layer0/attn" in note for note in validation.notes)
    worst = max(o.max_abs_error for o in validation.outputs if o.name == "out")
    assert 0 < worst < 0.05


def test_a_cache_head_size_follows_the_spec_where_inputs_are_separate_or_unknown() -> None:
    """GroupQueryAttention with a separate key of unknown shape fixes nothing (the query is not
    packed then); MultiHeadAttention's caches both take the query's head size, whatever the
    value's width."""
    from mixprec.analysis.input_indices import cache_head_sizes

    gqa = helper.make_graph(
        [helper.make_node("Relu", ["k_in"], ["k"]),
         helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens", "total"], ["y", "k_out", "v_out"],
                          domain="com.microsoft", num_heads=4, kv_num_heads=2, name="gqa")],
        "g",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, ["b", "s", 64]),
            helper.make_tensor_value_info("k_in", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, ["b", "s", 32]),
            helper.make_tensor_value_info("pk", TensorProto.FLOAT, ["b", 2, "p", "key_dim"]),
            helper.make_tensor_value_info("pv", TensorProto.FLOAT, ["b", 2, "p", "value_dim"]),
            helper.make_tensor_value_info("seqlens", TensorProto.INT32, ["b"]),
            helper.make_tensor_value_info("total", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(gqa, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    assert cache_head_sizes(model) == {"value_dim": (16, "gqa")}  # the key's shape is unknown

    assert cache_head_sizes(_multi_head_model(128, "kd", "vd")) == {"kd": (16, "mha"), "vd": (16, "mha")}


def test_generated_inputs_fall_back_to_the_ladder_where_a_bound_head_size_fails(tmp_path: Path, monkeypatch) -> None:
    """A binding the FP32 model refuses is not the end: the ladder alone is tried, and no note
    claims the binding."""
    import mixprec
    from mixprec.validate import staged

    monkeypatch.setattr(
        staged, "fixed_input_dims", lambda proto: {"kv_cache_dim": (5, "the head size of the key/value cache 'layer0/attn' reads")}
    )
    result = mixprec.convert(_cached_attention_model(head=16), tmp_path / "out.onnx", target_dtype="float16")
    validation = result.report.validation
    assert not validation.numerics_unchecked, validation.numerics
    assert not any("kv_cache_dim" in note for note in validation.notes)


def _feature_sized_model() -> onnx.ModelProto:
    """Inputs whose feature sizes only the weights reading them fix: frames of 13 features into
    an LSTM (through an Unsqueeze), 2 groups of 3 channels into a Conv, 11 features into a
    MatMul. No size of the generated-input ladder is 13, 6 or 11."""
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    graph = helper.make_graph(
        [
            helper.make_node("Unsqueeze", ["feats", "axis1"], ["seq"]),
            helper.make_node("LSTM", ["seq", "W", "R"], ["hidden"], hidden_size=4, name="lstm"),
            helper.make_node("Conv", ["image", "K"], ["conv"], group=2, name="conv"),
            helper.make_node("MatMul", ["rows", "M"], ["product"], name="matmul"),
        ],
        "g",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["frames", "features"]),
            helper.make_tensor_value_info("image", TensorProto.FLOAT, ["n", "channels", 5]),
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["n", "width"]),
        ],
        [
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["frames", 1, 1, 4]),
            helper.make_tensor_value_info("conv", TensorProto.FLOAT, ["n", 4, 5]),
            helper.make_tensor_value_info("product", TensorProto.FLOAT, ["n", 2]),
        ],
        [
            numpy_helper.from_array(np.array([1], np.int64), "axis1"),
            weight("W", 1, 16, 13), weight("R", 1, 16, 4), weight("K", 4, 3, 1), weight("M", 11, 2),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_feature_size_the_weights_fix_is_the_one_generated() -> None:
    """The LSTM's input size, the Conv's channels (its weight's times its groups) and the
    MatMul's contracted features bind the input dimensions that name them; the others stay
    symbolic."""
    from mixprec.analysis.input_indices import weight_sized_dims, with_fixed_dims

    model = _feature_sized_model()
    fixed = weight_sized_dims(model)
    assert fixed == {"features": (13, "lstm"), "channels": (6, "conv"), "width": (11, "matmul")}
    specs = {s.name: s.shape for s in with_fixed_dims(input_specs(model), fixed)}
    assert specs == {"feats": ("frames", 13), "image": ("n", 6, 5), "rows": ("n", 11)}


def test_a_model_whose_weights_fix_its_feature_sizes_is_checked_on_generated_inputs(tmp_path: Path) -> None:
    """Converted without data, the model runs on generated inputs of the sizes its weights read
    (no size of the ladder runs it), and the report says which sizes they took."""
    import mixprec

    result = mixprec.convert(_feature_sized_model(), tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda")
    validation = result.report.validation
    assert not validation.numerics_unchecked, validation.numerics
    assert any("dimension 'features' 13" in note and "'lstm'" in note for note in validation.notes)
    assert {o.name for o in validation.outputs} == {"hidden", "conv", "product"}
    assert max(o.max_abs_error for o in validation.outputs) < 0.05


def test_onnxruntime_runs_take_a_scalar_input_as_one(tmp_path: Path) -> None:
    """Through OrtValues too (a model with an input onnxruntime's numpy path would take), a
    rank-0 feed stays rank 0: Unsqueeze makes a [1] of it, not a [1, 1]."""
    import onnxruntime as ort  # noqa: PLC0415

    from mixprec.runtime.sessions import _run_with_ort_values  # noqa: PLC0415

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    axes = onnx.numpy_helper.from_array(np.array([0], np.int64), "axes")
    graph = onnx.helper.make_graph([onnx.helper.make_node("Unsqueeze", ["x", "axes"], ["y"])], "g", [x], [y], [axes])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (out,) = _run_with_ort_values(session, {"x": np.array(1.5, np.float32)}, ["y"], session.get_inputs())
    assert out.shape == (1,)


def _masked_by_ids() -> onnx.ModelProto:
    """Softmax over scores all masked (-inf) where any id is 0 (a padded batch, as a model that
    masks by its smallest id would): then every output is NaN."""
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])
    zero = numpy_helper.from_array(np.array(0, np.int64), "zero")
    minus_inf = numpy_helper.from_array(np.array(-np.inf, np.float32), "minus_inf")
    nodes = [
        helper.make_node("ReduceMin", ["ids"], ["smallest"], keepdims=0),
        helper.make_node("Equal", ["smallest", "zero"], ["pad"]),
        helper.make_node("Where", ["pad", "minus_inf", "x"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(nodes, "masked", [ids, x], [y], [zero, minus_inf])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_generated_ids_avoid_zero_where_zeros_leave_no_finite_output(tmp_path: Path) -> None:
    """Generated integers in [0, 2) can mask every position (ids of 0 as padding): the FP32
    model then gives only NaN and nothing would be compared. The check draws them from 1 then,
    and says so; a model whose outputs stay non-finite whatever the ids is named in a note."""
    import mixprec  # noqa: PLC0415

    path = tmp_path / "masked.onnx"
    onnx.save(_masked_by_ids(), str(path))
    result = mixprec.convert(path, tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda")
    notes = result.report.validation.notes
    assert any(n.startswith("generated integer inputs are at least 1") for n in notes), notes
    (output,) = result.report.validation.outputs
    assert output.nan_count == 0
    assert not any("hold no finite value" in n for n in notes)


def test_an_output_nan_by_design_does_not_stop_the_ids_from_avoiding_zero(tmp_path: Path) -> None:
    """The fallback counts outputs: ids from 1 leave one output without a finite value (NaN
    whatever the ids) where zeros left two, so it is taken, and that one output is named."""
    import mixprec  # noqa: PLC0415

    model = _masked_by_ids()
    nan = numpy_helper.from_array(np.array(np.nan, np.float32), "nan")
    model.graph.initializer.append(nan)
    model.graph.node.append(helper.make_node("Add", ["x", "nan"], ["z"]))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", "seq"]))
    path = tmp_path / "masked_and_void.onnx"
    onnx.save(model, str(path))
    result = mixprec.convert(path, tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda")
    notes = result.report.validation.notes
    assert any(n.startswith("generated integer inputs are at least 1") for n in notes), notes
    assert any(n.startswith("the FP32 model's output(s) 'z' hold no finite value") for n in notes), notes
    assert {o.name: o.nan_count for o in result.report.validation.outputs}["y"] == 0


def test_tune_without_data_runs_the_batches_a_conversion_checks(tmp_path: Path) -> None:
    """tune's generated batch is validation's: ids from 1 where zeros mask every position."""
    from mixprec.tune.inputs import read_batches  # noqa: PLC0415
    from mixprec.validate.staged import generated_batches  # noqa: PLC0415

    path = tmp_path / "masked.onnx"
    onnx.save(_masked_by_ids(), str(path))
    notes: list[str] = []
    batches = read_batches(None, path, 4, notes)
    expected = generated_batches(path)
    assert len(batches) == len(expected) == 1
    np.testing.assert_array_equal(batches[0]["ids"], expected[0]["ids"])
    assert batches[0]["ids"].min() >= 1
    assert notes == ["no data given: 1 generated batch(es) (random inputs), as a conversion's check uses"]


def test_an_output_with_no_finite_value_on_generated_inputs_is_named(tmp_path: Path) -> None:
    import mixprec  # noqa: PLC0415

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 4])
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    nodes = [
        helper.make_node("Abs", ["x"], ["a"]),
        helper.make_node("Add", ["a", "one"], ["b"]),
        helper.make_node("Neg", ["b"], ["c"]),
        helper.make_node("Sqrt", ["c"], ["y"]),  # the root of a negative number: NaN everywhere
        helper.make_node("Relu", ["x"], ["z"]),
    ]
    graph = helper.make_graph(nodes, "void", [x], [y, z], [one])
    path = tmp_path / "void.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    result = mixprec.convert(path, tmp_path / "out.onnx", target_dtype="float16", runtime="ort-cuda")
    assert (
        "the FP32 model's output(s) 'y' hold no finite value on the generated inputs: nothing is compared "
        "there; pass --data"
    ) in result.report.validation.notes
