"""Fused attention: ONNX `Attention` (opset 23) and onnxruntime's `Attention`,
`MultiHeadAttention` and `GroupQueryAttention` (com.microsoft).

A head is a unit: its query, key and value dims are read together (the scores contract the
query and key dims; softmax mixes the key positions), so a head goes whole or stays whole.
Heads are either an axis of their own (opset 23's 4-D form, [batch, heads, seq, head_dim];
MultiHeadAttention's packed QKV [batch, seq, heads, 3, head_dim], packed KV [batch, seq,
heads, 2, head_dim], keys and values per head [batch, heads, seq, head_dim]) or blocks of
head_dim along a packed hidden axis ([batch, seq, heads * head_dim], the contrib ops and
opset 23's 3-D form). A head goes when no kept output reads it: its output block is unread
(the output projection's columns are masked) or constant zero (its value projection is masked:
softmax(scores) @ 0 = 0, which the consumer absorbs). With grouped-query attention a
key/value head serves `rep` query heads; the kept query heads are a product (kept K/V heads) x
(kept ranks within a group), so that every K/V head still serves the same number of query
heads, and a K/V head goes with all its query heads. `num_heads`-style attributes are
rewritten; the initializers (packed QKV weights and biases) are sliced by the kept sets.

Past key/value inputs, present outputs and attention biases with a head axis are sliced with
the heads they hold (a K/V head's cache, a query head's bias); when they are graph inputs or
outputs (the interface), their heads stay, exactly, except a KV cache: a present output that
extends its past input (`extends`) is one state the runtime feeds back, whose K/V heads go with
their groups (analyze/cache.py). Rotary embeddings act within a head and
need nothing. For `--groups` and `--prune` each op ties what goes with a head (or a K/V head
with its query heads) together (`KeepView.unit`) and says where its heads are (`head_axis`).
With grouped-query attention the packed-hidden forms also tie the other way to cut the
query heads (`tie_ranks`: the query heads of one rank in every K/V group), which the groups
use when asked (`--units head` without `kv_group`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Dims,
    Handler,
    HeadAxis,
    KeepView,
    OpNode,
    Reader,
    Reason,
    RewriteView,
    ShapeView,
    WeightAxes,
    int_attr,
    register,
)
from onnxshrink.ops.fused_activation import MS
from onnxshrink.ops.oracle import (
    MS_HEADER,
    OPSET23,
    OracleCase,
    declare_cases,
    needs,
    sig,
    zero_rows,
)

# The two ways to cut grouped-query attention's query heads into units, named by the unit each
# makes (`KeepView.unit`'s kind; the groups ask for one): with their K/V head, or by their rank
# in every K/V group (a K/V head then a unit alone).
WITH_KV_HEAD = "kv_group"
BY_RANK = "head"

# ------------------------------------------------------------------ heads as blocks
def blocks(heads: Sequence[int] | np.ndarray, size: int, offset: int = 0) -> np.ndarray:
    """The indices of heads' blocks of `size` along a packed axis starting at `offset`."""
    heads = np.asarray(heads, dtype=np.int64)
    return (offset + heads[:, None] * size + np.arange(size)[None, :]).reshape(-1)


def heads_read(kept: np.ndarray | None, heads: int) -> np.ndarray:
    """Per head: is any index of its block kept? (a dynamic axis: all)"""
    if kept is None:
        return np.ones(heads, bool)
    return np.asarray(kept.reshape(heads, -1).any(axis=1))


def zero_heads(c: ConstInfo | None, axis: int, size: int, heads: int) -> np.ndarray:
    """Per head: is its block along `axis` (of `size` indices) constant zero?"""
    if c is None:
        return np.zeros(heads, bool)
    return np.asarray(c.slice_zero(axis, size).reshape(heads, -1).all(axis=1))


def grouped(q_heads: np.ndarray, kv_needed: np.ndarray, rep: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept query heads, kept K/V heads) with grouped-query attention: query head j * rep + r
    reads K/V head j. The kept query heads form a product (K/V heads) x (ranks) so that every
    K/V head serves the same number of query heads."""
    kv = len(kv_needed)
    need = q_heads.reshape(kv, rep)
    groups = np.asarray(need.any(axis=1) | kv_needed)
    ranks = np.asarray(need[groups].any(axis=0))
    if groups.any() and not ranks.any():
        ranks[0] = True  # a K/V head kept for its present output still serves one query head
    q = (groups[:, None] & ranks[None, :]).reshape(-1)
    return q, groups


def keep_blocks(ks: KeepView, t: gs.Tensor, axis: int, mask: np.ndarray, why: Reason) -> None:
    if ks.kept(t, axis) is not None and ks.size(t, axis) == len(mask):
        ks.keep(t, axis, mask, why)
    else:
        ks.pin(t, axis, why)


def keep_head_axis(
    ks: KeepView, t: gs.Tensor, heads: np.ndarray, y: gs.Tensor, why: Reason, last: gs.Tensor | None = None
) -> None:
    """A [batch, heads, seq, d] output (present key/value, scores): the kept heads; batch tied to
    y's; its sequence pinned; its last axis tied to `last`'s (present value: V's dims) or pinned."""
    if ir.rank(t) != 4:
        ks.pin(t)
        return
    keep_blocks(ks, t, 1, heads, why)
    ks.couple(t, 0, y, 0)
    ks.pin(t, 2)
    if last is not None:
        ks.couple(t, 3, last, 3)
    else:
        ks.pin(t, 3)


def tie_heads(ks: KeepView, y: gs.Tensor, size: int, rep: int, kind: str | None = None) -> np.ndarray:
    """Records (for the coupled groups) that y's axis 2 holds query heads of `size` channels,
    `rep` of them to a K/V head, which go together (as a unit of `kind`, when that is one way
    to cut them); returns the y index each K/V head's group is tied at (its first channel), to
    tie the group's other slices to."""
    n = int(ks.size(y, 2) or 0)
    anchor = np.arange(n // (size * rep)) * size * rep
    ks.unit(y, 2, np.arange(n), y, 2, anchor[np.arange(n) // (size * rep)], kind)
    return anchor


def every_head(ks: KeepView, node: gs.Node, y: gs.Tensor, what: str) -> None:
    """`what` carries every head: none can go (said on the output's heads, for the groups)."""
    ks.pin(y, 2, Reason("structure", node.name, node.op, f"{what} carries every head"))


def mask_heads(mask: gs.Tensor) -> int:
    """The heads' axis of an attention mask or bias [.., heads, S, T] (rank 3 or more)."""
    return (ir.rank(mask) or 3) - 3


def pin_but_heads(ks: KeepView, node: gs.Node, mask: gs.Tensor | None) -> None:
    """A per-head attention mask or bias [.., heads, S, T]: every axis but the heads' is read
    whole."""
    r = ir.rank(mask) if mask is not None else None
    if mask is None or r is None:
        return
    for a in range(r):
        if a != r - 3:
            ks.pin(mask, a, Reason("structure", node.name, node.op, "a mask's positions are read whole"))


def set_attr(node: gs.Node, name: str, old: int, new: int) -> None:
    if new != old:
        node.attrs[name] = int(new)


# ------------------------------------------------------------------ onnxruntime's Attention
@register("Attention", domain=MS)
class ContribAttention(Handler):
    """x [B, S, in] @ packed weights [in, q + k + v] (+ bias) -> per-head attention ->
    [B, S, v]. Inputs after bias: mask_index, past, attention_bias, past_sequence_length."""

    evaluate_with_ort = True
    head_attrs = ("num_heads", "kv_num_heads")

    def macs(self, node: OpNode, inputs: Sequence[list[int] | None], output: list[int]) -> int:
        """The packed projection, and each head's scores and weighted values."""
        x, w = inputs[0], inputs[1]
        if x is None or w is None or len(x) != 3 or len(w) != 2:
            return 0
        b, s = x[0], x[1]
        return b * s * int(np.prod(w)) + 2 * b * s * s * (w[1] // 3)

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        """The packed Q|K|V weight [in, q + k + v] (a linear layer's, stored [in, out]) and bias."""
        if i == 1 and rank == 2:
            return WeightAxes(1, 0, "linear")
        return WeightAxes(0, None, "vector") if i == 2 and rank == 1 else None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> dict[str, int]:
        return {"weight": 1, "bias": 2}

    def head_axis(self, node: gs.Node) -> HeadAxis | None:
        wt = node.inputs[1] if len(node.inputs) > 1 else None
        got = self.sizes(node, np.asarray(wt.values) if isinstance(wt, gs.Constant) else None)
        if got is None:
            return None
        heads, q, _, v = got
        return HeadAxis(0, 2, v // heads, q // heads)

    def sizes(self, node: gs.Node, w: np.ndarray | None) -> tuple[int, int, int, int] | None:
        """(heads, q, k, v) hidden sizes, from qkv_hidden_sizes or equal thirds."""
        heads = int(node.attrs.get("num_heads", 0))
        if w is None or w.ndim != 2 or heads <= 0:
            return None
        sizes = node.attrs.get("qkv_hidden_sizes")
        q, k, v = [int(s) for s in sizes] if sizes else [w.shape[1] // 3] * 3
        if q + k + v != w.shape[1] or q % heads or k % heads or v % heads or q != k:
            return None
        return heads, q, k, v

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        w, y = ctx.value(node.inputs[1]), node.outputs[0]
        got = self.sizes(node, w)
        if got is None or w is None or ir.rank(y) != 3:
            return None
        heads, q, k, v = got
        b = ctx.value(ir.present(node, 2))
        wv = w[:, q + k :]
        dead = (wv == 0).all(axis=0) & ((b[q + k :] == 0) if b is not None else True)
        dead = dead.reshape(heads, -1).all(axis=1)  # a head whose V is zero outputs zero
        if not dead.any():
            return None
        mask = np.repeat(dead, v // heads).reshape(1, 1, v)
        return [ConstInfo(mask, np.zeros((1, 1, 1), w.dtype))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, wt, y = node.inputs[0], node.inputs[1], node.outputs[0]
        w = ks.value(wt)
        got = self.sizes(node, w)
        if got is None or w is None or ir.rank(x) != 3 or ir.rank(y) != 3:
            ks.barrier(node, Reason("barrier", node.name, node.op, "weights or sizes unknown"))
            return
        heads, q, k, v = got
        bias = ir.present(node, 2)
        caches = self.caches(node, ks, heads)
        ab = ir.present(node, 5)  # attention_bias [B or 1, heads or 1, S, T]
        mask = ab if ab is not None and heads > 1 and ir.rank(ab) == 4 and ir.static_dim(ab, 1) == heads else None
        self.demand(node, ks, [*(caches or ()), *([mask] if mask is not None else [])])
        ks.couple(x, 0, y, 0)
        ks.couple(x, 1, y, 1)
        why = Reason("structure", node.name, node.op, "a head's dims go together")
        ks.pin(x, 1, Reason("structure", node.name, node.op, "every position is a key"))
        if caches is None:
            every_head(ks, node, y, "a past/present not [2, B, heads, T, d] or an attention bias not [B, heads or 1, S, T]")
        pin_but_heads(ks, node, mask)
        for t in caches or ():  # [2 (key, value), B, heads, positions, d]
            ks.couple(t, 1, y, 0)
            for a, what in ((0, "key and value"), (3, "every position is a key"), (4, "a head's dims go together")):
                ks.pin(t, a, Reason("structure", node.name, node.op, what))
        need = heads_read(ks.kept(y, 2), heads)
        for t in caches or ():
            need |= heads_read(ks.kept(t, 2), heads)
        if mask is not None:
            need |= heads_read(ks.kept(mask, 1), heads)
        kept = np.flatnonzero(need)
        cols = np.zeros(q + k + v, bool)
        head_of = np.zeros(q + k + v, np.int64)  # the head of each packed column
        for off, size in ((0, q), (q, k), (q + k, v)):
            cols[blocks(kept, size // heads, off)] = True
            head_of[off : off + size] = np.arange(size) // (size // heads)
        self.tie(ks, node, got, head_of, caches or [], mask)
        keep_blocks(ks, y, 2, np.repeat(need, v // heads), why)
        for t in caches or ():
            keep_blocks(ks, t, 2, need, why)
        if mask is not None:
            keep_blocks(ks, mask, 1, need, why)
        if bias is not None:
            ks.couple(wt, 1, bias, 0)
        ks.keep(wt, 1, cols, why)
        ks.couple(x, 2, wt, 0)
        ks.need(x, 2, (w[:, cols] != 0).any(axis=1))
        for t in node.outputs[1:]:
            if not any(t is c for c in caches or ()):
                ks.pin(t)

    def demand(self, node: gs.Node, ks: KeepView, ours: list[gs.Tensor]) -> None:
        """Every input: x, the weights, the bias and `ours` (the caches and per-head attention
        bias) constrained here, the others whole."""
        for i in range(3):
            ks.demand(ir.present(node, i), pin=False)
        for t in node.inputs[3:]:
            if t is not None and t.name and any(t is c for c in ours):
                ks.demand(t, pin=False)
            else:
                ks.demand(t if t is not None and t.name else None)

    def tie(
        self,
        ks: KeepView,
        node: gs.Node,
        got: tuple[int, int, int, int],
        head_of: np.ndarray,
        caches: list[gs.Tensor],
        mask: gs.Tensor | None,
    ) -> None:
        """Records (for the coupled groups) what goes with a head: its output channels, its packed
        weight columns (`head_of`: each column's head), its slice of the caches [2, B, heads, T,
        d] and of a per-head attention bias [B, heads, S, T]."""
        heads, _, _, v = got
        wt, y = node.inputs[1], node.outputs[0]
        anchor = tie_heads(ks, y, v // heads, 1)
        if len(anchor) != heads:
            return
        ks.unit(wt, 1, np.arange(len(head_of)), y, 2, anchor[head_of])
        for t in caches:
            ks.unit(t, 2, np.arange(heads), y, 2, anchor)
        if mask is not None:
            ks.unit(mask, 1, np.arange(heads), y, 2, anchor)

    def caches(self, node: gs.Node, ks: KeepView, heads: int) -> list[gs.Tensor] | None:
        """The past input and the present output when read, each [2, B, heads, T, d]: a head's
        slice of the cache goes with it. None when something carries every head: a cache of
        another layout, an attention bias whose head axis is not the heads, another output read."""
        ab = ir.present(node, 5)
        if ab is not None and (ir.rank(ab) != 4 or ir.static_dim(ab, 1) not in (1, heads)):
            return None
        past = ir.present(node, 4)
        found = [past] if past is not None else []
        found += [t for t in node.outputs[1:2] if ks.is_read(t)]
        if any(ks.is_read(t) for t in node.outputs[2:]):
            return None
        if any(ir.rank(t) != 5 or ir.static_dim(t, 2) != heads for t in found):
            return None
        return found

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        w = rw.original(node.inputs[1])
        got = self.sizes(node, w)
        kept = rw.kept(node.inputs[1], 1)
        if got is None or kept is None:
            return
        heads, q, k, v = got
        now = int(kept[:q].sum()) // (q // heads)
        set_attr(node, "num_heads", heads, now)
        if node.attrs.get("qkv_hidden_sizes"):
            node.attrs["qkv_hidden_sizes"] = [
                int(kept[:q].sum()),
                int(kept[q : q + k].sum()),
                int(kept[q + k :].sum()),
            ]


# ------------------------------------------------------------------ packed-hidden forms
@dataclass
class _Roles:
    """A packed-hidden attention node's inputs by what they hold of the heads."""

    q: gs.Tensor
    packed: bool  # Q, K and V packed in the query [B, S, (hq + 2 hkv) d]
    kv_ins: list[gs.Tensor]  # key and value inputs [B, S, hkv * d] (not packed, not split)
    split: list[tuple[gs.Tensor, int]]  # inputs whose heads are an axis, with it (`split_heads`)
    q_split: bool  # the query among them
    bias: gs.Tensor | None
    pasts: list[gs.Tensor]  # past key/value [B, hkv, P, d]
    mask: gs.Tensor | None  # an attention mask or bias with a query-head axis
    per_head: list[gs.Tensor]  # [hq] inputs (a head sink)

    def per_head_inputs(self) -> list[gs.Tensor]:
        """The inputs besides Q, K, V and bias that hold heads (the cache, mask, head sink)."""
        return [*self.pasts, *self.per_head, *([self.mask] if self.mask is not None else [])]


class _PackedHeads(Handler):
    """Query, key and value as [B, S, heads * head_dim] inputs (projected before the op)."""

    evaluate_with_ort = True
    head_attrs = ("num_heads", "kv_num_heads")
    #: input slots: query, key, value, packed bias (None: no bias input)
    slots: tuple[int, int, int, int | None] = (0, 1, 2, 3)
    #: inputs that carry every head when present and not one value (a quantized cache's scales)
    all_heads_inputs: tuple[int, ...] = ()
    #: 1-D inputs of one value per query head ([heads]: a head sink): a head's value goes with it
    per_head_slots: tuple[int, ...] = ()
    #: past key/value inputs ([B, kv heads, P, d]): each K/V head's cache goes with it
    past_slots: tuple[int, ...] = ()
    #: an attention mask that may have a head axis ([.., heads or 1, q, k])
    mask_slot: int | None = None

    def extends(self, node: OpNode) -> dict[int, tuple[int, int]]:
        """present_key/value (outputs 1 and 2): past_key/value [B, heads, P, d] (in a 3-D form
        too) with this step's keys/values appended along the sequence (or written into a shared
        buffer's next positions)."""
        return {o: (i, 2) for o, i in zip((1, 2), self.past_slots, strict=True) if node.has_input(i)}

    def head_counts(self, node: gs.Node | OpNode) -> tuple[int, int] | None:
        """(query heads, key/value heads)."""
        raise NotImplementedError

    def layout(self, node: gs.Node) -> tuple[int, int, int, int, bool] | None:
        """(query heads, K/V heads, head_dim, value head_dim, packed QKV in the query input)."""
        counts = self.head_counts(node)
        qi, ki, vi, _ = self.slots
        q, k, v = (ir.present(node, i) for i in (qi, ki, vi))
        if counts is None or q is None or ir.rank(q) != 3:
            return None
        hq, hkv = counts
        if hq <= 0 or hkv <= 0 or hq % hkv:
            return None
        qs = ir.static_dim(q, 2)
        if k is None and v is None:  # packed: [B, S, (hq + 2 hkv) * d]
            if qs is None or qs % (hq + 2 * hkv):
                return None
            d = qs // (hq + 2 * hkv)
            return hq, hkv, d, d, True
        ks_, vs = (ir.static_dim(t, 2) if t is not None and ir.rank(t) == 3 else None for t in (k, v))
        if qs is None or ks_ is None or vs is None or qs % hq or ks_ % hkv or vs % hkv:
            return None
        if qs // hq != ks_ // hkv:
            return None
        return hq, hkv, qs // hq, vs // hkv, False

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        got = self.layout(node)
        if got is None or got[4] or self.split_heads(node):
            return None
        hq, hkv, d, dv, _ = got
        _, _, vi, bi = self.slots
        bias = ctx.value(ir.present(node, bi)) if bi is not None else None
        if bi is not None and ir.present(node, bi) is not None and bias is None:
            return None
        dead_kv = zero_heads(ctx.const(node.inputs[vi]), 2, hkv * dv, hkv)
        if bias is not None:
            off = hq * d + hkv * d
            dead_kv &= (bias[off : off + hkv * dv] == 0).reshape(hkv, dv).all(axis=1)
        if not dead_kv.any():
            return None
        dead = np.repeat(dead_kv, hq // hkv)  # a zero V head: its query heads output zero
        y = node.outputs[0]
        dtype = np.dtype(y.dtype) if y.dtype is not None else np.dtype(np.float32)
        mask = np.repeat(dead, dv).reshape(1, 1, hq * dv)
        return [ConstInfo(mask, np.zeros((1, 1, 1), dtype))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        got = self.layout(node)
        y = node.outputs[0]
        if got is None or ir.rank(y) != 3:
            ks.barrier(node, Reason("barrier", node.name, node.op, "head layout unknown"))
            return
        hq, hkv = got[0], got[1]
        roles = self.roles(node, got)
        self.demand(node, ks, roles)
        self.structure(node, ks, roles)
        if self.every_head(node, ks, node.outputs[3:], hq, hkv):
            every_head(ks, node, y, "a per-head input or output")
        need_q, need_kv = self.needed_heads(node, ks, got, roles)
        q_heads, kv_heads = grouped(need_q, need_kv, hq // hkv)
        self.keep_heads(node, ks, got, roles, q_heads, kv_heads)
        self.tie(ks, node, got, roles.pasts, roles.mask)

    def roles(self, node: gs.Node, got: tuple[int, int, int, int, bool]) -> _Roles:
        """The node's inputs by what they hold of the heads (`got`: its `layout`)."""
        hq, hkv, _, _, packed = got
        qi, ki, vi, bi = self.slots
        q = node.inputs[qi]
        split = self.split_heads(node)
        kv_ins = [] if packed else [ir.present(node, ki), ir.present(node, vi)]
        return _Roles(
            q,
            packed,
            [t for t in kv_ins if t is not None and not any(t is u for u, _ in split)],
            split,
            any(q is t for t, _ in split),
            ir.present(node, bi) if bi is not None else None,
            self.pasts(node, hkv),
            self.head_mask(node, hq),
            self.per_head(node, hq),
        )

    def demand(self, node: gs.Node, ks: KeepView, roles: _Roles) -> None:
        """Every input: those holding heads constrained here, the others whole."""
        qi, ki, vi, bi = self.slots
        ours = roles.per_head_inputs()
        for t in [roles.q, *roles.kv_ins, *(t for t, _ in roles.split), roles.bias, *ours]:
            ks.demand(t, pin=False)
        for i, t in enumerate(node.inputs):
            if i not in (qi, ki, vi, bi) and not any(t is o for o in ours):
                ks.demand(t if t is not None and t.name else None)

    def structure(self, node: gs.Node, ks: KeepView, roles: _Roles) -> None:
        """Batch tied to the output's, every position a key, a head's dims and parts whole."""
        y, q = node.outputs[0], roles.q
        ks.couple(q, 0, y, 0)
        ks.couple(q, 1, y, 1)
        key = Reason("structure", node.name, node.op, "every position is a key")
        for t in roles.kv_ins:
            ks.couple(t, 0, y, 0)
            ks.pin(t, 1, key)
        if roles.packed or roles.q_split:
            ks.pin(q, 1, key)
        for t, a in roles.split:  # heads an axis; the positions, parts (Q, K, V) and a head's dims whole
            ks.couple(t, 0, y, 0)
            for b in range(1, ir.rank(t) or 0):
                if b != a:
                    ks.pin(t, b, Reason("structure", node.name, node.op, "a head's positions, parts and dims go together"))
        for t in roles.pasts:  # [B, kv heads, past positions, d]: a K/V head's slice of the cache
            ks.couple(t, 0, y, 0)
            ks.pin(t, 2, key)
            ks.pin(t, 3, Reason("structure", node.name, node.op, "a head's dims go together"))
        pin_but_heads(ks, node, roles.mask)

    def needed_heads(
        self, node: gs.Node, ks: KeepView, got: tuple[int, int, int, int, bool], roles: _Roles
    ) -> tuple[np.ndarray, np.ndarray]:
        """(query heads, K/V heads) a kept output or another reader of an input reads (what
        other readers keep of the inputs stays too, and only as whole heads)."""
        hq, hkv, d, _, packed = got
        need_q = heads_read(ks.kept(node.outputs[0], 2), hq)
        need_kv = np.zeros(hkv, bool)
        kq = ks.kept(roles.q, 2)
        if packed:
            kq = np.ones((hq + 2 * hkv) * d, bool) if kq is None else kq
            need_q |= heads_read(kq[: hq * d], hq)
            need_kv |= heads_read(kq[hq * d : (hq + hkv) * d], hkv)
            need_kv |= heads_read(kq[(hq + hkv) * d :], hkv)
        else:
            need_q |= heads_read(kq, hq)
            for t in roles.kv_ins:
                need_kv |= heads_read(ks.kept(t, 2), hkv)
        for t, a in roles.split:  # its query heads are its K/V heads (layout: hq == hkv)
            need_kv |= heads_read(ks.kept(t, a), hkv)
        for t in roles.pasts:
            need_kv |= heads_read(ks.kept(t, 1), hkv)
        if roles.mask is not None:
            need_q |= heads_read(ks.kept(roles.mask, mask_heads(roles.mask)), hq)
        for t in roles.per_head:
            need_q |= heads_read(ks.kept(t, 0), hq)
        for out in node.outputs[1:3]:  # present key / value: [B, kv heads, T, d]
            if ks.is_read(out):
                need_kv |= heads_read(ks.kept(out, 1) if ir.rank(out) == 4 else None, hkv)
        return need_q, need_kv

    def keep_heads(
        self,
        node: gs.Node,
        ks: KeepView,
        got: tuple[int, int, int, int, bool],
        roles: _Roles,
        q_heads: np.ndarray,
        kv_heads: np.ndarray,
    ) -> None:
        """Keep the kept heads' blocks of every input and output that holds heads."""
        _, _, d, dv, packed = got
        y, q = node.outputs[0], roles.q
        why = Reason("structure", node.name, node.op, "a head's dims go together")
        keep_blocks(ks, y, 2, np.repeat(q_heads, dv), why)
        qcols = np.repeat(q_heads, d)
        kcols, vcols = np.repeat(kv_heads, d), np.repeat(kv_heads, dv)
        if packed:
            keep_blocks(ks, q, 2, np.concatenate([qcols, kcols, vcols]), why)
        elif not roles.q_split:
            keep_blocks(ks, q, 2, qcols, why)
        for t, cols in zip(roles.kv_ins, (kcols, vcols), strict=False):
            keep_blocks(ks, t, 2, cols, why)
        for t, a in roles.split:
            keep_blocks(ks, t, a, q_heads if t is q else kv_heads, why)
        if roles.bias is not None:
            keep_blocks(ks, roles.bias, 0, np.concatenate([qcols, kcols, vcols]), why)
        for t in roles.pasts:
            keep_blocks(ks, t, 1, kv_heads, why)
        if roles.mask is not None:
            keep_blocks(ks, roles.mask, mask_heads(roles.mask), q_heads, why)
        for t in roles.per_head:
            keep_blocks(ks, t, 0, q_heads, why)
        for out in node.outputs[1:3]:
            keep_head_axis(ks, out, kv_heads, y, why)
        for out in node.outputs[3:]:
            ks.pin(out)

    def tie(
        self,
        ks: KeepView,
        node: gs.Node,
        got: tuple[int, int, int, int, bool],
        pasts: list[gs.Tensor],
        mask: gs.Tensor | None,
    ) -> None:
        """Records (for the coupled groups) what goes with a K/V head: its query heads' output
        channels, query, key and value dims (and bias), its slice of the cache, and its query
        heads' slices of a per-head attention bias and of per-head inputs (a head sink). With
        grouped-query attention, also the other way to cut them (`tie_ranks`)."""
        hq, hkv, d, dv, packed = got
        rep = hq // hkv
        y = node.outputs[0]
        split = self.split_heads(node)
        ranks = rep > 1 and not split
        which = WITH_KV_HEAD if ranks else None  # one of two ways to cut them: `tie_ranks`
        anchor = tie_heads(ks, y, dv, rep, which)
        if len(anchor) != hkv:
            return
        if ranks:
            self.tie_ranks(ks, node, got, pasts, mask)
        qg, kg, vg = np.arange(hq * d) // (d * rep), np.arange(hkv * d) // d, np.arange(hkv * dv) // dv
        qi, ki, vi, bi = self.slots
        parts = [(node.inputs[qi], np.concatenate([qg, kg, vg]) if packed else qg)]
        if not packed:
            parts += [(ir.present(node, ki), kg), (ir.present(node, vi), vg)]
        bias = ir.present(node, bi) if bi is not None else None
        for t, groups_of in parts:
            if t is not None and not any(t is u for u, _ in split) and ks.size(t, 2) == len(groups_of):
                ks.unit(t, 2, np.arange(len(groups_of)), y, 2, anchor[groups_of], which)
        for t, a in split:  # heads an axis: query heads (of their K/V heads) or K/V heads
            groups_of = np.arange(hq) // rep if t is node.inputs[qi] else np.arange(hkv)
            ks.unit(t, a, np.arange(len(groups_of)), y, 2, anchor[groups_of])
        if bias is not None and ks.size(bias, 0) == (hq + hkv) * d + hkv * dv:
            bias_of = anchor[np.concatenate([qg, kg, vg])]
            ks.unit(bias, 0, np.arange(len(bias_of)), y, 2, bias_of, which)
        for t in [*pasts, *node.outputs[1:3]]:
            if ir.rank(t) == 4 and ks.size(t, 1) == hkv:
                ks.unit(t, 1, np.arange(hkv), y, 2, anchor, which)
        if mask is not None:
            ks.unit(mask, mask_heads(mask), np.arange(hq), y, 2, anchor[np.arange(hq) // rep], which)
        for t in self.per_head(node, hq):
            ks.unit(t, 0, np.arange(hq), y, 2, anchor[np.arange(hq) // rep], which)

    def tie_ranks(
        self,
        ks: KeepView,
        node: gs.Node,
        got: tuple[int, int, int, int, bool],
        pasts: list[gs.Tensor],
        mask: gs.Tensor | None,
    ) -> None:
        """The other way to cut grouped-query attention into units (`BY_RANK`):
        query head j * rep + r is removed with the query heads of rank r in every other K/V
        group (the kept query heads are a product, `grouped`: a rank gone from every group
        leaves each K/V head serving rep - 1), with its output channels, query dims, bias and
        per-head slices; a K/V head's key and value dims and cache go together, alone."""
        hq, hkv, d, dv, packed = got
        rep = hq // hkv
        y = node.outputs[0]
        rank_at = np.arange(hq) % rep * dv  # each query head's rank, tied at that rank's first y channel
        ks.unit(y, 2, np.arange(hq * dv), y, 2, rank_at[np.arange(hq * dv) // dv], BY_RANK)
        qi, ki, vi, bi = self.slots
        q = node.inputs[qi]
        q_rank = rank_at[np.arange(hq * d) // d]
        # each K/V head's key and value dims, tied at its first key dim (`layout`: the packed
        # query [B, S, (hq + 2 hkv) d], or key and value inputs [B, S, hkv d])
        kt = q if packed else node.inputs[ki]
        first = (hq * d if packed else 0) + np.arange(hkv) * d
        k_of, v_of = first[np.arange(hkv * d) // d], first[np.arange(hkv * dv) // dv]
        if packed:  # (one call per pair of axes: the log keeps the last)
            parts = [(q, 0, q_rank, y), (q, hq * d, np.concatenate([k_of, v_of]), kt)]
        else:
            parts = [(q, 0, q_rank, y), (kt, 0, k_of, kt), (node.inputs[vi], 0, v_of, kt)]
        width = (hq + 2 * hkv) * d if packed else None  # the packed query's
        for t, off, at, to in parts:
            if ks.size(t, 2) == (width or len(at)):
                ks.unit(t, 2, off + np.arange(len(at)), to, 2, at, BY_RANK)
        for t in [*pasts, *node.outputs[1:3]]:
            if ir.rank(t) == 4 and ks.size(t, 1) == hkv:
                ks.unit(t, 1, np.arange(hkv), kt, 2, first, BY_RANK)
        bias = ir.present(node, bi) if bi is not None else None
        if bias is not None and ks.size(bias, 0) == (hq + hkv) * d + hkv * dv:
            ks.unit(bias, 0, np.arange(hq * d), y, 2, q_rank, BY_RANK)
            ks.unit(bias, 0, hq * d + np.arange(hkv * (d + dv)), kt, 2, np.concatenate([k_of, v_of]), BY_RANK)
        if mask is not None:
            ks.unit(mask, mask_heads(mask), np.arange(hq), y, 2, rank_at, BY_RANK)
        for t in self.per_head(node, hq):
            ks.unit(t, 0, np.arange(hq), y, 2, rank_at, BY_RANK)

    def split_heads(self, node: gs.Node) -> list[tuple[gs.Tensor, int]]:
        """Inputs whose heads are an axis of their own, with that axis, as `layout` accepted them
        (MultiHeadAttention's packed QKV or KV [B, S, heads, parts, head_dim]: 2; its keys and
        values given per head [B, heads, L, head_dim]: 1)."""
        return []

    def per_head(self, node: gs.Node, hq: int) -> list[gs.Tensor]:
        """The per-query-head inputs present, when they are [`hq`]."""
        found = [ir.present(node, i) for i in self.per_head_slots]
        return [t for t in found if t is not None and ir.rank(t) == 1 and ir.static_dim(t, 0) == hq]

    def input_dims(
        self, node: OpNode, dims: Callable[[str], Sequence[int | None] | None]
    ) -> Mapping[int, Mapping[int, int]]:
        """The past key and value [B, kv heads, P, head size]: their K/V head count, and their
        head sizes from the static hidden sizes of the query (packed QKV: (heads + 2 kv heads)
        x head size, the value's the same) and of the value; nothing where those are unknown or
        do not divide."""
        counts = self.head_counts(node)
        qi, ki, vi, _ = self.slots
        if counts is None or not any(node.has_input(i) for i in self.past_slots):
            return {}
        hq, hkv = counts

        def hidden(i: int) -> int | None:
            d = dims(node.inputs[i]) if node.has_input(i) else None
            return d[2] if d is not None and len(d) == 3 else None

        q = hidden(qi)
        if not node.has_input(ki) and not node.has_input(vi):  # packed QKV
            d = q // (hq + 2 * hkv) if q is not None and q % (hq + 2 * hkv) == 0 else None
            sizes = [d, d]
        else:
            v = hidden(vi)
            sizes = [q // hq if q is not None and q % hq == 0 else None,
                     v // hkv if v is not None and v % hkv == 0 else None]  # fmt: skip
        out: dict[int, dict[int, int]] = {}
        for i, size in zip(self.past_slots, sizes, strict=True):
            if node.has_input(i):
                out[i] = {1: hkv} if size is None else {1: hkv, 3: size}
        return out

    def head_mask(self, node: gs.Node, hq: int) -> gs.Tensor | None:
        """The attention mask or bias when it has an axis of the `hq` query heads ([.., hq, S, T]):
        a query head's slice of it goes with the head."""
        m = ir.present(node, self.mask_slot) if self.mask_slot is not None else None
        if m is None or (ir.rank(m) or 0) < 3 or hq == 1 or ir.static_dim(m, -3) != hq:
            return None
        return m

    def pasts(self, node: gs.Node, hkv: int) -> list[gs.Tensor]:
        """The past key/value inputs present, when they are [B, `hkv` heads, P, d]."""
        found = [ir.present(node, i) for i in self.past_slots]
        return [t for t in found if t is not None and ir.rank(t) == 4 and ir.static_dim(t, 1) == hkv]

    def every_head(self, node: gs.Node, ks: KeepView, outputs: Sequence[gs.Tensor], hq: int, hkv: int) -> bool:
        """Inputs that carry every head (a quantized cache's scales, a head sink, mask or cache
        whose head axis is not the heads) or other outputs that are read with one (the scores):
        no head can go."""
        for i in self.all_heads_inputs:
            t = ir.present(node, i)
            if t is not None and any(d != 1 for d in ir.dims(t) or [None]):
                return True
        present = [i for i in self.past_slots if ir.present(node, i) is not None]
        if len(self.pasts(node, hkv)) != len(present):
            return True
        if len(self.per_head(node, hq)) != sum(ir.present(node, i) is not None for i in self.per_head_slots):
            return True
        mask = ir.present(node, self.mask_slot) if self.mask_slot is not None else None
        if mask is not None and (ir.rank(mask) or 0) >= 3 and ir.static_dim(mask, -3) != 1:
            return self.head_mask(node, hq) is None
        return any(ks.is_read(t) for t in outputs)

    def head_axis(self, node: gs.Node) -> HeadAxis | None:
        got = self.layout(node)
        if got is None:
            return None
        qi, ki, vi, _ = self.slots
        kv = [(qi, 2)] if got[4] else [(ki, 2), (vi, 2)]
        kv += [(i, 1) for i in self.past_slots]
        return HeadAxis(0, 2, got[3], got[2], got[0] // got[1], tuple(kv))

    def kept_heads(self, node: gs.Node, rw: RewriteView) -> tuple[int, int] | None:
        got = self.layout(node)
        k = rw.kept(node.outputs[0], 2)
        if got is None or k is None:
            return None
        hq, hkv, d, dv, _ = got
        q_heads = heads_read(k, hq)
        kv = q_heads.reshape(hkv, hq // hkv).any(axis=1)
        return int(q_heads.sum()), int(kv.sum())


@register("MultiHeadAttention", domain=MS)
class MultiHeadAttention(_PackedHeads):
    """query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value, ..."""

    slots = (0, 1, 2, 3)
    past_slots = (6, 7)
    mask_slot = 5  # attention_bias

    def head_counts(self, node: gs.Node | OpNode) -> tuple[int, int] | None:
        heads = int_attr(node, "num_heads", 0)
        return (heads, heads) if heads > 0 else None

    def layout(self, node: gs.Node) -> tuple[int, int, int, int, bool] | None:
        """Also the packed forms: QKV in the query, [B, S, heads, 3, d] (key and value absent),
        or KV in the key, [B, L, heads, 2, d] (value absent); the heads are their axis 2. And
        keys and values per head, [B, heads, L, d] (a cross-attention's cache), without a bias."""
        q, k, v = (ir.present(node, i) for i in (0, 1, 2))
        if q is not None and k is not None and v is not None and ir.rank(k) == 4 and ir.rank(v) == 4:
            return self.per_head_kv(node, q, k, v)
        if q is None or not (ir.rank(q) == 5 or (k is not None and ir.rank(k) == 5)):
            return super().layout(node)
        counts = self.head_counts(node)
        five = q if ir.rank(q) == 5 else k
        assert five is not None
        parts = 3 if five is q else 2
        if counts is None or v is not None or (five is q and k is not None):
            return None
        heads, d = counts[0], ir.static_dim(five, 4)
        if ir.static_dim(five, 2) != heads or ir.static_dim(five, 3) != parts or not d:
            return None
        if five is k and (ir.rank(q) != 3 or ir.static_dim(q, 2) != heads * d):
            return None
        return heads, heads, d, d, False

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        """The output [B, S, heads * dv] where shape inference leaves it unknown (onnxruntime's
        gives none with keys and values per head)."""
        got = self.layout(node)
        qd = ir.dims(node.inputs[0])
        if got is None or qd is None or len(qd) not in (3, 5):
            return None
        return [qd[0], qd[1], got[0] * got[3]]

    def per_head_kv(
        self, node: gs.Node, q: gs.Tensor, k: gs.Tensor, v: gs.Tensor
    ) -> tuple[int, int, int, int, bool] | None:
        """Keys and values [B, heads, L, d] and [B, heads, L, dv] with a query [B, S, heads * d]."""
        counts = self.head_counts(node)
        if counts is None or ir.present(node, self.slots[3]) is not None or ir.rank(q) != 3:
            return None  # a bias's K and V parts would be added to given keys and values: not read here
        heads = counts[0]
        d, dv = ir.static_dim(k, 3), ir.static_dim(v, 3)
        if ir.static_dim(k, 1) != heads or ir.static_dim(v, 1) != heads or not d or not dv:
            return None
        if ir.static_dim(q, 2) != heads * d:
            return None
        return heads, heads, d, dv, False

    def split_heads(self, node: gs.Node) -> list[tuple[gs.Tensor, int]]:
        if self.layout(node) is None:
            return []
        return [
            (t, 2 if ir.rank(t) == 5 else 1)
            for t in node.inputs[:3]
            if t is not None and t.name and ir.rank(t) in (4, 5)
        ]

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        got = self.kept_heads(node, rw)
        if got is not None:
            set_attr(node, "num_heads", int(node.attrs["num_heads"]), got[0])


@register("GroupQueryAttention", domain=MS)
class GroupQueryAttention(_PackedHeads):
    """query, key, value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache,
    sin_cache, position_ids, attention_bias, head_sink, k_scale, v_scale, q_norm_weight,
    k_norm_weight, query_seqlens; a K/V head serves num_heads / kv_num_heads query heads.
    The Q/K norm weights are [head_size], shared by the heads."""

    slots = (0, 1, 2, None)
    per_head_slots = (11,)  # head_sink [num_heads]
    all_heads_inputs = (12, 13)  # k_scale, v_scale of a quantized cache (per channel: unread here)
    past_slots = (3, 4)
    mask_slot = 10  # attention_bias

    def head_counts(self, node: gs.Node | OpNode) -> tuple[int, int] | None:
        hq, hkv = int_attr(node, "num_heads", 0), int_attr(node, "kv_num_heads", 0)
        return (hq, hkv) if hq > 0 and hkv > 0 else None

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        got = self.kept_heads(node, rw)
        if got is not None:
            set_attr(node, "num_heads", int(node.attrs["num_heads"]), got[0])
            set_attr(node, "kv_num_heads", int(node.attrs["kv_num_heads"]), got[1])


# ------------------------------------------------------------------ ONNX Attention (opset 23)
@register("Attention", since=23)
class OnnxAttention(_PackedHeads):
    """Q, K, V, attn_mask, past_key, past_value[, nonpad_kv_seqlen] -> Y, present_key,
    present_value, qk_matmul_output. 4-D inputs ([B, heads, seq, head_dim]) have heads as an
    axis; 3-D inputs pack them ([B, seq, heads * head_dim], with q_num_heads/kv_num_heads)."""

    slots = (0, 1, 2, None)
    past_slots = (4, 5)
    mask_slot = 3
    head_attrs = ("q_num_heads", "kv_num_heads")

    def head_counts(self, node: gs.Node | OpNode) -> tuple[int, int] | None:
        hq, hkv = int_attr(node, "q_num_heads", 0), int_attr(node, "kv_num_heads", 0)
        return (hq, hkv) if hq > 0 and hkv > 0 else None

    def four_d(self, node: gs.Node) -> tuple[int, int] | None:
        """(query heads, K/V heads) of the 4-D form, when static."""
        q, k, v = node.inputs[:3]
        if not all(ir.rank(t) == 4 for t in (q, k, v, node.outputs[0])):
            return None
        hq, hkv = ir.static_dim(q, 1), ir.static_dim(k, 1)
        if hq is None or hkv is None or hq % hkv or ir.static_dim(v, 1) != hkv:
            return None
        return hq, hkv

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        if ir.rank(node.inputs[0]) == 3:
            return super().constants(node, ctx)
        got = self.four_d(node)
        c = ctx.const(node.inputs[2])
        if got is None or c is None:
            return None
        hq, hkv = got
        shape = np.broadcast_shapes(c.mask.shape, c.value.shape)
        zero = (np.broadcast_to(c.mask, shape) & (np.broadcast_to(c.value, shape) == 0)).all(
            axis=(0, 2)
        )  # [kv heads or 1, dv or 1]: V's zero columns, per K/V head
        if not zero.any():
            return None
        if zero.shape[0] == hkv and hq != hkv:
            zero = np.repeat(zero, hq // hkv, axis=0)  # each query head reads its K/V head
        return [ConstInfo(zero[None, :, None, :], np.zeros((1, 1, 1, 1), c.value.dtype))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        if ir.rank(node.inputs[0]) == 3:
            super().keep(node, ks)
            return
        got = self.four_d(node)
        q, k, v = node.inputs[:3]
        y = node.outputs[0]
        if got is None:
            ks.barrier(node, Reason("barrier", node.name, node.op, "head counts unknown"))
            return
        hq, hkv = got
        pasts = self.pasts(node, hkv)
        mask = self.head_mask(node, hq)
        ours = [*pasts, mask] if mask is not None else pasts
        for t in (q, k, v, *ours):
            ks.demand(t, pin=False)
        for t in node.inputs[3:]:
            if not any(t is o for o in ours):
                ks.demand(t if t is not None and t.name else None)
        key = Reason("structure", node.name, node.op, "every position is a key")
        dims = Reason("structure", node.name, node.op, "query and key dims are contracted")
        ks.couple(q, 0, y, 0)
        ks.couple(q, 2, y, 2)
        ks.couple(v, 3, y, 3)  # output column j is probs @ V[..., j]
        for t in (k, v):
            ks.couple(t, 0, y, 0)
            ks.pin(t, 2, key)
        ks.pin(q, 3, dims)
        ks.pin(k, 3, dims)
        for t in pasts:  # [B, kv heads, past positions, d]
            ks.couple(t, 0, y, 0)
            ks.pin(t, 2, key)
            ks.pin(t, 3, dims)
        pin_but_heads(ks, node, mask)
        need_q, need_kv = self.four_d_needs(node, ks, got, pasts, mask)
        q_heads, kv_heads = grouped(need_q, need_kv, hq // hkv)
        why = Reason("structure", node.name, node.op, "a head's query, key and value go together")
        for t in (q, y):
            keep_blocks(ks, t, 1, q_heads, why)
        for t in (k, v, *pasts):
            keep_blocks(ks, t, 1, kv_heads, why)
        if mask is not None:
            keep_blocks(ks, mask, mask_heads(mask), q_heads, why)
        for j, out in enumerate(node.outputs[1:3]):
            keep_head_axis(ks, out, kv_heads, y, why, last=v if j == 1 else None)
        qk = node.outputs[3] if len(node.outputs) > 3 else None
        if qk is not None:
            keep_head_axis(ks, qk, q_heads, y, why)
        self.tie_four_d(ks, node, got, pasts, mask)

    def four_d_needs(
        self, node: gs.Node, ks: KeepView, got: tuple[int, int], pasts: list[gs.Tensor], mask: gs.Tensor | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The 4-D form's (query heads, K/V heads) read: by the kept outputs (the scores too), by
        other readers of the inputs; all where something carries every head."""
        hq, hkv = got
        q, k, v = node.inputs[:3]
        need_q = heads_read(ks.kept(node.outputs[0], 1), hq) | heads_read(ks.kept(q, 1), hq)
        need_kv = heads_read(ks.kept(k, 1), hkv) | heads_read(ks.kept(v, 1), hkv)
        for t in pasts:
            need_kv |= heads_read(ks.kept(t, 1), hkv)
        if mask is not None:
            need_q |= heads_read(ks.kept(mask, mask_heads(mask)), hq)
        for out in node.outputs[1:3]:
            if ks.is_read(out):
                need_kv |= heads_read(ks.kept(out, 1) if ir.rank(out) == 4 else None, hkv)
        qk = node.outputs[3] if len(node.outputs) > 3 else None
        if qk is not None and ks.is_read(qk):
            need_q |= heads_read(ks.kept(qk, 1), hq) if ir.rank(qk) == 4 else True
        if self.every_head(node, ks, (), hq, hkv):
            need_q[:], need_kv[:] = True, True
        return need_q, need_kv

    def tie_four_d(
        self, ks: KeepView, node: gs.Node, got: tuple[int, int], pasts: list[gs.Tensor], mask: gs.Tensor | None
    ) -> None:
        """Records (for the coupled groups) that in the 4-D form a K/V head goes with its query
        heads (and their scores, mask slices, cache)."""
        hq, hkv = got
        q, k, v = node.inputs[:3]
        y = node.outputs[0]
        qk = node.outputs[3] if len(node.outputs) > 3 else None
        rep = hq // hkv
        group = np.arange(hq) // rep * rep  # each query head's group, by its first query head
        for t in (q, y, qk):
            if t is not None and ir.rank(t) == 4 and ks.size(t, 1) == hq:
                ks.unit(t, 1, np.arange(hq), y, 1, group)
        if mask is not None:
            ks.unit(mask, mask_heads(mask), np.arange(hq), y, 1, group)
        for t in (k, v, *pasts, *node.outputs[1:3]):
            if ir.rank(t) == 4 and ks.size(t, 1) == hkv:
                ks.unit(t, 1, np.arange(hkv), y, 1, np.arange(hkv) * rep)

    def head_axis(self, node: gs.Node) -> HeadAxis | None:
        if ir.rank(node.inputs[0]) == 3:
            return super().head_axis(node)
        d = ir.static_dim(node.inputs[0], 3)
        return HeadAxis(0, 1, 1, d) if self.four_d(node) is not None and d else None

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        if ir.rank(node.inputs[0]) != 3:
            return  # heads are an axis: nothing names their count
        got = self.kept_heads(node, rw)
        if got is not None:
            set_attr(node, "q_num_heads", int(node.attrs["q_num_heads"]), got[0])
            set_attr(node, "kv_num_heads", int(node.attrs["kv_num_heads"]), got[1])


# ------------------------------------------------------------------ rotary embeddings
class _Rotary(Handler):
    """Rotates pairs of dims within each head: [B, heads, S, d] (heads an axis) or
    [B, S, heads * d] (blocks). Heads pass through whole; the head dims stay."""

    evaluate_with_ort = True
    cos_slot = 2

    def head_size(self, node: gs.Node, hidden: int, reader: Reader) -> int | None:
        heads = int(node.attrs.get("num_heads", 0))
        if heads > 0:
            return hidden // heads if hidden % heads == 0 else None
        cos = ir.present(node, self.cos_slot)
        half = ir.static_dim(cos, -1) if cos is not None else None
        return 2 * half if half else None  # no num_heads: a head is the rotary dims

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        for i, t in enumerate(node.inputs):
            ks.demand(t if t is not None and t.name else None, pin=i != 0)
        why = Reason("structure", node.name, node.op, "rotations pair dims within a head")
        if r == 4 and ir.rank(y) == 4:
            for a in range(3):
                ks.couple(x, a, y, a)
            ks.pin(x, 3, why)
            ks.pin(y, 3, why)
            return
        hidden = ir.static_dim(x, 2) if r == 3 else None
        d = self.head_size(node, hidden, ks) if hidden else None
        if r != 3 or ir.rank(y) != 3 or hidden is None or d is None or hidden % d:
            ks.barrier(node, Reason("barrier", node.name, node.op, "head layout unknown"))
            return
        ks.couple(x, 0, y, 0)
        ks.couple(x, 1, y, 1)
        heads = hidden // d
        need = heads_read(ks.kept(y, 2), heads) | heads_read(ks.kept(x, 2), heads)
        for t in (x, y):
            keep_blocks(ks, t, 2, np.repeat(need, d), why)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        heads = int(node.attrs.get("num_heads", 0))
        k = rw.kept(node.outputs[0], 2) if ir.rank(node.outputs[0]) == 3 else None
        hidden = ir.static_dim(node.outputs[0], 2)
        if heads > 0 and k is not None and hidden:
            set_attr(node, "num_heads", heads, int(k.sum()) // (hidden // heads))


@register("RotaryEmbedding", domain=MS)
class ContribRotary(_Rotary):
    """input, position_ids, cos_cache, sin_cache."""

    cos_slot = 2


@register("RotaryEmbedding", since=23)
class OnnxRotary(_Rotary):
    """X, cos_cache, sin_cache[, position_ids]."""

    cos_slot = 1


# ------------------------------------------------------------------ oracle cases
def _attention_case(op: str, rng: np.random.Generator) -> OracleCase:
    """Fused attention, one of its forms at random; heads of 2 dims."""
    s, heads = int(rng.integers(2, 5)), int(rng.choice([2, 4]))
    d = 2
    h = heads * d
    if op == "MultiHeadAttention":
        ins = [("q", "float", [1, s, h]), ("k", "float", [1, s, h]), ("v", "float", [1, s, h]), ("B", "float", [3 * h])]
        body = f"y = com.microsoft.MultiHeadAttention <num_heads = {heads}> (q, k, v, B)"
        return OracleCase(op, MS_HEADER + sig(ins, [("y", [1, s, h])]) + f" {{ {body} }}", 17,
                          needs=needs(rng, "y", [1, s, h]))
    form = rng.choice(["contrib", "3d", "4d"])
    if form == "contrib":
        ins = [("x", "float", [1, s, 8]), ("W", "float", [8, 3 * h]), ("B", "float", [3 * h])]
        body = f"y = com.microsoft.Attention <num_heads = {heads}> (x, W, B)"
        return OracleCase(op, MS_HEADER + sig(ins, [("y", [1, s, h])]) + f" {{ {body} }}", 17,
                          zero={"W": np.s_[:, zero_rows(rng, 3 * h)]}, needs=needs(rng, "y", [1, s, h]))
    if form == "3d":
        ins = [("q", "float", [1, s, h]), ("k", "float", [1, s, h]), ("v", "float", [1, s, h])]
        body = f"y = Attention <q_num_heads = {heads}, kv_num_heads = {heads}> (q, k, v)"
        return OracleCase(op, OPSET23 + sig(ins, [("y", [1, s, h])]) + f" {{ {body} }}", 23,
                          needs=needs(rng, "y", [1, s, h]))
    kv = int(rng.choice([1, heads]))
    q, k = [1, heads, s, d], [1, kv, s, d]
    ins = [("q", "float", q), ("k", "float", k), ("v", "float", k)]
    body = f"y = Attention <is_causal = {int(rng.integers(0, 2))}> (q, k, v)"
    return OracleCase(op, OPSET23 + sig(ins, [("y", q)]) + f" {{ {body} }}", 23, needs=needs(rng, "y", q))


def _rotary_case(op: str, rng: np.random.Generator) -> OracleCase:
    s, heads, d = int(rng.integers(2, 5)), int(rng.choice([1, 2])), 4
    angles = np.arange(s)[:, None] * (1.0 / 10000 ** (np.arange(d // 2) / (d // 2)))[None, :]
    values = {"C": np.cos(angles), "S": np.sin(angles), "P": np.arange(s).reshape(1, s)}
    x = [1, s, heads * d]
    caches = [("C", "float", [s, d // 2]), ("S", "float", [s, d // 2]), ("P", "int64", [1, s])]
    if rng.random() < 0.5:
        body = f"y = com.microsoft.RotaryEmbedding <num_heads = {heads}> (x, P, C, S)"
        return OracleCase(op, MS_HEADER + sig([("x", "float", x), *caches], [("y", x)]) + f" {{ {body} }}",
                          17, values=values, needs=needs(rng, "y", x))
    body = f"y = RotaryEmbedding <num_heads = {heads}> (x, C, S, P)"
    return OracleCase(op, OPSET23 + sig([("x", "float", x), *caches], [("y", x)]) + f" {{ {body} }}",
                      23, values=values, needs=needs(rng, "y", x))


declare_cases(
    {"Attention": _attention_case, "MultiHeadAttention": _attention_case, "RotaryEmbedding": _rotary_case},
    excluded={
        "GroupQueryAttention": "empty optional inputs (past key/value) before the ones it needs, "
        "which the replay cannot feed; tests/ops/test_fused.py",
    },
)
