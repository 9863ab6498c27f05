"""Analyze a graph: constants forward, shape symbols forward, then the keep closure.

The analysis knows no op: every step asks the node's handler (`lookup`, from onnxshrink.ops).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnx_graphsurgeon as gs

from onnxshrink.analyze.constants import ConstContext, propagate_constants
from onnxshrink.analyze.keep import AxisKey, KeepState
from onnxshrink.analyze.replay import scoped
from onnxshrink.analyze.shapes import SymValue, propagate_shapes, refine_shapes

Lookup = Callable[[gs.Node], Any]


@dataclass
class Analysis:
    graph: gs.Graph
    opset: int
    consts: ConstContext
    syms: dict[str, SymValue]
    keep: KeepState
    untied: dict[str, str]
    handler_for: Lookup


@scoped
def analyze(
    graph: gs.Graph,
    opset: int,
    lookup: Lookup,
    untied: dict[str, str] | None = None,
    pins: frozenset[AxisKey] = frozenset(),
    mode: str = "rules",
    free_inputs: bool = False,
    log: Any = None,
    progress: bool = False,
) -> Analysis:
    """`pins`: tensor axes kept whole whatever the analysis finds (after a failed proof);
    `mode` "replay": handlers' needs are found by replaying their nodes (analyze/replay.py);
    `free_inputs`: graph inputs are not pinned (what the rules demand of them shows); `log`:
    records what the keep closure ties (analyze.coupling.CouplingLog), for the coupled groups;
    `progress`: a progress bar over the first pass, which reads the weights."""
    consts = propagate_constants(graph, opset, lookup, progress=progress)
    syms = propagate_shapes(graph, consts, lookup)
    if refine_shapes(graph, syms, consts, lookup):  # sizes only the shape values tell: redo
        consts = propagate_constants(graph, opset, lookup, syms)
        syms = propagate_shapes(graph, consts, lookup)
    keep = KeepState(graph, consts, syms, lookup, pins, mode, free_inputs, log)
    keep.run()
    return Analysis(graph, opset, consts, syms, keep, untied or {}, lookup)
