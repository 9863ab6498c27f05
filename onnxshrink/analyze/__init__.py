"""Analyze a graph: constants forward, shape symbols forward, then the keep closure.

The analysis knows no op: every step asks the node's handler (`lookup(opset)`: the registered
handlers of onnxshrink.ops, and for an op none claims, its replay in onnxruntime: fallback.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

import onnxshrink.ops  # noqa: F401  (registers every handler the lookup finds)
from onnxshrink.analyze.constants import ConstContext, propagate_constants
from onnxshrink.analyze.coupling import CouplingLog
from onnxshrink.analyze.fallback import FALLBACK
from onnxshrink.analyze.keep import KeepState
from onnxshrink.analyze.replay import scoped
from onnxshrink.analyze.shapes import propagate_shapes, refine_shapes
from onnxshrink.core import registry
from onnxshrink.core.reasons import AxisKey
from onnxshrink.core.registry import Lookup
from onnxshrink.core.symbols import SymValue


def lookup(opset: int) -> Lookup:
    """The handler of each node at `opset`; the replay fallback for an op no handler claims."""
    return registry.lookup(opset, FALLBACK)


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
    log: CouplingLog | None = None,
    progress: bool = False,
) -> Analysis:
    """`pins`: tensor axes kept whole whatever the analysis finds (after a failed proof);
    `mode` "replay": handlers' needs are found by replaying their nodes (analyze/replay.py);
    `free_inputs`: graph inputs are not pinned (what the rules demand of them shows); `log`:
    records what the keep closure ties (analyze.coupling.CouplingLog), for the coupled groups;
    `progress`: a progress bar over the first pass, which reads the weights, and a count of the
    keep closure's visits."""
    consts = propagate_constants(graph, opset, lookup, progress=progress)
    syms = propagate_shapes(graph, consts, lookup, not free_inputs)
    if refine_shapes(graph, syms, consts, lookup):  # sizes only the shape values tell: redo
        consts = propagate_constants(graph, opset, lookup, syms)
        syms = propagate_shapes(graph, consts, lookup, not free_inputs)
    keep = KeepState(graph, consts, syms, lookup, pins, mode, free_inputs, log, untied)
    keep.run(progress)
    if keep.larger_copies():  # a shared weight sliced two ways, more than itself: try it once
        shared = KeepState(graph, consts, syms, lookup, pins, mode, free_inputs, log, untied, share_copies=True)
        shared.run(progress)
        if shared.stored() < keep.stored():
            keep = shared
    return Analysis(graph, opset, consts, syms, keep, untied or {}, lookup)
