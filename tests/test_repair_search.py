"""The repair's search (`mixprec.validate.repair.find_culprits`) and where it looks first
(`mixprec.pipeline.repair.near_named_nodes`), on synthetic failures and small graphs.

`find_culprits` is driven by a monotone `fails(kept)` built from a known culprit set (the model
"fails" while any culprit is converted), so the answer and the trial count can be checked
exactly; `near_named_nodes` runs on a chain of nodes whose names are prefixes of each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import helper as oh

from mixprec.pipeline.repair import NEAR_HOPS, near_named_nodes
from mixprec.validate.repair import Culprits, find_culprits

CANDIDATES = [f"node_{i}" for i in range(32)]


class Runtime:
    """A monotone failure: the model fails while any culprit is converted (not kept FP32)."""

    def __init__(self, culprits: Iterable[str], *, always: bool = False) -> None:
        self.culprits = frozenset(culprits)
        self.always = always
        self.calls: list[frozenset[str]] = []

    def __call__(self, kept: frozenset[str]) -> bool:
        self.calls.append(kept)
        return self.always or not self.culprits <= kept


def _search(culprits: Iterable[str], candidates: list[str] = CANDIDATES, **kwargs: int) -> tuple[Culprits, Runtime]:
    runtime = Runtime(culprits)
    return find_culprits(candidates, runtime, **kwargs), runtime


@pytest.mark.parametrize(
    "culprits",
    [
        (),
        ("node_0",),
        ("node_31",),
        ("node_13",),
        ("node_3", "node_17", "node_30"),
        ("node_4", "node_5", "node_6"),
        ("node_0", "node_1", "node_30", "node_31"),
    ],
)
def test_finds_exactly_the_culprits_within_the_trial_budget(culprits: tuple[str, ...]) -> None:
    result, runtime = _search(culprits)
    assert result.names is not None
    assert sorted(result.names) == sorted(culprits)
    assert len(set(result.names)) == len(result.names)
    assert not runtime(frozenset(result.names))  # keeping them FP32 makes it load
    # Every trial is one call of `fails`, only ever with candidates kept.
    assert result.trials == len(runtime.calls) - 1
    assert all(kept <= set(CANDIDATES) for kept in runtime.calls)
    # About log2(n) + 1 trials per culprit, plus the check with all kept and the final one.
    per_culprit = math.ceil(math.log2(len(CANDIDATES))) + 1
    assert result.trials <= 2 + per_culprit * len(culprits)


def test_one_culprit_among_many_costs_logarithmically_few_trials() -> None:
    candidates = [f"n{i}" for i in range(1024)]
    result, _ = _search(["n700"], candidates)
    assert result.names == ("n700",)
    assert result.trials <= 2 + math.ceil(math.log2(len(candidates))) + 1


def test_names_none_when_even_every_candidate_kept_fails() -> None:
    runtime = Runtime([], always=True)
    result = find_culprits(CANDIDATES, runtime)
    assert result.names is None
    assert result.trials == 1 == len(runtime.calls)
    assert runtime.calls[0] == frozenset(CANDIDATES)


def test_a_culprit_outside_the_candidates_is_reported_as_none() -> None:
    result, _ = _search(["elsewhere"])
    assert result.names is None


def test_past_max_trials_every_candidate_in_question_is_kept() -> None:
    # With one trial allowed, the check with all kept spends it: every candidate stays FP32.
    result, runtime = _search(["node_9"], max_trials=1)
    assert result.names is not None
    assert set(result.names) == set(CANDIDATES)
    assert not runtime(frozenset(result.names))


@pytest.mark.parametrize("max_trials", [2, 5, 8, 12])
def test_max_trials_caps_the_search_and_still_loads(max_trials: int) -> None:
    culprits = {"node_5", "node_20", "node_28"}
    result, runtime = _search(culprits, max_trials=max_trials)
    exact, _ = _search(culprits)
    assert exact.trials > max_trials  # the cap does bite here
    assert result.names is not None
    assert culprits <= set(result.names) <= set(CANDIDATES)
    assert not runtime(frozenset(result.names))
    assert len(result.names) > len(culprits)  # it gave up and kept the rest in question
    # The cap is checked between culprits: at most one bisection past it.
    assert result.trials <= max_trials + math.ceil(math.log2(len(CANDIDATES)))


def test_a_generous_max_trials_changes_nothing() -> None:
    culprits = {"node_2", "node_11"}
    capped, _ = _search(culprits, max_trials=1000)
    default, _ = _search(culprits)
    assert capped == default
    assert set(capped.names or ()) == culprits


# -- near_named_nodes ----------------------------------------------------------------------


def _chain(names: list[str]) -> ir.Model:
    """x -> Relu(names[0]) -> Relu(names[1]) -> ... -> y."""
    nodes = []
    previous = "x"
    for i, name in enumerate(names):
        out = "y" if i == len(names) - 1 else f"v{i}"
        nodes.append(oh.make_node("Relu", [previous], [out], name=name))
        previous = out
    graph = oh.make_graph(
        nodes, "chain", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return ir.from_proto(model)


CHAIN = [f"Conv_{i}" for i in range(16)]


def _keys(model: ir.Model, key: Callable[[str], str] = lambda name: f"key/{name}") -> dict[ir.Node, str]:
    return {node: key(node.name) for node in model.graph}


def _within(index: int, hops: int = NEAR_HOPS) -> set[str]:
    return {f"key/Conv_{i}" for i in range(len(CHAIN)) if abs(i - index) <= hops}


def test_whole_name_matching_and_the_neighbourhood() -> None:
    model = _chain(CHAIN)
    keys = _keys(model)
    converted = [keys[node] for node in model.graph]
    near = near_named_nodes(model, keys, "Non-zero status code returned while running Conv_12 node.", converted)
    # Conv_12 named, not Conv_1: its neighbourhood is NEAR_HOPS nodes either side.
    assert set(near) == _within(12)
    assert "key/Conv_1" not in near
    near = near_named_nodes(model, keys, "Node (Conv_1) failed: type mismatch", converted)
    assert set(near) == _within(1)
    assert "key/Conv_12" not in near and "key/Conv_10" not in near


def test_result_follows_the_order_of_converted_and_keeps_only_converted() -> None:
    model = _chain(CHAIN)
    keys = _keys(model)
    converted = [keys[node] for node in reversed(list(model.graph)) if node.name != "Conv_7"]
    near = near_named_nodes(model, keys, "error in Conv_8", converted)
    assert near == [key for key in converted if key in _within(8)]
    assert "key/Conv_7" not in near
    assert near[0] == "key/Conv_12" and near[-1] == "key/Conv_4"


def test_several_named_nodes_unite_their_neighbourhoods() -> None:
    model = _chain(CHAIN)
    keys = _keys(model)
    converted = [keys[node] for node in model.graph]
    near = near_named_nodes(model, keys, "fused Conv_0 ... Conv_15", converted)
    assert set(near) == _within(0) | _within(15)


@pytest.mark.parametrize(
    "error",
    [
        "",
        "LoadModel failed: unsupported type tensor(float16)",
        "Conv_123 failed",  # a longer name: not Conv_12 nor Conv_1
        "xConv_3 failed",  # inside another word
        "model.Conv_3 failed",  # a dotted path
    ],
)
def test_no_node_named_gives_nothing(error: str) -> None:
    model = _chain(CHAIN)
    keys = _keys(model)
    assert near_named_nodes(model, keys, error, [keys[node] for node in model.graph]) == []


def test_names_shorter_than_three_characters_are_ignored() -> None:
    model = _chain(["ab", "Conv_long", "cd"])
    keys = _keys(model)
    converted = [keys[node] for node in model.graph]
    assert near_named_nodes(model, keys, "node ab failed", converted) == []
    assert near_named_nodes(model, keys, "node Conv_long failed", converted) == converted
