"""Run a model in pieces: segments of its node order, and prefixes of its repeated blocks.

A proof of a model larger than memory cannot hold it in one onnxruntime session. Any position
in a topological order is a cut: what the nodes before it produced and the nodes after it read
(the *frontier*) is all that flows across. `split` cuts a model into segments of bounded weight
bytes; running them in order, each on the frontier the previous one left, computes exactly what
the whole model computes, with one segment's weights in memory at a time.

`blocks` finds the repeated structure of the graph (the layers of a transformer, the residual
blocks of a CNN stage) from the nodes that read weights: the period at which they repeat (op
type and weight shapes) over the longest run. `prefix` is the model up to the end of the first
N blocks, its outputs the frontier there: what `--validate-layers N` proves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxshrink.prepare import inferred_shapes


@dataclass
class Segment:
    model: onnx.ModelProto
    inputs: list[str]  # read from the graph inputs or earlier segments
    outputs: list[str]  # left for later segments or the graph's outputs


def _has_subgraph(n: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)


def tensor_bytes(t: onnx.TensorProto) -> int:
    size = int(np.prod(t.dims, dtype=np.int64))
    try:
        return size * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except Exception:
        return size * 4


def weight_bytes(model: onnx.ModelProto) -> int:
    return sum(tensor_bytes(t) for t in model.graph.initializer)


def _types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every tensor's type: the graph's inputs and outputs, and shape inference's results."""
    out: dict[str, onnx.TypeProto] = {}
    for vi in [*inferred_shapes(model), *model.graph.input, *model.graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            out[vi.name] = vi.type
    return out


def _value_info(name: str, types: dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    vi = onnx.ValueInfoProto(name=name)
    tt = types[name].tensor_type
    vi.type.tensor_type.elem_type = tt.elem_type  # shapes left to the runtime
    return vi


def _frontier(nodes: Sequence[onnx.NodeProto], cut: int, graph_outputs: set[str]) -> list[str]:
    """Tensors the nodes before `cut` produce that the nodes from `cut` on read, or that are
    graph outputs; in the order produced."""
    later = {i for n in nodes[cut:] for i in n.input if i}
    out = []
    for n in nodes[:cut]:
        for o in n.output:
            if o and (o in later or o in graph_outputs) and o not in out:
                out.append(o)
    return out


def _sub_model(
    model: onnx.ModelProto,
    nodes: Sequence[onnx.NodeProto],
    inputs: list[str],
    outputs: list[str],
    types: dict[str, onnx.TypeProto],
) -> onnx.ModelProto:
    read = {i for n in nodes for i in n.input if i}
    inits = [t for t in model.graph.initializer if t.name in read]
    graph = helper.make_graph(
        list(nodes),
        model.graph.name or "segment",
        [_value_info(i, types) for i in inputs],
        [_value_info(o, types) for o in outputs],
        initializer=inits,
    )
    sub = helper.make_model(graph, opset_imports=list(model.opset_import))
    sub.ir_version = model.ir_version
    sub.functions.extend(model.functions)
    return sub


def split(model: onnx.ModelProto, budget: int) -> list[Segment] | None:
    """Segments of at most about `budget` weight bytes each (a segment holds at least one node);
    None when the model cannot be cut (subgraphs, tensors of unknown type) or needs no cut."""
    found = pieces(model, budget)
    return [Segment(p.model, p.inputs, p.outputs) for p in found] if found is not None else None


class Piece:
    """A segment whose model is made when asked for, anew each time: a run of pieces holds one
    piece's weights at a time (`split` copies every segment's weights at once)."""

    def __init__(self, make: Callable[[], onnx.ModelProto], inputs: list[str], outputs: list[str]):
        self._make, self.inputs, self.outputs = make, inputs, outputs

    @property
    def model(self) -> onnx.ModelProto:
        return self._make()


def pieces(model: onnx.ModelProto, budget: int) -> list[Piece] | None:
    """`split`, each segment's model made when asked for (`Piece`)."""
    bounds = _bounds(model, budget)
    return _segments(model, list(model.graph.node), bounds) if bounds is not None else None


def _bounds(model: onnx.ModelProto, budget: int) -> list[int] | None:
    """Where `split` cuts (the first and the last node index included); None: no cut."""
    nodes = list(model.graph.node)
    if weight_bytes(model) <= budget or any(_has_subgraph(n) for n in nodes):
        return None
    sizes = {t.name: tensor_bytes(t) for t in model.graph.initializer}
    cuts, acc, seen = [], 0, set()
    for k, n in enumerate(nodes):
        for i in n.input:
            if i in sizes and i not in seen:
                seen.add(i)
                acc += sizes[i]
        if acc >= budget and k + 1 < len(nodes):
            cuts.append(k + 1)
            acc, seen = 0, set()
    return [0, *cuts, len(nodes)] if cuts else None


def _segments(model: onnx.ModelProto, nodes: list[onnx.NodeProto], bounds: list[int]) -> list[Piece] | None:
    types = _types(model)
    graph_outputs = {o.name for o in model.graph.output}
    inits = {t.name for t in model.graph.initializer}
    segments = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        part = nodes[a:b]
        made = {o for n in part for o in n.output}
        inputs = []
        for n in part:
            for i in n.input:
                if i and i not in made and i not in inits and i not in inputs:
                    inputs.append(i)
        outputs = [o for o in _frontier(nodes, b, graph_outputs) if o in made]
        if any(t not in types for t in [*inputs, *outputs]):
            return None
        segments.append(Piece(partial(_sub_model, model, part, inputs, outputs, types), inputs, outputs))
    return segments


def _lent(model: onnx.ModelProto) -> dict[str, list[tuple[int, ...]]]:
    """Tensors computed from weights alone for one reader (a weight's DequantizeLinear or
    Transpose), each with the shapes of the weights it is computed from: they belong where
    their reader is, not where the graph lists them."""
    nodes = list(model.graph.node)
    weights = {t.name: [tuple(int(d) for d in t.dims)] for t in model.graph.initializer}
    readers_of: dict[str, int] = {}
    for n in nodes:
        for i in set(n.input):
            readers_of[i] = readers_of.get(i, 0) + 1
    for o in model.graph.output:
        readers_of[o.name] = readers_of.get(o.name, 0) + 2
    lent: dict[str, list[tuple[int, ...]]] = {}
    for n in nodes:
        ins = [i for i in n.input if i]
        if (
            ins
            and all(i in weights or i in lent for i in ins)
            and all(readers_of.get(o, 0) == 1 for o in n.output if o)
            and not _has_subgraph(n)
        ):
            for o in n.output:
                if o:
                    lent[o] = [w for i in ins for w in (weights[i] if i in weights else lent[i])]
    return lent


@dataclass
class Blocks:
    count: int  # how many blocks repeat
    cuts: list[int]  # cuts[n - 1]: the node index after block n (n < count)
    period: int  # weight-reading nodes per block

    def end(self, n: int) -> int:
        """The node index after the first n blocks (n < count)."""
        return self.cuts[n - 1]


def blocks(model: onnx.ModelProto) -> Blocks | None:
    """The repeated blocks of the graph (a transformer's layers, a stage's residual blocks): the
    nodes that read weights, each by op type and weight shapes, repeat with some period P; the
    P with the longest run of repetition (the shortest such P) gives the blocks. Shared nodes
    that read no weights (rotary tables, masks, hoisted by exporters into the first layer) do not
    disturb it. A node that computes from weights alone for one reader (a weight's
    DequantizeLinear, which onnxruntime's quantize_static puts at the top of the graph, a
    weight's Transpose) is not a reader: its weights count for the node that reads its output,
    where the layer uses them. Between the last weight node of block n and the first of block
    n + 1, the cut is where the fewest tensors cross (the residual stream, after its Add). None
    when nothing repeats."""
    nodes = list(model.graph.node)
    weights = {t.name: [tuple(int(d) for d in t.dims)] for t in model.graph.initializer}
    lent = _lent(model)
    weights.update(lent)
    computed = {k for k, n in enumerate(nodes) if any(o in lent for o in n.output)}
    readers = [
        k
        for k, n in enumerate(nodes)
        if k not in computed and any(int(np.prod(w)) > 1 for i in n.input for w in weights.get(i, []))
    ]
    signatures = [
        f"{nodes[k].domain}:{nodes[k].op_type}:{[weights[i] for i in nodes[k].input if i in weights]}"
        for k in readers
    ]
    if len(signatures) < 2:
        return None
    codes = np.unique(np.asarray(signatures), return_inverse=True)[1]
    best: tuple[int, int, int] | None = None  # (run length, -period, start)
    for p in range(1, len(codes) // 2 + 1):
        eq = np.concatenate([[False], codes[:-p] == codes[p:], [False]])
        edges = np.flatnonzero(eq[1:] != eq[:-1])
        if not len(edges):
            continue
        starts, ends = edges[::2], edges[1::2]
        j = int(np.argmax(ends - starts))
        run = int(ends[j] - starts[j])
        if run >= p and (best is None or (run, -p) > best[:2]):
            best = (run, -p, int(starts[j]))
    if best is None:
        return None
    run, period, start = best[0], -best[1], best[2]
    count = (run + period) // period
    graph_outputs = {o.name for o in model.graph.output}
    crossing = _crossing(nodes, graph_outputs)
    cuts = []
    for n in range(1, count):
        last, first = readers[start + n * period - 1], readers[start + n * period]
        # the narrowest cut between the two (the latest of equals)
        sizes = {c: int(crossing[c]) for c in range(last + 1, first + 1)}
        narrowest = min(sizes.values())
        cuts.append(max(c for c, size in sizes.items() if size == narrowest))
    return Blocks(count, cuts, period)


def _crossing(nodes: Sequence[onnx.NodeProto], graph_outputs: set[str]) -> np.ndarray:
    """len(_frontier(nodes, c, graph_outputs)) for every cut c in 0..len(nodes), from one pass:
    a tensor crosses the cuts after the node that first makes it, up to its last reader (every
    cut after it when it is a graph output). `_frontier` per cut read every later node, once
    per cut tried between two blocks (1.4 s of SmolLM-135M's groups phase under cProfile)."""
    n = len(nodes)
    last_read: dict[str, int] = {}
    for k, node in enumerate(nodes):
        for i in node.input:
            if i:
                last_read[i] = k
    made: dict[str, int] = {}
    for k, node in enumerate(nodes):
        for o in node.output:
            if o and o not in made:
                made[o] = k
    starts = np.zeros(n + 2, np.int64)  # +1 at the first cut it crosses, -1 past the last
    for o, k in made.items():
        end = n if o in graph_outputs else last_read.get(o, -1)
        if end > k:  # read after it is made (a reader before it is not the frontier's)
            starts[k + 1] += 1
            starts[end + 1] -= 1
    return np.cumsum(starts)[: n + 1]


@dataclass
class Prefix:
    model: onnx.ModelProto
    outputs: list[str]
    nodes: int  # nodes of the prefix


def prefix(model: onnx.ModelProto, end: int, names: Iterable[str] | None = None) -> Prefix | None:
    """The part of `model` that computes the frontier after node `end` (or the tensors `names`):
    those tensors' ancestors. None when some has no known type or is not in the model. A later
    block's weight computed before `end` for it alone (a hoisted DequantizeLinear) is not of
    the frontier: it is that block's, not the first blocks' result."""
    nodes = list(model.graph.node)
    graph_outputs = {o.name for o in model.graph.output}
    if names is not None:
        wanted = list(names)
    else:
        lent = _lent(model)
        wanted = [t for t in _frontier(nodes, end, graph_outputs) if t not in lent]
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    inputs = {i.name for i in model.graph.input}
    if any(w not in producer and w not in inputs for w in wanted):
        return None
    need, stack = set(), [producer[w] for w in wanted if w in producer]
    while stack:
        k = stack.pop()
        if k in need:
            continue
        need.add(k)
        stack.extend(producer[i] for i in nodes[k].input if i in producer)
    part = [nodes[k] for k in sorted(need)]
    read = {i for n in part for i in n.input if i}
    types = _types(model)
    ins = [i.name for i in model.graph.input if i.name in read or i.name in wanted]
    if any(t not in types for t in [*ins, *wanted]):
        return None
    return Prefix(_sub_model(model, part, ins, wanted, types), wanted, len(part))


def on_kept(model: onnx.ModelProto, kept: Mapping[str, Mapping[int, np.ndarray]]) -> onnx.ModelProto:
    """`model` whose outputs named in `kept` give only the indices kept along each axis there
    (a Gather of them per axis; the output keeps its name): the reference's tensors after the
    first blocks, as the shrunk model holds them when the hidden width was pruned."""
    if not kept:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for o in g.output:
        axes = kept.get(o.name)
        if not axes:
            continue
        src = o.name + "__whole"
        for n in g.node:  # the output's producer now writes the whole tensor
            n.output[:] = [src if x == o.name else x for x in n.output]
            n.input[:] = [src if x == o.name else x for x in n.input]
        shape = o.type.tensor_type.shape
        for k, (a, mask) in enumerate(sorted(axes.items())):
            idx = f"{o.name}__kept{a}"
            g.initializer.append(numpy_helper.from_array(np.flatnonzero(mask).astype(np.int64), idx))
            dst = o.name if k == len(axes) - 1 else f"{o.name}__part{a}"
            g.node.append(helper.make_node("Gather", [src, idx], [dst], axis=a, name=f"{o.name}__on_kept{a}"))
            src = dst
            if a < len(shape.dim):
                shape.dim[a].Clear()
                shape.dim[a].dim_value = int(mask.sum())
    return out
