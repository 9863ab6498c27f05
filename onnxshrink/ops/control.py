"""Control flow: If, Loop and Scan. Their bodies are analyzed in place, as part of the graph.

The nodes of a body are nodes like any other (the analysis walks every scope, each body just
before the node that holds it); a body reads outer tensors by name, so a weight read inside a
body is demanded, kept and sliced by what the body's nodes need, once, wherever it is read. What
these handlers add is how a body's inputs and outputs stand for the node's own:

- If: output j is then-branch output j or else-branch output j, so their axes are tied. It is
  constant where both branches are constant with the same values (only the taken branch counts
  when the condition is a constant). An output nothing reads is dropped from the node and both
  branches.
- Loop: a loop-carried value is one tensor seen four times (initial value, body input, body
  output, final value): their axes are tied, so the closure keeps in all four what any
  iteration needs (a fixpoint, as sets only grow). A scan output is the body output stacked
  along a new axis 0. Body inputs are live (what an iteration reads differs from step to step);
  a loop-carried value is constant only where its initial value and the body's output are the
  same constant (the body's is then computed from outer constants alone). A scan output nothing
  reads is dropped from the node and the body.
- Scan (opset 9+): states as Loop's carried values; a scan input is its body input stacked
  along its scan axis (constant elements the same in every slice are constant in the body), a
  scan output its body output stacked along its scan axis (dropped when nothing reads it).

Where the shapes do not tell how the axes correspond (an unknown rank, a body whose inputs and
outputs do not match the node's), the axes are kept whole, and the reason says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
    Reason,
    RewriteView,
    ShapeView,
    SymValue,
    compress,
    int_attr,
    ints_attr,
    opaque,
    register,
)
from onnxshrink.ops.oracle import declare_cases


def _why(node: gs.Node, detail: str) -> Reason:
    return Reason("structure", node.name, node.op, detail)


def tie_same(ks: KeepView, node: gs.Node, ts: Sequence[gs.Tensor]) -> None:
    """The tensors are one value seen in several places (a branch output and the If's output, a
    loop-carried value): every axis is tied across them; all kept whole when their ranks are
    unknown or differ."""
    ranks = {ir.rank(t) for t in ts}
    if len(ranks) != 1 or None in ranks:
        for t in ts:
            ks.pin(t, reason=_why(node, "the ranks of its body's inputs and outputs are unknown or differ"))
        return
    (r,) = ranks
    assert r is not None
    for a in range(r):
        for t in ts[1:]:
            ks.couple(ts[0], a, t, a)


def tie_stacked(ks: KeepView, node: gs.Node, inner: gs.Tensor, outer: gs.Tensor, axis: int) -> None:
    """`outer` is `inner` stacked along `axis` (one slice per iteration): the other axes are
    tied, the stacking axis is kept whole."""
    ri, ro = ir.rank(inner), ir.rank(outer)
    if ri is None or ro != ri + 1 or not 0 <= axis < ro:
        why = _why(node, "the ranks of its body's inputs and outputs are unknown or do not match")
        ks.pin(inner, reason=why)
        ks.pin(outer, reason=why)
        return
    ks.pin(outer, axis, _why(node, "its iterations"))
    for a in range(ri):
        ks.couple(inner, a, outer, a + (a >= axis))


def _same_static(a: gs.Tensor, b: gs.Tensor) -> bool:
    """The same rank and the same static sizes (dynamic where the other is dynamic)."""
    da, db = ir.dims(a), ir.dims(b)
    if da is None or db is None or len(da) != len(db):
        return False
    return all(
        (isinstance(x, int) and x >= 0) == (isinstance(y, int) and y >= 0) and (not isinstance(x, int) or x == y)
        for x, y in zip(da, db, strict=True)
    )


def agree(ctx: ConstView, y: gs.Tensor, sources: Sequence[gs.Tensor]) -> ConstInfo | None:
    """The constant elements of `y`, which is one of `sources` (a branch's output, a
    loop-carried value's initial or computed value): those constant in every source, with the
    same value."""
    cs = [ctx.const(t) for t in sources]
    if not cs or any(c is None for c in cs) or not all(_same_static(y, t) for t in sources):
        return None
    infos = [c for c in cs if c is not None]
    if len(infos) == 1:
        return ConstInfo(infos[0].mask, infos[0].value)
    shape = np.broadcast_shapes(*(c.mask.shape for c in infos), *(c.value.shape for c in infos))
    first = np.broadcast_to(infos[0].value, shape)
    mask = np.ones(shape, bool)
    for c in infos:
        v = np.broadcast_to(c.value, shape)
        mask &= np.broadcast_to(c.mask, shape) & (v == first)
    return compress(mask, np.where(mask, first, np.zeros((), first.dtype)))


def stacked_const(ctx: ConstView, y: gs.Tensor, inner: gs.Tensor, axis: int) -> ConstInfo | None:
    """Constant elements of `y`, `inner` stacked along `axis`: the same in every slice."""
    c = ctx.const(inner)
    di, dy = ir.dims(inner), ir.dims(y)
    if c is None or di is None or dy is None or len(dy) != len(di) + 1 or not 0 <= axis < len(dy):
        return None
    for arr in (c.mask, c.value):
        if any(arr.shape[a] > 1 and dy[a + (a >= axis)] != arr.shape[a] for a in range(len(di))):
            return None  # an axis the stacked tensor does not have at that static size
    return ConstInfo(np.expand_dims(c.mask, axis), np.expand_dims(c.value, axis))


def carried_dims(ts: Sequence[gs.Tensor]) -> Dims | None:
    """A loop-carried value's dims: those its initial value, its body input and its body output
    all have, static (the body keeps the shape it was given, so every iteration does; onnx's
    inference leaves a Loop's outputs without shapes)."""
    dims = [ir.dims(t) for t in ts]
    first = dims[0]
    if first is None or not all(ir.is_static(t) for t in ts) or any(d != first for d in dims):
        return None
    return list(first)


def fill_dims(y: gs.Tensor, new: Dims | None) -> Dims | None:
    """`y`'s dims with the unknown ones taken from `new` (same rank), or None."""
    old = ir.dims(y)
    if new is None:
        return None
    if old is None:
        return new
    if len(old) != len(new):
        return None
    return [o if isinstance(o, int) or n is None else n for o, n in zip(old, new, strict=True)]


def scan_length(node: OpNode, shapes: Mapping[str, list[int]]) -> int:
    """A Scan's sequence length: its first scanned input's size along its scan axis (1 unknown)."""
    n_scan = int_attr(node, "num_scan_inputs", 0)
    shape = shapes.get(node.inputs[len(node.inputs) - n_scan]) if n_scan else None
    if not shape:
        return 1
    axis = ints_attr(node, "scan_input_axes", [0])[0]
    return int(shape[axis % len(shape)])


@register("If")
class If(Handler):
    runs_one_body = True

    @staticmethod
    def branches(node: gs.Node) -> list[gs.Graph]:
        return [node.attrs["then_branch"], node.attrs["else_branch"]]

    @staticmethod
    def taken(node: gs.Node, reader: ConstView | ShapeView) -> list[gs.Graph]:
        """The branches that may run: the one a constant condition picks, else both."""
        cond = reader.value(node.inputs[0])
        then, other = If.branches(node)
        if cond is None or np.asarray(cond).size != 1:
            return [then, other]
        return [then if bool(np.asarray(cond).reshape(-1)[0]) else other]

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        taken = self.taken(node, ctx)
        return [agree(ctx, y, [b.outputs[j] for b in taken]) for j, y in enumerate(node.outputs)]

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        outs = [b.outputs[0] for b in self.taken(node, view)]
        if not any(view.is_shape(o) for o in outs):
            return None
        syms = [view.sym(o) for o in outs]
        if any(s is None for s in syms):
            return None  # data in one branch: the If's output is data
        first = syms[0]
        assert first is not None
        if all(s == first for s in syms):
            return first
        n = ir.static_dim(node.outputs[0], 0)
        return SymValue((opaque(*[s for s in syms if s is not None]),) * (n or 1), scalar=first.scalar)

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        ks.demand(node.inputs[0])
        for j, y in enumerate(node.outputs):
            if not ks.is_read(y):
                continue  # dropped by the rewrite
            outs = [b.outputs[j] for b in self.branches(node)]
            for o in outs:
                ks.demand(o, pin=False)
            tie_same(ks, node, [y, *outs])
            if ks.sym(y) is None:  # a shape value a branch returns is used as data
                for o in outs:
                    s = ks.sym(o)
                    if s is not None:
                        ks.pin_refs(s, Reason("shape", node.name, node.op, "a branch returns it as data"))

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        unread = [j for j, y in enumerate(node.outputs) if not rw.is_read(y)]
        for j in reversed(unread):
            del node.outputs[j]
            for b in self.branches(node):
                del b.outputs[j]


@register("Loop")
class Loop(Handler):
    def body_runs(self, node: OpNode, shapes: Mapping[str, list[int]], scalars: Mapping[str, int]) -> int:
        """M, its trip count."""
        m = node.inputs[0] if node.inputs else ""
        return max(scalars[m], 0) if m in scalars else 1

    def carried(self, node: OpNode) -> list[tuple[int, int, int]]:
        return [(2 + k, 2 + k, 1 + k) for k in range(len(node.inputs) - 2)]

    @staticmethod
    def layout(node: gs.Node) -> tuple[gs.Graph, int, int] | None:
        """(body, loop-carried count, scan-output count), when the body matches the node."""
        body = node.attrs.get("body")
        if not isinstance(body, gs.Graph):
            return None
        n = len(node.inputs) - 2
        k = len(body.outputs) - 1 - n
        if n < 0 or k < 0 or len(body.inputs) != n + 2 or len(node.outputs) != n + k:
            return None
        return body, n, k

    def refine_output_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> list[Dims | None]:
        got = self.layout(node)
        if got is None:
            return []
        body, n, k = got
        out: list[Dims | None] = []
        for c in range(n):
            ts = [node.inputs[2 + c], body.inputs[2 + c], body.outputs[1 + c]]
            out.append(fill_dims(node.outputs[c], carried_dims(ts)))
        for j in range(k):
            d = ir.dims(body.outputs[1 + n + j])
            out.append(fill_dims(node.outputs[n + j], None if d is None else [None, *d]))
        return out

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        got = self.layout(node)
        if got is None:
            return None
        body, n, k = got
        carried = [agree(ctx, node.outputs[c], [node.inputs[2 + c], body.outputs[1 + c]]) for c in range(n)]
        scans = [stacked_const(ctx, node.outputs[n + j], body.outputs[1 + n + j], 0) for j in range(k)]
        return [*carried, *scans]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        got = self.layout(node)
        if got is None:
            ks.barrier(node, Reason("barrier", node.name, node.op, "its body's inputs and outputs do not match its own"))
            return
        body, n, k = got
        ks.demand(ir.present(node, 0))
        ks.demand(ir.present(node, 1))
        ks.demand(body.outputs[0])
        for c in range(n):
            v0, y = node.inputs[2 + c], node.outputs[c]
            bi, bo = body.inputs[2 + c], body.outputs[1 + c]
            ks.demand(v0, pin=False)
            ks.demand(bo, pin=False)
            tie_same(ks, node, [v0, bi, bo, y])
        for j in range(k):
            bo, y = body.outputs[1 + n + j], node.outputs[n + j]
            if ks.is_read(y):  # else dropped by the rewrite
                ks.demand(bo, pin=False)
                tie_stacked(ks, node, bo, y, 0)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        got = self.layout(node)
        assert got is not None  # keep() made it a barrier otherwise
        body, n, k = got
        for j in reversed(range(k)):
            if not rw.is_read(node.outputs[n + j]):
                del node.outputs[n + j]
                del body.outputs[1 + n + j]


@register("Scan", since=9)
class Scan(Handler):
    def body_runs(self, node: OpNode, shapes: Mapping[str, list[int]], scalars: Mapping[str, int]) -> int:
        return scan_length(node, shapes)

    @staticmethod
    def layout(node: gs.Node) -> tuple[gs.Graph, int, list[int], list[int]] | None:
        """(body, state count, each scan input's axis, each scan output's axis), when the body
        matches the node and the ranks are known."""
        body = node.attrs.get("body")
        m = int(node.attrs.get("num_scan_inputs", 0))
        if not isinstance(body, gs.Graph):
            return None
        n = len(node.inputs) - m
        k = len(body.outputs) - n
        if n < 0 or m < 1 or k < 0 or len(body.inputs) != n + m or len(node.outputs) != n + k:
            return None
        in_axes = list(node.attrs.get("scan_input_axes") or [0] * m)
        out_axes = list(node.attrs.get("scan_output_axes") or [0] * k)
        if len(in_axes) != m or len(out_axes) != k:
            return None
        ins, outs = [], []
        for j, a in enumerate(in_axes):
            r = ir.rank(node.inputs[n + j])
            if r is None:
                return None
            ins.append(ir.norm_axis(int(a), r))
        for j, a in enumerate(out_axes):
            r = ir.rank(node.outputs[n + j])
            if r is None:
                return None
            outs.append(ir.norm_axis(int(a), r))
        return body, n, ins, outs

    def body_constants(self, node: gs.Node, ctx: ConstView) -> Mapping[str, ConstInfo] | None:
        got = self.layout(node)
        if got is None:
            return None
        body, n, ins, _ = got
        seeds: dict[str, ConstInfo] = {}
        for j, s in enumerate(ins):
            x, bi = node.inputs[n + j], body.inputs[n + j]
            c = ctx.const(x)
            if c is None or ir.rank(bi) != c.mask.ndim - 1 or c.mask.shape[s] != 1 or c.value.shape[s] != 1:
                continue  # varies from slice to slice (or not constant)
            seeds[bi.name] = ConstInfo(np.squeeze(c.mask, s), np.squeeze(c.value, s))
        return seeds

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        got = self.layout(node)
        if got is None:
            return None
        body, n, _, outs = got
        states = [agree(ctx, node.outputs[c], [node.inputs[c], body.outputs[c]]) for c in range(n)]
        scans = [stacked_const(ctx, node.outputs[n + j], body.outputs[n + j], s) for j, s in enumerate(outs)]
        return [*states, *scans]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        got = self.layout(node)
        if got is None:
            why = "its body's inputs and outputs do not match its own, or their ranks are unknown"
            ks.barrier(node, Reason("barrier", node.name, node.op, why))
            return
        body, n, ins, outs = got
        for c in range(n):
            x0, y = node.inputs[c], node.outputs[c]
            bi, bo = body.inputs[c], body.outputs[c]
            ks.demand(x0, pin=False)
            ks.demand(bo, pin=False)
            tie_same(ks, node, [x0, bi, bo, y])
        for j, s in enumerate(ins):
            x = node.inputs[n + j]
            ks.demand(x, pin=False)
            tie_stacked(ks, node, body.inputs[n + j], x, s)
        for j, s in enumerate(outs):
            bo, y = body.outputs[n + j], node.outputs[n + j]
            if ks.is_read(y):  # else dropped by the rewrite
                ks.demand(bo, pin=False)
                tie_stacked(ks, node, bo, y, s)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        got = self.layout(node)
        assert got is not None  # keep() made it a barrier otherwise
        body, n, _, outs = got
        dropped = [j for j in range(len(outs)) if not rw.is_read(node.outputs[n + j])]
        for j in reversed(dropped):
            del node.outputs[n + j]
            del body.outputs[n + j]
        for attr in ("scan_output_axes", "scan_output_directions"):
            if node.attrs.get(attr) is not None and dropped:
                node.attrs[attr] = [v for j, v in enumerate(node.attrs[attr]) if j not in dropped]


@register("Scan", until=8)
class ScanWithBatch(Handler):
    """Scan of opset 8 (a batch axis and sequence lengths): kept whole."""

    def body_runs(self, node: OpNode, shapes: Mapping[str, list[int]], scalars: Mapping[str, int]) -> int:
        return scan_length(node, shapes)

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        ks.barrier(node, Reason("barrier", node.name, node.op, "Scan of opset 8 is not analyzed"))


declare_cases(excluded={
    "If": "its bodies' nodes are analyzed (and replayed) each on its own; tests/ops/test_control.py",
    "Loop": "its body's nodes are analyzed (and replayed) each on its own; tests/ops/test_control.py",
    "Scan": "its body's nodes are analyzed (and replayed) each on its own; tests/ops/test_control.py",
})  # fmt: skip
