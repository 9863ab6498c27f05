"""Helpers shared by op handlers: reading parameters across opsets, broadcasting, index maps."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import ConstInfo, KeepView, Reader, Reason, compress, expand_to


def ints(
    node: gs.Node, reader: Reader, attr: str, index: int
) -> list[int] | None:
    """An int-list parameter that older opsets give as attribute `attr` and newer as input `index`
    (its value read through any of the views)."""
    if attr in node.attrs and node.attrs[attr] is not None:
        v = node.attrs[attr]
        return [int(x) for x in np.asarray(v).reshape(-1)]
    t = ir.present(node, index)
    if t is None:
        return None
    v = reader.value(t)
    return None if v is None else ir.int_list(v)


def align(r_out: int, r_in: int) -> int:
    """Offset of an input axis in a numpy-broadcast output (inputs are right-aligned)."""
    return r_out - r_in


def couple_broadcast(
    ks: KeepView, node: gs.Node, out: gs.Tensor, t: gs.Tensor, combine: bool = False
) -> None:
    """Tie the axes of input `t` to the output axes they broadcast to. `combine`: `node` mixes
    its operands elementwise (a constant index meeting a live one is explained as such)."""
    r_out, r_in = ir.rank(out), ir.rank(t)
    if r_out is None or r_in is None or r_in > r_out:
        ks.pin(t)
        ks.pin(out)
        return
    off = align(r_out, r_in)
    for j in range(r_in):
        si, so = ks.size(t, j), ks.size(out, j + off)
        if si == 1 and so != 1:
            ks.pin(t, j)  # broadcast: one index stands for all
        else:
            ks.couple(t, j, out, j + off, meet=node if combine else None)


def couple_same(ks: KeepView, node: gs.Node, a: gs.Tensor, b: gs.Tensor) -> None:
    ra, rb = ir.rank(a), ir.rank(b)
    if ra is None or ra != rb:
        ks.pin(a)
        ks.pin(b)
        return
    for i in range(ra):
        ks.couple(a, i, b, i)


def pin_normalized(ks: KeepView, node: gs.Node, axes: list[int]) -> None:
    """Output 0 is input 0 normalized over `axes`: those axes mix, so each keeps every index in
    both; the other axes pass straight through (coupled)."""
    x, y = node.inputs[0], node.outputs[0]
    ks.demand(x, pin=False)
    why = Reason("normalization", node.name, node.op)
    for a in axes:
        ks.pin(x, a, why)
        ks.pin(y, a, why)
    couple_same(ks, node, x, y)


def const_or_live(ctx, t: gs.Tensor, r: int) -> tuple[np.ndarray, np.ndarray]:
    """(mask, value) of `t` aligned to rank r; a live tensor gives mask False and value 0."""
    c = ctx.const(t)
    dtype = dtype_of(t)
    if c is None:
        return np.zeros((1,) * r, bool), np.zeros((1,) * r, dtype)
    m, v = c.mask, c.value
    m = m.reshape((1,) * (r - m.ndim) + m.shape)
    v = v.reshape((1,) * (r - v.ndim) + v.shape)
    return m, v


def dtype_of(t: gs.Tensor) -> np.dtype:
    try:
        return np.dtype(t.dtype) if t.dtype is not None else np.dtype(np.float32)
    except TypeError:
        return np.dtype(np.float32)


def channel_expand(ctx, t: gs.Tensor) -> np.ndarray | None:
    """The constant values of `t` at full static shape (batch 1), live elements set to 0."""
    from onnxshrink.core import static_batch1

    c = ctx.const(t)
    shape = static_batch1(t)
    if c is None or shape is None:
        return None
    m = expand_to(c.mask, shape)
    v = expand_to(c.value, shape)
    if m is None or v is None:
        return None
    return np.where(m, v, np.zeros((), v.dtype)).astype(v.dtype)


def channelwise_constants(
    ctx, node: gs.Node, invariant: bool, channel_axis: int = 1
) -> list[ConstInfo | None] | None:
    """Constants of an op that maps each channel on its own (pooling, Resize, InstanceNorm...).

    An output channel is constant when its input channel is. Its value is computed at full
    static shape; with dynamic spatial dims only when `invariant` (a uniform input gives the
    same uniform output, e.g. MaxPool, global pooling) and the channel is uniform."""
    x, y = node.inputs[0], node.outputs[0]
    c = ctx.const(x)
    n = ir.static_dim(x, channel_axis)
    r = ir.rank(y)
    if c is None or n is None or r is None:
        return None
    chan = c.slice_constant(channel_axis, n)
    if not chan.any():
        return None
    full = channel_expand(ctx, x)
    if full is not None:
        others = [
            ctx.value(t) if t is not None and i > 0 else None for i, t in enumerate(node.inputs)
        ]
        out = ctx.evaluate(node, [full, *others[1:]])[0]
        mask = np.broadcast_to(along(chan, channel_axis, r), out.shape)
        return [compress(mask, out)]
    if invariant:
        uni = c.slice_uniform(channel_axis, n)
        if not uni.any():
            return None
        per = np.moveaxis(
            np.broadcast_to(
                c.value, c.mask.shape[:channel_axis] + (n,) + c.mask.shape[channel_axis + 1 :]
            ),
            channel_axis,
            0,
        )
        vals = per.reshape(n, -1)[:, 0]
        return [ConstInfo(along(uni, channel_axis, r), along(vals, channel_axis, r))]
    return None


def along(vec: np.ndarray, axis: int, r: int) -> np.ndarray:
    """A 1-D array laid along `axis` of a rank-r broadcastable array."""
    shape = [1] * r
    shape[axis] = len(vec)
    return np.asarray(vec).reshape(shape)
