"""State carried between runs (a decoder's KV cache): graph inputs and outputs whose axes may shrink.

The interface is kept as it is, with one exception the graph itself declares: an output that is
an input extended (`Concat(input, new, axis=c)`, or any op whose handler says so, see
`Handler.extends`; directly or as an `If` branch's output, as optimum's merged decoder writes the
with-cache branch) is that input's next value: the runtime feeds it back. Such a pair is one state seen twice; its axes other than `c` are coupled through
the Concat, and an index of them that no other output needs can go from both (a removed KV head
is dead in the input and dropped from the output the runtime would feed back into it). The
pair is found from the graph's structure, never from names; every other input and output keeps
every index.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper

from onnxshrink import ir
from onnxshrink.core.handler import OpNode
from onnxshrink.core.registry import Lookup


def state_pairs(graph: gs.Graph, handler_for: Lookup) -> dict[str, tuple[str, int]]:
    """Graph output name -> (the graph input it extends, the axis it extends along), for every
    output each of whose producers (through Identity and If branches) is either a node whose
    handler says that output extends that graph input (`Handler.extends`: Concat(past, new), a
    fused attention's present), or a node not extending any graph input; each input paired with
    one output only."""
    inputs = {t.name for t in graph.inputs}
    pairs: dict[str, tuple[str, int]] = {}
    for out in graph.outputs:
        found: set[tuple[str, int]] = set()
        ok = True
        for t, node in _producers(out, handler_for):
            if node is None or _copies(node, handler_for):
                ok = False  # a graph input itself, or a form not followed
                break
            handler = handler_for(node)
            j = next(k for k, y in enumerate(node.outputs) if y is t)
            extended = handler.extends(OpNode.of(node)).get(j)
            if extended is None:
                continue
            i, axis = extended
            rank = ir.rank(t)
            source = node.inputs[i] if i < len(node.inputs) else None
            if source is None or source.name not in inputs:
                continue
            if rank is None or not -rank <= axis < rank:
                ok = False
                break
            found.add((source.name, axis % rank))
        if ok and len(found) == 1:
            pairs[out.name] = next(iter(found))
    paired: dict[str, list[str]] = {}
    for out_name, (in_name, _) in pairs.items():
        paired.setdefault(in_name, []).append(out_name)
    for outs in paired.values():
        if len(outs) > 1:  # one state extended into two outputs: which is fed back is unknown
            for o in outs:
                del pairs[o]
    for out_name, (in_name, _) in list(pairs.items()):
        t_in = next(t for t in graph.inputs if t.name == in_name)
        t_out = next(t for t in graph.outputs if t.name == out_name)
        if ir.rank(t_in) is None or ir.rank(t_in) != ir.rank(t_out):
            del pairs[out_name]
    return pairs


def free_axes(graph: gs.Graph, handler_for: Lookup) -> dict[str, set[int]]:
    """Graph input or output name -> the axes the interface does not pin: a state pair's axes
    other than the one it extends along."""
    out: dict[str, set[int]] = {}
    for o, (i, axis) in state_pairs(graph, handler_for).items():
        t = next(x for x in graph.outputs if x.name == o)
        rank = ir.rank(t)
        assert rank is not None
        axes = {a for a in range(rank) if a != axis}
        out[o] = axes
        out[i] = axes
    return out


def _copies(node: gs.Node, handler_for: Lookup) -> bool:
    """Does `node` return a copy of a tensor made elsewhere (an alias, a body's output)?"""
    handler = handler_for(node)
    return handler.is_alias or handler.runs_one_body


def _producers(t: gs.Tensor, handler_for: Lookup) -> Iterator[tuple[gs.Tensor, gs.Node | None]]:
    """(tensor, its producer) of `t` and, through aliases (Identity) and the bodies whose outputs
    a node returns (If), of what it is a copy of."""
    node = t.inputs[0] if t.inputs else None
    if node is None:
        yield t, None
        return
    handler = handler_for(node)
    if handler.is_alias and node.inputs:
        yield from _producers(node.inputs[0], handler_for)
        return
    if handler.runs_one_body:
        j = next(k for k, y in enumerate(node.outputs) if y is t)
        for body in ir.bodies(node):
            if j >= len(body.outputs):
                yield t, node
                return
            yield from _producers(body.outputs[j], handler_for)
        return
    yield t, node


def sliced_interface(
    model: onnx.ModelProto, interface: Mapping[str, Mapping[int, np.ndarray]]
) -> onnx.ModelProto:
    """`model` (the reference) as the shrunk model is called: each input of `interface` given at
    its kept indices (the removed ones, which the analysis found dead, filled with zeros), each
    output of it returned at its kept indices. What the proof compares the shrunk model with."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    names = _Names(g)
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 1)
    front: list[onnx.NodeProto] = []
    for vi in g.input:
        if interface.get(vi.name):
            _widen_input(g, vi, interface[vi.name], names, opset, front)
    nodes = list(g.node)
    del g.node[:]
    g.node.extend([*front, *nodes])
    for vi in g.output:
        if interface.get(vi.name):
            _narrow_output(g, vi, interface[vi.name], names)
    return out


class _Names:
    """Fresh names in a graph (and its bodies), and the int64 initializers made under them."""

    def __init__(self, g: onnx.GraphProto):
        self.g = g
        self.taken = {n for sub in ir.all_graphs(g) for node in sub.node for n in [*node.input, *node.output]}
        self.taken |= {v.name for v in [*g.input, *g.output]} | {t.name for t in g.initializer}

    def fresh(self, hint: str) -> str:
        return ir.fresh_name(self.taken, hint)

    def const(self, values: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.g.initializer.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name


def _widen_input(
    g: onnx.GraphProto,
    vi: onnx.ValueInfoProto,
    axes: Mapping[int, np.ndarray],
    names: _Names,
    opset: int,
    front: list[onnx.NodeProto],
) -> None:
    """Graph input `vi` taken at its kept indices of `axes`: the nodes `front` gains scatter it
    back to its full size (zeros at the removed indices), and the graph reads that instead."""
    dims = vi.type.tensor_type.shape.dim
    rank = len(dims)
    current = vi.name
    for axis, kept in sorted(axes.items()):
        size = dims[axis].dim_value
        kept = np.asarray(kept, np.int64)
        pads = [0] * (2 * rank)
        pads[rank + axis] = size - len(kept)
        padded = names.fresh(f"{vi.name}_padded")
        if opset >= 11:
            front.append(helper.make_node("Pad", [current, names.const(np.asarray(pads), "pads")], [padded]))
        else:
            front.append(helper.make_node("Pad", [current], [padded], pads=pads))
        where = np.full(size, len(kept), np.int64)  # a removed index: a zero padded slot
        where[kept] = np.arange(len(kept))
        whole = names.fresh(f"{vi.name}_whole")
        front.append(helper.make_node("Gather", [padded, names.const(where, "where")], [whole], axis=axis))
        current = whole
        dims[axis].dim_value = len(kept)
    _rename_reads(g, vi.name, current, skip=front)


def _narrow_output(
    g: onnx.GraphProto, vi: onnx.ValueInfoProto, axes: Mapping[int, np.ndarray], names: _Names
) -> None:
    """Graph output `vi` returned at its kept indices of `axes`: what computed it is renamed,
    and Gathers of the kept indices make the output from it."""
    dims = vi.type.tensor_type.shape.dim
    whole = names.fresh(f"{vi.name}_whole")
    for node in g.node:
        node.output[:] = [whole if o == vi.name else o for o in node.output]
    _rename_reads(g, vi.name, whole)
    current = whole
    for k, (axis, kept) in enumerate(sorted(axes.items())):
        last = k == len(axes) - 1
        nxt = vi.name if last else names.fresh(f"{vi.name}_part")
        g.node.append(
            helper.make_node("Gather", [current, names.const(np.asarray(kept), "kept")], [nxt], axis=axis)
        )
        dims[axis].dim_value = len(kept)
        current = nxt


def _rename_reads(g: onnx.GraphProto, old: str, new: str, skip: Iterable[onnx.NodeProto] = ()) -> None:
    """Every read of `old`, in `g` and its bodies (which read it by name), made a read of `new`."""
    skipped = {id(n) for n in skip}
    for sub in ir.all_graphs(g):
        for node in sub.node:
            if id(node) not in skipped:
                node.input[:] = [new if i == old else i for i in node.input]


def sliced_shapes(
    shapes: Mapping[str, list[int]] | None, interface: Mapping[str, Mapping[int, np.ndarray]]
) -> dict[str, list[int]] | None:
    """Input shapes given for the model as the shrunk model takes them (the kept count on each
    axis that lost indices)."""
    if not shapes:
        return None if shapes is None else {}
    out = {k: list(v) for k, v in shapes.items()}
    for name, axes in interface.items():
        for axis, kept in axes.items():
            if name in out and axis < len(out[name]):
                out[name][axis] = len(kept)
    return out


def sliced_feeds(
    feeds: Sequence[Mapping[str, np.ndarray]] | None, interface: Mapping[str, Mapping[int, np.ndarray]]
) -> list[dict[str, np.ndarray]] | None:
    """Inputs given for the model as the shrunk model takes them (each state at its kept
    indices)."""
    if feeds is None:
        return None
    out = []
    for feed in feeds:
        f = dict(feed)
        for name, axes in interface.items():
            if name in f:
                for axis, kept in axes.items():
                    f[name] = np.take(f[name], kept, axis=axis)
        out.append(f)
    return out
