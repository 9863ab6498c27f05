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


def bodies(node: gs.Node) -> list[gs.Graph]:
    """The node's own subgraphs (If branches, a Loop or Scan body), in attribute order."""
    return [v for v in node.attrs.values() if isinstance(v, gs.Graph)]


def scopes(graph: gs.Graph) -> Iterator[gs.Graph]:
    """`graph` and every subgraph in it, depth first (gs graphs; `all_graphs` walks protos)."""
    yield graph
    for node in graph.nodes:
        for body in bodies(node):
            yield from scopes(body)


def flat_nodes(graph: gs.Graph) -> list[gs.Node]:
    """Every node of `graph` and of its subgraphs, each body's nodes just before the node that
    holds them: a topological order of the whole model (a body reads only what is computed
    before its node, and its node's outputs come from it)."""
    out: list[gs.Node] = []
    for node in graph.nodes:
        for body in bodies(node):
            out.extend(flat_nodes(body))
        out.append(node)
    return out


def home_graphs(graph: gs.Graph) -> dict[int, gs.Graph]:
    """id(node) -> the graph (scope) that holds it, for every node of every scope."""
    return {id(n): g for g in scopes(graph) for n in g.nodes}


def all_tensors(graph: gs.Graph) -> dict[str, gs.Tensor]:
    """Every tensor of every scope by name (names are unique across scopes: see
    unique_scope_names, which prepare applies)."""
    out: dict[str, gs.Tensor] = {}
    for g in scopes(graph):
        out.update(g.tensors())
    return out


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
        for g in subgraphs_of(n):
            yield from all_graphs(g)


def subgraphs_of(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]


def fresh_name(taken: set[str], hint: str) -> str:
    """`hint`, or `hint_1`, `hint_2`, ... : the first name not in `taken`, which then holds it."""
    name, k = hint, 0
    while name in taken:
        k += 1
        name = f"{hint}_{k}"
    taken.add(name)
    return name


def unique_scope_names(graph: onnx.GraphProto, apply: bool = True) -> list[tuple[str, str]]:
    """Give the tensors a subgraph defines under a name another scope already uses (a sibling
    body may reuse its sibling's names; an enclosing graph's, against the spec) a name of their
    own, in place: the analysis reads the tensors of every scope by name. Inputs and outputs of
    a body are positional, so renaming changes nothing it computes. `apply` False: only say
    which would be renamed. Returns (old, new) names."""
    taken = {
        name
        for g in all_graphs(graph)
        for name in [
            *(v.name for v in [*g.input, *g.output, *g.value_info]),
            *(t.name for t in g.initializer),
            *(x for n in g.node for x in [*n.input, *n.output]),
        ]
    }
    seen: set[str] = set()
    renamed: list[tuple[str, str]] = []

    def fresh(name: str) -> str:
        k, new = 1, f"{name}__1"
        while new in taken:
            k += 1
            new = f"{name}__{k}"
        taken.add(new)
        return new

    def visit(g: onnx.GraphProto, outer: dict[str, str], top: bool) -> None:
        names = {}
        defined = [*(v.name for v in g.input), *(t.name for t in g.initializer)]
        defined += [o for n in g.node for o in n.output if o]
        for name in defined:
            if name in seen and not top:
                names[name] = fresh(name)
                renamed.append((name, names[name]))
            seen.add(name)
        mapping = {**outer, **names}
        if apply and mapping:
            for v in [*g.input, *g.output, *g.value_info]:
                v.name = mapping.get(v.name, v.name)
            for t in g.initializer:
                t.name = mapping.get(t.name, t.name)
            for n in g.node:
                n.input[:] = [mapping.get(x, x) for x in n.input]
                n.output[:] = [mapping.get(x, x) for x in n.output]
        for n in g.node:
            for sub in subgraphs_of(n):
                visit(sub, mapping, False)

    visit(graph, {}, True)
    return renamed


def nbytes(t: gs.Constant) -> int:
    """The bytes of a constant's values, without loading them when they are not yet."""
    held = getattr(t, "_values", None)
    size = getattr(held, "nbytes", None)
    return int(size) if size is not None else int(np.asarray(t.values).nbytes)
