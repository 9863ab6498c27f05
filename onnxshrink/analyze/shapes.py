"""Symbolic values of shape-computing subgraphs (Shape -> Gather -> Concat -> Reshape, ...).

A pruned axis changes what `Shape` reports, so shape values are never folded to constants.
Instead each element of a shape value is tracked as a literal, a reference to one tensor axis,
or an opaque expression over some axes. A *shape value* is an integer tensor computed only from
shape values and small integer constants (each op's handler says how, `Handler.shape_value`).
Consumers then either use it as a size (a Reshape target: the referenced axis and the output
axis are coupled; the handler claims the input) or as anything else, e.g. a number in float
arithmetic: then the referenced axes are pinned, they must keep their size.

The one exception is an axis that can never change: a static axis of a graph input the closure
pins (the interface; not an axis of a state pair, `analyze/cache.py`). The runtime refuses any
other size there, so its size is the literal the graph declares, and arithmetic on it stays
literal (torch's `E // num_heads` from the input's width gives the head dim).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze.cache import free_axes
from onnxshrink.analyze.constants import ConstContext
from onnxshrink.core.handler import Dims, OpNode
from onnxshrink.core.registry import Lookup
from onnxshrink.core.shape_rules import is_integer_output, opaque_value
from onnxshrink.core.symbols import DimRef, Item, SymValue


class ShapeSyms:
    """The shape values known so far (what a handler's `shape_value` reads)."""

    def __init__(self, consts: ConstContext, tensors: Mapping[str, gs.Tensor]):
        self.consts = consts
        self.opset = consts.opset
        self.tensors = tensors
        self.syms: dict[str, SymValue] = {}

    def is_shape(self, t: gs.Tensor | None) -> bool:
        """Is `t` a shape value computed from some tensor's sizes?"""
        return t is not None and t.name in self.syms

    def sym(self, t: gs.Tensor | None) -> SymValue | None:
        """The symbolic value of a shape value or of a small integer constant, else None."""
        if t is None:
            return None
        if t.name in self.syms:
            return self.syms[t.name]
        v = self.consts.value(t)
        if v is not None and v.ndim <= 1 and v.size <= 64 and np.issubdtype(v.dtype, np.integer):
            return SymValue(tuple(int(x) for x in v.reshape(-1)), scalar=v.ndim == 0)
        return None

    def value(self, t: gs.Tensor | None) -> np.ndarray | None:
        return self.consts.value(t)


def fixed_sizes(graph: gs.Graph, lookup: Lookup) -> dict[DimRef, int]:
    """The static sizes that cannot change: every static axis of a graph input that the keep
    closure pins as the interface (all but a state pair's free axes), and the axes ops pass on
    from them unchanged (`Handler.passes_axes`: a Transpose of the input; the closure ties
    each such axis to its input's index for index, so it is pinned with it)."""
    free = free_axes(graph, lookup)
    out: dict[DimRef, int] = {}
    for t in graph.inputs:
        for a, d in enumerate(ir.dims(t) or []):
            if isinstance(d, int) and d >= 0 and a not in free.get(t.name, set()):
                out[DimRef(t.name, a)] = d
    for node in ir.flat_nodes(graph) if out else ():
        x = node.inputs[0] if node.inputs and node.outputs else None
        rank = ir.rank(x) if x is not None else None
        perm = lookup(node).passes_axes(OpNode.of(node), 0, rank) if x is not None and rank is not None else None
        for o, a in enumerate(perm or ()):
            size = out.get(DimRef(x.name, a)) if x is not None else None
            if size is not None and ir.static_dim(node.outputs[0], o) == size:
                out[DimRef(node.outputs[0].name, o)] = size
    return out


def _literal(it: Item, fixed: Mapping[DimRef, int]) -> Item:
    return fixed.get(it, it) if isinstance(it, DimRef) else it


def propagate_shapes(
    graph: gs.Graph, consts: ConstContext, lookup: Lookup, pinned_inputs: bool = True
) -> dict[str, SymValue]:
    """Symbolic values of every shape value in the graph, each node's handler giving its rule.
    `pinned_inputs`: the closure pins the graph inputs (not so for the test bench's
    `free_inputs`), so their static sizes are literals (`fixed_sizes`)."""
    view = ShapeSyms(consts, ir.all_tensors(graph))
    fixed = fixed_sizes(graph, lookup) if pinned_inputs else {}
    for node in ir.flat_nodes(graph):
        handler = lookup(node)
        if not node.outputs:
            continue
        try:
            out = handler.shape_value(node, view)
        except (IndexError, ValueError, TypeError):  # a rule that does not fit: not modelled
            out = opaque_value(node, view) if is_integer_output(node) else None
        if out is not None and fixed:
            out = SymValue(tuple(_literal(it, fixed) for it in out.items), out.scalar)
        if out is not None:
            view.syms[node.outputs[0].name] = out
    return view.syms


# ---------------------------------------------------------------------- dims shape inference missed
def refine_shapes(
    graph: gs.Graph,
    syms: dict[str, SymValue],
    consts: ConstContext,
    lookup: Lookup,
) -> bool:
    """Fill output dims that shape inference left unknown but the size inputs of Expand,
    ConstantOfShape and Reshape give (e.g. Expand(0, Shape(W)[0:1]), a zero bias the exporter
    builds at run time), or that a Slice with run-time bounds leaves as they were, and carry
    them on through elementwise ops and Concat (shape inference ran before these were known, or
    gave up where input dims had different symbols). True when a dim was filled."""
    view = ShapeSyms(consts, ir.all_tensors(graph))
    view.syms = syms
    outputs = {t.name for t in graph.outputs}
    changed = False
    for node in ir.flat_nodes(graph):
        handler = lookup(node)
        if not node.outputs:
            continue
        for y, new in zip(node.outputs, handler.refine_output_dims(node, consts, view), strict=False):
            if y.name not in outputs:  # the interface keeps the dims it declares
                changed |= _fill(y, new)
    return changed


def _fill(y: gs.Tensor, new: Dims | None) -> bool:
    """Give `y` the dims `new` (computed only where `y`'s were not static); True if any changed."""
    if new is None or new == list(ir.dims(y) or []):
        return False
    y.shape = new
    return True


