"""Layout ops: Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Expand, ConstantOfShape, Range.

Reshape and Flatten split and merge axes. Matching input and output dims gives groups of axes
with equal products; within a group the flat index space is shared, so the kept elements must
form a product set on both sides (e.g. whole heads times whole head dims, or whole channels
times every spatial position when flattening into a Linear). Target shapes that name a pruned
size are rewritten, whether constant or computed from Shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    DimRef,
    Dims,
    Handler,
    Item,
    KeepView,
    MaxOf,
    OpNode,
    Prod,
    Reader,
    Reason,
    RewriteView,
    ShapeView,
    SymValue,
    compress,
    ints_attr,
    item_deps,
    item_size,
    opaque_value,
    own_axes,
    register,
    sized_dims,
)
from onnxshrink.ops.common import couple_broadcast, ints
from onnxshrink.ops.oracle import OracleCase, declare_cases, layout_dims, needs, sig

Group = tuple[list[int], list[int]]
#: a dim as the axis groups compare it: a static size, a symbolic name, or a tagged tensor axis
#: (("ref", tensor, axis): that axis's dynamic size; ("merged", tensor, axis): input axes merged)
Token = int | str | tuple[str, str, int]


# ------------------------------------------------------------------ axis groups
def reshape_groups(a: list[Token], b: list[Token]) -> list[Group] | None:
    """Pair input dims `a` with output dims `b` into groups of equal product.

    Static dims are ints; any other value is a token for a dynamic size. Groups are matched from
    both ends; where dynamic sizes do not pair up (shape inference gave the same size two
    names), what is left in the middle is one group: the element count is the same on both
    sides, so equal products at both ends leave equal products in between. None when not even
    that is consistent."""
    head, i, j = _scan(a, b)
    if i == len(a) and j == len(b):
        return head
    ra, rb = a[i:][::-1], b[j:][::-1]
    tail, ti, tj = _scan(ra, rb)
    ea, eb = len(a) - ti, len(b) - tj

    def back(g: Group) -> Group:
        return ([len(a) - 1 - k for k in g[0]][::-1], [len(b) - 1 - k for k in g[1]][::-1])

    middle = (list(range(i, ea)), list(range(j, eb)))
    statics = [v for v in [*a[i:ea], *b[j:eb]] if isinstance(v, int)]
    if not any(not isinstance(v, int) for v in [*a[i:ea], *b[j:eb]]) and statics:
        return None  # static on both sides yet unmatched: not a reshape of equal sizes
    return [*head, middle, *[back(g) for g in reversed(tail)]]


def _scan(a: list[Token], b: list[Token]) -> tuple[list[Group], int, int]:
    """Match groups left to right until a dynamic size meets one it cannot be shown equal to;
    the groups and where it stopped in `a` and `b`."""
    groups: list[Group] = []
    i = j = 0
    while i < len(a) or j < len(b):
        ai = a[i] if i < len(a) else None
        bj = b[j] if j < len(b) else None
        if ai == 1 and (bj is None or not isinstance(bj, int) or bj != 1):
            groups.append(([i], []))
            i += 1
            continue
        if bj == 1 and (ai is None or not isinstance(ai, int) or ai != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if ai is None or bj is None:
            break
        if not isinstance(ai, int) or not isinstance(bj, int):
            if ai != bj:
                break
            groups.append(([i], [j]))
            i += 1
            j += 1
            continue
        gi, gj, pa, pb, ni, nj = [i], [j], ai, bj, i + 1, j + 1
        while pa != pb:
            if pa < pb:
                v = a[ni] if ni < len(a) else None
                if not isinstance(v, int) or v == 0:
                    break
                pa *= v
                gi.append(ni)
                ni += 1
            else:
                v = b[nj] if nj < len(b) else None
                if not isinstance(v, int) or v == 0:
                    break
                pb *= v
                gj.append(nj)
                nj += 1
        if pa != pb:
            break
        groups.append((gi, gj))
        i, j = ni, nj
    return groups, i, j


def _tokens(t: gs.Tensor) -> list[Token] | None:
    d = ir.dims(t)
    if d is None:
        return None
    return [
        v if isinstance(v, int) and v >= 0 else (v if isinstance(v, str) else ("ref", t.name, k))
        for k, v in enumerate(d)
    ]


def _pair_leftovers(a: list[Token], b: list[Token]) -> tuple[list[Token], list[Token]]:
    """One unmatched dynamic dim on each side, with equal static products: the same size."""
    la = [v for v in a if not isinstance(v, int) and v not in b]
    lb = [v for v in b if not isinstance(v, int) and v not in a]
    pa = int(np.prod([v for v in a if isinstance(v, int)], dtype=np.int64))
    pb = int(np.prod([v for v in b if isinstance(v, int)], dtype=np.int64))
    if len(la) == 1 and len(lb) == 1 and pa == pb:
        b = [la[0] if v == lb[0] else v for v in b]
    return a, b


def size_items(node: gs.Node, reader: Reader, i: int) -> list[Item] | None:
    """Elements of a shape-valued input: ints or symbolic items; None if not known."""
    t = ir.present(node, i)
    if t is None:
        return None
    v = reader.value(t)
    if v is not None:
        return list(ir.int_list(v) or ())
    s = reader.sym(t)
    return list(s.items) if s is not None else None


def tie_size_items(
    ks: KeepView,
    node: gs.Node,
    items: Sequence[Item],
    y: gs.Tensor,
    inferred: int | None = None,
    merged: frozenset[int] = frozenset(),
) -> None:
    """Output axis p has the size given by items[p]: a referenced axis keeps the same indices
    (each of a `MaxOf`'s: equal counts, so the larger is the kept count); an opaque size cannot
    change, so the axis and what it was computed from keep everything (but at `inferred`, a
    Reshape's size the rewrite makes -1: see `inferred_item`; at `merged`, a Reshape's product
    of its input's own axes: its axis groups keep the product set, and the product computed at
    run time from the shrunk input is its size)."""
    for p, it in enumerate(items):
        if p == inferred or p in merged:
            continue
        if isinstance(it, DimRef | MaxOf) and not _untied(it):
            for ref in sorted(item_deps(it), key=str):
                t = ks.tensors.get(ref.tensor)
                if t is not None:
                    ks.couple(t, ref.axis, y, p)
        elif _untied(it):
            why = Reason(
                "shape", node.name, node.op, "the target size is computed from other sizes"
            )
            ks.pin(y, p, why)
            for ref in item_deps(it):
                t = ks.tensors.get(ref.tensor)
                if t is not None:
                    ks.pin(t, ref.axis, why)


def _untied(it: Item) -> bool:
    """A size that tying axes cannot keep right: not a literal, a tensor's dim, or the larger of
    dims (an opaque expression, a product)."""
    if isinstance(it, MaxOf):
        return not all(isinstance(a, DimRef) for a in it.args)
    return not isinstance(it, int | DimRef)


def inferred_item(items: Sequence[Item], merged: frozenset[int] = frozenset()) -> int | None:
    """The position of a Reshape target's one opaque size (e.g. `Shape(v)[1] * 2`, a repeat of KV
    heads; or the larger of two sizes), when every other size is a literal other than -1, a
    tensor's dim or a product of the input's axes it merges (`merged`): the element count then
    fixes it (the reshape's axis groups tie that axis to the input's), so the rewrite can write
    it as the literal kept count of a pruned static axis (or -1); None otherwise."""
    opaque = [p for p, it in enumerate(items) if (_untied(it) or isinstance(it, MaxOf)) and p not in merged]
    if len(opaque) != 1 or any(isinstance(it, int) and it < 0 for it in items):
        return None
    return opaque[0]


def rewrite_size_input(
    rw: RewriteView,
    node: gs.Node,
    i: int,
    items: Sequence[Item],
    y: gs.Tensor,
    x: gs.Tensor | None = None,
    inferred: int | None = None,
) -> None:
    """Replace literal sizes of pruned output axes in shape input i (and the size at
    `inferred`, an opaque one, by its kept count when its axis is pruned)."""
    allowzero = bool(int(node.attrs.get("allowzero", 0)))
    new = list(items)
    if inferred is not None:
        after = rw.kept_count(y, inferred)
        full, k = ir.static_dim(y, inferred), rw.kept(y, inferred)
        if full is None and k is not None:
            # a dynamic axis kept by a period (a batch merged with heads): outer x kept heads,
            # which the element count gives (the other sizes are literals, dims or products)
            after = None if k.all() else -1
        if after is not None and after != full:
            new[inferred] = after
    for p, it in enumerate(items):
        if not isinstance(it, int):
            continue
        after = rw.kept_count(y, p)
        if after is None or after == ir.static_dim(y, p) and it != 0:
            continue
        if it == -1:
            continue
        if it == 0 and not allowzero and x is not None and rw.kept_count(x, p) == after:
            continue
        if node.op == "Expand" and it == 1:
            continue  # 1 keeps the input's size
        new[p] = after
    if new == items:
        return
    if all(isinstance(v, int) for v in new):
        rw.replace_input(node, i, np.asarray(new, dtype=np.int64))
        return
    # Mixed: take unchanged (symbolic) elements from the original shape tensor, literals anew.
    orig = node.inputs[i]
    pieces: list[gs.Tensor] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            pieces.append(rw.constant(np.asarray(run, dtype=np.int64), "shape"))
            run.clear()

    for p, (_old, now) in enumerate(zip(items, new, strict=True)):
        if isinstance(now, int):
            run.append(now)
        else:
            flush()
            pieces.append(rw.slice1d(orig, p))
    flush()
    node.inputs[i] = rw.concat1d(pieces)


# ------------------------------------------------------------------ helpers
def _close_product(
    ks: KeepView,
    x: gs.Tensor,
    in_axes: list[int],
    y: gs.Tensor,
    out_axes: list[int],
    site: gs.Node,
) -> None:
    """Kept elements of a merged/split block form one set seen from both sides. Dynamic sizes
    may lead the block on both sides (e.g. (batch, heads) merged for a batched MatMul): every
    index of them is kept, and a single dynamic axis on one side is then kept by its period
    (`_adopt_period`). The block's static and periodic axes are recorded for the coupled groups:
    its inner index space, the dynamic sizes leading it aside."""
    side_a, side_b = _adopt_period(ks, x, in_axes, y, out_axes)
    if side_a is None or side_b is None or side_a[0] != side_b[0]:
        _pin_block(ks, x, in_axes, y, out_axes, site)
        return
    in_axes, ka = [a for a, _ in side_a[1]], [k for _, k in side_a[1]]
    out_axes, kb = [b for b, _ in side_b[1]], [k for _, k in side_b[1]]
    if not ka and not kb:
        return
    if not ka or not kb:
        _pin_block(ks, x, in_axes, y, out_axes, site)
        return
    ks.block(x, in_axes, y, out_axes, site)
    fa = reduce(np.logical_and.outer, ka).reshape(-1)
    fb = reduce(np.logical_and.outer, kb).reshape(-1)
    if len(fa) != len(fb):
        _pin_block(ks, x, in_axes, y, out_axes, site)
        return
    if np.array_equal(fa, fb):
        return
    f = fa | fb
    split = max((ka, kb), key=len)
    why = Reason(
        "structure",
        site.name,
        site.op,
        f"it views these {len(fa)} indices as {' x '.join(str(len(k)) for k in split)} "
        "(e.g. heads x head dims), so one goes only with its whole block, and the rest of "
        "this block is live",
    )
    for side, axes, ks_ in ((x, in_axes, ka), (y, out_axes, kb)):
        shaped = f.reshape([len(k) for k in ks_])
        for n, a in enumerate(axes):
            other = tuple(m for m in range(len(axes)) if m != n)
            ks.keep(side, a, shaped.any(axis=other) if other else shaped, why)


Side = tuple[bool, list[tuple[int, np.ndarray]]]


def _adopt_period(
    ks: KeepView, x: gs.Tensor, in_axes: list[int], y: gs.Tensor, out_axes: list[int]
) -> tuple[Side | None, Side | None]:
    """Both sides of a block (`_static_tail`) after a lone dynamic axis leading one side adopts
    its period: where the other side's static (and periodic) sizes multiply to n times this
    side's, with dynamic sizes leading both, row-major order makes that axis's index
    outer * n + inner (a batch merged with heads, [B, E] -> [B * H, E / H]: n = H), for any
    outer size (`KeepView.adopt`); the other side's periodic axes are part of its lead and of
    its inner sizes alike."""
    side_a, side_b = _static_tail(ks, x, in_axes), _static_tail(ks, y, out_axes)
    if side_a is None or side_b is None:
        return side_a, side_b
    for t, axes, mine, theirs in ((x, in_axes, side_a, side_b), (y, out_axes, side_b, side_a)):
        # one dynamic axis, not periodic, then static sizes only (a periodic axis after it
        # would put its own outer index between this axis's inner index and the static ones)
        lone = mine[0] and ks.kept(t, axes[0]) is None and len(axes) == len(mine[1]) + 1
        lone = lone and all(ir.static_dim(t, a) is not None for a, _ in mine[1])
        if not lone or not theirs[1] or (not theirs[0] and mine[1]):
            continue
        pm = int(np.prod([len(k) for _, k in mine[1]], dtype=np.int64))
        pt = int(np.prod([len(k) for _, k in theirs[1]], dtype=np.int64))
        if pt > pm and pt % pm == 0 and ks.adopt(t, axes[0], pt // pm):
            return _static_tail(ks, x, in_axes), _static_tail(ks, y, out_axes)
        break
    return side_a, side_b


def _pin_block(
    ks: KeepView, x: gs.Tensor, in_axes: list[int], y: gs.Tensor, out_axes: list[int], site: gs.Node
) -> None:
    """Keep a block whole whose two sides' sizes do not pair up, and say so: which indices go
    together (heads of a merged batch x heads, say) is not derived from the graph."""
    why = Reason(
        "structure",
        site.name,
        site.op,
        "its input and output sizes do not pair up here (a static size against a dynamic one, "
        "or static sizes whose products differ): which of their indices go together is not "
        "derived from the graph",
    )
    for a in in_axes:
        ks.pin(x, a, why)
    for b in out_axes:
        ks.pin(y, b, why)


def _static_tail(
    ks: KeepView, t: gs.Tensor, axes: list[int]
) -> tuple[bool, list[tuple[int, np.ndarray]]] | None:
    """A block's side as (whether dynamic sizes lead it, its (axis, kept) of static sizes, in
    order): a periodic axis is a dynamic size then its period. None when a dynamic size follows
    a static one (not a leading batch) or the rank is unknown."""
    d = ir.dims(t)
    if d is None:
        return None
    lead, tail = False, list[tuple[int, np.ndarray]]()
    for a in axes:
        k = ks.kept(t, a)
        if k is None or ks.periodic(t, a):
            if tail or a >= len(d) or isinstance(d[a], int):
                return None
            lead = True
        if k is not None:
            tail.append((a, k))
    return lead, tail


def keep_groups(
    ks: KeepView, node: gs.Node, x: gs.Tensor, y: gs.Tensor, groups: list[Group] | None
) -> None:
    if groups is None:
        why = Reason("structure", node.name, node.op, "input and output dims could not be matched")
        ks.pin(x, reason=why)
        ks.pin(y, reason=why)
        return
    for ga, gb in groups:
        if not ga or not gb:
            for a in ga:
                ks.pin(x, a)
            for b in gb:
                ks.pin(y, b)
        elif len(ga) == 1 and len(gb) == 1:
            ks.couple(x, ga[0], y, gb[0])
        else:
            _close_product(ks, x, ga, y, gb, node)


def reshape_constants(
    ctx: ConstView, x: gs.Tensor, y: gs.Tensor, groups: list[Group] | None
) -> ConstInfo | None:
    """Reshape the compressed mask/value group by group (expanding a group only when needed)."""
    c = ctx.const(x)
    if c is None or groups is None:
        return None
    din, dout = ir.dims(x), ir.dims(y)
    if din is None or dout is None:
        return None
    m, v = c.mask, c.value
    new_shape = []
    for ga, gb in groups:
        varying = any(m.shape[a] > 1 or v.shape[a] > 1 for a in ga)
        if not varying:
            new_shape += [1] * len(gb)
            continue
        if any(not isinstance(din[a], int) for a in ga) or any(
            not isinstance(dout[b], int) for b in gb
        ):
            return None
        target = list(m.shape)
        for a in ga:
            target[a] = int(din[a])  # type: ignore[arg-type]  # checked static above
        m = np.broadcast_to(m, np.broadcast_shapes(m.shape, tuple(target)))
        v = np.broadcast_to(v, np.broadcast_shapes(v.shape, tuple(target)))
        new_shape += [int(dout[b]) for b in gb]  # type: ignore[arg-type]
    # Only grouped axes are expanded, so both arrays now share the sizes reshape needs.
    full = np.broadcast_shapes(m.shape, v.shape)
    m, v = np.broadcast_to(m, full), np.broadcast_to(v, full)
    return compress(m.reshape(new_shape), v.reshape(new_shape))


def _reshape_grouping(node: gs.Node, reader: Reader, x: gs.Tensor, y: gs.Tensor) -> list[Group] | None:
    a, b = _tokens(x), _tokens(y)
    if a is None or b is None:
        return None
    items = size_items(node, reader, 1)
    merges = _merges(items, x) if items is not None and len(items) == len(b) else []
    if merges:  # target sizes that are products of x's own axes: those axes merge into them
        spans = {axes[0]: (axes, p) for p, axes in merges}
        short: list[Token] = []
        back: list[list[int]] = []
        k = 0
        while k < len(a):
            if k in spans:
                axes, p = spans[k]
                short.append(("merged", x.name, k))
                b[p] = short[-1]
                back.append(axes)
                k = axes[-1] + 1
            else:
                short.append(a[k])
                back.append([k])
                k += 1
        groups = _size_groups(node, reader, short, b, items)
        if groups is None:
            return None
        return [([k for i in ga for k in back[i]], gb) for ga, gb in groups]
    return _size_groups(node, reader, a, b, items)


def _merges(items: Sequence[Item], x: gs.Tensor) -> list[tuple[int, list[int]]]:
    """(output position, input axes) of each target size that is the product of consecutive
    axes of x itself (`own_axes`), when no input axis is in two."""
    out = [(p, axes) for p, axes in ((p, own_axes(it, x)) for p, it in enumerate(items)) if axes]
    used = [a for _, axes in out for a in axes]
    return out if len(used) == len(set(used)) else []


def merged_positions(node: gs.Node, reader: Reader, items: Sequence[Item], groups: list[Group] | None) -> frozenset[int]:
    """The target positions whose product of input axes the axis groups merge into them."""
    if groups is None:
        return frozenset()
    return frozenset(p for p, axes in _merges(items, node.inputs[0]) if (axes, [p]) in groups)


def _size_groups(
    node: gs.Node, reader: Reader, a: list[Token], b: list[Token], items: Sequence[Item] | None
) -> list[Group] | None:
    allowzero = bool(int(node.attrs.get("allowzero", 0)))
    if items is not None and len(items) == len(b):
        for p, it in enumerate(items):
            if isinstance(b[p], int):
                continue
            if isinstance(it, int) and it > 0:
                b[p] = it
            elif it == 0 and not allowzero and p < len(a):
                b[p] = a[p]
            elif isinstance(it, DimRef):
                t = reader.tensors.get(it.tensor)
                d = ir.dims(t) if t is not None else None
                if d is not None and it.axis < len(d):
                    dim = d[it.axis]
                    b[p] = dim if dim is not None else ("ref", it.tensor, it.axis)
            elif isinstance(it, Prod | MaxOf):
                size = item_size(it, reader.tensors)
                if size is not None:
                    b[p] = size
    a, b = _pair_leftovers(a, b)
    return reshape_groups(a, b)


# ------------------------------------------------------------------ handlers
def vector_of(node: gs.Node, view: ShapeView) -> SymValue | None:
    """Shape rule of a reshape to a vector (Unsqueeze, Reshape, Flatten of a shape value)."""
    if not view.is_shape(node.inputs[0]):
        return None
    a = view.sym(node.inputs[0])
    if a is not None and ir.rank(node.outputs[0]) == 1:
        return SymValue(a.items, scalar=False)
    return opaque_value(node, view)


@register("Reshape")
class Reshape(Handler):
    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,)

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        return vector_of(node, view)

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        return sized_dims(node, ir.present(node, 1), consts, view, zero_copies=True)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x, y = node.inputs[0], node.outputs[0]
        return [reshape_constants(ctx, x, y, _reshape_grouping(node, ctx, x, y))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        ks.claim(node, 1)
        ks.demand(x, pin=False)
        ks.demand(node.inputs[1])
        items = size_items(node, ks, 1)
        if items is None:
            ks.barrier(
                node, Reason("shape", node.name, node.op, "the target shape is not understood")
            )
            return
        groups = _reshape_grouping(node, ks, x, y)
        keep_groups(ks, node, x, y, groups)
        merged = merged_positions(node, ks, items, groups)
        inferred = inferred_item(items, merged) if groups is not None else None
        tie_size_items(ks, node, items, y, inferred, merged)
        allowzero = bool(int(node.attrs.get("allowzero", 0)))
        for p, it in enumerate(items):
            if it == 0 and not allowzero:
                ks.couple(x, p, y, p)  # 0 copies the input's size at the same position

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        items = size_items(node, rw, 1)
        if items is not None:  # keep() made a Reshape of an unknown target a barrier
            x, y = node.inputs[0], node.outputs[0]
            groups = _reshape_grouping(node, rw, x, y)
            merged = merged_positions(node, rw, items, groups)
            inferred = inferred_item(items, merged) if groups is not None else None
            rewrite_size_input(rw, node, 1, items, y, x, inferred)


@register("Flatten")
class Flatten(Handler):
    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,)

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        return vector_of(node, view)

    def _groups(self, node: gs.Node, x: gs.Tensor) -> list[Group] | None:
        r = ir.rank(x)
        if r is None:
            return None
        axis = ir.norm_axis(int(node.attrs.get("axis", 1)), r)
        return [(list(range(axis)), [0]), (list(range(axis, r)), [1])]

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x, y = node.inputs[0], node.outputs[0]
        return [reshape_constants(ctx, x, y, self._groups(node, x))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        ks.demand(x, pin=False)
        keep_groups(ks, node, x, y, self._groups(node, x))


@register("Transpose")
class Transpose(Handler):
    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,)

    def perm(self, node: gs.Node | OpNode, r: int) -> list[int]:
        return ints_attr(node, "perm") if node.attrs.get("perm") is not None else list(range(r))[::-1]

    def passes_axes(self, node: OpNode, i: int, rank: int) -> list[int] | None:
        return self.perm(node, rank) if i == 0 else None

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        x, yd = ir.dims(node.inputs[0]), ir.dims(node.outputs[0])
        if x is not None and yd is None:
            yd = [None] * len(x)  # the output has the input's rank
        if x is None or yd is None or len(x) != len(yd):
            return None
        return [d if isinstance(d, int) else x[a] for d, a in zip(yd, self.perm(node, len(x)), strict=True)]

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        c, r = ctx.const(node.inputs[0]), ir.rank(node.inputs[0])
        if c is None or r is None:
            return None
        p = self.perm(node, r)
        return [ConstInfo(np.transpose(c.mask, p), np.transpose(c.value, p), c.whole)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        if r is None:
            ks.barrier(node)
            return
        ks.demand(x, pin=False)
        for i, a in enumerate(self.perm(node, r)):
            ks.couple(x, a, y, i)


def _squeeze_axes(node: gs.Node, reader: Reader, x: gs.Tensor) -> list[int] | None:
    r = ir.rank(x)
    if r is None:
        return None
    axes = ints(node, reader, "axes", 1)
    if axes is None:
        if "axes" not in node.attrs and ir.present(node, 1) is not None:
            return None  # given, but not constant
        d = ir.dims(x) or []
        if any(not isinstance(v, int) for v in d):
            return None
        return [k for k, v in enumerate(d) if v == 1]
    return ir.norm_axes(axes, r)


@register("Squeeze")
class Squeeze(Handler):
    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,)

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        if not view.is_shape(node.inputs[0]):
            return None
        a = view.sym(node.inputs[0])
        if a is not None and len(a.items) == 1:
            return SymValue(a.items, scalar=True)
        return opaque_value(node, view)

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        x, yd = ir.dims(node.inputs[0]), ir.dims(node.outputs[0])
        axes = _squeeze_axes(node, consts, node.inputs[0])
        if x is None or yd is None or axes is None or len(x) - len(axes) != len(yd):
            return None
        rest = [d for a, d in enumerate(x) if a not in axes]
        return [d if isinstance(d, int) else r for d, r in zip(yd, rest, strict=True)]

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        c = ctx.const(node.inputs[0])
        axes = _squeeze_axes(node, ctx, node.inputs[0])
        if c is None or axes is None:
            return None
        return [
            ConstInfo(
                np.squeeze(c.mask, tuple(axes)),
                np.squeeze(c.value, tuple(axes)) if c.value.ndim == c.mask.ndim else c.value,
                c.whole,
            )
        ]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        axes = _squeeze_axes(node, ks, x)
        if axes is None:
            ks.barrier(node)
            return
        ks.demand(x, pin=False)
        for t in node.inputs[1:]:
            ks.demand(t)
        j = 0
        for a in range(ir.known_rank(x)):
            if a in axes:
                ks.pin(x, a)
            else:
                ks.couple(x, a, y, j)
                j += 1


@register("Unsqueeze")
class Unsqueeze(Handler):
    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,)

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        return vector_of(node, view)

    def axes(self, node: gs.Node, reader: Reader) -> list[int] | None:
        r = ir.rank(node.outputs[0])
        axes = ints(node, reader, "axes", 1)
        return None if axes is None or r is None else ir.norm_axes(axes, r)

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        x, yd, axes = ir.dims(node.inputs[0]), ir.dims(node.outputs[0]), self.axes(node, consts)
        if x is None or yd is None or axes is None or len(x) + len(axes) != len(yd):
            return None
        rest = iter(x)
        new = []
        for b, d in enumerate(yd):
            src = 1 if b in axes else next(rest)
            new.append(d if isinstance(d, int) else src)
        return new

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        c, axes = ctx.const(node.inputs[0]), self.axes(node, ctx)
        if c is None or axes is None:
            return None
        m, v = c.mask, c.value
        for a in axes:
            m = np.expand_dims(m, a)
            v = np.expand_dims(v, a)
        return [ConstInfo(m, v, c.whole)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        axes = self.axes(node, ks)
        if axes is None:
            ks.barrier(node)
            return
        ks.demand(x, pin=False)
        for t in node.inputs[1:]:
            ks.demand(t)
        j = 0
        for b in range(ir.known_rank(y)):
            if b in axes:
                ks.pin(y, b)
            else:
                ks.couple(x, j, y, b)
                j += 1


@register("Expand")
class Expand(Handler):
    """Broadcast to a shape: a copied axis ties to the input; a new or widened one is free to
    keep any subset (its elements are copies), as long as the target size is rewritten."""

    def form_since(self, op: str) -> int:
        return 8  # the target shape as an input

    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,)

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        """A shape vector broadcast to a 1-D target (e.g. [n] to [1])."""
        if not view.is_shape(node.inputs[0]):
            return None
        a, target = view.sym(node.inputs[0]), view.sym(ir.present(node, 1))
        if a is None or target is None or len(target.items) != 1 or not target.literal or a.scalar:
            return opaque_value(node, view)
        n = target.items[0]
        assert isinstance(n, int)
        if len(a.items) == 1 and n > 1:
            return SymValue(a.items * n)
        return a if n in (1, len(a.items)) else opaque_value(node, view)

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        return sized_dims(node, ir.present(node, 1), consts, view, broadcast=True)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        c, r = ctx.const(node.inputs[0]), ir.rank(node.outputs[0])
        if c is None or r is None:
            return None
        pad = (1,) * (r - c.mask.ndim)
        return [ConstInfo(c.mask.reshape(pad + c.mask.shape), c.value.reshape(pad + c.value.shape))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        ks.claim(node, 1)
        items = size_items(node, ks, 1)
        if items is None or ir.rank(y) is None or ir.rank(x) is None:
            ks.barrier(node)
            return
        ks.demand(x, pin=False)
        ks.demand(node.inputs[1])
        couple_broadcast(ks, node, y, x)
        off = ir.known_rank(y) - len(items)
        tie_size_items(ks, node, [1] * off + items, y)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        items = size_items(node, rw, 1)
        y = node.outputs[0]
        if items is not None and ir.known_rank(y) == len(items):
            rewrite_size_input(rw, node, 1, items, y)


@register("ConstantOfShape")
class ConstantOfShape(Handler):
    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        return sized_dims(node, node.inputs[0], consts, view)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        r = ir.rank(node.outputs[0])
        if r is None:
            return None
        val = node.attrs.get("value")
        fill = (
            np.asarray(val.values).reshape(-1)[:1] if val is not None else np.zeros(1, np.float32)
        )
        return [ConstInfo(np.ones((1,) * r, bool), fill.reshape((1,) * r))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        ks.claim(node, 0)
        items = size_items(node, ks, 0)
        if items is None:
            ks.barrier(node)
            return
        ks.demand(node.inputs[0])
        tie_size_items(ks, node, items, node.outputs[0])

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        items = size_items(node, rw, 0)
        if items is not None:
            rewrite_size_input(rw, node, 0, items, node.outputs[0])


@register("Range", since=11)
class Range(Handler):
    """Values and length come from its scalar inputs (e.g. position ids up to a dynamic sequence
    length): there is no channel to remove, and nothing that blocks its consumers."""

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        for t in node.inputs:
            ks.demand(t)
        ks.pin(node.outputs[0])


# ------------------------------------------------------------------ oracle cases
def _reshape_case(op: str, rng: np.random.Generator) -> OracleCase:
    """Reshape, Flatten, Transpose, Squeeze, Unsqueeze, Expand of an input [1, c, h, w]."""
    c, h, w = layout_dims(rng)
    x = [1, c, h, w]
    ins = [("x", "float", x)]
    if op == "Reshape":
        y = [1, c, h * w] if rng.random() < 0.5 else [1, 2, c // 2, h, w]
        ins.append(("S", "int64", [len(y)]))
        return OracleCase(op, sig(ins, [("y", y)]) + " { y = Reshape (x, S) }", 17, values={"S": y}, needs=needs(rng, "y", y))
    if op == "Flatten":
        return OracleCase(op, sig(ins, [("y", [1, c * h * w])]) + " { y = Flatten (x) }", 17, needs=needs(rng, "y", [1, c * h * w]))
    if op == "Transpose":
        perm = [0, *(1 + rng.permutation(3)).tolist()]
        y = [x[p] for p in perm]
        return OracleCase(op, sig(ins, [("y", y)]) + f" {{ y = Transpose <perm = [{', '.join(map(str, perm))}]> (x) }}", 17,
                          needs=needs(rng, "y", y))
    if op == "Squeeze":
        ins.append(("A", "int64", [1]))
        return OracleCase(op, sig(ins, [("y", [c, h, w])]) + " { y = Squeeze (x, A) }", 17, values={"A": [0]}, needs=needs(rng, "y", [c, h, w]))
    if op == "Unsqueeze":
        ins.append(("A", "int64", [1]))
        y = [1, c, 1, h, w]
        return OracleCase(op, sig(ins, [("y", y)]) + " { y = Unsqueeze (x, A) }", 17, values={"A": [2]}, needs=needs(rng, "y", y))
    ins = [("x", "float", [1, c, 1, w]), ("S", "int64", [4])]  # Expand
    y = [2, c, h, w]
    return OracleCase(op, sig(ins, [("y", y)]) + " { y = Expand (x, S) }", 17, values={"S": y}, needs=needs(rng, "y", y))


declare_cases(
    dict.fromkeys(("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Expand"), _reshape_case),
    excluded={"ConstantOfShape": "reads a shape, not data", "Range": "reads scalars, not data"},
)
