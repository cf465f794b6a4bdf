"""ONNX's checker and inference of the input file in a child process (`mixprec.io.onnx_file`):
the conversion takes the child's answers where it gives them and computes them itself where it
does not, with the same outcome either way; no child outlives a conversion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from onnx import TensorProto

import mixprec
from mixprec.errors import ModelLoadError, ValidationFailure
from mixprec.io import onnx_file
from mixprec.io.onnx_file import FileChecks
from mixprec.validate import staged
from mixprec.validate.checker import check_model_file

from helpers import assert_close, random_feeds, relu_model, run

F32 = TensorProto.FLOAT


class _Spy:
    """Records the children started and which answers the conversion took from them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, min_bytes: int = 0, min_nodes: int = 0) -> None:
        self.started: list[FileChecks] = []
        self.kinds: list[str] = []  # "input" (checker and inference) or "output" (full checker)
        self.inferred = 0
        monkeypatch.setattr(onnx_file, "CHILD_MIN_BYTES", min_bytes)
        monkeypatch.setattr(staged, "CHECKER_CHILD_MIN_NODES", min_nodes)
        start, inference = FileChecks.start.__func__, FileChecks.inference  # type: ignore[attr-defined]

        def spy_start(cls: type[FileChecks], *args, **kwargs) -> FileChecks | None:
            checks = start(cls, *args, **kwargs)
            if checks is not None:
                self.started.append(checks)
                self.kinds.append("input" if kwargs.get("infer") else "output")
            return checks

        def spy_inference(checks: FileChecks, fallback, objected=None):  # noqa: ANN001, ANN202
            def counted_fallback(told):  # noqa: ANN001, ANN202
                self.inferred -= 1
                return fallback(told)

            self.inferred += 1
            return inference(checks, counted_fallback, objected)

        monkeypatch.setattr(FileChecks, "start", classmethod(spy_start))
        monkeypatch.setattr(FileChecks, "inference", spy_inference)

    def all_ended(self) -> bool:
        return all(checks._process.returncode is not None for checks in self.started)


def _branching_model() -> onnx.ModelProto:
    """MatMul -> If (both branches compute on the outer value) -> Softmax, with a declared
    output shape that contradicts what the model computes (inference corrects it)."""
    rng = np.random.default_rng(0)
    weight = oh.make_tensor("w", F32, [8, 8], rng.standard_normal((8, 8)).astype(np.float32).ravel().tolist())
    then_graph = oh.make_graph(
        [oh.make_node("Relu", ["h"], ["t"])], "then", [], [oh.make_tensor_value_info("t", F32, None)]
    )
    else_graph = oh.make_graph(
        [oh.make_node("Neg", ["h"], ["e"])], "else", [], [oh.make_tensor_value_info("e", F32, None)]
    )
    graph = oh.make_graph(
        [
            oh.make_node("MatMul", ["x", "w"], ["h"]),
            oh.make_node("If", ["flag"], ["b"], then_branch=then_graph, else_branch=else_graph),
            oh.make_node("Softmax", ["b"], ["y"], axis=-1),
        ],
        "g",
        [oh.make_tensor_value_info("x", F32, [2, 8]), oh.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [oh.make_tensor_value_info("y", F32, [2, 3])],
        [weight],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _convert(source: Path, out: Path) -> tuple[bytes, mixprec.Report]:
    result = mixprec.convert(source, out, target_dtype="float16", validate="checker")
    return out.read_bytes(), result.report


def test_the_childs_inference_converts_the_model_as_the_process_own_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Byte-identical outputs and the same report notes with the child's inference as with
    the process's own, on a model with subgraphs and a corrected output shape."""
    source = tmp_path / "m.onnx"
    onnx.save(_branching_model(), str(source))
    in_process = _convert(source, tmp_path / "in_process.onnx")
    spy = _Spy(monkeypatch)
    by_child = _convert(source, tmp_path / "by_child.onnx")
    assert spy.kinds == ["input", "output"] and spy.inferred == 1
    assert by_child[0] == in_process[0]
    assert by_child[1].notes == in_process[1].notes
    assert any("declared output shape" in note for note in by_child[1].notes)
    assert spy.all_ended()
    converted = onnx.load(str(tmp_path / "by_child.onnx"))
    feeds = {"x": random_feeds(_branching_model())["x"], "flag": np.array(True)}
    assert_close(run(converted, feeds)[0], run(_branching_model(), feeds)[0], rtol=1e-2, atol=1e-3)


def test_a_model_below_the_thresholds_is_checked_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The input's child starts by the file's size, the output checker's by the node count."""
    source = tmp_path / "m.onnx"
    onnx.save(_branching_model(), str(source))
    spy = _Spy(monkeypatch, min_bytes=source.stat().st_size + 1)
    _convert(source, tmp_path / "out.onnx")
    assert spy.kinds == ["output"]
    spy = _Spy(monkeypatch, min_nodes=1000)
    _convert(source, tmp_path / "out.onnx")
    assert spy.kinds == ["input"]


@pytest.mark.parametrize(
    ("model", "kind"),
    [(relu_model(input_name="missing"), "structural"), (relu_model(output_type=TensorProto.INT64), "strict")],
)
def test_an_invalid_file_is_refused_as_the_process_itself_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: onnx.ModelProto, kind: str
) -> None:
    """The structural checker's objection (answered before the IR is used) and strict
    inference's (onnxruntime cannot load the model either) refuse the input with the same
    one-line message, and the child ends."""
    source = tmp_path / f"{kind}.onnx"
    onnx.save(model, str(source))
    with pytest.raises(ModelLoadError) as in_process:
        _convert(source, tmp_path / "a.onnx")
    spy = _Spy(monkeypatch)
    with pytest.raises(ModelLoadError) as by_child:
        _convert(source, tmp_path / "b.onnx")
    assert spy.kinds == ["input"]
    assert str(by_child.value) == str(in_process.value)
    assert "not a valid ONNX model" in str(by_child.value)
    assert spy.all_ended()
    assert not (tmp_path / "b.onnx").exists()


@pytest.mark.parametrize(
    "entry",
    [
        "import sys; sys.exit(0)",  # answers nothing
        "import sys; sys.stdout.buffer.write(b'c' + bytes(8))",  # the check only, then dies
        "import sys; sys.stdout.buffer.write(b'c' + bytes(8) + b'm' + (99).to_bytes(8, 'little'))",  # cut off
    ],
)
def test_a_child_that_answers_in_part_is_made_up_for_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: str
) -> None:
    source = tmp_path / "m.onnx"
    onnx.save(_branching_model(), str(source))
    expected = _convert(source, tmp_path / "expected.onnx")[0]
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(onnx_file, "_CHILD_ENTRY", entry)
    assert _convert(source, tmp_path / "out.onnx")[0] == expected
    assert spy.kinds == ["input", "output"] and spy.inferred == 0  # the fallback answered
    assert spy.all_ended()


def test_the_output_checker_in_a_child_fails_the_model_as_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full checker of a staged model, in a child: the same finding, the same failure."""
    monkeypatch.setattr(onnx_file, "CHILD_MIN_BYTES", 0)
    invalid = tmp_path / "invalid.onnx"
    onnx.save(relu_model(output_type=TensorProto.INT64), str(invalid))
    with pytest.raises(ValidationFailure) as in_process:
        check_model_file(invalid)
    checks = FileChecks.start(invalid, checker="full")
    assert checks is not None
    with pytest.raises(ValidationFailure) as by_child:
        check_model_file(invalid, None, checks)
    assert str(by_child.value) == str(in_process.value)
    valid = tmp_path / "valid.onnx"
    onnx.save(relu_model(), str(valid))
    checks = FileChecks.start(valid, checker="full")
    assert checks is not None and check_model_file(valid, None, checks) is None
    checks.close()
    waiting = FileChecks.start(None, checker="full")  # started before the file is written
    assert waiting is not None
    waiting.check_file(invalid)
    with pytest.raises(ValidationFailure) as named_later:
        check_model_file(invalid, None, waiting)
    assert str(named_later.value) == str(in_process.value)
    unnamed = FileChecks.start(None, checker="full")
    assert unnamed is not None
    unnamed.close()  # never named: ended without an answer
    assert unnamed._process.returncode is not None


def test_a_conversion_the_output_check_fails_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report is built while the child checks; its finding still stops the output."""
    source = tmp_path / "m.onnx"
    onnx.save(_branching_model(), str(source))
    spy = _Spy(monkeypatch)
    entry = "import sys; '--full' in sys.argv and sys.stdout.buffer.write(b'c' + (4).to_bytes(8, 'little') + b'bad!')"
    monkeypatch.setattr(onnx_file, "_CHILD_ENTRY", entry)  # the output's checker objects
    with pytest.raises(ValidationFailure, match="fails the ONNX checker: bad!"):
        _convert(source, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()
    assert spy.all_ended()


def test_no_child_starts_where_python_cannot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "m.onnx"
    onnx.save(_branching_model(), str(source))
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(onnx_file.sys, "executable", str(tmp_path / "no-python"))
    assert FileChecks.start(source, checker="structural", infer=True, strict=True) is None
    _convert(source, tmp_path / "out.onnx")
    assert spy.started == []


def test_a_model_the_steps_change_closes_the_child_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An IR version below 4 is raised on load: the file's inference no longer describes the
    model, so the child ends unread and the model is inferred in process."""
    model = relu_model()
    model.ir_version = 3
    model.graph.ClearField("value_info")
    source = tmp_path / "old.onnx"
    onnx.save(model, str(source))
    spy = _Spy(monkeypatch)
    _convert(source, tmp_path / "out.onnx")
    assert spy.kinds == ["input", "output"] and spy.inferred == 0
    assert spy.all_ended()


def test_the_child_does_not_import_the_package(tmp_path: Path) -> None:
    """The child runs this module's file as a script: onnx alone is imported, and a module the
    working directory holds does not stand in for it."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    (tmp_path / "onnx.py").write_text("raise SystemExit('the working directory shadowed onnx')\n")
    source = tmp_path / "m.onnx"
    onnx.save(relu_model(), str(source))
    probe = (
        onnx_file._CHILD_ENTRY.replace("run_name='__main__')", "run_name='__main__'); "
        "sys.stderr.write(str(sorted(m for m in sys.modules if m.startswith('mixprec'))))")
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, onnx_file.__file__, str(source), "--structural", "--infer", "--strict"],
        cwd=tmp_path, capture_output=True, timeout=120, check=True,
    )
    assert done.stderr.decode() == "[]"
    assert done.stdout[:1] == b"c" and done.stdout[1:9] == bytes(8)  # passes the checker
    assert b"m" in done.stdout[9:10]


def test_what_else_writes_to_the_childs_stdout_does_not_break_its_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Output after the child took its private stream (an import's message) goes to stderr and
    the answers are used; bytes before it make the answers unreadable and the conversion infers
    in process, with the same output."""
    source = tmp_path / "m.onnx"
    onnx.save(_branching_model(), str(source))
    expected = _convert(source, tmp_path / "expected.onnx")[0]
    entry = onnx_file._CHILD_ENTRY
    after = entry.replace("os.dup2(2, 1); ", "os.dup2(2, 1); print('a message', flush=True); ")
    assert after != entry
    for noisy, used in ((after, 1), ("print('a message', flush=True); " + entry, 0)):
        spy = _Spy(monkeypatch)
        monkeypatch.setattr(onnx_file, "_CHILD_ENTRY", noisy)
        assert _convert(source, tmp_path / "out.onnx")[0] == expected
        assert spy.kinds == ["input", "output"] and spy.inferred == used
        assert spy.all_ended()


def test_an_objection_told_before_the_child_died_is_not_told_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "m.onnx"
    onnx.save(relu_model(), str(source))
    monkeypatch.setattr(onnx_file, "CHILD_MIN_BYTES", 0)
    frame = b"s" + (3).to_bytes(8, "little") + b"odd"
    monkeypatch.setattr(onnx_file, "_CHILD_ENTRY", f"import sys; sys.stdout.buffer.write({frame!r})")
    checks = FileChecks.start(source, checker=None, infer=True, strict=True)
    assert checks is not None
    told: list[str] = []
    given: list[object] = []

    def fallback(objected):  # noqa: ANN001, ANN202
        given.append(objected)
        return onnx_file.file_inference(source, strict=True, objected=objected)

    inferred = checks.inference(fallback, told.append)
    assert told == ["odd"] and given == [None]
    assert inferred.model is not None


def test_no_child_where_the_interpreter_is_an_application(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = tmp_path / "m.onnx"
    onnx.save(relu_model(), str(source))
    monkeypatch.setattr(onnx_file, "CHILD_MIN_BYTES", 0)
    monkeypatch.setattr(onnx_file.sys, "frozen", True, raising=False)
    assert FileChecks.start(source, checker="structural", infer=True) is None
