"""onnxruntime's fused normalizations (com.microsoft, and SimplifiedLayerNormalization in the
ONNX domain as onnxruntime registers it): what its transformer optimizer writes for a residual
Add and the LayerNorm (or RMSNorm) after it, and for BERT's embeddings.

They normalize over the last axis of input + skip + bias, as LayerNormalization and RMSNorm do
(`ops.norm.StatNormalization`): a channel zero in all three leaves, the norm keeping the
statistics of its original width; the other axes pass through (tied across input, skip and
outputs). A constant added to the input or the skip (a removed neuron folded into the
projection before them) goes into their bias, which they add before normalizing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import Handler, KeepView, OpNode, Reason, RewriteView, WeightAxes, register
from onnxshrink.ops.common import couple_broadcast
from onnxshrink.ops.fused_activation import MS, add_to_bias
from onnxshrink.ops.norm import StatNormalization
from onnxshrink.ops.oracle import MS_HEADER, OracleCase, declare_cases, needs, sig


class _SkipNorm(StatNormalization):
    """input, skip, gamma, [beta,] [bias] -> output, mean, inv_std_var, input + skip + bias."""

    evaluate_with_ort = True
    params: Mapping[str, int] = {"weight": 2, "bias": 3}
    bias_slot = 4
    scale_slot = 2
    sum_output = 3

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        return WeightAxes(0, None, "vector") if i >= 2 and rank == 1 else None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        return {k: v for k, v in self.params.items() if v < len(constant) and constant[v]}

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        if self.stats(node, ks) is not None:
            super().keep(node, ks)
            return
        x, skip, y = node.inputs[0], node.inputs[1], node.outputs[0]
        r = ir.rank(y)
        if r is None or ir.rank(x) != r:
            ks.barrier(node, Reason("barrier", node.name, node.op, "shapes unknown"))
            return
        why = Reason("normalization", node.name, node.op)
        for t in (x, skip):
            ks.demand(t, pin=False)
            couple_broadcast(ks, node, y, t, combine=True)
            ks.pin(t, ir.known_rank(t) - 1, why)
        ks.pin(y, r - 1, why)
        for t in node.inputs[2:]:
            ks.demand(t if t is not None and t.name else None)  # gamma, beta, bias: whole
        for extra in node.outputs[1:]:
            if ir.rank(extra) == r:  # mean, inv_std_var ([.., 1]) and the sum ([.., hidden])
                for a in range(r):
                    if ks.size(extra, a) == ks.size(y, a):
                        ks.couple(extra, a, y, a)
                    else:
                        ks.pin(extra, a)
            else:
                ks.pin(extra)

    def absorb_addend(self, node: gs.Node, i: int, values, rw: RewriteView) -> bool:
        if i not in (0, 1) or any(t.outputs for t in node.outputs[3:]):
            return False  # the sum output would show the addend: it must stay where it was
        return add_to_bias(node, self.bias_slot, values, rw)


@register("SkipLayerNormalization", domain=MS)
class SkipLayerNorm(_SkipNorm):
    params = {"weight": 2, "bias": 3}
    bias_slot = 4
    summed_slots = (0, 1, 4)
    shift_slot = 3


@register("SkipSimplifiedLayerNormalization", domain=MS)
class SkipSimplifiedLayerNorm(_SkipNorm):
    params = {"weight": 2}
    bias_slot = 3
    summed_slots = (0, 1, 3)
    shift_slot = None
    centered = False


@register("SimplifiedLayerNormalization")
@register("SimplifiedLayerNormalization", domain=MS)
class SimplifiedLayerNorm(StatNormalization):
    """RMSNorm: normalizes from `axis` (default -1) to the end, as LayerNormalization does."""

    centered = False
    shift_slot = None


@register("EmbedLayerNormalization", domain=MS)
class EmbedLayerNorm(Handler):
    """Token, position and segment embeddings summed and normalized over the hidden axis: the
    tables and the hidden axis stay whole (masked embedding rows are tokens, kept as the
    unfused Gather keeps them); batch and sequence pass through from the ids."""

    evaluate_with_ort = True

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        ids = node.inputs[0]
        for t in node.inputs:
            ks.demand(t if t is not None and t.name else None)
        why = Reason("normalization", node.name, node.op)
        for k in (0, 2):  # output and embedding_sum: [batch, seq, hidden]
            if k < len(node.outputs):
                out = node.outputs[k]
                if ir.rank(out) != 3 or ir.rank(ids) != 2:
                    ks.pin(out, reason=why)
                    continue
                ks.couple(ids, 0, out, 0)
                ks.couple(ids, 1, out, 1)
                ks.pin(out, 2, why)
        if len(node.outputs) > 1:
            ks.pin(node.outputs[1])  # mask_index


# ------------------------------------------------------------------ oracle cases
def _skip_norm_case(op: str, rng: np.random.Generator) -> OracleCase:
    s, c = int(rng.integers(1, 4)), int(rng.choice([4, 6, 8]))
    x = [1, s, c]
    ins = [("x", "float", x), ("skip", "float", x), ("G", "float", [c])]
    if op == "SkipLayerNormalization":
        ins += [("Be", "float", [c]), ("Bi", "float", [c])]
    args = ", ".join(n for n, _, _ in ins)
    text = sig(ins, [("y", x)]) + f" {{ y = com.microsoft.{op} <epsilon = 1e-5> ({args}) }}"
    return OracleCase(op, MS_HEADER + text, 17, needs=needs(rng, "y", x))


declare_cases(
    dict.fromkeys(("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"), _skip_norm_case),
    excluded={
        "SimplifiedLayerNormalization": "onnx's checker refuses it in the ONNX domain, where "
        "onnxruntime defines it (tests/ops/test_fused.py runs it)",
        "EmbedLayerNormalization": "its data inputs are token ids (integers)",
    },
)
