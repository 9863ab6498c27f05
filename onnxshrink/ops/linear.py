"""Gemm and MatMul: features through a (usually constant) weight matrix, constants folded.

Output feature n reads input feature k when the weight W[k, n] is non-zero. A removed input
feature is either unread by every kept output or constant; a constant one adds
`value * W[k, :]` to the output, which goes into the bias (Gemm's C, the Add that follows a
MatMul, or a new Add).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from onnxshrink import ir
from onnxshrink.core import (
    BiasSlot,
    ConstInfo,
    ConstView,
    Dims,
    Handler,
    IntegerProduct,
    KeepView,
    OpNode,
    RewriteView,
    ShapeView,
    WeightAxes,
    compress,
    float_attr,
    int_attr,
    register,
)
from onnxshrink.ops.common import const_or_live, couple_broadcast
from onnxshrink.ops.oracle import OracleCase, declare_cases, needs, sig, zero_rows


def _live_product(live_a: np.ndarray, nz: np.ndarray) -> np.ndarray:
    """(live rows of A) x (non-zero pattern of B) > 0, as bools, with numpy broadcasting."""
    k = max(live_a.shape[-1], nz.shape[-2])
    live_a = np.broadcast_to(live_a, live_a.shape[:-1] + (k,))
    nz = np.broadcast_to(nz, nz.shape[:-2] + (k, nz.shape[-1]))
    return np.matmul(live_a.astype(np.float32), nz.astype(np.float32)) > 0


def _const_through(live_a: np.ndarray, w: np.ndarray | ConstInfo) -> np.ndarray:
    """Output elements of A @ W (W a constant [K, N] matrix: an array, or a whole constant's
    ConstInfo, read through its pattern) that no live element of A reaches:
    `~_live_product(live_a, W != 0)`, from W's non-zero pattern (one memoized pass over W) when
    it is exact, else from W itself."""
    m = _matrix(w)
    p = m.matrix_pattern()
    if not p.exact:
        return ~_live_product(live_a, m.value != 0)
    k, n = m.matrix_shape
    live = np.broadcast_to(live_a, live_a.shape[:-1] + (k,))
    reached = p.reached(live.reshape(-1, k)).reshape(live.shape[:-1] + (n,))
    return ~reached


def _rows_read(w: np.ndarray | ConstInfo, cols: np.ndarray | None) -> np.ndarray:
    """Rows of a [K, N] matrix W holding a non-zero in a kept column (`cols`, None: all)."""
    m = _matrix(w)
    p = m.matrix_pattern()
    if p.exact:
        return p.rows_reading(np.ones(m.matrix_shape[1], bool) if cols is None else cols)
    nz = m.value != 0
    return np.asarray(nz[:, cols].any(axis=1) if cols is not None else nz.any(axis=1))


def _times_rows(a: np.ndarray, w: np.ndarray | ConstInfo) -> np.ndarray:
    """a @ w in float64 (a: [..., K], w: [K, N]), reading only the rows of w that a non-zero
    element of a multiplies: the constant part of a product with a large weight costs the rows
    it uses, not a pass over (or a float64 copy of) the whole weight."""
    used = np.asarray(a != 0).reshape(-1, a.shape[-1]).any(axis=0)
    rows = _matrix(w).matrix_rows(np.asarray(used))
    return np.matmul(a[..., used].astype(np.float64), np.asarray(rows, dtype=np.float64))


def _matrix(w: np.ndarray | ConstInfo) -> ConstInfo:
    return w if isinstance(w, ConstInfo) else ConstInfo.of_array(w)


def _weight(view: ConstView | KeepView | RewriteView, t: gs.Tensor, rank: int) -> ConstInfo | None:
    """B as a whole constant matrix (an initializer): the helpers above read its pattern and
    the rows they use, not its whole values (a prune's zeroed weight is then never made)."""
    c = view.const(t)
    return c if rank == 2 and c is not None and c.whole and c.full and len(c.matrix_shape) == 2 else None


def _full_k(m: np.ndarray, v: np.ndarray, k: int, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Mask and value (live elements zeroed) broadcast to size k along the contracted axis."""
    shape = list(np.broadcast_shapes(m.shape, v.shape))
    shape[axis] = k
    m = np.broadcast_to(m, shape)
    return m, np.where(m, np.broadcast_to(v, shape), np.zeros((), v.dtype))


def absorbable(ks: KeepView, a: gs.Tensor, k_axis: int, reads: np.ndarray) -> np.ndarray:
    """Constant input features of A (along `k_axis`) a product with constant weights absorbs:
    one uniform over A's other axes adds one row of constants (a bias); one that varies adds a
    constant of A's other sizes per output feature, taken only when that is no larger than
    the weight rows their removal takes out (static shapes only): the rows of the varying
    features the kept outputs read (`reads`), the others going without a fold."""
    k = len(reads)
    c = ks.const(a)
    if c is None:
        return np.zeros(k, dtype=bool)
    uniform = c.slice_uniform(k_axis, k)
    varying = c.slice_constant(k_axis, k) & ~uniform
    dims = ir.dims(a)
    if varying.any() and dims is not None:
        rows = [d for i, d in enumerate(dims) if i != k_axis]
        sizes = [d for d in rows if isinstance(d, int)]
        if len(sizes) == len(rows) and int(np.prod(sizes)) <= int((varying & reads).sum()):
            uniform = uniform | varying
    return uniform


def _all_kept(ks: KeepView, t: gs.Tensor, axis: int) -> bool:
    """Is every index of the axis kept already (or the axis not prunable)? Then what a weight
    says about it adds nothing, and the pass over the weight is skipped."""
    k = ks.kept(t, axis)
    return k is None or bool(k.all())


def fold_into_c(rw: RewriteView, node: gs.Node, delta: np.ndarray, n_channels: int) -> None:
    """Gemm's C absorbs a removed constant input feature's contribution."""
    if not np.any(delta):
        return
    beta = float(node.attrs.get("beta", 1.0))
    c = ir.present(node, 2)
    dtype = np.asarray(rw.value(node.inputs[1])).dtype
    if c is not None and not isinstance(c, gs.Constant) and beta != 0.0:  # computed at run time
        rw.add_constant(node, 0, delta.astype(dtype), n_channels)
        return
    if c is None or beta == 0.0:
        new = delta
        node.attrs["beta"] = 1.0
    else:
        new = np.asarray(c.values, dtype=np.float64) + delta / beta
        dtype = c.values.dtype
    if new.ndim == 2 and new.shape[0] == 1 and (c is None or c.values.ndim < 2):
        new = new.reshape(-1)
    rw.replace_input(node, 2, new.astype(dtype))
    rw.record_fold(node, n_channels, "bias")



@register("Gemm")
class Gemm(Handler):
    evaluate_with_ort = True
    channel_bias = BiasSlot(axis=1, bias=2, bias_layout=(1, 2), gain=("alpha", "beta"))  # C: [N] or [1, N]

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        if i == 1 and rank == 2:  # B is [K, N], or [N, K] with transB: torch's [out, in]
            trans = int_attr(node, "transB", 0)
            return WeightAxes(0, 1, "linear") if trans else WeightAxes(1, 0, "linear")
        if i == 0 and rank == 2:  # a constant A: W @ x, [out, in] (transposed with transA)
            trans = int_attr(node, "transA", 0)
            return WeightAxes(1, 0, "linear") if trans else WeightAxes(0, 1, "linear")
        return WeightAxes(rank - 1, None, "vector") if i == 2 and rank >= 1 else None

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        return {"weight": 1, "bias": 2}

    def qdq_form(self, node: OpNode) -> IntegerProduct:
        trans_a, trans_b = bool(node.attrs.get("transA", 0)), bool(node.attrs.get("transB", 0))
        alpha, beta = float_attr(node, "alpha", 1.0), float_attr(node, "beta", 1.0)
        return IntegerProduct(None, 0 if trans_b else 1, 2, trans_a, trans_b, alpha, beta)

    def macs(self, node: OpNode, inputs: Sequence[list[int] | None], output: list[int]) -> int:
        a = inputs[0]
        if a is None:
            return 0
        k = a[0] if int_attr(node, "transA", 0) else a[-1]
        return int(np.prod(output)) * int(k)

    def axes(self, node: gs.Node) -> tuple[int, int, int, int]:
        """(A's M axis, A's K axis, B's K axis, B's N axis)."""
        a = (1, 0) if int(node.attrs.get("transA", 0)) else (0, 1)
        b = (1, 0) if int(node.attrs.get("transB", 0)) else (0, 1)
        return a + b

    def oriented(self, node: gs.Node, b: np.ndarray) -> np.ndarray:
        return b.T if int(node.attrs.get("transB", 0)) else b

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        a_t, b_t, c_t = node.inputs[0], node.inputs[1], ir.present(node, 2)
        b = ctx.value(b_t)
        if b is None:
            return None
        b = self.oriented(node, b)
        am, av = const_or_live(ctx, a_t, 2)
        if int(node.attrs.get("transA", 0)):
            am, av = am.T, av.T
        const = _const_through(~am, b)
        if not const.any():
            return None
        alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
        _, av = _full_k(am, av, b.shape[0], 1)
        y = alpha * _times_rows(av, b)
        c = ctx.value(c_t) if c_t is not None else None
        if c is not None:
            y = y + beta * c.astype(np.float64)
        const, y = np.broadcast_arrays(const, y.astype(b.dtype))
        return [compress(np.array(const), np.array(y))]

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        a_t, b_t, c_t, y = node.inputs[0], node.inputs[1], ir.present(node, 2), node.outputs[0]
        a_m, a_k, b_k, b_n = self.axes(node)
        for t in (a_t, b_t, c_t):
            ks.demand(t, pin=False)
        ks.couple(a_t, a_m, y, 0)
        ks.couple(b_t, b_n, y, 1)
        ks.couple(a_t, a_k, b_t, b_k)
        if c_t is not None:
            couple_broadcast(ks, node, y, c_t)
        b = ks.value(b_t)
        if b is not None:
            if _all_kept(ks, a_t, a_k):
                return
            reads = _rows_read(self.oriented(node, b), ks.kept(y, 1))
            absorb = absorbable(ks, a_t, a_k, reads)
            ks.need(a_t, a_k, reads & ~absorb)
        else:
            ks.pin(a_t, a_k)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        a_t, b_t, y = node.inputs[0], node.inputs[1], node.outputs[0]
        a_m, a_k, _, _ = self.axes(node)
        b0 = rw.original(b_t)
        ca = rw.const(a_t)
        if b0 is None or ca is None:
            return
        b0 = self.oriented(node, b0)
        ka = rw.kept(a_t, a_k)
        if ka is None or ka.all():  # a dynamic K (A is e.g. a constant of a dynamic size) keeps all
            return
        # An output axis declared dynamic has no kept set: keep() pinned B's columns with it.
        ky = rw.kept(y, 1)
        ky = np.ones(b0.shape[1], bool) if ky is None else ky
        removed = ~ka & _rows_read(b0, ky)
        rw.check_removed_constant(node, ca, a_k, removed)
        if not removed.any():
            return
        am, av = ca.mask, ca.value
        if a_k == 0:
            am, av = am.T, av.T
        a_c = np.where(removed[None, :] & am, av, 0).astype(np.float64)
        alpha = float(node.attrs.get("alpha", 1.0))
        # [1 or M, N], then at Y's kept rows too (a constant A, W @ x, loses rows of W)
        delta = rw.kept_part(y, alpha * _times_rows(a_c, b0))
        fold_into_c(rw, node, delta, int(removed.sum()))


@register("MatMul")
class MatMul(Handler):
    evaluate_with_ort = True
    channel_bias = BiasSlot(axis=-1, weight_rank=2)  # a batched weight: no per-channel bias

    def weight_axes(self, node: OpNode, i: int, rank: int) -> WeightAxes | None:
        if rank < 2 or i not in (0, 1):
            return None
        if i == 1:  # B is [.., K, N]: in, out
            return WeightAxes(rank - 1, rank - 2, "linear")
        return WeightAxes(rank - 2, rank - 1, "linear")  # a constant A: W @ x

    def param_inputs(self, node: OpNode, constant: Sequence[bool]) -> Mapping[str, int]:
        return {"weight": 1}

    def qdq_form(self, node: OpNode) -> IntegerProduct:
        return IntegerProduct(None, out_axis=1)

    def macs(self, node: OpNode, inputs: Sequence[list[int] | None], output: list[int]) -> int:
        a = inputs[0]
        return int(np.prod(output)) * int(a[-1]) if a else 0

    def constants(self, node: gs.Node, ctx: ConstView) -> list[ConstInfo | None] | None:
        a_t, b_t = node.inputs[0], node.inputs[1]
        roles = self.roles(node)
        if roles is None:
            return None
        ra, rb, ry, _, _ = roles
        if ctx.const(a_t) is None and ctx.const(b_t) is None:
            return None
        am, av = const_or_live(ctx, a_t, max(ra, 2))
        bw = _weight(ctx, b_t, rb)  # a weight: read through its pattern and used rows
        bm, bv = (np.ones((1, 1), bool), None) if bw is not None else const_or_live(ctx, b_t, max(rb, 2))
        if ra == 1:
            am, av = am.reshape(1, -1), av.reshape(1, -1)
        if rb == 1 and bv is not None:
            bm, bv = bm.reshape(-1, 1), bv.reshape(-1, 1)
        b_full, a_full = bw if bw is not None else ctx.value(b_t), ctx.value(a_t)
        b2 = bw if bw is not None else bv  # B as the matrix helpers read it
        if b_full is not None and rb == 2:
            assert b2 is not None
            const = _const_through(~am, b2)
        elif b_full is not None:
            const = ~_live_product(~am, np.asarray(bv != 0))
        elif a_full is not None:
            const = ~_live_product(av != 0, ~bm)
        else:
            const = np.asarray(am.all(axis=-1, keepdims=True) & bm.all(axis=-2, keepdims=True))
            # A row or column that is constant zero makes its products zero whatever the other
            # side (e.g. a head whose V projection is masked: probs @ 0).
            const = (
                const
                | (am & (av == 0)).all(axis=-1, keepdims=True)
                | (bm & (bv == 0)).all(axis=-2, keepdims=True)
            )
        if not const.any():
            return None
        # The contracted size is the tensors' (the constants may be compressed along it: a value
        # uniform over K stands for K equal terms of the sum).
        assert b2 is not None
        b_rows = _matrix(b2).matrix_shape[-2] if rb >= 2 else len(np.asarray(b2).reshape(-1))
        packed = max(am.shape[-1], bm.shape[-2], av.shape[-1], b_rows)
        k = ir.static_dim(a_t, -1) or ir.static_dim(b_t, -2 if rb >= 2 else -1) or packed
        _, av = _full_k(am, av, k, -1)
        if b_full is not None and rb == 2 and b_rows == k:  # a weight: only the rows used
            out = _times_rows(av, b2).astype(np.result_type(av, _matrix(b2).matrix_dtype))
        else:
            _, bv0 = _full_k(bm, bv if bv is not None else _matrix(b2).value, k, -2)
            out = np.matmul(av, bv0)
        const, out = np.broadcast_arrays(const, out)
        const, out = np.array(const), np.array(out)
        if k == 1 and packed == 1 and ir.static_dim(a_t, -1) is None:
            const &= out == 0  # a sum of a dynamic number of equal terms: known when they are 0
        if ra == 1:
            const, out = const[..., 0, :], out[..., 0, :]
        if rb == 1:
            const, out = const[..., 0], out[..., 0]
        if const.ndim != ry:
            return None
        return [compress(const, out)]

    def refine_dims(self, node: gs.Node, consts: ConstView, view: ShapeView) -> Dims | None:
        """Y's M and N from A's rows and B's columns, its batch dims broadcast from theirs (the
        batched MatMuls of an einsum lowering, whose operands' dims only the shape values tell)."""
        a, b, yd = ir.dims(node.inputs[0]), ir.dims(node.inputs[1]), ir.dims(node.outputs[0])
        if a is None or b is None or yd is None or len(a) < 2 or len(b) < 2 or len(yd) != max(len(a), len(b)):
            return None
        new = list(yd)
        for k, d in ((len(yd) - 2, a[-2]), (len(yd) - 1, b[-1])):
            if not isinstance(new[k], int) and d is not None:
                new[k] = d
        for k in range(len(yd) - 2):
            if isinstance(new[k], int):
                continue
            at = [t[k - len(yd) + len(t)] if k - len(yd) + len(t) >= 0 else 1 for t in (a, b)]
            big = {v for v in at if isinstance(v, int) and v != 1}
            if len(big) == 1:  # whatever the other is, they broadcast to it
                new[k] = big.pop()
            elif all(v == 1 for v in at):
                new[k] = 1
            elif at[0] == at[1] and isinstance(at[0], str):
                new[k] = at[0]
        return new

    def roles(self, node: gs.Node) -> tuple[int, int, int, int | None, int | None] | None:
        """(rank A, rank B, rank Y, Y's M axis, Y's N axis)."""
        ra, rb, ry = ir.rank(node.inputs[0]), ir.rank(node.inputs[1]), ir.rank(node.outputs[0])
        if ra is None or rb is None or ry is None or ra < 1 or rb < 1:
            return None
        y_m = (ry - 2 if rb >= 2 else ry - 1) if ra >= 2 else None
        y_n = ry - 1 if rb >= 2 else None
        return ra, rb, ry, y_m, y_n

    def keep(self, node: gs.Node, ks: KeepView) -> None:
        a_t, b_t, y = node.inputs[0], node.inputs[1], node.outputs[0]
        roles = self.roles(node)
        if roles is None:
            ks.barrier(node)
            return
        ra, rb, ry, y_m, y_n = roles
        ks.demand(a_t, pin=False)
        ks.demand(b_t, pin=False)
        nb = ry - (y_m is not None) - (y_n is not None)  # broadcast batch axes of Y
        for t, r, mats in ((a_t, ra, 2), (b_t, rb, 2)):
            for j in range(r - mats):  # batch axes of the operand, right-aligned to Y's batch axes
                ya = nb - (r - mats) + j
                if ks.size(t, j) == 1 and ks.size(y, ya) != 1:
                    ks.pin(t, j)
                else:
                    ks.couple(t, j, y, ya)
        if y_m is not None:
            ks.couple(a_t, ra - 2, y, y_m)
        if y_n is not None:
            ks.couple(b_t, rb - 1, y, y_n)
        b_k = rb - 2 if rb >= 2 else 0
        ks.couple(a_t, ra - 1, b_t, b_k)
        bw = _weight(ks, b_t, rb)
        b = bw if bw is not None else ks.value(b_t)
        a = ks.value(a_t)
        if b is not None:
            if _all_kept(ks, a_t, ra - 1):
                return
            kn = ks.kept(y, y_n) if y_n is not None else None
            if rb == 2:
                reads = _rows_read(b, kn)
            else:
                assert isinstance(b, np.ndarray)
                nz = self._nz_b(b, rb)
                reads = np.asarray(nz[:, kn].any(axis=1) if kn is not None else nz.any(axis=1))
            absorb = np.zeros(len(reads), dtype=bool)
            if rb == 2:
                absorb = absorbable(ks, a_t, ra - 1, reads)
            ks.need(a_t, ra - 1, reads & ~absorb)
        elif a is not None:
            nz = self._nz_a(a, ra)
            km = ks.kept(y, y_m) if y_m is not None else None
            read_by_a = nz[km].any(axis=0) if km is not None else nz.any(axis=0)
            ks.need(b_t, b_k, read_by_a)
        else:
            ks.pin(a_t, ra - 1)

    @staticmethod
    def _nz_b(b: np.ndarray, rb: int) -> np.ndarray:
        """[K, N] non-zero pattern of B (any over batch axes)."""
        if rb == 1:
            return (b != 0).reshape(-1, 1)
        nz = b != 0
        return nz.reshape(-1, *nz.shape[-2:]).any(axis=0)

    @staticmethod
    def _nz_a(a: np.ndarray, ra: int) -> np.ndarray:
        if ra == 1:
            return (a != 0).reshape(1, -1)
        nz = a != 0
        return nz.reshape(-1, *nz.shape[-2:]).any(axis=0)

    def rewrite(self, node: gs.Node, rw: RewriteView) -> None:
        a_t, b_t, y = node.inputs[0], node.inputs[1], node.outputs[0]
        roles = self.roles(node)
        ca = rw.const(a_t)
        if roles is None or ca is None:
            return
        ra, rb, ry, y_m, y_n = roles
        bw = _weight(rw, b_t, rb)
        b0 = bw if bw is not None else rw.original(b_t)
        if b0 is None:
            return
        kn = rw.kept(y, y_n) if y_n is not None else None
        cols = kn if kn is not None else slice(None)
        ka = rw.kept(a_t, ra - 1)
        if ka is None or ka.all():
            return
        if rb == 2:
            removed = ~ka & _rows_read(b0, kn)
        else:
            assert isinstance(b0, np.ndarray)
            nz = self._nz_b(b0, rb)
            removed = ~ka & nz[:, cols].reshape(len(ka), -1).any(axis=1)
        rw.check_removed_constant(node, ca, ra - 1, removed)
        if not removed.any():
            return
        am, av = const_or_live(rw, a_t, ra)
        a_c = np.where(am & removed.reshape((1,) * (ra - 1) + (-1,)), av, 0).astype(np.float64)
        if rb == 2:
            delta = _times_rows(a_c, b0)
        else:
            assert isinstance(b0, np.ndarray)
            bsel = b0.reshape(len(ka), -1) if rb == 1 else b0
            delta = np.matmul(a_c, bsel.astype(np.float64))
        if rb == 1:
            delta = delta[..., 0]
        # Y's kept indices on every axis: its columns, and the rows and batch indices A's other
        # axes lose (a constant A, W @ x, loses rows of W)
        delta = rw.kept_part(y, delta)
        rw.add_constant(node, 0, delta.astype(_matrix(b0).matrix_dtype), int(removed.sum()))


# ------------------------------------------------------------------ oracle cases
def _gemm_case(op: str, rng: np.random.Generator) -> OracleCase:
    m, k, n = int(rng.integers(1, 4)), int(rng.integers(2, 6)), int(rng.integers(2, 6))
    ta, tb = int(rng.integers(0, 2)), int(rng.integers(0, 2))
    a = [k, m] if ta else [m, k]
    b = [n, k] if tb else [k, n]
    text = sig([("a", "float", a), ("B", "float", b), ("C", "float", [n])], [("y", [m, n])])
    zero = {"B": np.s_[zero_rows(rng, b[0])]}
    return OracleCase(op, text + f" {{ y = Gemm <transA = {ta}, transB = {tb}> (a, B, C) }}", 17,
                      zero=zero, needs=needs(rng, "y", [m, n]))


def _matmul_case(op: str, rng: np.random.Generator) -> OracleCase:
    s, k, n = int(rng.integers(1, 4)), int(rng.integers(2, 6)), int(rng.integers(2, 5))
    lead = [1, 2] if rng.random() < 0.5 else [1]
    a = [*lead, s, k]
    if rng.random() < 0.6:
        text = sig([("a", "float", a), ("B", "float", [k, n])], [("y", [*lead, s, n])])
        return OracleCase(op, text + " { y = MatMul (a, B) }", 17, zero={"B": np.s_[zero_rows(rng, k)]},
                          needs=needs(rng, "y", [*lead, s, n]))
    text = sig([("a", "float", a), ("b", "float", [*lead, k, n])], [("y", [*lead, s, n])])
    return OracleCase(op, text + " { y = MatMul (a, b) }", 17, needs=needs(rng, "y", [*lead, s, n]))


declare_cases({"Gemm": _gemm_case, "MatMul": _matmul_case})
