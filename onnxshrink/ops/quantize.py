"""Quantized models: QDQ (`QuantizeLinear`/`DequantizeLinear` around float ops), dynamic
quantization (`DynamicQuantizeLinear` feeding `MatMulInteger`/`ConvInteger`) and the operator
form (`QLinearMatMul`, `QLinearConv`, and onnxruntime's `QGemm`, `QLinearAdd`, `QLinearMul`,
`QLinearSoftmax`, `QLinearGlobalAveragePool`, `QLinearAveragePool`, `QLinearConcat`,
`QLinearSigmoid`, `QLinearLeakyRelu`).

The reference is the quantized model as given: a masked weight quantizes to its zero point, so
an integer weight "is zero" where it equals its zero point, and DequantizeLinear of it is
exactly 0. Integer products read `(a - a_zero_point) * (w - w_zero_point)`: an input feature
whose weights all equal their zero point is unread, and one whose values all equal its zero
point adds nothing. Per-channel scales and zero points (1-D, along `axis`) slice with their
channel; per-tensor ones (scalars) stay. Each op says how it dequantizes its integer weights
(`quantized_input`), for the coupled groups (prune/groups.py).

- Q and DQ are elementwise (their scale and zero point broadcast along `axis`): they pass
  channels through; DQ's constants are computed in numpy as onnxruntime's kernel computes them
  (one float32 product), Q's with onnxruntime's kernel.
- DynamicQuantizeLinear computes its scale and zero point from every element of its input
  (min and max, with 0 always in the range): an index may go only where its whole slice is
  constant zero; everything else stays, as under a normalization.
- The integer products (MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv, grouped and
  depthwise too, and QGemm) are a weight product with zero points: an output channel whose
  weights, or whose inputs read, all sit at their zero points is a constant (0, or the
  requantized bias); no constant is folded into them, so an input feature goes only when unread
  or equal to its zero point. A ConvInteger/QLinearConv input channel equal to its zero point
  is removed under ONNX's definition of these ops (onnx's reference: the input is shifted by its
  zero point, then zero-padded), which onnxruntime follows (tested). A QLinearMatMul of two
  activations (attention) is a batched product: its output is the output zero point where a row
  or column of an operand sits at its zero point.
- QLinearAdd/QLinearMul are elementwise with broadcasting (per-tensor parameters), QLinearSoftmax
  normalizes over its axis, QLinearGlobalAveragePool and QLinearAveragePool pool each channel,
  QLinearSigmoid and QLinearLeakyRelu are elementwise; QLinearConcat joins its parts as Concat
  does, each requantized elementwise with its own per-tensor scale and zero point (a part
  removed whole leaves with them). Each maps an input at its zero point to the output's zero
  point (the dequantized 0), so what a masked channel feeds stays unread downstream.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Dequantizes,
    Dims,
    Handler,
    InputTypes,
    KeepView,
    OpNode,
    Quantized,
    Quantizes,
    Reader,
    Reason,
    RewriteView,
    WeightAxes,
    compress,
    int_attr,
    register,
)
from onnxshrink.ops.common import (
    along,
    channelwise_constants,
    const_or_live,
    couple_broadcast,
    couple_same,
    dtype_of,
    pin_normalized,
)
from onnxshrink.ops.concat import joined, keep_joined
from onnxshrink.ops.conv import keep_groups, regroup
from onnxshrink.ops.oracle import declare_cases
from onnxshrink.ops.pool import _no_padding


def per_axis(node: gs.Node, reader: Reader, slot: int, rank: int) -> int | None:
    """The axis a quantization parameter at `slot` runs along (its `axis` attribute), or None
    for a per-tensor one (a scalar or a single value)."""
    t = ir.present(node, slot)
    if t is None or ir.rank(t) in (None, 0):
        return None
    if ir.rank(t) == 1 and ir.static_dim(t, 0) == 1:
        return None
    return ir.norm_axis(int(node.attrs.get("axis", 1)), rank)


def tie_params(ks: KeepView, node: gs.Node, slots: tuple[int, ...], y: gs.Tensor, axis: int) -> None:
    """Parameters at `slots`: a 1-D one of y's size along `axis` is sliced with it; a scalar
    stays whole."""
    n = ks.size(y, axis)
    for s in slots:
        t = ir.present(node, s)
        if t is None:
            continue
        if ir.rank(t) == 1 and ks.size(t, 0) == n and n not in (None, 1):
            ks.demand(t, pin=False)
            ks.couple(t, 0, y, axis)
        else:
            ks.demand(t)


# ------------------------------------------------------------------ Q and DQ
_PLAIN_INTEGERS = tuple(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32))


def _is_integer(dtype: np.dtype) -> bool:
    """Plain integers, or onnx's 4-bit ones (ml_dtypes int4/uint4 arrays)."""
    return dtype in _PLAIN_INTEGERS or dtype.name in ("int4", "uint4")


@register("QuantizeLinear", "DequantizeLinear", since=10)
class QuantizeDequantize(Handler):
    """y = saturate(round(x / scale) + zp), or y = (x - zp) * scale: elementwise, the scale
    and zero point per tensor or along `axis`."""

    evaluate_with_ort = True

    def passes_axes(self, node: OpNode, i: int, rank: int) -> list[int] | None:
        return list(range(rank)) if i == 0 else None

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        return WeightAxes(0, None, "vector") if i in (1, 2) and rank == 1 else None

    def quantized_input(self, node: OpNode, i: int, rank: int) -> Quantized | None:
        """DequantizeLinear's input: (x - zero point) * scale, per tensor or along `axis` (in
        blocks of `block_size` along it: one scale and zero point per block)."""
        if node.op != "DequantizeLinear" or i != 0:
            return None
        zp = 2 if node.has_input(2) else None
        axis = ir.norm_axis(int_attr(node, "axis", 1), max(rank, 1))
        return Quantized((1,), zp, axis, block=int_attr(node, "block_size", 0))

    def qdq_form(self, node: OpNode) -> Dequantizes | Quantizes | None:
        if node.op == "DequantizeLinear":
            return Dequantizes(int_attr(node, "axis", 1), self.blocked_size(node))
        return Quantizes(int_attr(node, "output_dtype", 0) or TensorProto.UINT8)

    def blocked(self, node: gs.Node | OpNode) -> bool:
        return int_attr(node, "block_size", 0) != 0

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x, y = node.inputs[0], node.outputs[0]
        c, r = ctx.const(x), ir.rank(y)
        if c is None or r is None:
            return None
        if self.blocked(node):
            return self.blocked_constants(node, ctx, r)
        params = [ctx.value(ir.present(node, i)) for i in (1, 2)]
        if params[0] is None or (ir.present(node, 2) is not None and params[1] is None):
            return None
        m, v = const_or_live(ctx, x, r)
        axis = per_axis(node, ctx, 1, r)
        if axis is not None:  # the values must line up with their per-channel parameters
            n = ir.static_dim(x, axis)
            if n is None:
                return None
            shape = list(np.broadcast_shapes(m.shape, v.shape))
            shape[axis] = n
            m, v = np.broadcast_to(m, shape), np.broadcast_to(v, shape)
        elif r > 0:
            params = [None if p is None else p.reshape(()) for p in params]
        out = self.dequantized(node, v, params, axis, r)
        if out is None:
            out = ctx.evaluate(node, [np.ascontiguousarray(v), *params])[0]
        m, out = np.broadcast_arrays(m, out)
        return [compress(np.array(m), np.array(out))]

    def blocked_constants(self, node: gs.Node, ctx: ConstView, r: int) -> list[ConstInfo | None] | None:
        """A block-wise DequantizeLinear of a constant (an int4 weight): its parameters repeated
        over their blocks, then as per axis (where x is constant whole; else unknown)."""
        x = node.inputs[0]
        v = ctx.value(x)
        params = [ctx.value(ir.present(node, i)) for i in (1, 2)]
        if v is None or params[0] is None or (ir.present(node, 2) is not None and params[1] is None):
            return None
        axis = ir.norm_axis(int(node.attrs.get("axis", 1)), r)
        bs, n = self.blocked_size(node), v.shape[axis]
        full = [
            None if p is None else np.repeat(p, bs, axis=axis).take(np.arange(n), axis=axis)
            for p in params
        ]
        out = self.dequantized(node, v, full, None, r)
        if out is None:
            return None
        return [compress(np.ones((1,) * r, bool), out)]

    @staticmethod
    def blocked_size(node: gs.Node | OpNode) -> int:
        return int_attr(node, "block_size", 0)

    @staticmethod
    def dequantized(
        node: gs.Node, v: np.ndarray, params: list[np.ndarray | None], axis: int | None, r: int
    ) -> np.ndarray | None:
        """DequantizeLinear of plain integers with a float32 scale, in numpy: float32(x - zp) *
        scale, one rounding, as onnxruntime's kernel computes it (and without a session per
        weight); None for other ops and types (then onnxruntime evaluates it)."""
        scale, zp = params
        if (
            node.op != "DequantizeLinear"
            or not _is_integer(v.dtype)
            or scale is None
            or scale.dtype != np.float32
            or (zp is not None and zp.dtype != v.dtype)
        ):
            return None

        def shaped(p: np.ndarray) -> np.ndarray:  # (axis None: p broadcasts as it is)
            return p.reshape([-1 if a == axis else 1 for a in range(r)]) if axis is not None else p

        centered = v.astype(np.int64) - (shaped(zp).astype(np.int64) if zp is not None else 0)
        with np.errstate(invalid="ignore", over="ignore"):  # a NaN/inf scale: the runtime's NaN, unannounced
            return np.asarray(centered.astype(np.float32) * shaped(scale), dtype=np.float32)

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(y)
        if r is None or ir.rank(x) != r:
            ks.barrier(node, Reason("barrier", node.name, node.op, "shapes unknown"))
            return
        ks.demand(x, pin=False)
        couple_same(ks, node, x, y)
        if self.blocked(node):
            self.keep_blocks(node, ks, y, r)
            return
        axis = per_axis(node, ks, 1, r)
        if axis is None:
            for t in node.inputs[1:]:
                ks.demand(t if t is not None and t.name else None)
        else:
            tie_params(ks, node, (1, 2), y, axis)


    def keep_blocks(self, node: gs.Node, ks: KeepView, y: gs.Tensor, r: int) -> None:
        """Block-wise parameters (opset 21: x's shape, ceil(n / block_size) along `axis`): index j
        along `axis` is in block j // block_size, whose parameter slice goes only when all of it
        does (the others' blocks stay aligned); the other axes slice with y's."""
        axis = ir.norm_axis(int(node.attrs.get("axis", 1)), r)
        n, bs = ks.size(y, axis), self.blocked_size(node)
        for slot in (1, 2):
            p = ir.present(node, slot)
            if p is None:
                continue
            nb = ks.size(p, axis) if ir.rank(p) == r else None
            if n is None or bs <= 0 or nb != -(-n // bs):
                ks.demand(p)
                ks.pin(y, axis, Reason("barrier", node.name, node.op, "block parameters unknown"))
                continue
            ks.demand(p, pin=False)
            for a in range(r):
                if a == axis:
                    ks.couple_map(y, a, p, a, np.arange(n) // bs)
                else:
                    ks.couple(p, a, y, a)


@register("QuantizeLinear", "DequantizeLinear", domain="com.microsoft")
class ContribQuantizeDequantize(QuantizeDequantize):
    """onnxruntime's own Q/DQ (16-bit and 4-bit types before ONNX had them): the same ops."""

    def qdq_form(self, node: OpNode) -> None:
        return None  # the proof computes the standard ops' QDQ products in integers only


@register("DynamicQuantizeLinear", since=11)
class DynamicQuantizeLinear(Handler):
    """x -> (uint8 y, scale, zero point) from x's min and max (0 always in range): its
    statistics see every element, so an index goes only where x is constant zero."""

    evaluate_with_ort = True

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        if r is None or ir.rank(y) != r:
            ks.barrier(node, Reason("barrier", node.name, node.op, "shapes unknown"))
            return
        ks.demand(x, pin=False)
        couple_same(ks, node, x, y)
        why = Reason(
            "normalization",
            node.name,
            node.op,
            "its scale and zero point are computed from every element (only zeros do not count)",
        )
        c = ks.const(x)
        for a in range(r):
            n = ks.size(x, a)
            if n is None:
                continue
            zero = c.slice_zero(a, n) if c is not None else np.zeros(n, bool)
            ks.keep(x, a, ~zero, why)
        for t in node.outputs[1:]:
            ks.pin(t)


def at_zero_point(reader: Reader, node: gs.Node, a_slot: int, zp_slot: int, axis: int, n: int) -> np.ndarray:
    """Per index of input a_slot along `axis`: is its whole slice equal to its zero point (it
    adds nothing to an integer product)? Known when the input is constant there and the zero
    point constant, or when the input is DynamicQuantizeLinear's output with its own zero point
    (its input constant zero there: zero quantizes to the zero point exactly)."""
    a, zp = node.inputs[a_slot], ir.present(node, zp_slot)
    src = ir.producer(a)
    if (
        src is not None
        and src.op == "DynamicQuantizeLinear"
        and src.outputs[0] is a
        and len(src.outputs) > 2
        and zp is src.outputs[2]
    ):
        cx = reader.const(src.inputs[0])
        return cx.slice_zero(axis, n) if cx is not None else np.zeros(n, bool)
    c = reader.const(a)
    zv = np.zeros((), np.int32) if zp is None else reader.value(zp)
    if c is None or zv is None or zv.size != 1:
        return np.zeros(n, bool)
    shape = np.broadcast_shapes(c.mask.shape, c.value.shape)
    at = np.broadcast_to(c.mask, shape) & (np.broadcast_to(c.value, shape) == zv.reshape(()))
    return ConstInfo(at, np.broadcast_to(c.value, shape)).slice_constant(axis, n)


def weight_live(w: np.ndarray, zp: np.ndarray | None, out_axis: int) -> np.ndarray:
    """Where an integer weight differs from its zero point (per tensor or per output channel)."""
    w = w.astype(np.int64)
    if zp is None or zp.size == 1:
        return w != (0 if zp is None else int(zp.reshape(-1)[0]))
    return w != along(zp.reshape(-1).astype(np.int64), out_axis, w.ndim)


# ------------------------------------------------------------------ integer products
class _IntegerProduct(Handler):
    """A weight product with zero points: x, w and their parameters at `slots`."""

    evaluate_with_ort = True
    x_slot, w_slot, x_zp, w_zp = 0, 1, 2, 3
    per_output: tuple[int, ...] = (3,)  # parameters along the weight's output channels
    w_scales: tuple[int, ...] = ()  # the weight's scale (none: applied after the op)
    bias_slot: int | None = None  # an int32 bias, scaled by `bias_scales`
    bias_scales: tuple[int, ...] = ()

    def w_axes(self, node: OpNode | gs.Node, rank: int) -> tuple[int, int]:
        """(output-channel axis, input-feature axis) of the weight."""
        raise NotImplementedError

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        if i == self.w_slot and rank >= 2:
            out, inp = self.w_axes(node, rank)
            return WeightAxes(out, inp, "conv" if rank > 2 else "linear")
        if i == self.bias_slot and rank == 1:
            return WeightAxes(0, None, "vector")
        return None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        slots = {"weight": self.w_slot}
        return slots | ({"bias": self.bias_slot} if self.bias_slot is not None else {})

    def quantized_input(self, node: OpNode, i: int, rank: int) -> Quantized | None:
        """The weight, (w - w_zero_point) * w_scale per tensor or per output channel (the integer
        ops with no scale input leave it to the graph after them); the int32 bias, scaled by
        x_scale * w_scale with no zero point."""
        if i == self.w_slot and rank >= 2:
            zp = self.w_zp if node.has_input(self.w_zp) else None
            return Quantized(self.w_scales, zp, self.w_axes(node, rank)[0])
        if i == self.bias_slot and rank == 1:
            return Quantized(self.bias_scales, None, 0)
        return None

    def applied_scale(self, node: gs.Node, i: int) -> np.ndarray | None:
        """The weight's scale, as quantize_dynamic applies it after MatMulInteger/ConvInteger:
        Cast(y) * (x_scale * w_scale), x_scale the scale DynamicQuantizeLinear computed for x
        (so the other factor, a constant, is the weight's)."""
        x, y = node.inputs[self.x_slot], node.outputs[0]
        src = ir.producer(x)
        if i != self.w_slot or self.w_scales or src is None or src.op != "DynamicQuantizeLinear":
            return None
        if src.outputs[0] is not x or len(src.outputs) < 2:
            return None
        x_scale = src.outputs[1]
        cast = y.outputs[0] if len(y.outputs) == 1 else None
        if cast is None or cast.op != "Cast" or len(cast.outputs[0].outputs) != 1:
            return None
        mul = cast.outputs[0].outputs[0]
        scaled = [t for t in mul.inputs if t is not cast.outputs[0]]
        product = ir.producer(scaled[0]) if mul.op == "Mul" and len(scaled) == 1 else None
        if product is None or product.op != "Mul" or len(product.inputs) != 2:
            return None
        a, b = product.inputs
        other = b if a is x_scale else a if b is x_scale else None
        return np.asarray(other.values) if isinstance(other, gs.Constant) else None

    def macs(self, node: OpNode, inputs: Sequence[list[int] | None], output: list[int]) -> int:
        w = inputs[self.w_slot] if self.w_slot < len(inputs) else None
        if w is None or len(w) < 2:
            return 0
        _, inp = self.w_axes(node, len(w))
        per_output = int(np.prod(w[1:])) if len(w) > 2 else int(w[inp])  # conv: a filter
        return int(np.prod(output)) * per_output

    def live_weights(self, node: gs.Node, reader: Reader) -> np.ndarray | None:
        """[output channel, input feature]: is any weight between them off its zero point? (Once
        per analysis: the closure visits a node several times.)"""
        memo = getattr(reader, "memo", None)
        if memo is None:
            return self._live_weights(node, reader)
        key = ("live_weights", node.name, node.outputs[0].name)
        return memo(key, lambda: self._live_weights(node, reader))

    def _live_weights(self, node: gs.Node, reader: Reader) -> np.ndarray | None:
        w = reader.value(node.inputs[self.w_slot])
        zp = ir.present(node, self.w_zp)
        zv = reader.value(zp) if zp is not None else None
        if w is None or (zp is not None and zv is None):
            return None
        out, inp = self.w_axes(node, w.ndim)
        moved = np.moveaxis(weight_live(w, zv, out), (out, inp), (0, 1))
        return np.asarray(moved.reshape(moved.shape[0], moved.shape[1], -1).any(axis=2))

    def depends(self, node: gs.Node, reader: Reader) -> np.ndarray | None:
        """D[o, i]: output channel o reads input feature i with a weight off its zero point."""
        return self.live_weights(node, reader)

    def x_axis(self, node: gs.Node) -> int | None:
        """The axis of x the weight's input features run along."""
        raise NotImplementedError

    def dead_outputs(self, node: gs.Node, reader: Reader) -> np.ndarray | None:
        """Output channels that add nothing to their accumulation: every weight at its zero point,
        or every input feature they read at its zero point (0 after the shift)."""
        d, axis = self.depends(node, reader), self.x_axis(node)
        if d is None or axis is None:
            return None
        silent = at_zero_point(reader, node, self.x_slot, self.x_zp, axis, d.shape[1])
        return np.asarray(~(d & ~silent[None, :]).any(axis=1))

    def reads(self, node: gs.Node, reader: Reader, kept_out: np.ndarray | None) -> np.ndarray | None:
        """Input features some kept output channel reads with a weight off its zero point."""
        live = self.live_weights(node, reader)
        if live is None:
            return None
        return np.asarray(live[kept_out].any(axis=0) if kept_out is not None else live.any(axis=0))

    def dummy_input(self, node: gs.Node, ctx: ConstView) -> np.ndarray | None:
        raise NotImplementedError

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """Dead output channels do not depend on x: evaluated once on a small stand-in."""
        dead, y = self.dead_outputs(node, ctx), node.outputs[0]
        r = ir.rank(y)
        if dead is None or not dead.any() or r is None:
            return None
        x = self.dummy_input(node, ctx)
        others = [ctx.value(t) if t is not None and t.name else None for t in node.inputs]
        if x is None or any(
            v is None and i not in (self.x_slot, self.x_zp) and ir.present(node, i) is not None
            for i, v in enumerate(others)
        ):
            return None
        others[self.x_slot] = x
        if self.x_zp < len(others) and ir.present(node, self.x_zp) is not None:
            others[self.x_zp] = np.zeros((), x.dtype)  # its run-time zero point: any will do
        out = ctx.evaluate(node, others)[0]
        ch = self.out_axis(r)
        values = np.moveaxis(out, ch, 0).reshape(out.shape[ch], -1)[:, 0]
        return [ConstInfo(along(dead, ch, r), along(np.where(dead, values, 0).astype(out.dtype), ch, r))]

    def out_axis(self, r: int) -> int:
        raise NotImplementedError


@register("MatMulInteger", since=10)
class MatMulInteger(_IntegerProduct):
    """A [.., M, K] x B [K, N] (constant) with a_zero_point and b_zero_point (per column)."""

    def w_axes(self, node: OpNode | gs.Node, rank: int) -> tuple[int, int]:
        return rank - 1, rank - 2

    def out_axis(self, r: int) -> int:
        return r - 1

    def x_axis(self, node: gs.Node) -> int | None:
        r = ir.rank(node.inputs[self.x_slot])
        return None if r is None else r - 1

    def dummy_input(self, node: gs.Node, ctx: ConstView) -> np.ndarray | None:
        w, a = ctx.value(node.inputs[self.w_slot]), node.inputs[self.x_slot]
        ra = ir.rank(a)
        if w is None or ra is None or ra < 2:
            return None
        dtype = a.dtype if a.dtype is not None else np.uint8
        return np.zeros((1,) * (ra - 1) + (w.shape[-2],), dtype=np.dtype(dtype))

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        if ctx.value(node.inputs[self.w_slot]) is not None:
            return super().constants(node, ctx)
        return self.activation_constants(node, ctx)

    def activation_constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """A product of two activations: an output element whose row of A or column of B sits at
        its zero point is the product of zero (0, or requantized: the output zero point)."""
        a, b, y = node.inputs[self.x_slot], node.inputs[self.w_slot], node.outputs[0]
        ra, rb, ry = ir.rank(a), ir.rank(b), ir.rank(y)
        if ra is None or rb is None or ry is None or min(ra, rb) < 2 or ry != max(ra, rb):
            return None
        rows = self.silent(ctx, node, self.x_slot, self.x_zp, ry, -1)
        cols = self.silent(ctx, node, self.w_slot, self.w_zp, ry, -2)
        if rows is None and cols is None:
            return None
        mask = np.logical_or(
            rows if rows is not None else np.zeros((1,) * ry, bool),
            cols if cols is not None else np.zeros((1,) * ry, bool),
        )
        zero = self.zero_product(node, ctx)
        if zero is None or not mask.any():
            return None
        return [compress(mask, np.broadcast_to(zero, mask.shape).copy())]

    def silent(
        self, ctx: ConstView, node: gs.Node, slot: int, zp_slot: int, r: int, axis: int
    ) -> np.ndarray | None:
        """Where input `slot` is constant at its (per-tensor) zero point along the whole `axis`
        (kept as a size-1 axis), aligned to rank r; None when nowhere."""
        c = ctx.const(node.inputs[slot])
        zp = ir.present(node, zp_slot)
        zv = np.zeros((), np.int64) if zp is None else ctx.value(zp)
        if c is None or zv is None or zv.size != 1:
            return None
        m, v = const_or_live(ctx, node.inputs[slot], r)
        at = np.all(m & (v == zv.reshape(())), axis=axis, keepdims=True)
        return at if at.any() else None

    def zero_product(self, node: gs.Node, ctx: ConstView) -> np.ndarray | None:
        """The output of a product of zeros (both operands at their zero points), evaluated."""
        values = [ctx.value(t) if t is not None and t.name else None for t in node.inputs]
        for slot, zp_slot in ((self.x_slot, self.x_zp), (self.w_slot, self.w_zp)):
            dtype = dtype_of(node.inputs[slot])
            values[slot] = np.zeros((1, 1), dtype)
            if zp_slot < len(values) and ir.present(node, zp_slot) is not None:
                values[zp_slot] = np.zeros((), dtype)
        if any(v is None and ir.present(node, i) is not None for i, v in enumerate(values)):
            return None
        return np.asarray(ctx.evaluate(node, values)[0]).reshape(())

    def keep_activations(self, node: gs.Node, ks: KeepView) -> None:
        """A [.., M, K] x B [.., K, N], both computed: batch axes broadcast, M and N pass through,
        K is read whole (both sides live)."""
        a, b, y = node.inputs[self.x_slot], node.inputs[self.w_slot], node.outputs[0]
        ra, rb, ry = ir.rank(a), ir.rank(b), ir.rank(y)
        if ra is None or rb is None or ry is None or min(ra, rb) < 2 or ry != max(ra, rb):
            ks.barrier(node, Reason("barrier", node.name, node.op, "shapes unknown"))
            return
        ks.demand(a, pin=False)
        ks.demand(b, pin=False)
        for t, r in ((a, ra), (b, rb)):
            for j in range(r - 2):  # right-aligned batch axes
                ya = ry - r + j
                if ks.size(t, j) == 1 and ks.size(y, ya) != 1:
                    ks.pin(t, j)
                else:
                    ks.couple(t, j, y, ya)
        ks.couple(a, ra - 2, y, ry - 2)
        ks.couple(b, rb - 1, y, ry - 1)
        ks.couple(a, ra - 1, b, rb - 2)
        ks.pin(a, ra - 1)
        for i, t in enumerate(node.inputs):
            if i not in (self.x_slot, self.w_slot):
                ks.demand(t if t is not None and t.name else None)

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        a, b, y = node.inputs[self.x_slot], node.inputs[self.w_slot], node.outputs[0]
        ra, ry = ir.rank(a), ir.rank(y)
        w = ks.value(b)
        if w is None and not isinstance(b, gs.Constant):
            self.keep_activations(node, ks)
            return
        if w is None or w.ndim != 2 or ra is None or ra < 2 or ry != ra:
            why = "weights not a constant matrix" if w is None or w.ndim != 2 else "shapes unknown"
            ks.barrier(node, Reason("barrier", node.name, node.op, why))
            return
        ks.demand(a, pin=False)
        ks.demand(b, pin=False)
        for j in range(ra - 1):
            ks.couple(a, j, y, j)
        ks.couple(b, 1, y, ry - 1)
        ks.couple(a, ra - 1, b, 0)
        tie_params(ks, node, self.per_output, y, ry - 1)
        for i, t in enumerate(node.inputs):
            if i not in (self.x_slot, self.w_slot, *self.per_output):
                ks.demand(t if t is not None and t.name else None)
        reads = self.reads(node, ks, ks.kept(y, ry - 1))
        k = len(reads) if reads is not None else 0
        silent = at_zero_point(ks, node, self.x_slot, self.x_zp, ra - 1, k)
        if reads is None:
            ks.pin(a, ra - 1)
        else:
            ks.need(a, ra - 1, reads & ~silent)


@register("QLinearMatMul", since=10)
class QLinearMatMul(MatMulInteger):
    """a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp: MatMulInteger requantized."""

    x_slot, w_slot, x_zp, w_zp = 0, 3, 2, 5
    per_output = (4, 5)
    w_scales = (4,)


@register("ConvInteger", since=10)
class ConvInteger(_IntegerProduct):
    """x [N, C, ...] with a constant weight [M, C, k...], x_zero_point, w_zero_point (per M)."""

    def w_axes(self, node: OpNode | gs.Node, rank: int) -> tuple[int, int]:
        return 0, 1

    def out_axis(self, r: int) -> int:
        return 1

    def group(self, node: gs.Node) -> int:
        return int(node.attrs.get("group", 1))

    def x_axis(self, node: gs.Node) -> int | None:
        return 1

    def dummy_input(self, node: gs.Node, ctx: ConstView) -> np.ndarray | None:
        """One sample, the kernel's extent in every spatial dim (so at least one output)."""
        w, x = ctx.value(node.inputs[self.w_slot]), node.inputs[self.x_slot]
        if w is None:
            return None
        dil = node.attrs.get("dilations") or [1] * (w.ndim - 2)
        spatial = [(k - 1) * int(d) + 1 for k, d in zip(w.shape[2:], dil, strict=True)]
        dtype = x.dtype if x.dtype is not None else np.uint8
        return np.zeros([1, w.shape[1] * self.group(node), *spatial], dtype=np.dtype(dtype))

    def depends(self, node: gs.Node, reader: Reader) -> np.ndarray | None:
        """D[o, i]: output channel o reads input channel i with a weight off its zero point (a
        grouped conv's output channels read their group's inputs only)."""
        live = self.live_weights(node, reader)
        g = self.group(node)
        if live is None or g == 1:
            return live
        co, cin = live.shape
        cout = co // g
        d = np.zeros((co, cin * g), dtype=bool)
        for k in range(g):
            d[k * cout : (k + 1) * cout, k * cin : (k + 1) * cin] = live[k * cout : (k + 1) * cout]
        return d

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, wt, y = node.inputs[self.x_slot], node.inputs[self.w_slot], node.outputs[0]
        w, r, g = ks.value(wt), ir.rank(x), self.group(node)
        if (
            w is None
            or r is None
            or ir.rank(y) != r
            or ks.size(x, 1) != w.shape[1] * g
            or ks.size(y, 1) != w.shape[0]
            or w.shape[0] % g
        ):
            ks.barrier(
                node, Reason("barrier", node.name, node.op, "weights or channel counts unknown")
            )
            return
        ks.demand(x, pin=False)
        ks.demand(wt, pin=False)
        ks.couple(x, 0, y, 0)
        for a in range(2, r):
            ks.pin(x, a)
            ks.pin(y, a)
            ks.pin(wt, a)
        ks.couple(y, 1, wt, 0)
        if g == 1:
            ks.couple(x, 1, wt, 1)
        else:  # a group's channels leave together, on both sides (see ops/conv.py)
            ks.pin(wt, 1)
            ci, co = w.shape[1] * g, w.shape[0]
            ks.unit(x, 1, np.arange(ci), y, 1, np.arange(ci) // w.shape[1] * (co // g))
            ks.unit(y, 1, np.arange(co), y, 1, np.arange(co) // (co // g) * (co // g))
        tie_params(ks, node, self.per_output, y, 1)
        for i, t in enumerate(node.inputs):
            if i not in (self.x_slot, self.w_slot, *self.per_output):
                ks.demand(t if t is not None and t.name else None)
        d = self.depends(node, ks)
        ky = ks.kept(y, 1)
        assert d is not None and ky is not None  # w is constant, y's channels static (checked)
        reads = d[ky].any(axis=0)
        ks.need(x, 1, reads & ~at_zero_point(ks, node, self.x_slot, self.x_zp, 1, len(reads)))

    def settle(self, node: gs.Node, ks: KeepView) -> None:
        w, g = ks.value(node.inputs[self.w_slot]), self.group(node)
        if w is not None and g > 1:
            x, y = node.inputs[self.x_slot], node.outputs[0]
            keep_groups(node, ks, x, y, g, w.shape[1], w.shape[0] // g)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        g = self.group(node)
        if g > 1:
            x, y = node.inputs[self.x_slot], node.outputs[0]
            regroup(node, rw, self.w_slot, g, rw.kept_static(x, 1), rw.kept_static(y, 1), False)


@register("QLinearConv", since=10)
class QLinearConv(ConvInteger):
    """x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, bias: ConvInteger requantized, with
    an int32 bias and per-channel w_scale, w_zp."""

    types_unknown_to_inference = True  # for symbolic spatial dims: onnx's knows static ones

    def output_types(self, node: OpNode, inputs: InputTypes) -> list[tuple[Dims | None, int] | None] | None:
        """Conv's dims of x and w; y_zero_point's type."""
        dims = inputs.float_op_dims("Conv", (0, 3))
        return None if dims is None else [(dims, inputs.dtype(7 if node.has_input(7) else 0))]

    x_slot, w_slot, x_zp, w_zp = 0, 3, 2, 5
    per_output = (4, 5, 8)
    w_scales = (4,)
    bias_slot, bias_scales = 8, (1, 4)


# ------------------------------------------------------------------ onnxruntime's QOperator ops
MS = "com.microsoft"


@register("QGemm", domain=MS)
class QGemm(_IntegerProduct):
    """A, a_scale, a_zp, B, b_scale, b_zp, C (int32 bias), y_scale, y_zp (both absent: a float
    output); alpha, transA, transB: Gemm on integers, requantized."""

    types_unknown_to_inference = True

    def output_types(self, node: OpNode, inputs: InputTypes) -> list[tuple[Dims | None, int] | None] | None:
        """Gemm's [M, N]; y_zp's type, or float without it."""
        a, b = inputs.known_dims(0), inputs.known_dims(3)
        m = a[1] if node.attrs.get("transA", 0) else a[0]
        n = b[0] if node.attrs.get("transB", 0) else b[1]
        return [([m, n], inputs.dtype(8) if node.has_input(8) else onnx.TensorProto.FLOAT)]

    x_slot, w_slot, x_zp, w_zp = 0, 3, 2, 5
    per_output = (4, 5, 6)
    w_scales = (4,)
    bias_slot, bias_scales = 6, (1, 4)

    def w_axes(self, node: OpNode | gs.Node, rank: int) -> tuple[int, int]:
        return (0, 1) if int_attr(node, "transB", 0) else (1, 0)

    def a_axes(self, node: gs.Node) -> tuple[int, int]:
        """(M axis, K axis) of A."""
        return (1, 0) if int(node.attrs.get("transA", 0)) else (0, 1)

    def x_axis(self, node: gs.Node) -> int | None:
        return self.a_axes(node)[1]

    def out_axis(self, r: int) -> int:
        return 1

    def macs(self, node: OpNode, inputs: Sequence[list[int] | None], output: list[int]) -> int:
        a = inputs[0]
        if a is None or len(a) != 2:
            return 0
        return int(np.prod(output)) * int(a[0] if int_attr(node, "transA", 0) else a[1])

    def dummy_input(self, node: gs.Node, ctx: ConstView) -> np.ndarray | None:
        w = ctx.value(node.inputs[self.w_slot])
        if w is None or w.ndim != 2:
            return None
        _, k = self.w_axes(node, 2)
        shape = [w.shape[k], 1] if int(node.attrs.get("transA", 0)) else [1, w.shape[k]]
        return np.zeros(shape, dtype_of(node.inputs[self.x_slot]))

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        a, b, y = node.inputs[self.x_slot], node.inputs[self.w_slot], node.outputs[0]
        w = ks.value(b)
        if w is None or w.ndim != 2 or ir.rank(a) != 2 or ir.rank(y) != 2:
            ks.barrier(node, Reason("barrier", node.name, node.op, "weights not a constant matrix"))
            return
        a_m, a_k = self.a_axes(node)
        b_n, b_k = self.w_axes(node, 2)
        ks.demand(a, pin=False)
        ks.demand(b, pin=False)
        ks.couple(a, a_m, y, 0)
        ks.couple(b, b_n, y, 1)
        ks.couple(a, a_k, b, b_k)
        tie_params(ks, node, self.per_output, y, 1)
        for i, t in enumerate(node.inputs):
            if i not in (self.x_slot, self.w_slot, *self.per_output):
                ks.demand(t if t is not None and t.name else None)
        reads = self.reads(node, ks, ks.kept(y, 1))
        assert reads is not None  # w is constant (checked above)
        ks.need(a, a_k, reads & ~at_zero_point(ks, node, self.x_slot, self.x_zp, a_k, len(reads)))


@register("QLinearAdd", "QLinearMul", domain=MS)
class QLinearBinary(Handler):
    """A, A_scale, A_zp, B, B_scale, B_zp, C_scale, C_zp: Add or Mul of the dequantized operands
    (numpy broadcasting), requantized; per-tensor scales and zero points."""

    evaluate_with_ort = True
    operand_slots = (0, 3)

    def quantized_input(self, node: OpNode, i: int, rank: int) -> Quantized | None:
        """A constant operand (a bias, a scale): (x - its zero point) * its scale."""
        if i not in self.operand_slots:
            return None
        return Quantized((i + 1,), i + 2 if node.has_input(i + 2) else None, max(rank - 1, 0))

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        return WeightAxes(0, None, "vector") if i in self.operand_slots and rank == 1 else None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        """A bias (QLinearAdd) or a scale (QLinearMul): the one constant operand."""
        consts = [i for i in self.operand_slots if i < len(constant) and constant[i]]
        name = "bias" if node.op == "QLinearAdd" else "weight"
        return {name: consts[0]} if len(consts) == 1 else {}

    def multiplies(self, node: OpNode) -> bool:
        return node.op == "QLinearMul"

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """Where both operands are constant (for QLinearMul also where one sits at its zero
        point, a product with 0), evaluated with onnxruntime's kernel."""
        y = node.outputs[0]
        r = ir.rank(y)
        operands = [node.inputs[i] for i in self.operand_slots]
        if r is None or any(ir.rank(t) is None for t in operands):
            return None
        if all(ctx.const(t) is None for t in operands):
            return None
        params = [ctx.value(t) if t is not None and t.name else None for t in node.inputs]
        missing = [i for i, v in enumerate(params) if v is None and ir.present(node, i) is not None]
        if set(missing) - set(self.operand_slots):
            return None
        pairs = [const_or_live(ctx, t, r) for t in operands]
        mask = np.logical_and.reduce(np.broadcast_arrays(*[m for m, _ in pairs]))
        if node.op == "QLinearMul":
            for (m, v), slot in zip(pairs, self.operand_slots, strict=True):
                given = params[slot + 2] if slot + 2 < len(params) else None
                zp = given if given is not None else np.zeros((), v.dtype)
                mask = mask | (m & (v == zp.reshape(())))
        if not mask.any():
            return None
        full = list(params)
        for (_, v), slot in zip(pairs, self.operand_slots, strict=True):
            full[slot] = v
        out = ctx.evaluate(node, full)[0]
        mask, out = np.broadcast_arrays(mask, out)
        return [compress(np.array(mask), np.array(out))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        y = node.outputs[0]
        for i, t in enumerate(node.inputs):
            if i in self.operand_slots:
                ks.demand(t, pin=False)
                couple_broadcast(ks, node, y, t, combine=True)
            else:
                ks.demand(t if t is not None and t.name else None)  # per-tensor parameters


@register("QLinearSoftmax", domain=MS)
class QLinearSoftmax(Handler):
    """X, X_scale, X_zp, Y_scale, Y_zp; axis, opset: Softmax of the dequantized input,
    requantized. It normalizes over `axis` (from `axis` on, flattened, for opset < 13)."""

    types_unknown_to_inference = True

    def output_types(self, node: OpNode, inputs: InputTypes) -> list[tuple[Dims | None, int] | None] | None:
        return [(inputs.dims(0), inputs.dtype(0))]

    evaluate_with_ort = True

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        if r is None or ir.rank(y) != r:
            ks.barrier(node, Reason("barrier", node.name, node.op, "shapes unknown"))
            return
        axis = ir.norm_axis(int(node.attrs.get("axis", -1)), r)
        axes = [axis] if int(node.attrs.get("opset", 13)) >= 13 else list(range(axis, r))
        pin_normalized(ks, node, axes)
        for t in node.inputs[1:]:
            ks.demand(t if t is not None and t.name else None)


@register("QLinearGlobalAveragePool", domain=MS)
class QLinearGlobalAveragePool(Handler):
    """X, x_scale, x_zp, y_scale, y_zp; channels_last: the mean over the spatial axes of each
    channel, requantized."""

    types_unknown_to_inference = True

    def output_types(self, node: OpNode, inputs: InputTypes) -> list[tuple[Dims | None, int] | None] | None:
        """X's dims, each spatial one 1."""
        x = inputs.known_dims(0)
        c = len(x) - 1 if node.attrs.get("channels_last", 0) else 1
        return [([d if a in (0, c) else 1 for a, d in enumerate(x)], inputs.dtype(0))]

    evaluate_with_ort = True

    def channel_axis(self, node: gs.Node, r: int) -> int:
        return r - 1 if int(node.attrs.get("channels_last", 0)) else 1

    def window(self, node: gs.Node, r: int) -> list[int] | None:
        """The smallest spatial extent with one output: the kernel's (1 for a global pool); None
        when a uniform input channel does not pool to its own value (padding counted in)."""
        return [1] * (r - 2)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x = node.inputs[0]
        r = ir.rank(x)
        if r is None:
            return None
        c = self.channel_axis(node, r)
        out = channelwise_constants(ctx, node, invariant=False, channel_axis=c)
        cx, n, window = ctx.const(x), ir.static_dim(x, c), self.window(node, r)
        if out is not None or cx is None or n is None or window is None:
            return out
        # Dynamic spatial dims: a channel uniform over them pools to its value, requantized as
        # the op requantizes it on one window of it.
        uniform = cx.slice_uniform(c, n)
        params = [ctx.value(t) if t is not None and t.name else None for t in node.inputs]
        if not uniform.any() or any(v is None and ir.present(node, i) is not None for i, v in enumerate(params) if i):
            return None
        shape = [1, *window]
        shape.insert(c, n)
        values = along(cx.slice_values(c, n), c, r)
        pooled = ctx.evaluate(node, [np.ascontiguousarray(np.broadcast_to(values, shape)), *params[1:]])[0]
        per = np.moveaxis(pooled, c, 0).reshape(n, -1)[:, 0]
        return [ConstInfo(along(uniform, c, r), along(np.where(uniform, per, 0).astype(per.dtype), c, r))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        if r is None or ir.rank(y) != r or r < 3:
            ks.barrier(node, Reason("barrier", node.name, node.op, "shapes unknown"))
            return
        c = self.channel_axis(node, r)
        ks.demand(x, pin=False)
        for a in range(r):
            if a in (0, c):
                ks.couple(x, a, y, a)
            else:
                ks.pin(x, a)
                ks.pin(y, a)
        for t in node.inputs[1:]:
            ks.demand(t if t is not None and t.name else None)


@register("QLinearAveragePool", domain=MS)
class QLinearAveragePool(QLinearGlobalAveragePool):
    """X, x_scale, x_zp, y_scale, y_zp; AveragePool's attributes and channels_last: each
    channel's windows averaged in float, requantized (per-tensor parameters)."""

    def output_types(self, node: OpNode, inputs: InputTypes) -> list[tuple[Dims | None, int] | None] | None:
        """AveragePool's dims of X."""
        dims = inputs.float_op_dims("AveragePool", (0,), bool(node.attrs.get("channels_last", 0)))
        return None if dims is None else [(dims, inputs.dtype(0))]

    def window(self, node: gs.Node, r: int) -> list[int] | None:
        if not _no_padding(node) and int(node.attrs.get("count_include_pad", 0)):
            return None
        kernel = [int(k) for k in node.attrs.get("kernel_shape", [])]
        return kernel if len(kernel) == r - 2 else None


@register("QLinearSigmoid", "QLinearLeakyRelu", domain=MS)
class QLinearUnary(Handler):
    """X, X_scale, X_zp, Y_scale, Y_zp (per tensor): quantize(f(dequantize(x))), elementwise."""

    types_unknown_to_inference = True

    def output_types(self, node: OpNode, inputs: InputTypes) -> list[tuple[Dims | None, int] | None] | None:
        return [(inputs.dims(0), inputs.dtype(0))]

    evaluate_with_ort = True

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x, r = node.inputs[0], ir.rank(node.outputs[0])
        params = [ctx.value(t) if t is not None and t.name else None for t in node.inputs]
        if r is None or ctx.const(x) is None:
            return None
        if any(v is None and i > 0 and ir.present(node, i) is not None for i, v in enumerate(params)):
            return None
        m, v = const_or_live(ctx, x, r)
        out = ctx.evaluate(node, [np.ascontiguousarray(v), *params[1:]])[0]
        m, out = np.broadcast_arrays(m, out)
        return [compress(np.array(m), np.array(out))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        ks.demand(x, pin=False)
        couple_same(ks, node, x, y)
        for t in node.inputs[1:]:
            ks.demand(t if t is not None and t.name else None)


@register("QLinearConcat", domain=MS)
class QLinearConcat(Handler):
    """Y_scale, Y_zp, then (X, X_scale, X_zp) per part; axis: each part requantized to Y's
    scale and zero point (all per tensor), elementwise, then joined as Concat joins."""

    types_unknown_to_inference = True

    def output_types(self, node: OpNode, inputs: InputTypes) -> list[tuple[Dims | None, int] | None] | None:
        """The parts' dims, their sizes along `axis` summed (unknown unless all are static)."""
        shapes = [inputs.known_dims(i) for i in range(2, len(node.inputs), 3)]
        axis = int_attr(node, "axis", 0)
        axis = axis + len(shapes[0]) if axis < 0 else axis
        static = [d for d in (s[axis] for s in shapes) if isinstance(d, int)]
        out = list(shapes[0])
        out[axis] = sum(static) if len(static) == len(shapes) else None
        return [(out, inputs.dtype(1))]

    evaluate_with_ort = True

    @staticmethod
    def part_slots(node: gs.Node | OpNode) -> range:
        return range(2, len(node.inputs), 3)

    def may_drop_inputs(self, node: gs.Node) -> tuple[int, ...]:
        return tuple(self.part_slots(node))

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """Each part's constants requantized on their own (a one-part QLinearConcat evaluated),
        joined where every part's size along the axis is static."""
        y = node.outputs[0]
        r = ir.rank(y)
        parts = [node.inputs[i] for i in self.part_slots(node)]
        if r is None or any(ir.rank(t) != r for t in parts) or all(ctx.const(t) is None for t in parts):
            return None
        axis = ir.norm_axis(int(node.attrs["axis"]), r)
        sizes = [ir.static_dim(t, axis) for t in parts]
        params = [ctx.value(t) if i not in self.part_slots(node) else None for i, t in enumerate(node.inputs)]
        if any(n is None for n in sizes) or any(
            v is None and i not in self.part_slots(node) for i, v in enumerate(params)
        ):
            return None
        pieces = []
        for i, t in zip(self.part_slots(node), parts, strict=True):
            m, v = const_or_live(ctx, t, r)
            if m.any():
                v = ctx.evaluate(node, [params[0], params[1], np.ascontiguousarray(v), *params[i + 1 : i + 3]])[0]
            pieces.append((m, v))
        return [joined(pieces, [int(n) for n in sizes if n is not None], axis)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        y = node.outputs[0]
        r = ir.rank(y)
        if r is None:
            ks.barrier(node, Reason("barrier", node.name, node.op, "shapes unknown"))
            return
        slots = self.part_slots(node)
        keep_joined(ks, [node.inputs[i] for i in slots], y, ir.norm_axis(int(node.attrs["axis"]), r))
        for i, t in enumerate(node.inputs):
            if i not in slots:
                ks.demand(t if t is not None and t.name else None)  # per-tensor parameters

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        """A part that lost every index leaves with its scale and zero point."""
        axis = ir.norm_axis(int(node.attrs["axis"]), ir.known_rank(node.outputs[0]))
        kept = list(node.inputs[:2])
        for i in self.part_slots(node):
            if rw.kept_count(node.inputs[i], axis) != 0:
                kept.extend(node.inputs[i : i + 3])
        node.inputs.clear()
        node.inputs.extend(kept)


declare_cases(excluded={
    "DequantizeLinear": "integer data (the replay draws floats); tests/ops/test_quantize.py",
    "QuantizeLinear": "integer outputs, which the replay does not judge; tests/ops/test_quantize.py",
    "DynamicQuantizeLinear": "integer outputs, which the replay does not judge; "
    "tests/ops/test_quantize.py",
    "MatMulInteger": "integer data only; tests/ops/test_quantize.py",
    "ConvInteger": "integer data only; tests/ops/test_quantize.py",
    "QLinearMatMul": "integer data only; tests/ops/test_quantize.py",
    "QLinearConv": "integer data only; tests/ops/test_quantize.py",
    "QGemm": "integer data only; tests/test_prune_quantized.py",
    "QLinearAdd": "integer data only; tests/test_prune_quantized.py",
    "QLinearMul": "integer data only; tests/test_prune_quantized.py (the QOperator BERT)",
    "QLinearSoftmax": "integer data only; tests/test_prune_quantized.py (the QOperator BERT)",
    "QLinearGlobalAveragePool": "integer data only; tests/test_prune_quantized.py",
    "QLinearAveragePool": "integer data only; tests/ops/test_quantize.py",
    "QLinearConcat": "integer data only; tests/ops/test_quantize.py",
    "QLinearSigmoid": "integer data only; tests/ops/test_quantize.py",
    "QLinearLeakyRelu": "integer data only; tests/ops/test_quantize.py",
})
