"""Ops no handler knows: replayed in onnxruntime (analyze/replay.py) instead of kept whole.

The replay reads off what each output index depends on. Where output index k along an axis
depends on input index k only (or on nothing), the op leaves that axis in place and the channels
flow through it as through an activation: the input and output axes are tied. Everything else
keeps every index, as a barrier does: an axis the op mixes (LpNormalization over channels), an
axis an attribute or a constant input is sized by (a per-channel parameter), inputs whose values
cannot be drawn (integers), ops onnxruntime cannot run. Constants are found the same way: output
elements no live input reaches are constant, with the value the runtime computes.

Not registered for any op: the analysis's lookup (analyze.lookup) falls back to it for nodes no
handler claims.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze.replay import Replayed, ReplayError, commutes, replay
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Handler,
    KeepView,
    Reader,
    Reason,
    compress,
    static_batch1,
)

# Domains whose ops onnxruntime runs.
REPLAYABLE_DOMAINS = ("", "ai.onnx", "com.microsoft")


def replayable(node: gs.Node) -> bool:
    """May this node be replayed at all (a runnable domain, no subgraph)?"""
    subgraph = any(isinstance(v, gs.Graph) for v in node.attrs.values())
    return (node.domain or "") in REPLAYABLE_DOMAINS and not subgraph


def _inputs(node: gs.Node, reader: Reader) -> tuple[list[np.ndarray | None], list[bool]] | str:
    """Arrays to replay the node with (constant inputs' values; placeholders for live ones) and
    which inputs are live; a reason when it cannot be replayed."""
    arrays: list[np.ndarray | None] = []
    live: list[bool] = []
    for i, t in enumerate(node.inputs):
        if t is None or not t.name:
            arrays.append(None)
            live.append(False)
            continue
        value = reader.value(t)
        if value is not None:
            arrays.append(np.asarray(value))
            live.append(False)
            continue
        shape = static_batch1(t)
        if shape is None or t.dtype is None:
            return f"input {i} has no static shape"
        dtype = np.dtype(t.dtype)
        if not np.issubdtype(dtype, np.floating):
            return f"input {i} is computed and not floating point"
        arrays.append(np.zeros(shape, dtype))
        live.append(True)
    return arrays, live


class ReplayedOp(Handler):
    """The fallback for ops with no handler (see the module docstring)."""

    def probe(self, node: gs.Node, reader: Reader) -> tuple[Replayed, list[bool]] | str:
        """Replay the node: every axis of every live input probed; constant elements of live
        inputs keep their values (what depends only on them is constant)."""
        got = _inputs(node, reader)
        if isinstance(got, str):
            return got
        arrays, live = got
        axes = {i: list(range(a.ndim)) for i, (a, v) in enumerate(zip(arrays, live, strict=True)) if v and a is not None}
        fixed = {}
        for i, t in enumerate(node.inputs):
            c = reader.const(t) if live[i] else None
            if c is not None:
                fixed[i] = (c.mask, c.value)
        try:
            return replay(node, arrays, live, axes, reader.opset, fixed=fixed), live
        except ReplayError as exc:
            return str(exc)

    def arrays(self, node: gs.Node, reader: Reader) -> list[np.ndarray | None]:
        got = _inputs(node, reader)
        assert not isinstance(got, str)  # probe() succeeded on the same node
        return got[0]

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        if not replayable(node) or not any(ctx.const(t) is not None for t in node.inputs if t is not None):
            return None
        found = self.probe(node, ctx)
        if isinstance(found, str):
            return None
        rep, _ = found
        out: list[ConstInfo | None] = []
        for o, t in enumerate(node.outputs):
            shape = ir.dims(t)
            const = ~rep.depends[o]
            if not const.any() or shape is None or list(const.shape) != list(shape):
                out.append(None)  # nothing constant, or shapes the replay does not stand for
                continue
            value = rep.outputs[o].astype(np.dtype(t.dtype)) if t.dtype is not None else rep.outputs[o]
            out.append(compress(const, np.where(const, value, np.zeros((), value.dtype))))
        return out

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        if not replayable(node):
            ks.barrier(node, Reason("unsupported", node.name, node.op, "no handler for this op"))
            return
        found = ks.memo(("replay", id(node)), lambda: self.probe(node, ks))
        if isinstance(found, str):
            why = f"no handler for this op, and it cannot be replayed: {found}"
            ks.barrier(node, Reason("unsupported", node.name, node.op, why))
            return
        rep, live = found
        passes = ks.memo(("replay axes", id(node)), lambda: self.passing_axes(node, rep, live, self.arrays(node, ks), ks.opset))
        mixed = Reason("barrier", node.name, node.op, "no handler for this op; replayed in "
                       "onnxruntime, it mixes the indices of this axis")  # fmt: skip
        tied: set[int] = set()
        for i, t in enumerate(node.inputs):
            if t is None or not t.name:
                continue
            ks.demand(t, pin=not live[i])
            for a in range(len(ir.dims(t) or [])) if live[i] else ():
                if a in passes.get(i, ()):
                    for y in node.outputs:
                        ks.couple(t, a, y, a)
                    tied.add(a)
                else:
                    ks.pin(t, a, mixed)
        for y in node.outputs:
            for b in range(len(ir.dims(y) or [])):
                if b not in tied:
                    ks.pin(y, b, mixed)
        kept = sorted(tied)
        ks.note(node, f"replayed in onnxruntime: axis {kept} pass(es) through" if kept
                else "replayed in onnxruntime: it mixes every axis; kept whole")  # fmt: skip

    @staticmethod
    def passing_axes(
        node: gs.Node, rep: Replayed, live: list[bool], arrays: list[np.ndarray | None], opset: int
    ) -> dict[int, list[int]]:
        """Per live input, the axes the op leaves in place as channels: every live input with that
        axis (size > 1) has it at the same position and size in every output, output index k
        depends on its index k only, no attribute or constant input is sized like it, and
        removing indices of it from those inputs removes the same of every output, changing
        nothing else (`replay.commutes`: an op that splits the axis into heads fails this)."""
        sized = {len(v) for v in node.attrs.values() if isinstance(v, list | tuple)}
        sized |= {
            d for t in node.inputs if isinstance(t, gs.Constant) and np.asarray(t.values).ndim
            for d in np.asarray(t.values).shape
        }  # fmt: skip
        candidates: dict[int, list[int]] = {}  # axis -> the live inputs that have it
        diagonal: dict[int, bool] = {}
        for (i, a), per_output in rep.relation.items():
            n = rep.relation[(i, a)][0][a].shape[0] if per_output and len(per_output[0]) > a else 0
            if n < 2:
                continue  # a broadcast (size 1) input: it stays whole
            eye = np.eye(n, dtype=bool)
            ok = n not in sized and all(
                len(axes) > a and axes[a].shape == (n, n) and not (axes[a] & ~eye).any()
                for axes in per_output
            )
            candidates.setdefault(a, []).append(i)
            diagonal[a] = diagonal.get(a, True) and ok
        out: dict[int, list[int]] = {}
        for a, inputs in candidates.items():
            if diagonal[a] and commutes(node, arrays, live, inputs, a, opset):
                for i in inputs:
                    out.setdefault(i, []).append(a)
        return out


FALLBACK = ReplayedOp()
