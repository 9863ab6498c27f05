"""Pad, Resize/Upsample, Tile: an axis they leave alone passes its indices through."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Handler,
    KeepView,
    OpNode,
    Reader,
    Reason,
    RewriteView,
    compress,
    evaluate_op,
    register,
    str_attr,
)
from onnxshrink.ops.common import channelwise_constants, const_or_live, ints
from onnxshrink.ops.oracle import OracleCase, declare_cases, layout_dims, needs, sig


def _per_axis(
    node: gs.Node, ks: KeepView, x: gs.Tensor, y: gs.Tensor, touched: set[int], why: Reason
) -> None:
    ks.demand(x, pin=False)
    for t in node.inputs[1:]:
        if t is not None and t.name:
            ks.demand(t)
    for a in range(ir.rank(x) or 0):
        if a in touched:
            ks.pin(x, a, why)
            ks.pin(y, a, why)
        else:
            ks.couple(x, a, y, a)


# ------------------------------------------------------------------ Pad
def pad_amounts(node: gs.Node, reader: Reader, r: int) -> dict[int, tuple[int, int]] | None:
    pads = ints(node, reader, "pads", 1)
    if pads is None:
        return None
    axes = ints(node, reader, "", 3) if "pads" not in node.attrs else None
    axes = ir.norm_axes(axes, r) if axes is not None else list(range(r))
    k = len(axes)
    return {a: (pads[i], pads[i + k]) for i, a in enumerate(axes)}


def _pad_mask(
    node: gs.Node, ctx: ConstView, m: np.ndarray, rest: list[np.ndarray | None], mode: str
) -> np.ndarray:
    """Which output cells are constant: padded cells are, in constant mode (they hold the value)."""
    if mode != "constant":
        return ctx.evaluate(node, [m, *rest])[0] > 0.5  # edge/reflect/wrap copy input cells
    if "pads" in node.attrs:  # opset < 11: the pad value is an attribute
        return evaluate_op("Pad", {**node.attrs, "value": 1.0}, [m], ctx.opset)[0] > 0.5
    rest = [*rest, None, None][:3]  # pads, constant_value, axes
    rest[1] = np.ones((), m.dtype)
    return ctx.evaluate(node, [m, *rest])[0] > 0.5


def _index_map(before: int, after: int, n: int | None, m: int | None) -> tuple[bool, np.ndarray] | None:
    """A constant-mode pad of an axis of size n to size m: (x is the smaller, idx) where index j
    of the smaller is index idx[j] of the larger (x's i is y's i + before); None where neither
    side holds the other (padded at one end, cropped at the other) or a size is unknown."""
    if n is None or m is None or n + before + after != m:
        return None
    if before >= 0 and after >= 0:
        return True, np.arange(n) + before
    if before <= 0 and after <= 0:
        return False, np.arange(m) - before
    return None


@register("Pad")
class Pad(Handler):
    """A constant-mode pad maps the indices of an axis it pads by an offset (a channel of x is
    channel i + pads_begin of y; a BlazeFace shortcut padding channels with zeros to a wider
    residual): the padded indices are constants (the pad value), which go where their readers
    let them, and the pads are rewritten to the kept counts. Other modes copy input indices into
    the border: a padded axis is kept whole."""

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x = node.inputs[0]
        c, r = ctx.const(x), ir.rank(x)
        amounts = pad_amounts(node, ctx, r) if r is not None else None
        if amounts is None or r is None:
            return None
        mode = str_attr(node, "mode", "constant")
        rest = [ctx.value(t) if t is not None and t.name else None for t in node.inputs[1:]]
        if c is None:  # a live input: in constant mode, the cells padded hold the pad value
            # (recorded where one axis grows: whole slices, as a channel pad makes; the borders
            # of a spatial pad are read by no rule, and would cost a mask the map's size)
            value_t = ir.present(node, 2) if "pads" not in node.attrs else None
            grows = [a for a, (b, e) in amounts.items() if b > 0 or e > 0]
            if mode != "constant" or len(grows) != 1 or (value_t is not None and rest[1] is None):
                return None
        m, v = np.broadcast_arrays(*(const_or_live(ctx, x, r) if c is None else (c.mask, c.value)))
        for a, (b, e) in amounts.items():
            if b or e:
                n = ir.static_dim(x, a)
                if n is None:
                    return None
                shape = list(m.shape)
                shape[a] = n
                m, v = np.broadcast_to(m, shape), np.broadcast_to(v, shape)
        out_v = ctx.evaluate(node, [np.ascontiguousarray(v), *rest])[0]
        out_m = _pad_mask(node, ctx, np.ascontiguousarray(m.astype(v.dtype)), rest, mode)
        return [compress(out_m, out_v)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        amounts = pad_amounts(node, ks, r) if r is not None else None
        if amounts is None:
            ks.barrier(node, Reason("structure", node.name, node.op, "pads not constant"))
            return
        touched = {a for a, (b, e) in amounts.items() if b or e}
        why = Reason("structure", node.name, node.op, "padded axis")
        if str_attr(node, "mode", "constant") != "constant":
            _per_axis(node, ks, x, y, touched, why)
            return
        ks.demand(x, pin=False)
        for t in node.inputs[1:]:
            if t is not None and t.name:
                ks.demand(t)
        for a in range(r or 0):
            if a not in touched:
                ks.couple(x, a, y, a)
                continue
            b, e = amounts[a]
            found = _index_map(b, e, ks.size(x, a), ks.size(y, a))
            if found is None:
                ks.pin(x, a, why)
                ks.pin(y, a, why)
            elif found[0]:
                ks.couple_map(x, a, y, a, found[1])
            else:
                ks.couple_map(y, a, x, a, found[1])

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        amounts = pad_amounts(node, rw, r) if r is not None and str_attr(node, "mode", "constant") == "constant" else None
        changes = {}
        for a, (b, e) in (amounts or {}).items():
            kx, ky = rw.kept(x, a), rw.kept(y, a)
            if not (b or e) or kx is None or ky is None or (kx.all() and ky.all()):
                continue
            # the kept indices of the padded (or cropped) ends
            nb = int(ky[:b].sum()) if b >= 0 else -int(kx[:-b].sum())
            ne = int(ky[len(ky) - e :].sum()) if e > 0 else -int(kx[len(kx) + e :].sum()) if e < 0 else 0
            changes[a] = (nb, ne)
        if changes:
            _set_pads(node, rw, r or 0, changes)


def _set_pads(node: gs.Node, rw: RewriteView, r: int, changes: dict[int, tuple[int, int]]) -> None:
    """Write the new (begin, end) pads of the axes in `changes`, where the node keeps them."""
    pads = ints(node, rw, "pads", 1)
    assert pads is not None  # constant pads (the keep step read them)
    axes = ints(node, rw, "", 3) if "pads" not in node.attrs else None
    axes = ir.norm_axes(axes, r) if axes is not None else list(range(r))
    k = len(axes)
    for i, a in enumerate(axes):
        if a in changes:
            pads[i], pads[i + k] = changes[a]
    if "pads" in node.attrs:
        node.attrs["pads"] = pads
    else:
        rw.replace_input(node, 1, np.asarray(pads, dtype=np.int64))


# ------------------------------------------------------------------ Resize / Upsample
def resize_factors(
    node: gs.Node, reader: KeepView | ConstView | RewriteView, x: gs.Tensor
) -> tuple[list[float] | None, list[int | None] | None] | None:
    """(scales, sizes) over all axes of x, either may be None; None when neither is known."""
    r = ir.rank(x)
    if r is None:
        return None
    if node.op == "Upsample" or reader.opset <= 10:
        scales = node.attrs.get("scales")
        if scales is None and ir.present(node, 1) is not None:
            v = reader.value(node.inputs[1])
            scales = None if v is None else [float(s) for s in v.reshape(-1)]
        return (list(scales), None) if scales is not None else None
    sc_t, sz_t = ir.present(node, 2), ir.present(node, 3)
    scales = reader.value(sc_t) if sc_t is not None else None
    sizes = reader.value(sz_t) if sz_t is not None else None
    if scales is not None and scales.size == 0:
        scales = None
    if (scales is None and sc_t is not None and reader.value(sc_t) is None) or (
        sizes is None and sz_t is not None
    ):
        return None
    axes = node.attrs.get("axes")
    full_scales = full_sizes = None
    if scales is not None:
        full_scales = [1.0] * r
        for k, a in enumerate(ir.norm_axes(axes, r) if axes else range(r)):
            full_scales[a] = float(scales.reshape(-1)[k])
    if sizes is not None:
        full_sizes = [ir.static_dim(x, a) for a in range(r)]
        for k, a in enumerate(ir.norm_axes(axes, r) if axes else range(r)):
            full_sizes[a] = int(sizes.reshape(-1)[k])
    if full_scales is None and full_sizes is None:
        return None
    return full_scales, full_sizes


@register("Resize")
@register("Upsample", until=9)
class Resize(Handler):
    evaluate_with_ort = True

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        f = resize_factors(node, ctx, node.inputs[0])
        if f is None or (f[0] is not None and f[0][:2] != [1.0, 1.0]):
            return None
        mode = node.attrs.get("mode", "nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        ctm = node.attrs.get("coordinate_transformation_mode", "half_pixel")
        ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
        return channelwise_constants(
            ctx, node, invariant=mode in ("nearest", "linear") and ctm != "tf_crop_and_resize"
        )

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        f = resize_factors(node, ks, x)
        if f is None:
            ks.barrier(node)
            return
        scales, sizes = f
        touched = set()
        for a in range(ir.rank(x) or 0):
            if scales is not None and scales[a] != 1.0:
                touched.add(a)
            if sizes is not None and sizes[a] != ir.static_dim(x, a):
                touched.add(a)
        _per_axis(node, ks, x, y, touched, Reason("structure", node.name, node.op, "resized axis"))

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        sz_t = ir.present(node, 3) if node.op == "Resize" and rw.opset > 10 else None
        sizes = rw.value(sz_t) if sz_t is not None else None
        if sizes is None:
            return
        y = node.outputs[0]
        r = ir.rank(y)
        if r is None:
            return
        axes = node.attrs.get("axes")
        new = [int(s) for s in sizes.reshape(-1)]
        for k, a in enumerate(ir.norm_axes(axes, r) if axes else range(r)):
            n = rw.kept_count(y, a)
            if n is not None:
                new[k] = n
        if new != [int(s) for s in sizes.reshape(-1)]:
            rw.replace_input(node, 3, np.asarray(new, dtype=np.int64))


# ------------------------------------------------------------------ Tile
@register("Tile")
class Tile(Handler):
    def form_since(self, op: str) -> int:
        return 6  # the repeats as an input

    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        c, reps = ctx.const(node.inputs[0]), ctx.value(node.inputs[1])
        if c is not None and reps is None and c.mask.all() and (c.value == c.value.flat[0]).all():
            # one value everywhere (a zero state Tiled to a batch the graph reads at run time):
            # so is every tiling of it, whatever the repeats
            one = (1,) * max(c.mask.ndim, c.value.ndim)
            return [compress(np.ones(one, bool), c.value.reshape(-1)[:1].reshape(one))]
        if c is None or reps is None:
            return None
        m, v = np.broadcast_arrays(c.mask, c.value)
        tiles = [int(k) if m.shape[a] > 1 else 1 for a, k in enumerate(reps.reshape(-1))]
        return [compress(np.tile(m, tiles), np.tile(v, tiles))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        reps = ks.value(node.inputs[1])
        if reps is None or ir.rank(x) is None:
            ks.barrier(node)
            return
        touched = {a for a, k in enumerate(reps.reshape(-1)) if int(k) != 1}
        _per_axis(node, ks, x, y, touched, Reason("structure", node.name, node.op, "tiled axis"))


# ------------------------------------------------------------------ oracle cases
def _spatial_case(op: str, rng: np.random.Generator) -> OracleCase:
    """Pad, Resize, Upsample, Tile of an input [1, c, h, w]."""
    c, h, w = layout_dims(rng)
    x = [1, c, h, w]
    ins = [("x", "float", x)]
    if op == "Pad":
        ins.append(("P", "int64", [8]))
        cb, ce = (int(k) for k in rng.integers(0, 3, 2))  # channels padded with zeros too
        y = [1, c + cb + ce, h + 2, w + 1]
        return OracleCase(op, sig(ins, [("y", y)]) + " { y = Pad (x, P) }", 17, values={"P": [0, cb, 1, 0, 0, ce, 1, 1]},
                          needs=needs(rng, "y", y))
    if op == "Tile":
        ins.append(("R", "int64", [4]))
        y = [1, c, 2 * h, w]
        return OracleCase(op, sig(ins, [("y", y)]) + " { y = Tile (x, R) }", 17, values={"R": [1, 1, 2, 1]}, needs=needs(rng, "y", y))
    y = [1, c, 2 * h, 2 * w]
    if op == "Upsample":
        ins.append(("S", "float", [4]))
        return OracleCase(op, sig(ins, [("y", y)]) + " { y = Upsample (x, S) }", 9, values={"S": [1, 1, 2, 2]},
                          needs=needs(rng, "y", y))
    ins += [("R", "float", [0]), ("S", "float", [4])]
    return OracleCase(op, sig(ins, [("y", y)]) + " { y = Resize (x, R, S) }", 17, values={"R": [], "S": [1, 1, 2, 2]},
                      needs=needs(rng, "y", y))


declare_cases(dict.fromkeys(("Pad", "Resize", "Upsample", "Tile"), _spatial_case))
