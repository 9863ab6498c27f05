"""Rewrite the graph for the kept index sets: slice initializers, let each handler fix its node
(attributes, shape inputs, folded constants), drop dead nodes, and export a checked model."""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from onnxshrink import ir
from onnxshrink.analyze import Analysis
from onnxshrink.core import nonzero
from onnxshrink.core.evaluate import evaluate
from onnxshrink.core.values import ConstInfo
from onnxshrink.core.zeroed import ZeroedWeight
from onnxshrink.errors import InternalError
from onnxshrink.io import weights
from onnxshrink.io.skeleton import checkable
from onnxshrink.io.weights import DataWriter, tensor_proto
from onnxshrink.logs import route_library_logs
from onnxshrink.ops import handler_for_op, is_constant_node
from onnxshrink.prepare import default_opset, inferred_shapes, retie
from onnxshrink.report import KeptGroup, explain_kept

T = TypeVar("T")


@dataclass
class Fold:
    node: str
    op: str
    channels: int
    into: str  # "bias" | "border correction" | "constant map"


@dataclass
class RewriteResult:
    model: onnx.ModelProto
    folds: list[Fold] = field(default_factory=list)
    removed_nodes: int = 0
    kept_zeroed: list[KeptGroup] = field(default_factory=list)
    # Streamed: the initializers written to the external data file, by name (mapped, read-only)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    data_file: Path | None = None  # that file
    inserted: set[str] = field(default_factory=set)  # initializers the rewrite added (not the model's)
    # graph inputs and outputs that lost indices (a KV cache's heads): {name: {axis: kept}}
    interface: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    # every tensor that lost indices: {name: {axis: kept}} (filled for --validate-layers, whose
    # proof compares the tensors after the first blocks on the indices they kept)
    kept: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    # per weight and axis that lost indices: tensor, axis, size, kept, removed (the indices)
    removed_slices: list[dict[str, Any]] = field(default_factory=list)
    # the ids of the analysis' nodes still in the shrunk graph (a node kept whole whose output
    # the rewrite stopped reading, a zero state left out, is gone: no barrier of the output;
    # None: not known, every barrier stands)
    left: set[int] | None = None


class Rewriter:
    """What handlers' `rewrite` methods read (pre-shrink facts) and write (the new graph)."""

    def __init__(self, analysis: Analysis):
        self.graph = analysis.graph
        self.ks = analysis.keep
        self.opset = analysis.opset
        self.handler_for = analysis.handler_for
        self.tensors = self.ks.tensors
        self.folds: list[Fold] = []
        self._taken = set(self.tensors)
        # The scope of every node: what a handler adds for a node goes beside it (in its body)
        self._home = ir.home_graphs(self.graph)
        self.here = self.graph  # the scope of the node being rewritten
        self.untied = analysis.untied
        # {new constant: the weight it was made from}: readers of one weight (both branches of
        # an If) that each fold the same constant into it get equal copies, stored once
        self.derived: dict[str, str] = {}
        self.inserted: set[str] = set()  # constants made here (folds, corrections): not the model's
        self._ones: dict[tuple[int, tuple[ir.Dim, ...] | str, str], gs.Tensor] = {}
        self.bypassed: list[tuple[gs.Node, int]] = []  # nodes to splice out (see `bypass`)
        for t in self.tensors.values():  # freeze kept-set shapes before anything is sliced
            self.ks.kept(t, 0)

    # ------------------------------------------------------------ reads (pre-shrink)
    def kept(self, t: gs.Tensor, axis: int) -> np.ndarray | None:
        """Bool mask of kept indices along axis, or None when the axis is dynamic."""
        return self.ks.kept(t, axis)

    def kept_static(self, t: gs.Tensor, axis: int) -> np.ndarray:
        """The kept indices of an axis the handler's keep step required to be static."""
        k = self.kept(t, axis)
        if k is None:
            raise InternalError(f"{t.name!r} axis {axis}: no kept set (a dynamic size)")
        return k

    def is_read(self, t: gs.Tensor) -> bool:
        """Does a live node (or the interface) read `t`?"""
        return self.ks.is_read(t)

    def kept_part(self, t: gs.Tensor, values: np.ndarray) -> np.ndarray:
        """`values`, laid out as `t` was before the shrink (aligned to its last axes, each dim
        t's size or 1, as ConstInfo arrays are), at t's kept indices: a constant computed from
        the original tensors, made fit to add to the shrunk `t`."""
        r = ir.rank(t)
        off = (r if r is not None else values.ndim) - values.ndim
        for a in range(values.ndim):
            k = self.kept(t, a + off) if a + off >= 0 else None
            if k is None or values.shape[a] == 1 or k.all():
                continue
            if values.shape[a] != len(k):
                raise InternalError(
                    f"{t.name!r} axis {a + off}: a constant of size {values.shape[a]} for an axis of {len(k)}"
                )
            values = np.compress(k, values, axis=a)
        return values

    def kept_count(self, t: gs.Tensor, axis: int) -> int | None:
        k = self.kept(t, axis)
        return None if k is None else int(k.sum())

    def const(self, t: gs.Tensor) -> ConstInfo | None:
        return self.ks.const(t)

    def value(self, t: gs.Tensor | None) -> np.ndarray | None:
        """The original (pre-slice) value of a wholly constant tensor."""
        return self.ks.value(t)

    original = value

    def sym(self, t: gs.Tensor | None):
        return self.ks.sym(t)

    def current(self, t: gs.Constant) -> np.ndarray:
        return np.asarray(t.values)

    def evaluate(self, node: gs.Node, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        handler = self.handler_for(node)
        return evaluate(node, inputs, self.opset, ort=bool(handler and handler.evaluate_with_ort))

    def memo(self, key: Hashable, compute: Callable[[], T]) -> T:
        return self.ks.memo(key, compute)

    # ------------------------------------------------------------ writes
    def _name(self, hint: str) -> str:
        name = hint
        k = 0
        while name in self._taken:
            k += 1
            name = f"{hint}_{k}"
        self._taken.add(name)
        return name

    def constant(self, values: np.ndarray, hint: str) -> gs.Constant:
        c = gs.Constant(self._name(f"onnxshrink_{hint}"), values=np.asarray(values))
        self.inserted.add(c.name)
        return c

    def replace_input(self, node: gs.Node, i: int, values: np.ndarray) -> gs.Constant:
        """Give input i new constant values: in place when only `node` reads it (the name stays)."""
        old = ir.present(node, i)
        if isinstance(old, gs.Constant) and all(c is node for c in old.outputs):
            old.values = np.asarray(values)
            return old
        hint = old.name if old is not None else f"{node.name}_in{i}"
        c = gs.Constant(self._name(hint), values=np.asarray(values))
        if isinstance(old, gs.Constant):  # a copy of a shared weight: merged with its equals
            self.derived[c.name] = self.untied.get(old.name, old.name)
        while len(node.inputs) <= i:
            node.inputs.append(gs.Variable.empty())
        node.inputs[i] = c
        return c

    def available(self, op: str) -> bool:
        """Can a node of ONNX op `op`, in the form this rewrite writes it, be added at the
        model's opset? (Inserted ops never need a newer opset than the model's.)"""
        try:
            schema = onnx.defs.get_schema(op, self.opset, "")
        except onnx.defs.SchemaError:
            return False
        return schema.since_version >= self._form_since(op)

    def _form_since(self, op: str) -> int:
        handler = handler_for_op(op, "", self.opset)
        return handler.form_since(op) if handler is not None else 1

    def _check_available(self, op: str) -> None:
        if not self.available(op):
            raise InternalError(
                f"the rewrite needs a {op} node in a form the model's opset {self.opset} does not "
                f"have (opset {self._form_since(op)}+): that channel is kept"
            )

    def add_node(
        self, op: str, inputs: list[gs.Tensor], hint: str, attrs: dict[str, Any] | None = None, dtype=None
    ) -> gs.Variable:
        self._check_available(op)
        out = gs.Variable(self._name(f"onnxshrink_{hint}"), dtype=dtype)
        self.here.nodes.append(
            gs.Node(
                op,
                name=self._name(f"onnxshrink_{hint}_{op}"),
                attrs=attrs or {},
                inputs=inputs,
                outputs=[out],
            )
        )
        return out

    def slice1d(self, t: gs.Tensor, p: int) -> gs.Variable:
        return self._slice(t, p, p + 1)

    def _slice(self, t: gs.Tensor, start: int, end: int) -> gs.Variable:
        """t[start:end] along axis 0: Slice's bounds are inputs from opset 10, attributes before."""
        if self.opset < 10:
            attrs = {"starts": [start], "ends": [end], "axes": [0]}
            return self.add_node("Slice", [t], "shape_part", attrs, dtype=np.int64)
        ints = [self.constant(np.asarray([v], dtype=np.int64), "idx") for v in (start, end, 0)]
        return self.add_node("Slice", [t, *ints], "shape_part", dtype=np.int64)

    def concat1d(self, parts: list[gs.Tensor]) -> gs.Variable:
        return self.add_node("Concat", parts, "shape", {"axis": 0}, dtype=np.int64)

    def add_constant(
        self,
        node: gs.Node,
        out_index: int,
        values: np.ndarray,
        channels: int,
        into: str | None = None,
    ) -> None:
        """Add a constant to output `out_index`: into its only reader when that reader's handler
        absorbs it (a bias Add), else with a new Add."""
        if not np.any(values):
            return
        values = _smallest_broadcast(values)
        if self.absorb_into_reader(node, out_index, values, channels, into):
            return
        self.add_to_output(node, out_index, self.constant(values, f"{node.name}_folded"))
        kind = "constant map" if values.size > values.shape[-1] else "bias"
        self.record_fold(node, channels, into or kind)

    def absorb_into_reader(
        self, node: gs.Node, out_index: int, values: np.ndarray, channels: int, into: str | None = None
    ) -> bool:
        """Add a constant to output `out_index` inside its only reader, when that reader's handler
        absorbs it (a bias Add after a bias-less Conv or MatMul); False, changing nothing, if not."""
        y = node.outputs[out_index]
        nxt = y.outputs[0] if len(y.outputs) == 1 else None
        if nxt is None or y in self.scope(node).outputs:  # a body's output is read by its node
            return False
        handler = self.handler_for(nxt)
        slots = [i for i, t in enumerate(nxt.inputs) if t is y]
        if handler is None or len(slots) != 1 or not handler.absorb_addend(nxt, slots[0], values, self):
            return False
        self.record_fold(node, channels, into or "bias")
        return True

    def add_to_output(self, node: gs.Node, out_index: int, addend: gs.Tensor) -> None:
        """Output `out_index` of `node` becomes itself + `addend` (for every reader)."""
        self.insert_after(node, out_index, "Add", [addend], "fold", "unfolded")

    def insert_after(
        self,
        node: gs.Node,
        out_index: int,
        op: str,
        operands: list[gs.Tensor],
        hint: str,
        suffix: str = "raw",
        attrs: dict[str, Any] | None = None,
    ) -> gs.Variable:
        """Output `out_index` of `node` goes through a new `op` node (as its first input, then
        `operands`), whose output is the old tensor: every reader reads the new node. Returns
        `node`'s own output, now a new tensor."""
        self._check_available(op)
        y = node.outputs[out_index]
        mid = gs.Variable(self._name(f"{y.name}_{suffix}"), dtype=y.dtype)
        node.outputs[out_index] = mid
        self.scope(node).nodes.append(
            gs.Node(
                op,
                name=self._name(f"{node.name}_{hint}"),
                attrs=attrs or {},
                inputs=[mid, *operands],
                outputs=[y],
            )
        )
        return mid

    def bypass(self, node: gs.Node, i: int) -> None:
        """`node` computes its input i unchanged (an Add of zeros): once every handler has
        rewritten its node, its readers read that input instead and the node goes."""
        self.bypassed.append((node, i))

    def ones_map(self, x: gs.Tensor, dtype: Any) -> gs.Tensor:
        """A [1, 1, *spatial] map of ones the size of x's spatial dims: one shared map per static
        size, or built from x's shape at run time (ConstantOfShape from opset 9; before, a
        stored map of a static size, or a Tile of a one)."""
        dims = ir.dims(x) or []
        static = len(dims) > 2 and all(isinstance(d, int) for d in dims[2:])
        key = (id(self.here), tuple(dims[2:]) if static else x.name, np.dtype(dtype).str)
        if key in self._ones:
            return self._ones[key]
        ones: gs.Tensor
        if static and not self.available("ConstantOfShape"):
            ones = self.constant(np.ones([1, 1, *(int(d) for d in dims[2:] if isinstance(d, int))], dtype=dtype), "ones")
        else:
            size: gs.Tensor
            if static:
                size = self.constant(np.asarray([1, 1, *dims[2:]], np.int64), "ones_shape")
            else:
                if self.opset >= 15:
                    spatial = self.add_node("Shape", [x], "spatial", {"start": 2}, np.int64)
                else:
                    shape = self.add_node("Shape", [x], "shape", None, np.int64)
                    spatial = self._slice(shape, 2, np.iinfo(np.int64).max)
                one_one = self.constant(np.asarray([1, 1], np.int64), "one_one")
                size = self.concat1d([one_one, spatial])
            if self.available("ConstantOfShape"):
                one = gs.Constant(self._name("onnxshrink_one"), values=np.ones(1, dtype=dtype))
                ones = self.add_node("ConstantOfShape", [size], "ones", {"value": one}, dtype)
            else:  # opset 7-8, dynamic spatial size: a one tiled to the size
                rank = len(dims) if dims else 4
                one = self.constant(np.ones([1] * rank, dtype=dtype), "one")
                ones = self.add_node("Tile", [one, size], "ones", None, dtype)
        self._ones[key] = ones
        return ones

    def scope(self, node: gs.Node) -> gs.Graph:
        """The graph (the model's, or a body) that holds `node`."""
        return self._home.get(id(node), self.here)

    def record_fold(self, node: gs.Node, channels: int, into: str) -> None:
        self.folds.append(Fold(node.name, node.op, channels, into))

    def check_removed_constant(
        self, node: gs.Node, c: ConstInfo | None, axis: int, removed: np.ndarray
    ) -> None:
        """Every removed input index a kept output still reads must be a constant."""
        const = (
            c.slice_constant(axis, len(removed)) if c is not None else np.zeros(len(removed), bool)
        )
        bad = removed & ~const
        if bad.any():
            raise InternalError(
                f"{node.op} node {node.name!r}: input indices {np.flatnonzero(bad)[:8].tolist()} were "
                "removed although live outputs read them"
            )


def _smallest_broadcast(values: np.ndarray) -> np.ndarray:
    """`values` with every axis along which it does not vary cut to size 1: the same addend
    under broadcasting, stored as small as it is (a folded bias is not a map)."""
    for a in range(values.ndim):
        if values.shape[a] > 1 and np.all(values == values.take([0], axis=a)):
            values = values.take([0], axis=a)
    return values


def apply(
    analysis: Analysis,
    original: onnx.ModelProto,
    writer: DataWriter | None = None,
    progress: Any = None,
) -> RewriteResult:
    """Shrink `analysis.graph` in place and export it as a model like `original`. With a
    `writer`, every initializer of STREAM_BYTES or more is written (sliced) to its external data
    file a block of rows at a time, and the model refers to it there. `progress.update(n)` is
    told the bytes of each initializer done."""
    route_library_logs()
    rw = Rewriter(analysis)
    graph, ks = analysis.graph, analysis.keep
    frozen = _frozen_scopes(ks)
    nodes = [n for n in ks.nodes if id(rw.scope(n)) not in frozen]
    live = [n for n in nodes if ks.node_live(n)]
    dead = [n for n in nodes if not ks.node_live(n)]
    _slice_weights(rw, ks, writer, progress)
    _rewrite_nodes(analysis, rw, live)
    # The original weights are no longer needed: free them before the export copies the graph.
    analysis.consts.consts.clear()
    ks.forget()
    for node in dead:
        node.inputs.clear()
        node.outputs.clear()
    interface = _declare_shapes(graph, ks, frozen)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    kept_zeroed = explain_kept(analysis)
    retie(graph, {**analysis.untied, **rw.derived})
    arrays = _externalize(graph, writer) if writer is not None else {}
    result = RewriteResult(export(graph, original), rw.folds, len(dead), kept_zeroed, arrays)
    result.inserted = rw.inserted
    result.interface = interface
    result.left = {id(n) for g in ir.scopes(graph) for n in g.nodes}
    return result


def _frozen_scopes(ks) -> set[int]:
    """The ids of the bodies of the nodes kept whole (barriers), and of the bodies inside
    them: they are kept as they are, nodes and shapes."""
    return {id(g) for n in ks.nodes if id(n) in ks.barriers for b in ir.bodies(n) for g in ir.scopes(b)}


def _slice_weights(rw: Rewriter, ks, writer: DataWriter | None, progress: Any) -> None:
    """Slice every weight the kept nodes read to its kept indices (`progress.update(n)`: the
    bytes of each one done)."""
    for t in list(rw.tensors.values()):
        if isinstance(t, gs.Constant) and t.name in ks.demanded:
            size = ir.nbytes(t)
            _slice_constant(t, ks, writer)
            if progress is not None:
                progress.update(size)


def _rewrite_nodes(analysis: Analysis, rw: Rewriter, live: list[gs.Node]) -> None:
    """Let each live node's handler fix what slicing its weights left (attributes, shape
    inputs, folded constants), then splice out the nodes that became pass-throughs."""
    ks = analysis.keep
    for node in live:
        handler = analysis.handler_for(node)
        if handler is not None and id(node) not in ks.barriers:
            rw.here = rw.scope(node)
            handler.rewrite(node, rw)
            weights.trim()
    _splice(rw)
    rw.here = analysis.graph


def _declare_shapes(graph: gs.Graph, ks, frozen: set[int]) -> dict[str, dict[int, np.ndarray]]:
    """Declare the shrunk shapes of the graph's and its bodies' inputs and outputs, and forget
    every other tensor's (the export infers them again); returns what each graph input or
    output keeps where it loses indices (`_interface_kept`)."""
    io = {t.name for t in [*graph.inputs, *graph.outputs]}
    interface = _interface_kept(graph, ks)
    for t in [*graph.inputs, *graph.outputs]:  # a state (KV cache) whose heads went
        if t.name in interface and isinstance(t, gs.Variable):
            t.shape = _shrunk_dims(t, ks)
    bodies = [g for g in list(ir.scopes(graph))[1:] if id(g) not in frozen]
    bounds = {t.name: t for g in bodies for t in [*g.inputs, *g.outputs]}
    for t in bounds.values():  # a body's inputs and outputs declare their shrunk shapes
        if isinstance(t, gs.Variable) and t.shape is not None:
            t.shape = _shrunk_dims(t, ks)
    for g in [graph, *bodies]:
        for t in g.tensors().values():
            if isinstance(t, gs.Variable) and t.name not in io and t.name not in bounds:
                t.shape = None
    return interface


def _interface_kept(graph: gs.Graph, ks) -> dict[str, dict[int, np.ndarray]]:
    """Graph input or output name -> {axis: the indices kept}, for those that lose some (only
    a state the runtime feeds back may: see analyze.cache)."""
    out: dict[str, dict[int, np.ndarray]] = {}
    for t in [*graph.inputs, *graph.outputs]:
        for a in range(len(t.shape or [])):
            k = ks.kept(t, a)
            if k is not None and not k.all():
                out.setdefault(t.name, {})[a] = np.flatnonzero(k)
    return out


def _splice(rw: Rewriter) -> None:
    """Remove each node that passes its input i through unchanged (`Rewriter.bypass`): its
    readers, in any scope, read that input. One whose output is its scope's output stays, as an
    Identity (the output keeps its name)."""
    if not rw.bypassed:
        return
    readers: dict[int, list[gs.Node]] = {}
    for g in ir.scopes(rw.graph):
        for n in g.nodes:
            for t in n.inputs:
                readers.setdefault(id(t), []).append(n)
    for node, i in rw.bypassed:
        x, y = node.inputs[i], node.outputs[0]
        scope = rw.scope(node)
        if any(t is y for t in scope.outputs):
            node.op, node.domain = "Identity", None
            node.attrs.clear()
            node.inputs.clear()
            node.inputs.append(x)
            continue
        for reader in readers.get(id(y), []):
            for k, t in enumerate(reader.inputs):
                if t is y:
                    reader.inputs[k] = x
            readers.setdefault(id(x), []).append(reader)
        node.inputs.clear()
        node.outputs.clear()


def _shrunk_dims(t: gs.Tensor, ks) -> list[ir.Dim]:
    """`t`'s dims with each prunable axis at its kept count."""
    dims = list(t.shape or [])
    for a, d in enumerate(dims):
        k = ks.kept(t, a)
        if isinstance(d, int) and k is not None and len(k) == d:
            dims[a] = int(k.sum())
    return dims


def release(graph: gs.Graph) -> None:
    """Drop the graph's weight arrays now (its nodes and tensors form reference cycles, which
    only a full garbage collection would free; that costs more than it saves here)."""
    for t in ir.all_tensors(graph).values():
        loaded = getattr(t, "_values", None)  # not the lazy (never loaded) ones
        if isinstance(t, gs.Constant) and isinstance(loaded, np.ndarray):
            t.values = np.zeros((0,), dtype=loaded.dtype)


# Initializers at least this large are streamed to the external data file (as onnx's own
# external-data writer's threshold).
STREAM_BYTES = 1024


def _slice_constant(t: gs.Constant, ks, writer: DataWriter | None = None) -> None:
    zeroed = getattr(getattr(t, "_values", None), "deferred", None)  # made from the original
    shape = tuple(zeroed.shape) if zeroed is not None else tuple(np.shape(t.values))
    index: dict[int, np.ndarray] = {}
    for a in range(len(shape)):
        k = ks.kept(t, a)
        if k is not None and len(k) == shape[a] and not k.all():
            index[a] = np.flatnonzero(k)
    if zeroed is not None and writer is not None:
        _slice_zeroed(t, zeroed, index, writer)
        return
    values = np.asarray(t.values)
    if writer is None or values.nbytes < STREAM_BYTES:
        for a, idx in index.items():
            values = np.take(values, idx, axis=a)
        if values is not t.values:
            t.values = values
        return
    _slice_zeroed(t, ZeroedWeight(values, ()), index, writer)


def _slice_zeroed(t: gs.Constant, zeroed: ZeroedWeight, index: dict[int, np.ndarray], writer: DataWriter) -> None:
    """A mapped weight sliced to `index` and streamed to `writer`, read from its original (a
    weight the reference holds zeroed but has not written, `core.zeroed`: any zeroed slice kept
    set to zero; never the whole made). Its non-zero pattern, when known, is derived for the
    slice (the shrunk model's analysis does not scan it again)."""
    arr = zeroed.original
    shape = tuple(len(index[a]) if a in index else n for a, n in enumerate(arr.shape))
    weights.populate(arr)
    before = zeroed.known_pattern() if arr.ndim == 2 else None
    place = _place_of(arr, index)
    cuts = tuple((a, np.asarray(idx).tobytes()) for a, idx in zeroed.slices)
    key = None if place is None else (*place, cuts, None if zeroed.zero is None else zeroed.zero.tobytes())
    t.values = _once(writer, key, lambda: writer.write(t.name, zeroed.kept_blocks(index), shape, arr.dtype))
    after = nonzero.sliced(before, index.get(0), index.get(1)) if before is not None else None
    if after is not None:
        nonzero.remember(t.values, after)
    weights.trim()


def _place_of(values: np.ndarray, index: dict[int, np.ndarray]) -> tuple[Hashable, ...] | None:
    """Where a mapped weight lies and how it is sliced (None: not a mapped weight)."""
    store = weights.owner(values)
    where = store.location(values) if store is not None else None
    if where is None:
        return None
    kept = tuple((a, idx.tobytes()) for a, idx in sorted(index.items()))
    return (where.path, where.offset, values.shape, values.strides, values.dtype.str, kept)


def _once(writer: DataWriter, key: tuple[Hashable, ...] | None, write: Callable[[], np.ndarray]) -> np.ndarray:
    """A weight's slice written once per output file: copies of a shared weight sliced alike
    (a tied embedding and LM head) refer to one range. Written apart, the merge of equal copies
    that follows (`retie`) left the other's bytes in the file, read by nothing (90 MB of
    SmolLM2-135M's 441 MB)."""
    if key is None:
        return write()
    made = writer.made.get(key)
    if made is None:
        made = writer.made[key] = write()
    return made


def _externalize(graph: gs.Graph, writer: DataWriter) -> dict[str, np.ndarray]:
    """Make every large initializer refer to its bytes in the writer's file (writing those not
    written yet: constants the handlers made), so that the export copies no weights."""
    arrays: dict[str, np.ndarray] = {}
    for t in ir.all_tensors(graph).values():
        if not isinstance(t, gs.Constant) or not isinstance(t._values, np.ndarray):
            continue
        arr = t._values
        if arr.nbytes < STREAM_BYTES or _four_bit(arr):  # (4-bit: packed by `export`)
            continue
        where = writer.store.location(arr)
        if where is None or where.path != writer.path:
            arr = writer.write(t.name, weights.row_blocks(arr), arr.shape, arr.dtype)
            where = writer.store.location(arr)
            assert where is not None
        arrays[t.name] = arr
        t._values = LazyValues(tensor_proto(t.name, arr, where, writer.path.parent))
    return arrays


def _four_bit(arr: np.ndarray) -> bool:
    return arr.dtype.name in ("int4", "uint4")


def export(graph: gs.Graph, original: onnx.ModelProto) -> onnx.ModelProto:
    for t in ir.all_tensors(graph).values():
        # onnx-graphsurgeon writes an int4 array one byte an element; onnx packs two a byte
        if isinstance(t, gs.Constant) and isinstance(t._values, np.ndarray) and _four_bit(t._values):
            t._values = LazyValues(onnx.numpy_helper.from_array(t._values, t.name))
    model = gs.export_onnx(graph, do_type_check=False)
    model.ir_version = original.ir_version
    del model.opset_import[:]
    model.opset_import.extend(original.opset_import)
    for f in ("producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(model, f, getattr(original, f))
    del model.metadata_props[:]
    model.metadata_props.extend(original.metadata_props)
    if original.functions and not model.functions:
        model.functions.extend(original.functions)
    if original.ir_version < 4:  # IR 3: every initializer is listed as a graph input too
        listed = {i.name for i in model.graph.input}
        model.graph.input.extend(
            onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
            for t in model.graph.initializer
            if t.name not in listed
        )
    _place_initializers(model.graph, _declared_depths(original.graph, default_opset(original)))
    bodies = list(ir.all_graphs(model.graph))[1:]
    inner = {n for g in bodies for n in [*(o for x in g.node for o in x.output), *(v.name for v in [*g.input, *g.output])]}
    inferred = {vi.name: vi for vi in inferred_shapes(model, subgraphs=bool(bodies))}
    del model.graph.value_info[:]
    model.graph.value_info.extend(vi for name, vi in inferred.items() if name not in inner)
    for g in bodies:  # each body's own tensors, as inferred (outer ones are the outer graph's)
        own = [o for x in g.node for o in x.output if o and o in inferred]
        del g.value_info[:]
        g.value_info.extend(inferred[o] for o in own)
    onnx.checker.check_model(checkable(model))
    return model


def _declared_depths(graph: onnx.GraphProto, opset: int) -> dict[str, int]:
    """How deep in the model's subgraphs each weight (initializer or Constant node) is declared:
    0 for the main graph, 1 for a body in it, ..."""
    depths: dict[str, int] = {}

    def walk(g: onnx.GraphProto, depth: int) -> None:
        for t in g.initializer:
            depths[t.name] = depth
        for n in g.node:
            if is_constant_node(n, opset) and not n.input:
                depths.update((o, depth) for o in n.output)
            for a in n.attribute:
                for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                    walk(sub, depth + 1)

    walk(graph, 0)
    return depths


def _place_initializers(graph: onnx.GraphProto, declared: dict[str, int]) -> None:
    """onnx-graphsurgeon writes a weight into every subgraph that reads it from outside (one
    copy per If branch, none in the graph around them). An initializer belongs, once, where
    the input model declared it (`declared`: its depth), which holds every node reading it;
    one the rewrite made, in the innermost graph that holds them all."""
    paths: list[tuple[onnx.GraphProto, tuple[int, ...]]] = []

    def walk(g: onnx.GraphProto, path: tuple[int, ...]) -> None:
        paths.append((g, path))
        for n in g.node:
            for a in n.attribute:
                for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                    walk(sub, (*path, id(sub)))

    walk(graph, (id(graph),))
    if len(paths) == 1:
        return
    tensors: dict[str, onnx.TensorProto] = {}
    readers: dict[str, list[tuple[int, ...]]] = {}
    for g, path in paths:
        for t in g.initializer:
            tensors.setdefault(t.name, t)
        for name in [*(i for n in g.node for i in n.input), *(o.name for o in g.output)]:
            readers.setdefault(name, []).append(path)
    owner: dict[str, int] = {}
    for name in tensors:
        where = readers.get(name)
        if where:
            common = os.path.commonprefix(where)  # tuples compare element by element
            innermost = len(common) - 1
            owner[name] = common[min(declared.get(name, innermost), innermost)]
    plan: list[tuple[onnx.GraphProto, list[onnx.TensorProto]]] = []
    for g, path in paths:  # copies made before any list is changed
        here = path[-1]
        stay = [t for t in g.initializer if owner.get(t.name, here) == here]
        names = {t.name for t in stay}
        moved_in = [tensors[n] for n, o in owner.items() if o == here and n not in names]
        if len(stay) == len(g.initializer) and not moved_in:
            continue
        plan.append((g, [_copy(t) for t in [*stay, *moved_in]]))
    for g, kept in plan:
        del g.initializer[:]
        g.initializer.extend(kept)


def _copy(t: onnx.TensorProto) -> onnx.TensorProto:
    out = onnx.TensorProto()
    out.CopyFrom(t)
    return out
