"""Normalizations. BatchNorm and InstanceNorm act per channel. LayerNorm and RMSNorm see every
channel of the axis they normalize in their statistics, but a channel that is exactly zero at
their input adds nothing to the sums: it may leave when the norm is rewritten to keep the
statistics of the original width d (`StatNormalization`). GroupNorm's whole zero groups leave
(`GroupNorm`). Softmax and the other normalizations keep the axes they normalize whole.

Of a channel zero at the input: RMSNorm outputs 0 whatever its scale; LayerNorm outputs
-mean / std x scale + bias, a constant (the bias) only where the scale is zero, so a zero channel
with a non-zero scale stays (it is read), and `--explain` says so. With k of d channels gone:
- RMSNorm is the kept channels' RMSNorm with epsilon x d/(d-k) and scale x sqrt(d/(d-k)): the
  sum of squares is the same, only its divisor changes, and that factor moves out of the root;
- LayerNorm's mean divides the kept channels' sum by d, not d-k, which no LayerNorm of the kept
  channels does: the fused op runs over its input padded with k zeros, and the output is sliced
  back (measured faster in onnxruntime than the statistics written out with the divisor d:
  `tools/norm_forms.py`); a decomposed LayerNorm (ReduceMean, Sub, Pow, ReduceMean, ...) keeps
  its own nodes, its means rewritten to the divisor d (`ops/reduce.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

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
    Reader,
    Reason,
    RewriteView,
    ShapeView,
    WeightAxes,
    compress,
    elementwise_dims,
    register,
)
from onnxshrink.ops.common import (
    along,
    channelwise_constants,
    const_or_live,
    couple_broadcast,
    couple_same,
    dtype_of,
    ints,
    pin_normalized,
)
from onnxshrink.ops.oracle import OracleCase, declare_cases, needs, sig, zero_rows


@register("BatchNormalization")
class BatchNorm(Handler):
    """y = scale * (x - mean) / sqrt(var + eps) + bias, per channel (axis 1)."""

    evaluate_with_ort = True  # onnx.reference's opset-9 kernel takes a momentum attribute as training

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        return WeightAxes(0, None, "vector") if 1 <= i <= 4 and rank == 1 else None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        return {"weight": 1, "bias": 2, "running_mean": 3, "running_var": 4}

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(y)
        scale = ctx.value(node.inputs[1])
        if r is None or scale is None:
            return None
        xm, xv = const_or_live(ctx, x, r)
        mask = xm | along(scale.reshape(-1) == 0, 1, r)  # zero scale: the channel is the bias
        if not mask.any():
            return None
        params = [p for p in (ctx.value(t) for t in node.inputs[1:5]) if p is not None]
        if len(params) != 4:
            return None
        # Inference-mode formula. (onnx.reference's opset-9 kernel reads a momentum attribute as
        # "use batch statistics", so it is not used here.)
        scale, bias, mean, var = (along(p.reshape(-1).astype(np.float64), 1, r) for p in params)
        eps = float(node.attrs.get("epsilon", 1e-5))
        xin = np.where(xm, xv, 0).astype(np.float64)
        out = ((xin - mean) / np.sqrt(var + eps) * scale + bias).astype(xv.dtype)
        mask, out = np.broadcast_arrays(mask, out)
        return [compress(np.array(mask), np.array(out))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        if any(t.outputs for t in node.outputs[1:]):
            ks.barrier(
                node, Reason("barrier", node.name, node.op, "training-mode outputs are used")
            )
            return
        x, y = node.inputs[0], node.outputs[0]
        ks.demand(x, pin=False)
        couple_same(ks, node, x, y)
        for p in node.inputs[1:5]:
            ks.demand(p, pin=False)
            ks.couple(y, 1, p, 0)


@register("InstanceNormalization")
class InstanceNorm(Handler):
    """Statistics per (sample, channel) over the spatial axes: channels stay independent."""

    evaluate_with_ort = True

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        return WeightAxes(0, None, "vector") if i in (1, 2) and rank == 1 else None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        return {"weight": 1, "bias": 2}

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """A constant channel's output, computed at full static shape; and, exactly, the bias
        where the statistics cancel: a zero gain (whatever the input), a channel constant with
        one value all over the map (x - mean is 0; the runtime's float32 gives its rounding
        amplified by 1/sqrt(epsilon) there, which is no function to fold)."""
        x, y = node.inputs[0], node.outputs[0]
        r, n = ir.rank(y), ir.static_dim(x, 1)
        scale, bias = ctx.value(node.inputs[1]), ctx.value(node.inputs[2])
        base = channelwise_constants(ctx, node, invariant=False)
        if r is None or n is None or scale is None or bias is None or not float(node.attrs.get("epsilon", 1e-5)) > 0:
            return base
        exact = np.broadcast_to(scale.reshape(-1) == 0, (n,)).copy()
        c = ctx.const(x)
        if c is not None:
            exact |= c.slice_uniform(1, n)
        if not exact.any():
            return base
        b = np.broadcast_to(bias.reshape(-1), (n,)).astype(dtype_of(y))
        cb = base[0] if base else None
        if cb is None:
            return [ConstInfo(along(exact, 1, r), along(b, 1, r))]
        m, v = np.broadcast_arrays(cb.mask, cb.value)
        m = m | along(exact, 1, r)
        return [compress(m, np.where(along(exact, 1, r), along(b, 1, r), v))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        if r is None:
            ks.barrier(node)
            return
        ks.demand(x, pin=False)
        ks.couple(x, 0, y, 0)
        ks.couple(x, 1, y, 1)
        for a in range(2, r):
            ks.pin(x, a)
            ks.pin(y, a)
        for p in node.inputs[1:3]:
            ks.demand(p, pin=False)
            ks.couple(y, 1, p, 0)


def normalized_axes(node: gs.Node, reader: Reader, r: int, opset: int) -> list[int] | None:
    op = node.op
    if op in ("Softmax", "LogSoftmax", "Hardmax"):
        axis = ir.norm_axis(int(node.attrs.get("axis", -1 if opset >= 13 else 1)), r)
        return [axis] if opset >= 13 else list(range(axis, r))  # before 13: flattened from axis
    if op in ("LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"):
        return list(range(ir.norm_axis(int(node.attrs.get("axis", -1)), r), r))
    if op == "LpNormalization":
        return [ir.norm_axis(int(node.attrs.get("axis", -1)), r)]
    if op == "GroupNormalization":
        return list(range(1, r))
    if op == "LRN":
        return [1]
    if op == "MeanVarianceNormalization":
        axes = ints(node, reader, "axes", 99)
        return ir.norm_axes(axes if axes is not None else [0, 2, 3], r)
    return None


@register(
    "Softmax",
    "LogSoftmax",
    "Hardmax",
    "LpNormalization",
    "MeanVarianceNormalization",
)
class AxisNormalization(Handler):
    """Mixes the normalized axes: they keep every index; the other axes pass straight through."""

    # A constant row's statistics are ill-conditioned ((x - mean) / sqrt(var + eps) with var 0
    # amplifies one ulp of the mean): fold with the runtime's kernel, as the model will run it.
    evaluate_with_ort = True

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        return elementwise_dims(node, same_shape=True)

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        return WeightAxes(rank - 1, None, "vector") if i in (1, 2) and rank >= 1 else None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        return {"weight": 1, "bias": 2}

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        r = ir.rank(x)
        axes = normalized_axes(node, ks, r, ks.opset) if r is not None else None
        if r is None or axes is None:
            ks.barrier(node)
            return
        pin_normalized(ks, node, axes)
        for t in node.inputs[1:]:
            ks.demand(t)  # scale / bias over the normalized axes: kept whole
        for extra in node.outputs[1:]:  # saved mean / inverse std-dev (LayerNormalization)
            if ir.rank(extra) == r:
                for a in range(r):
                    if a not in axes:
                        ks.couple(extra, a, y, a)


@register("LRN")
class LocalResponseNormalization(AxisNormalization):
    evaluate_with_ort = True


# ---------------------------------------------------------------------- LayerNorm, RMSNorm
# epsilon where the attribute is absent, as onnxruntime's schemas give it
# (onnxruntime.capi.onnxruntime_pybind11_state.get_all_operator_schema)
EPSILON = {
    "LayerNormalization": 1e-5,
    "RMSNormalization": 1e-5,
    "SimplifiedLayerNormalization": 1e-5,
    "SkipLayerNormalization": 1e-12,
    "SkipSimplifiedLayerNormalization": 1e-12,
}


@dataclass(frozen=True)
class Stats:
    """A normalization over the last axis of the sum of `summed` (its input; plus skip and bias
    for the Skip ops): width d, its scale and shift (1-D, constant), and its epsilon."""

    d: int
    summed: list[gs.Tensor]
    scale: gs.Tensor
    shift: gs.Tensor | None
    eps: float


class StatNormalization(AxisNormalization):
    """LayerNorm (`centered`) or RMSNorm over the last axis, whose zero channels may leave (see
    the module docstring). Other layouts (several normalized axes, a scale that is not one
    constant per channel) keep the normalized axes whole, as before."""

    centered: ClassVar[bool] = True
    summed_slots: ClassVar[tuple[int, ...]] = (0,)
    scale_slot: ClassVar[int] = 1
    shift_slot: ClassVar[int | None] = 2
    sum_output: ClassVar[int | None] = None  # the output that is the summed input (Skip ops)

    def stats(self, node: gs.Node, reader: Reader) -> Stats | None:
        y = node.outputs[0]
        r = ir.rank(y)
        if r is None or r < 1:
            return None
        if "axis" in node.attrs and ir.norm_axis(int(node.attrs["axis"]), r) != r - 1:
            return None
        d = ir.static_dim(y, r - 1)
        if d is None or d < 2:
            return None
        summed = [ir.present(node, i) for i in self.summed_slots]
        summed = [t for t in summed if t is not None]
        if not summed or summed[0] is not node.inputs[0]:
            return None
        for t in summed:
            # a constant summand (the Skip ops' bias) by its original value: in the rewrite it
            # is sliced already, while the output still has the width the statistics saw
            v = reader.value(t) if isinstance(t, gs.Constant) else None
            shape = np.shape(v) if v is not None else None
            rt = len(shape) if shape is not None else ir.rank(t)
            last = shape[-1] if shape else (ir.static_dim(t, rt - 1) if rt else None)
            if rt is None or rt < 1 or rt > r or last != d:
                return None
        scale = ir.present(node, self.scale_slot)
        shift = ir.present(node, self.shift_slot) if self.shift_slot is not None else None
        for p in (scale, shift):
            v = reader.value(p) if p is not None else None
            if p is not None and (v is None or np.shape(v) != (d,)):
                return None
        if scale is None:
            return None
        eps = float(node.attrs.get("epsilon", EPSILON.get(node.op, 1e-5)))
        return Stats(d, summed, scale, shift, eps)

    def zero_channels(self, st: Stats, reader: Reader) -> np.ndarray:
        """The channels that are exactly 0 at the normalized input, for every input: zero in
        every summand (a constant from the analysis, never a sampled value)."""
        zero = np.ones(st.d, bool)
        for t in st.summed:
            c = reader.const(t)
            if c is None:
                return np.zeros(st.d, bool)
            zero &= c.slice_zero(ir.known_rank(t) - 1, st.d)
        return zero

    def output_constants(self, st: Stats, zero: np.ndarray, reader: Reader) -> tuple[np.ndarray, np.ndarray]:
        """Of the zero channels, those whose output is a constant, and its value: RMSNorm gives
        0 x scale / rms = 0; LayerNorm (0 - mean) / std x scale + bias, the bias where the scale
        is 0. Only with epsilon > 0 (else a row of zeros is 0 / 0)."""
        if not st.eps > 0:
            return np.zeros(st.d, bool), np.zeros(st.d)
        if not self.centered:
            return zero, np.zeros(st.d)
        scale = np.asarray(reader.value(st.scale)).reshape(-1)
        shift = reader.value(st.shift) if st.shift is not None else None
        bias = np.zeros(st.d) if shift is None else np.asarray(shift, np.float64).reshape(-1)
        return zero & (scale == 0), bias

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        st = self.stats(node, ctx)
        if st is None:
            return None
        zero = self.zero_channels(st, ctx)
        if not zero.any():
            return None
        const, value = self.output_constants(st, zero, ctx)
        outs: list[ConstInfo | None] = [None] * len(node.outputs)
        y = node.outputs[0]
        r = ir.known_rank(y)
        if const.any():
            outs[0] = ConstInfo(along(const, r - 1, r), along(value.astype(dtype_of(y)), r - 1, r))
        k = self.sum_output
        if k is not None and k < len(node.outputs) and ir.rank(node.outputs[k]) == r:
            out = node.outputs[k]
            outs[k] = ConstInfo(along(zero, r - 1, r), np.zeros((1,) * r, dtype_of(out)))
        return outs

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        st = self.stats(node, ks)
        if st is None:
            super().keep(node, ks)
            return
        y = node.outputs[0]
        r = ir.known_rank(y)
        zero = self.zero_channels(st, ks)
        ky = ks.kept(y, r - 1)
        for t in st.summed:
            ks.demand(t, pin=False)
        if ky is not None:
            # A zero channel whose output is read (LayerNorm with a non-zero scale): it stays.
            const, _ = self.output_constants(st, zero, ks)
            read_zero = ky & zero & ~const if self.centered else np.zeros(st.d, bool)
            if read_zero.any():
                why = Reason(
                    "normalization", node.name, node.op,
                    "this channel is zero at its input, but its scale is not zero: its output "
                    "(-mean / std x scale + bias) depends on the other channels",
                )  # fmt: skip
                for t in st.summed:
                    ks.keep(t, ir.known_rank(t) - 1, read_zero, why)
        stats = Reason(
            "normalization", node.name, node.op, "its statistics see every channel that is not zero"
        )
        for t in st.summed:
            ks.keep(t, ir.known_rank(t) - 1, ~zero, stats)
            couple_broadcast(ks, node, y, t, combine=len(st.summed) > 1)
        ks.normalizes(y, r - 1)
        for p in (st.scale, st.shift):
            if p is not None:
                ks.demand(p, pin=False)
                ks.couple(p, 0, y, r - 1)
        self.keep_extra_outputs(node, ks, r)

    def keep_extra_outputs(self, node: gs.Node, ks: KeepView, r: int) -> None:
        """Mean and inverse std-dev ([..., 1]): the rows pass through; the summed input (Skip
        ops) is indexed as the output."""
        y = node.outputs[0]
        for k, extra in enumerate(node.outputs[1:], 1):
            if ir.rank(extra) != r:
                ks.pin(extra)
                continue
            for a in range(r):
                if k == self.sum_output or (a < r - 1 and ks.size(extra, a) == ks.size(y, a)):
                    ks.couple(extra, a, y, a)
                else:
                    ks.pin(extra, a)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        st = self.stats(node, rw)
        y = node.outputs[0]
        kept = rw.kept(y, ir.known_rank(y) - 1) if st is not None else None
        if st is None or kept is None or kept.all():
            return
        n = int(kept.sum())
        if not self.centered:  # RMSNorm: the factor d/n moves out of the root
            factor = st.d / n
            node.attrs["epsilon"] = float(np.float32(st.eps * factor))
            scale = np.asarray(rw.value(st.scale))
            rw.replace_input(
                node,
                self.scale_slot,
                (scale.astype(np.float64)[kept] * math.sqrt(factor)).astype(scale.dtype),
            )
            rw.record_fold(node, st.d - n, "normalization with epsilon and scale rescaled")
            return
        self.pad_to_width(node, st, kept, rw)
        rw.record_fold(node, st.d - n, "normalization over a zero-padded input")

    def pad_to_width(self, node: gs.Node, st: Stats, kept: np.ndarray, rw: RewriteView) -> None:
        """LayerNorm over the kept channels and k zeros: the statistics of the width d. Scale and
        shift (and the Skip ops' bias) get k zeros too; the output is sliced back."""
        n = int(kept.sum())
        k = st.d - n
        vectors = [self.scale_slot, self.shift_slot]
        zeros: dict[str, gs.Tensor] = {}
        for i in [*self.summed_slots, *vectors]:
            t = ir.present(node, i) if i is not None else None
            if t is None:
                continue
            value = rw.value(t)
            if value is not None and value.ndim == 1:
                # Scale, shift, bias: k zeros made by nodes, which onnxruntime folds when the
                # session is made (it cannot fold a Pad of fp16), so that the model stores only
                # the kept channels' parameters.
                dtype = np.dtype(value.dtype)
                if dtype.str not in zeros:
                    width = rw.constant(np.asarray([k], np.int64), "norm_pad_width")
                    zero = rw.constant(np.zeros(1, dtype), "zero")
                    zeros[dtype.str] = rw.add_node(
                        "ConstantOfShape", [width], f"{node.name}_pad", {"value": zero}, dtype=dtype
                    )
                node.inputs[i] = rw.add_node(
                    "Concat", [t, zeros[dtype.str]], f"{t.name}_padded", {"axis": 0}, dtype=dtype
                )
                continue
            rt = ir.known_rank(t)
            pads = np.zeros(2 * rt, np.int64)
            pads[2 * rt - 1] = k
            if rw.opset >= 11:
                inputs, attrs = [t, rw.constant(pads, "norm_pads")], None
            else:
                inputs, attrs = [t], {"pads": pads.tolist()}
            node.inputs[i] = rw.add_node("Pad", inputs, f"{t.name}_padded", attrs, dtype=t.dtype)
        for j, out in enumerate(node.outputs):
            if (j == 0 or j == self.sum_output) and out.name:
                r = ir.known_rank(out)
                bounds = [rw.constant(np.asarray([v], np.int64), "norm_slice") for v in (0, n, r - 1)]
                rw.insert_after(node, j, "Slice", bounds, "unpadded", "padded")


def _only_reader(t: gs.Tensor, op: str | tuple[str, ...]) -> gs.Node | None:
    ops = (op,) if isinstance(op, str) else op
    if len(t.outputs) != 1 or t.outputs[0].op not in ops:
        return None
    return t.outputs[0]


def _other(node: gs.Node, t: gs.Tensor) -> tuple[int, gs.Tensor] | None:
    """The other operand of a binary node that reads `t` once."""
    if len(node.inputs) != 2 or (node.inputs[0] is t) == (node.inputs[1] is t):
        return None
    i = 1 if node.inputs[0] is t else 0
    return i, node.inputs[i]


@dataclass(frozen=True)
class RmsChain:
    """A decomposed RMSNorm after its mean of squares: the Add of epsilon (its operand
    `eps_at`) and the Mul by the scale vector (its operand `scale_at`)."""

    add: gs.Node
    eps_at: int
    gain: gs.Node
    scale_at: int


def rms_chain(mean: gs.Tensor, reader: Reader) -> RmsChain | None:
    """When the mean of squares `mean` feeds a decomposed RMSNorm as exporters write it:
    Add(mean, eps) -> Sqrt -> Reciprocal or Div(1, .) -> Mul(x, .), or Div(x, Sqrt); then Casts
    and the Mul by a constant scale vector, each the only reader of the one before."""
    add = _only_reader(mean, "Add")
    eps_at = _other(add, mean) if add is not None else None
    if add is None or eps_at is None or not isinstance(eps_at[1], gs.Constant):
        return None
    eps = reader.value(eps_at[1])
    sqrt = _only_reader(add.outputs[0], "Sqrt")
    if eps is None or np.size(eps) != 1 or sqrt is None:
        return None
    q = sqrt.outputs[0]
    step = _only_reader(q, ("Reciprocal", "Div"))
    if step is None or (step.op == "Div" and step.inputs[1] is not q):
        return None
    if step.op == "Div" and not _is_one(step.inputs[0], reader):  # x / sqrt(...)
        z = step.outputs[0]
    else:  # Reciprocal or Div(1, .) (torch's rsqrt, as its legacy exporter writes it)
        mul = _only_reader(step.outputs[0], "Mul")
        if mul is None or _other(mul, step.outputs[0]) is None:
            return None
        z = mul.outputs[0]
    while (cast := _only_reader(z, "Cast")) is not None:
        z = cast.outputs[0]
    gain = _only_reader(z, "Mul")
    scale_at = _other(gain, z) if gain is not None else None
    if gain is None or scale_at is None or not isinstance(scale_at[1], gs.Constant):
        return None
    scale = reader.value(scale_at[1])
    if scale is None or scale.ndim != 1:
        return None
    return RmsChain(add, eps_at[0], gain, scale_at[0])


def _is_one(t: gs.Tensor, reader: Reader) -> bool:
    """Whether `t` is the constant scalar 1 (a reciprocal's numerator)."""
    v = reader.value(t) if isinstance(t, gs.Constant) else None
    return v is not None and np.size(v) == 1 and float(np.asarray(v).reshape(-1)[0]) == 1.0


def rescale_rms(rw: RewriteView, mean: gs.Tensor, f: float) -> bool:
    """The mean of squares `mean` must be multiplied by f (kept / original channels) to keep
    the divisor of the original width. When it feeds a decomposed RMSNorm (`rms_chain`),
    rsqrt(f x mean + eps) is rsqrt(mean + eps / f) / sqrt(f): epsilon and the scale are
    rescaled as for a fused RMSNorm, and no node is added. True if done; else nothing changes."""
    chain = rms_chain(mean, rw)
    if chain is None:
        return False
    e = np.asarray(rw.current(chain.add.inputs[chain.eps_at]))
    scale = rw.current(chain.gain.inputs[chain.scale_at])
    rw.replace_input(chain.add, chain.eps_at, (e.astype(np.float64) / f).astype(e.dtype))
    rw.replace_input(
        chain.gain, chain.scale_at, (scale.astype(np.float64) / math.sqrt(f)).astype(scale.dtype)
    )
    return True


@register("LayerNormalization")
class LayerNorm(StatNormalization):
    """X, Scale, [B] -> Y, [Mean, InvStdDev]; normalized from `axis` to the end."""


@register("RMSNormalization")
class RMSNorm(StatNormalization):
    """ONNX's RMSNormalization (opset 23): X, scale -> Y."""

    centered = False
    shift_slot = None


@register("GroupNormalization")
class GroupNorm(AxisNormalization):
    """Statistics per (sample, group of C/G channels) over the group's channels and the spatial
    axes. A group whose every channel is exactly zero at the input has mean 0 and variance 0:
    its outputs are the bias (epsilon > 0), and the other groups' statistics do not see it, so
    it leaves whole (`num_groups` rewritten). A group with one non-zero channel stays whole.
    Scale and bias are per channel from opset 21; a model before that with per-group ones keeps
    its channels."""

    def groups(self, node: gs.Node, reader: Reader) -> tuple[int, int] | None:
        """(channels C, channels per group) when the layout is understood."""
        x = node.inputs[0]
        r, c = ir.rank(x), ir.static_dim(x, 1)
        g = int(node.attrs.get("num_groups", 0))
        if r is None or r < 2 or c is None or g < 1 or c % g:
            return None
        for t in node.inputs[1:3]:
            v = reader.value(t) if t is not None and t.name else None
            if v is None or np.shape(v) != (c,):
                return None  # per-group (opset 18) or computed scale and bias
        return c, c // g

    def zero_groups(self, node: gs.Node, reader: Reader, c: int, per: int) -> np.ndarray:
        """Per channel: is its whole group one constant at the input (zero, or one value over
        every channel and position of the group: its statistics cancel exactly, to the bias)?"""
        const = reader.const(node.inputs[0])
        if const is None:
            return np.zeros(c, bool)
        uniform = const.slice_uniform(1, c).reshape(-1, per).all(axis=1)
        values = const.slice_values(1, c).reshape(-1, per)
        same = uniform & (values == values[:, :1]).all(axis=1)
        return np.repeat(const.slice_zero(1, c).reshape(-1, per).all(axis=1) | same, per)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        layout = self.groups(node, ctx)
        if layout is None or not float(node.attrs.get("epsilon", 1e-5)) > 0:
            return None
        c, per = layout
        zero = self.zero_groups(node, ctx, c, per)
        if not zero.any():
            return None
        y = node.outputs[0]
        r = ir.known_rank(node.inputs[0])
        bias = np.asarray(ctx.value(node.inputs[2])).reshape(-1)
        return [ConstInfo(along(zero, 1, r), along(bias.astype(dtype_of(y)), 1, r))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        layout = self.groups(node, ks)
        if layout is None:
            super().keep(node, ks)
            return
        c, per = layout
        x, y = node.inputs[0], node.outputs[0]
        r = ir.known_rank(x)
        ks.demand(x, pin=False)
        why = Reason("normalization", node.name, node.op, "its statistics see every channel of a group")
        zero = self.zero_groups(node, ks, c, per)
        ks.keep(x, 1, ~zero, why)
        ky = ks.kept(y, 1)
        if ky is not None and ky.any():  # kept channels keep their whole groups
            ks.keep(y, 1, np.repeat(ky.reshape(-1, per).any(axis=1), per), why)
        ks.couple(x, 0, y, 0)
        ks.couple(x, 1, y, 1)
        for a in range(2, r):
            ks.pin(x, a)
            ks.pin(y, a)
        for p in node.inputs[1:3]:
            ks.demand(p, pin=False)
            ks.couple(p, 0, y, 1)
        if per > 1:  # for the coupled groups: a group of channels is one unit
            first = np.repeat(np.arange(0, c, per), per)
            ks.unit(y, 1, np.arange(c), y, 1, first)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        layout = self.groups(node, rw)
        kept = rw.kept(node.outputs[0], 1) if layout is not None else None
        if layout is None or kept is None or kept.all():
            return
        node.attrs["num_groups"] = int(kept.sum()) // layout[1]


# ------------------------------------------------------------------ oracle cases
def _norm_case(op: str, rng: np.random.Generator) -> OracleCase:
    c = int(rng.choice([2, 4, 6]))
    x = [1, c, 3, 2]
    vec = [("S", "float", [c]), ("B", "float", [c])]
    if op == "BatchNormalization":
        ins = [("x", "float", x), *vec, ("M", "float", [c]), ("V", "float", [c])]
        body, values = "y = BatchNormalization (x, S, B, M, V)", {"V": np.abs(np.linspace(0.5, 2, c))}
        return OracleCase(op, sig(ins, [("y", x)]) + f" {{ {body} }}", 15, values=values,
                          zero={"S": np.s_[zero_rows(rng, c)]}, needs=needs(rng, "y", x))
    if op == "InstanceNormalization":
        return OracleCase(op, sig([("x", "float", x), *vec], [("y", x)]) + " { y = InstanceNormalization (x, S, B) }",
                          17, needs=needs(rng, "y", x))
    if op == "GroupNormalization":
        g = int(rng.choice([1, 2]))
        return OracleCase(op, sig([("x", "float", x), *vec], [("y", x)]) + f" {{ y = GroupNormalization <num_groups = {g}> (x, S, B) }}",
                          21, needs=needs(rng, "y", x))
    if op == "LayerNormalization":
        axis = int(rng.choice([-1, -2]))
        shape = x[axis:]
        ins = [("x", "float", x), ("S", "float", shape), ("B", "float", shape)]
        return OracleCase(op, sig(ins, [("y", x)]) + f" {{ y = LayerNormalization <axis = {axis}> (x, S, B) }}", 17,
                          needs=needs(rng, "y", x))
    if op == "LRN":
        return OracleCase(op, sig([("x", "float", x)], [("y", x)]) + " { y = LRN <size = 3> (x) }", 17, needs=needs(rng, "y", x))
    if op == "MeanVarianceNormalization":
        return OracleCase(op, sig([("x", "float", x)], [("y", x)]) + f" {{ y = {op} (x) }}", 17, needs=needs(rng, "y", x))
    axis = int(rng.integers(1, 4))
    attr = " <p = 2, axis = 1>" if op == "LpNormalization" else f" <axis = {axis}>"
    return OracleCase(op, sig([("x", "float", x)], [("y", x)]) + f" {{ y = {op}{attr} (x) }}", 17, needs=needs(rng, "y", x))


declare_cases(
    dict.fromkeys(
        ("BatchNormalization", "InstanceNormalization", "GroupNormalization", "LayerNormalization", "LRN",
         "MeanVarianceNormalization", "Softmax", "LogSoftmax", "Hardmax", "LpNormalization"),
        _norm_case,
    ),
    excluded={"RMSNormalization": "onnxruntime here has no kernel for it (opset 23)"},
)  # fmt: skip
