"""Reductions: the reduced axes combine every index; the others pass through.

An index that is exactly zero in the input adds nothing to a sum: ReduceSum, ReduceSumSquare,
ReduceL1, ReduceL2 and ReduceLogSum do not need it, and ReduceMean does not either when it is
rewritten to keep its original divisor (its result times kept / original). The others (max,
min, product, log-sum-exp) read every index. A ReduceMean of (u - mean(u))², the variance of a
decomposed LayerNorm, does not need the indices where u is zero either: each adds mean², and the
rewrite adds them back (`centered_square`). A mean of squares that feeds a decomposed RMSNorm
has its factor moved into that norm's epsilon and scale instead (`ops.norm.rescale_rms`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Handler,
    Item,
    KeepView,
    Reader,
    Reason,
    RewriteView,
    ShapeView,
    SymValue,
    compress,
    max_item,
    opaque,
    opaque_value,
    product_item,
    register,
    shape_operands,
)
from onnxshrink.ops.common import dtype_of, ints
from onnxshrink.ops.norm import rescale_rms, rms_chain
from onnxshrink.ops.oracle import OracleCase, declare_cases, needs, sig


def centered_square(node: gs.Node, reader: Reader) -> tuple[gs.Tensor, gs.Tensor] | None:
    """When `node` (a ReduceMean) reduces (u - m)², with m = ReduceMean(u) over the same axes
    (keepdims): (u, m). The square is Pow(c, 2) or Mul(c, c), c = Sub(u, m)."""
    sq = node.inputs[0]
    p = ir.producer(sq)
    if p is None or len(p.inputs) < 2:
        return None
    if p.op == "Pow":
        e = reader.value(p.inputs[1])
        if e is None or np.size(e) != 1 or float(np.asarray(e).reshape(-1)[0]) != 2.0:
            return None
    elif p.op != "Mul" or p.inputs[0] is not p.inputs[1]:
        return None
    c = p.inputs[0]
    sub = ir.producer(c)
    if sub is None or sub.op != "Sub" or len(sub.inputs) != 2:
        return None
    u, m = sub.inputs
    mean = ir.producer(m)
    r = ir.rank(u)
    if (
        mean is None
        or mean.op != "ReduceMean"
        or mean.inputs[0] is not u
        or not int(mean.attrs.get("keepdims", 1))
        or r is None
        or ir.rank(sq) != r
    ):
        return None
    axes, mean_axes = reduced_axes(node, reader, r), reduced_axes(mean, reader, r)
    if axes is None or axes != mean_axes:
        return None
    return u, m

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
_ZERO_SAFE = ("ReduceSum", "ReduceSumSquare", "ReduceL1", "ReduceL2")  # zeros in -> 0 out, any length
# a zero index adds nothing to the sum they are made of
_SUMS = ("ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum")
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
        (the product of one size is that size), a product or maximum of sizes is one
        (`product_item`, `max_item`), other reductions of several symbolic ones are opaque."""
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
        elif node.op == "ReduceProd":
            item = product_item(a.items)
        elif node.op == "ReduceMax":
            item = reduce(max_item, a.items)
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
        # mask and value may be stored at different broadcast shapes (a mask per channel over
        # a value uniform across them): reduce over their common shape
        shape = list(np.broadcast_shapes(c.mask.shape, c.value.shape))
        for a in axes:
            n = ir.static_dim(x, a)
            if n is None:
                if shape[a] != 1 or node.op not in _UNIFORM_SAFE + _ZERO_SAFE:
                    return None
                if node.op in _ZERO_SAFE:  # over a run-time length, only zeros are known: 0
                    c = ConstInfo(c.mask & (c.value == 0), c.value)
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
                n = ks.size(x, a)
                if node.op in _SUMS and n is not None:
                    ks.keep(x, a, ~self.unneeded(node, ks, a, n), why)
                    if node.op == "ReduceMean" and (
                        self.variance(node, ks) is not None or rms_chain(y, ks) is not None
                    ):
                        ks.normalizes(x, a)  # the statistics of a decomposed LayerNorm/RMSNorm
                else:
                    ks.pin(x, a, why)
                if keepdims:
                    ks.pin(y, a)
                    j += 1
            else:
                ks.couple(x, a, y, j)
                j += 1

    def unneeded(self, node: gs.Node, reader: KeepView, axis: int, n: int) -> np.ndarray:
        """Indices of the reduced `axis` the result does not need: zero in the input, or, for
        the variance of a decomposed LayerNorm, zero in the centered tensor's source."""
        c = reader.const(node.inputs[0])
        zero = c.slice_zero(axis, n) if c is not None else np.zeros(n, bool)
        var = self.variance(node, reader)
        if var is not None:
            cu = reader.const(var[0])
            if cu is not None:
                zero = zero | cu.slice_zero(axis, n)
        return zero

    def variance(self, node: gs.Node, reader: KeepView | RewriteView) -> tuple[gs.Tensor, gs.Tensor] | None:
        """`centered_square`, as the graph was analysed (the rewrite inserts nodes after means)."""
        if node.op != "ReduceMean":
            return None
        return reader.memo(("variance", id(node)), lambda: centered_square(node, reader))

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        """Zero indices removed: a mean keeps its divisor (times kept / original); the variance
        of a decomposed LayerNorm adds mean² for each removed index."""
        x = node.inputs[0]
        r = ir.rank(x)
        axes = reduced_axes(node, rw, r) if r is not None else None
        if node.op not in _SUMS or axes is None:
            return
        kept_n, total = 1, 1
        for a in axes:
            k = rw.kept(x, a)
            if k is not None and not k.all():
                kept_n, total = kept_n * int(k.sum()), total * len(k)
                if self.variance(node, rw) is None:
                    rw.check_removed_constant(node, rw.const(x), a, ~k)
        if kept_n == total or node.op != "ReduceMean":
            return
        removed = sum(int((~k).sum()) for a in axes if (k := rw.kept(x, a)) is not None)
        dtype = dtype_of(node.outputs[0])
        var = self.variance(node, rw)
        if var is None:
            if rescale_rms(rw, node.outputs[0], kept_n / total):
                rw.record_fold(node, removed, "normalization with epsilon and scale rescaled")
                return
            share = rw.constant(np.asarray(kept_n / total, dtype), "kept_share")
            rw.insert_after(node, 0, "Mul", [share], "original_divisor")
            rw.record_fold(node, removed, "mean with its original divisor")
            return
        kept_share = rw.constant(np.asarray(kept_n / total, dtype), "kept_share")
        # (sum over kept of (u - mean)² + removed x mean²) / total
        y = node.outputs[0]
        rw.insert_after(node, 0, "Mul", [kept_share], "original_divisor")
        mean = var[1]
        square = rw.add_node("Mul", [mean, mean], "mean_squared", dtype=dtype)
        removed_share = rw.constant(np.asarray(1 - kept_n / total, dtype), "removed_share")
        removed_squares = rw.add_node("Mul", [square, removed_share], "removed_squares", dtype=dtype)
        rw.add_to_output(y.inputs[0], 0, removed_squares)
        rw.record_fold(node, removed, "variance with its original divisor")


# ------------------------------------------------------------------ oracle cases
def _reduce_case(op: str, rng: np.random.Generator) -> OracleCase:
    x = [1, int(rng.integers(2, 5)), 3, 2]
    axes = sorted(rng.choice(4, size=int(rng.integers(1, 3)), replace=False).tolist())
    keep = int(rng.integers(0, 2))
    y = [1 if a in axes else d for a, d in enumerate(x)] if keep else [d for a, d in enumerate(x) if a not in axes]
    opset = 18 if rng.random() < 0.5 else 11
    if opset >= 18 or op == "ReduceSum" and opset >= 13:
        text = sig([("x", "float", x), ("A", "int64", [len(axes)])], [("y", y)])
        return OracleCase(op, text + f" {{ y = {op} <keepdims = {keep}> (x, A) }}", opset, values={"A": axes},
                          needs=needs(rng, "y", y))
    text = sig([("x", "float", x)], [("y", y)])
    return OracleCase(op, text + f" {{ y = {op} <axes = [{', '.join(map(str, axes))}], keepdims = {keep}> (x) }}",
                      opset, needs=needs(rng, "y", y))


declare_cases(dict.fromkeys(REDUCE, _reduce_case))
