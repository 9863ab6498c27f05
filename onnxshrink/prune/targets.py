"""Targets users think in: a fraction of the parameters, of the MACs, or of the latency.

Every allocation is a family of plans growing with one number t in [0, 1) (the ratio of each
layer, the global ratio, the share of the cost budget); a target is met by finding t:

- parameters and MACs: the cost of a plan is estimated from the groups (a weight's parameters
  and its node's MACs scale with the kept fraction of each of its sliced axes), t is found on the
  estimate, and the plan is shrunk (the analysis and rewrite, without the proof) to count it
  exactly; the estimate is corrected by the miss and searched again, until the count is within
  the tolerance. The estimate misses what weights do not measure (attention's activation
  products, ops a removal leaves behind), the correction takes it in.
- latency: measured, never predicted: onnxruntime (all its graph optimizations, as deployed)
  runs the shrunk model and the input in turns (the ratio of their fastest rounds, robust to a
  busy machine), and t is bisected on that ratio, starting where the MACs alone would put it.
  Runtimes speed up channel counts unevenly (onnxruntime's blocked NCHWc convolutions want
  multiples of 8 or 16 channels, which `round_to` keeps), which is why it is measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from onnxshrink.errors import ShrinkError
from onnxshrink.prune.groups import GroupSet, Member, gather_slices, sliced_elements
from onnxshrink.prune.select import LayerPlan

KINDS = ("ratio", "params", "macs", "latency")


@dataclass(frozen=True)
class Target:
    """What to prune to: `kind` ratio (of each layer's groups, or of all groups), or the fraction
    of the input's params, macs or measured latency to keep."""

    kind: str
    value: float

    def flag(self) -> str:
        return "--prune" if self.kind == "ratio" else f"--prune-to-{self.kind}"

    def check(self) -> None:
        if self.kind not in KINDS:
            raise ShrinkError(f"target {self.kind!r}: choose one of {', '.join(KINDS)}.")
        if self.kind == "ratio":
            if not 0.0 <= self.value < 1.0:
                raise ShrinkError(f"--prune {self.value}: give a ratio in [0, 1), e.g. 0.5 for half the channels.")
        elif not (math.isfinite(self.value) and 0.0 < self.value < 1.0):
            raise ShrinkError(
                f"{self.flag()} {self.value}: give the fraction of the input's {self.kind} to keep, "
                "in (0, 1), e.g. 0.5."
            )


class Costs:
    """Parameters and MACs a removal takes out, estimated from the groups alone."""

    def __init__(
        self,
        gset: GroupSet,
        model: onnx.ModelProto,
        shapes: Mapping[str, list[int]],
        macs: tuple[int, dict[str, int]] | None = None,
    ):
        """`macs`: macs_of(model, shapes), when counted already."""
        from onnxshrink.report import count_params, macs_of

        self.gset = gset
        self.shapes = {name: tuple(int(d) for d in a.shape) for name, a in gset.arrays.items()}
        self.params = count_params(model)
        self.macs, per_node = macs if macs is not None else macs_of(model, dict(shapes))  # one shape inference for both
        # the MACs each weight matrix (a member read as a matrix) costs its node: a node reading
        # several (a recurrent op's W and R) spends its MACs on them in proportion to their
        # elements (every step multiplies each once), else each would be charged the whole
        # node's and a plan could remove more than all the MACs (lac's GRUs: 101%)
        matrices: dict[str, set[str]] = {}
        for g in gset.groups:
            for m in g.members:
                if m.matrix and m.side:
                    matrices.setdefault(m.site[0], set()).add(m.tensor)
        self.weight_macs: dict[str, float] = {}
        for node, tensors in matrices.items():
            sizes = {t: math.prod(self.shapes[t]) for t in tensors}
            for t, size in sizes.items():
                self.weight_macs[t] = per_node.get(node, 0) * size / max(sum(sizes.values()), 1)

    def removed(self, members: Sequence[Member]) -> tuple[int, float]:
        """(parameters, MACs) the members' slices take out, estimated."""
        cut = gather_slices((m.tensor, m.axis, m.indices) for m in members)
        left: dict[str, list[int]] = {}
        for (tensor, axis), idx in cut.items():
            dims = left.setdefault(tensor, list(self.shapes[tensor]))
            dims[axis] -= len(idx)
        # a weight several nodes read is one weight, whatever copies the analysis gave them
        # (groups take a slice from all of them: groups.tie_copies)
        weight = {t: self.gset.untied.get(t, t) for t in left}
        per_weight = gather_slices((weight[t], axis, idx) for (t, axis), idx in cut.items())
        shapes = {weight[t]: self.shapes[t] for t in left}
        params = sliced_elements({k: len(v) for k, v in per_weight.items()}, shapes)
        macs = 0.0
        for t, dims in left.items():
            if t in self.weight_macs:
                kept = math.prod(d / n for d, n in zip(dims, self.shapes[t], strict=True))
                macs += self.weight_macs[t] * (1.0 - kept)
        return params, macs

    def fraction(self, kind: str, members: Sequence[Member]) -> float:
        """The estimated fraction of the input's params or macs left after removing `members`."""
        params, macs = self.removed(members)
        if kind == "params":
            return 1.0 - params / max(self.params, 1)
        return 1.0 - macs / max(self.macs, 1)


@dataclass(frozen=True)
class RatioMeaning:
    """What `--prune R` removes, before any work: `params` and `macs` the fractions of the
    input's that R of every layer's groups (uniform) take out; `counted`: measured on that plan
    shrunk (the analysis and rewrite, without the proof: the weights the shrink stores anew, a
    shared weight's copy per reader or a folded constant, counted), else estimated from the
    groups. Every allocation removes that fraction of the parameters: `target` is what the
    others meet."""

    ratio: float
    params: float
    macs: float
    counted: bool = False

    def target(self, allocation: str) -> Target | None:
        """The parameter target an allocation other than uniform meets (None: R as it is)."""
        if allocation == "uniform" or self.params <= 0.0:
            return None
        return Target("params", 1.0 - self.params)

    def text(self, allocation: str) -> str:
        same = (
            ""
            if allocation == "uniform"
            else f"; --allocation {allocation} removes the same fraction of the parameters"
        )
        how = (
            "counted on that plan shrunk, before the proof"
            if self.counted
            else "estimated from the groups; weights the shrink stores anew not counted"
        )
        return (
            f"--prune {self.ratio:g} means {self.ratio:.0%} of each layer's groups: "
            f"{'' if self.counted else 'about '}{self.params:.1%} of the parameters and {self.macs:.1%} of "
            f"the MACs ({how}; layers in a row compound){same}; --prune-to-params F keeps the fraction F "
            "of the parameters"
        )


def ratio_meaning(gset: GroupSet, ratio: float, costs: Costs, plans: Sequence[LayerPlan]) -> RatioMeaning:
    """The fractions `plans` (R of every layer's groups) remove, by the groups' costs."""
    params, macs = costs.removed(members_of(gset, plans))
    return RatioMeaning(ratio, params / max(costs.params, 1), macs / max(costs.macs, 1))


def members_of(gset: GroupSet, plans: Sequence[LayerPlan]) -> list[Member]:
    return gset.zeroed_members(gset.groups[i] for p in plans for i in p.removed)


def bisect(f: Callable[[float], float], goal: float, hi: float = 0.999, steps: int = 30) -> float:
    """The smallest t in [0, hi] with f(t) <= goal, f non-increasing (hi when none is)."""
    lo = 0.0
    if f(hi) > goal:
        return hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        if f(mid) <= goal:
            hi = mid
        else:
            lo = mid
    return hi


def meet(
    plan_at: Callable[[float], list[LayerPlan]],
    estimate: Callable[[list[LayerPlan]], float],
    exact: Callable[[list[LayerPlan]], float],
    goal: float,
    tolerance: float,
    say: Callable[[str], None],
    what: str,
    rounds: int = 5,
) -> tuple[list[LayerPlan], float]:
    """The plan whose exact count (a fraction of the input's) is nearest `goal`: t found on the
    estimate, the estimate's goal corrected by each miss. Returns the plan and its count."""
    aim = goal
    best: tuple[float, list[LayerPlan], float] | None = None
    seen: dict[tuple[int, ...], float] = {}
    for _ in range(rounds):
        t = bisect(lambda v: estimate(plan_at(v)), aim)
        plans = plan_at(t)
        key = tuple(sorted(i for p in plans for i in p.removed))
        got = seen[key] if key in seen else exact(plans)
        seen[key] = got
        say(f"{what}: {got:.4f} of the input's at t = {t:.4f} (goal {goal:g})")
        if best is None or abs(got - goal) < abs(best[0] - goal):
            best = (got, plans, t)
        if abs(got - goal) <= tolerance:
            break
        aim = min(max(aim + (goal - got), 0.0), 1.0)
    assert best is not None
    return best[1], best[0]


# ---------------------------------------------------------------------- latency
def _session(model: onnx.ModelProto | bytes | str, threads: int, data_dir: str | Path | None = None):
    """A session of `model`: a ModelProto, its bytes, or its file (read by onnxruntime);
    `data_dir`: where the external data of a model given in bytes are (a streamed prune's)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if data_dir is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(data_dir))
    data = model if isinstance(model, bytes | str) else model.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


class LatencyMeter:
    """onnxruntime latency of the input model and of candidates, measured in turns: each round
    times a block of runs of one and then of the other; a model's latency is its fastest round's
    mean (what the machine gives when nothing else runs), and the ratio compares rounds taken
    side by side in time. All of onnxruntime's graph optimizations, as a deployment runs it;
    threads as the proof's sessions (ONNXSHRINK_THREADS, else one per core)."""

    def __init__(
        self, model: onnx.ModelProto | str, feed: Mapping[str, np.ndarray], rounds: int = 7, budget: float = 0.15
    ):
        """`model`: the input, or its file (read by onnxruntime, not serialized here)."""
        from onnxshrink.proof.sessions import session_threads

        self.threads = session_threads()
        self.rounds, self.budget = rounds, budget
        self.base = _session(model, self.threads)
        names = {i.name for i in self.base.get_inputs()}
        self.feed = {k: v for k, v in feed.items() if k in names}
        self.base_ms: float | None = None

    def _block(self, sess, runs: int) -> float:
        t0 = time.perf_counter()
        for _ in range(runs):
            sess.run(None, self.feed)
        return (time.perf_counter() - t0) / runs * 1e3

    def session(self, model: onnx.ModelProto | bytes, data_dir: str | Path | None = None):
        """A session of `model` as the input's (to time with `compare`, or to run); `data_dir`:
        where its external data are."""
        return _session(model, self.threads, data_dir)

    def compare(self, model, warm: bool = False, runs: tuple[list[float], list[float]] = ([], [])) -> tuple[float, float]:
        """(input ms, `model` ms): a model, or a session of it made by `session`. `warm`: both
        sessions have run already (their first, slow run is behind them): the first pair of
        runs, which sizes the blocks, then counts as a round when a block is one run. `runs`:
        pairs of single warm runs (ms) of the input and of the model on this meter's feed, taken
        side by side in time: rounds when a block is one run."""
        cand = self.session(model) if isinstance(model, onnx.ModelProto) else model
        if runs[0]:
            first = [min(runs[0]), min(runs[1])]
        else:
            first = [self._block(s, 1) for s in (self.base, cand)]  # warm-up: allocations, caches
        block = max(1, min(200, int(self.budget / max(max(first) / 1e3, 1e-6))))
        base: list[float] = []
        other: list[float] = []
        if block == 1:
            base, other = (list(runs[0]), list(runs[1])) if runs[0] else ([first[0]], [first[1]]) if warm else ([], [])
        while len(base) < self.rounds:
            base.append(self._block(self.base, block))
            other.append(self._block(cand, block))
        b, o = min(base), min(other)
        self.base_ms = b if self.base_ms is None else min(self.base_ms, b)
        return b, o


def meet_latency(
    plan_at: Callable[[float], list[LayerPlan]],
    start: float,
    shrunk: Callable[[list[LayerPlan]], onnx.ModelProto],
    meter: LatencyMeter,
    goal: float,
    say: Callable[[str], None],
    tolerance: float = 0.04,
    steps: int = 8,
) -> tuple[list[LayerPlan], float, float]:
    """Bisect t on the measured latency ratio, from `start`: the plan nearest `goal` (within
    `tolerance`, relative), its ratio and t."""
    lo, hi = 0.0, 0.999
    t = start
    best: tuple[float, list[LayerPlan], float] | None = None
    seen: dict[tuple[int, ...], float] = {}
    for _ in range(steps):
        plans = plan_at(t)
        key = tuple(sorted(i for p in plans for i in p.removed))
        if key not in seen:
            b, o = meter.compare(shrunk(plans))
            seen[key] = o / b
            say(f"latency: {o:.2f} ms against the input's {b:.2f} ms ({o / b:.3f}x) at t = {t:.4f} (goal {goal:g}x)")
        ratio = seen[key]
        if best is None or abs(ratio - goal) < abs(best[0] - goal):
            best = (ratio, plans, t)
        if abs(ratio / goal - 1) <= tolerance:
            break
        if ratio > goal:
            lo = t
        else:
            hi = t
        if hi - lo < 1e-3:
            break
        t = (lo + hi) / 2
    assert best is not None
    return best[1], best[0], best[2]
