"""Terse helpers over onnx-graphsurgeon graphs: shapes, constant inputs, attribute-or-input reads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs

Dim = int | str | None


def is_float(dtype: np.dtype) -> bool:
    """A floating-point dtype, bfloat16 included (ml_dtypes' type, which numpy does not count
    as np.floating)."""
    return bool(np.issubdtype(dtype, np.floating)) or np.dtype(dtype).name == "bfloat16"


def dims(t: gs.Tensor) -> list[Dim] | None:
    """The tensor's dims (int, symbolic name or None), or None when even the rank is unknown."""
    if t.shape is None:
        return None
    return [d if isinstance(d, int | str) or d is None else None for d in t.shape]


def rank(t: gs.Tensor) -> int | None:
    d = dims(t)
    return None if d is None else len(d)


def known_rank(t: gs.Tensor) -> int:
    """The rank of a tensor the analysis has already required to be known (a handler's rewrite
    of a node its keep step did not make a barrier)."""
    r = rank(t)
    assert r is not None, f"rank of {t.name!r} unknown"
    return r


def static_dim(t: gs.Tensor, axis: int) -> int | None:
    d = dims(t)
    if d is None or not -len(d) <= axis < len(d):
        return None
    v = d[axis]
    return v if isinstance(v, int) and v >= 0 else None


def is_static(t: gs.Tensor) -> bool:
    d = dims(t)
    return d is not None and all(isinstance(v, int) and v >= 0 for v in d)


def present(node: gs.Node, i: int) -> gs.Tensor | None:
    """Input i of node, or None when it is absent or given as the empty name (optional input)."""
    if i >= len(node.inputs):
        return None
    t = node.inputs[i]
    if t is None or (isinstance(t, gs.Variable) and t.name == ""):
        return None
    return t


def producer(t: gs.Tensor) -> gs.Node | None:
    return t.inputs[0] if t.inputs else None


def consumers(t: gs.Tensor) -> list[gs.Node]:
    return list(t.outputs)


def outer_inputs(node: gs.Node) -> list[gs.Tensor]:
    """Tensors from outside that a node's subgraphs (Loop, If, Scan bodies) read: inputs the node
    does not list, but needs as much as those it does. May include the subgraphs' own
    initializers; callers look the names up in the enclosing graph."""
    subs = list(node.subgraphs(recursive=True))
    local = {t.name for g in subs for t in g.inputs}
    local |= {t.name for g in subs for n in g.nodes for t in n.outputs}
    found: dict[str, gs.Tensor] = {}
    for g in subs:
        for n in g.nodes:
            for t in n.inputs:
                if t is not None and t.name and t.name not in local:
                    found.setdefault(t.name, t)
    return list(found.values())


def norm_axis(axis: int, r: int) -> int:
    return axis + r if axis < 0 else axis


def norm_axes(axes: Iterable[int], r: int) -> list[int]:
    return sorted({norm_axis(int(a), r) for a in axes})


def int_list(values: np.ndarray | Sequence[int] | None) -> list[int] | None:
    if values is None:
        return None
    return [int(v) for v in np.asarray(values).reshape(-1)]


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every subgraph in it (If branches, Loop and Scan bodies), depth first."""
    yield graph
    for n in graph.node:
        for a in n.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                yield from all_graphs(g)
