"""Which groups a prune removes: an allocation (uniform per layer, global ranking, or by measured
sensitivity) met at a target (a ratio of the groups, or a fraction of the parameters, MACs or
latency), and the reference model each choice makes (the input with the groups zeroed, and the
compensation's changed values).

The allocations (see select.choose for the first two, sensitivity for the third) are families of
plans growing with one number t; targets.meet and targets.meet_latency find t.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from onnxshrink.errors import ShrinkError
from onnxshrink.options import ALLOCATIONS, DEFAULT_UNITS
from onnxshrink.prune import compensate as comp_mod
from onnxshrink.prune import sensitivity as sens
from onnxshrink.prune.calibrate import Calibration, Runner, deviation
from onnxshrink.prune.groups import GroupSet
from onnxshrink.prune.select import LayerPlan, _bounded, _ignored, choose
from onnxshrink.prune.spill import Disk
from onnxshrink.prune.targets import (
    Costs,
    LatencyMeter,
    Target,
    bisect,
    meet,
    meet_latency,
    members_of,
)


@dataclass
class Builder:
    """Makes the reference of a plan: the input with the plan's groups zeroed, and with a
    compensation its consumers' biases (and weights) changed."""

    model: onnx.ModelProto
    gset: GroupSet
    compensation: comp_mod.Compensation | None = None
    calibration: Calibration | None = None
    mode: str = "none"
    ridge: float = 1.0
    values: dict[str, np.ndarray] = field(default_factory=dict)  # the last reference's changes

    def reference(self, plans: Sequence[LayerPlan], copy: bool = True) -> onnx.ModelProto:
        from onnxshrink.prune.reference import zeroed

        members = members_of(self.gset, plans)
        if self.compensation is None:
            self.values = {}
            return zeroed(self.model, self.gset, members, copy=copy)
        self.values = comp_mod.changes(self.compensation, members, self.calibration, self.mode, self.ridge)
        return comp_mod.apply(self.compensation, self.values, copy=copy)

    def on_disk(self, plans: Sequence[LayerPlan], disk: Disk) -> onnx.ModelProto:
        """The reference of a plan of a streamed model, its zeroed weights written to `disk`'s
        spill file tensor by tensor (and a compensation's large changed values): never the
        model in memory. `values`: the compensation's changed values alone (and its biases);
        the tensors only zeroed are left out (`framework_values` leaves them out too)."""
        from onnxshrink.prune.reference import zeroed

        members = members_of(self.gset, plans)
        if self.compensation is None:
            self.values = {}
            return zeroed(self.model, self.gset, members, copy=True, disk=disk)
        comp = self.compensation
        self.values = comp_mod.changes(
            comp, members, self.calibration, self.mode, self.ridge, zero_all=False, keep=comp_mod.spilled(disk)
        )
        return comp_mod.apply_on_disk(comp, self.values, self.gset, members, disk)


@dataclass
class Choice:
    plans: list[LayerPlan]
    t: float | None = None  # the allocation's parameter that met the target
    reached: float | None = None  # the target's measure of the plan (fraction of the input's)
    families: list[sens.Family] | None = None
    predicted: float | None = None  # sensitivity: the predicted relative error


def plan(
    gset: GroupSet,
    importance: np.ndarray,
    target: Target,
    *,
    allocation: str = "uniform",
    ignore: Sequence[str] = (),
    round_to: int | None = None,
    max_layer_ratio: float = 1.0,
    builder: Builder,
    costs: Callable[[], Costs],
    count: Callable[[list[LayerPlan]], tuple[int, int]],
    shrunk: Callable[[onnx.ModelProto], onnx.ModelProto],
    meter: Callable[[], LatencyMeter],
    families: list[sens.Family] | None = None,
    units: Sequence[str] = DEFAULT_UNITS,
    say: Callable[[str], None] = lambda m: None,
) -> Choice:
    """The plans meeting `target` by `allocation`. `count(plans)` is the exact (params, macs)
    of the plans' reference once shrunk, `shrunk(reference)` the shrunk model (for latency), `meter()`
    the latency meter; `families`: the measured sensitivity (allocation "sensitivity")."""
    if allocation not in ALLOCATIONS:
        raise ShrinkError(f"--allocation {allocation}: choose one of {', '.join(ALLOCATIONS)}.")
    choose(gset, importance, 0.0, round_to=round_to, max_layer_ratio=max_layer_ratio)  # checks them
    if allocation == "sensitivity":
        assert families is not None
        plan_at, cost_kind = _by_sensitivity(gset, families, target, round_to, max_layer_ratio, ignore, costs)
    else:

        def plan_at(t: float) -> list[LayerPlan]:
            return choose(
                gset,
                importance,
                t,
                global_ranking=allocation == "global",
                ignore=ignore,
                round_to=round_to,
                max_layer_ratio=max_layer_ratio,
                units=units,
            )

    if target.kind == "ratio":
        return Choice(plan_at(target.value), target.value, families=families)
    return _meet(gset, plan_at, target, builder, costs(), count, shrunk, meter, say, families)


def _meet(
    gset: GroupSet,
    plan_at: Callable[[float], list[LayerPlan]],
    target: Target,
    builder: Builder,
    c: Costs,
    count: Callable[[list[LayerPlan]], tuple[int, int]],
    shrunk: Callable[[onnx.ModelProto], onnx.ModelProto],
    meter: Callable[[], LatencyMeter],
    say: Callable[[str], None],
    families: list[sens.Family] | None,
) -> Choice:
    """The plan of the family `plan_at` that meets a measured target (params, MACs: estimated,
    then counted exactly on the shrunk reference; latency: timed)."""

    def estimate(kind: str) -> Callable[[list[LayerPlan]], float]:
        return lambda plans: c.fraction(kind, members_of(gset, plans))

    if target.kind in ("params", "macs"):
        index = 0 if target.kind == "params" else 1
        total = c.params if index == 0 else c.macs

        def exact(plans: list[LayerPlan]) -> float:
            return count(plans)[index] / max(total, 1)

        plans, reached = meet(plan_at, estimate(target.kind), exact, target.value, 0.005, say, target.kind)
        return Choice(plans, None, reached, families)
    start = bisect(lambda v: estimate("macs")(plan_at(v)), target.value)
    m = meter()
    plans, ratio, t = meet_latency(
        plan_at, start, lambda p: shrunk(builder.reference(p)), m, target.value, say
    )
    return Choice(plans, t, ratio, families)


def families_of(
    gset: GroupSet, importance: np.ndarray, ignore: Sequence[str], units: Sequence[str] = DEFAULT_UNITS
) -> list[sens.Family]:
    """One family per layer of `units` with exact groups (not ignored), its groups least
    important first."""
    out = []
    for layer in gset.layers:
        ids = [i for i in layer.groups if gset.groups[i].exact]
        if not ids or layer.kind not in units or _ignored(gset, layer, ignore):
            continue
        order = sorted(ids, key=lambda i: (importance[i], i))
        out.append(sens.Family(layer.id, layer.name, layer.kind, order))
    return out


def measure_families(
    families: list[sens.Family],
    builder: Builder,
    calibration: Calibration,
    *,
    round_to: int | None,
    max_layer_ratio: float,
    ratios: Sequence[float] = sens.RATIOS,
    say: Callable[[str], None] = lambda m: None,
    progress: bool = False,
) -> list[sens.Family]:
    """Each family pruned alone at each ratio, on the calibration inputs, in one session
    (`progress`: a bar counting the runs, on a terminal)."""
    comp = builder.compensation
    assert comp is not None
    runner = Runner(comp_mod.with_all_biases(comp), comp.variable(), calibration.feeds)
    base = runner.run({})
    gset = builder.gset

    def evaluate(ids: list[int]) -> float:
        members = gset.zeroed_members(gset.groups[i] for i in ids)
        values = comp_mod.changes(comp, members, calibration, builder.mode, builder.ridge)
        return deviation(base, runner.run(values))

    plans = {f.layer: _plan_for(gset, f) for f in families}
    return sens.measure(
        families,
        evaluate,
        ratios,
        lambda f, k: _bounded(gset, plans[f.layer], k, round_to, max_layer_ratio),
        say,
        progress,
    )


def _plan_for(gset: GroupSet, fam: sens.Family) -> LayerPlan:
    return LayerPlan(gset.layers[fam.layer], len(fam.order))


def _by_sensitivity(
    gset: GroupSet,
    families: list[sens.Family],
    target: Target,
    round_to: int | None,
    max_layer_ratio: float,
    ignore: Sequence[str],
    costs: Callable[[], Costs],
):
    """plan_at(t) for the sensitivity allocation: t of the whole cost (units for a ratio,
    parameters, or MACs for MACs and latency) spent where the curves say it costs least."""
    kind = {"ratio": "units", "params": "params"}.get(target.kind, "macs")
    cache: dict[tuple[int, int], float] = {}
    c = costs() if kind == "macs" else None

    def exact_cost(fam: sens.Family, k: int) -> float:
        key = (fam.layer, k)
        if key not in cache:
            if kind == "units":
                cache[key] = float(k)
            elif kind == "params":
                cache[key] = float(sum(gset.groups[i].params for i in fam.order[:k]))
            else:
                assert c is not None
                cache[key] = c.removed([m for i in fam.order[:k] for m in gset.groups[i].members])[1]
        return cache[key]

    def cost(fam: sens.Family, k: int) -> float:
        """Exact at the measured counts and the whole family; linear between them."""
        marks = [0, *fam.counts, len(fam.order)]
        if k in marks:
            return exact_cost(fam, k)
        j = next(j for j in range(1, len(marks)) if k < marks[j])
        a, b = marks[j - 1], marks[j]
        ca, cb = exact_cost(fam, a), exact_cost(fam, b)
        return ca + (cb - ca) * (k - a) / (b - a)

    total = sum(cost(f, len(f.order)) for f in families)
    plans_base = {f.layer: _plan_for(gset, f) for f in families}

    def plan_at(t: float) -> list[LayerPlan]:
        budget = (target.value if target.kind == "ratio" else t) * total
        chosen = sens.allocate(families, cost, budget)
        out = []
        for layer in gset.layers:
            ids = [i for i in layer.groups if gset.groups[i].exact]
            p = LayerPlan(layer, len(ids), ignored=_ignored(gset, layer, ignore))
            fam = next((f for f in families if f.layer == layer.id), None)
            if fam is not None:
                k = _bounded(gset, plans_base[layer.id], chosen.get(layer.id, 0), round_to, max_layer_ratio)
                p.removed = fam.order[:k]
            out.append(p)
        return out

    return plan_at, kind
