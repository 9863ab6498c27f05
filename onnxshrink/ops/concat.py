"""Concat, Split, Slice, Gather: index ranges of one tensor are index ranges of another."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Dims,
    Handler,
    KeepView,
    OpNode,
    Reader,
    Reason,
    RewriteView,
    ShapeView,
    SymValue,
    WeightAxes,
    compress,
    int_attr,
    opaque_value,
    register,
    shape_operands,
)
from onnxshrink.ops.common import const_or_live, ints
from onnxshrink.ops.oracle import OracleCase, declare_cases, layout_dims, needs, sig


def _expand_axis(m: np.ndarray, v: np.ndarray, axis: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    ms = list(m.shape)
    ms[axis] = n
    vs = list(v.shape)
    vs[axis] = n
    return np.broadcast_to(m, ms), np.broadcast_to(v, vs)


# ------------------------------------------------------------------ Concat
def _joined_uniform(ctx, inputs, axis: int, r: int) -> ConstInfo | None:
    """Parts of run-time lengths: the join is known only where every part is the same along
    the joined axis (e.g. a channel constant over the whole sequence)."""
    parts = [np.broadcast_arrays(*const_or_live(ctx, t, r)) for t in inputs]
    if any(m.shape[axis] != 1 for m, _ in parts):
        return None
    m0, v0 = parts[0]
    full = np.broadcast_shapes(*(m.shape for m, _ in parts))
    m0, v0 = np.broadcast_to(m0, full), np.broadcast_to(v0, full)
    same = np.ones(full, bool)
    for m, v in parts[1:]:
        m, v = np.broadcast_to(m, full), np.broadcast_to(v, full)
        same &= m & m0 & (v == v0)
    if len(parts) == 1:
        same = m0
    return compress(same, np.where(same, v0, 0).astype(v0.dtype)) if same.any() else None


def joined(parts: Sequence[tuple[np.ndarray, np.ndarray]], sizes: Sequence[int], axis: int) -> ConstInfo | None:
    """The constants of a join along `axis` of parts (mask, value) of static sizes there."""
    full = []
    for (m, v), n in zip(parts, sizes, strict=True):
        m, v = np.broadcast_arrays(m, v)
        full.append(_expand_axis(m, v, axis, n))
    common = [max(p[0].shape[a] for p in full) for a in range(full[0][0].ndim)]
    ms, vs = [], []
    for m, v in full:
        target = list(common)
        target[axis] = m.shape[axis]
        ms.append(np.broadcast_to(m, target))
        vs.append(np.broadcast_to(v, target))
    return compress(np.concatenate(ms, axis), np.concatenate(vs, axis))


def keep_joined(ks: KeepView, inputs: Sequence[gs.Tensor], y: gs.Tensor, axis: int) -> None:
    """y is `inputs` joined along `axis`: each input's indices there are a range of y's (its
    offset: the sizes before it), the other axes are y's."""
    off = 0
    for t in inputs:
        ks.demand(t, pin=False)
        for a in range(ir.known_rank(y)):
            if a != axis:
                ks.couple(t, a, y, a)
        n = ks.size(t, axis)
        if n is None or ks.size(y, axis) is None:
            ks.pin(t, axis)
            ks.pin(y, axis)
            continue
        ks.couple_map(t, axis, y, axis, np.arange(n) + off)
        off += n


@register("Concat")
class Concat(Handler):
    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return tuple(range(len(node.inputs)))

    def extends(self, node: OpNode) -> dict[int, tuple[int, int]]:
        """The output is the first input extended along the axis (a KV cache's Concat(past, new))."""
        return {0: (0, int_attr(node, "axis", 0))} if len(node.inputs) > 1 else {}

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        y = node.outputs[0]
        r = ir.rank(y)
        if r is None or all(ctx.const(t) is None for t in node.inputs):
            return None
        axis = ir.norm_axis(int(node.attrs["axis"]), r)
        if any(ir.rank(t) != r for t in node.inputs):
            return None
        if any(ir.static_dim(t, axis) is None for t in node.inputs):
            return [_joined_uniform(ctx, node.inputs, axis, r)]
        parts = [const_or_live(ctx, t, r) for t in node.inputs]
        return [joined(parts, [ir.static_dim(t, axis) or 0 for t in node.inputs], axis)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        y = node.outputs[0]
        r = ir.rank(y)
        if r is None:
            ks.barrier(node)
            return
        keep_joined(ks, list(node.inputs), y, ir.norm_axis(int(node.attrs["axis"]), r))

    def may_drop_inputs(self, node: gs.Node) -> tuple[int, ...]:
        return tuple(range(len(node.inputs)))

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        vals = shape_operands(node, view, range(len(node.inputs)))
        if vals is None:
            return None
        return SymValue(tuple(i for v in vals for i in v.items))

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        """Inputs agree on every axis but the joined one, whose size is their sum."""
        yd = ir.dims(node.outputs[0])
        dims = [ir.dims(t) for t in node.inputs]
        if yd is None or any(d is None or len(d) != len(yd) for d in dims):
            return None
        axis = ir.norm_axis(int(node.attrs.get("axis", 0)), len(yd))
        new = list(yd)
        for k in range(len(yd)):
            if isinstance(yd[k], int):
                continue
            at = [d[k] for d in dims]  # type: ignore[index]
            if k == axis:
                if all(isinstance(v, int) for v in at):
                    new[k] = sum(at)  # type: ignore[arg-type]
                continue
            known = {v for v in at if isinstance(v, int)}
            if len(known) == 1:
                new[k] = known.pop()
            elif not known and len(set(at)) == 1 and at[0] is not None:
                new[k] = at[0]
        return new

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        axis = ir.norm_axis(int(node.attrs["axis"]), ir.known_rank(node.outputs[0]))
        keep = [t for t in node.inputs if rw.kept_count(t, axis) != 0]
        node.inputs.clear()
        node.inputs.extend(keep)


# ------------------------------------------------------------------ Split
def split_sizes(node: gs.Node, reader: Reader, x: gs.Tensor) -> tuple[int, list[int]] | None:
    r = ir.rank(x)
    if r is None:
        return None
    axis = ir.norm_axis(int(node.attrs.get("axis", 0)), r)
    sizes = ints(node, reader, "split", 1)
    if sizes is None:
        if "split" not in node.attrs and ir.present(node, 1) is not None:
            return None
        n = ir.static_dim(x, axis)
        k = len(node.outputs)
        if n is None:
            return None
        step = -(-n // k)  # opset 18: the last chunk may be smaller
        sizes = [min(step, n - step * i) for i in range(k)]
    return axis, sizes


@register("Split")
class Split(Handler):
    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x = node.inputs[0]
        c, ss = ctx.const(x), split_sizes(node, ctx, x)
        if c is None or ss is None:
            return None
        axis, sizes = ss
        m, v = np.broadcast_arrays(c.mask, c.value)
        m, v = _expand_axis(m, v, axis, sum(sizes))
        cuts = np.cumsum(sizes)[:-1]
        return [
            compress(a, b)
            for a, b in zip(np.split(m, cuts, axis), np.split(v, cuts, axis), strict=True)
        ]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x = node.inputs[0]
        ss = split_sizes(node, ks, x)
        if ss is None or ks.size(x, ss[0]) is None:
            ks.barrier(node)
            return
        axis, sizes = ss
        ks.demand(x, pin=False)
        for t in node.inputs[1:]:
            ks.demand(t)
        off = 0
        for y, n in zip(node.outputs, sizes, strict=True):
            for a in range(ir.known_rank(x)):
                if a != axis:
                    ks.couple(x, a, y, a)
            ks.couple_map(y, axis, x, axis, np.arange(n) + off)
            off += n

    def settle(self, node: gs.Node, ks: KeepView) -> None:
        ss = split_sizes(node, ks, node.inputs[0])
        if ss is None:
            return
        axis = ss[0]
        why = Reason(
            "structure", node.name, node.op, "each part of a Split keeps at least one index"
        )
        for y in node.outputs:
            k = ks.kept(y, axis)
            if k is not None and len(k) and not k.any():
                ks.keep(y, axis, [0], why)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        x = node.inputs[0]
        ss = split_sizes(node, rw, x)
        if ss is None:
            return
        axis, sizes = ss
        # a part whose size the analysis does not know was tied whole (keep's couple_map pins
        # both sides): it keeps its size
        counts = [rw.kept_count(y, axis) for y in node.outputs]
        new = [n if k is None else k for n, k in zip(sizes, counts, strict=True)]
        if new == sizes:
            return
        node.attrs.pop("num_outputs", None)
        if "split" in node.attrs or rw.opset < 13:
            node.attrs["split"] = new
        elif ir.present(node, 1) is not None:
            rw.replace_input(node, 1, np.asarray(new, dtype=np.int64))
        else:
            node.inputs.append(rw.constant(np.asarray(new, dtype=np.int64), "split"))


# ------------------------------------------------------------------ Slice
def clamped_bounds(n: int, start: int, end: int, step: int) -> tuple[int, int]:
    """(start, end) of a Slice of an axis of size n, as ONNX clamps them: negative ones count
    from the end, then [0, n] with a positive step; with a negative one, the start to
    [0, n - 1] and the end to [-1, n - 1] (numpy, and onnx's reference evaluator, take a start
    before the first element as selecting nothing)."""
    if step > 0:
        return min(max(start + n if start < 0 else start, 0), n), min(max(end + n if end < 0 else end, 0), n)
    return min(max(start + n if start < 0 else start, 0), n - 1), min(max(end + n if end < 0 else end, -1), n - 1)


def sliced_size(n: int, start: int, end: int, step: int) -> int:
    s, e = clamped_bounds(n, start, end, step)
    return len(range(s, e, step))


def size_varies(start: int, end: int, step: int) -> bool:
    """Does a Slice's output size on an axis of dynamic size n vary with n (n >= 1)? The clamps
    make it piecewise: x[-1:7] has 1 element up to n = 7 and none past it, so that two large
    probe sizes agree on 0 (prepare.complete_shapes)."""
    finite = [abs(v) for v in (start, end) if abs(v) < 2**62]
    top = max(finite, default=0) + 2 * abs(step) + 2
    # piecewise linear in n between the bounds' breakpoints: sizes around each, and past them
    sizes = [*range(1, min(top, 64) + 1), *(v + d for v in finite for d in range(-3, 4)), top, 2 * top + 1]
    return len({sliced_size(n, start, end, step) for n in sizes if n >= 1}) > 1


def slice_ranges(
    node: gs.Node, reader: Reader, x: gs.Tensor
) -> dict[int, tuple[int, int, int, np.ndarray | None]] | None:
    """Per sliced axis: (start, end, step, indices read or None when the axis is dynamic)."""
    r = ir.rank(x)
    if r is None:
        return None
    if "starts" in node.attrs:  # opset < 10
        starts, ends = list(node.attrs["starts"]), list(node.attrs["ends"])
        axes = list(node.attrs.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        got_starts, got_ends = ints(node, reader, "", 1), ints(node, reader, "", 2)
        got_axes, got_steps = ints(node, reader, "", 3), ints(node, reader, "", 4)
        if got_axes is None:
            if ir.present(node, 3) is not None or got_starts is None:
                return None
            got_axes = list(range(len(got_starts)))
        if (
            got_starts is None
            or got_ends is None
            or (got_steps is None and ir.present(node, 4) is not None)
        ):
            # Bounds computed at run time (e.g. up to a dynamic sequence length): the sliced
            # axes are known, what they keep is not.
            return {ir.norm_axis(int(a), r): (0, 0, 1, None) for a in got_axes}
        starts, ends, axes = got_starts, got_ends, got_axes
        steps = got_steps if got_steps is not None else [1] * len(starts)
    out: dict[int, tuple[int, int, int, np.ndarray | None]] = {}
    for a, s, e, st in zip(axes, starts, ends, steps, strict=True):
        a = ir.norm_axis(int(a), r)
        n = ir.static_dim(x, a)
        if n is None:
            out[a] = (s, e, st, None)
            continue
        s, e = clamped_bounds(n, s, e, st)
        out[a] = (s, e, st, np.arange(s, e, st))
    return out


@register("Slice")
class Slice(Handler):
    # onnx.reference slices as numpy does: with a negative step, a start before the first
    # element selects nothing, where ONNX (and onnxruntime) clamp it to the first element
    evaluate_with_ort = True

    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,)

    def reads_along(
        self, node: OpNode, i: int, axis: int, dims: Sequence[int], values: Mapping[str, np.ndarray]
    ) -> np.ndarray | None:
        """Of its data, the range its constant bounds give on `axis` (as ONNX clamps them)."""
        if i != 0:
            return None
        if "starts" in node.attrs:  # opset < 10
            bounds = [list(cast(Sequence[int], node.attrs[k])) if k in node.attrs else None for k in ("starts", "ends", "axes")]
            bounds.append(None)
        else:
            bounds = [values[x].reshape(-1).tolist() if x in values else None for x in (*node.inputs[1:5], "", "", "")[:4]]
            if any(node.has_input(k) and bounds[k - 1] is None for k in range(1, 5)):
                return None  # a bound computed at run time
        starts, ends, axes, steps = bounds
        if starts is None or ends is None:
            return None
        axes = axes if axes is not None else list(range(len(starts)))
        steps = steps if steps is not None else [1] * len(starts)
        for a, start, end, step in zip(axes, starts, ends, steps, strict=True):
            if ir.norm_axis(int(a), len(dims)) == axis:
                lo, hi = clamped_bounds(dims[axis], int(start), int(end), int(step))
                return np.arange(lo, hi, int(step))
        return np.arange(dims[axis])  # not sliced on this axis: all of it

    def resized_bounds(
        self, node: OpNode, consts: Mapping[str, np.ndarray], base: Dims, now: Dims
    ) -> list[list[int]] | None:
        # (opset < 10 gives the bounds as attributes: rare enough to leave alone)
        ins = list(node.inputs) + [""] * (5 - len(node.inputs))
        if len(node.inputs) < 3 or any(i and i not in consts for i in ins[1:]):
            return None
        starts, ends = (consts[i].reshape(-1).tolist() for i in ins[1:3])
        axes = consts[ins[3]].reshape(-1).tolist() if ins[3] else list(range(len(starts)))
        steps = consts[ins[4]].reshape(-1).tolist() if ins[4] else [1] * len(starts)
        bounds, resized = [list(starts), list(ends), axes, list(steps)], False
        for j, (a, st, en, sp) in enumerate(zip(axes, starts, ends, steps, strict=True)):
            size = now[a + len(base) if a < 0 else a]
            if isinstance(base[a], int) or not isinstance(size, int) or size < 1 or not size_varies(st, en, sp):
                continue
            c = sliced_size(size, st, en, sp)
            bounds[0][j], bounds[1][j], bounds[3][j] = 0, c + 1 if c < size else c - 1, 1
            resized = True
        return bounds if resized else None

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        if not view.is_shape(node.inputs[0]):
            return None
        a = view.sym(node.inputs[0])
        assert a is not None
        if "starts" in node.attrs:  # opset < 10
            starts, ends, steps = list(node.attrs["starts"]), list(node.attrs["ends"]), [1]
        else:
            params = [view.sym(ir.present(node, i)) for i in range(1, 5)]
            got = [p.ints() if p is not None else None for p in params]
            if got[0] is None or got[1] is None or (params[3] is not None and got[3] is None):
                return opaque_value(node, view)
            starts, ends, steps = got[0], got[1], got[3] or [1]
        return SymValue(a.items[slice(starts[0], ends[0], steps[0])])

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        """A Slice keeps the input's dims on the axes it does not slice; shape inference drops
        them all when the bounds are computed at run time."""
        x, y = node.inputs[0], node.outputs[0]
        xd, yd = ir.dims(x), ir.dims(y)
        if xd is None or yd is None or len(xd) != len(yd):
            return None
        if "axes" in node.attrs:
            axes = list(node.attrs["axes"])
        elif "starts" in node.attrs:
            axes = list(range(len(node.attrs["starts"])))
        elif ir.present(node, 3) is not None:
            v = consts.value(node.inputs[3])
            if v is None:
                return None
            axes = [int(a) for a in v.reshape(-1)]
        else:
            n = ir.static_dim(node.inputs[1], 0)
            if n is None:
                return None
            axes = list(range(n))
        sliced = {ir.norm_axis(a, len(xd)) for a in axes}
        return [
            xd[a] if a not in sliced and not isinstance(d, int) and isinstance(xd[a], int) else d
            for a, d in enumerate(yd)
        ]

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x = node.inputs[0]
        c, rng = ctx.const(x), slice_ranges(node, ctx, x)
        if c is None or rng is None:
            return None
        m, v = np.broadcast_arrays(c.mask, c.value)
        for a, (_, _, _, idx) in rng.items():
            if m.shape[a] == 1:
                continue  # uniform along the axis: any slice of it is the same
            if idx is None:
                return None
            m, v = np.take(m, idx, axis=a), np.take(v, idx, axis=a)
        return [compress(np.array(m), np.array(v))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        rng = slice_ranges(node, ks, x)
        if rng is None:
            ks.barrier(node)
            return
        ks.demand(x, pin=False)
        for t in node.inputs[1:]:
            ks.demand(t)
        for a in range(ir.known_rank(x)):
            if a not in rng:
                ks.couple(x, a, y, a)
                continue
            _, _, step, idx = rng[a]
            if idx is None or step != 1:
                ks.pin(x, a, Reason("structure", node.name, node.op, "strided or dynamic slice"))
                ks.pin(y, a)
            else:
                ks.couple_map(y, a, x, a, idx)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        rng = slice_ranges(node, rw, x)
        changes = {}
        for a, (s, _e, step, idx) in (rng or {}).items():
            kx = rw.kept(x, a)
            if idx is None or step != 1 or kx is None or kx.all():
                continue
            start = int(kx[:s].sum())
            changes[a] = (start, start + int(rw.kept_static(y, a).sum()))
        if not changes:
            return
        if "starts" in node.attrs:
            axes = [
                ir.norm_axis(int(a), ir.known_rank(x))
                for a in node.attrs.get("axes", range(len(node.attrs["starts"])))
            ]
            for k, a in enumerate(axes):
                if a in changes:
                    node.attrs["starts"][k], node.attrs["ends"][k] = changes[a]
            return
        starts, ends = ints(node, rw, "", 1), ints(node, rw, "", 2)
        assert starts is not None and ends is not None  # constant bounds (slice_ranges gave them)
        axes = ints(node, rw, "", 3) or list(range(len(starts)))
        for k, a in enumerate(axes):
            a = ir.norm_axis(int(a), ir.known_rank(x))
            if a in changes:
                starts[k], ends[k] = changes[a]
        rw.replace_input(node, 1, np.asarray(starts, dtype=np.int64))
        rw.replace_input(node, 2, np.asarray(ends, dtype=np.int64))


# ------------------------------------------------------------------ Gather
def _same_as_first(m: np.ndarray, v: np.ndarray, first: np.ndarray, axis: int) -> np.ndarray | None:
    """Where every index along `axis` is constant and equal to index 0 (keepdims); None when
    nowhere. In blocks along the axis, stopping at the first block that rules everything out
    (an embedding table: its second row already differs), so a large table costs a block."""
    mv, vv, f = np.moveaxis(m, axis, 0), np.moveaxis(v, axis, 0), np.moveaxis(first, axis, 0)
    step = max(1, (1 << 22) // max(1, f.size))
    same = np.ones(f.shape, bool)
    for start in range(0, vv.shape[0], step):
        block = slice(start, start + step)
        same &= (mv[block] & (vv[block] == f)).all(axis=0, keepdims=True)
        if not same.any():
            return None
    return np.moveaxis(same, 0, axis)


def _index_axis(idx: np.ndarray | None) -> int | None:
    """The axis of a constant index array that holds its entries (0 for a scalar), when every
    other axis has size 1; else None."""
    if idx is None:
        return None
    if idx.ndim == 0:
        return 0
    wide = [k for k, n in enumerate(idx.shape) if n != 1]
    return wide[0] if len(wide) == 1 else 0 if not wide else None


@register("Gather")
class Gather(Handler):
    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,)

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        if not view.is_shape(node.inputs[0]):
            return None
        a = view.sym(node.inputs[0])
        idx = view.sym(ir.present(node, 1))
        picks = idx.ints() if idx is not None else None
        if a is None or idx is None or picks is None or a.scalar:
            return opaque_value(node, view)
        n = len(a.items)
        return SymValue(tuple(a.items[i + n if i < 0 else i] for i in picks), scalar=idx.scalar)

    def index_inputs(self, node: OpNode) -> Mapping[int, tuple[int, int]]:
        return {1: (0, int_attr(node, "axis", 0))}

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        if i == 0 and rank == 2 and int_attr(node, "axis", 0) == 0:
            return WeightAxes(1, 0, "embedding")  # rows are looked up; their features go out
        return None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        return {"weight": 0}

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x, i_t = node.inputs[0], node.inputs[1]
        c, idx, r = ctx.const(x), ctx.value(i_t), ir.rank(x)
        if c is None or r is None:
            return None
        axis = ir.norm_axis(int(node.attrs.get("axis", 0)), r)
        if idx is None:  # looked up by the inputs: constant where every row is the same
            ri = ir.rank(i_t)
            m, v = np.broadcast_arrays(c.mask, c.value)
            if ri is None or m.shape[axis] == 0:
                return None
            first = v.take([0], axis=axis)
            same = _same_as_first(m, v, first, axis)
            if same is None:
                return None
            shape = same.shape[:axis] + (1,) * ri + same.shape[axis + 1 :]
            return [compress(same.reshape(shape), first.reshape(shape))]
        m, v = np.broadcast_arrays(c.mask, c.value)
        if m.shape[axis] == 1:
            shape_m = m.shape[:axis] + (1,) * idx.ndim + m.shape[axis + 1 :]
            return [ConstInfo(m.reshape(shape_m), v.reshape(shape_m))]
        n = ir.static_dim(x, axis)
        if n is None:  # the constants vary along an axis of unknown size
            return None
        idx = np.where(idx < 0, idx + n, idx)
        return [compress(np.take(m, idx, axis=axis), np.take(v, idx, axis=axis))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, i_t, y = node.inputs[0], node.inputs[1], node.outputs[0]
        r, ri = ir.rank(x), ir.rank(i_t)
        if r is None or ri is None:
            ks.barrier(node)
            return
        axis = ir.norm_axis(int(node.attrs.get("axis", 0)), r)
        ks.demand(x, pin=False)
        for a in range(r):
            if a < axis:
                ks.couple(x, a, y, a)
            elif a > axis:
                ks.couple(x, a, y, a - 1 + ri)
        idx = ks.value(i_t)
        n = ks.size(x, axis)
        along = _index_axis(idx)
        if idx is not None and n is not None and along is not None:
            ks.demand(i_t)
            idx = np.where(idx < 0, idx + n, idx)
            if idx.ndim == 0:
                ks.need(x, axis, [int(idx)])
                ks.selects(x, axis)
            else:  # the index's one axis of more than one entry (as_strided's [1, C, 1, 1])
                for k in range(idx.ndim):
                    if k != along:
                        ks.pin(y, axis + k)
                ks.couple_map(y, axis + along, x, axis, idx.reshape(-1))
        else:
            ks.demand(i_t, pin=False)
            ks.pin(
                x,
                axis,
                Reason(
                    "structure", node.name, node.op, "its rows are looked up by run-time indices"
                ),
            )
            for k in range(ri):
                ks.couple(i_t, k, y, axis + k)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        x, i_t, y = node.inputs[0], node.inputs[1], node.outputs[0]
        idx = rw.value(i_t)
        r = ir.known_rank(x)
        axis = ir.norm_axis(int(node.attrs.get("axis", 0)), r)
        kx = rw.kept(x, axis)
        along = _index_axis(idx)
        if idx is None or kx is None or along is None or kx.all():
            return
        n = len(kx)
        idx = np.where(idx < 0, idx + n, idx)
        pos = np.cumsum(kx) - 1
        if idx.ndim >= 1:
            ky = rw.kept(y, axis + along)
            idx = np.compress(ky, idx, axis=along) if ky is not None else idx
        rw.replace_input(node, 1, pos[idx].astype(idx.dtype))


# ------------------------------------------------------------------ oracle cases
def _concat_case(op: str, rng: np.random.Generator) -> OracleCase:
    """Concat, Split, Slice, Gather of an input [1, c, h, w] along its channels."""
    c, h, w = layout_dims(rng)
    x = [1, c, h, w]
    ins = [("x", "float", x)]
    if op == "Concat":
        ins = [("x", "float", x), ("z", "float", [1, c + 1, h, w])]
        y = [1, 2 * c + 1, h, w]
        return OracleCase(op, sig(ins, [("y", y)]) + " { y = Concat <axis = 1> (x, z) }", 17, needs=needs(rng, "y", y))
    if op == "Split":
        ins.append(("P", "int64", [2]))
        outs = [("y", [1, 1, h, w]), ("z", [1, c - 1, h, w])]
        return OracleCase(op, sig(ins, outs) + " { y, z = Split <axis = 1> (x, P) }", 17, values={"P": [1, c - 1]},
                          needs={**needs(rng, "y", outs[0][1]), **needs(rng, "z", outs[1][1])})
    if op == "Slice":
        ins += [("St", "int64", [1]), ("En", "int64", [1]), ("Ax", "int64", [1])]
        y = [1, c - 1, h, w]
        return OracleCase(op, sig(ins, [("y", y)]) + " { y = Slice (x, St, En, Ax) }", 17,
                          values={"St": [1], "En": [c], "Ax": [1]}, needs=needs(rng, "y", y))
    idx = sorted(rng.choice(c, size=int(rng.integers(1, c + 1)), replace=False).tolist())  # Gather
    ins.append(("I", "int64", [len(idx)]))
    y = [1, len(idx), h, w]
    return OracleCase(op, sig(ins, [("y", y)]) + " { y = Gather <axis = 1> (x, I) }", 17, values={"I": idx},
                      needs=needs(rng, "y", y))


declare_cases(dict.fromkeys(("Concat", "Split", "Slice", "Gather"), _concat_case))
