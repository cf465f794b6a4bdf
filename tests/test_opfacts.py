"""The op-facts table parses strictly and agrees with the ONNX operator schemas."""

from __future__ import annotations

import onnx_ir as ir

import onnx.defs
import pytest

from mixprec.dtypes import LowPrecision
from mixprec.errors import PolicyError
from mixprec.policy.opfacts import (
    FLOPS_FORMULAS,
    INTERVAL_RULES,
    NO_FACTS,
    Carrier,
    all_op_facts,
    op_facts,
    parse_op_facts,
)
from mixprec.policy.profiles import load_runtime
from mixprec.policy.table import load_policy, parse_policy

FACTS = all_op_facts()


def _latest_schema(domain: str, op: str) -> onnx.defs.OpSchema:
    return onnx.defs.get_schema(op, domain)


def test_the_table_parses_and_answers_by_domain() -> None:
    assert len(FACTS) > 50
    add = op_facts("", "Add")
    assert add.carrier is Carrier.ARITHMETIC and add.interval == "add" and add.carries_floats
    assert op_facts("ai.onnx", "Add") == add
    assert op_facts("com.example", "Add") is NO_FACTS
    assert op_facts("", "NoSuchOp") is NO_FACTS
    assert op_facts("", "Range").integer_inputs == ((0, "start"), (1, "limit"), (2, "delta"))
    assert op_facts("", "MatMul").flops == "matmul" and op_facts("", "Gather").gathers


def test_every_op_exists_in_onnx_or_a_runtime() -> None:
    runtimes = [load_runtime(name) for name in ("ort-cpu", "ort-cuda", "ort-dml")]
    missing = [
        (domain, op)
        for domain, op in FACTS
        if not onnx.defs.has(op, domain) and not any(r.knows(domain, op) for r in runtimes)
    ]
    assert not missing


def test_dtype_attributes_exist_on_the_schemas() -> None:
    listed = {key: facts.dtype_attribute for key, facts in FACTS.items() if facts.dtype_attribute}
    assert listed[("", "Cast")] == "to" and listed[("", "DequantizeLinear")] == "output_dtype"
    for (domain, op), name in listed.items():
        attributes = _latest_schema(domain, op).attributes
        assert name in attributes, (op, name)
        kinds = onnx.defs.OpSchema.AttrType
        assert attributes[name].type == (kinds.TENSOR if name == "value" else kinds.INT), (op, name)


def test_integer_input_roles_are_the_schema_input_names() -> None:
    for (domain, op), facts in FACTS.items():
        inputs = _latest_schema(domain, op).inputs if facts.integer_inputs else []
        for index, role in facts.integer_inputs:
            assert index < len(inputs) and inputs[index].name == role, (op, index, role)


def test_named_rules_are_implemented() -> None:
    from mixprec.analysis import value_bounds  # noqa: PLC0415
    from mixprec.analysis import cost_model as cost  # noqa: PLC0415

    assert set(value_bounds.INTERVAL_RULES) == INTERVAL_RULES
    assert set(cost._FORMULAS) == FLOPS_FORMULAS
    used = {f.interval for f in FACTS.values()} | {f.flops for f in FACTS.values()}
    assert used - {None} == INTERVAL_RULES | FLOPS_FORMULAS


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"colour": "red"}, "unknown key 'colour'"),
        ({"carrier": "teleport"}, "unknown carrier 'teleport'"),
        ({"interval": "sideways"}, "unknown interval 'sideways'"),
        ({"flops": "lots"}, "unknown flops 'lots'"),
        ({"random": "yes"}, "'random' must be true or false"),
        ({"integer_inputs": {"x": "depth"}}, "'integer_inputs'"),
        ({"integer_inputs": [0, 1]}, "'integer_inputs'"),
        ({"dtype_attribute": 1}, "'dtype_attribute'"),
    ],
)
def test_bad_entries_name_the_file_op_and_key(entry: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=rf"my\.toml: \[OneHot\]: {message}"):
        parse_op_facts({"OneHot": entry}, "my.toml")


def test_a_domain_op_is_keyed_by_its_domain() -> None:
    facts = parse_op_facts({"com.example::Mix": {"random": True}, "ai.onnx::Mix": {}}, "my.toml")
    assert facts[("com.example", "Mix")].random and ("", "Mix") in facts


def test_policy_retargets_the_attribute_the_facts_name() -> None:
    for target in LowPrecision:
        for (domain, op), rule in load_policy(target).rules.items():
            if rule.dtype_attribute is not None:
                assert rule.dtype_attribute == op_facts(domain, op).dtype_attribute

    def rule(**keys: object) -> dict:
        return {"rule": [{"class": "follow", "ops": ["EyeLike"], **keys}]}

    parsed = parse_policy(rule(retarget_dtype=True), LowPrecision.FLOAT16, "my.toml")
    assert parsed.rule_for("", "EyeLike").dtype_attribute == "dtype"
    # The former spelling names the attribute: accepted where it agrees with the facts.
    parsed = parse_policy(rule(dtype_attribute="dtype"), LowPrecision.FLOAT16, "my.toml")
    assert parsed.rule_for("", "EyeLike").dtype_attribute == "dtype"
    with pytest.raises(PolicyError, match="set by 'dtype', not 'to'"):
        parse_policy(rule(dtype_attribute="to"), LowPrecision.FLOAT16, "my.toml")
    with pytest.raises(PolicyError, match="Relu has no attribute"):
        parse_policy(
            {"rule": [{"class": "follow", "ops": ["Relu"], "retarget_dtype": True}]},
            LowPrecision.FLOAT16,
            "my.toml",
        )


def test_ops_that_quantize_their_input_as_they_run() -> None:
    from mixprec.analysis.qdq import quantizes_at_run_time  # noqa: PLC0415

    def node(op: str, domain: str = "", **attributes: int) -> ir.Node:
        return ir.Node(domain, op, [], attributes=[ir.AttrInt64(k, v) for k, v in attributes.items()])

    assert quantizes_at_run_time(node("DynamicQuantizeLinear"))
    assert quantizes_at_run_time(node("MatMulNBits", "com.microsoft", accuracy_level=4))  # int8 compute
    assert not quantizes_at_run_time(node("MatMulNBits", "com.microsoft", accuracy_level=0))
    assert not quantizes_at_run_time(node("MatMulNBits", "com.microsoft"))
    assert not quantizes_at_run_time(node("QuantizeLinear"))  # static: a QDQ end, not dynamic
    assert not quantizes_at_run_time(node("MatMul"))
