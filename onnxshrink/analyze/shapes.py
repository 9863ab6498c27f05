"""Symbolic values of shape-computing subgraphs (Shape -> Gather -> Concat -> Reshape, ...).

A pruned axis changes what `Shape` reports, so shape values are never folded to constants.
Instead each element of a shape tensor is tracked as a literal, a reference to one tensor
axis, or an opaque expression over some axes. Consumers then either use the value as a size
(a Reshape target: the referenced axis and the output axis are coupled) or as anything else
(the referenced axes are pinned: they must keep their size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.analyze.constants import ConstContext


@dataclass(frozen=True)
class DimRef:
    tensor: str
    axis: int


@dataclass(frozen=True)
class Opaque:
    deps: frozenset[DimRef]


Item = int | DimRef | Opaque


@dataclass(frozen=True)
class SymValue:
    items: tuple[Item, ...]
    scalar: bool = False

    def deps(self) -> set[DimRef]:
        out: set[DimRef] = set()
        for it in self.items:
            if isinstance(it, DimRef):
                out.add(it)
            elif isinstance(it, Opaque):
                out |= it.deps
        return out


def _opaque(*vals: SymValue) -> Opaque:
    deps: set[DimRef] = set()
    for v in vals:
        deps |= v.deps()
    return Opaque(frozenset(deps))


_ARITH = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Max": np.maximum,
    "Min": np.minimum,
}
_PASS = {"Identity", "Cast", "CastLike"}
_SHAPE_OPS = {
    "Expand",
    "Shape",
    "Size",
    "Gather",
    "Slice",
    "Concat",
    "Unsqueeze",
    "Squeeze",
    "Reshape",
    "Flatten",
    "Div",
    "Mod",
    "Neg",
    "Abs",
    "Floor",
    "Ceil",
    "Equal",
    "Where",
    *_ARITH,
    *_PASS,
}


def propagate_shapes(graph: gs.Graph, consts: ConstContext) -> dict[str, SymValue]:
    """Symbolic values of every int tensor computed (partly) from Shape/Size."""
    syms: dict[str, SymValue] = {}

    def get(t: gs.Tensor | None) -> SymValue | None:
        if t is None:
            return None
        if t.name in syms:
            return syms[t.name]
        v = consts.value(t)
        if v is not None and v.ndim <= 1 and v.size <= 64 and np.issubdtype(v.dtype, np.integer):
            return SymValue(tuple(int(x) for x in v.reshape(-1)), scalar=v.ndim == 0)
        return None

    for node in graph.nodes:
        if node.op not in _SHAPE_OPS or not node.outputs:
            continue
        if node.op in ("Concat", "Div", "Mod", "Equal", "Where", *_ARITH):
            if not any(t is not None and t.name in syms for t in node.inputs):
                continue
        elif node.op not in ("Shape", "Size") and node.inputs[0].name not in syms:
            continue  # a data op (e.g. Reshape of an activation), not a shape computation
        try:
            out = _step(node, get)
        except (IndexError, ValueError, TypeError):
            out = None
        if out is None:
            # Consumes shape values in a way not modelled: its output is opaque over their axes.
            ins = [get(t) for t in node.inputs]
            deps = _opaque(*[v for v in ins if v is not None])
            if node.op in ("Shape", "Size") and ir.rank(node.inputs[0]) is not None:
                deps = Opaque(
                    frozenset(
                        DimRef(node.inputs[0].name, a) for a in range(ir.rank(node.inputs[0]))
                    )
                )
            r = ir.static_dim(node.outputs[0], 0)
            out = SymValue((deps,) * (r or 1), scalar=ir.rank(node.outputs[0]) == 0)
        syms[node.outputs[0].name] = out
    return syms


def _step(node: gs.Node, get) -> SymValue | None:
    op = node.op
    x = node.inputs[0]
    if op == "Shape":
        r = ir.rank(x)
        if r is None:
            return None
        start = ir.norm_axis(int(node.attrs.get("start", 0)), r)
        end = node.attrs.get("end")
        end = r if end is None else min(ir.norm_axis(int(end), r), r)
        return SymValue(tuple(DimRef(x.name, a) for a in range(max(start, 0), end)))
    if op == "Size":
        r = ir.rank(x)
        if r is None:
            return None
        return SymValue((Opaque(frozenset(DimRef(x.name, a) for a in range(r))),), scalar=True)
    if op == "Where":  # the legacy exporter's expand: Where(Equal(shape, -1), 1, shape)
        c, t, f = (get(ir.present(node, i)) for i in range(3))
        if c is None or t is None or f is None or not all(isinstance(i, int) for i in c.items):
            return None
        n = max(len(c.items), len(t.items), len(f.items))
        c_, t_, f_ = (v.items * n if len(v.items) == 1 else v.items for v in (c, t, f))
        if not len(c_) == len(t_) == len(f_) == n:
            return None
        return SymValue(tuple(p if k else q for k, p, q in zip(c_, t_, f_, strict=True)))
    a = get(x)
    if a is None:
        return None
    if op in _PASS:
        return a
    if op in ("Unsqueeze", "Reshape", "Flatten"):
        return SymValue(a.items, scalar=False) if ir.rank(node.outputs[0]) == 1 else None
    if op == "Expand":  # a shape vector broadcast to a 1-D target (e.g. [n] to [1])
        target = get(ir.present(node, 1))
        if (
            target is None
            or len(target.items) != 1
            or not isinstance(target.items[0], int)
            or a.scalar
        ):
            return None
        n = target.items[0]
        if len(a.items) == 1 and n > 1:
            return SymValue(a.items * n)
        return a if n in (1, len(a.items)) else None
    if op == "Squeeze":
        return SymValue(a.items, scalar=True) if len(a.items) == 1 else None
    if op == "Gather":
        idx = get(ir.present(node, 1))
        if idx is None or any(not isinstance(i, int) for i in idx.items) or a.scalar:
            return None
        n = len(a.items)
        picked = tuple(a.items[i + n if i < 0 else i] for i in idx.items)
        return SymValue(picked, scalar=idx.scalar)
    if op == "Slice":
        params = [get(ir.present(node, i)) for i in range(1, 5)]
        if "starts" in node.attrs:  # opset < 10
            starts, ends = node.attrs["starts"], node.attrs["ends"]
            steps = [1]
        else:
            if params[0] is None or params[1] is None:
                return None
            if any(not isinstance(i, int) for p in params if p is not None for i in p.items):
                return None
            starts, ends = list(params[0].items), list(params[1].items)
            steps = list(params[3].items) if params[3] is not None else [1]
        return SymValue(a.items[slice(starts[0], ends[0], steps[0])])
    if op == "Concat":
        vals = [get(t) for t in node.inputs]
        if any(v is None for v in vals):
            return None
        return SymValue(tuple(i for v in vals for i in v.items))
    if op in ("Neg", "Abs", "Floor", "Ceil"):
        return SymValue(tuple(_unary(op, i, a) for i in a.items), a.scalar)
    b = get(ir.present(node, 1))
    if b is None:
        return None
    n = max(len(a.items), len(b.items))
    ai = a.items * n if len(a.items) == 1 else a.items
    bi = b.items * n if len(b.items) == 1 else b.items
    if len(ai) != len(bi):
        return None
    out = []
    for p, q in zip(ai, bi, strict=True):
        if op == "Equal":
            known = _equal(p, q)
            if known is None:
                return None
            out.append(int(known))
        elif isinstance(p, int) and isinstance(q, int):
            out.append(_binary(op, p, q))
        else:
            out.append(_opaque(SymValue((p,)), SymValue((q,))))
    return SymValue(tuple(out), scalar=a.scalar and b.scalar)


def _equal(p: Item, q: Item) -> bool | None:
    """Whether two items are equal, when that is known: a size (a tensor's dim) is never
    negative; the same dim is equal to itself."""
    if isinstance(p, int) and isinstance(q, int):
        return p == q
    if isinstance(p, DimRef) and isinstance(q, int) or isinstance(q, DimRef) and isinstance(p, int):
        return False if min(x for x in (p, q) if isinstance(x, int)) < 0 else None
    if isinstance(p, DimRef) and p == q:
        return True
    return None


def _unary(op: str, i: Item, a: SymValue) -> Item:
    if isinstance(i, int):
        return {"Neg": -i, "Abs": abs(i)}.get(op, i)
    return _opaque(SymValue((i,)))


def _binary(op: str, p: int, q: int) -> int:
    if op in _ARITH:
        return int(_ARITH[op](p, q))
    if op == "Div":
        return int(np.trunc(p / q)) if q else 0
    if op == "Mod":
        return int(np.fmod(p, q)) if q else 0
    raise ValueError(op)


def refine_shapes(graph: gs.Graph, syms: dict[str, SymValue], consts: ConstContext) -> bool:
    """Fill output dims that shape inference left unknown but the size inputs of Expand,
    ConstantOfShape and Reshape give (e.g. Expand(0, Shape(W)[0:1]), a zero bias the exporter
    builds at run time), or that a Slice with run-time bounds leaves as they were, and carry
    them on through elementwise ops and Concat (shape inference ran before these were known, or
    gave up where input dims had different symbols). True when a dim was filled."""
    tensors = graph.tensors()
    outputs = {t.name for t in graph.outputs}
    changed = False
    for node in graph.nodes:
        if not node.outputs:
            continue
        interface = node.outputs[0].name in outputs
        if node.op == "Slice":
            new = _slice_dims(node, consts)
        elif node.op in ("Expand", "ConstantOfShape", "Reshape"):
            new = _sized_dims(node, syms, consts, tensors)
        elif node.op == "Concat" and not interface:
            new = _concat_dims(node)
        elif (node.op in _SAME_SHAPE or node.op in _BROADCAST) and not interface:
            new = _elementwise_dims(node)
        else:
            continue
        changed |= _fill(node.outputs[0], new)
    return changed


def _fill(y: gs.Tensor, new: list | None) -> bool:
    """Give `y` the dims `new` (computed only where `y`'s were not static); True if any changed."""
    if new is None or new == list(ir.dims(y) or []):
        return False
    y.shape = new
    return True


def _sized_dims(
    node: gs.Node, syms: dict[str, SymValue], consts: ConstContext, tensors: dict
) -> list | None:
    """Expand, ConstantOfShape, Reshape: the dims their size input names."""
    size_in = node.inputs[0] if node.op == "ConstantOfShape" else ir.present(node, 1)
    if size_in is None:
        return None
    v = consts.value(size_in)
    items = (
        [int(x) for x in v.reshape(-1)]
        if v is not None
        else (list(syms[size_in.name].items) if size_in.name in syms else None)
    )
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
        elif isinstance(it, DimRef) and it.tensor in tensors:
            size = ir.static_dim(tensors[it.tensor], it.axis)
        if node.op == "Expand" and size is not None:  # broadcast with the input's dim
            x = ir.dims(node.inputs[0])
            k = p - (len(new) - len(x)) if x is not None else -1
            xd = x[k] if k >= 0 else 1
            if not isinstance(xd, int):
                size = None if size == 1 else size
            elif size == 1 or xd == size:
                size = xd
            elif xd != 1:
                size = None  # not broadcastable: leave it to shape inference
        elif size == 0 and node.op == "Reshape":
            size = None  # 0 copies the input's dim (or is literal): left as inferred
        if size is not None:
            new[p] = size
    return new


def _slice_dims(node: gs.Node, consts: ConstContext) -> list | None:
    """A Slice keeps the input's dims on the axes it does not slice; shape inference drops them
    all when the bounds are computed at run time."""
    x, y = node.inputs[0], node.outputs[0]
    xd, yd = ir.dims(x), ir.dims(y)
    if xd is None or yd is None or len(xd) != len(yd):
        return None
    if "axes" in node.attrs:
        axes = list(node.attrs["axes"])
    elif "starts" in node.attrs:
        axes = list(range(len(node.attrs["starts"])))
    elif ir.present(node, 3) is not None:
        v = consts.value(node.inputs[3])
        if v is None:
            return None
        axes = [int(a) for a in v.reshape(-1)]
    else:
        n = ir.static_dim(node.inputs[1], 0)
        if n is None:
            return None
        axes = list(range(n))
    sliced = {ir.norm_axis(a, len(xd)) for a in axes}
    return [
        xd[a] if a not in sliced and not isinstance(d, int) and isinstance(xd[a], int) else d
        for a, d in enumerate(yd)
    ]


# Ops whose first output has the shape of their first input, or of their inputs broadcast.
_SAME_SHAPE = {
    *("Identity", "Cast", "CastLike", "Relu", "LeakyRelu", "PRelu", "Sigmoid", "HardSigmoid"),
    *("Tanh", "Erf", "Gelu", "Sqrt", "Reciprocal", "Neg", "Abs", "Exp", "Log", "Not", "Sign"),
    *("Softmax", "LogSoftmax", "Clip", "Dropout", "Elu", "Selu", "Celu", "Softplus", "Mish"),
    *("HardSwish", "Floor", "Ceil", "Round", "IsNaN", "IsInf", "LayerNormalization"),
}
_BROADCAST = {
    *("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Where"),
    *("And", "Or", "Xor", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"),
}


def _elementwise_dims(node: gs.Node) -> list | None:
    """Unknown output dims from the inputs: copied for same-shape ops, broadcast otherwise
    (known when some input has a size > 1, or all share one symbol or 1)."""
    yd = ir.dims(node.outputs[0])
    ins = [node.inputs[0]] if node.op in _SAME_SHAPE else [t for t in node.inputs if t is not None]
    dims = [ir.dims(t) for t in ins]
    if yd is None or any(d is None for d in dims) or any(len(d) > len(yd) for d in dims):
        return None
    new = list(yd)
    for k in range(len(yd)):
        if isinstance(yd[k], int):
            continue
        at = [d[k - len(yd) + len(d)] if k - len(yd) + len(d) >= 0 else 1 for d in dims]
        big = {v for v in at if isinstance(v, int) and v != 1}
        syms = {v for v in at if not isinstance(v, int)}
        if len(big) == 1:  # whatever the unknown sizes, they broadcast to it
            new[k] = big.pop()
        elif not big and not syms:
            new[k] = 1
        elif not big and len(syms) == 1 and None not in syms:
            new[k] = syms.pop()
    return new


def _concat_dims(node: gs.Node) -> list | None:
    """Inputs agree on every axis but the joined one, whose size is their sum."""
    yd = ir.dims(node.outputs[0])
    dims = [ir.dims(t) for t in node.inputs]
    if yd is None or any(d is None or len(d) != len(yd) for d in dims):
        return None
    axis = ir.norm_axis(int(node.attrs.get("axis", 0)), len(yd))
    new = list(yd)
    for k in range(len(yd)):
        if isinstance(yd[k], int):
            continue
        at = [d[k] for d in dims]
        if k == axis:
            if all(isinstance(v, int) for v in at):
                new[k] = sum(at)
            continue
        known = {v for v in at if isinstance(v, int)}
        if len(known) == 1:
            new[k] = known.pop()
        elif not known and len(set(at)) == 1 and at[0] is not None:
            new[k] = at[0]
    return new
