"""DepthToSpace: blocks of channels become pixels. [N, C*b*b, H, W] -> [N, C, H*b, W*b].

Output channel c is built from b*b input channels (mode DCR: channels (i*b + j)*C + c; CRD:
c*b*b + i*b + j), so channels go as whole blocks: an output channel kept keeps its block, and
an input channel kept (by another reader) keeps its output channel. Removing whole blocks keeps
the layout of the rest, so nothing needs rewriting: blocksize and mode do not depend on C.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import ConstInfo, ConstView, Handler, KeepView, Reason, compress, register
from onnxshrink.ops.common import along, channel_expand
from onnxshrink.ops.oracle import OracleCase, declare_cases, layout_dims, needs, sig


@register("DepthToSpace")
class DepthToSpace(Handler):
    def owner(self, node: gs.Node, channels_out: int) -> np.ndarray:
        """For each input channel, the output channel it is part of."""
        b = int(node.attrs["blocksize"])
        k = np.arange(channels_out * b * b)
        mode = node.attrs.get("mode", "DCR")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        return k // (b * b) if mode == "CRD" else k % channels_out

    def channels(self, node: gs.Node, x: gs.Tensor, y: gs.Tensor) -> tuple[int, int] | None:
        """(input channels, output channels) when both are static and consistent."""
        b = int(node.attrs["blocksize"])
        ci, co = ir.static_dim(x, 1), ir.static_dim(y, 1)
        if ir.rank(x) != 4 or ci is None or co is None or ci != co * b * b:
            return None
        return ci, co

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        x, y = node.inputs[0], node.outputs[0]
        c, sizes = ctx.const(x), self.channels(node, x, y)
        if c is None or sizes is None:
            return None
        ci, co = sizes
        owner = self.owner(node, co)
        in_const = c.slice_constant(1, ci)
        out_const = np.array([in_const[owner == o].all() for o in range(co)])
        full = channel_expand(ctx, x)  # the constant values at full (static) shape
        if not out_const.any() or full is None:
            return None
        out = ctx.evaluate(node, [full])[0]
        return [compress(np.broadcast_to(along(out_const, 1, 4), out.shape), out)]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        x, y = node.inputs[0], node.outputs[0]
        sizes = self.channels(node, x, y)
        if sizes is None:
            ks.barrier(node, Reason("barrier", node.name, node.op, "channel counts unknown"))
            return
        _, co = sizes
        ks.demand(x, pin=False)
        ks.couple(x, 0, y, 0)
        why = Reason("structure", node.name, node.op, "blocks of channels become pixels")
        for a in (2, 3):  # every pixel of the output interleaves a whole block
            ks.pin(x, a, why)
            ks.pin(y, a, why)
        owner = self.owner(node, co)
        kx, ky = ks.kept(x, 1), ks.kept(y, 1)
        assert kx is not None and ky is not None  # static (checked above)
        ks.need(x, 1, ky[owner], why=ks.reason_ids(y, 1)[owner])  # an output channel: its block
        ks.keep(y, 1, np.bincount(owner, weights=kx, minlength=co) > 0, why)
        ks.unit(x, 1, np.arange(len(owner)), y, 1, owner)  # for the groups: a block goes with its channel


# ------------------------------------------------------------------ oracle cases
def _depth_to_space_case(op: str, rng: np.random.Generator) -> OracleCase:
    c, _, _ = layout_dims(rng)
    x = [1, 4 * c, 2, 2]
    y = [1, c, 4, 4]
    mode = rng.choice(["DCR", "CRD"])
    return OracleCase(op, sig([("x", "float", x)], [("y", y)]) + f' {{ y = DepthToSpace <blocksize = 2, mode = "{mode}"> (x) }}',
                      17, needs=needs(rng, "y", y))


declare_cases({"DepthToSpace": _depth_to_space_case})
