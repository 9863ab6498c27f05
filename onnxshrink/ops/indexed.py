"""CumSum, GatherND, ScatterElements: ops driven by an axis or by indices, whose other axes pass
their indices through.

- CumSum sums along one axis (a constant input): every other axis is elementwise, so a channel
  passes through when the sum runs along another axis (an LLM's position ids: a cumsum of the
  attention mask along the sequence); the summed axis keeps every index.
- GatherND(data, indices, batch_dims=b) looks up data's axes b .. b+k-1 (k: the indices' last
  dim) at run-time positions: those keep every index; the batch axes and data's trailing axes
  pass through to the output (the indices' leading axes come first), so the features of a
  graph network's node table go as channels.
- ScatterElements(data, indices, updates, axis) writes updates into data along `axis` at
  run-time positions: that axis keeps every index; along the others, index i of updates (and of
  indices) is index i of data and of the output, as updates may be shorter there.

What cannot be derived from the graph (an axis computed at run time, ranks shape inference did
not give, the indices' last dim unknown) keeps everything the op touches, and says why.
"""

from __future__ import annotations

from collections.abc import Mapping

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
    compress,
    int_attr,
    register,
    str_attr,
)
from onnxshrink.ops.oracle import OracleCase, declare_cases, needs, sig


# ------------------------------------------------------------------ CumSum
def cumsum_axis(node: gs.Node, reader: Reader, r: int) -> int | None:
    """The summed axis (a constant input); None when it is computed at run time."""
    t = ir.present(node, 1)
    v = reader.value(t) if t is not None else None
    if v is None or v.size != 1:
        return None
    a = int(v.reshape(-1)[0])
    return ir.norm_axis(a, r) if -r <= a < r else None


def _prefix_constant(m: np.ndarray, axis: int, reverse: bool, exclusive: bool) -> np.ndarray:
    """Where a running sum along `axis` of elements constant where `m` is, is constant: every
    element it adds is (an exclusive sum's first is the empty sum)."""
    mm = np.flip(m, axis) if reverse else m
    acc = np.logical_and.accumulate(mm, axis=axis)
    if exclusive:
        first = np.ones_like(np.take(acc, [0], axis=axis))
        acc = np.concatenate([first, np.take(acc, np.arange(acc.shape[axis] - 1), axis=axis)], axis=axis)
    return np.flip(acc, axis) if reverse else acc


@register("CumSum")
class CumSum(Handler):
    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x = node.inputs[0]
        c, r = ctx.const(x), ir.rank(x)
        axis = cumsum_axis(node, ctx, r) if r is not None else None
        if c is None or r is None or axis is None:
            return None
        m, v = np.broadcast_arrays(c.mask, c.value)
        n = ir.static_dim(x, axis)
        if n is None:  # a run-time length: only a sum of zeros is known (it is zero)
            zero = m & (v == 0) if m.shape[axis] == 1 else None
            if zero is None or not zero.any():
                return None
            return [compress(zero, np.zeros_like(v))]
        shape = list(m.shape)
        shape[axis] = n
        m, v = np.broadcast_to(m, shape), np.broadcast_to(v, shape)
        mask = _prefix_constant(
            m, axis, bool(int_attr(node, "reverse", 0)), bool(int_attr(node, "exclusive", 0))
        )
        if not mask.any():
            return None
        xin = np.where(m, v, np.zeros((), v.dtype)).astype(v.dtype)
        out = ctx.evaluate(node, [xin, ctx.value(node.inputs[1])])[0]
        return [compress(mask, out)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        axis = cumsum_axis(node, ks, r) if r is not None else None
        if r is None or axis is None or ir.rank(y) != r:
            why = "its axis is computed at run time" if r is not None else "its input's rank is unknown"
            ks.barrier(node, Reason("barrier", node.name, node.op, why))
            return
        ks.demand(x, pin=False)
        ks.demand(node.inputs[1])
        summed = Reason("structure", node.name, node.op, "the axis it sums along")
        for a in range(r):
            if a == axis:
                ks.pin(x, a, summed)
                ks.pin(y, a, summed)
            else:
                ks.couple(x, a, y, a)


# ------------------------------------------------------------------ GatherND
def _gather_nd_layout(node: gs.Node) -> tuple[int, int, int, int] | None:
    """(data rank, indices rank, batch_dims, k: data axes each index tuple addresses)."""
    data, indices = node.inputs[0], node.inputs[1]
    r, q = ir.rank(data), ir.rank(indices)
    if r is None or q is None or q < 1:
        return None
    k = ir.static_dim(indices, q - 1)
    b = int_attr(node, "batch_dims", 0)
    if k is None or b + k > r or b > q - 1:
        return None
    return r, q, b, k


@register("GatherND")
class GatherND(Handler):
    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """An output element is constant where its trailing slice of data is constant and the
        same at every position the indices may address."""
        c, lay = ctx.const(node.inputs[0]), _gather_nd_layout(node)
        if c is None or lay is None:
            return None
        r, q, b, k = lay
        m, v = np.broadcast_arrays(c.mask, c.value)
        lead = tuple(range(b + k))
        first = v[tuple(slice(0, 1) for _ in lead)]
        same = np.asarray((m & (v == first)).all(axis=lead))
        if not same.any():
            return None
        shape = (1,) * (q - 1) + same.shape
        return [compress(same.reshape(shape), first.reshape(shape))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        data, indices, y = node.inputs[0], node.inputs[1], node.outputs[0]
        lay = _gather_nd_layout(node)
        if lay is None or ir.rank(y) != lay[1] - 1 + lay[0] - lay[2] - lay[3]:
            why = "shape inference gave no ranks or no static index length"
            ks.barrier(node, Reason("barrier", node.name, node.op, why))
            return
        r, q, b, k = lay
        ks.demand(data, pin=False)
        ks.demand(indices, pin=False)
        looked_up = Reason("structure", node.name, node.op, "its positions are looked up by run-time indices")
        for a in range(b):
            ks.couple(data, a, y, a)
        for a in range(q - 1):
            ks.couple(indices, a, y, a)
        ks.pin(indices, q - 1, looked_up)
        for a in range(b, b + k):
            ks.pin(data, a, looked_up)
        for a in range(b + k, r):
            ks.couple(data, a, y, q - 1 + a - b - k)


# ------------------------------------------------------------------ ScatterElements
@register("ScatterElements")
class ScatterElements(Handler):
    def index_inputs(self, node: OpNode) -> Mapping[int, tuple[int, int]]:
        return {1: (0, int_attr(node, "axis", 0))}

    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0, 2) if str_attr(node, "reduction", "none") == "none" else ()

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """A slice across the written axis is constant where data's is, the same all along the
        axis, and whatever is written there leaves it so (updates of the same value; adding 0,
        multiplying by 1; not above a max, not below a min): where it lands is decided at run
        time."""
        data, updates = node.inputs[0], node.inputs[2]
        cd, r = ctx.const(data), ir.rank(data)
        if cd is None or r is None:
            return None
        axis = ir.norm_axis(int_attr(node, "axis", 0), r)
        dims = [ir.static_dim(data, a) for a in range(r)]
        udims = [ir.static_dim(updates, a) for a in range(r)]
        if any(dims[a] is None or udims[a] is None for a in range(r) if a != axis):
            return None
        full = tuple(1 if a == axis else int(dims[a] or 0) for a in range(r))
        d_uni, d_first = _uniform_along(cd, axis, full)
        ok = d_uni.copy()
        cu = ctx.const(updates)
        written = tuple(slice(None) if a == axis else slice(0, udims[a]) for a in range(r))
        if cu is None:
            ok[written] = False
        else:
            u_uni, u_first = _uniform_along(cu, axis, tuple(1 if a == axis else int(udims[a] or 0) for a in range(r)))
            ok[written] &= u_uni & _leaves(str_attr(node, "reduction", "none"), d_first[written], u_first)
        if not ok.any():
            return None
        return [compress(ok, np.where(ok, d_first, np.zeros((), d_first.dtype)))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        data, indices, updates, y = node.inputs[0], node.inputs[1], node.inputs[2], node.outputs[0]
        r = ir.rank(data)
        if r is None or any(ir.rank(t) != r for t in (indices, updates, y)):
            ks.barrier(node, Reason("barrier", node.name, node.op, "shape inference gave no ranks"))
            return
        axis = ir.norm_axis(int_attr(node, "axis", 0), r)
        for t in (data, indices, updates):
            ks.demand(t, pin=False)
        written = Reason("structure", node.name, node.op, "it writes along it at run-time positions")
        for t in (data, indices, updates, y):
            ks.pin(t, axis, written)
        for a in range(r):
            if a == axis:
                continue
            ks.couple(data, a, y, a)
            ks.couple(indices, a, updates, a)
            nd, nu = ks.size(data, a), ks.size(updates, a)
            if nd is not None and nd == nu:
                ks.couple(updates, a, y, a)
            elif nd is not None and nu is not None and nu < nd:
                ks.couple_map(updates, a, y, a, np.arange(nu))  # the first nu indices
            else:
                ks.pin(updates, a, written)
                ks.pin(y, a, written)


def _uniform_along(c: ConstInfo, axis: int, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(where the slice across `axis` is constant and the same all along it, its value), at
    `shape` (1 on `axis`)."""
    m, v = np.broadcast_arrays(c.mask, c.value)
    first = np.take(v, [0], axis=axis)
    same = (m & (v == first)).all(axis=axis, keepdims=True)
    return np.broadcast_to(same, shape).copy(), np.broadcast_to(first, shape)


def _leaves(reduction: str, d: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Where writing u into d with `reduction` gives d back, whatever the positions."""
    if reduction == "add":
        return np.asarray(u == 0)
    if reduction == "mul":
        return np.asarray((u == 1) | ((d == 0) & np.isfinite(u)))
    if reduction == "max":
        return np.asarray(u <= d)
    if reduction == "min":
        return np.asarray(u >= d)
    return np.asarray(u == d)


# ------------------------------------------------------------------ oracle cases
def _indexed_case(op: str, rng: np.random.Generator) -> OracleCase:
    """CumSum of [1, c, h, w] along a random axis; GatherND of a node table [n, c] by index
    tuples; ScatterElements of updates [m, c'] into [n, c] along the rows."""
    c, n = int(rng.integers(2, 6)), int(rng.integers(3, 6))
    if op == "CumSum":
        x = [1, c, 3, 4]
        ax = int(rng.integers(1, 4))
        attrs = f"<exclusive = {int(rng.integers(0, 2))}, reverse = {int(rng.integers(0, 2))}>"
        text = sig([("x", "float", x), ("A", "int64", [])], [("y", x)]) + f" {{ y = CumSum {attrs} (x, A) }}"
        return OracleCase(op, text, 17, values={"A": ax}, needs=needs(rng, "y", x))
    m = int(rng.integers(1, n + 1))
    if op == "GatherND":
        y = [m, c]
        text = sig([("x", "float", [n, c]), ("I", "int64", [m, 1])], [("y", y)]) + " { y = GatherND (x, I) }"
        idx = rng.integers(0, n, (m, 1)).tolist()
        return OracleCase(op, text, 17, values={"I": idx}, needs=needs(rng, "y", y))
    cu = int(rng.integers(1, c + 1))
    idx = np.stack([rng.permutation(n)[:m] for _ in range(cu)], axis=1).tolist()
    ins = [("x", "float", [n, c]), ("I", "int64", [m, cu]), ("u", "float", [m, cu])]
    text = sig(ins, [("y", [n, c])]) + " { y = ScatterElements <axis = 0> (x, I, u) }"
    return OracleCase(op, text, 17, values={"I": idx}, needs=needs(rng, "y", [n, c]))


declare_cases(dict.fromkeys(("CumSum", "GatherND", "ScatterElements"), _indexed_case))
