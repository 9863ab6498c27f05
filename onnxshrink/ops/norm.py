"""Normalizations. BatchNorm and InstanceNorm act per channel; the others mix the axes they
normalize over (their statistics see every index), so those axes keep everything."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze.constants import ConstInfo, compress
from onnxshrink.analyze.keep import Reason
from onnxshrink.analyze.shapes import elementwise_dims
from onnxshrink.ops.common import along, channelwise_constants, const_or_live, couple_same, ints
from onnxshrink.ops.contract import (
    ConstView,
    Handler,
    KeepView,
    OpNode,
    Reader,
    ShapeView,
    WeightAxes,
)
from onnxshrink.ops.registry import register


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
        return channelwise_constants(ctx, node, invariant=False)

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
    "LayerNormalization",
    "RMSNormalization",
    "LpNormalization",
    "GroupNormalization",
    "MeanVarianceNormalization",
)
class AxisNormalization(Handler):
    """Mixes the normalized axes: they keep every index; the other axes pass straight through."""

    # A constant row's statistics are ill-conditioned ((x - mean) / sqrt(var + eps) with var 0
    # amplifies one ulp of the mean): fold with the runtime's kernel, as the model will run it.
    evaluate_with_ort = True

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> list | None:
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
        ks.demand(x, pin=False)
        why = Reason("normalization", node.name, node.op)
        for a in axes:
            ks.pin(x, a, why)
            ks.pin(y, a, why)
        couple_same(ks, node, x, y)
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
