"""The order of nodes within the layers of the built-in layout (:mod:`mixprec.report.layout`):
longest-path layers, then barycentre sweeps over the layers (long edges split by placeholder
nodes) that keep the order with the fewest edge crossings."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mixprec.report.layout import FoldedGraph

__all__ = ["count_crossings", "longest_path_layers", "order_layers"]

# Barycentre sweeps of the built-in ordering, and the most placeholder nodes it adds on long
# edges (more would cost seconds on the largest graphs; long edges beyond it are left out of the
# ordering).
_SWEEPS = 8
_MAX_PLACEHOLDERS = 12000


def longest_path_layers(folded: FoldedGraph) -> dict[int, int]:
    """Layer of every drawn node: 0 without drawn producers, else one below its lowest one."""
    layer: dict[int, int] = {}
    for i in folded.nodes:
        layer[i] = 1 + max((layer[p] for p in folded.preds[i]), default=-1)
    return layer


def order_layers(layers: list[list[int]], edges: list[tuple[int, int]]) -> list[list[int]]:
    """Reorder each layer to reduce edge crossings: alternating downward and upward barycentre
    sweeps over the layers with placeholders on long edges; the order with the fewest crossings
    wins. `edges` go from a lower layer to a higher one."""
    order = [list(nodes) for nodes in layers]
    steps = _one_layer_steps(order, edges)
    up: dict[int, list[int]] = {}
    down: dict[int, list[int]] = {}
    for u, v in steps:
        down.setdefault(u, []).append(v)
        up.setdefault(v, []).append(u)

    best = [list(nodes) for nodes in order]
    best_crossings = count_crossings(order, steps)
    for sweep in range(_SWEEPS):
        if best_crossings == 0:
            break
        downward = sweep % 2 == 0
        _barycentre_sweep(order, up if downward else down, downward)
        crossings = count_crossings(order, steps)
        if crossings < best_crossings:
            best, best_crossings = [list(nodes) for nodes in order], crossings
    return [[v for v in nodes if v >= 0] for nodes in best]


def _one_layer_steps(order: list[list[int]], edges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The edges as one-layer steps: placeholders (negative ids, appended to the layers of
    `order`) split long edges, shortest edges first, while :data:`_MAX_PLACEHOLDERS` allows."""
    layer_of = {v: k for k, nodes in enumerate(order) for v in nodes}
    steps: list[tuple[int, int]] = []
    budget = _MAX_PLACEHOLDERS
    next_id = -1
    for u, v in sorted(edges, key=lambda e: layer_of[e[1]] - layer_of[e[0]]):
        span = layer_of[v] - layer_of[u]
        if span == 1:
            steps.append((u, v))
            continue
        if span - 1 > budget:
            continue
        budget -= span - 1
        previous = u
        for k in range(layer_of[u] + 1, layer_of[v]):
            order[k].append(next_id)
            steps.append((previous, next_id))
            previous, next_id = next_id, next_id - 1
        steps.append((previous, v))
    return steps


def _barycentre_sweep(order: list[list[int]], neighbours: dict[int, list[int]], downward: bool) -> None:
    """Sort each layer of `order` in place by the mean position of its nodes' `neighbours` in
    the layer before it (`downward`) or after it."""
    indices = range(1, len(order)) if downward else range(len(order) - 2, -1, -1)
    for k in indices:
        fixed = order[k - 1] if downward else order[k + 1]
        position = {v: p for p, v in enumerate(fixed)}
        stretch = len(fixed) / max(len(order[k]), 1)
        keys: dict[int, tuple[float, int]] = {}
        for here, v in enumerate(order[k]):
            linked = [position[w] for w in neighbours.get(v, ()) if w in position]
            # Without a neighbour on that side a node keeps its relative place.
            centre = sum(linked) / len(linked) if linked else here * stretch
            keys[v] = (centre, here)
        order[k].sort(key=keys.__getitem__)


def count_crossings(order: list[list[int]], edges: list[tuple[int, int]]) -> int:
    """Crossings between the edges of adjacent layers (edges spanning more layers are skipped),
    counted as inversions with a Fenwick tree."""
    position = {v: p for nodes in order for p, v in enumerate(nodes)}
    layer_of = {v: k for k, nodes in enumerate(order) for v in nodes}
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for u, v in edges:
        if u in layer_of and v in layer_of and layer_of[v] == layer_of[u] + 1:
            by_layer.setdefault(layer_of[u], []).append((position[u], position[v]))
    total = 0
    for k, pairs in by_layer.items():
        size = len(order[k + 1])
        tree = [0] * (size + 1)
        pairs.sort()
        for seen, (_, target) in enumerate(pairs):
            at_most = 0
            j = target + 1
            while j > 0:
                at_most += tree[j]
                j -= j & -j
            total += seen - at_most
            j = target + 1
            while j <= size:
                tree[j] += 1
                j += j & -j
    return total
