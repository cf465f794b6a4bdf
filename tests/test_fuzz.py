"""Broken, mutated and hostile input: one line on stderr, a documented exit code, nothing
half-written, nothing left behind, nothing read outside the model's folder.

Every case runs the command line in-process. For each: the exit code is 0, 2, 3, 4 or 5; the
last stderr line is a single line without a traceback; there is a file at the output path only
after exit 0 or 5 (5: written, numerics unchecked) and then it passes the ONNX checker; no
staging folder or stray data file is left. The seeded mutations are a sample; a longer run:
`python bench/fuzz_inputs.py --cases 2000`.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mixprec.cli import main
from mixprec.demo_models import DEMO_MODELS

OK_CODES = {0, 5}
ALLOWED = {0, 2, 3, 4, 5}


def _external(folder: Path, location: str | None = None, length: int | None = None) -> Path:
    """An MLP whose weight lives in external data (optionally at a hostile location)."""
    folder.mkdir(parents=True, exist_ok=True)
    weight = numpy_helper.from_array(np.full((64, 64), 0.01, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="fc")], "ext",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])], [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "ext.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="ext.bin", size_threshold=0)
    if location is not None or length is not None:
        proto = onnx.load(str(path), load_external_data=False)
        for entry in proto.graph.initializer[0].external_data:
            if entry.key == "location" and location is not None:
                entry.value = location
            if entry.key == "length" and length is not None:
                entry.value = str(length)
        onnx.save(proto, str(path))
    return path


def _graph_model(nodes: list, inputs: list, outputs: list, inits: list = (), opset: int = 17, ir: int | None = None, **kw) -> onnx.ModelProto:  # type: ignore[assignment]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=[helper.make_opsetid("", opset)], **kw)
    if ir is not None:
        model.ir_version = ir
    return model


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])


def _bad_tensor(dims: list[int], raw: bytes | None) -> onnx.ModelProto:
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=dims)
    if raw is not None:
        tensor.raw_data = raw
    return _graph_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [X], [Y], [tensor])


def _recursive_function() -> onnx.ModelProto:
    body = helper.make_node("Rec", ["a"], ["b"], domain="local")
    function = helper.make_function("local", "Rec", ["a"], ["b"], [body], [helper.make_opsetid("", 17)])
    model = _graph_model([helper.make_node("Rec", ["x"], ["y"], domain="local")], [X], [Y])
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.functions.append(function)
    return model


def _hostile_models(folder: Path) -> dict[str, Path]:
    """Name -> model file, each broken or hostile in one way."""
    protos: dict[str, onnx.ModelProto] = {
        "shape-data-mismatch": _bad_tensor([4, 4], b"\0" * 8),
        "dims-without-data": _bad_tensor([1 << 20, 1 << 20], None),
        "negative-dims": _bad_tensor([-4, 4], b"\0" * 64),
        "cycle": _graph_model([helper.make_node("Relu", ["z"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], [X], [Y]),
        "undefined-input": _graph_model([helper.make_node("Relu", ["nowhere"], ["y"])], [X], [Y]),
        "unknown-op": _graph_model([helper.make_node("NoSuchOp", ["x"], ["y"])], [X], [Y]),
        "opset-0": _graph_model([helper.make_node("Relu", ["x"], ["y"])], [X], [Y], opset=0),
        "ir-99": _graph_model([helper.make_node("Relu", ["x"], ["y"])], [X], [Y], ir=99),
        "type-mismatch": _graph_model(
            [helper.make_node("Add", ["x", "i"], ["y"])],
            [X, helper.make_tensor_value_info("i", TensorProto.INT64, [4, 4])], [Y],
        ),
        "recursive-function": _recursive_function(),
        "sequence-input": _graph_model(
            [helper.make_node("SequenceAt", ["s", "k"], ["y"])],
            [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [4, 4]), helper.make_tensor_value_info("k", TensorProto.INT64, [])],
            [Y],
        ),
    }
    paths = {}
    for name, proto in protos.items():
        path = folder / f"{name}.onnx"
        path.write_bytes(proto.SerializeToString())
        paths[name] = path
    bad_utf8 = _graph_model([helper.make_node("Relu", ["x"], ["y"])], [X], [Y]).SerializeToString().replace(b"Relu", b"Re\xffu")
    (folder / "op-not-utf8.onnx").write_bytes(bad_utf8)
    paths["op-not-utf8"] = folder / "op-not-utf8.onnx"
    paths["traversal"] = _external(folder / "trav" / "inner", location="../../../../../etc/hostname")
    paths["absolute"] = _external(folder / "abs", location="/etc/hostname")
    link = folder / "link"
    paths["symlink-escape"] = _external(link, location="escape.bin")
    (link / "escape.bin").symlink_to("/etc/hostname")
    paths["data-too-short"] = _external(folder / "short", length=1 << 20)
    paths["empty"] = folder / "empty.onnx"
    paths["empty"].write_bytes(b"")
    paths["directory"] = folder
    return paths


def _mutations(folder: Path, count: int, seed: int = 0) -> dict[str, Path]:
    """Seeded truncations and byte flips of real models."""
    rng = random.Random(seed)
    sources = {
        "cnn": DEMO_MODELS["cnn"]().SerializeToString(),
        "transformer": DEMO_MODELS["transformer"]().SerializeToString(),
    }
    paths = {}
    for index in range(count):
        name, data = rng.choice(sorted(sources.items()))
        data = bytearray(data)
        if index % 3 == 0:
            data = data[: rng.randrange(1, len(data))]
            kind = "truncated"
        else:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            kind = "flipped"
        path = folder / f"{name}-{kind}-{index}.onnx"
        path.write_bytes(bytes(data))
        paths[path.stem] = path
    return paths


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".mixprec-" in p.name or p.name.startswith(("out.onnx.", ".out.onnx")) and p.suffix == ".data")


def _run_case(source: Path, out_dir: Path, extra: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / "out.onnx"
    code = main(["convert", str(source), str(output), *extra])
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert code in ALLOWED, (source.name, code, err)
    assert "Traceback" not in err, (source.name, err)
    assert len(last) < 2000, (source.name, last[:200])
    if code in OK_CODES:
        onnx.checker.check_model(str(output), full_check=False)
    else:
        assert not output.exists(), (source.name, code, last)
        assert last.startswith("mixprec: error: "), (source.name, last)
    left = [p.name for p in out_dir.iterdir() if p.name.startswith(".out.onnx.mixprec-")]
    assert not left, (source.name, left)
    return code, last


def test_hostile_and_mutated_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    models = tmp_path / "models"
    models.mkdir()
    hostile = _hostile_models(models)
    expected_codes = {
        "shape-data-mismatch": 4, "dims-without-data": 4, "negative-dims": 4, "cycle": 4,
        "undefined-input": 4, "unknown-op": 4, "opset-0": 4, "ir-99": 4, "type-mismatch": 4,
        "recursive-function": 4, "op-not-utf8": 4, "traversal": 4, "absolute": 4,
        "symlink-escape": 4, "data-too-short": 4, "empty": 4, "directory": 4, "sequence-input": 5,
    }
    tally: Counter[int] = Counter()
    for name, path in hostile.items():
        code, last = _run_case(path, tmp_path / "out" / name, [], capsys)
        tally[code] += 1
        assert code == expected_codes[name], (name, code, last)
        if name in ("traversal", "absolute", "symlink-escape"):
            assert "outside the model's folder" in last, last
    for name, path in _mutations(models, 45).items():
        code, _ = _run_case(path, tmp_path / "out" / name, ["--validate", "checker"], capsys)
        tally[code] += 1
    assert tally[4] >= 20  # most mutations break the protobuf or the graph


def _newer_function_body() -> onnx.ModelProto:
    """A function whose body imports the default domain at a newer version than the model (it
    runs; it cannot be inlined)."""
    body = helper.make_function("local", "Act", ["a"], ["b"], [helper.make_node("Relu", ["a"], ["b"])], [helper.make_opsetid("", 18)])
    model = _graph_model([helper.make_node("Act", ["x"], ["y"], domain="local")], [X], [Y])
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.functions.append(body)
    return model


@pytest.mark.parametrize(
    ("name", "extra", "message"),
    [
        ("recursive-function", ["--allow-invalid"], "Cyclic dependency detected between functions: local::Rec -> local::Rec"),
        ("newer-body", [], "function 'Act' imports the default domain at version 18, the model at 17"),
    ],
)
def test_functions_that_cannot_be_inlined(
    name: str, extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--inline-functions on functions no inliner can inline: a one-line error naming the
    function, and no output."""
    source = tmp_path / f"{name}.onnx"
    onnx.save(_recursive_function() if name == "recursive-function" else _newer_function_body(), str(source))
    code, last = _run_case(source, tmp_path / "out", [*extra, "--inline-functions"], capsys)
    assert code == 2 and last == f"mixprec: error: cannot inline the model's local functions: {message}", last


def test_outputs_are_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "m.onnx"
    onnx.save(DEMO_MODELS["cnn"](), str(source))
    out = tmp_path / "o.onnx"
    for flag in ("--report", "--plan-out", "--html"):
        code = main(["convert", str(source), str(out), flag, str(tmp_path / "missing" / "f")])
        assert code == 2 and not out.exists()
        assert f"{tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    assert main(["convert", str(source), str(out), "--report", str(out)]) == 2
    assert "name the same file" in capsys.readouterr().err


def test_output_equal_to_input_needs_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "m.onnx"
    onnx.save(DEMO_MODELS["cnn"](), str(source))
    before = source.read_bytes()
    assert main(["convert", str(source), str(source)]) == 2
    assert "--overwrite" in capsys.readouterr().err and source.read_bytes() == before
    assert main(["convert", str(source), str(source), "--overwrite"]) == 0
    assert source.read_bytes() != before
    onnx.checker.check_model(str(source))


def test_invalid_model_converts_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A valid graph whose declared output type is wrong: the checker's strict inference and
    # onnxruntime both reject it.
    model = _graph_model([helper.make_node("Relu", ["x"], ["y"])], [X], [helper.make_tensor_value_info("y", TensorProto.INT64, [4, 4])])
    source = tmp_path / "m.onnx"
    source.write_bytes(model.SerializeToString())
    assert main(["convert", str(source), str(tmp_path / "o.onnx")]) == 4
    assert "--allow-invalid" in capsys.readouterr().err
    code = main(["convert", str(source), str(tmp_path / "o.onnx"), "--allow-invalid", "--validate", "none"])
    assert code == 0


def test_input_check_infers_once_and_accepts_what_onnxruntime_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The type step's inference is the input check's strict half: a valid model never runs the
    full checker again; a model strict inference rejects (an intermediate declared [4, 5] where
    Relu gives [4, 4]) but onnxruntime loads converts, with the computed shape."""
    import onnxruntime as ort

    from mixprec.pipeline import steps

    full_checks: list[object] = []
    real = steps.input_problem
    monkeypatch.setattr(steps, "input_problem", lambda model, order=None: full_checks.append(model) or real(model, order))
    source = tmp_path / "m.onnx"
    onnx.save(_graph_model([helper.make_node("Relu", ["x"], ["y"])], [X], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])]), str(source))
    assert main(["convert", str(source), str(tmp_path / "ok.onnx"), "--validate", "none"]) == 0
    assert full_checks == []
    relu2 = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["y"], ["z"])]
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 4])
    declared = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5])
    graph = helper.make_graph(relu2, "g", [X], [z], value_info=[declared])
    source.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    out = tmp_path / "o.onnx"
    assert main(["convert", str(source), str(out)]) in OK_CODES
    assert full_checks == [source]
    x = np.linspace(-2, 2, 16, dtype=np.float32).reshape(4, 4)
    (result,) = ort.InferenceSession(str(out)).run(None, {"x": x})
    np.testing.assert_allclose(result, np.maximum(x, 0), rtol=1e-3)


def test_external_data_no_inlines_the_weights(tmp_path: Path) -> None:
    source = _external(tmp_path / "m")
    out = tmp_path / "o" / "o.onnx"
    out.parent.mkdir()
    assert main(["convert", str(source), str(out), "--external-data", "no", "--runtime", "ort-cpu"]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["o.onnx"]
    model = onnx.load(str(out), load_external_data=False)
    assert all(t.data_location != TensorProto.EXTERNAL for t in model.graph.initializer)


def test_publishing_replaces_the_pair_and_leaves_nothing(tmp_path: Path) -> None:
    source = _external(tmp_path / "m")
    out = tmp_path / "o.onnx"

    def data_files() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("o.onnx."))

    assert main(["convert", str(source), str(out), "--external-data", "yes", "--runtime", "ort-cpu"]) == 0
    first = data_files()
    assert len(first) == 1
    # Leftovers of a killed writer (dead process id): removed by the next save.
    (tmp_path / ".o.onnx.mixprec-999999-deadbeef-x").mkdir()
    (tmp_path / "o.onnx.999999-deadbeef.data").write_bytes(b"junk")
    assert main(["convert", str(source), str(out), "--external-data", "yes", "--runtime", "ort-cpu"]) == 0
    second = data_files()
    assert len(second) == 1 and second != first  # the new pair replaced the old one
    assert not [p for p in tmp_path.iterdir() if ".mixprec-" in p.name]
    referenced = {e.value for t in onnx.load(str(out), load_external_data=False).graph.initializer for e in t.external_data if e.key == "location"}
    assert referenced == set(second)


@pytest.mark.slow
def test_many_inputs_convert_in_linear_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """20,000 inputs into one Sum: onnxruntime's Python feed check is quadratic; the check
    runs past it (the runs go through the direct path, counted, not timed)."""
    from mixprec.runtime import sessions  # noqa: PLC0415

    direct: list[int] = []
    original = sessions._run_many_inputs

    def counting(session, feeds, output_names):  # type: ignore[no-untyped-def]
        direct.append(len(feeds))
        return original(session, feeds, output_names)

    monkeypatch.setattr(sessions, "_run_many_inputs", counting)
    n = 20000
    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [2]) for i in range(n)]
    model = _graph_model([helper.make_node("Sum", [f"x{i}" for i in range(n)], ["y"])], inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    source = tmp_path / "sum.onnx"
    source.write_bytes(model.SerializeToString())
    assert main(["convert", str(source), str(tmp_path / "o.onnx")]) == 0
    assert direct and all(count == n for count in direct)


def _mount_tmpfs(path: Path, options: str) -> bool:
    import subprocess  # noqa: PLC0415

    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode == 0


def test_full_and_read_only_disks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess  # noqa: PLC0415

    source = _external(tmp_path / "m")
    full, read_only = tmp_path / "full", tmp_path / "ro"
    if not _mount_tmpfs(full, "size=16k"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        assert _mount_tmpfs(read_only, "ro,size=16k")
        code = main(["convert", str(source), str(full / "o.onnx"), "--runtime", "onnx"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "No space left on device" in err and len(err.splitlines()) == 1, err
        assert list(full.iterdir()) == []  # no output, no staging folder
        code = main(["convert", str(source), str(read_only / "o.onnx")])
        assert code == 2 and "is not writable" in capsys.readouterr().err
    finally:
        for mount in (full, read_only):
            subprocess.run(["umount", str(mount)], capture_output=True)


def test_sigterm_cleans_up(tmp_path: Path) -> None:
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    n = 20000  # a few seconds of work
    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [2]) for i in range(n)]
    model = _graph_model([helper.make_node("Sum", [f"x{i}" for i in range(n)], ["y"])], inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    source = tmp_path / "sum.onnx"
    source.write_bytes(model.SerializeToString())
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    child = subprocess.Popen([sys.executable, "-m", "mixprec.cli", "convert", str(source), str(out_dir / "o.onnx")], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(".mixprec-" in p.name for p in out_dir.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130, err
    assert err.strip().splitlines()[-1] == "mixprec: interrupted"
    assert list(out_dir.iterdir()) == []


def test_hostile_factory_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The `file.py:factory` entry: a missing file, a missing function, broken or failing code, a
    wrong return value: one line, exit 2, nothing written (no torch needed to get there)."""
    cases = {
        "missing": (None, "no such Python file"),
        "syntax": ("def build(:\n", "SyntaxError"),
        "raises": ("def build():\n    raise ValueError('bad weights')\n", "ValueError: bad weights"),
        "returns": ("def build():\n    return 42\n", "must return (module, example_inputs)"),
        "nofunc": ("x = 1\n", "defines no function 'build'"),
    }
    for name, (body, expected) in cases.items():
        script = tmp_path / f"{name}.py"
        if body is not None:
            script.write_text(body)
        out_dir = tmp_path / f"out-{name}"
        out_dir.mkdir()
        out = out_dir / "out.onnx"
        assert main(["convert", f"{script}:build", str(out)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert expected in err and "\n" not in err, (name, err)
        assert not list(out_dir.iterdir()), (name, list(out_dir.iterdir()))
