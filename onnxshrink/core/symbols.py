"""Symbolic shape values (`SymValue`) and their algebra.

A pruned axis changes what `Shape` reports, so shape values are never folded to constants.
Each element of a shape value is a literal, a reference to one tensor axis (`DimRef`), a
product or maximum of such sizes, or an opaque expression over some axes. The analysis tracks
them forward (analyze/shapes.py), each op's handler giving its rule (`Handler.shape_value`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir


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


