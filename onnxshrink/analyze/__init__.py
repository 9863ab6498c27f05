"""Analyze a graph: constants forward, shape symbols forward, then the keep closure."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from onnxshrink.analyze.constants import ConstContext, propagate_constants
from onnxshrink.analyze.keep import KeepState
from onnxshrink.analyze.shapes import SymValue, propagate_shapes, refine_shapes


@dataclass
class Analysis:
    graph: gs.Graph
    opset: int
    consts: ConstContext
    syms: dict[str, SymValue]
    keep: KeepState
    untied: dict[str, str]

    def handler_for(self, node: gs.Node):
        from onnxshrink.ops import handler_for

        return handler_for(node, self.opset)


def analyze(graph: gs.Graph, opset: int, untied: dict[str, str] | None = None) -> Analysis:
    from onnxshrink.ops import handler_for

    def lookup(node: gs.Node):
        return handler_for(node, opset)

    consts = propagate_constants(graph, opset, lookup)
    syms = propagate_shapes(graph, consts)
    if refine_shapes(graph, syms, consts):  # sizes only the shape values tell: redo with them
        consts = propagate_constants(graph, opset, lookup)
        syms = propagate_shapes(graph, consts)
    keep = KeepState(graph, consts, syms, lookup)
    keep.run()
    return Analysis(graph, opset, consts, syms, keep, untied or {})
