"""Shape rules handlers share: output dims from size inputs and broadcasting, and the shape
values of nodes that compute sizes (read through a `ShapeView`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core.handler import Dims
from onnxshrink.core.symbols import DimRef, Item, MaxOf, Prod, SymValue, item_size, opaque, own_axes
from onnxshrink.core.views import ConstView, ShapeView


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
    rank = ir.rank(node.outputs[0])
    n = 1 if rank == 0 else ir.static_dim(node.outputs[0], 0) if rank == 1 else None
    if n is None:  # a vector of unknown length: no value an element of it could be read from
        return None
    return SymValue((opaque(*ins),) * n, scalar=rank == 0)


def sized_dims(
    node: gs.Node,
    size_in: gs.Tensor | None,
    consts: ConstView,
    view: ShapeView,
    *,
    broadcast: bool = False,
    zero_copies: bool = False,
) -> Dims | None:
    """Output dims from a size input (Expand and ConstantOfShape targets, Reshape's shape).
    `broadcast`: the size broadcasts with input 0's dims (Expand); `zero_copies`: a 0 copies
    the input's dim (Reshape), left as inferred."""
    items = _size_items(size_in, consts, view) if size_in is not None else None
    dims = ir.dims(node.outputs[0])
    if dims is None and items is not None and not broadcast:
        dims = [None] * len(items)  # the output's rank is the size input's length
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
        inferred = _minus_one_dim(node.inputs[0], items, new)
        if inferred is not None:
            new[items.index(-1)] = inferred
    return new


def _size_items(size_in: gs.Tensor, consts: ConstView, view: ShapeView) -> list[Item] | None:
    """The elements of a size input: its values when constant, else its shape value's items."""
    v = consts.value(size_in)
    s = view.syms.get(size_in.name)
    return [int(x) for x in v.reshape(-1)] if v is not None else (list(s.items) if s else None)


def _minus_one_dim(x: gs.Tensor, items: list[Item], new: Dims) -> int | None:
    """A Reshape's -1 dim (at the one -1 of `items`, the target's) from input `x`'s dims and
    the other output dims `new`."""
    x_dims, rest = ir.dims(x), [d for k, d in enumerate(new) if items[k] != -1]
    merged = [set(a) for a in (own_axes(it, x) for it in items) if a]
    if x_dims and merged and sum(len(a) for a in merged) == len(set().union(*merged)):
        # a size that is the product of input axes cancels them, whatever their sizes
        x_dims = [d for k, d in enumerate(x_dims) if not any(k in a for a in merged)]
        rest = [d for k, d in enumerate(new) if items[k] != -1 and not own_axes(items[k], x)]
    return _inferred_dim(x_dims, rest)


def _inferred_dim(x: Dims | None, rest: Dims) -> int | None:
    """A Reshape's -1 dim: x's element count over the other output dims', when the dynamic
    dims cancel by name (shape inference leaves it unknown inside an If branch)."""
    if x is None:
        return None
    left, right = list(x), list(rest)
    for d in list(left):
        if isinstance(d, str) and d in right:
            left.remove(d)
            right.remove(d)
    static_left = [d for d in left if isinstance(d, int) and d > 0]
    static_right = [d for d in right if isinstance(d, int) and d > 0]
    if len(static_left) != len(left) or len(static_right) != len(right):
        return None
    num, den = int(np.prod(static_left, dtype=np.int64)), int(np.prod(static_right, dtype=np.int64))
    return num // den if den and num % den == 0 else None


def _dim_name(t: gs.Tensor, axis: int) -> str | None:
    """The symbolic name of a dynamic dim (shape inference's own `unk__` names excepted: they
    are unique per tensor, not a size shared)."""
    d = ir.dims(t)
    v = d[axis] if d is not None and 0 <= axis < len(d) else None
    return v if isinstance(v, str) and v and not v.startswith("unk__") else None


def elementwise_dims(node: gs.Node, same_shape: bool) -> Dims | None:
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
    wide = broadcast_dims([[*[1] * (len(yd) - len(d)), *d] for d in dims] or [[1] * len(yd)])
    return [y if isinstance(y, int) or b is None else b for y, b in zip(yd, wide, strict=True)]


def broadcast_dims(shapes: Sequence[Dims]) -> Dims:
    """numpy's broadcast of dims that may be symbolic (a name) or unknown (None), per axis: a
    size > 1 wins over 1 and over any name (whatever the unknown sizes, they broadcast to it);
    all 1 gives 1; one shared name stays; anything else is unknown (None)."""
    rank = max((len(d) for d in shapes), default=0)
    out: Dims = []
    for k in range(rank):
        at = [d[k - rank + len(d)] for d in shapes if k - rank + len(d) >= 0]
        big = {v for v in at if isinstance(v, int) and v != 1}
        names = {v for v in at if not isinstance(v, int)}
        if len(big) == 1:
            out.append(big.pop())
        elif not big and not names:
            out.append(1)
        elif not big and len(names) == 1 and None not in names:
            out.append(names.pop())
        else:
            out.append(None)
    return out
