"""What a precision plan is made of: per-node decisions with a category and a reason, the
value states of the planner's lattice, the plan itself, and the matcher of excluded node names
(the rules that decide nodes are in :mod:`mixprec.plan.rules`, the planner that applies them in
:mod:`mixprec.plan.planner`)."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import onnx_ir as ir

from mixprec.dtypes import LowPrecision
from mixprec.errors import InputError
from mixprec.policy.schemas import Signature
from mixprec.policy.table import OpRule


class Precision(str, enum.Enum):
    """Where a node computes."""

    LOW = "low"  # in the 16-bit type
    FP32 = "fp32"  # at its original FP32 types
    NONE = "none"  # it has no FP32 float computation (integer, bool, ... or already 16-bit)


class Category(str, enum.Enum):
    """Why a node got its precision (the report groups by this)."""

    POLICY = "policy"
    FOLLOW = "follows inputs"
    CONSUMERS = "decided by consumers"
    EXCLUDED = "excluded by user"
    CONDITION = "condition"
    CONSTANT_RANGE = "out-of-range constant"
    SCHEMA = "schema has no 16-bit type"
    RUNTIME = "runtime has no 16-bit kernel"
    RUNTIME_FAILURE = "runtime fails on it"
    NORM_BLOCK = "normalization block"
    WEIGHTS_ONLY = "weights only"
    UNKNOWN_OP = "unknown op"
    UNKNOWN_TYPE = "type unknown"
    CONTROL_FLOW = "control flow"
    FUNCTION = "function call"
    DATA_RANGE = "range measured on data"
    INTEGER = "integer semantics"
    QDQ = "quantized pair"
    CAST_COST = "placed by cast cost"
    NO_FLOAT = "no FP32 compute"
    INTEGER_KERNEL = "integer kernel"
    FOLDED = "folded when loaded"
    PLAN = "set by plan"


@dataclass(frozen=True)
class Decision:
    """The precision of one node and the reason for it."""

    precision: Precision
    category: Category
    reason: str

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form."""
        return {
            "precision": self.precision.value,
            "category": self.category.value,
            "reason": self.reason,
        }


class State(enum.Enum):
    """Lattice state of an FP32 value during planning."""

    LOW = "low"
    HIGH = "high"
    WIDE = "wide"
    TINY = "tiny"
    FLEX = "flex"


class Storage(enum.Enum):
    """How an FP32 constant is stored after conversion."""

    FP32 = "fp32"
    LOW = "low"
    BOTH = "both"  # kept FP32, with a 16-bit copy for the consumers that compute in 16 bits


@dataclass(frozen=True)
class NodeFacts:
    """What the planner knows about one node before deciding it.

    Attributes:
        rule: The policy rule (None for ops the policy does not know).
        sig: The schema binding of the node's inputs and outputs (None without a schema).
        float_vars: Type variables bound to FP32 values.
        lowerable: Type variables the node would compute in the 16-bit type.
        pinned_evidence: Why inputs that must not be narrowed pinned their type variables.
        flexible: Input indices the node takes as they are (Shape's input, ...).
        runtime_blocked: Type variables the runtime has no 16-bit kernel for.
        runtime_reason: Why, naming the kernel and provider.
    """

    rule: OpRule | None
    sig: Signature | None
    float_vars: frozenset[str] = frozenset()
    lowerable: frozenset[str] = frozenset()
    pinned_evidence: tuple[str, ...] = ()
    flexible: frozenset[int] = frozenset()
    runtime_blocked: frozenset[str] = frozenset()
    runtime_reason: str | None = None


@dataclass(frozen=True)
class PrecisionPlan:
    """Per-node precision decisions and what they imply for values and constants (built once by
    the planner; a different plan is a new object, see `dataclasses.replace`).

    Attributes:
        target: The 16-bit type.
        keep_io_types: Whether the model's inputs and outputs keep FP32.
        decisions: Node -> decision.
        lowered_vars: For LOW nodes, the schema type variables that become 16-bit.
        facts: Node -> facts used for the decision (schema binding, flexible inputs).
        storage: FP32 constants (initializers and Constant outputs) -> how they are stored.
        constant_notes: Constants kept FP32 or saturated because of their values -> evidence.
        saturated: Constants whose out-of-range values saturate to the 16-bit maximum.
        order: All nodes, subgraph nodes before their owner, in topological order.
        graphs: The main graph, function bodies and subgraphs.
        keys: Node -> stable key (`mixprec.graphs.node_keys`): the name plan files, reports
            and the accuracy search use for it.
        fp32: The FP32 tensor values the graphs and nodes read and write, as the planner read
            their types (None: not recorded; read again where needed).
        folded: The values the runtime computes once, when it loads the model: constants, and
            the outputs of nodes computed from them alone (empty where the runtime does not say).
        folded_nodes: Those nodes: they cost nothing per inference, in the FP32 model as in
            this one.
    """

    target: LowPrecision
    keep_io_types: bool
    decisions: dict[ir.Node, Decision]
    lowered_vars: dict[ir.Node, frozenset[str]]
    facts: dict[ir.Node, NodeFacts]
    storage: dict[ir.Value, Storage]
    constant_notes: dict[ir.Value, str]
    saturated: set[ir.Value]
    order: list[ir.Node]
    graphs: list[ir.Graph]
    keys: dict[ir.Node, str] = field(default_factory=dict)
    fp32: frozenset[ir.Value] | None = None
    folded: frozenset[ir.Value] = frozenset()
    folded_nodes: frozenset[ir.Node] = frozenset()

    def input_is_lowered(self, node: ir.Node, index: int) -> bool:
        """Whether input `index` of `node` is computed in the 16-bit type."""
        if self.decisions[node].precision is not Precision.LOW:
            return False
        facts = self.facts[node]
        if facts.sig is None or index >= len(facts.sig.input_vars):
            return False
        var = facts.sig.input_vars[index]
        return var is not None and var in self.lowered_vars[node]

    def output_is_lowered(self, node: ir.Node, index: int) -> bool:
        """Whether output `index` of `node` is produced in the 16-bit type."""
        if self.decisions[node].precision is not Precision.LOW:
            return False
        facts = self.facts[node]
        if facts.rule is not None and facts.rule.dtype_attribute is not None:
            return index == 0
        if facts.sig is None or index >= len(facts.sig.output_vars):
            return False
        var = facts.sig.output_vars[index]
        return var is not None and var in self.lowered_vars[node]

    def count(self, precision: Precision) -> int:
        """Number of nodes with this precision."""
        return sum(1 for d in self.decisions.values() if d.precision is precision)


class NodeMatcher:
    """Matches node names: a pattern equal to a node's name matches that node only; any other
    pattern is a regular expression matched with `re.search`."""

    def __init__(self, patterns: Iterable[str] = ()) -> None:
        self.patterns = list(patterns)
        self.used: set[str] = set()
        self._exact: set[str] = set()
        self._compiled: list[tuple[str, re.Pattern[str]]] = []

    def prepare(self, names: set[str]) -> None:
        """Split the patterns into exact names (present in `names`) and regular expressions."""
        self._exact = {p for p in self.patterns if p in names}
        self._compiled = []
        for pattern in self.patterns:
            if pattern in self._exact:
                continue
            try:
                self._compiled.append((pattern, re.compile(pattern)))
            except re.error as e:
                raise InputError(
                    f"node name pattern {pattern!r} is no node's name and not a valid regular "
                    f"expression: {e}"
                ) from e

    def match(self, name: str | None) -> str | None:
        """The pattern that matches `name`, or None."""
        if not name:
            return None
        if name in self._exact:
            self.used.add(name)
            return name
        for pattern, compiled in self._compiled:
            if compiled.search(name):
                self.used.add(pattern)
                return pattern
        return None

    def unused(self) -> list[str]:
        """Patterns that matched no node so far."""
        return [p for p in self.patterns if p not in self.used]
