"""The batched protobuf writer writes what onnx_ir writes, and loading does not keep the parsed
file alive."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from helpers import matmul_chain

from mixprec.io import load_model, streaming
from mixprec.io.graph_bytes import GraphFieldWriter
from mixprec.io.publishing import save_model


def _rich_model() -> onnx.ModelProto:
    """Every part of a ModelProto the writer assembles from pieces: doc strings, metadata on
    the model, graph and nodes, inline and Constant tensors, quantization annotations on an
    input, an initializer, an intermediate value and an output, value_info, an If with two
    branches, a model-local function, and graph outputs produced by nodes in different batches."""
    def branch(name: str, op: str) -> onnx.GraphProto:
        return oh.make_graph(
            [oh.make_node(op, ["h", "h"], [f"{name}_out"])], name, [],
            [oh.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2, 3])],
        )

    nodes = [
        oh.make_node("Constant", [], ["k"], value=nh.from_array(np.full((2, 3), 0.5, np.float32))),
        oh.make_node("Add", ["x", "w"], ["a"], name="add", doc_string="adds"),
        oh.make_node("Mul", ["a", "k"], ["h"], name="mul"),
        oh.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
        oh.make_node("Greater", ["top", "zero"], ["cond"]),
        oh.make_node("If", ["cond"], ["branch"], then_branch=branch("then", "Add"), else_branch=branch("else", "Sub")),
        oh.make_node("Scale2", ["branch"], ["s"], domain="local"),
        oh.make_node("Relu", ["s"], ["y"], name="relu"),
        oh.make_node("Neg", ["h"], ["z"]),
    ]
    nodes[1].metadata_props.add(key="origin", value="layer.0")
    graph = oh.make_graph(
        nodes, "rich", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]), oh.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3])],
        [nh.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w"), nh.from_array(np.array(0, np.float32), "zero")],
        doc_string="a graph",
        value_info=[oh.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])],
    )
    for tensor in ("x", "w", "a", "y"):
        entry = graph.quantization_annotation.add(tensor_name=tensor)
        entry.quant_parameter_tensor_names.add(key="SCALE_TENSOR", value=f"{tensor}_scale")
    graph.metadata_props.add(key="graph_key", value="graph_value")
    function = oh.make_function(
        "local", "Scale2", ["t"], ["u"], [oh.make_node("Add", ["t", "t"], ["u"])],
        [oh.make_opsetid("", 17)],
    )
    model = oh.make_model(
        graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)], functions=[function],
        producer_name="tests", doc_string="a model",
    )
    model.metadata_props.add(key="model_key", value="model_value")
    return model


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "_NODES_PER_BATCH", 2)


@pytest.mark.usefixtures("small_batches")
def test_the_batched_writer_writes_the_bytes_onnx_ir_writes(tmp_path: Path) -> None:
    model = ir.serde.deserialize_model(_rich_model())
    ir.save(model, tmp_path / "whole.onnx")
    streaming.save(model, tmp_path / "batched.onnx")
    assert (tmp_path / "batched.onnx").read_bytes() == (tmp_path / "whole.onnx").read_bytes()
    loaded = onnx.load(tmp_path / "batched.onnx")
    onnx.checker.check_model(loaded, full_check=True)
    assert [n.op_type for n in loaded.graph.node][-3:] == ["Scale2", "Relu", "Neg"]
    assert len(loaded.graph.quantization_annotation) == 4


def _typed_values_model() -> onnx.ModelProto:
    """Nodes whose bytes are written directly beside ones that need onnx_ir: value_info of every
    kind of dimension and type, attributes that compare equal but serialize apart (0.0 and
    -0.0), attribute doc strings, skipped optional inputs and outputs, names beyond 127 bytes."""
    long_name = "v" * 200
    nodes = [
        oh.make_node("Mul", ["x", "x"], [long_name], name="n" * 150),
        oh.make_node("LeakyRelu", [long_name], ["a"], alpha=0.0),
        oh.make_node("LeakyRelu", ["a"], ["b"], alpha=-0.0),
        oh.make_node("LeakyRelu", ["b"], ["c"], alpha=0.0),
        oh.make_node("Clip", ["c", "", "hi"], ["d"]),
        oh.make_node("Dropout", ["d"], ["e", ""]),
        oh.make_node("SequenceConstruct", ["e", "e"], ["seq"]),
        oh.make_node("SequenceAt", ["seq", "zero_i"], ["f"]),
        oh.make_node("Transpose", ["f"], ["g"], perm=[1, 0]),
        oh.make_node("Transpose", ["g"], ["h"], perm=[1, 0]),
        oh.make_node("Identity", ["h"], ["y"], name="named"),
    ]
    nodes[2].attribute[0].doc_string = "a negative zero"
    value_info = [
        oh.make_tensor_value_info(long_name, TensorProto.FLOAT, [2, 3]),
        oh.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", None]),
        oh.make_tensor_value_info("b", TensorProto.FLOAT, None),
        oh.make_tensor_value_info("c", TensorProto.FLOAT, []),
        oh.make_tensor_value_info("d", TensorProto.FLOAT, [2, "w" * 140]),
        oh.make_tensor_value_info("e", TensorProto.UNDEFINED, [2, 3]),
        oh.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, [2, 3]),
        oh.make_tensor_value_info("f", TensorProto.FLOAT, [2, 3]),
        oh.make_tensor_value_info("g", TensorProto.FLOAT, [3, 2]),
    ]
    value_info[-2].type.tensor_type.shape.dim[0].denotation = "DATA_BATCH"
    value_info[-1].doc_string = "transposed"
    value_info[-1].metadata_props.add(key="origin", value="layer.1")
    graph = oh.make_graph(
        nodes, "typed", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [nh.from_array(np.array(6, np.float32), "hi"), nh.from_array(np.array(0, np.int64), "zero_i")],
        value_info=value_info,
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


@pytest.mark.usefixtures("small_batches")
def test_the_batched_writer_writes_typed_values_and_attributes_as_onnx_ir_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ir.serde.deserialize_model(_typed_values_model())
    ir.save(model, tmp_path / "whole.onnx")
    through_onnx_ir: list[str] = []
    whole_node = GraphFieldWriter._encode_with_onnx_ir

    def count(self: GraphFieldWriter, node: ir.Node, pieces: object) -> None:
        through_onnx_ir.append(node.outputs[0].name)
        whole_node(self, node, pieces)

    monkeypatch.setattr(GraphFieldWriter, "_encode_with_onnx_ir", count)
    streaming.save(model, tmp_path / "batched.onnx")
    assert (tmp_path / "batched.onnx").read_bytes() == (tmp_path / "whole.onnx").read_bytes()
    # A sequence type, a dimension denotation, a value's doc string and metadata: onnx_ir's.
    assert through_onnx_ir == ["seq", "f", "g"]
    loaded = onnx.load(tmp_path / "batched.onnx")
    assert [a.attribute[0].f for a in loaded.graph.node[1:4]] == [0.0, -0.0, 0.0]
    assert str(loaded.graph.node[2].attribute[0].f) == "-0.0"
    assert len(loaded.graph.value_info) == 9 + 2  # and the initializers'


@pytest.mark.slow
@pytest.mark.usefixtures("small_batches")
def test_the_batched_writer_matches_onnx_ir_on_the_backend_corpus(tmp_path: Path) -> None:
    """Control flow, functions, every attribute type, optional inputs and outputs: every node
    test of onnx's backend."""
    from conformance import collect  # noqa: PLC0415

    cases = collect()
    assert len(cases) > 1000
    for case in cases:
        model = ir.serde.deserialize_model(case.model)
        ir.save(model, tmp_path / "whole.onnx")
        streaming.save(model, tmp_path / "batched.onnx")
        assert (tmp_path / "batched.onnx").read_bytes() == (tmp_path / "whole.onnx").read_bytes(), case.name


@pytest.mark.usefixtures("small_batches")
def test_a_save_with_external_data_keeps_the_models_own_tensors(tmp_path: Path) -> None:
    weights = np.linspace(-1, 1, 4096, dtype=np.float32).reshape(64, 64)
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["m"]), oh.make_node("Relu", ["m"], ["y"])], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [nh.from_array(weights, "w")],
    )
    model = ir.serde.deserialize_model(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]))
    save_model(model, tmp_path / "out.onnx", external_data=True)
    assert isinstance(model.graph.initializers["w"].const_value, ir.serde.TensorProtoTensor)
    assert onnx.load(tmp_path / "out.onnx", load_external_data=False).graph.initializer[0].data_location == TensorProto.EXTERNAL
    np.testing.assert_array_equal(nh.to_array(onnx.load(tmp_path / "out.onnx").graph.initializer[0]), weights)


def test_other_formats_go_through_onnx(tmp_path: Path) -> None:
    model = ir.serde.deserialize_model(_rich_model())
    streaming.save(model, tmp_path / "model.textproto")
    assert "producer_name" in (tmp_path / "model.textproto").read_text()


def test_saving_leaves_no_empty_metadata_behind(tmp_path: Path) -> None:
    """onnx_ir's serializer creates an empty metadata store on every value, node and tensor it
    reads; the save drops the empty ones and keeps what holds something."""
    model = ir.serde.deserialize_model(_rich_model())
    kept = model.graph.node(1).outputs[0]
    kept.meta["mark"] = 1
    save_model(model, tmp_path / "out.onnx")
    owners = [*model.graph.inputs, *(v for n in model.graph for v in n.outputs), *model.graph, *model.graph.initializers.values()]
    stores = [getattr(o, slot) for o in owners for slot in ("_metadata", "_metadata_props") if hasattr(o, slot)]
    assert stores and all(store is None or store for store in stores)
    assert kept.meta["mark"] == 1 and model.graph.node(1).metadata_props == {"origin": "layer.0"}


def test_loading_copies_inline_tensors_and_keeps_their_values(tmp_path: Path) -> None:
    onnx.save(_rich_model(), tmp_path / "m.onnx")
    model, _ = load_model(tmp_path / "m.onnx")
    w = model.graph.initializers["w"].const_value
    assert isinstance(w, ir.serde.TensorProtoTensor) and w.name == "w"
    np.testing.assert_array_equal(w.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
    constant = next(n for n in model.graph if n.op_type == "Constant").attributes["value"].value
    np.testing.assert_array_equal(constant.numpy(), np.full((2, 3), 0.5, np.float32))
    ir.save(model, tmp_path / "again.onnx")
    ir.save(ir.load(tmp_path / "m.onnx"), tmp_path / "plain.onnx")
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "plain.onnx").read_bytes()


_MEASURE = textwrap.dedent("""
    import ctypes, gc, sys
    import onnx_ir as ir
    from mixprec.io import loading
    if sys.argv[2] == "keep":
        loading._release_parsed_file = lambda slots: None
    def anon():
        gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
        return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1])
    before = anon()
    model, _ = loading.load_model(sys.argv[1])
    print(anon() - before)
""")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and glibc's malloc_trim")
def test_a_loaded_model_does_not_keep_the_parsed_file_alive(tmp_path: Path) -> None:
    """A few inline tensors kept the whole parsed message (every node) alive: measured as the
    memory the loaded model holds, with and without the copy."""
    nodes = [oh.make_node("Constant", [], ["c0"], value=nh.from_array(np.ones(4, np.float32)))]
    nodes += [oh.make_node("Add", [f"c{i}", "b"], [f"c{i + 1}"], name=f"add_{i}") for i in range(20000)]
    graph = oh.make_graph(
        nodes, "g", [], [oh.make_tensor_value_info("c20000", TensorProto.FLOAT, [4])],
        [nh.from_array(np.ones(4, np.float32), "b")],
    )
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), tmp_path / "m.onnx")
    held = {
        mode: int(subprocess.run(
            [sys.executable, "-c", _MEASURE, str(tmp_path / "m.onnx"), mode], capture_output=True, text=True, check=True
        ).stdout)
        for mode in ("keep", "release")
    }
    parsed = (tmp_path / "m.onnx").stat().st_size  # the parsed message is a few times the file
    assert held["keep"] - held["release"] > parsed // 1024, held


@pytest.mark.parametrize("external", [False, True])
def test_a_model_over_the_protobuf_limit_is_a_one_line_error_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, external: bool
) -> None:
    from mixprec.errors import InputError

    monkeypatch.setattr(streaming, "_PROTOBUF_LIMIT", 200)  # the rich model is ~1.5 kB
    model = ir.serde.deserialize_model(_rich_model())
    with pytest.raises(InputError, match="larger than protobuf's 2 GB limit"):
        save_model(model, tmp_path / "out.onnx", external_data=external)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("external", [False, True])
def test_tensors_in_lists_of_tensors_load_from_the_models_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, external: bool) -> None:
    """A list-of-tensors attribute (a custom op's) is walked like a Constant's value: its
    external tensors read from the model's folder (not the working directory), inline ones are
    copied out of the parsed file."""
    arrays = [np.arange(300, dtype=np.float32) + k for k in range(3)]
    folder = tmp_path / "models"
    folder.mkdir()
    tables = [nh.from_array(a, f"t{k}") for k, a in enumerate(arrays)]
    if external:  # onnx's helpers leave lists of tensors inline: point them at a data file by hand
        (folder / "m.data").write_bytes(b"".join(a.tobytes() for a in arrays))
        for k, table in enumerate(tables):
            table.ClearField("raw_data")
            table.data_location = TensorProto.EXTERNAL
            for key, value in (("location", "m.data"), ("offset", str(k * 1200)), ("length", "1200")):
                table.external_data.add(key=key, value=value)
    node = oh.make_node("Table", ["x"], ["y"], domain="custom", tables=tables)
    graph = oh.make_graph(
        [node], "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("custom", 1)])
    onnx.save(model, folder / "m.onnx")
    monkeypatch.chdir(tmp_path)  # the data file is not in the working directory
    loaded, _ = load_model(Path("models") / "m.onnx")
    tensors = loaded.graph.node(0).attributes["tables"].value
    assert all(isinstance(t, ir.ExternalTensor if external else ir.serde.TensorProtoTensor) for t in tensors)
    for tensor, array in zip(tensors, arrays):
        np.testing.assert_array_equal(tensor.numpy(), array)


def test_tensor_sizes_read_from_the_protobuf_equal_onnx_irs() -> None:
    from mixprec.io.views import tensor_nbytes, tensor_size

    protos = [nh.from_array(np.ones((3, 4), np.float32)), nh.from_array(np.ones((0, 2), np.float16)),
              nh.from_array(np.array(3, np.int64)), oh.make_tensor("q", TensorProto.INT4, [5], [1, 2, 3, 4, 5])]
    for proto in protos:
        tensor = ir.serde.TensorProtoTensor(proto)
        assert (tensor_size(tensor), tensor_nbytes(tensor)) == (tensor.size, tensor.nbytes), proto.name
    external = ir.ExternalTensor("w.data", 0, 24, ir.DataType.FLOAT, shape=ir.Shape([2, 3]), name="w")
    assert (tensor_size(external), tensor_nbytes(external)) == (6, 24)


def test_a_conversion_opens_each_data_file_a_handful_of_times(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small external weights are read one at a time (their ranges, then their 16-bit copies
    as the output is written): the data file stays open for the conversion instead of being
    opened once per read. The output still runs and matches."""
    import onnxruntime as ort

    import mixprec
    from mixprec.io import loading

    rng = np.random.default_rng(1)
    model = matmul_chain(40, seed=1)
    source = tmp_path / "in.onnx"
    onnx.save(model, source, save_as_external_data=True, location="in.data", size_threshold=0)
    data = str(tmp_path / "in.data")
    opened: list[str] = []
    real_open = loading.os.open

    def counting_open(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(loading.os, "open", counting_open)
    mixprec.convert(source, tmp_path / "out.onnx", validate="checker")
    monkeypatch.undo()
    assert 1 <= opened.count(data) <= 3, opened.count(data)  # 80 reads: 2 per weight
    feed = {"x": rng.standard_normal((2, 8)).astype(np.float32) * 0.3}
    expected = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(got, expected, rtol=5e-2, atol=5e-2 * np.abs(expected).max())


def test_external_tensors_read_the_same_without_positioned_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the platform has no positioned read into a buffer, the reader seeks and reads:
    the same values, at every offset of a shared data file."""
    from mixprec.io import loading

    rng = np.random.default_rng(2)
    arrays = {f"t{i}": rng.standard_normal((3, i + 1)).astype(np.float32) for i in range(5)}
    graph = oh.make_graph(
        [oh.make_node("Identity", [name], [f"o{name}"]) for name in arrays], "g", [],
        [oh.make_tensor_value_info(f"o{name}", TensorProto.FLOAT, None) for name in arrays],
        [nh.from_array(a, name) for name, a in arrays.items()],
    )
    onnx.save(oh.make_model(graph), tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    model, _ = load_model(tmp_path / "m.onnx")
    tensors = {v.name: v.const_value for v in model.graph.initializers.values()}
    positioned = {name: loading.read_external(t) for name, t in tensors.items()}
    monkeypatch.delattr(loading.os, "preadv", raising=False)
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(loading.read_external(tensor), arrays[name])
        np.testing.assert_array_equal(positioned[name], arrays[name])


@pytest.mark.parametrize("extension", [".onnx", ".textproto"])
def test_the_writer_keeps_the_types_of_declared_values_and_of_ops_outside_onnx(tmp_path: Path, extension: str) -> None:
    """Node outputs keep their value_info only where the input declared them or no ONNX inference
    recovers them; the model keeps every type; the bytes are onnx_ir's for the model without the
    types left out (a node written by onnx_ir, for its doc string, included)."""
    nodes = [
        oh.make_node("Relu", ["x"], ["r"], doc_string="through onnx_ir"),
        oh.make_node("Neg", ["r"], ["n"]),
        oh.make_node("Scale2", ["n"], ["s"], domain="local"),
        oh.make_node("Abs", ["s"], ["a"]),
        oh.make_node("Sin", ["a"], ["y"]),
    ]
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        value_info=[oh.make_tensor_value_info(name, TensorProto.FLOAT, [2]) for name in "rnsa"],
    )
    function = oh.make_function("local", "Scale2", ["t"], ["u"], [oh.make_node("Add", ["t", "t"], ["u"])], [oh.make_opsetid("", 17)])
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)], functions=[function])
    model = ir.serde.deserialize_model(proto)
    streaming.save(model, tmp_path / f"kept{extension}", declared={"n"})
    saved = onnx.load(tmp_path / f"kept{extension}")
    assert sorted(vi.name for vi in saved.graph.value_info) == ["n", "s"]
    assert all(value.type is not None for node in model.graph for value in node.outputs)
    for node in model.graph:
        if node.outputs[0].name in ("r", "a"):
            node.outputs[0].type, node.outputs[0].shape = None, None
    ir.save(model, tmp_path / f"whole{extension}")
    assert (tmp_path / f"kept{extension}").read_bytes() == (tmp_path / f"whole{extension}").read_bytes()


def test_the_writer_writes_initializers_of_every_kind_as_onnx_ir_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors in external data (with and without offset), in memory, lazy, 16-bit, of no
    dimension, with a doc string or metadata (onnx_ir's), an initializer that is also a graph
    input, and one whose value carries its own doc string: the bytes onnx_ir writes."""
    data = np.arange(12, dtype=np.float32)
    (tmp_path / "w.data").write_bytes(data.tobytes())
    tensors: dict[str, ir.TensorProtocol] = {
        "ext": ir.ExternalTensor("w.data", 0, 24, ir.DataType.FLOAT, shape=ir.Shape([2, 3]), name="ext", base_dir=tmp_path),
        "ext_offset": ir.ExternalTensor("w.data", 24, 24, ir.DataType.FLOAT, shape=ir.Shape([6]), name="x", base_dir=tmp_path),
        "mem": ir.Tensor(data.reshape(3, 4)),
        "half": ir.Tensor(data.astype(np.float16)),
        "scalar": ir.Tensor(np.array(2.5, np.float32)),
        "lazy": ir.LazyTensor(lambda: ir.Tensor(data[:4]), dtype=ir.DataType.FLOAT, shape=ir.Shape([4])),
        "documented": ir.Tensor(data[:2], doc_string="two"),
        "in_input": ir.Tensor(data[:3]),
    }
    tensors["with_metadata"] = ir.Tensor(data[:5])
    tensors["with_metadata"].metadata_props["origin"] = "w"
    values = {}
    for name, tensor in tensors.items():
        values[name] = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tensor.shape.dims), const_value=tensor)
    values["documented"].doc_string = "a documented value"
    x = ir.Value(name="input", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3]))
    node = ir.Node("", "Identity", [x], num_outputs=1)
    node.outputs[0].name = "y"
    graph = ir.Graph(
        [x, values["in_input"]], node.outputs, nodes=[node], initializers=list(values.values()), opset_imports={"": 17}
    )
    model = ir.Model(graph, ir_version=10)
    ir.save(model, tmp_path / "whole.onnx")
    through_onnx_ir: list[str] = []
    from mixprec.io import graph_bytes  # noqa: PLC0415

    original = ir.serde.serialize_tensor_into

    def count(proto: onnx.TensorProto, tensor: ir.TensorProtocol) -> None:
        through_onnx_ir.append(tensor.name)
        original(proto, tensor)

    monkeypatch.setattr(graph_bytes.ir.serde, "serialize_tensor_into", count)
    streaming.save(model, tmp_path / "batched.onnx")
    assert (tmp_path / "batched.onnx").read_bytes() == (tmp_path / "whole.onnx").read_bytes()
    assert sorted(through_onnx_ir) == ["documented", "with_metadata"]
    loaded = onnx.load(tmp_path / "batched.onnx", load_external_data=False)
    assert [t.name for t in loaded.graph.initializer] == list(tensors)
