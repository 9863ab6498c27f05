"""onnxruntime's fused activations (com.microsoft): what onnxruntime's transformer optimizer and
Optimum write for a Linear's bias and its GELU.

`BiasGelu(x, b)` is gelu(x + b), `FastGelu(x, b?)` the tanh approximation of gelu(x + b),
`QuickGelu(x)` x * sigmoid(alpha * x), `BiasAdd(x, b, skip)` x + b + skip, `Gelu(x)` gelu(x):
elementwise with numpy broadcasting, so they tie their operands' indices as Add and Gelu do.
Their constants are evaluated with onnxruntime's own kernels (the model runs them). A constant
added to x (a removed FFN neuron folded into the projection before them) goes into their bias.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    OpNode,
    RewriteView,
    WeightAxes,
    compress,
    register,
)
from onnxshrink.ops.common import const_or_live
from onnxshrink.ops.elementwise import Elementwise
from onnxshrink.ops.oracle import MS_HEADER, OracleCase, declare_cases, needs, sig, zero_rows

MS = "com.microsoft"


def add_to_bias(node: gs.Node, slot: int, values: np.ndarray, rw: RewriteView) -> bool:
    """A constant added to an input whose op adds the vector at `slot` over the last axis:
    merge it into that vector (created when absent) if it is one value per last-axis index."""
    values = np.asarray(values)
    if values.ndim == 0 or any(d != 1 for d in values.shape[:-1]):
        return False  # varies over rows: not a bias
    vec = values.reshape(-1)
    bias = ir.present(node, slot)
    if bias is not None and not isinstance(bias, gs.Constant):
        return False
    if bias is not None:
        old = np.asarray(bias.values)
        if old.ndim != 1 or len(old) not in (1, len(vec)):
            return False
        merged, dtype = old.astype(np.float64) + vec.astype(np.float64), old.dtype
    else:
        merged, dtype = vec.astype(np.float64), vec.dtype
    rw.replace_input(node, slot, merged.astype(dtype))
    return True


class _Fused(Elementwise):
    evaluate_with_ort = True  # onnxruntime's own kernels: onnx's reference evaluator has none
    bias_slot: int | None = 1

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        return WeightAxes(0, None, "vector") if i == self.bias_slot and rank == 1 else None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        slot = self.bias_slot
        return {"bias": slot} if slot is not None and slot < len(constant) and constant[slot] else {}

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """As Elementwise's, with every operand at full size along the last axis and the bias a
        vector: onnxruntime's kernels take no other broadcast."""
        y = node.outputs[0]
        r, n = ir.rank(y), ir.static_dim(y, -1)
        ops = self.operands(node)
        if r is None or n is None or all(ctx.const(t) is None for t in ops):
            return None
        pairs: list[tuple[np.ndarray, np.ndarray] | None] = []
        for t in node.inputs:
            if t is None or not t.name:
                pairs.append(None)
                continue
            rt = ir.rank(t)
            if rt is None:
                return None
            m, v = const_or_live(ctx, t, rt)
            full = m.shape[:-1] + (n,)
            pairs.append((np.broadcast_to(m, full), np.broadcast_to(v, v.shape[:-1] + (n,))))
        mask = np.logical_and.reduce(
            np.broadcast_arrays(*[p[0].reshape((1,) * (r - p[0].ndim) + p[0].shape) for p in pairs if p])
        )
        if not mask.any():
            return None
        lead = np.broadcast_shapes(*[p[1].shape[:-1] for p in pairs if p and p[1].ndim == r])
        vals = [
            None
            if p is None
            else (p[1].reshape(-1)[:n] if i == self.bias_slot else np.broadcast_to(p[1], lead + (n,)))
            for i, p in enumerate(pairs)
        ]
        out = ctx.evaluate(node, [None if v is None else np.ascontiguousarray(v) for v in vals])[0]
        mask, out = np.broadcast_arrays(mask, out)
        return [compress(np.array(mask), np.array(out))]

    def absorb_addend(self, node: gs.Node, i: int, values: np.ndarray, rw: RewriteView) -> bool:
        if self.bias_slot is None or i == self.bias_slot or i >= self.bias_slot:
            return False
        return add_to_bias(node, self.bias_slot, values, rw)


@register("BiasGelu", "FastGelu", domain=MS)
class BiasGelu(_Fused):
    pass


@register("BiasAdd", domain=MS)
class BiasAdd(_Fused):
    def absorb_addend(self, node: gs.Node, i: int, values: np.ndarray, rw: RewriteView) -> bool:
        return i in (0, 2) and add_to_bias(node, 1, values, rw)


@register("QuickGelu", "Gelu", domain=MS)
class FusedUnary(_Fused):
    bias_slot = None


# ------------------------------------------------------------------ oracle cases
def _fused_case(op: str, rng: np.random.Generator) -> OracleCase:
    s, c = int(rng.integers(1, 4)), int(rng.choice([4, 6, 8]))
    x = [1, s, c]
    vec = op in ("BiasGelu", "FastGelu")
    ins = [("x", "float", x)] + ([("B", "float", [c])] if vec else [])
    args = "x, B" if vec else "x"
    text = sig(ins, [("y", x)]) + f" {{ y = com.microsoft.{op} ({args}) }}"
    return OracleCase(op, MS_HEADER + text, 17, zero={"B": np.s_[zero_rows(rng, c)]} if vec else {},
                      needs=needs(rng, "y", x))


declare_cases(
    dict.fromkeys(("BiasGelu", "FastGelu", "QuickGelu"), _fused_case),
    excluded={"BiasAdd": "onnxruntime has a CUDA kernel only (tests/ops/test_fused.py checks its rule)"},
)
