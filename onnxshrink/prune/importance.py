"""How important each group is, by one criterion (higher: keep it longer).

- `l1`, `l2`: Torch-Pruning's group magnitude (`GroupMagnitudeImportance` with its defaults:
  bias excluded, group reduction "mean"): per member whose role is a weight (a layer's weight
  matrix along its output or input axis, a normalization's scale), the sum of |w|^p over the
  member's slice; then the mean over those members. With a BatchNorm the exporter folded into
  the conv, the conv's weights are the folded ones (W * gamma / sqrt(var + eps)): export with
  optimize=False to rank by the same numbers as in the framework. A quantized weight's
  magnitude is that of its dequantized values, (q - zero point) * scale.
- `random`: uniform, from the seed.
- `activation`: data-driven, on the given inputs run with onnxruntime: per weight matrix that
  reads the group's channels (along its input axis), the mean |activation| of each channel
  times the sum of |w| over the weights that read it, summed.
- `wanda`: the same with the activation's root mean square (Wanda's |W| * ||X||_2, per weight,
  summed over the group).
- `fluctuation`: FLAP's: each channel's variance over the inputs times the sum of w^2 over the
  weights that read it: the squared output error of replacing the channel by its mean, which is
  what bias compensation (`compensate`) then leaves.

A group no weight matrix reads through an activation (its channels reach only the output) is
ranked by its L1 magnitude by the data-driven criteria.

Under a data-driven criterion a block's importance is its influence (ShortGPT's Block Influence):
1 - the cosine of the residual stream before and after it, along the channel axis, averaged over
every other position.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from operator import attrgetter

import numpy as np
import onnx

from onnxshrink.errors import ShrinkError
from onnxshrink.io import weights
from onnxshrink.options import CRITERIA, DATA_CRITERIA
from onnxshrink.prune.calibrate import Calibration, collect
from onnxshrink.prune.groups import Group, GroupSet, Member

# What each criterion needs, for --help and the messages.
NEEDS = {
    "l1": "the weights alone",
    "l2": "the weights alone",
    "random": "--seed alone",
    "activation": "--inputs (mean |x| of each channel x sum |w|)",
    "wanda": "--inputs (Wanda: RMS of each channel x sum |w|)",
    "fluctuation": "--inputs (FLAP: variance of each channel x sum w^2; pairs with --compensate)",
}


def scores(
    gset: GroupSet,
    criterion: str = "l1",
    *,
    seed: int = 0,
    model: onnx.ModelProto | None = None,
    inputs: list[Mapping[str, np.ndarray]] | None = None,
    calibration: Calibration | None = None,
) -> np.ndarray:
    """One importance per group (NaN for groups that are not exact: they are never chosen). The
    data-driven criteria read `calibration`, or collect it from `model` run on `inputs`."""
    if criterion not in CRITERIA:
        raise ShrinkError(f"--criterion {criterion}: choose one of {', '.join(CRITERIA)}.")
    out = np.full(len(gset.groups), np.nan)
    exact = [g for g in gset.groups if g.exact]
    if criterion == "random":
        rng = np.random.default_rng(seed)
        out[[g.id for g in exact]] = rng.random(len(exact))
        return out
    if criterion in DATA_CRITERIA:
        if calibration is None:
            if model is None or not inputs:
                raise ShrinkError(
                    f"--criterion {criterion} ranks groups by their activations on your inputs: "
                    "give them with --inputs data.npz (one array per model input)."
                )
            calibration = collect(model, activations(exact), inputs, streams=block_streams(gset, exact))
        per_channel = {
            "activation": lambda s: s.mean_abs,
            "wanda": lambda s: s.rms,
            "fluctuation": lambda s: s.variance,
        }[criterion]
        stats = {name: per_channel(s) for name, s in calibration.stats.items()}
        p = 2 if criterion == "fluctuation" else 1
        influence = block_influence(gset, exact, calibration)
        for g in exact:
            out[g.id] = influence[g.id] if g.id in influence else _activation_score(gset, g, stats, p)
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
    counts = np.fromiter(map(len, members), np.int64, len(members))
    flat = _member_norms(gset, list(chain.from_iterable(members)), p)
    out = np.full(len(groups), np.nan)  # a group with no member to weigh: nan, as np.mean([])
    some = counts > 0
    if some.any():
        starts = (np.cumsum(counts) - counts)[some]
        out[some] = np.add.reduceat(flat, starts) / counts[some]
    return out


def _member_norms(gset: GroupSet, members: list[Member], p: int) -> np.ndarray:
    """`member_norm` of each member, without a Python step per member where it holds one index
    (a layer's groups each hold one index of a weight): those are read from each weight's
    per-index norms with one fancy index per weight."""
    out = np.empty(len(members), np.float64)
    indices = list(map(attrgetter("indices"), members))
    lengths = np.fromiter(map(len, indices), np.int64, len(indices))
    keys = list(map(attrgetter("tensor", "axis"), members))
    codes = {key: c for c, key in enumerate(dict.fromkeys(keys))}  # (tensor, axis) -> its number
    all_norms(gset, list(codes), p)
    code = np.fromiter(map(codes.__getitem__, keys), np.int64, len(members))
    for k in np.flatnonzero(lengths != 1).tolist():
        out[k] = member_norm(gset, members[k], p)
    single = np.flatnonzero(lengths == 1)
    if not len(single):
        return out
    first = np.concatenate(indices)[(np.cumsum(lengths) - lengths)[single]]  # their one index
    order = np.argsort(code[single], kind="stable")
    ids, starts = np.unique(code[single][order], return_index=True)
    bounds = [*starts.tolist(), len(order)]
    names = list(codes)
    for j, c in enumerate(ids.tolist()):
        at = order[bounds[j] : bounds[j + 1]]
        tensor, axis = names[c]
        out[single[at]] = channel_norms(gset, tensor, axis, p)[first[at]]
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
        gset.norms.update(_tensor_norms(gset, tensor, [axis], p))
        weights.trim()  # the mapped pages read go back to the page cache
    return gset.norms[key]


def all_norms(gset: GroupSet, keys: list[tuple[str, int]], p: int) -> None:
    """`channel_norms` of every (tensor, axis) of `keys`, computed NORM_THREADS weights at a time
    (numpy lets go of the interpreter in its loops: a pass over TinyLlama's 4.4 GB of weights
    is a second or two of each core's time). Each weight's norms are the same sums as one at a
    time; they are stored here, in the order of `keys`."""
    axes: dict[str, list[int]] = {}
    for tensor, axis in keys:
        if (tensor, axis, p) not in gset.norms:
            axes.setdefault(tensor, []).append(axis)
    if len(axes) < 2 or NORM_THREADS < 2:
        for tensor, wanted in axes.items():
            channel_norms(gset, tensor, wanted[0], p)
            for axis in wanted[1:]:
                channel_norms(gset, tensor, axis, p)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(NORM_THREADS) as pool:
        for got in pool.map(lambda tensor: _tensor_norms(gset, tensor, axes[tensor], p), axes):
            gset.norms.update(got)
            weights.trim()  # the mapped pages read go back to the page cache


def _tensor_norms(gset: GroupSet, tensor: str, wanted: list[int], p: int) -> dict[tuple[str, int, int], np.ndarray]:
    """`channel_norms` of `tensor` along the axes `wanted`: a float matrix's along both, from one
    pass (a layer's weight is sliced along both: its output channels, and the hidden width it
    reads)."""
    values = gset.real(tensor)  # a quantized weight's dequantized values (a new array)
    if values.ndim == 2 and values.flags.c_contiguous and values.dtype in _FLOATS:
        weights.populate(values)  # a mapped weight's pages faulted in at once, not one by one
        rows, cols = _matrix_norms(values, p)
        return {(tensor, 0, p): rows, (tensor, 1, p): cols}
    return {(tensor, axis, p): _norms(values, axis, p) for axis in wanted}


def _norms(values: np.ndarray, axis: int, p: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """`channel_norms` of indices start..stop of `axis`, in blocks of indices of NORM_BLOCK_BYTES
    (in float64): a mapped weight is never copied whole. Each index's sum is numpy's over the
    block moved to put `axis` first, laid out as `astype` keeps it: along a matrix's rows,
    pairwise over each row; along its columns (a transposed block), each column's elements
    added one after the other, in order."""
    n = values.shape[axis]
    stop = n if stop is None else stop
    step = _norm_step(values, axis)
    out = np.empty(stop - start, np.float64)
    where: list[slice] = [slice(None)] * values.ndim
    for first in range(start, stop, step):  # the blocks start where they did for the whole axis
        where[axis] = slice(first, min(first + step, stop))
        part = values[tuple(where)]
        rows = np.moveaxis(part, axis, 0).reshape(part.shape[axis], -1).astype(np.float64)
        np.abs(rows, out=rows)
        if p != 1:
            np.power(rows, p, out=rows)
        out[first - start : first - start + len(rows)] = np.sum(rows, axis=1)  # each index whole
    return out


def _norm_step(values: np.ndarray, axis: int) -> int:
    """Indices of `axis` per block of `_norms`."""
    n = values.shape[axis]
    return max(1, NORM_BLOCK_BYTES // max(1, 8 * values.size // max(n, 1)))


def _matrix_norms(values: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
    """`_norms` of a C-ordered float matrix along both axes, the same sums in the same order,
    from one pass in blocks of rows (contiguous: no transposing copy), each converted and made
    absolute in one step. Along rows: each row summed whole (pairwise, as `_norms`). Along
    columns: each column's elements added one row after the other onto the running sums (held
    as the block's first row, then reduced along the rows: numpy adds them in order), as
    `_norms` adds a transposed block; except a block of `_norms` of one column, which it sums
    pairwise: so here."""
    k, n = values.shape
    per_row = max(1, MATRIX_BLOCK_BYTES // (8 * max(n, 1)))
    rows_out = np.empty(k, np.float64)
    sums = np.zeros(n, np.float64)  # 0 + x is x: the first row's values, as numpy starts with
    for start in range(0, k, per_row):
        part = values[start : start + per_row]
        block = np.empty((len(part) + 1, n), np.float64)
        block[0] = sums
        np.abs(part, out=block[1:])
        if p != 1:
            np.power(block[1:], p, out=block[1:])
        rows_out[start : start + len(part)] = np.sum(block[1:], axis=1)
        sums = np.add.reduce(block, axis=0)
    step = _norm_step(values, 1)
    if step == 1 or k == 1:
        sums = _norms(values, 1, p)
    elif n % step == 1:  # the last block of `_norms` holds one column
        sums[n - 1 :] = _norms(values, 1, p, n - 1)
    return rows_out, sums


# Weights whose norms `all_norms` computes at once. 1: two showed no gain on the shared 2-core
# machine it was tried on (TinyLlama's importance 5.6-7.4 s either way, load 5); the sums are
# the same bits at any count (test_weights_norms_computed_two_at_a_time...), so it may be raised
# where a quiet machine shows it pays.
NORM_THREADS = 1
NORM_BLOCK_BYTES = 32 * 2**20  # the float64 block of a weight `_norms` holds at once
# `_matrix_norms`' float64 blocks: small enough to stay in a core's L2 cache with the rows they
# are read from (4 MiB did not, on a 2 MiB L2: TinyLlama's 5632 x 2048 matrices 20% slower). The
# sums do not depend on it (each row summed whole, each column row after row)
MATRIX_BLOCK_BYTES = 512 * 2**10
_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def _activation_score(gset: GroupSet, g: Group, stats: dict[str, np.ndarray], p: int = 1) -> float:
    """Sum over the group's input-side weights of each channel's statistic x sum |w|^p."""
    total, used = 0.0, False
    for m in g.members:
        if m.data is None or m.data[0] not in stats:
            continue
        name, _, idx = m.data
        if len(idx) != len(m.indices):
            continue
        per_channel = channel_norms(gset, m.tensor, m.axis, p)[m.indices]
        total += float(np.sum(stats[name][idx] * per_channel))
        used = True
    return total if used else magnitude(gset, g, 1)  # nothing reads it through a weight


def block_streams(gset: GroupSet, groups: Sequence[Group]) -> list[tuple[str, str, int]]:
    """(stream before, stream after, channel axis) of each block among `groups`: what
    calibrate.collect measures the cosine of."""
    return sorted({(b.before, b.after, b.axis) for b in (gset.blocks.get(g.id) for g in groups) if b})


def block_influence(gset: GroupSet, groups: Sequence[Group], calibration: Calibration) -> dict[int, float]:
    """1 - the mean cosine of each block's stream before and after it, on the calibration
    inputs (blocks whose streams were not measured, e.g. inside an If: none)."""
    out: dict[int, float] = {}
    for g in groups:
        b = gset.blocks.get(g.id)
        if b is not None and (b.before, b.after, b.axis) in calibration.cosines:
            out[g.id] = 1.0 - calibration.cosines[b.before, b.after, b.axis]
    return out


def activations(groups: list[Group]) -> dict[str, int]:
    """Every activation the groups' input-side weights read: {tensor: channel axis}."""
    out: dict[str, int] = {}
    for g in groups:
        for m in g.members:
            if m.data is not None:
                out[m.data[0]] = m.data[1]
    return out
