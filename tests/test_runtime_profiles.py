"""The shipped runtime kernel profiles: reproducible from the pinned tables, and truthful."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterable
from functools import cache
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
GENERATOR = REPO_ROOT / "tools" / "gen_runtime_profiles.py"
PROFILES = ("ort-cpu", "ort-cuda", "ort-dml", "tensorrt")
HALF_TYPES = frozenset({"tensor(float16)", "tensor(bfloat16)"})
F16 = "tensor(float16)"
OPEN_END = 2**31 - 1  # onnxruntime's "no upper bound" in a kernel's version range


@cache
def generator() -> ModuleType:
    """tools/gen_runtime_profiles.py imported as a module."""
    spec = importlib.util.spec_from_file_location("gen_runtime_profiles", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def shipped_text(name: str) -> str:
    """The text of a shipped profile, read as package data."""
    path = resources.files("mixprec").joinpath("policy", "runtimes", f"{name}.json")
    return path.read_text(encoding="utf-8")


@cache
def profile(name: str) -> dict[str, Any]:
    return json.loads(shipped_text(name))


def entries(name: str, domain: str, op: str) -> list[dict[str, Any]]:
    return profile(name)["kernels"][domain][op]


def admits(name: str, domain: str, op: str, type_: str) -> bool:
    """Whether any kernel of the op lists ``type_`` for some type variable."""
    return any(type_ in types for e in entries(name, domain, op) for types in e["types"].values())


# --------------------------------------------------------------------------- reproduction


@pytest.fixture(scope="module")
def source() -> Path:
    path = generator().DEFAULT_SOURCE
    if not (path / "OperatorKernels.md").is_file():
        pytest.skip(f"pinned runtime tables not present at {path}")
    return path


def test_generator_reproduces_the_shipped_profiles(source: Path) -> None:
    files = generator().generate(source)
    assert sorted(files) == sorted(f"{name}.json" for name in PROFILES)
    for file_name, text in files.items():
        assert shipped_text(file_name.removesuffix(".json")) == text, f"{file_name} is stale"


def test_check_mode_names_a_stale_file(source: Path, tmp_path: Path, capsys: Any) -> None:
    gen = generator()
    gen.write(gen.generate(source), tmp_path)
    assert gen.main(["--source", str(source), "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "ort-dml.json").write_text("{}\n", encoding="utf-8")
    assert gen.main(["--source", str(source), "--out", str(tmp_path), "--check"]) == 1
    assert "ort-dml.json" in capsys.readouterr().out


def test_unknown_layout_is_reported_with_its_line(source: Path, tmp_path: Path) -> None:
    for name in ("SOURCE.md", "operators.md"):
        (tmp_path / name).write_text((source / name).read_text(encoding="utf-8"), "utf-8")
    table = (source / "OperatorKernels.md").read_text(encoding="utf-8").splitlines()
    line_no = next(n for n, line in enumerate(table, 1) if line.startswith("|Abs|"))
    table[line_no - 1] = table[line_no - 1].replace("13+", "13 and later")
    (tmp_path / "OperatorKernels.md").write_text("\n".join(table), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"OperatorKernels\.md:{line_no}: unknown opset version"):
        generator().generate(tmp_path)


def test_unknown_tensorrt_type_spelling_fails() -> None:
    gen = generator()
    line = gen.Line(Path("operators.md"), 7, "| Foo | Y | FP32, FP4 |")
    with pytest.raises(ValueError, match=r"operators\.md:7: .*FP4"):
        gen.trt_types(line, "FP32, FP4")


# --------------------------------------------------------------------------- parsed facts


def test_profile_headers() -> None:
    for name in PROFILES:
        assert profile(name)["name"] == name
    assert profile("ort-cuda")["provider"] == "CUDAExecutionProvider"
    assert profile("ort-cpu")["source"].startswith("OperatorKernels.md at onnxruntime commit ")
    assert profile("tensorrt")["runtime"] == "tensorrt"
    assert profile("tensorrt")["provider"] == "TensorrtExecutionProvider"
    assert profile("tensorrt")["opset_range"] == [9, 20]
    assert profile("ort-cpu")["opset_range"] is None


@pytest.mark.parametrize(
    "op", ["Attention", "SkipLayerNormalization", "BiasGelu", "FastGelu", "MultiHeadAttention"]
)
def test_cuda_contrib_transformer_kernels_admit_float16(op: str) -> None:
    assert admits("ort-cuda", "com.microsoft", op, F16)


def test_cpu_has_no_float16_matmul_gemm_or_conv() -> None:
    for op in ("MatMul", "Gemm", "Conv"):
        assert not admits("ort-cpu", "", op, F16), op
    assert admits("ort-cuda", "", "MatMul", F16)


def test_cpu_conv_version_ranges() -> None:
    ranges = [(e["since"], e["until"]) for e in entries("ort-cpu", "", "Conv")]
    assert ranges == [(22, None), (11, 21), (1, 10)]
    assert entries("ort-cpu", "", "Conv")[0]["types"] == {"T": ["tensor(float)"]}


def test_layer_normalization_entries() -> None:
    newest, older = entries("ort-cpu", "", "LayerNormalization")
    assert (newest["since"], newest["until"], older["since"], older["until"]) == (17, None, 1, 16)
    assert newest["inputs"] == [["X", "T"], ["Scale", "T"], ["B", "T"]]
    assert newest["outputs"] == [["Y", "T"], ["Mean", "U"], ["InvStdDev", "U"]]
    assert F16 in newest["types"]["T"] and newest["types"]["U"] == ["tensor(float)"]
    cuda = entries("ort-cuda", "", "LayerNormalization")[0]["types"]
    assert {F16, "tensor(bfloat16)"} <= set(cuda["T"])


def test_signature_details() -> None:
    argmax = entries("ort-cpu", "", "ArgMax")[0]
    assert argmax["outputs"] == [["reduced", "tensor(int64)"]]  # a fixed type, not a variable
    resize = entries("ort-cpu", "", "Resize")  # the "or" variant with the most inputs
    assert [name for name, _ in resize[0]["inputs"]] == ["X", "roi", "scales", "sizes"]
    # Each version row takes the variant whose type variables it constrains: Resize-10 has
    # the two-input form over T, the newer rows the four-input form over T1/T2.
    resize_10 = next(e for e in resize if e["since"] == 10)
    assert resize_10["inputs"] == [["X", "T"], ["scales", "tensor(float)"]]
    batchnorm_cuda = entries("ort-cuda", "", "BatchNormalization")[0]
    assert {v for _, v in batchnorm_cuda["inputs"]} <= set(batchnorm_cuda["types"])
    batchnorm = entries("ort-cpu", "", "BatchNormalization")[0]  # the variant over T, T1, T2
    assert batchnorm["inputs"] == [
        ["X", "T"], ["scale", "T1"], ["B", "T1"], ["input_mean", "T2"], ["input_var", "T2"]
    ]
    assert entries("ort-dml", "", "GroupNorm")[0]["inputs"] is None  # the table lists none


def test_domains_are_normalized() -> None:
    assert sorted(profile("ort-cpu")["kernels"]) == [
        "",
        "ai.onnx.ml",
        "com.microsoft",
        "com.microsoft.nchwc",
    ]


def test_tensorrt_entries() -> None:
    (layer_norm,) = entries("tensorrt", "", "LayerNormalization")
    assert layer_norm["note"] == "Only the first output `Y` is supported."
    assert (layer_norm["since"], layer_norm["until"]) == (1, None)  # op-level: any op version
    assert layer_norm["inputs"] is None and layer_norm["outputs"] is None
    assert layer_norm["types"] == {"*": ["tensor(bfloat16)", "tensor(float)", "tensor(float16)"]}
    assert "note" not in entries("tensorrt", "", "Conv")[0]
    assert "tensor(int64)" in entries("tensorrt", "", "ConstantOfShape")[0]["types"]["*"]
    assert "tensor(float8e4m3fn)" in entries("tensorrt", "", "DequantizeLinear")[0]["types"]["*"]
    assert "tensor(bfloat16)" not in entries("tensorrt", "", "Mish")[0]["types"]["*"]
    assert "AffineGrid" not in profile("tensorrt")["kernels"][""]  # Supported = N


# --------------------------------------------------------------------------- installed runtime

# (domain, op, since, until); until None = open-ended
KernelKey = tuple[str, str, int, "int | None"]


def profile_kernels(name: str) -> dict[KernelKey, dict[str, set[str]]]:
    """(domain, op, since, until) -> type variable -> 16-bit types, from a shipped profile."""
    kernels: dict[KernelKey, dict[str, set[str]]] = {}
    for domain, ops in profile(name)["kernels"].items():
        for op, op_entries in ops.items():
            for e in op_entries:
                key = (domain, op, e["since"], e["until"])
                kernels[key] = {var: set(ts) & HALF_TYPES for var, ts in e["types"].items()}
    return kernels


def input_bound(
    data: dict[str, Any], kernels: dict[KernelKey, dict[str, set[str]]]
) -> dict[KernelKey, dict[str, set[str]]]:
    """`kernels` restricted to the type variables each profile entry binds to an input."""
    bound: dict[KernelKey, set[str]] = {}
    for domain, ops in data["kernels"].items():
        for op, op_entries in ops.items():
            for e in op_entries:
                bound[(domain, op, e["since"], e["until"])] = {v for _, v in e["inputs"] or []}
    return {
        key: {var: types for var, types in vars_.items() if var in bound.get(key, set())}
        for key, vars_ in kernels.items()
    }


def installed_kernels(provider: str) -> dict[KernelKey, dict[str, set[str]]]:
    """The same, from the installed onnxruntime's registered kernel definitions."""
    state = pytest.importorskip("onnxruntime.capi.onnxruntime_pybind11_state")
    kernels: dict[KernelKey, dict[str, set[str]]] = {}
    for kernel in state.get_all_opkernel_def():
        if kernel.provider != provider:
            continue
        since, until = kernel.version_range
        key = (kernel.domain, kernel.op_name, since, None if until == OPEN_END else until)
        types = kernels.setdefault(key, {})
        for var, listed in kernel.type_constraints.items():
            types.setdefault(var, set()).update(set(listed) & HALF_TYPES)
    return kernels


def overlaps(a: KernelKey, b: KernelKey) -> bool:
    """Same op and intersecting opset ranges."""
    if a[:2] != b[:2]:
        return False
    return a[2] <= (b[3] if b[3] is not None else OPEN_END) and b[2] <= (
        a[3] if a[3] is not None else OPEN_END
    )


def unbacked(
    claims: dict[KernelKey, dict[str, set[str]]], truth: dict[KernelKey, dict[str, set[str]]]
) -> list[str]:
    """Each 16-bit fact of ``claims`` that a kernel of ``truth`` with an overlapping range lacks."""
    found = []
    for key, types in sorted(claims.items(), key=lambda item: repr(item[0])):
        for other in (k for k in truth if overlaps(key, k)):
            found += [
                f"{describe(key)} {var}={t} (absent from {describe(other)})"
                for var, listed in sorted(types.items())
                for t in sorted(listed - truth[other].get(var, set()))
            ]
    return found


def unmatched(claims: Iterable[KernelKey], truth: dict[KernelKey, Any]) -> list[KernelKey]:
    """Kernels of ``claims`` that no kernel of ``truth`` overlaps."""
    return [key for key in claims if not any(overlaps(key, k) for k in truth)]


def describe(key: KernelKey) -> str:
    domain, op, since, until = key
    return f"{domain or 'ai.onnx'}::{op}[{since}, {'+' if until is None else until}]"


def test_cpu_profile_claims_no_16bit_kernel_the_installed_runtime_lacks() -> None:
    installed = installed_kernels("CPUExecutionProvider")
    shipped = profile_kernels("ort-cpu")
    assert installed, "the installed onnxruntime reports no CPU kernels"

    extra = unbacked(installed, shipped)
    extra += [
        f"{describe(key)} {var}={t} (op/range absent from the profile)"
        for key in unmatched(installed, shipped)
        for var, listed in sorted(installed[key].items())
        for t in sorted(listed)
    ]
    if extra:
        print(f"installed onnxruntime has {len(extra)} 16-bit CPU kernel facts the profile lacks:")
        print("\n".join(f"  {fact}" for fact in extra))

    # Type variables bound to no input (LayerNormalization's Mean/InvStdDev type U) are the
    # kernel's own choice: the converter never retypes them, so a stale claim there is only named.
    convertible = input_bound(profile("ort-cpu"), shipped)
    output_only = sorted(set(unbacked(shipped, installed)) - set(unbacked(convertible, installed)))
    if output_only:
        print(f"stale output-only facts in the profile (never converted): {output_only}")
    missing = unbacked(convertible, installed)
    assert not missing, (
        f"ort-cpu profile claims {len(missing)} 16-bit kernel fact(s) the installed onnxruntime "
        "lacks:\n" + "\n".join(missing)
    )


def test_every_runtime_is_a_data_file() -> None:
    """Each profile, the hand-written ones included, is one JSON file: what runtime Z runs is
    in runtimes/Z.json."""
    from importlib import resources  # noqa: PLC0415

    from mixprec.policy.profiles import RUNTIMES, load_runtime  # noqa: PLC0415

    folder = resources.files("mixprec.policy").joinpath("runtimes")
    assert sorted(f"{name}.json" for name in RUNTIMES) == sorted(e.name for e in folder.iterdir() if e.name.endswith(".json"))
    openvino, onnx_only = load_runtime("openvino"), load_runtime("onnx")
    assert not openvino.has_table and not onnx_only.has_table
    assert openvino.needs_one_type("", "BatchNormalization") and not onnx_only.needs_one_type("", "BatchNormalization")
    assert not load_runtime("ort-cuda").needs_one_type("", "BatchNormalization")


def test_ops_a_runtime_cannot_run_at_all_are_named(tmp_path: Path) -> None:
    # onnxruntime's dynamic quantization writes DynamicQuantizeLinear and ConvInteger, which
    # TensorRT's parser does not import (operators.md): no conversion makes the model run there,
    # so the report says so. onnxruntime's providers fall back to its CPU provider: no note.
    import mixprec  # noqa: PLC0415
    from mixprec.policy.profiles import load_runtime  # noqa: PLC0415
    from test_calibration import _dynamic_conv_attention  # noqa: PLC0415

    model, _ = _dynamic_conv_attention(tmp_path)
    notes = mixprec.convert(model, tmp_path / "trt.onnx", runtime="tensorrt", validate="checker").report.notes
    refused = [n for n in notes if "cannot run" in n]
    assert len(refused) == 1 and refused[0].startswith("tensorrt cannot run ConvInteger, DynamicQuantizeLinear (")
    assert "FP32 or converted" in refused[0]
    notes = mixprec.convert(model, tmp_path / "cuda.onnx", runtime="ort-cuda", validate="checker").report.notes
    assert not any("cannot run" in n for n in notes)
    assert load_runtime("tensorrt").refuses("", "MatMulInteger") and not load_runtime("tensorrt").refuses("", "Constant")
    assert not load_runtime("ort-cuda").refuses("", "MatMulInteger") and not load_runtime("openvino").refuses("", "X")
