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

from onnxshrink.errors import ShrinkError, first_line
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
    out[[g.id for g in exact]] = magnitudes(gset, exact, p)
    return out


def weighed(g: Group) -> list[Member]:
    """The members whose magnitude counts: the weights (biases excluded), else all."""
    return [m for m in g.members if m.role == "weight"] or g.members


def magnitudes(gset: GroupSet, groups: list[Group], p: int) -> np.ndarray:
    """`magnitude` of each of `groups`, vectorised: the members' norms are read from each
    weight's per-index norms (one fancy index per weight), then averaged per group with one
    reduceat (the same sums, in the same order, as np.mean of each group's list)."""
    members = [weighed(g) for g in groups]
    counts = np.array([len(ms) for ms in members], np.int64)
    flat = np.empty(int(counts.sum()), np.float64)
    single: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    k = 0
    for ms in members:
        for m in ms:
            if len(m.indices) == 1:
                pos, idx = single.setdefault((m.tensor, m.axis), ([], []))
                pos.append(k)
                idx.append(int(m.indices[0]))
            else:
                flat[k] = member_norm(gset, m, p)
            k += 1
    for (tensor, axis), (pos, idx) in single.items():
        flat[pos] = channel_norms(gset, tensor, axis, p)[idx]
    out = np.full(len(groups), np.nan)  # a group with no member to weigh: nan, as np.mean([])
    some = counts > 0
    if some.any():
        starts = (np.cumsum(counts) - counts)[some]
        out[some] = np.add.reduceat(flat, starts) / counts[some]
    return out


def magnitude(gset: GroupSet, g: Group, p: int) -> float:
    return float(np.mean([member_norm(gset, m, p) for m in weighed(g)]))


def member_norm(gset: GroupSet, m: Member, p: int) -> float:
    """The sum of |w|^p over the member's slice."""
    return float(np.sum(channel_norms(gset, m.tensor, m.axis, p)[m.indices]))


def channel_norms(gset: GroupSet, tensor: str, axis: int, p: int) -> np.ndarray:
    """The sum of |w|^p of each index of `axis` of `tensor`: one pass over the weight (in float64),
    kept for every member that slices it (a layer's groups each hold one index or a few)."""
    key = (tensor, axis, p)
    if key not in gset.norms:
        values = gset.arrays[tensor]
        rows = np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1).astype(np.float64)
        np.abs(rows, out=rows)
        if p != 1:
            np.power(rows, p, out=rows)
        gset.norms[key] = np.sum(rows, axis=1)
    return gset.norms[key]


def _activation_score(gset: GroupSet, g: Group, means: dict[str, np.ndarray]) -> float:
    total, used = 0.0, False
    for m in g.members:
        if m.data is None or m.data[0] not in means:
            continue
        name, _, idx = m.data
        if len(idx) != len(m.indices):
            continue
        per_channel = channel_norms(gset, m.tensor, m.axis, 1)[m.indices]
        total += float(np.sum(means[name][idx] * per_channel))
        used = True
    return total if used else magnitude(gset, g, 1)  # nothing reads it through a weight


def _mean_abs_activations(
    model: onnx.ModelProto, gset: GroupSet, groups: list[Group], inputs: list[Mapping[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """Mean |x| per index of the channel axis of every activation a group's weights read."""
    from onnxshrink.validate import check_inputs, session

    check_inputs(model, inputs)  # names, dtypes and shapes, as for the proof (each named)
    wanted: dict[str, int] = {}
    # only the main graph's tensors can be outputs; inside an If/Loop/Scan body, the magnitude
    visible = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    for g in groups:
        for m in g.members:
            if m.data is not None and m.data[0] in visible:
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
        try:
            ran = sess.run(None, {k: v for k, v in feed.items() if k in feed_names})
        except Exception as exc:  # onnxruntime on the user's values: a token id out of range, ...
            raise ShrinkError(
                f"{getattr(feed, 'source', '--inputs')}: the model fails to run on these inputs in "
                f"onnxruntime ({first_line(exc)}). Check the arrays' values against the model's "
                "inputs (e.g. token ids below the vocabulary size)."
            ) from exc
        outs = dict(zip(names, ran, strict=True))
        for name, axis in wanted.items():
            x = np.abs(np.asarray(outs[name], dtype=np.float64))
            m = np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1).mean(axis=1)
            sums[name] = sums.get(name, 0) + m
    return {k: v / len(inputs) for k, v in sums.items()}
