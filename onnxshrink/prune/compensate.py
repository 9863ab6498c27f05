"""Bias compensation: a removed channel is replaced by its mean over the calibration inputs, and
that constant is folded into the bias of every layer that read it (FLAP's compensation); or the
layer's weights on the kept channels are refit by regularized least squares (`refit`), of which
the mean is the special case that predicts nothing from the kept channels.

The pruned reference is then the input with the chosen groups zeroed *and* these biases (and
weights) changed: the shrink is proven against it, and `weights_out` gives the changed values
under the framework's names, so that the masks and the changed values applied to the original
model make the reference again.

A consumer is a weight matrix that reads a group's channels along its input axis: a Conv (one
group), a Gemm's B, a MatMul's B. Where its constant goes is read from the graph: its own bias
input (Conv, Gemm's C of one value per output channel), the one Add of a constant of one value
per output channel that alone reads its output (F.linear exported as MatMul + Add), or the
BatchNormalization that alone reads it (its B, scaled by gamma / sqrt(var + eps)); with none of
these a bias is added (a Conv or Gemm bias input, or an Add after a MatMul), which the framework
has no parameter for: it goes under `onnx/NAME` in the weights written out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxshrink.core import BiasSlot, float_attr
from onnxshrink.errors import ShrinkError
from onnxshrink.io import weights as mapped
from onnxshrink.masks import ONNX_SECTION  # tensors with no framework name, as in --masks-out
from onnxshrink.ops import facts
from onnxshrink.options import COMPENSATIONS
from onnxshrink.prepare import default_opset
from onnxshrink.prune import spill
from onnxshrink.prune.calibrate import Calibration
from onnxshrink.prune.groups import GroupSet, Member, ParamRef, gather_slices
from onnxshrink.prune.spill import Disk, zero_slice


@dataclass
class Consumer:
    """A layer reading a group's channels with its weight `weight` along axis `inp`, its output
    channels along `out`; `bias`: the initializer its constant goes into (flattened, one value
    per output channel), times `scale` (a BatchNormalization between) and `gain` (Gemm's
    alpha / beta); `create`: how to add a bias it has not ("input", "add"), None when it has."""

    site: tuple[str, int]
    node: str
    weight: str
    inp: int
    out: int
    channels: int
    bias: str
    bias_site: tuple[str, int] | None = None  # (reader's first output, input index): its name
    create: str | None = None
    shape: tuple[int, ...] = ()  # of the bias it creates
    scale: np.ndarray | None = None
    gain: float = 1.0


@dataclass
class Compensation:
    """The model prepared for compensated prunes (shared weights untied per reader, biases found),
    the consumers by site, and the values every prune starts from."""

    model: onnx.ModelProto
    consumers: dict[tuple[str, int], Consumer]
    base: dict[str, np.ndarray]
    uncompensable: dict[str, str]  # consumer node -> why its channels are only zeroed
    # quantized members: what zeroing their slices sets them to (their zero point; GroupSet.zero_of)
    zeros: dict[str, np.ndarray] = field(default_factory=dict)
    # the readers' copies of shared initializers ({copy: original}): merged back where they stay equal
    copies: dict[str, str] = field(default_factory=dict)

    def variable(self) -> set[str]:
        """Every initializer a prune may change."""
        return set(self.base)


def prepare(
    model: onnx.ModelProto, gset: GroupSet, read: Callable[[onnx.TensorProto], np.ndarray] | None = None
) -> Compensation:
    """`model` (a copy) with every exact group's shared initializers untied per reader (as the
    analysis saw them), and the bias of each consumer of an exact group found or named. `read`:
    how a streamed model's initializers are read (mapped, `weights.WeightStore.array`); its
    weights then stay where they are (an untied copy refers to its original's external data)
    and the values every prune starts from (`base`) are read-only views of the mapped files."""
    from onnxshrink.prune.reference import untied, zeroed

    members = [m.with_indices(np.zeros(0, np.int64)) for g in gset.exact() for m in g.members]
    # zeroes nothing: unties (each reader its own copy to compensate) and makes Constants initializers
    out = zeroed(model, gset, members, retie=False) if read is None else untied(model, gset, members)
    read = read or numpy_helper.to_array
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    by_output = {n.output[0]: n for n in g.node if n.output}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for name in n.input:
            readers[name].append(n)
    consumers: dict[tuple[str, int], Consumer] = {}
    copies = {c: o for c, o in gset.untied.items() if c in inits}
    why: dict[str, str] = {}
    taken: set[str] = set()
    for grp in gset.exact():
        for m in grp.members:
            if m.side != "in" or not m.matrix or m.data is None or m.site in consumers:
                continue
            node = by_output.get(m.site[0])
            if node is None or m.site[0] in why:
                continue
            c = _consumer(node, m, inits, readers, out, read)
            if isinstance(c, str):
                why[node.name or node.output[0]] = c
                continue
            before = c.bias
            if c.bias in taken or (c.create is None and _shared(c.bias, node, readers)):
                c.bias = _untie(g, inits, c.bias, node, readers)
            taken.add(c.bias)
            consumers[m.site] = c
            if c.bias not in copies and c.bias != before:
                copies[c.bias] = before
    base: dict[str, np.ndarray] = {}
    for grp in gset.exact():
        for m in grp.members:
            if m.tensor in inits and m.tensor not in base:
                base[m.tensor] = read(inits[m.tensor])
    for c in consumers.values():
        if c.weight not in base:
            base[c.weight] = read(inits[c.weight])
        if c.create is None:
            base[c.bias] = read(inits[c.bias])
        else:
            base[c.bias] = np.zeros(c.shape, _dtype(inits[c.weight]))
    zeros = {name: z for name in base if (z := gset.zero_of(name)) is not None}
    return Compensation(out, consumers, base, why, zeros, copies)


def _dtype(t: onnx.TensorProto) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))


def _consumer(node, m: Member, inits, readers, model, read) -> Consumer | str:
    """The consumer reading member `m` at `node`, or why its channels cannot be compensated
    (its weight's shape from the TensorProto: its values are not read)."""
    i = m.site[1]
    if i >= len(node.input) or node.input[i] not in inits:
        return f"{node.op_type} reads its weight through another node"
    shape = tuple(int(d) for d in inits[node.input[i]].dims)
    rank = len(shape)
    handler, op = facts(node, default_opset(model))
    wa = handler.weight_axes(op, i, rank) if handler is not None else None
    if wa is None or wa.inp is None:
        return f"{node.op_type}: no weight matrix at input {i}"
    slot = handler.channel_bias if handler is not None else None
    if slot is None or i != slot.weight or slot.weight_rank not in (None, rank):
        return f"{node.op_type} with its weight at input {i}: no bias to fold a constant into"
    if slot.groups is not None and op.attrs.get(slot.groups, 1) != 1:
        return f"a grouped {node.op_type} (its input channels map to output channels by group)"
    gain = float_attr(op, slot.gain[0], 1.0) / float_attr(op, slot.gain[1], 1.0) if slot.gain else 1.0
    channels = shape[wa.out]
    name = node.name or node.output[0]
    common = dict(site=m.site, node=name, weight=node.input[i], inp=wa.inp, out=wa.out, channels=channels, gain=gain)
    own = node.input[slot.bias] if slot.bias is not None and len(node.input) > slot.bias else ""
    if own in inits and slot.bias is not None:
        if _per_channel(list(inits[own].dims), *slot.bias_layout, channels):
            return Consumer(bias=own, bias_site=(node.output[0], slot.bias), **common)
        return f"{node.op_type}'s bias {own!r} is not a constant of one value per output channel"
    after = readers.get(node.output[0], [])
    graph_outputs = {o.name for o in model.graph.output}
    if len(after) == 1 and node.output[0] not in graph_outputs:
        found = _bias_after(after[0], node, slot, rank, channels, inits, model, read)
        if found is not None:
            return Consumer(bias=found[0], bias_site=found[1], scale=found[2], **common)
    # none: a bias input where the op has a free one, else an Add after it (a computed bias, as
    # torch's exporter writes a Conv's bias=False without its optimizer, stays as it is)
    create = "input" if slot.bias is not None and not own else "add"
    trailing = rank - 1 - slot.axis if create == "add" and slot.axis != -1 else 0  # a Conv's spatial axes
    return Consumer(bias=f"{name}.compensation", create=create, shape=(channels,) + (1,) * trailing, **common)


def _bias_after(
    nxt: onnx.NodeProto, node: onnx.NodeProto, slot: BiasSlot, rank: int, channels: int, inits, model, read
) -> tuple[str, tuple[str, int], np.ndarray | None] | None:
    """The bias the one node after a consumer holds for it: an Add of a constant of one value
    per output channel, or a BatchNorm's shift (with the scale it multiplies the output by):
    (its name, its site, the scale), else None."""
    handler, op = facts(nxt, default_opset(model))
    if handler is None:
        return None
    params = handler.param_inputs(op, [name in inits for name in nxt.input])
    if set(params) == {"bias"} and len(nxt.input) == 2:  # an Add of a constant: a bias
        other = nxt.input[1] if nxt.input[0] == node.output[0] else nxt.input[0]
        if other in inits and _per_channel(list(inits[other].dims), slot.axis, None if slot.axis == -1 else rank, channels):
            return other, (nxt.output[0], list(nxt.input).index(other)), None
    if "running_var" in params and nxt.input[0] == node.output[0]:  # a BatchNorm after it
        scale = _bn_scale(nxt, params, inits, read)
        if scale is not None and scale.shape == (channels,):
            return nxt.input[params["bias"]], (nxt.output[0], params["bias"]), scale
    return None


def _per_channel(dims: list[int], axis: int, rank: int | None, channels: int) -> bool:
    """A constant of these dims, added to an output whose channel axis is `axis` (of `rank`; a
    MatMul's output: the last), holds one value per output channel and nothing else."""
    if int(np.prod(dims, dtype=np.int64)) != channels:
        return False
    if axis == -1:
        return not dims or dims[-1] == channels
    assert rank is not None
    pos = axis - (rank - len(dims))  # numpy's broadcasting aligns from the right
    return 0 <= pos < len(dims) and dims[pos] == channels


def _bn_scale(node: onnx.NodeProto, params: Mapping[str, int], inits, read) -> np.ndarray | None:
    """What a BatchNorm multiplies its input's channels by (`params`: its parameters' inputs)."""
    names = list(node.input[1:5])
    if len(names) < 4 or any(n not in inits for n in names):
        return None
    gamma, var = (read(inits[node.input[params[k]]]).astype(np.float64) for k in ("weight", "running_var"))
    eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
    return gamma / np.sqrt(var + eps)


def _shared(name: str, node: onnx.NodeProto, readers) -> bool:
    return sum(list(r.input).count(name) for r in readers.get(name, [])) > 1


def _untie(g: onnx.GraphProto, inits, name: str, node: onnx.NodeProto, readers) -> str:
    """A copy of initializer `name` for the consumer `node` (or the one Add/BatchNorm reading its
    output) alone."""
    reader = next(
        r for r in [node, *readers.get(node.output[0], [])] if name in list(r.input)
    )
    taken = {t.name for t in g.initializer}
    new, k = f"{name}.{reader.name or reader.output[0]}", 1
    while new in taken:
        new, k = f"{name}.{reader.name or reader.output[0]}.{k}", k + 1
    t = onnx.TensorProto()
    t.CopyFrom(inits[name])
    t.name = new
    g.initializer.append(t)
    inits[new] = t
    for j, x in enumerate(reader.input):
        if x == name:
            reader.input[j] = new
    readers[new].append(reader)
    readers[name] = [r for r in readers[name] if r is not reader]
    return new


# ---------------------------------------------------------------------- one prune's values
def changes(
    comp: Compensation,
    removed: Sequence[Member],
    calibration: Calibration | None,
    mode: str = "bias",
    ridge: float = 1.0,
    zero_all: bool = True,
    keep: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The new values of every initializer the prune changes: the removed members' slices zeroed
    and, with `mode` "bias" or "refit", each consumer's bias (and, refit, its weights on the kept
    channels) compensated for the channels it no longer reads. Computed from the unpruned values.
    `zero_all` False: only the values the compensation changed (with their removed slices
    zeroed, and the consumers' biases); the tensors that are only zeroed are left out
    (`apply_on_disk` zeroes them on disk, never copying them into memory). `keep`: where a
    refit weight goes once it is final (its removed slices zeroed), what is held instead (a
    streamed reference's spill file: the mapped view of it written), one weight in memory at
    a time."""
    if mode not in COMPENSATIONS:
        raise ShrinkError(f"--compensate {mode}: choose one of {', '.join(COMPENSATIONS)}.")
    out: dict[str, np.ndarray] = {}
    cuts = gather_slices((m.tensor, m.axis, m.indices) for m in removed)
    final: set[str] = set()  # the values handed to `keep`

    def value(name: str) -> np.ndarray:
        if name not in out:
            out[name] = np.array(comp.base[name], copy=True)
        return out[name]

    readers = Counter(c.weight for c in comp.consumers.values())
    if mode != "none":
        if calibration is None:
            raise ShrinkError(
                f"--compensate {mode} replaces removed channels by their mean on your inputs: give "
                "them with --inputs data.npz (one array per model input)."
            )
        for c in _each_consumer(comp, removed, calibration, mode, ridge, value):
            if keep is not None and c.weight in out and readers[c.weight] == 1:  # a refit weight, final
                for (name, axis), idx in cuts.items():
                    if name == c.weight:
                        zero_slice(out[name], axis, idx, comp.zeros.get(name))
                out[c.weight] = keep(c.weight, out[c.weight])
                final.add(c.weight)
            mapped.trim()  # a streamed model's weight pages read go back to the page cache
    # without zero_all: the biases too (small), whose removed outputs are zeroed below
    held = {c.bias for c in comp.consumers.values()}
    for (name, axis), idx in cuts.items():
        if name in comp.base and name not in final and (zero_all or name in out or name in held):
            zero_slice(value(name), axis, idx, comp.zeros.get(name))
    out_removed = defaultdict(list)
    for m in removed:
        out_removed[(m.tensor, m.axis)].append(m.indices)
    for c in comp.consumers.values():  # a bias the compensation added holds nothing for removed outputs
        if c.bias in out and (c.weight, c.out) in out_removed:
            idx = np.unique(np.concatenate(out_removed[(c.weight, c.out)]))
            out[c.bias].reshape(-1)[idx] = 0
    return out


def _each_consumer(
    comp: Compensation, removed: Sequence[Member], calibration: Calibration, mode: str, ridge: float, value
) -> Iterator[Consumer]:
    """Each consumer of a removed member compensated (`_compensate`), then yielded. A fit serves
    the consumers of one activation (q, k and v; gate and up): it goes after the last of them (a
    1.1 B LLaMA's down_proj fits, [kept, removed] in float64, held to the end, were 1.4 GiB of the
    refit's peak)."""
    fits: dict[tuple[str, bytes], tuple[np.ndarray, np.ndarray]] = {}  # (activation, rows) -> _regress
    by_site = _by_consumer(comp, removed, calibration)
    left = Counter(_activation(ms) for ms in by_site.values())
    for site, ms in by_site.items():
        c = comp.consumers[site]
        _compensate(c, ms, calibration, mode, ridge, comp.base, value, fits)
        left[_activation(ms)] -= 1
        if not left[_activation(ms)]:
            for key in [k for k in fits if k[0] == _activation(ms)]:
                del fits[key]
        yield c


def _by_consumer(
    comp: Compensation, removed: Sequence[Member], calibration: Calibration
) -> dict[tuple[str, int], list[Member]]:
    """The removed members each consumer compensates for, by its site: those it reads whose
    activation was calibrated, each weight row reading one channel."""
    per: dict[tuple[str, int], list[Member]] = defaultdict(list)
    for m in removed:
        if (
            m.site in comp.consumers
            and m.data is not None
            and m.data[0] in calibration.stats
            and len(m.data[2]) == len(m.indices)  # each weight row reads one channel
        ):
            per[m.site].append(m)
    return per


def _activation(ms: list[Member]) -> str:
    """The activation the members' consumer reads (the compensated members all have one)."""
    data = ms[0].data
    assert data is not None
    return data[0]


def _compensate(
    c: Consumer, ms: list[Member], calib: Calibration, mode: str, ridge: float, base, value,
    fits: dict[tuple[str, bytes], tuple[np.ndarray, np.ndarray]],
) -> None:
    src = base[c.weight]
    rows = np.concatenate([m.indices for m in ms])
    data = ms[0].data
    assert data is not None
    stats = calib.stats[data[0]]
    chans = np.concatenate([m.data[2] for m in ms if m.data is not None])
    samples = stats.samples
    refit = (
        mode == "refit"
        and samples is not None
        and src.shape[c.inp] == len(stats.total)
        and all(m.data is not None and np.array_equal(m.indices, m.data[2]) for m in ms)
    )
    if refit:
        kept = np.setdiff1d(np.arange(src.shape[c.inp]), rows)
        assert samples is not None
        key = (data[0], rows.tobytes())  # q, k and v (gate and up) read one activation: one fit
        if key not in fits:
            fits[key] = _regress(np.asarray(samples, np.float64), stats.mean, kept, rows, ridge)
        fit, const = fits[key]
        target = value(c.weight)
        delta = np.empty(src.shape[c.out], np.float64)
        # a block of outputs at a time, in float64: an LM head's [2048, 32000] weight took 1.5 GiB
        # of copies whole (its float64 copy, the fit's product, the kept rows' fancy copy)
        step = max(1, REFIT_BLOCK_BYTES // max(8 * src.size // max(src.shape[c.out], 1), 1))
        for lo in range(0, src.shape[c.out], step):
            block = _along(c.out, slice(lo, lo + step), src.ndim)
            rows_w = np.moveaxis(np.asarray(src[block], np.float64), [c.inp, c.out], [0, 1])  # [in, out, taps...]
            flat = rows_w.reshape(rows_w.shape[0], -1)  # [in, out * taps] (a copy when not a view)
            delta[lo : lo + step] = const @ _per_out(rows_w[rows])
            flat[kept] += fit @ flat[rows]  # (the removed rows, read first, are not among the kept)
            target[block] = np.moveaxis(flat.reshape(rows_w.shape), [0, 1], [c.inp, c.out])
    else:  # the removed rows alone, read and summed (a large weight is not copied whole)
        picked = np.asarray(np.take(src, rows, axis=c.inp), np.float64)
        delta = stats.mean[chans] @ _per_out(np.moveaxis(picked, [c.inp, c.out], [0, 1]))
    delta = delta * c.gain
    if c.scale is not None:
        delta = delta * c.scale
    b = value(c.bias)
    b.reshape(-1)[...] = (b.reshape(-1).astype(np.float64) + delta).astype(b.dtype)


# The float64 copy of a refit weight's block of outputs (see `_compensate`).
REFIT_BLOCK_BYTES = 32 * 2**20


def _along(axis: int, index: slice, ndim: int) -> tuple[slice, ...]:
    """An index taking `index` along `axis` of an array of `ndim` dims, all of the others."""
    return tuple(index if k == axis else slice(None) for k in range(ndim))


def _per_out(rows_w: np.ndarray) -> np.ndarray:
    """A weight's [in, out, taps...] rows summed over their taps: [in, out]."""
    return rows_w.reshape(rows_w.shape[0], rows_w.shape[1], -1).sum(axis=2)


def _regress(samples: np.ndarray, mean: np.ndarray, kept: np.ndarray, removed: np.ndarray, ridge: float):
    """x_removed ~ x_kept @ B + c over the samples, ridge-regularized (lambda = ridge x the kept
    channels' mean variance): (B, c)."""
    x = samples - samples.mean(axis=0)
    n = max(len(x), 1)
    xk, xr = x[:, kept], x[:, removed]
    lam = ridge * float(np.einsum("ij,ij->", xk, xk)) / (n * len(kept)) if len(kept) else 0.0
    if lam > 0 and len(x) < len(kept):
        # fewer samples than kept channels (1024 positions, a 5632-neuron FFN): the same fit
        # from the samples' n x n system, (Xk'Xk/n + lam I)^-1 Xk' = Xk' (Xk Xk'/n + lam I)^-1
        # (an LLM's refit spent minutes in k x k systems; this is ~(k/n)^2 less)
        z = np.linalg.solve(xk @ xk.T / n + lam * np.eye(len(x)), xr / n)
        fit = xk.T @ z
        return fit, mean[removed] - mean[kept] @ fit
    gram = xk.T @ xk / n
    lam = ridge * float(np.mean(np.diag(gram))) if len(kept) else 0.0
    fit = np.linalg.solve(gram + (lam or 1e-12) * np.eye(len(kept)), xk.T @ xr / n)
    return fit, mean[removed] - mean[kept] @ fit


# ---------------------------------------------------------------------- the reference
def apply(comp: Compensation, values: Mapping[str, np.ndarray], copy: bool = True) -> onnx.ModelProto:
    """The prepared model with `values` written, and the biases added where a consumer had none
    and its compensation is not zero."""
    out = comp.model
    if copy:
        out = onnx.ModelProto()
        out.CopyFrom(comp.model)
    _written(out, comp, values, lambda name, v: numpy_helper.from_array(v, name))
    from onnxshrink.prune.reference import retie_copies

    retie_copies(out, comp.copies)  # the readers' copies that stayed equal: one tensor again
    return out


def apply_on_disk(
    comp: Compensation, values: Mapping[str, np.ndarray], gset: GroupSet, removed: Sequence[Member], disk: Disk
) -> onnx.ModelProto:
    """`apply` for a model prepared with its weights on disk (`prepare(..., read)`), with
    `values` from `changes(..., zero_all=False)`: those written (a large one, a refit weight, to
    `disk`'s spill file), and the `removed` members' slices of every other tensor `changes`
    would have zeroed, zeroed on disk tensor by tensor (`reference.zeroed` with `disk`): the
    same reference as `apply(comp, changes(...))`, never the model's weights in memory."""
    from onnxshrink.prune.reference import retie_copies, zeroed

    out = onnx.ModelProto()
    out.CopyFrom(comp.model)
    _written(out, comp, values, lambda name, v: _stored(name, v, disk))
    # as `changes` zeroes them: the members of tensors the compensation may change (`base`)
    rest = [m for m in removed if m.tensor in comp.base and m.tensor not in values]
    zeroed(out, gset, rest, copy=False, retie=False, disk=disk)
    retie_copies(out, comp.copies, disk.read)
    return out


def spilled(disk: Disk) -> Callable[[str, np.ndarray], np.ndarray]:
    """`changes`' keep for a reference on disk: a large value written to `disk`'s spill file,
    its mapped view held instead (a small one as it is)."""

    def keep(name: str, v: np.ndarray) -> np.ndarray:
        if v.nbytes < spill.SPILL_BYTES or v.ndim == 0:
            return v
        return disk.writer.write(name, mapped.row_blocks(v), v.shape, v.dtype)

    return keep


def _written(
    out: onnx.ModelProto,
    comp: Compensation,
    values: Mapping[str, np.ndarray],
    stored: Callable[[str, np.ndarray], onnx.TensorProto],
) -> None:
    """`values` written into `out` as `stored` makes their TensorProtos, the biases added first
    where a consumer had none and its compensation is not zero (`apply`, `apply_on_disk`)."""
    g = out.graph
    add = {c.bias: c for c in comp.consumers.values() if c.create and c.bias in values and np.any(values[c.bias])}
    _add_biases(g, list(add.values()))
    inits = {t.name: t for t in g.initializer}
    for name, v in values.items():
        if name in inits:
            inits[name].CopyFrom(stored(name, np.asarray(v)))
        elif name in add:
            g.initializer.append(stored(name, np.asarray(v)))


def _stored(name: str, v: np.ndarray, disk: Disk) -> onnx.TensorProto:
    """The TensorProto of a changed value: in the spill file when large (written row block by
    row block, then mapped), else holding it."""
    if disk.store.owns(v):  # written already (`changes`' keep)
        return disk.proto(name, v)
    if v.nbytes < spill.SPILL_BYTES or v.ndim == 0:
        return numpy_helper.from_array(v, name)
    made = disk.writer.write(name, mapped.row_blocks(v), v.shape, v.dtype)
    return disk.proto(name, made)


def with_all_biases(comp: Compensation) -> onnx.ModelProto:
    """The prepared model with every consumer's bias present (zeros where it had none): what the
    sensitivity runner changes."""
    out = onnx.ModelProto()
    out.CopyFrom(comp.model)
    made = [c for c in comp.consumers.values() if c.create]
    _add_biases(out.graph, made)
    out.graph.initializer.extend(numpy_helper.from_array(comp.base[c.bias], c.bias) for c in made)
    return out


def _add_biases(g: onnx.GraphProto, made: list[Consumer]) -> None:
    """A bias input for each Conv/Gemm consumer of `made`, an Add after each MatMul one."""
    nodes = {n.output[0]: n for n in g.node if n.output}
    for c in made:
        node = nodes[c.site[0]]
        if c.create == "input":
            while len(node.input) < 2:
                node.input.append("")
            if len(node.input) == 2:
                node.input.append(c.bias)
            else:
                node.input[2] = c.bias
            continue
        y = node.output[0]
        raw = f"{y}.uncompensated"
        node.output[0] = raw
        k = list(g.node).index(node)
        g.node.insert(k + 1, helper.make_node("Add", [raw, c.bias], [y], name=f"{c.node}.compensation"))


# ---------------------------------------------------------------------- the weights written out
def framework_values(
    gset: GroupSet, values: Mapping[str, np.ndarray], comp: Compensation
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The values the prune changed other than by zeroing (compensated biases, refit weights)
    under the framework's parameter names, in the framework's layout, as the exporter recorded
    them for the node reading each; those with no parameter of that value (a BatchNorm the
    exporter folded into its conv, a bias the compensation added) under `onnx/NAME`, and listed
    second. In a model that records no framework names at all (ONNX-first exporters), the ONNX
    names are the only ones, and stand alone."""
    refs: dict[tuple[str, int], tuple[list[ParamRef], int]] = {}
    for g in gset.groups:
        for m in g.members:
            if m.params:
                refs.setdefault(m.site, (m.params, m.axis))
    site_of: dict[str, tuple[str, int] | None] = {}
    for c in comp.consumers.values():
        site_of[c.weight] = c.site
        site_of[c.bias] = c.bias_site
    section = ONNX_SECTION if refs else ""
    out: dict[str, np.ndarray] = {}
    unnamed: list[str] = []
    for name, v in values.items():
        base = comp.base.get(name)
        v = np.asarray(v)
        only_zeroed = base is not None and _only_zeroed(base, v, comp.zeros.get(name))
        mapped.trim()  # a streamed model's pages read (`base`, a refit weight spilled) given back
        if only_zeroed:
            continue  # the masks say it
        site = site_of.get(name)
        ps, axis = refs.get(site, ([], -1)) if site is not None else ([], -1)
        if len(ps) == 1 and tuple(ps[0].shape) == v.shape and ps[0].axis == axis:
            out[ps[0].name] = v
        elif len(ps) == 1 and v.ndim == 2 and tuple(ps[0].shape) == v.shape[::-1] and ps[0].axis != axis:
            out[ps[0].name] = np.ascontiguousarray(v.T)  # a Linear weight a MatMul reads transposed
        else:
            out[section + name] = v
            unnamed.append(name)
    return out, unnamed


def _only_zeroed(before: np.ndarray, after: np.ndarray, zero: np.ndarray | None = None) -> bool:
    """Did the prune only remove elements of this tensor (set them to 0, or to `zero`, a quantized
    weight's zero point)?"""
    return bool(np.all((after == before) | (after == (0 if zero is None else zero))))
