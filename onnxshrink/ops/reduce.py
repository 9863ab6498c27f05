"""Reductions: the reduced axes combine every index and keep them all; the others pass through."""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze.constants import ConstInfo, compress
from onnxshrink.analyze.keep import Reason
from onnxshrink.analyze.shapes import Item, SymValue, opaque, opaque_value, shape_operands
from onnxshrink.ops.common import ints
from onnxshrink.ops.contract import ConstView, Handler, KeepView, Reader, ShapeView
from onnxshrink.ops.registry import register

REDUCE = (
    "ReduceMean",
    "ReduceSum",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
)
_UNIFORM_SAFE = ("ReduceMean", "ReduceMax", "ReduceMin")  # uniform in -> same value out
# Reductions of a shape value to one size: tf2onnx computes the merged size of a reshape as
# ReduceProd(Gather(Shape(x), axes)) (its Einsum and MatMul lowerings).
_SHAPE_REDUCE: dict[str, Callable[[int, int], int]] = {
    "ReduceProd": lambda p, q: p * q,
    "ReduceSum": lambda p, q: p + q,
    "ReduceMax": max,
    "ReduceMin": min,
}


def reduced_axes(node: gs.Node, reader: Reader, r: int) -> list[int] | None:
    """Axes reduced over; None when they are not known statically."""
    if (
        "axes" not in node.attrs
        and ir.present(node, 1) is not None
        and reader.value(node.inputs[1]) is None
    ):
        return None
    axes = ints(node, reader, "axes", 1)
    if not axes:
        if int(node.attrs.get("noop_with_empty_axes", 0)):
            return []
        return list(range(r))
    return ir.norm_axes(axes, r)


def _vector_axes(node: gs.Node, view: ShapeView) -> list[int] | None:
    """Axes a reduction of a 1-d shape vector reduces ([] or [0]); None when not known."""
    if "axes" in node.attrs:
        axes = [int(v) for v in node.attrs["axes"]]
    elif ir.present(node, 1) is not None:
        v = view.value(node.inputs[1])
        if v is None:
            return None
        axes = [int(a) for a in np.asarray(v).reshape(-1)]
    else:
        axes = []
    if not axes:
        return [] if int(node.attrs.get("noop_with_empty_axes", 0)) else [0]
    return ir.norm_axes(axes, 1)


@register(*REDUCE)
class Reduce(Handler):
    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        """A shape vector reduced to one item: literal sizes are computed, a single item is itself
        (the product of one size is that size), several symbolic ones are opaque."""
        vals = shape_operands(node, view, [0])
        if vals is None:
            return None
        a = vals[0]
        axes = _vector_axes(node, view)
        if node.op not in _SHAPE_REDUCE or axes is None:
            return opaque_value(node, view)
        keepdims = bool(int(node.attrs.get("keepdims", 1)))
        if a.scalar or not axes:  # nothing reduced
            return a
        item: Item
        if not a.items:
            return opaque_value(node, view)
        lits = a.ints()
        if lits is not None:
            item = reduce(_SHAPE_REDUCE[node.op], lits)
        elif len(a.items) == 1:
            item = a.items[0]
        else:
            item = opaque(a)
        return SymValue((item,), scalar=not keepdims)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x = node.inputs[0]
        c, r = ctx.const(x), ir.rank(x)
        if c is None or r is None:
            return None
        axes = reduced_axes(node, ctx, r)
        if axes is None:
            return None
        keepdims = bool(int(node.attrs.get("keepdims", 1)))
        shape = list(c.value.shape)
        for a in axes:
            n = ir.static_dim(x, a)
            if n is None:
                if node.op not in _UNIFORM_SAFE or c.value.shape[a] != 1 or c.mask.shape[a] != 1:
                    return None
            else:
                shape[a] = n
        mask = np.asarray(
            np.broadcast_to(c.mask, np.broadcast_shapes(c.mask.shape, tuple(shape))).all(
                axis=tuple(axes), keepdims=keepdims
            )
        )
        if not mask.any():
            return None
        xin = np.broadcast_to(c.value, np.broadcast_shapes(c.value.shape, tuple(shape)))
        xin = np.where(np.broadcast_to(c.mask, xin.shape), xin, np.zeros((), xin.dtype))
        ins = [xin, *[ctx.value(t) if t is not None else None for t in node.inputs[1:]]]
        out = ctx.evaluate(node, ins)[0]
        mask, out = np.broadcast_arrays(mask, out)
        return [compress(np.array(mask), np.array(out))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        axes = reduced_axes(node, ks, r) if r is not None else None
        if r is None or axes is None:
            ks.barrier(node)
            return
        ks.demand(x, pin=False)
        for t in node.inputs[1:]:
            ks.demand(t)
        keepdims = bool(int(node.attrs.get("keepdims", 1)))
        why = Reason(
            "structure",
            node.name,
            node.op,
            "a reduction combines every index of the axes it reduces",
        )
        j = 0
        for a in range(r):
            if a in axes:
                ks.pin(x, a, why)
                if keepdims:
                    ks.pin(y, a)
                    j += 1
            else:
                ks.couple(x, a, y, j)
                j += 1
