"""Einsum as a matrix product: two operands, an explicit output, each letter either a batch axis
(both operands and the output), a free axis (one operand and the output) or contracted (both
operands, not the output): `bij,bjk->bik`, `bhqd,bhkd->bhqk`, `bsd,df->bsf`, ... These behave
as MatMul with their axes mapped: axes of the same letter keep the same indices; a contracted
index goes where one operand is a constant whose slice no kept output reads, or where an
operand is zero. Any other equation (one operand, a letter summed away from one operand alone,
repeated letters, ellipses) is a barrier. The equation does not depend on sizes: nothing to
rewrite, and no constant is folded into it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    ConstInfo,
    ConstView,
    Handler,
    KeepView,
    OpNode,
    Reason,
    register,
    str_attr,
)
from onnxshrink.ops.common import along
from onnxshrink.ops.oracle import OracleCase, declare_cases, needs, sig, zero_rows

Terms = tuple[str, str, str]


def product_terms(equation: str | bytes) -> Terms | None:
    """(A's letters, B's letters, the output's) of a matrix-product equation, else None."""
    eq = equation.decode() if isinstance(equation, bytes) else equation
    eq = eq.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    ins = lhs.split(",")
    if len(ins) != 2:
        return None
    a, b = ins
    for term in (a, b, out):
        if len(set(term)) != len(term) or not term.isalpha():
            return None
    if any(ch not in a and ch not in b for ch in out):
        return None
    # a letter of one operand only must be in the output (else: a sum over that axis alone)
    if any(ch not in out and ch not in b for ch in a) or any(ch not in out and ch not in a for ch in b):
        return None
    return a, b, out


@register("Einsum", since=12)
class Einsum(Handler):
    evaluate_with_ort = True

    def terms(self, node: gs.Node | OpNode) -> Terms | None:
        if node.attrs.get("equation") is None or len(node.inputs) != 2:
            return None
        return product_terms(str_attr(node, "equation"))

    def macs(self, node: OpNode, inputs: Sequence[list[int] | None], output: list[int]) -> int:
        terms = self.terms(node)
        if terms is None or inputs[0] is None or inputs[1] is None:
            return 0
        sizes: dict[str, int] = {}
        for term, dims in zip(terms[:2], inputs[:2], strict=True):
            for ch, d in zip(term, dims or [], strict=False):
                sizes[ch] = max(sizes.get(ch, 1), int(d))
        return int(np.prod(list(sizes.values()), dtype=np.int64))

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        """An output index is zero where an operand's slice of its letter is constant zero."""
        terms, y = self.terms(node), node.outputs[0]
        r = ir.rank(y)
        if terms is None or r is None:
            return None
        mask = np.zeros((1,) * r, bool)
        for t, term in zip(node.inputs, terms[:2], strict=True):
            c = ctx.const(t)
            if c is None:
                continue
            for a, ch in enumerate(term):
                o, n = terms[2].find(ch), ir.static_dim(t, a)
                if o < 0 or n is None or ir.static_dim(y, o) != n:
                    continue
                zero = c.slice_zero(a, n)
                if zero.any():
                    mask = mask | along(zero, o, r)
        if not mask.any():
            return None
        dtype = y.dtype if y.dtype is not None else np.float32
        return [ConstInfo(mask, np.zeros((1,) * r, np.dtype(dtype)))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        terms, y = self.terms(node), node.outputs[0]
        ops = list(node.inputs)
        if terms is None or any(ir.rank(t) != len(term) for t, term in zip(ops, terms, strict=False)) or ir.rank(y) != len(terms[2]):
            ks.barrier(node, Reason("barrier", node.name, node.op, "not a matrix-product equation"))
            return
        a_term, b_term, out = terms
        for t in ops:
            ks.demand(t, pin=False)
        for t, term in zip(ops, (a_term, b_term), strict=True):
            for a, ch in enumerate(term):
                o = out.find(ch)
                if o < 0:
                    continue
                if ks.size(t, a) == 1 and ks.size(y, o) != 1:
                    ks.pin(t, a)  # broadcast: one index stands for all
                else:
                    ks.couple(t, a, y, o)
        contracted = [ch for ch in a_term if ch in b_term and ch not in out]
        for ch in contracted:
            ka, kb = a_term.index(ch), b_term.index(ch)
            ks.couple(ops[0], ka, ops[1], kb)
            reads = None
            for (t, term), (other, oterm) in (
                ((ops[0], a_term), (ops[1], b_term)),
                ((ops[1], b_term), (ops[0], a_term)),
            ):
                w = ks.value(other)
                if w is None:
                    continue
                reads = self.read(ks, w, oterm, ch, out, y)
                c = ks.const(t)
                n = len(reads)
                silent = c.slice_zero(term.index(ch), n) if c is not None else np.zeros(n, bool)
                ks.need(t, term.index(ch), reads & ~silent)
                break
            if reads is None:
                ks.pin(ops[0], ka, Reason("structure", node.name, node.op, "a contracted axis of two computed operands"))

    @staticmethod
    def read(ks: KeepView, w: np.ndarray, term: str, ch: str, out: str, y: gs.Tensor) -> np.ndarray:
        """Indices of letter `ch` the constant operand `w` reads with a non-zero value at some
        kept output index."""
        nz = w != 0
        for a, letter in enumerate(term):
            o = out.find(letter)
            k = ks.kept(y, o) if o >= 0 else None
            if k is not None and len(k) == nz.shape[a]:
                nz = np.compress(k, nz, axis=a)
        axis = term.index(ch)
        others = tuple(i for i in range(nz.ndim) if i != axis)
        return np.asarray(nz.any(axis=others)) if others else np.asarray(nz)


# ------------------------------------------------------------------ oracle cases
def _einsum_case(op: str, rng: np.random.Generator) -> OracleCase:
    b, i, j, k = (int(v) for v in rng.integers(1, 4, size=4))
    eq = str(rng.choice(["bij,bjk->bik", "bij,jk->bik", "bij,bkj->bik", "bij,bik->bjk"]))
    a_term, b_term, out = eq.replace("->", ",").split(",")
    size = {"b": b, "i": i, "j": j + 1, "k": k + 1}
    shape = {t: [size[ch] for ch in t] for t in (a_term, b_term, out)}
    weight = len(b_term) == 2 or rng.random() < 0.5
    name = "W" if weight else "w"
    ins = [("x", "float", shape[a_term]), (name, "float", shape[b_term])]
    zero = {"W": np.s_[zero_rows(rng, shape[b_term][0])]} if weight else {}
    text = sig(ins, [("y", shape[out])]) + f' {{ y = Einsum <equation = "{eq}"> (x, {name}) }}'
    return OracleCase(op, text, 17, zero=zero, needs=needs(rng, "y", shape[out]))


declare_cases({"Einsum": _einsum_case})
