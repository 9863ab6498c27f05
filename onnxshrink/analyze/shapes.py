"""Symbolic values of shape-computing subgraphs (Shape -> Gather -> Concat -> Reshape, ...).

A pruned axis changes what `Shape` reports, so shape values are never folded to constants.
Instead each element of a shape value is tracked as a literal, a reference to one tensor axis,
or an opaque expression over some axes. A *shape value* is an integer tensor computed only from
shape values and small integer constants (each op's handler says how, `Handler.shape_value`).
Consumers then either use it as a size (a Reshape target: the referenced axis and the output
axis are coupled; the handler claims the input) or as anything else, e.g. a number in float
arithmetic: then the referenced axes are pinned, they must keep their size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze.constants import ConstContext

if TYPE_CHECKING:  # the views handlers receive (implemented here and in constants.py)
    from onnxshrink.ops.contract import ConstView, ShapeView


@dataclass(frozen=True)
class DimRef:
    tensor: str
    axis: int


@dataclass(frozen=True)
class Opaque:
    deps: frozenset[DimRef]


@dataclass(frozen=True)
class Prod:
    """The product of these sizes, in this order (ReduceProd of gathered dims: einsum lowerings
    merge (batch, heads) into one axis this way). Its own axes, consecutive, as a Reshape's
    target size: those axes merged into one, row-major."""

    refs: tuple[DimRef, ...]


@dataclass(frozen=True)
class MaxOf:
    """The larger of these sizes (Max of two shape values, as a batched MatMul's broadcast batch
    size is computed). Its consumer ties every one to where it is used as a size, so that they
    keep the same count and the larger stays the one kept; it never assumes them equal."""

    args: frozenset[DimRef | Prod]


Item = int | DimRef | Opaque | Prod | MaxOf


def item_deps(it: Item) -> set[DimRef]:
    """The tensor axes an item's value is computed from."""
    if isinstance(it, DimRef):
        return {it}
    if isinstance(it, Opaque):
        return set(it.deps)
    if isinstance(it, Prod):
        return set(it.refs)
    if isinstance(it, MaxOf):
        return {d for a in it.args for d in item_deps(a)}
    return set()


@dataclass(frozen=True)
class SymValue:
    items: tuple[Item, ...]
    scalar: bool = False

    def deps(self) -> set[DimRef]:
        out: set[DimRef] = set()
        for it in self.items:
            out |= item_deps(it)
        return out

    @property
    def literal(self) -> bool:
        return all(isinstance(i, int) for i in self.items)

    def ints(self) -> list[int] | None:
        """The values, when every one is a literal."""
        out = [i for i in self.items if isinstance(i, int)]
        return out if len(out) == len(self.items) else None


def opaque(*vals: SymValue | Item) -> Opaque:
    """An item computed from these values in a way not modelled: it depends on all their axes."""
    deps: set[DimRef] = set()
    for v in vals:
        deps |= v.deps() if isinstance(v, SymValue) else item_deps(v)
    return Opaque(frozenset(deps))


def product_item(items: tuple[Item, ...]) -> Item:
    """The product of shape items: literal when all are, the one size when the others are 1s,
    a `Prod` of tensor dims, else opaque."""
    refs: list[DimRef] = []
    lit = 1
    for it in items:
        if isinstance(it, int):
            lit *= it
        elif isinstance(it, DimRef):
            refs.append(it)
        elif isinstance(it, Prod):
            refs.extend(it.refs)
        else:
            return opaque(*items)
    if not refs:
        return lit
    if lit != 1:
        return opaque(*items)
    return refs[0] if len(refs) == 1 else Prod(tuple(refs))


def max_item(p: Item, q: Item) -> Item:
    """The larger of two shape items: literal when both are, either one when they are the same
    symbol, a `MaxOf` of tensor sizes, else opaque."""
    if isinstance(p, int) and isinstance(q, int):
        return max(p, q)
    if p == q:
        return p
    args: set[DimRef | Prod] = set()
    for it in (p, q):
        if isinstance(it, DimRef | Prod):
            args.add(it)
        elif isinstance(it, MaxOf):
            args |= it.args
        else:
            return opaque(p, q)
    return MaxOf(frozenset(args))


def items_equal(p: Item, q: Item) -> bool | None:
    """Whether two items are equal, when that is known: a size (a tensor's dim) is never
    negative; the same dim is equal to itself."""
    if isinstance(p, int) and isinstance(q, int):
        return p == q
    if isinstance(p, DimRef) and isinstance(q, int) or isinstance(q, DimRef) and isinstance(p, int):
        return False if min(x for x in (p, q) if isinstance(x, int)) < 0 else None
    if isinstance(p, DimRef | Prod | MaxOf) and p == q:
        return True
    return None


def broadcast_items(*vals: SymValue) -> list[tuple[Item, ...]] | None:
    """The items of elementwise operands side by side (a single item broadcast)."""
    n = max(len(v.items) for v in vals)
    cols = [v.items * n if len(v.items) == 1 else v.items for v in vals]
    if any(len(c) != n for c in cols):
        return None
    return list(zip(*cols, strict=True))


class ShapeSyms:
    """The shape values known so far (what a handler's `shape_value` reads)."""

    def __init__(self, consts: ConstContext, tensors: Mapping[str, gs.Tensor]):
        self.consts = consts
        self.opset = consts.opset
        self.tensors = tensors
        self.syms: dict[str, SymValue] = {}

    def is_shape(self, t: gs.Tensor | None) -> bool:
        """Is `t` a shape value computed from some tensor's sizes?"""
        return t is not None and t.name in self.syms

    def sym(self, t: gs.Tensor | None) -> SymValue | None:
        """The symbolic value of a shape value or of a small integer constant, else None."""
        if t is None:
            return None
        if t.name in self.syms:
            return self.syms[t.name]
        v = self.consts.value(t)
        if v is not None and v.ndim <= 1 and v.size <= 64 and np.issubdtype(v.dtype, np.integer):
            return SymValue(tuple(int(x) for x in v.reshape(-1)), scalar=v.ndim == 0)
        return None

    def value(self, t: gs.Tensor | None) -> np.ndarray | None:
        return self.consts.value(t)


def is_integer_output(node: gs.Node) -> bool:
    """Does output 0 hold integers (or booleans), by its inferred type?"""
    dtype = node.outputs[0].dtype
    try:
        return dtype is not None and (
            np.issubdtype(np.dtype(dtype), np.integer) or np.dtype(dtype) == np.bool_
        )
    except TypeError:
        return False


def shape_operands(node: gs.Node, view: ShapeView, inputs: Iterable[int]) -> list[SymValue] | None:
    """The symbolic values of these inputs, when the node computes a shape value from them:
    some input is a shape value, every one is a shape value or a small integer constant, and
    the output is integer. None otherwise (the node computes data, e.g. divides by a size)."""
    ts = [t for t in (ir.present(node, i) for i in inputs) if t is not None]
    if not ts or not any(view.is_shape(t) for t in ts) or not is_integer_output(node):
        return None
    vals = []
    for t in ts:
        v = view.sym(t)
        if v is None:
            return None
        vals.append(v)
    return vals


def opaque_value(node: gs.Node, view: ShapeView) -> SymValue | None:
    """Output 0 of a node that computes a shape value in a way not modelled: each element
    depends on every axis its shape-valued inputs refer to. None when no input is one."""
    ins = [v for v in (view.sym(t) for t in node.inputs if view.is_shape(t)) if v is not None]
    if not ins:
        return None
    r = ir.static_dim(node.outputs[0], 0)
    return SymValue((opaque(*ins),) * (r or 1), scalar=ir.rank(node.outputs[0]) == 0)


def propagate_shapes(
    graph: gs.Graph, consts: ConstContext, lookup: Callable[[gs.Node], Any]
) -> dict[str, SymValue]:
    """Symbolic values of every shape value in the graph, each node's handler giving its rule."""
    view = ShapeSyms(consts, ir.all_tensors(graph))
    for node in ir.flat_nodes(graph):
        handler = lookup(node)
        if handler is None or not node.outputs:
            continue
        try:
            out = handler.shape_value(node, view)
        except (IndexError, ValueError, TypeError):  # a rule that does not fit: not modelled
            out = opaque_value(node, view) if is_integer_output(node) else None
        if out is not None:
            view.syms[node.outputs[0].name] = out
    return view.syms


# ---------------------------------------------------------------------- dims shape inference missed
def refine_shapes(
    graph: gs.Graph,
    syms: dict[str, SymValue],
    consts: ConstContext,
    lookup: Callable[[gs.Node], Any],
) -> bool:
    """Fill output dims that shape inference left unknown but the size inputs of Expand,
    ConstantOfShape and Reshape give (e.g. Expand(0, Shape(W)[0:1]), a zero bias the exporter
    builds at run time), or that a Slice with run-time bounds leaves as they were, and carry
    them on through elementwise ops and Concat (shape inference ran before these were known, or
    gave up where input dims had different symbols). True when a dim was filled."""
    view = ShapeSyms(consts, ir.all_tensors(graph))
    view.syms = syms
    outputs = {t.name for t in graph.outputs}
    changed = False
    for node in ir.flat_nodes(graph):
        handler = lookup(node)
        if handler is None or not node.outputs:
            continue
        for y, new in zip(node.outputs, handler.refine_output_dims(node, consts, view), strict=False):
            if y.name not in outputs:  # the interface keeps the dims it declares
                changed |= _fill(y, new)
    return changed


def _fill(y: gs.Tensor, new: list | None) -> bool:
    """Give `y` the dims `new` (computed only where `y`'s were not static); True if any changed."""
    if new is None or new == list(ir.dims(y) or []):
        return False
    y.shape = new
    return True


def sized_dims(
    node: gs.Node,
    size_in: gs.Tensor | None,
    consts: ConstView,
    view: ShapeView,
    *,
    broadcast: bool = False,
    zero_copies: bool = False,
) -> list | None:
    """Output dims from a size input (Expand and ConstantOfShape targets, Reshape's shape).
    `broadcast`: the size broadcasts with input 0's dims (Expand); `zero_copies`: a 0 copies
    the input's dim (Reshape), left as inferred."""
    if size_in is None:
        return None
    v = consts.value(size_in)
    s = view.syms.get(size_in.name)
    items = [int(x) for x in v.reshape(-1)] if v is not None else (list(s.items) if s else None)
    dims = ir.dims(node.outputs[0])
    if items is None or dims is None or len(dims) != len(items):
        return None
    new = list(dims)
    for p, it in enumerate(items):
        if isinstance(new[p], int):
            continue
        size = None
        if isinstance(it, int) and it >= 0:
            size = it
        elif isinstance(it, DimRef) and it.tensor in view.tensors:
            size = ir.static_dim(view.tensors[it.tensor], it.axis)
            named = _dim_name(view.tensors[it.tensor], it.axis)
            if size is None and named is not None:  # the same dynamic size as that axis
                x = ir.dims(node.inputs[0]) if broadcast else None
                k = p - (len(new) - len(x)) if x is not None else -1
                # broadcast: the target's size where the input's is 1, the same, or absent
                if not broadcast or x is not None and (k < 0 or x[k] in (1, named)):
                    new[p] = named
                continue
        elif isinstance(it, Prod | MaxOf):
            size = item_size(it, view.tensors)
        if broadcast and size is not None:
            x = ir.dims(node.inputs[0])
            k = p - (len(new) - len(x)) if x is not None else -1
            xd = x[k] if x is not None and k >= 0 else 1
            if not isinstance(xd, int):
                size = None if size == 1 else size
            elif size == 1 or xd == size:
                size = xd
            elif xd != 1:
                size = None  # not broadcastable: leave it to shape inference
        elif size == 0 and zero_copies:
            size = None
        if size is not None:
            new[p] = size
    if zero_copies and items.count(-1) == 1 and not isinstance(new[items.index(-1)], int):
        x_dims, rest = ir.dims(node.inputs[0]), [d for k, d in enumerate(new) if items[k] != -1]
        merged = [set(a) for a in (own_axes(it, node.inputs[0]) for it in items) if a]
        if x_dims and merged and sum(len(a) for a in merged) == len(set().union(*merged)):
            # a size that is the product of input axes cancels them, whatever their sizes
            x_dims = [d for k, d in enumerate(x_dims) if not any(k in a for a in merged)]
            rest = [d for k, d in enumerate(new) if items[k] != -1 and not own_axes(items[k], node.inputs[0])]
        inferred = _inferred_dim(x_dims, rest)
        if inferred is not None:
            new[items.index(-1)] = inferred
    return new


def item_size(it: Item, tensors: Mapping[str, gs.Tensor]) -> int | None:
    """The static size an item stands for, when the dims it refers to are static."""
    if isinstance(it, int):
        return it if it >= 0 else None
    if isinstance(it, DimRef):
        t = tensors.get(it.tensor)
        return ir.static_dim(t, it.axis) if t is not None else None
    if isinstance(it, Prod | MaxOf):
        sizes = [item_size(a, tensors) for a in (it.refs if isinstance(it, Prod) else it.args)]
        if any(v is None for v in sizes):
            return None
        known = [v for v in sizes if v is not None]
        return int(np.prod(known, dtype=np.int64)) if isinstance(it, Prod) else max(known)
    return None


def own_axes(it: Item, x: gs.Tensor) -> list[int] | None:
    """The axes of `x` a `Prod` item multiplies, when they are x's own consecutive axes in
    order (a Reshape of x to this size merges them); None otherwise."""
    if not isinstance(it, Prod) or any(r.tensor != x.name for r in it.refs):
        return None
    axes = [r.axis for r in it.refs]
    return axes if axes == list(range(axes[0], axes[0] + len(axes))) else None


def _inferred_dim(x: list | None, rest: list) -> int | None:
    """A Reshape's -1 dim: x's element count over the other output dims', when the dynamic
    dims cancel by name (shape inference leaves it unknown inside an If branch)."""
    if x is None:
        return None
    left, right = list(x), list(rest)
    for d in list(left):
        if isinstance(d, str) and d in right:
            left.remove(d)
            right.remove(d)
    if not all(isinstance(d, int) and d > 0 for d in [*left, *right]):
        return None
    num, den = int(np.prod(left, dtype=np.int64)), int(np.prod(right, dtype=np.int64))
    return num // den if den and num % den == 0 else None


def _dim_name(t: gs.Tensor, axis: int) -> str | None:
    """The symbolic name of a dynamic dim (shape inference's own `unk__` names excepted: they
    are unique per tensor, not a size shared)."""
    d = ir.dims(t)
    v = d[axis] if d is not None and 0 <= axis < len(d) else None
    return v if isinstance(v, str) and v and not v.startswith("unk__") else None


def elementwise_dims(node: gs.Node, same_shape: bool) -> list | None:
    """Unknown output dims from the inputs: copied for same-shape ops, broadcast otherwise
    (known when some input has a size > 1, or all share one symbol or 1)."""
    yd = ir.dims(node.outputs[0])
    ins = [node.inputs[0]] if same_shape else [t for t in node.inputs if t is not None and t.name]
    dims = []
    for t in ins:
        d = ir.dims(t)
        if d is None or yd is None or len(d) > len(yd):
            return None
        dims.append(d)
    if yd is None:
        return None
    new = list(yd)
    for k in range(len(yd)):
        if isinstance(yd[k], int):
            continue
        at = [d[k - len(yd) + len(d)] if k - len(yd) + len(d) >= 0 else 1 for d in dims]
        big = {v for v in at if isinstance(v, int) and v != 1}
        names = {v for v in at if not isinstance(v, int)}
        if len(big) == 1:  # whatever the unknown sizes, they broadcast to it
            new[k] = big.pop()
        elif not big and not names:
            new[k] = 1
        elif not big and len(names) == 1 and None not in names:
            new[k] = names.pop()
    return new
