"""Pooling: channels map one-to-one; the spatial axes are mixed and keep everything."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import ConstInfo, ConstView, Handler, KeepView, Reason, register
from onnxshrink.ops.common import channelwise_constants
from onnxshrink.ops.oracle import OracleCase, declare_cases, needs, sig


def _no_padding(node: gs.Node) -> bool:
    auto = node.attrs.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    return auto in ("NOTSET", "VALID") and not any(node.attrs.get("pads", []) or [])


def channel_map_keep(node: gs.Node, ks: KeepView, x: gs.Tensor, y: gs.Tensor) -> None:
    """Batch and channel axes tie input to output; every other axis keeps all indices."""
    r = ir.rank(x)
    if r is None or ir.rank(y) != r:
        ks.barrier(node)
        return
    ks.demand(x, pin=False)
    ks.couple(x, 0, y, 0)
    ks.couple(x, 1, y, 1)
    for a in range(2, r):
        ks.pin(x, a)
        ks.pin(y, a)


@register("MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
class Pool(Handler):
    evaluate_with_ort = True

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        op = node.op
        invariant = op in ("MaxPool", "GlobalMaxPool", "GlobalAveragePool") or (
            op == "AveragePool"
            and (_no_padding(node) or not int(node.attrs.get("count_include_pad", 0)))
        )
        return channelwise_constants(ctx, node, invariant)

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        channel_map_keep(node, ks, x, y)
        if len(node.outputs) > 1 and node.outputs[1].outputs:
            # MaxPool's indices are flat offsets that count the channels before them.
            why = Reason(
                "structure", node.name, node.op, "its indices output encodes channel offsets"
            )
            ks.pin(x, 1, why)
            ks.pin(y, 1, why)
            ks.couple(node.outputs[1], 1, y, 1)


# ------------------------------------------------------------------ oracle cases
def _pool_case(op: str, rng: np.random.Generator) -> OracleCase:
    c = int(rng.integers(2, 5))
    x = [1, c, 4, 4]
    if op.startswith("Global"):
        return OracleCase(op, sig([("x", "float", x)], [("y", [1, c, 1, 1])]) + f" {{ y = {op} (x) }}", 17,
                          needs=needs(rng, "y", [1, c, 1, 1]))
    pad = int(rng.integers(0, 2))
    y = [1, c, 4 + 2 * pad - 1, 4 + 2 * pad - 1]
    attrs = f"kernel_shape = [2, 2], pads = [{pad}, {pad}, {pad}, {pad}]"
    if op == "AveragePool":
        attrs += f", count_include_pad = {int(rng.integers(0, 2))}"
    return OracleCase(op, sig([("x", "float", x)], [("y", y)]) + f" {{ y = {op} <{attrs}> (x) }}", 17,
                      needs=needs(rng, "y", y))


declare_cases(dict.fromkeys(
    ("MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"), _pool_case
))
