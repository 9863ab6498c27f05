"""Elementwise ops (activations, arithmetic, comparisons): indices tie across broadcast operands."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze.constants import ConstContext, ConstInfo, compress
from onnxshrink.analyze.keep import KeepState
from onnxshrink.ops.common import const_or_live, couple_broadcast, dtype_of
from onnxshrink.ops.registry import Handler, register

UNARY = (
    "Relu",
    "LeakyRelu",
    "Sigmoid",
    "HardSigmoid",
    "HardSwish",
    "Tanh",
    "Gelu",
    "Elu",
    "Selu",
    "Celu",
    "Softplus",
    "Softsign",
    "Mish",
    "ThresholdedRelu",
    "Swish",
    "Identity",
    "Cast",
    "Neg",
    "Abs",
    "Exp",
    "Log",
    "Sqrt",
    "Reciprocal",
    "Erf",
    "Sin",
    "Cos",
    "Tan",
    "Asin",
    "Acos",
    "Atan",
    "Sinh",
    "Cosh",
    "Asinh",
    "Acosh",
    "Atanh",
    "Floor",
    "Ceil",
    "Round",
    "Sign",
    "Not",
    "IsNaN",
    "IsInf",
)
NARY = (
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Max",
    "Min",
    "Sum",
    "Mean",
    "Where",
    "Equal",
    "Greater",
    "Less",
    "GreaterOrEqual",
    "LessOrEqual",
    "And",
    "Or",
    "Xor",
    "Mod",
    "BitShift",
    "PRelu",
    "Clip",
)


@register(*UNARY, *NARY)
class Elementwise(Handler):
    """y[i] depends on each operand at the broadcast position i only."""

    def operands(self, node: gs.Node) -> list[gs.Tensor]:
        return [t for t in node.inputs if t is not None and t.name]

    def constants(self, node: gs.Node, ctx: ConstContext) -> list[ConstInfo | None] | None:
        y = node.outputs[0]
        r = ir.rank(y)
        ops = self.operands(node)
        if (
            r is None
            or any(ir.rank(t) is None for t in ops)
            or all(ctx.const(t) is None for t in ops)
        ):
            return None
        pairs = [const_or_live(ctx, t, r) for t in ops]
        mask = np.logical_and.reduce(np.broadcast_arrays(*[m for m, _ in pairs]))
        if node.op in ("Mul", "And"):
            # A product with an exact zero is zero whatever the other operand (finite inputs).
            for m, v in pairs:
                mask = mask | (m & (v == 0))
        if not mask.any():
            return None
        values = [v for _, v in pairs]
        full = [None] * len(node.inputs)
        k = 0
        for i, t in enumerate(node.inputs):
            if t is not None and t.name:
                full[i] = values[k]
                k += 1
        out = ctx.evaluate(node, full)[0]
        mask, out = np.broadcast_arrays(mask, out)
        return [compress(np.array(mask), np.array(out))]

    def keep(self, node: gs.Node, ks: KeepState) -> None:
        y = node.outputs[0]
        for t in self.operands(node):
            ks.demand(t, pin=False)
            couple_broadcast(ks, node, y, t, combine=len(self.operands(node)) > 1)
        for extra in node.outputs[1:]:  # Dropout's mask
            couple_broadcast(ks, node, extra, y)


@register("Dropout")
class Dropout(Elementwise):
    """Inference-mode Dropout is the identity; ratio and training_mode are parameters."""

    def operands(self, node: gs.Node) -> list[gs.Tensor]:
        return node.inputs[:1]

    def constants(self, node, ctx):
        c = ctx.const(node.inputs[0])
        return [c] if c is not None else None

    def keep(self, node, ks):
        super().keep(node, ks)
        for t in node.inputs[1:]:
            ks.demand(t)


@register("CastLike")
class CastLike(Dropout):
    """The second input only donates its dtype: its indices are not read."""

    def keep(self, node, ks):
        Elementwise.keep(self, node, ks)
        ks.demand(node.inputs[1], pin=False)

    def constants(self, node, ctx):
        c = ctx.const(node.inputs[0])
        if c is None:
            return None
        return [ConstInfo(c.mask, c.value.astype(dtype_of(node.inputs[1])))]
