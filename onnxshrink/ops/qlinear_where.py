"""QLinearWhere (onnxruntime's com.microsoft domain): Where of two quantized operands,
requantized to the output's scale and zero point.

Inputs: condition, X, x_scale, x_zero_point, Y, y_scale, y_zero_point, z_scale, z_zero_point;
the three data inputs broadcast (numpy rules) to the output, the scales and zero points are per
tensor. Each output element is X's or Y's element at the same (broadcast) index, so channels
pass through it like an elementwise op: an output channel reads the same channel of each data
input, and a channel whose X and Y are constants that requantize alike is constant whatever the
condition (a pruned channel at both zero points leaves at the output's zero point).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Dims,
    Handler,
    InputTypes,
    KeepView,
    OpNode,
    broadcast_dims,
    compress,
    register,
)
from onnxshrink.ops.common import const_or_live, couple_broadcast
from onnxshrink.ops.oracle import declare_cases

MS = "com.microsoft"
CONDITION, X, Y = 0, 1, 4
DATA = (CONDITION, X, Y)


@register("QLinearWhere", domain=MS)
class QLinearWhere(Handler):
    """condition, X, X_scale, X_zp, Y, Y_scale, Y_zp, Z_scale, Z_zp: Where of the dequantized
    operands, requantized."""

    # onnx's reference evaluator has no com.microsoft ops: constants fold in onnxruntime's kernel
    evaluate_with_ort = True
    # neither onnx's shape inference nor onnxruntime's symbolic one knows its output
    types_unknown_to_inference = True

    def output_types(
        self, node: OpNode, inputs: InputTypes
    ) -> list[tuple[Dims | None, int] | None] | None:
        """The data inputs' dims broadcast; X's element type (the op's T)."""
        dims = [inputs.dims(i) for i in DATA]
        known = [d for d in dims if d is not None]
        return [(broadcast_dims(known) if len(known) == len(dims) else None, inputs.dtype(X))]

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """Where the condition is constant and picks a constant operand, or where both operands
        are constant and requantize to the same code: evaluated with onnxruntime's kernel, once
        with every condition True and once False."""
        r = ir.rank(node.outputs[0])
        if r is None or any(ir.rank(node.inputs[i]) is None for i in DATA):
            return None
        if ctx.const(node.inputs[X]) is None and ctx.const(node.inputs[Y]) is None:
            return None
        params = [ctx.value(t) if t is not None and t.name else None for t in node.inputs]
        if any(
            params[i] is None and ir.present(node, i) is not None
            for i in range(len(params))
            if i not in DATA
        ):
            return None  # a scale or zero point computed at run time
        (c_mask, c_val), (x_mask, x_val), (y_mask, y_val) = (
            const_or_live(ctx, node.inputs[i], r) for i in DATA
        )
        full = list(params)
        full[X], full[Y] = x_val, y_val
        picked = []
        for choice in (True, False):
            full[CONDITION] = np.full(
                np.broadcast_shapes(c_mask.shape, x_mask.shape, y_mask.shape), choice
            )
            picked.append(ctx.evaluate(node, full)[0])
        if_true, if_false = np.broadcast_arrays(*picked)
        c_mask, c_val, x_mask, y_mask = np.broadcast_arrays(
            c_mask, c_val.astype(bool), x_mask, y_mask
        )
        either = x_mask & y_mask & (if_true == if_false)
        chosen = c_mask & np.where(c_val, x_mask, y_mask)
        mask = either | chosen
        if not mask.any():
            return None
        value = np.where(chosen & ~c_val, if_false, if_true)
        return [compress(np.array(mask), np.array(value))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        """Each data input's axes tie to the output's (broadcast); the per-tensor scales and zero
        points are read whole."""
        y = node.outputs[0]
        for i, t in enumerate(node.inputs):
            if i in DATA:
                ks.demand(t, pin=False)
                couple_broadcast(ks, node, y, t, combine=True)
            else:
                ks.demand(t if t is not None and t.name else None)


# The oracle replays float data only (integer inputs are fixed there), as for QLinearAdd.
declare_cases(excluded={"QLinearWhere": "integer data only; tests/ops/test_qlinear_where.py"})
