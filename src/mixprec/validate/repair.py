"""Find the converted nodes a runtime fails on: the fewest to keep FP32 so that it loads.

`fails(kept)` converts the model with the nodes in `kept` held FP32 and reports whether the
runtime still fails. Failures are taken to be monotone (keeping more nodes FP32 never makes a
model fail that loaded), as they are for kernels that crash or fusions that meet mixed types.
Each culprit is found by bisection on the candidates in topological order: the shortest prefix
that, held FP32 beside the culprits found so far, makes the model load ends in a culprit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Culprits:
    """The outcome of :func:`find_culprits`.

    Attributes:
        names: Nodes to keep FP32 (None: even with every candidate FP32 the runtime fails).
        trials: Conversions tried.
    """

    names: tuple[str, ...] | None
    trials: int


def find_culprits(
    candidates: Sequence[str], fails: Callable[[frozenset[str]], bool], *, max_trials: int = 64
) -> Culprits:
    """The nodes among `candidates` to keep FP32 so that `fails` is False.

    Costs about (log2(len(candidates)) + 1) trials per culprit; past `max_trials` the
    candidates still in question are all kept.
    """
    trials = 0

    def probe(kept: frozenset[str]) -> bool:
        nonlocal trials
        trials += 1
        return fails(kept)

    if probe(frozenset(candidates)):
        return Culprits(None, trials)
    found: list[str] = []
    pool = list(candidates)
    while pool and probe(frozenset(found)):
        if trials >= max_trials:
            found.extend(pool)
            break
        # The shortest prefix of `pool` that makes the model load (the whole pool does).
        low, high = 1, len(pool)
        while low < high:
            middle = (low + high) // 2
            if probe(frozenset(found) | frozenset(pool[:middle])):
                low = middle + 1
            else:
                high = middle
        found.append(pool[low - 1])
        pool = pool[: low - 1]
    return Culprits(tuple(found), trials)
