"""What the runtime computes once, when it loads the model: the nodes whose inputs are all
constants. onnxruntime folds them with its CPU provider's kernels whatever provider runs the rest
(`policy/tables/constant_folding.toml`); where those kernels have no 16-bit one for a node, it
folds only in FP32, and the planner's `folded_at_load` rule keeps it so.

:class:`LoadFolding` follows the planner's forward pass: which nodes the rule may keep FP32 (their
inputs are constants that fit the 16-bit type, or computed from such alone) and, once every node
is decided, which nodes and values the runtime folds in the precision they were decided in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import onnx_ir as ir

from mixprec.analysis.constants import ConstantRange, is_constant
from mixprec.dtypes import LowPrecision
from mixprec.plan.model import Decision, Precision
from mixprec.policy.opfacts import Carrier, op_facts
from mixprec.policy.profiles import ConstantFolding

__all__ = ["LoadFolding"]


def _type_fits(dtype: ir.DataType | None, largest: float) -> bool:
    """Whether every value of an integer or bool element type is at most `largest` in magnitude."""
    if dtype == ir.DataType.BOOL:
        return True
    if dtype is None or not dtype.is_integer():
        return False
    return 2 ** (dtype.bitwidth - (1 if dtype.is_signed() else 0)) <= largest


def _computed_type(node: ir.Node, precision: Precision, low: str) -> str:
    """The element type a node computes in, as kernel tables write it: the 16-bit type when
    lowered, FP32 when kept, else its first input's own (a float16 or integer node)."""
    if precision is Precision.LOW:
        return low
    if precision is Precision.FP32:
        return "tensor(float)"
    dtype = next((v.dtype for v in node.inputs if v is not None), None)
    return f"tensor({dtype.name.lower()})" if dtype is not None else "tensor(unknown)"


class LoadFolding:
    """The nodes a runtime folds when it loads the model, for one planner run.

    Attributes:
        folding: How the runtime folds (its kernels, domains, the ops it leaves alone).
        inputs: The values `folded_at_load` may build on: every constant (whether an FP32 one
            fits is read where it matters), and what nodes compute from fitting ones alone.
    """

    def __init__(
        self,
        folding: ConstantFolding,
        target: LowPrecision,
        constants: Iterable[ir.Value],
        fp32: frozenset[ir.Value],
        owners: set[ir.Node],
        constant_range: Callable[[ir.Value], ConstantRange | None],
        opset: Callable[[ir.Node], int | None],
    ) -> None:
        self.folding = folding
        self._target = target
        self._constants = list(constants)
        self._fp32 = fp32
        self._owners = owners
        self._constant_range = constant_range
        self._opset = opset
        self.inputs: set[ir.Value] = set(self._constants)
        self._ops: dict[tuple[str, str], tuple[bool, bool, bool]] = {}

    def _op(self, node: ir.Node) -> tuple[bool, bool, bool]:
        """(the runtime folds the op and it is deterministic, it moves or converts values, it
        converts to the type of an attribute), per op."""
        key = (node.domain, node.op_type)
        found = self._ops.get(key)
        if found is None:
            fact = op_facts(*key)
            folds = self.folding.folds(*key) and not fact.random
            moves = fact.value_preserving or fact.carrier is Carrier.MOVEMENT
            found = self._ops[key] = (folds, moves, fact.dtype_attribute is not None)
        return found

    def _folds(self, node: ir.Node) -> bool:
        """Whether the runtime folds the node's op, deterministic and without subgraphs (its
        inputs aside)."""
        return self._op(node)[0] and node not in self._owners

    def _fits(self, constant: ir.Value) -> bool:
        """Whether a constant's values fit the 16-bit type (an FP32 one neither overflows nor
        flushes where that matters; others are not converted)."""
        if constant not in self._fp32:
            return True
        rng = self._constant_range(constant)
        return rng is not None and not rng.overflow and not rng.significant_flush

    def _constants_fit(self, node: ir.Node) -> bool:
        """Whether the node's FP32 constant inputs fit the 16-bit type (read only for nodes of
        constants alone)."""
        fp32 = self._fp32
        return all(
            value is None or value not in fp32 or not is_constant(value) or self._fits(value) for value in node.inputs
        )

    def _reads_inputs_only(self, node: ir.Node) -> bool:
        """Whether every input of the node is one of `inputs` (most nodes read an activation:
        one lookup)."""
        inputs = self.inputs
        for value in node.inputs:
            if value is not None and value not in inputs:
                return False
        return True

    def folds_at_load(self, node: ir.Node) -> bool:
        """Whether the runtime computes the node once, when it loads the model, from values that
        fit the 16-bit type: its inputs are constants that fit or computed from such alone, and
        the runtime folds its op."""
        return self._reads_inputs_only(node) and self._folds(node) and self._constants_fit(node)

    def note(self, node: ir.Node, kept_to_fold: bool) -> None:
        """After the planner decided `node` (`kept_to_fold`: by `folded_at_load`): record the
        values the rule may build on, a folded node's outputs, a Constant node's, and those of an
        op that moves or converts values (Reshape, Cast from an int8 weight, ...) computed from
        fitting constants alone (from integers whose type's range fits the 16-bit type, for a
        conversion)."""
        if not kept_to_fold:
            if not node.inputs:  # a Constant node (or a generator)
                if self._folds(node):
                    self.inputs.update(out for out in node.outputs if is_constant(out))
                return
            if not self._reads_inputs_only(node):
                return
            folds, moves, converts = self._op(node)
            if not folds or not moves or node in self._owners or not self._constants_fit(node):
                return
            largest = self._target.limits.max
            if converts and not all(v is None or v in self._fp32 or _type_fits(v.dtype, largest) for v in node.inputs):
                return
        self.inputs.update(node.outputs)

    def folded(
        self, order: Iterable[ir.Node], decisions: Mapping[ir.Node, Decision]
    ) -> tuple[frozenset[ir.Value], frozenset[ir.Node]]:
        """The values the runtime folds when it loads the model (constants, and the outputs of
        the nodes it folds in the precision they were decided in) and those nodes, in `order`
        (topological: a node's inputs are settled before it)."""
        folding, low = self.folding, self._target.type_str
        values: set[ir.Value] = set(self._constants)
        nodes: set[ir.Node] = set()
        for node in order:
            inputs = node.inputs
            for value in inputs:  # most nodes read an activation: one lookup
                if value is not None and value not in values:
                    break
            else:
                if node not in decisions or not self._folds(node):
                    continue
                if inputs and not folding.folds_in(
                    node.domain, node.op_type, self._opset(node), _computed_type(node, decisions[node].precision, low)
                ):
                    continue  # a Constant node needs no kernel: it is a constant already
                nodes.add(node)
                values.update(node.outputs)
        return frozenset(values), frozenset(nodes)
