"""Elementwise ops (activations, arithmetic, comparisons): indices tie across broadcast operands."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import reduce

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Dims,
    Handler,
    Item,
    KeepView,
    OpNode,
    Reader,
    RewriteView,
    ShapeView,
    SymValue,
    WeightAxes,
    broadcast_items,
    compress,
    elementwise_dims,
    items_equal,
    max_item,
    opaque,
    opaque_value,
    product_item,
    register,
    shape_operands,
)
from onnxshrink.ops.common import const_or_live, couple_broadcast, dtype_of
from onnxshrink.ops.oracle import OracleCase, declare_cases, layout_dims, needs, sig, zero_rows


def _from_inputs(t: gs.Tensor, reader: Reader) -> bool:
    """Is `t` computed from a graph input (through any chain of nodes)? A tensor computed from
    initializers alone is a parameter (an alias, a cast), not a branch of the computation."""

    def reach() -> bool:
        stack, seen = [t], {t.name}
        while stack:
            x = stack.pop()
            p = ir.producer(x)
            if p is None:
                if not isinstance(x, gs.Constant):
                    return True  # a graph input
                continue
            for y in p.inputs:
                if y is not None and y.name and y.name not in seen:
                    seen.add(y.name)
                    stack.append(y)
        return False

    memo = getattr(reader, "memo", None)
    return bool(memo(("from inputs", t.name), reach)) if memo is not None else reach()


def _unread(t: gs.Tensor, rw: RewriteView) -> bool:
    """Has `t` lost every index of some axis (an operand only its value is read of)?"""
    return any(rw.kept_count(t, a) == 0 for a in range(len(ir.dims(t) or [])))

UNARY = (
    "Relu",
    "LeakyRelu",
    "Sigmoid",
    "HardSigmoid",
    "HardSwish",
    "Tanh",
    "Gelu",
    "Elu",
    "Selu",
    "Celu",
    "Softplus",
    "Softsign",
    "Mish",
    "ThresholdedRelu",
    "Swish",
    "Identity",
    "Cast",
    "Neg",
    "Abs",
    "Exp",
    "Log",
    "Sqrt",
    "Reciprocal",
    "Erf",
    "Sin",
    "Cos",
    "Tan",
    "Asin",
    "Acos",
    "Atan",
    "Sinh",
    "Cosh",
    "Asinh",
    "Acosh",
    "Atanh",
    "Floor",
    "Ceil",
    "Round",
    "Sign",
    "Not",
    "IsNaN",
    "IsInf",
)
NARY = (
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Max",
    "Min",
    "Sum",
    "Mean",
    "Where",
    "Equal",
    "Greater",
    "Less",
    "GreaterOrEqual",
    "LessOrEqual",
    "And",
    "Or",
    "Xor",
    "Mod",
    "BitShift",
    "PRelu",
    "Clip",
)


COMPARISONS = ("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual")

# Integer arithmetic exporters write on shape values, by op.
_SHAPE_ARITH: dict[str, Callable[[int, int], int]] = {
    "Add": lambda p, q: p + q,
    "Sub": lambda p, q: p - q,
    "Mul": lambda p, q: p * q,
    "Max": max,
    "Min": min,
    "Div": lambda p, q: int(np.trunc(p / q)) if q else 0,
    "Mod": lambda p, q: int(np.fmod(p, q)) if q else 0,
}
_SHAPE_UNARY: dict[str, Callable[[int], int]] = {"Neg": lambda p: -p, "Abs": abs, "Floor": lambda p: p, "Ceil": lambda p: p}
# Ops whose output has the shape of input 0 (the others broadcast their operands).
SAME_SHAPE = {*UNARY, "Clip", "PRelu", "Dropout", "CastLike"}


#: f(±0) is ±0 and f(NaN) is NaN: they keep a value that is 0 or NaN so
_ZERO_NAN_KEEPING = ("Identity", "Floor", "Ceil", "Round", "Neg")


def zero_or_nan(ctx: ConstView, t: gs.Tensor, r: int, depth: int = 0) -> np.ndarray | None:
    """Where `t` is ±0 or NaN whatever the inputs (a mask aligned to rank r; None: nowhere): a
    constant zero; 0 / d for any d (±0, or NaN where d is 0 or NaN: no assumption on d, a run-time
    scale that can underflow to 0 among them); and Floor, Ceil, Round, Neg or a float Cast of
    such a value."""
    m, v = const_or_live(ctx, t, r)
    at = m & (v == 0)
    src = ir.producer(t)
    if src is None or depth >= 8 or (src.domain or "") not in ("", "ai.onnx") or not src.outputs or src.outputs[0] is not t:
        return at if at.any() else None
    x = src.inputs[0] if src.inputs else None
    rx = ir.rank(x) if x is not None else None
    if src.op == "Div" and x is not None and rx is not None and rx <= r:
        mx, vx = const_or_live(ctx, x, r)
        at = at | (mx & (vx == 0))
    elif x is not None and (
        src.op in _ZERO_NAN_KEEPING
        or (src.op == "Cast" and np.issubdtype(dtype_of(t), np.floating) and np.issubdtype(dtype_of(x), np.floating))
    ):
        inner = zero_or_nan(ctx, x, r, depth + 1)
        if inner is not None:
            at = at | inner
    return at if at.any() else None


@register(*[op for op in UNARY if op != "Identity"], *NARY)
class Elementwise(Handler):
    """y[i] depends on each operand at the broadcast position i only."""

    def form_since(self, op: str) -> int:
        return 7 if op == "Add" else 1  # multidirectional broadcasting

    def operands(self, node: gs.Node) -> list[gs.Tensor]:
        return [t for t in node.inputs if t is not None and t.name]

    def moves_values(self, node: OpNode) -> tuple[int, ...]:
        return (0,) if node.op in ("Identity", "Cast") else ()

    def compares(self, node: OpNode) -> bool:
        return node.op in COMPARISONS

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        """Integer arithmetic on shape values (a float result is data: a size used as a number)."""
        op = node.op
        if op in ("Identity", "Cast"):
            vals = shape_operands(node, view, [0])
            return vals[0] if vals else None
        if op in _SHAPE_UNARY:
            vals = shape_operands(node, view, [0])
            if vals is None:
                return None
            a = vals[0]
            f = _SHAPE_UNARY[op]
            return SymValue(tuple(f(i) if isinstance(i, int) else opaque(i) for i in a.items), a.scalar)
        if op == "Where":  # the legacy exporter's expand: Where(Equal(shape, -1), 1, shape)
            vals = shape_operands(node, view, [0, 1, 2])
            if vals is None:
                return None
            cols = broadcast_items(*vals)
            if cols is None:
                return opaque_value(node, view)
            # an element whose condition is known picks its operand; another is opaque
            return SymValue(tuple((p if c else q) if isinstance(c, int) else opaque(c, p, q) for c, p, q in cols))
        if op not in _SHAPE_ARITH and op != "Equal":
            return opaque_value(node, view) if shape_operands(node, view, range(len(node.inputs))) else None
        if op == "Max":  # variadic: the larger size, element by element (`max_item`)
            vals = shape_operands(node, view, range(len(node.inputs)))
            if vals is None:
                return None
            cols = broadcast_items(*vals)
            if cols is None:
                return opaque_value(node, view)
            return SymValue(tuple(reduce(max_item, col) for col in cols), scalar=all(v.scalar for v in vals))
        vals = shape_operands(node, view, [0, 1])
        if vals is None:
            return None
        cols = broadcast_items(*vals)
        if cols is None:
            return opaque_value(node, view)
        out: list[Item] = []
        for p, q in cols:
            if op == "Mul":  # a product of sizes stays one (`product_item`)
                out.append(product_item((p, q)))
            elif op == "Equal":  # element by element: the unknown ones opaque
                known = items_equal(p, q)
                out.append(opaque(p, q) if known is None else int(known))
            elif isinstance(p, int) and isinstance(q, int):
                out.append(int(_SHAPE_ARITH[op](p, q)))
            else:
                out.append(opaque(p, q))
        return SymValue(tuple(out), scalar=vals[0].scalar and vals[1].scalar)

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        return elementwise_dims(node, same_shape=node.op in SAME_SHAPE)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        y = node.outputs[0]
        r = ir.rank(y)
        if node.op == "Cast" and r is not None:
            return self.cast_constants(node, ctx, r)
        return self.computed_constants(node, ctx)

    def cast_constants(self, node: gs.Node, ctx: ConstView, r: int) -> list[ConstInfo | None] | None:
        """A Cast from floating point to an integer type is 0 wherever its input is 0 or NaN
        (`zero_or_nan`): ONNX leaves the cast of a value out of the type's range, NaN among them,
        undefined, so 0 is the cast wherever it is defined (quantize_dynamic's old form rounds
        its bias into the accumulator as Cast(Floor(bias / scale)), and a zeroed bias over a
        scale of 0 is NaN there)."""
        found = self.computed_constants(node, ctx)
        x, to = node.inputs[0], node.attrs.get("to")
        if to is None or not np.issubdtype(dtype_of(x), np.floating):
            return found
        target = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(to)))
        if not np.issubdtype(target, np.integer):
            return found
        zero = zero_or_nan(ctx, x, r)
        if zero is None:
            return found
        mask, value = np.zeros((1,) * r, bool), np.zeros((1,) * r, target)
        if found and found[0] is not None:
            mask, value = found[0].mask, found[0].value
            mask = mask.reshape((1,) * (r - mask.ndim) + mask.shape)
            value = value.reshape((1,) * (r - value.ndim) + value.shape)
        mask, value, zero = np.broadcast_arrays(mask, value, zero)
        return [compress(np.array(mask | zero), np.where(zero, 0, value).astype(target))]

    def computed_constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """The elements every operand holds constant (for a product, also where one operand is
        an exact zero), evaluated."""
        y = node.outputs[0]
        r = ir.rank(y)
        ops = self.operands(node)
        if (
            r is None
            or any(ir.rank(t) is None for t in ops)
            or all(ctx.const(t) is None for t in ops)
        ):
            return None
        pairs = [const_or_live(ctx, t, r) for t in ops]
        mask = np.logical_and.reduce(np.broadcast_arrays(*[m for m, _ in pairs]))
        if node.op in ("Mul", "And"):
            # A product with an exact zero is zero whatever the other operand (finite inputs).
            for m, v in pairs:
                mask = mask | (m & (v == 0))
        if not mask.any():
            return None
        values = [v for _, v in pairs]
        full: list[np.ndarray | None] = [None] * len(node.inputs)
        k = 0
        for i, t in enumerate(node.inputs):
            if t is not None and t.name:
                full[i] = values[k]
                k += 1
        out = ctx.evaluate(node, full)[0]
        mask, out = np.broadcast_arrays(mask, out)
        return [compress(np.array(mask), np.array(out))]

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        """A vector operand of Add/Mul/PRelu: one value per channel of the last axis."""
        if rank == 1 and node.op in ("Add", "Mul", "Sub", "Div", "PRelu"):
            return WeightAxes(0, None, "vector")
        return None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        """F.linear's bias Add after a MatMul, an RMSNorm's scale Mul: the one constant operand."""
        name = {"Add": "bias", "Mul": "weight", "PRelu": "weight"}.get(node.op)
        consts = [i for i, c in enumerate(constant) if c]
        return {name: consts[0]} if name and len(consts) == 1 else {}

    def passes_axes(self, node: OpNode, i: int, rank: int) -> list[int] | None:
        return list(range(rank)) if node.op in ("Identity", "Cast") and i == 0 else None

    def multiplies(self, node: OpNode) -> bool:
        return node.op == "Mul"

    def adds(self, node: OpNode) -> bool:
        return node.op == "Add"

    def absorb_addend(self, node: gs.Node, i: int, values: np.ndarray, rw: RewriteView) -> bool:
        """Add(y, C): a constant added to y goes into C."""
        other = [k for k, t in enumerate(node.inputs) if k != i]
        if node.op != "Add" or len(other) != 1 or not isinstance(node.inputs[other[0]], gs.Constant):
            return False
        c = np.asarray(node.inputs[other[0]].values)
        merged = c.astype(np.float64) + values.astype(np.float64)
        if merged.ndim > max(ir.rank(node.outputs[0]) or 0, c.ndim):
            return False
        rw.replace_input(node, other[0], merged.astype(c.dtype))
        return True

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        y = node.outputs[0]
        ops = self.operands(node)
        drop = self.constant_operand(node, ks)
        for t in ops:
            ks.demand(t, pin=False)
            if drop is None or t is not node.inputs[drop]:
                couple_broadcast(ks, node, y, t, combine=len(ops) > 1)
        for extra in node.outputs[1:]:  # Dropout's mask
            couple_broadcast(ks, node, extra, y)

    def constant_operand(self, node: gs.Node, reader: Reader) -> int | None:
        """An operand of an Add (or the subtrahend of a Sub) computed from live values, yet zero
        for every input: a residual branch whose writes are zeroed (the output projections of a
        transformer block). The node adds nothing: it goes, and what computes the operand is
        unread. Its index, when the other operand alone has the output's shape. (A non-zero
        constant stays computed: stored, it could hold more than what computes it; and a zero
        computed from constants alone, a bias the exporter aliased, is a parameter: it stays,
        as an initializer would.)"""
        if node.op not in ("Add", "Sub") or len(node.inputs) != 2:
            return None
        yd = ir.dims(node.outputs[0])
        if yd is None or any(d is None for d in yd):
            return None
        for i in (0, 1) if node.op == "Add" else (1,):
            t, other = node.inputs[i], node.inputs[1 - i]
            c, co = reader.const(t), reader.const(other)
            td = ir.dims(t)
            if (
                isinstance(t, gs.Constant)
                or c is None
                or not c.full
                or c.value.any()
                or (co is not None and co.full)
                or not _from_inputs(t, reader)
                or ir.dims(other) != yd
                or td is None
                or not any(isinstance(v, int) and v > 0 for v in td)  # else it cannot go
            ):
                continue
            return i
        return None

    def may_drop_inputs(self, node: gs.Node) -> tuple[int, ...]:
        # Only a constant operand (`constant_operand`) is not tied to the output, so only it can
        # be left with no index (the others share the live output's).
        return {"Add": (0, 1), "Sub": (1,)}.get(node.op, ())

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        for i in self.may_drop_inputs(node):
            t = node.inputs[i] if i < len(node.inputs) else None
            if t is None or isinstance(t, gs.Constant) or not _unread(t, rw):
                continue
            c = rw.const(t)
            assert c is not None and c.full and not c.value.any(), "constant_operand chose it"
            rw.bypass(node, 1 - i)  # adds nothing: the node is its other operand
            return


@register("Dropout")
class Dropout(Elementwise):
    """Inference-mode Dropout is the identity; ratio and training_mode are parameters."""

    deterministic = False  # training_mode may be set: never folded

    def operands(self, node: gs.Node) -> list[gs.Tensor]:
        return node.inputs[:1]

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        c = ctx.const(node.inputs[0])
        return [c] if c is not None else None

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        super().keep(node, ks)
        for t in node.inputs[1:]:
            ks.demand(t)


@register("CastLike")
class CastLike(Dropout):
    """The second input only donates its dtype: its indices are not read."""

    deterministic = True

    def shape_value(self, node: gs.Node, view: ShapeView) -> SymValue | None:
        vals = shape_operands(node, view, [0])
        return vals[0] if vals else None

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        Elementwise.keep(self, node, ks)
        ks.demand(node.inputs[1], pin=False)

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        c = ctx.const(node.inputs[0])
        if c is None:
            return None
        return [ConstInfo(c.mask, c.value.astype(dtype_of(node.inputs[1])))]


@register("Identity")
class Identity(Elementwise):
    is_alias = True


# ------------------------------------------------------------------ oracle cases
_UNARY_CASES = (
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Celu", "Cos", "Cosh",
    "Elu", "Erf", "Exp", "Floor", "HardSigmoid", "HardSwish", "IsInf", "IsNaN", "LeakyRelu",
    "Log", "Mish", "Neg", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin",
    "Sinh", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu", "Identity",
)  # fmt: skip
_BINARY_CASES = (
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Equal", "Greater", "Less",
    "GreaterOrEqual", "LessOrEqual",
)  # fmt: skip
_COMPARES = ("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual")


def _unary_case(op: str, rng: np.random.Generator) -> OracleCase:
    c, h, w = int(rng.integers(2, 6)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    x = [1, c, h, w]
    out_t = "bool" if op in ("IsInf", "IsNaN") else "float"
    attrs = {"Celu": " <alpha = 1.5>", "ThresholdedRelu": " <alpha = 0.7>"}.get(op, "")
    text = sig([("x", "float", x)], [("y", x)], out_t)
    opset = 18 if op == "Mish" else 17
    return OracleCase(op, text + f" {{ y = {op}{attrs} (x) }}", opset, needs=needs(rng, "y", x))


def _binary_case(op: str, rng: np.random.Generator) -> OracleCase:
    c, h, w = int(rng.integers(2, 5)), int(rng.integers(1, 4)), int(rng.integers(2, 4))
    x = [1, c, h, w]
    other = [[1, c, h, w], [1, c, 1, 1], [c, 1, 1], [1, 1, h, w], [w]][int(rng.integers(0, 5))]
    weight = rng.random() < 0.4  # the second operand a constant (a bias, a scale)
    b = "B" if weight else "b"
    ins = [("x", "float", x)] + ([] if weight else [("b", "float", other)])
    if weight:
        ins.append(("B", "float", other))
    text = sig(ins, [("y", x)], "bool" if op in _COMPARES else "float")
    zero = {"B": np.s_[..., 0]} if weight and rng.random() < 0.5 else {}
    return OracleCase(op, text + f" {{ y = {op} (x, {b}) }}", 17, zero=zero, needs=needs(rng, "y", x))


def _prelu_case(op: str, rng: np.random.Generator) -> OracleCase:
    c = int(rng.integers(2, 6))
    x = [1, c, 2, 3]
    text = sig([("x", "float", x), ("S", "float", [c, 1, 1])], [("y", x)])
    return OracleCase(op, text + " { y = PRelu (x, S) }", 17, zero={"S": np.s_[zero_rows(rng, c)]},
                      needs=needs(rng, "y", x))


def _mod_case(op: str, rng: np.random.Generator) -> OracleCase:
    x = [1, int(rng.integers(2, 5)), 3]
    text = sig([("x", "float", x), ("b", "float", x)], [("y", x)])
    return OracleCase(op, text + " { y = Mod <fmod = 1> (x, b) }", 17, needs=needs(rng, "y", x))


def _where_case(op: str, rng: np.random.Generator) -> OracleCase:
    x = [1, int(rng.integers(2, 5)), 3]
    text = sig([("c", "bool", x), ("a", "float", x), ("b", "float", [x[1], 1])], [("y", x)])
    return OracleCase(op, text + " { y = Where (c, a, b) }", 17, needs=needs(rng, "y", x))


def _clip_case(op: str, rng: np.random.Generator) -> OracleCase:
    x = [1, int(rng.integers(2, 5)), 3]
    text = sig([("x", "float", x), ("Lo", "float", []), ("Hi", "float", [])], [("y", x)])
    return OracleCase(op, text + " { y = Clip (x, Lo, Hi) }", 17, values={"Lo": -0.5, "Hi": 0.7},
                      needs=needs(rng, "y", x))


def _same_shape_case(op: str, rng: np.random.Generator) -> OracleCase:
    """Cast, CastLike, Dropout, Gelu: y of x's shape."""
    c, h, w = layout_dims(rng)
    x = [1, c, h, w]
    ins = [("x", "float", x)]
    if op == "CastLike":
        ins.append(("L", "float", [1]))
    body = {"Cast": "Cast <to = 1> (x)", "CastLike": "CastLike (x, L)"}.get(op, f"{op} (x)")
    return OracleCase(op, sig(ins, [("y", x)]) + f" {{ y = {body} }}", 20 if op == "Gelu" else 17,
                      needs=needs(rng, "y", x))


declare_cases(
    {
        **dict.fromkeys(_UNARY_CASES, _unary_case),
        **dict.fromkeys(_BINARY_CASES, _binary_case),
        **dict.fromkeys(("Cast", "CastLike", "Dropout", "Gelu"), _same_shape_case),
        "PRelu": _prelu_case, "Mod": _mod_case, "Where": _where_case, "Clip": _clip_case,
    },
    excluded={
        "And": "boolean data only", "Or": "boolean data only", "Xor": "boolean data only",
        "Not": "boolean data only", "BitShift": "integer data only",
        "Swish": "onnxruntime here has no kernel for it (opset 24)",
    },
)  # fmt: skip
