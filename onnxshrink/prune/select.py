"""Which groups to remove at a pruning ratio, the way Torch-Pruning's pruners choose.

Per layer (the default, Torch-Pruning's local pruning): a layer of n exact groups loses the
n - int(n * (1 - ratio)) least important. Global (`global_ranking`): every group's importance
is divided by its layer's mean (Torch-Pruning's "mean" normalizer) and the least important
int(ratio * total) ... of all layers go, up to each layer's maximum. Either way a layer keeps at
least one group and loses at most `max_layer_ratio` of its groups; `round_to` keeps channel
counts multiples of it (rounded down, as Torch-Pruning does); `ignore` leaves alone the
layers whose producing weights, framework parameters, nodes or op types match a pattern, and
`units` the layers of other unit kinds (blocks only when asked for).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from onnxshrink.errors import ShrinkError
from onnxshrink.options import DEFAULT_UNITS
from onnxshrink.prune.groups import GroupSet, Layer


@dataclass
class LayerPlan:
    layer: Layer
    total: int  # exact groups
    removed: list[int] = field(default_factory=list)  # group ids
    ignored: bool = False


def choose(
    gset: GroupSet,
    importance: np.ndarray,
    ratio: float,
    *,
    global_ranking: bool = False,
    ignore: Sequence[str] = (),
    round_to: int | None = None,
    max_layer_ratio: float = 1.0,
    units: Sequence[str] = DEFAULT_UNITS,
) -> list[LayerPlan]:
    if not 0.0 <= ratio < 1.0:
        raise ShrinkError(f"--prune {ratio}: give a ratio in [0, 1), e.g. 0.5 for half the channels.")
    if not 0.0 < max_layer_ratio <= 1.0:
        raise ShrinkError(f"--max-layer-ratio {max_layer_ratio}: give a ratio in (0, 1].")
    if round_to is not None and round_to < 1:
        raise ShrinkError(f"--round-to {round_to}: give a positive multiple.")
    plans = []
    for layer in gset.layers:
        ids = [i for i in layer.groups if gset.groups[i].exact]
        ignored = layer.kind not in units or _ignored(gset, layer, ignore)
        plans.append(LayerPlan(layer, len(ids), ignored=ignored))
    ranked = [
        (p, sorted((i for i in p.layer.groups if gset.groups[i].exact), key=lambda i: (importance[i], i)))
        for p in plans
        if p.total > 0 and not p.ignored
    ]
    if global_ranking:
        _global(gset, importance, ratio, ranked, round_to, max_layer_ratio)
    else:
        for plan, order in ranked:
            n = len(order)
            k = n - int(n * (1 - ratio))
            plan.removed = order[: _bounded(gset, plan, k, round_to, max_layer_ratio)]
    return plans


def _bounded(gset: GroupSet, plan: LayerPlan, k: int, round_to: int | None, max_ratio: float) -> int:
    """k groups to remove, within the layer's maximum, at least one kept, channels rounded."""
    n = plan.total
    k = min(k, int(n * max_ratio), n - 1)
    if round_to and k > 0:
        per = gset.groups[plan.layer.groups[0]].unit.channels
        kept = (n - k) * per
        kept -= kept % round_to
        k = n - -(-kept // per)  # whole groups: kept channels rounded down, then to whole groups
        k = min(max(k, 0), int(n * max_ratio), n - 1)
    return max(k, 0)


def _global(gset, importance, ratio, ranked, round_to, max_ratio) -> None:
    normalized = []
    for plan, order in ranked:
        imp = importance[order]
        mean = float(np.mean(imp)) if len(imp) else 1.0
        normalized += [(v / mean if mean else v, plan, i) for v, i in zip(imp, order, strict=True)]
    total = len(normalized)
    target = total - int(total * (1 - ratio))
    if target <= 0:
        return
    normalized.sort(key=lambda t: (t[0], t[2]))
    threshold = normalized[target - 1][0]
    for plan, order in ranked:
        imp = importance[order]
        mean = float(np.mean(imp))  # the layer's mean once (it was taken again per group)
        below = int(np.count_nonzero((imp / mean if mean else imp) <= threshold))
        plan.removed = order[: _bounded(gset, plan, below, round_to, max_ratio)]


def _ignored(gset: GroupSet, layer: Layer, patterns: Sequence[str]) -> bool:
    if not patterns:
        return False
    names: set[str] = set()
    for m in gset.groups[layer.groups[0]].members:
        if m.side == "out":  # the layers producing these channels (Torch-Pruning's roots)
            names |= {m.initializer, m.node, m.op, *(p.name for p in m.params)}
    return any(fnmatch.fnmatchcase(n, pat) for n in names for pat in patterns)
