"""Shape and Size: they read only sizes. Their outputs are shape values (see analyze/shapes.py):
each element refers to one axis of the input (Shape) or to all of them (Size)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    DimRef,
    Handler,
    KeepView,
    Opaque,
    OpNode,
    ShapeView,
    SymValue,
    int_attr,
    register,
)
from onnxshrink.ops.oracle import declare_cases


class _SizesOf(Handler):
    """Reads only the sizes of input 0, which pruning changes: never folded to a constant."""

    sizes_only = (0,)

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        ks.demand(node.inputs[0], pin=False)  # sizes only; what consumes the value decides


@register("Shape")
class Shape(_SizesOf):
    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        x = node.inputs[0]
        r = ir.rank(x)
        if r is None:  # its length is the input's rank: known only when shape inference says
            n = ir.static_dim(node.outputs[0], 0)
            return SymValue((Opaque(frozenset()),) * n) if n is not None else None
        start = ir.norm_axis(int(node.attrs.get("start", 0)), r)
        end = node.attrs.get("end")
        stop = r if end is None else min(ir.norm_axis(int(end), r), r)
        return SymValue(tuple(DimRef(x.name, a) for a in range(max(start, 0), stop)))

    def sizes_value(self, node: OpNode, shapes: Sequence[list[int] | None]) -> np.ndarray | None:
        """The input's dims from `start` to `end` (opset 15's attributes; clamped as the spec
        says)."""
        dims = shapes[0] if shapes else None
        if dims is None:
            return None
        r = len(dims)
        start, end = int_attr(node, "start", 0), int_attr(node, "end", r)
        lo, hi = (min(max(v + r if v < 0 else v, 0), r) for v in (start, end))
        return np.asarray(dims[lo:hi], np.int64)


@register("Size")
class Size(_SizesOf):
    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        x = node.inputs[0]
        r = ir.rank(x) or 0
        return SymValue((Opaque(frozenset(DimRef(x.name, a) for a in range(r))),), scalar=True)

    def sizes_value(self, node: OpNode, shapes: Sequence[list[int] | None]) -> np.ndarray | None:
        dims = shapes[0] if shapes else None
        return None if dims is None else np.asarray(int(np.prod(dims, dtype=np.int64)), np.int64)


declare_cases(excluded={"Shape": "reads sizes only", "Size": "reads sizes only"})
