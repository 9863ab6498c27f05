"""Forward pass: which elements of each tensor are input-independent ("constant"), and their values.

A constant is any element whose value does not depend on the graph inputs: a zeroed filter's
bias, BatchNorm's shift on a zeroed channel, sigmoid(0) = 0.5, every initializer. Facts are
exact (structural, with exact zeros from the weights), never guessed from sampled values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core.evaluate import EvaluationError, evaluate
from onnxshrink.core.handler import Handler
from onnxshrink.core.registry import Lookup
from onnxshrink.core.symbols import SymValue
from onnxshrink.core.values import ConstInfo
from onnxshrink.io import weights


class ConstContext:
    """What a handler's `constants` method can read (core.views.ConstView)."""

    def __init__(self, graph: gs.Graph, opset: int, lookup: Lookup, syms: Mapping[str, SymValue] | None = None):
        self.graph = graph
        self.opset = opset
        self.lookup = lookup
        self.tensors = ir.all_tensors(graph)
        self.syms: Mapping[str, SymValue] = syms or {}  # shape values from an earlier pass, when there was one
        self.consts: dict[str, ConstInfo] = {}

    def sym(self, t: gs.Tensor | None) -> SymValue | None:
        return None if t is None else self.syms.get(t.name)

    def const(self, t: gs.Tensor | None) -> ConstInfo | None:
        return None if t is None else self.consts.get(t.name)

    def value(self, t: gs.Tensor | None) -> np.ndarray | None:
        """The full value of a wholly constant tensor, else None."""
        c = self.const(t)
        if c is None or not c.full:
            return None
        if c.whole:
            return c.value
        d = ir.dims(t)
        if d is not None and len(d) == c.value.ndim and ir.is_static(t):
            return np.broadcast_to(c.value, [int(v) for v in d])  # type: ignore[arg-type]
        return None

    def evaluate(self, node: gs.Node, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        handler = self.lookup(node)
        return evaluate(node, inputs, self.opset, ort=handler.evaluate_with_ort)


def foldable(handler: Handler) -> bool:
    """May a node with all-constant inputs be evaluated to a constant? Not when it reads sizes
    (they change when axes are pruned) or is not a function of its inputs (random ops)."""
    return handler.deterministic and not handler.sizes_only


def propagate_constants(
    graph: gs.Graph,
    opset: int,
    handler_for: Lookup,
    syms: Mapping[str, SymValue] | None = None,
    progress: bool = False,
) -> ConstContext:
    """Walk the graph in topological order, recording constant elements of every tensor. Where
    handlers read weights, the pages they read are given back between nodes (weights.trim)."""
    from onnxshrink.progress import bar

    with bar(len(ir.flat_nodes(graph)), "analysis: reading weights", "node", progress) as shown:
        return _propagate(graph, opset, handler_for, syms, shown)


def _propagate(
    graph: gs.Graph, opset: int, handler_for: Lookup, syms: Mapping[str, SymValue] | None, shown: Any
) -> ConstContext:
    ctx = ConstContext(graph, opset, handler_for, syms)
    for t in ctx.tensors.values():
        if isinstance(t, gs.Constant):
            ctx.consts[t.name] = ConstInfo.of_constant(t)
    _walk(graph, ctx, handler_for, shown)
    return ctx


def _walk(graph: gs.Graph, ctx: ConstContext, handler_for: Lookup, shown: Any) -> None:
    """The nodes of one scope in order; a node's bodies just before it, their inputs' constant
    elements given by its handler (`body_constants`: e.g. a Scan's slices of a constant input;
    none otherwise: a body input is live)."""
    graph_inputs = {t.name for t in graph.inputs}
    for node in graph.nodes:
        subgraphs = ir.bodies(node)
        if subgraphs:
            ctx.consts.update(handler_for(node).body_constants(node, ctx) or {})
            for body in subgraphs:
                _walk(body, ctx, handler_for, shown)
        ins = [ir.present(node, i) for i in range(len(node.inputs))]
        if any(t is not None and t.name in graph_inputs for t in ins):
            full_const = False
        else:
            consts = [ctx.const(t) for t in ins if t is not None]
            full_const = all(c is not None and c.full for c in consts)
        outs: list[ConstInfo | None] | None = None
        handler = handler_for(node)
        if full_const and foldable(handler) and node.inputs and not subgraphs:
            outs = _fold(node, ctx)
        if outs is None:
            try:
                outs = handler.constants(node, ctx)
            except EvaluationError:
                outs = None
        for t, c in zip(node.outputs, outs or [], strict=False):
            if c is not None:
                ctx.consts[t.name] = c
        weights.trim()
        shown.update(1)


def _fold(node: gs.Node, ctx: ConstContext) -> list[ConstInfo | None] | None:
    """Evaluate a node whose inputs are all wholly constant; None when some cannot be
    materialized (a constant of a dynamic size: its handler's rule decides instead)."""
    vals = [ctx.value(t) if t is not None else None for t in node.inputs]
    if any(v is None and t is not None for t, v in zip(node.inputs, vals, strict=True)):
        return None
    try:
        outs = ctx.evaluate(node, vals)
    except EvaluationError:
        return None
    return [ConstInfo.of_array(o) for o in outs]
