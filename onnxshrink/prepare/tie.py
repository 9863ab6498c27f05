"""Untie initializers read by several nodes (one tensor per use, sharing the array) so that each
use can be sliced on its own; `retie` merges the uses that end up identical again.

An initializer read in several scopes (both branches of an If, a body and the graph around it)
stays one tensor: it is sliced once, for everything its readers need, and stored once."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir


def untie(graph: gs.Graph, opset: int) -> dict[str, str]:
    """One tensor per use of each initializer read by several nodes; {copy name: original}."""
    from onnxshrink.ops import handler_for

    uses: dict[str, list[tuple[gs.Node, int]]] = defaultdict(list)
    home = ir.home_graphs(graph)
    for node in ir.flat_nodes(graph):
        handler = handler_for(node, opset)
        sizes = handler.sizes_only if handler is not None else ()
        for i, t in enumerate(node.inputs):
            if i in sizes:
                continue  # reads only sizes: it keeps seeing the tensor of the first other use
            if isinstance(t, gs.Constant):
                uses[t.name].append((node, i))
    taken = set(ir.all_tensors(graph))
    untied: dict[str, str] = {}
    for name, sites in uses.items():
        if len(sites) < 2 or len({id(home[id(node)]) for node, _ in sites}) > 1:
            continue
        original = sites[0][0].inputs[sites[0][1]]
        for k, (node, i) in enumerate(sites[1:], start=1):
            new = f"{name}__use{k}"
            while new in taken:
                new += "_"
            taken.add(new)
            node.inputs[i] = gs.Constant(new, values=original.values)
            untied[new] = name
    return untied


def retie(graph: gs.Graph, untied: dict[str, str]) -> None:
    """Merge untied uses whose sliced values are identical; name the rest apart."""
    originals = set(untied.values())
    groups: dict[str, list[tuple[gs.Node, int]]] = defaultdict(list)
    for node in ir.flat_nodes(graph):
        for i, t in enumerate(node.inputs):
            if isinstance(t, gs.Constant):
                base = untied.get(t.name, t.name if t.name in originals else None)
                if base is not None:
                    groups[base].append((node, i))
    taken = {n for n in ir.all_tensors(graph) if n not in untied and n not in originals}
    for base, sites in groups.items():
        distinct: list[gs.Constant] = []
        for node, i in sites:
            t = node.inputs[i]
            for d in distinct:
                if d is t or (
                    d.values.shape == t.values.shape
                    and d.values.dtype == t.values.dtype
                    and np.array_equal(d.values, t.values)
                ):
                    node.inputs[i] = d
                    break
            else:
                distinct.append(t)
        for k, d in enumerate(distinct):
            name = base if k == 0 else f"{base}__{k}"
            while name in taken:
                name += "_"
            d.name = name
            taken.add(name)
