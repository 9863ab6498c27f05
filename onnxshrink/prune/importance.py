"""How important each group is, by one criterion (higher: keep it longer).

- `l1`, `l2`: Torch-Pruning's group magnitude (`GroupMagnitudeImportance` with its defaults:
  bias excluded, group reduction "mean"): per member whose role is a weight (a layer's weight
  matrix along its output or input axis, a normalization's scale), the sum of |w|^p over the
  member's slice; then the mean over those members. With a BatchNorm the exporter folded into
  the conv, the conv's weights are the folded ones (W * gamma / sqrt(var + eps)): export with
  optimize=False to rank by the same numbers as in the framework.
- `random`: uniform, from the seed.
- `activation`: data-driven, on the given inputs run with onnxruntime: per weight matrix that
  reads the group's channels (along its input axis), the mean |activation| of each channel
  times the sum of |w| over the weights that read it (as Wanda scores a weight), summed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from onnxshrink.errors import ShrinkError
from onnxshrink.prune.groups import Group, GroupSet, Member

CRITERIA = ("l1", "l2", "random", "activation")


def scores(
    gset: GroupSet,
    criterion: str = "l1",
    *,
    seed: int = 0,
    model: onnx.ModelProto | None = None,
    inputs: list[Mapping[str, np.ndarray]] | None = None,
) -> np.ndarray:
    """One importance per group (NaN for groups that are not exact: they are never chosen)."""
    if criterion not in CRITERIA:
        raise ShrinkError(f"--criterion {criterion}: choose one of {', '.join(CRITERIA)}.")
    out = np.full(len(gset.groups), np.nan)
    exact = [g for g in gset.groups if g.exact]
    if criterion == "random":
        rng = np.random.default_rng(seed)
        out[[g.id for g in exact]] = rng.random(len(exact))
        return out
    if criterion == "activation":
        if model is None or not inputs:
            raise ShrinkError(
                "--criterion activation ranks groups by their activations on your inputs: give "
                "them with --inputs data.npz (one array per model input)."
            )
        means = _mean_abs_activations(model, gset, exact, inputs)
        for g in exact:
            out[g.id] = _activation_score(gset, g, means)
        return out
    p = 1 if criterion == "l1" else 2
    for g in exact:
        out[g.id] = magnitude(gset, g, p)
    return out


def magnitude(gset: GroupSet, g: Group, p: int) -> float:
    weights = [m for m in g.members if m.role == "weight"] or g.members
    return float(np.mean([_slice_norm(gset.arrays[m.tensor], m, p) for m in weights]))


def _slice_norm(values: np.ndarray, m: Member, p: int) -> float:
    part = np.take(values, m.indices, axis=m.axis).astype(np.float64)
    return float(np.sum(np.abs(part) ** p))


def _activation_score(gset: GroupSet, g: Group, means: dict[str, np.ndarray]) -> float:
    total, used = 0.0, False
    for m in g.members:
        if m.data is None or m.data[0] not in means:
            continue
        name, _, idx = m.data
        if len(idx) != len(m.indices):
            continue
        w = np.abs(np.take(gset.arrays[m.tensor], m.indices, axis=m.axis).astype(np.float64))
        per_channel = np.moveaxis(w, m.axis, 0).reshape(len(m.indices), -1).sum(axis=1)
        total += float(np.sum(means[name][idx] * per_channel))
        used = True
    return total if used else magnitude(gset, g, 1)  # nothing reads it through a weight


def _mean_abs_activations(
    model: onnx.ModelProto, gset: GroupSet, groups: list[Group], inputs: list[Mapping[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """Mean |x| per index of the channel axis of every activation a group's weights read."""
    from onnxshrink.validate import session

    wanted: dict[str, int] = {}
    for g in groups:
        for m in g.members:
            if m.data is not None:
                wanted[m.data[0]] = m.data[1]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    for name in wanted:
        if name not in present:
            probe.graph.output.append(onnx.ValueInfoProto(name=name))
    names = [o.name for o in probe.graph.output]
    sums: dict[str, np.ndarray] = {}
    sess = session(probe, "cpu")
    feed_names = {i.name for i in sess.get_inputs()}
    for feed in inputs:
        missing = feed_names - set(feed)
        if missing:
            raise ShrinkError(f"--inputs: no array for model input(s) {sorted(missing)}.")
        outs = dict(zip(names, sess.run(None, {k: v for k, v in feed.items() if k in feed_names}), strict=True))
        for name, axis in wanted.items():
            x = np.abs(np.asarray(outs[name], dtype=np.float64))
            m = np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1).mean(axis=1)
            sums[name] = sums.get(name, 0) + m
    return {k: v / len(inputs) for k, v in sums.items()}
