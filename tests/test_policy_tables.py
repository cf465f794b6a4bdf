"""The shipped policy tables are checked against the ONNX operator schemas."""

from __future__ import annotations

import functools

import onnx.defs
import pytest

from mixprec.dtypes import LowPrecision
from mixprec.errors import PolicyError
from mixprec.policy.conditions import CONDITIONS
from mixprec.policy.profiles import load_runtime
from mixprec.policy.schemas import signature
from mixprec.policy.table import OpClass, load_policy, parse_policy

TARGETS = list(LowPrecision)


@functools.lru_cache(maxsize=1)
def _schema_index() -> dict[str, list[onnx.defs.OpSchema]]:
    index: dict[str, list[onnx.defs.OpSchema]] = {}
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain in ("", "ai.onnx"):
            index.setdefault(schema.name, []).append(schema)
    return index


def _schemas(op_type: str) -> list[onnx.defs.OpSchema]:
    return _schema_index().get(op_type, [])


def _runtime_kernel(domain: str, op: str) -> bool:
    return any(load_runtime(name).knows(domain, op) for name in ("ort-cpu", "ort-cuda", "ort-dml"))


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.value)
def test_every_op_in_the_table_exists_in_onnx_or_a_runtime(target: LowPrecision) -> None:
    policy = load_policy(target)
    missing = [op for (domain, op) in policy.rules if not _schemas(op) and not _runtime_kernel(domain, op)]
    assert not missing
    # Ops without an ONNX schema are runtime ops (contrib ops, ORT's SimplifiedLayerNormalization).
    runtime_ops = sorted(op for (domain, op) in policy.rules if domain != "" or not _schemas(op))
    assert "Attention" in runtime_ops and "SimplifiedLayerNormalization" in runtime_ops


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.value)
def test_converted_classes_admit_the_target_type_at_some_opset(target: LowPrecision) -> None:
    policy = load_policy(target)
    never = []
    for (domain, op), rule in policy.rules.items():
        if rule.op_class is OpClass.FP32 or domain != "" or not _schemas(op):
            continue  # runtime ops: their kernel tables say the types
        if not any(
            target.type_str in c.allowed_type_strs for s in _schemas(op) for c in s.type_constraints
        ) and not any(target.type_str in f.type_str for s in _schemas(op) for f in s.outputs):
            never.append(op)
    # Constant and ConstantOfShape convert through attributes rather than type constraints; a few
    # old ops never gained bfloat16 (the planner checks the schema of each node's opset).
    allowed = {"Constant", "ConstantOfShape"}
    if target is LowPrecision.BFLOAT16:
        allowed |= {"Shrink", "Scatter", "Upsample"}
    assert set(never) <= allowed, never


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.value)
def test_per_input_settings_name_existing_inputs(target: LowPrecision) -> None:
    policy = load_policy(target)
    for (domain, op), rule in policy.rules.items():
        indices = rule.fp32_inputs | rule.flexible_inputs | rule.saturate_inputs
        if not indices:
            continue
        if domain:  # a contrib op: the inputs of onnxruntime's kernels
            kernels = load_runtime("ort-cuda").kernels.get((domain, op), ())
            counts = [len(k.inputs) for k in kernels if k.inputs is not None]
            assert counts and max(indices) < min(counts), (domain, op, indices)
            continue
        latest = max(_schemas(op), key=lambda s: s.since_version)
        assert max(indices) < len(latest.inputs), (op, indices)
        if rule.fp32_inputs:
            # A pinned input needs a type variable of its own, else pinning would pin the op.
            sig = signature(op, "", latest.since_version, len(latest.inputs), len(latest.outputs))
            assert sig is not None
            for index in rule.fp32_inputs:
                var = sig.input_vars[index]
                others = {v for i, v in enumerate(sig.input_vars) if i != index}
                assert var is None or var not in others | set(sig.output_vars), (op, index)


def test_conditions_are_known() -> None:
    for target in TARGETS:
        for rule in load_policy(target).rules.values():
            if rule.condition is not None:
                assert rule.condition in CONDITIONS


def test_schema_decides_range_before_opset_27() -> None:
    sig = signature("Range", "", 21, 3, 1)
    assert sig is not None and "tensor(float16)" not in sig.allowed["T"]
    sig27 = signature("Range", "", 27, 3, 1)
    assert sig27 is not None and "tensor(float16)" in sig27.allowed["T"]


def test_bfloat16_needs_newer_opsets_than_float16() -> None:
    conv11 = signature("Conv", "", 11, 3, 1)
    conv22 = signature("Conv", "", 22, 3, 1)
    assert conv11 is not None and conv22 is not None
    assert "tensor(float16)" in conv11.allowed["T"]
    assert "tensor(bfloat16)" not in conv11.allowed["T"]
    assert "tensor(bfloat16)" in conv22.allowed["T"]


def test_user_overrides_move_ops_between_classes() -> None:
    policy = load_policy(LowPrecision.FLOAT16).with_overrides(fp32_ops=["MatMul"], low_precision_ops=["Softmax"])
    assert policy.rule_for("", "MatMul").op_class is OpClass.FP32
    assert policy.rule_for("", "Softmax").op_class is OpClass.LOW
    resize = load_policy(LowPrecision.FLOAT16).with_overrides(fp32_ops=["Resize"]).rule_for("", "Resize")
    assert resize.op_class is OpClass.FP32 and resize.fp32_inputs == frozenset({1})
    with pytest.raises(PolicyError, match="MatMul"):
        load_policy(LowPrecision.FLOAT16).with_overrides(fp32_ops=["MatMul"], low_precision_ops=["MatMul"])


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"rule": [{"class": "sometimes", "ops": ["Add"]}]}, "class"),
        ({"rule": [{"class": "low", "ops": ["Add"], "colour": "red"}]}, "colour"),
        ({"rule": [{"class": "low", "ops": []}]}, "ops"),
        ({"rule": [{"class": "conditional", "ops": ["Add"]}]}, "condition"),
        ({"rule": [{"class": "low", "ops": ["Add"], "condition": "attribute_in"}]}, "conditional, fp32 and follow only"),
        ({"rule": [{"class": "low", "ops": ["Add"], "fp32_inputs": ["x"]}]}, "fp32_inputs"),
        ({"rules": []}, "top-level"),
    ],
)
def test_bad_tables_are_rejected_with_the_rule_named(document: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy(document, LowPrecision.FLOAT16, "my.toml")


def test_user_table_with_an_unknown_condition_is_a_one_line_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    table = tmp_path / "p.toml"
    table.write_text('[[rule]]\nclass = "conditional"\nops = ["ReduceMean"]\ncondition = "no_such"\n')
    with pytest.raises(PolicyError, match="unknown condition 'no_such' \\(known: attribute_in"):
        load_policy(LowPrecision.FLOAT16, table)


def test_kernel_accumulation_names_ops_the_profile_runs_in_16_bits() -> None:
    """Each entry of tables/kernel_accumulation.toml names an op its profile has a 16-bit kernel
    for, with its evidence; ONNX Runtime CUDA's InstanceNormalization is one, TensorRT's none."""
    from mixprec.policy.profiles import _kernel_accumulation  # noqa: PLC0415

    table = _kernel_accumulation()
    assert table, "the table is empty"
    for name, ops in table.items():
        profile = load_runtime(name)
        for (domain, op), evidence in ops.items():
            assert profile.runs_in(domain, op, "tensor(float16)") or profile.runs_in(domain, op, "tensor(bfloat16)"), (name, op)
            assert len(evidence) > 40
    assert load_runtime("ort-cuda").accumulates_in_fp32("", "InstanceNormalization") is not None
    assert load_runtime("tensorrt").accumulates_in_fp32("", "InstanceNormalization") is None
