"""Conv and ConvTranspose (1d/2d/3d, grouped, depthwise): channels through weights, constants folded.

An output channel depends on the input channels of its group whose weights are not all zero.
An input channel no kept output reads is removable; so is a constant input channel, whose
contribution (it is input-independent) is folded:
- no padding, uniform constant: into the bias;
- zero padding (or a transposed conv), uniform constants: the contribution varies at the
  borders; it equals the same conv applied to a map of ones with the kernel
  sum over c of value(c) * W[:, c], which a one-input-channel conv adds at run time (exact for
  any spatial size; the main conv keeps exactly the channels native pruning would);
- otherwise, with static shapes: as one constant map added after the conv.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    BiasSlot,
    ConstInfo,
    ConstView,
    Handler,
    IntegerProduct,
    KeepView,
    OpNode,
    Reader,
    Reason,
    RewriteView,
    WeightAxes,
    compress,
    register,
    static_batch1,
)
from onnxshrink.ops.common import along, channel_expand
from onnxshrink.ops.oracle import OracleCase, declare_cases, needs, sig, zero_rows


class _ConvBase(Handler):
    transposed = False
    evaluate_with_ort = True

    # -------------------------------------------------------------- facts
    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        if i == 1 and rank >= 3:
            return WeightAxes(1, 0, "conv") if self.transposed else WeightAxes(0, 1, "conv")
        return WeightAxes(0, None, "vector") if i == 2 and rank == 1 else None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        return {"weight": 1, "bias": 2}

    def macs(self, node: OpNode, inputs: Sequence[list[int] | None], output: list[int]) -> int:
        x, w = inputs[0], inputs[1]
        if w is None:
            return 0
        if self.transposed:  # every input position scatters through the whole kernel
            return int(np.prod(x)) * int(np.prod(w[1:])) if x is not None else 0
        return int(np.prod(output)) * int(np.prod(w[1:]))

    # -------------------------------------------------------------- structure
    def layout(self, node: gs.Node, w: np.ndarray) -> tuple[int, int, int]:
        """(group, input channels, output channels)."""
        g = int(node.attrs.get("group", 1))
        if self.transposed:
            return g, w.shape[0], w.shape[1] * g
        return g, w.shape[1] * g, w.shape[0]

    def depends(self, node: gs.Node, w: np.ndarray) -> np.ndarray:
        """D[o, i]: output channel o reads input channel i with a non-zero weight."""
        g, ci, co = self.layout(node, w)
        cin, cout = ci // g, co // g
        nz = (w != 0).reshape(w.shape[0], w.shape[1], -1).any(axis=2)
        d = np.zeros((co, ci), dtype=bool)
        for k in range(g):
            o, i = slice(k * cout, (k + 1) * cout), slice(k * cin, (k + 1) * cin)
            d[o, i] = nz[i].T if self.transposed else nz[o]
        return d

    def no_padding(self, node: gs.Node) -> bool:
        auto = node.attrs.get("auto_pad", "NOTSET")
        auto = auto.decode() if isinstance(auto, bytes) else auto
        return auto in ("NOTSET", "VALID") and not any(node.attrs.get("pads", []) or [])

    def borders(self, node: gs.Node) -> bool:
        """Does a uniform input give a non-uniform output (zero padding, transposed taps)?"""
        return self.transposed or not self.no_padding(node)

    def constant_inputs(self, node: gs.Node, reader: Reader, x: gs.Tensor, ci: int) -> tuple[np.ndarray, ...]:
        """(free, border, varying) input channels by what folding their constant contribution
        takes: nothing (zero ones, and uniform ones without borders: into the bias); a border
        correction (uniform ones through padding or a transposed conv: a one-input-channel conv
        of their summed kernel); a constant map added after the conv (the rest, static shapes
        only: none with a dynamic size)."""
        c = reader.const(x)
        if c is None:
            return np.zeros(ci, bool), np.zeros(ci, bool), np.zeros(ci, bool)
        zero, uniform = c.slice_zero(1, ci), c.slice_uniform(1, ci)
        border = uniform & ~zero if self.borders(node) else np.zeros(ci, bool)
        varying = c.slice_constant(1, ci) & ~(zero | uniform)
        if static_batch1(x) is None or static_batch1(node.outputs[0]) is None:
            varying[:] = False
        return (zero | uniform) & ~border, border, varying

    def absorbable(self, node: gs.Node, ks: KeepView, x: gs.Tensor, w: np.ndarray, ky: np.ndarray) -> np.ndarray:
        """Input channels whose constant contribution can be folded exactly, and pays: counted,
        each fold is made only where what it stores is no larger than the weights the removal
        of the channels it folds takes out here (a channel's column: a filter's taps for every
        kept output of its group). A border correction stores a kernel per kept output, a
        constant map one map per kept output, whichever channels it folds, so a group of them
        folds whole or not at all (see `constant_inputs`)."""
        g, ci, co = self.layout(node, w)
        free, border, varying = ks.memo(("constant inputs", id(node)), lambda: self.constant_inputs(node, ks, x, ci))
        taps = int(np.prod(w.shape[2:]))
        column = np.repeat(ky.reshape(g, co // g).sum(axis=1), ci // g) * taps  # per input channel
        d = ks.memo(("depends", id(node)), lambda: self.depends(node, w))
        reads = d[ky].any(axis=0) if ky.any() else np.zeros(ci, bool)
        ok = free.copy()
        out = static_batch1(node.outputs[0])
        for folded, stored in ((border, taps), (varying, int(np.prod(out[2:])) if out is not None else 0)):
            folded = folded & reads  # the rest no kept output reads: removed without a fold
            if int(ky.sum()) * stored <= int(column[folded].sum()):
                ok |= folded
        return ok

    # -------------------------------------------------------------- forward
    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x, wt, bt = node.inputs[0], node.inputs[1], ir.present(node, 2)
        w = ctx.value(wt)
        r = ir.rank(node.outputs[0])
        if w is None or r is None:
            return None
        g, ci, co = self.layout(node, w)
        cx = ctx.const(x)
        in_const = cx.slice_constant(1, ci) if cx is not None else np.zeros(ci, bool)
        d = self.depends(node, w)
        out_const = ~(d & ~in_const[None, :]).any(axis=1)
        if not out_const.any():
            return None
        cb = ctx.const(bt) if bt is not None else ConstInfo.of_array(np.zeros(co, dtype=w.dtype))
        if cb is None or not cb.full:
            return None  # a bias computed from the inputs (not seen in practice)
        b = np.broadcast_to(cb.value.reshape(-1), (co,))
        reads_const = (d & in_const[None, :]).any(axis=1)
        if not (out_const & reads_const).any():
            # Only zeroed filters: the channel is the bias.
            return [ConstInfo(along(out_const, 1, r), along(np.asarray(b), 1, r))]
        xin = channel_expand(ctx, x)
        if xin is None:
            keep = out_const & ~reads_const
            return (
                [ConstInfo(along(keep, 1, r), along(np.asarray(b), 1, r))] if keep.any() else None
            )
        y = ctx.evaluate(node, [xin, w, b])[0]
        mask = np.broadcast_to(along(out_const, 1, r), y.shape)
        return [compress(mask, y)]

    # -------------------------------------------------------------- backward
    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, wt, bt, y = node.inputs[0], node.inputs[1], ir.present(node, 2), node.outputs[0]
        w = ks.value(wt)
        r = ir.rank(x)
        if w is None or r is None or ir.rank(y) != r:
            why = "weights are not constant" if w is None else "shape inference gave no shapes"
            ks.barrier(node, Reason("barrier", node.name, node.op, why))
            return
        g, ci, co = self.layout(node, w)
        if ks.size(x, 1) != ci or ks.size(y, 1) != co:
            ks.barrier(node, Reason("barrier", node.name, node.op, "channel count unknown"))
            return
        for t in (x, wt, bt):
            ks.demand(t, pin=False)
        self._tie(node, ks, g, ci, co)
        self._need_input_channels(node, ks, w, ci)

    def _tie(self, node: gs.Node, ks: KeepView, g: int, ci: int, co: int) -> None:
        """What the conv's structure ties: the batch passes through, the spatial axes keep every
        index, the weight's channel axes go with the input's and output's (per group), and a
        group's channels leave together."""
        x, wt, bt, y = node.inputs[0], node.inputs[1], ir.present(node, 2), node.outputs[0]
        r = ir.rank(x)
        assert r is not None  # checked by keep
        ks.couple(x, 0, y, 0)
        for a in range(2, r):
            ks.pin(x, a)
            ks.pin(y, a)
            ks.pin(wt, a)
        w_in, w_out = (0, 1) if self.transposed else (1, 0)
        if bt is not None:
            ks.couple(y, 1, bt, 0)
        if g == 1:
            ks.couple(x, 1, wt, w_in)
            ks.couple(y, 1, wt, w_out)
        elif self.transposed:
            ks.couple(x, 1, wt, 0)
            ks.pin(wt, 1)
        else:
            ks.couple(y, 1, wt, 0)
            ks.pin(wt, 1)
        inner = co // g if self.transposed else ci // g
        if g > 1 and inner > 1 and weight_holder(node, 1)[0] is None:
            cannot = Reason("barrier", node.name, node.op, "its computed weight cannot be cut per group")
            ks.pin(x, 1, cannot)
            ks.pin(y, 1, cannot)
        if g > 1:  # for the coupled groups: a conv group's channels leave together, both sides
            cin, cout = ci // g, co // g
            ks.unit(x, 1, np.arange(ci), y, 1, np.arange(ci) // cin * cout)
            ks.unit(y, 1, np.arange(co), y, 1, np.arange(co) // cout * cout)

    def _need_input_channels(self, node: gs.Node, ks: KeepView, w: np.ndarray, ci: int) -> None:
        """The input channels the kept output channels read through non-zero weights; those whose
        constant contribution cannot be folded away are kept."""
        x, y = node.inputs[0], node.outputs[0]
        d = ks.memo(("depends", id(node)), lambda: self.depends(node, w))
        ky = ks.kept(y, 1)
        assert ky is not None  # its size is static (checked above)
        absorb = self.absorbable(node, ks, x, w, ky)  # what a fold stores grows with ky
        reads = d[ky].any(axis=0) if ky.any() else np.zeros(ci, bool)
        cx = ks.const(x)
        if cx is not None:
            stuck = reads & ~absorb & cx.slice_constant(1, ci)
            if stuck.any():
                ks.keep(
                    x,
                    1,
                    stuck,
                    Reason(
                        "not-absorbable",
                        node.name,
                        node.op,
                        "its contribution varies over the map: folding it needs a constant map "
                        "(which a dynamic size rules out) or a border correction, either larger "
                        "than the weights its removal takes out",
                    ),
                )
        ks.need(x, 1, reads & ~absorb)

    def settle(self, node: gs.Node, ks: KeepView) -> None:
        w = ks.value(node.inputs[1])
        if w is None:
            return
        g, ci, co = self.layout(node, w)
        if g > 1:
            keep_groups(node, ks, node.inputs[0], node.outputs[0], g, ci // g, co // g)

    # -------------------------------------------------------------- rewrite
    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        x, wt, y = node.inputs[0], node.inputs[1], node.outputs[0]
        w0 = rw.original(wt)
        assert w0 is not None  # keep() made a node with a computed weight a barrier
        g, ci, co = self.layout(node, w0)
        kx, ky = rw.kept_static(x, 1), rw.kept_static(y, 1)
        self.fold(node, rw, x, w0, kx, ky, ci)
        if g > 1:
            regroup(node, rw, 1, g, kx, ky, self.transposed)

    def fold(self, node, rw: RewriteView, x, w0, kx, ky, ci) -> None:
        """Fold the contribution of removed constant input channels (see the module docstring)."""
        c = rw.const(x)
        d = rw.memo(("depends", id(node)), lambda: self.depends(node, w0))[ky]
        reads = d.any(axis=0)
        rw.check_removed_constant(node, c, 1, ~kx & reads)
        if c is None:
            return
        removed = ~kx & reads & ~c.slice_zero(1, ci)
        if not removed.any():
            return
        uniform = removed & c.slice_uniform(1, ci)
        if uniform.any():
            kernel = self.constant_kernel(c, w0, ky, uniform, node)
            if self.borders(node):
                self.border_correction(node, rw, kernel, int(uniform.sum()))
            else:  # every output position sees the whole kernel: a bias
                r = len(w0.shape)
                fold_into_bias(
                    rw,
                    node,
                    2,
                    kernel.reshape(1, len(kernel), -1).sum(-1).reshape((1, -1) + (1,) * (r - 2)),
                    1,
                    int(uniform.sum()),
                )
            removed &= ~uniform
            if not removed.any():
                return
        shape = static_batch1(x)
        if shape is None:  # dynamic spatial dims: uniform channels, no borders (see absorbable)
            k = node.attrs.get("kernel_shape") or list(w0.shape[2:])
            dil = node.attrs.get("dilations") or [1] * len(k)
            shape = [1, ci, *[(kk - 1) * dd + 1 for kk, dd in zip(k, dil, strict=True)]]
        xin = np.zeros(shape, dtype=w0.dtype)
        xin[:, removed] = np.broadcast_to(c.value, shape)[:, removed]
        contrib = rw.evaluate(node, [xin, w0])[0][:, ky]
        fold_into_bias(rw, node, 2, contrib, 1, int(removed.sum()))

    def constant_kernel(self, c, w0, ky, removed, node) -> np.ndarray:
        """K[o] = sum over removed inputs i of value(i) * W[o, i] (kept outputs o): what the
        removed uniform constants add, as a kernel over a map of ones."""
        g, ci, co = self.layout(node, w0)
        cin, cout = ci // g, co // g
        values = np.where(removed, c.slice_values(1, ci).astype(np.float64), 0.0)
        kept_out = np.flatnonzero(ky)
        grp = kept_out // cout  # each kept output's group: it reads that group's inputs
        v = values.reshape(g, cin)[grp]  # [kept outputs, inputs of their group]
        if self.transposed:  # W: [inputs, outputs per group, k...]
            w = w0.reshape(g, cin, cout, *w0.shape[2:])[grp, :, kept_out % cout]
        else:  # W: [outputs, inputs per group, k...]
            w = w0[kept_out]
        return np.einsum("oi,oi...->o...", v, w.astype(np.float64))

    def border_correction(self, node, rw: RewriteView, kernel: np.ndarray, n_channels: int) -> None:
        """y += conv(ones, K): the removed uniform constants' contribution, borders included."""
        dtype = _weight_dtype(rw, node)
        kernel = (kernel[None] if self.transposed else kernel[:, None]).astype(dtype)
        attrs = {k: val for k, val in node.attrs.items() if k != "group"}
        ones = rw.ones_map(node.inputs[0], dtype)
        weight = rw.constant(kernel, f"{node.name}_border")
        rw.add_to_output(node, 0, rw.add_node(node.op, [ones, weight], "border", attrs, dtype))
        rw.record_fold(node, n_channels, "border correction")


def fold_into_bias(
    rw: RewriteView,
    node: gs.Node,
    bias_index: int,
    contrib: np.ndarray,
    channel_axis: int,
    n_channels: int,
) -> None:
    """A per-channel bias input absorbs a uniform contribution; a non-uniform one (it varies over
    the map) is added after the node."""
    if not np.any(contrib):
        return  # zero constants (whole zeroed groups) contribute nothing
    co = contrib.shape[channel_axis]
    flat = np.moveaxis(contrib, channel_axis, 0).reshape(co, -1).astype(np.float64)
    scale = float(np.abs(flat).max()) if flat.size else 0.0
    if flat.shape[1] != 1 and not np.all(flat.max(axis=1) - flat.min(axis=1) <= 1e-6 * scale):
        rw.add_constant(node, 0, contrib, n_channels, into="constant map")
        return
    vec = flat.mean(axis=1)
    b = ir.present(node, bias_index)
    dtype = _weight_dtype(rw, node)
    r = ir.rank(node.outputs[0])
    if b is None and r is not None and r > channel_axis:
        # A bias-less conv followed by its bias Add (paddle2onnx writes Conv + Add of a
        # [1, C, 1, 1] constant): the Add's constant takes it, rather than a new bias input.
        per_channel = vec.reshape(co, *([1] * (r - channel_axis - 1))).astype(dtype)
        if rw.absorb_into_reader(node, 0, per_channel, n_channels):
            return
    if b is None or isinstance(b, gs.Constant):
        base = np.zeros(co) if b is None else np.asarray(b.values, dtype=np.float64)
        rw.replace_input(node, bias_index, (base + vec).astype(dtype))
    else:  # a bias computed at run time (optimize=False exports): add to it
        node.inputs[bias_index] = rw.add_node(
            "Add", [b, rw.constant(vec.astype(dtype), f"{node.name}_folded")], "bias", None, dtype
        )
    rw.record_fold(node, n_channels, "bias")


def _weight_dtype(rw: RewriteView, node: gs.Node) -> np.dtype:
    """The dtype of the node's weight: an initializer, or computed from initializers in the graph
    (a pruning hook's weight_orig * weight_mask in an export with optimize=False)."""
    w = rw.original(node.inputs[1])
    assert w is not None  # keep() made a node with a computed, non-constant weight a barrier
    return np.asarray(w).dtype


# Conv's attributes that place its window, which ConvInteger takes as they are
CONV_WINDOW = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


@register("Conv")
class Conv(_ConvBase):
    def qdq_form(self, node: OpNode) -> IntegerProduct:
        window = {k: v for k, v in node.attrs.items() if k in CONV_WINDOW}
        return IntegerProduct(window, out_axis=0, bias=2)

    channel_bias = BiasSlot(axis=1, bias=2, bias_layout=(0, 1), groups="group")  # B is [C]


@register("ConvTranspose")
class ConvTranspose(_ConvBase):
    transposed = True


def keep_groups(
    node: gs.Node,
    ks: KeepView,
    x: gs.Tensor,
    y: gs.Tensor,
    g: int,
    cin: int,
    cout: int,
) -> None:
    """Kept groups must all keep the same numbers of input and output channels. A group that
    keeps nothing on one side is active because of the other: what it adds there is kept
    for the other side's reason (a depthwise conv whose output channel stays keeps its input
    channel: the output's reason is the root cause); otherwise for the structure."""
    kx_all, ky_all = ks.kept(x, 1), ks.kept(y, 1)
    assert kx_all is not None and ky_all is not None  # static (keep() checked)
    kx, ky = kx_all.reshape(g, cin), ky_all.reshape(g, cout)
    active = kx.any(axis=1) | ky.any(axis=1)
    if not active.any():
        return
    n_in = max(1, int(kx[active].sum(axis=1).max()))
    n_out = max(1, int(ky[active].sum(axis=1).max()))
    rx, ry = ks.reason_ids(x, 1).reshape(g, cin), ks.reason_ids(y, 1).reshape(g, cout)
    add_x, add_y = np.zeros(g * cin, bool), np.zeros(g * cout, bool)
    why_x, why_y = np.full(g * cin, -1, np.int32), np.full(g * cout, -1, np.int32)
    sides = ((kx, n_in, add_x, why_x, cin, ry), (ky, n_out, add_y, why_y, cout, rx))
    for k in np.flatnonzero(active):
        for kept, n, add, why, size, other in sides:
            missing = n - int(kept[k].sum())
            if missing > 0:
                free = k * size + np.flatnonzero(~kept[k])[:missing]
                add[free] = True
                reasons = other[k][other[k] >= 0]
                if not kept[k].any() and len(reasons):
                    why[free] = reasons[0]
    structure = Reason(
        "structure", node.name, node.op, "every group of a grouped conv keeps as many channels"
    )
    for t, add, why in ((x, add_x, why_x), (y, add_y, why_y)):
        if add.any():
            ks.keep(t, 1, add & (why < 0), structure)
            if (why >= 0).any():
                ks.keep(t, 1, add & (why >= 0), why=why)


def regroup(
    node: gs.Node, rw: RewriteView, w_slot: int, g: int, kx: np.ndarray, ky: np.ndarray, transposed: bool
) -> None:
    """A grouped conv's `group` after whole groups left, and its weight's per-group input axis
    (when a group reads more than one channel) cut to the channels each group keeps."""
    cin, cout = len(kx) // g, len(ky) // g
    groups = ky.reshape(g, cout).any(axis=1)
    node.attrs["group"] = int(groups.sum())
    inner, outer = (cout, cin) if transposed else (cin, cout)
    k_inner = (ky if transposed else kx).reshape(g, inner)
    k_outer = (kx if transposed else ky).reshape(g, outer)
    if inner > 1:
        holder, slot = weight_holder(node, w_slot)
        assert holder is not None  # keep() pinned the channels of a weight it cannot cut
        w = rw.current(holder.inputs[slot])  # already sliced along the per-group (outer) axis
        rows = [np.flatnonzero(k_inner[k]) for k in range(g) for _ in range(int(k_outer[k].sum()))]
        rw.replace_input(
            holder, slot, np.stack([w[n, r] for n, r in enumerate(rows)]) if rows else w[:, :0]
        )


def weight_holder(node: gs.Node, w_slot: int) -> tuple[gs.Node | None, int]:
    """The node and input holding a grouped conv's weight as an initializer, to be cut per group:
    the conv itself, or the DequantizeLinear that dequantizes it for this conv alone with a scale
    and zero point per tensor or per output channel (the QDQ form); (None, 0) otherwise."""
    wt = node.inputs[w_slot]
    if isinstance(wt, gs.Constant):
        return node, w_slot
    dq = ir.producer(wt)
    if dq is None or dq.op != "DequantizeLinear" or len(wt.outputs) != 1:
        return None, 0
    q = dq.inputs[0]
    params = [t for t in dq.inputs[1:] if t is not None and t.name]
    per_output = int(dq.attrs.get("axis", 1)) in (0, -len(q.shape or [0]))
    if not isinstance(q, gs.Constant) or not all(
        isinstance(t, gs.Constant) and (t.values.size == 1 or per_output) for t in params
    ):
        return None, 0
    return dq, 0


# ------------------------------------------------------------------ oracle cases
def _conv_case(op: str, rng: np.random.Generator) -> OracleCase:
    cin = int(rng.choice([2, 4, 6]))
    group = int(rng.choice([g for g in (1, 2, cin) if cin % g == 0]))
    cout = group * int(rng.integers(1, 3))
    k = int(rng.choice([1, 3]))
    pad = k // 2 if rng.random() < 0.5 else 0
    h = w = 4
    if op == "Conv":
        wshape = [cout, cin // group, k, k]
        oh = h + 2 * pad - k + 1
    else:
        wshape = [cin, cout // group, k, k]
        oh = h - 2 * pad + k - 1
    y = [1, cout, oh, oh]
    attrs = f"<group = {group}, pads = [{pad}, {pad}, {pad}, {pad}]>"
    text = sig([("x", "float", [1, cin, h, w]), ("W", "float", wshape), ("B", "float", [cout])], [("y", y)])
    zero: dict[str, Any] = {"W": np.s_[zero_rows(rng, wshape[0])]}
    if rng.random() < 0.5:
        zero = {"W": np.s_[:, zero_rows(rng, wshape[1])]}
    return OracleCase(op, text + f" {{ y = {op} {attrs} (x, W, B) }}", 17, zero=zero, needs=needs(rng, "y", y))


declare_cases({"Conv": _conv_case, "ConvTranspose": _conv_case})
