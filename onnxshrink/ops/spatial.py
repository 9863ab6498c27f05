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
)
from onnxshrink.ops.common import channelwise_constants, ints
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


@register("Pad")
class Pad(Handler):
    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x = node.inputs[0]
        c, r = ctx.const(x), ir.rank(x)
        amounts = pad_amounts(node, ctx, r) if r is not None else None
        if c is None or amounts is None:
            return None
        m, v = np.broadcast_arrays(c.mask, c.value)
        for a, (b, e) in amounts.items():
            if b or e:
                n = ir.static_dim(x, a)
                if n is None:
                    return None
                shape = list(m.shape)
                shape[a] = n
                m, v = np.broadcast_to(m, shape), np.broadcast_to(v, shape)
        mode = node.attrs.get("mode", "constant")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        rest = [ctx.value(t) if t is not None and t.name else None for t in node.inputs[1:]]
        out_v = ctx.evaluate(node, [np.ascontiguousarray(v), *rest])[0]
        out_m = _pad_mask(node, ctx, np.ascontiguousarray(m.astype(v.dtype)), rest, mode)
        return [compress(out_m, out_v)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        amounts = pad_amounts(node, ks, r) if r is not None else None
        if amounts is None:
            ks.barrier(node)
            return
        touched = {a for a, (b, e) in amounts.items() if b or e}
        _per_axis(node, ks, x, y, touched, Reason("structure", node.name, node.op, "padded axis"))


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
        y = [1, c, h + 2, w + 1]
        return OracleCase(op, sig(ins, [("y", y)]) + " { y = Pad (x, P) }", 17, values={"P": [0, 0, 1, 0, 0, 0, 1, 1]},
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
