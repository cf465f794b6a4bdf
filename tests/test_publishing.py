"""Atomic publishing of outputs (`mixprec.io.publishing`): a staged model leaves the
destination alone until `publish()`, `discard()` and a failed `staged_save` leave nothing
behind, and publishing over a model with external data removes the old data file of ours only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from mixprec.io import load_model
from mixprec.io.publishing import StagedModel, save_model, staged_save


def _proto(seed: int) -> onnx.ModelProto:
    """y = x + w, with a 32x32 weight (4 KiB: large enough for the external data file)."""
    w = np.random.default_rng(seed).normal(size=(32, 32)).astype(np.float32)
    graph = oh.make_graph(
        [oh.make_node("Add", ["x", "w"], ["y"], name="add")], f"g{seed}",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [32, 32])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [32, 32])],
        [nh.from_array(w, "w")],
    )
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])


def _model(seed: int) -> ir.Model:
    return ir.from_proto(_proto(seed))


def _weight(path: Path) -> np.ndarray:
    """The weight of a saved model (external data read from its folder)."""
    proto = onnx.load(str(path))
    return nh.to_array(proto.graph.initializer[0])


def _expected(seed: int) -> np.ndarray:
    return nh.to_array(_proto(seed).graph.initializer[0])


def _data_locations(path: Path) -> set[str]:
    proto = onnx.load(str(path), load_external_data=False)
    return {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}


def _listing(folder: Path) -> set[str]:
    return {entry.name for entry in folder.iterdir()}


def test_destination_untouched_until_publish(tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    staged = StagedModel(_model(0), dest)
    assert not dest.exists()
    assert staged.path.is_file() and staged.path.parent != tmp_path
    np.testing.assert_array_equal(_weight(staged.path), _expected(0))
    assert staged.publish() == dest
    np.testing.assert_array_equal(_weight(dest), _expected(0))
    assert _listing(tmp_path) == {"model.onnx"}  # no staging folder left beside it


def test_existing_destination_keeps_its_bytes_until_publish(tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    save_model(_model(1), dest)
    before = dest.read_bytes()
    staged = StagedModel(_model(2), dest)
    assert dest.read_bytes() == before
    staged.publish()
    assert dest.read_bytes() != before
    np.testing.assert_array_equal(_weight(dest), _expected(2))


def test_discard_publishes_nothing_and_leaves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    save_model(_model(1), dest)
    before, listing = dest.read_bytes(), _listing(tmp_path)
    for external in (False, True):
        staged = StagedModel(_model(2), dest, external_data=external)
        assert _listing(tmp_path) != listing  # the staging folder sits beside the destination
        staged.discard()
        assert not staged.path.exists()
        assert _listing(tmp_path) == listing
        assert dest.read_bytes() == before


def test_discard_of_a_new_destination_leaves_an_empty_folder(tmp_path: Path) -> None:
    staged = StagedModel(_model(0), tmp_path / "new.onnx", external_data=True)
    staged.discard()
    assert _listing(tmp_path) == set()


def test_publish_with_external_data_moves_the_data_file_too(tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    StagedModel(_model(3), dest, external_data=True).publish()
    (location,) = _data_locations(dest)
    assert location.startswith("model.onnx.") and location.endswith(".data")
    assert _listing(tmp_path) == {"model.onnx", location}
    np.testing.assert_array_equal(_weight(dest), _expected(3))


def test_publishing_over_our_external_data_removes_the_old_data_file(tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    StagedModel(_model(3), dest, external_data=True).publish()
    (old,) = _data_locations(dest)
    staged = StagedModel(_model(4), dest, external_data=True)
    assert (tmp_path / old).is_file()  # the published pair stays whole until the switch
    np.testing.assert_array_equal(_weight(dest), _expected(3))
    staged.publish()
    (new,) = _data_locations(dest)
    assert new != old
    assert _listing(tmp_path) == {"model.onnx", new}
    np.testing.assert_array_equal(_weight(dest), _expected(4))


def test_publishing_inline_over_the_conventional_data_file_removes_it(tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    onnx.save_model(_proto(5), str(dest), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    assert _data_locations(dest) == {"model.onnx.data"}
    StagedModel(_model(6), dest, external_data=False).publish()
    assert _listing(tmp_path) == {"model.onnx"}
    assert _data_locations(dest) == set()
    np.testing.assert_array_equal(_weight(dest), _expected(6))


def test_a_data_file_that_is_not_ours_is_kept(tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    onnx.save_model(_proto(5), str(dest), save_as_external_data=True, location="weights.bin", size_threshold=0)
    StagedModel(_model(6), dest, external_data=False).publish()
    assert _listing(tmp_path) == {"model.onnx", "weights.bin"}
    np.testing.assert_array_equal(_weight(dest), _expected(6))


def test_staged_save_publishes_on_clean_exit(tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    with staged_save(_model(7), dest) as staged:
        assert staged.is_file() and not dest.exists()
    np.testing.assert_array_equal(_weight(dest), _expected(7))
    assert _listing(tmp_path) == {"model.onnx"}


@pytest.mark.parametrize("external", [False, True])
def test_an_exception_inside_staged_save_publishes_nothing(tmp_path: Path, external: bool) -> None:
    dest = tmp_path / "model.onnx"
    save_model(_model(1), dest, external_data=external)
    before, listing = dest.read_bytes(), _listing(tmp_path)
    with pytest.raises(RuntimeError, match="check failed"), staged_save(_model(2), dest, external_data=external) as staged:
        assert staged.is_file()
        raise RuntimeError("check failed")
    assert dest.read_bytes() == before
    assert _listing(tmp_path) == listing
    np.testing.assert_array_equal(_weight(dest), _expected(1))


def test_a_failing_check_in_save_model_publishes_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    seen: list[Path] = []

    def check(path: Path) -> None:
        seen.append(path)
        raise ValueError("rejected")

    with pytest.raises(ValueError, match="rejected"):
        save_model(_model(0), dest, check=check)
    assert len(seen) == 1 and seen[0] != dest
    assert not dest.exists() and not seen[0].exists()
    assert _listing(tmp_path) == set()


def test_leftover_data_file_of_a_dead_writer_is_removed_by_the_next_save(tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    save_model(_model(0), dest)
    # A data file named like ours, by a process id no live process has, referred to by nothing.
    dead = next(pid for pid in range(4_000_000, 4_100_000) if not Path(f"/proc/{pid}").exists())
    leftover = tmp_path / f"model.onnx.{dead}-0123abcd.data"
    leftover.write_bytes(b"\0" * 16)
    foreign = tmp_path / "model.onnx.notes.txt"
    foreign.write_text("keep me")
    StagedModel(_model(1), dest).publish()
    assert not leftover.exists()
    assert foreign.read_text() == "keep me"
    assert _listing(tmp_path) == {"model.onnx", foreign.name}


def test_a_save_without_external_data_inlines_constant_attributes_everywhere(tmp_path: Path) -> None:
    """Constant values stored externally, in the main graph and inside a model-local function,
    end up inside the .onnx file when the output is saved without external data."""
    rng = np.random.default_rng(3)
    c_main = rng.normal(size=(64, 64)).astype(np.float32)
    c_func = rng.normal(size=(64, 64)).astype(np.float32)
    function = oh.make_function(
        "local", "AddConst", ["a"], ["b"],
        [oh.make_node("Constant", [], ["k"], value=nh.from_array(c_func, "k")), oh.make_node("Add", ["a", "k"], ["b"])],
        opset_imports=[oh.make_opsetid("", 17)],
    )
    graph = oh.make_graph(
        [
            oh.make_node("Constant", [], ["c"], value=nh.from_array(c_main, "c"), name="const"),
            oh.make_node("Add", ["x", "c"], ["t"], name="add"),
            oh.make_node("AddConst", ["t"], ["y"], domain="local", name="call"),
        ],
        "g", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
    )
    proto = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("local", 1)], functions=[function])
    source = tmp_path / "src" / "model.onnx"
    source.parent.mkdir()
    from onnx.external_data_helper import convert_model_to_external_data  # noqa: PLC0415

    convert_model_to_external_data(proto, location="model.data", size_threshold=0, convert_attribute=True)
    for node in proto.functions[0].node:  # onnx's helper leaves function bodies alone
        for attr in node.attribute:
            if attr.HasField("t"):
                onnx.external_data_helper.set_external_data(attr.t, "model.data")
    onnx.save(proto, str(source))
    assert (source.parent / "model.data").stat().st_size >= 2 * c_main.nbytes
    model, _ = load_model(source)
    destination = tmp_path / "out" / "model.onnx"
    destination.parent.mkdir()
    save_model(model, destination, external_data=False)
    assert [p.name for p in destination.parent.iterdir()] == ["model.onnx"]
    loaded = onnx.load(str(destination))  # no data file to read
    import onnxruntime as ort  # noqa: PLC0415

    x = rng.normal(size=(64, 64)).astype(np.float32)
    y = ort.InferenceSession(str(destination), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x + c_main + c_func, rtol=1e-6)
    assert len(loaded.functions) == 1


def test_a_converted_file_declares_its_declared_values_not_its_initializers(tmp_path: Path) -> None:
    """The input declares h; its initializers need no value_info (their tensors carry their
    types) and the converted file adds none for them, 16-bit or FP32."""
    import mixprec

    w = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    big = np.full((8,), 1e6, np.float32)  # beyond float16: stays FP32
    graph = oh.make_graph(
        [oh.make_node("MatMul", ["x", "w"], ["h"]), oh.make_node("Relu", ["h"], ["r"]),
         oh.make_node("Add", ["r", "big"], ["y"])], "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [nh.from_array(w, "w"), nh.from_array(big, "big")],
        value_info=[oh.make_tensor_value_info("h", TensorProto.FLOAT, [2, 8])],
    )
    source, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), str(source))
    mixprec.convert(source, out, target_dtype="float16")
    saved = onnx.load(str(out))
    declared = {vi.name: vi.type.tensor_type.elem_type for vi in saved.graph.value_info}
    assert declared == {"h": TensorProto.FLOAT16}
    assert {t.name: t.data_type for t in saved.graph.initializer} == {"w": TensorProto.FLOAT16, "big": TensorProto.FLOAT}
