"""The non-zero pattern of a weight matrix, from one streaming pass over it.

Handlers of ops that read large weights (MatMul, Gemm) ask which rows and columns of a weight
hold non-zeros, and which rows the kept columns read. Computed on the whole matrix each time,
that is a full pass (and a temporary as large as the weight) per question, and the keep closure
asks several times per node. `pattern(w)` answers from one pass, in blocks of rows, memoized
for mapped (immutable) weights: per row and per column whether it holds a non-zero, and the
zeros that lie inside non-zero rows and columns (`zeros`), when there are few of them (exact
zeros of random or fp16 weights; structured masks leave none). Every question about rows and
columns then has an exact answer from these; with many scattered zeros (unstructured sparsity)
`zeros` is None and the caller asks the matrix itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxshrink.io import weights

# Scattered zeros recorded (a second pass over the weight); past this, the matrix is asked.
MAX_SCATTERED = 1 << 20
SCAN_BYTES = 1 << 20  # blocks of a pass: small enough to stay in the CPU's caches


def _nonzero(block: np.ndarray) -> np.ndarray:
    """block != 0 (-0.0 is zero). numpy compares fp16 (and ml_dtypes' bf16) by converting each
    element: on the bits, with the sign cleared, it is four times faster."""
    if block.dtype.itemsize == 2 and block.dtype.kind in "fV":  # fp16, bf16
        return (block.view(np.uint16) & np.uint16(0x7FFF)).astype(bool)
    return block != 0


@dataclass(frozen=True)
class Pattern:
    rows: np.ndarray  # bool [K]: row k holds a non-zero
    cols: np.ndarray  # bool [N]: column n holds a non-zero
    count: int  # non-zeros
    # (row indices, column indices) of the zeros inside non-zero rows and columns; None: too many
    zeros: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def exact(self) -> bool:
        """Do rows, cols and zeros say where every non-zero is?"""
        return self.zeros is not None

    @property
    def T(self) -> Pattern:
        zeros = (self.zeros[1], self.zeros[0]) if self.zeros is not None else None
        return Pattern(self.cols, self.rows, self.count, zeros)

    def reached(self, live: np.ndarray) -> np.ndarray:
        """For live rows `live` (bool [R, K]): [R, N], is column n non-zero in a live row? Only
        for an `exact` pattern."""
        assert self.zeros is not None
        live = np.asarray(live, bool) & self.rows
        hits = np.repeat(live.sum(axis=1, keepdims=True).astype(np.int64), len(self.cols), axis=1)
        zr, zc = self.zeros
        if len(zr):
            for r in range(len(live)):
                hits[r] -= np.bincount(zc, weights=live[r, zr], minlength=len(self.cols)).astype(np.int64)
        return (hits > 0) & self.cols

    def rows_reading(self, cols: np.ndarray) -> np.ndarray:
        """Rows holding a non-zero in one of `cols` (bool [N]); only for an `exact` pattern."""
        return self.T.reached(np.asarray(cols, bool)[None, :])[0]


def _scan(w: np.ndarray) -> Pattern:
    """One pass in blocks of rows. A block whose non-zero rows are not all non-zero in every
    column the block reaches holds scattered zeros: those rows are searched (they are few), and
    columns a block never reaches but others do add their zeros at the end."""
    weights.populate(w)
    k, n = w.shape
    rows = np.zeros(k, bool)
    cols = np.zeros(n, bool)
    count = 0
    start = 0
    zr: list[np.ndarray] = []
    zc: list[np.ndarray] = []
    scattered = 0  # recorded so far; past MAX_SCATTERED the pattern is not exact
    reach: list[tuple[int, np.ndarray, np.ndarray]] = []  # (start, non-zero rows, columns reached)
    for block in weights.row_blocks(w, chunk=SCAN_BYTES):
        nz = _nonzero(block)
        r = np.asarray(nz.any(axis=1))
        c = np.asarray(nz.any(axis=0))
        found = int(np.count_nonzero(nz))
        rows[start : start + len(block)] = r
        cols |= c
        count += found
        reach.append((start, r, c))
        missing = int(r.sum()) * int(c.sum()) - found
        if missing and scattered <= MAX_SCATTERED:
            scattered += missing
            short = np.flatnonzero(r & (nz.sum(axis=1, dtype=np.int64) < int(c.sum())))
            i, j = np.nonzero(~nz[short][:, c])
            zr.append(start + short[i])
            zc.append(np.flatnonzero(c)[j])
        start += len(block)
    zeros: tuple[np.ndarray, np.ndarray] | None = None
    expected = int(rows.sum()) * int(cols.sum()) - count
    for first, r, c in reach:  # columns this block never reached, though others do
        late = cols & ~c
        if late.any() and r.any() and scattered <= MAX_SCATTERED:
            i, j = np.nonzero(np.outer(r, late))
            scattered += len(i)
            zr.append(first + i)
            zc.append(j)
    if scattered <= MAX_SCATTERED:
        zeros = (
            np.concatenate([np.zeros(0, np.int64), *zr]).astype(np.int64),
            np.concatenate([np.zeros(0, np.int64), *zc]).astype(np.int64),
        )
        assert len(zeros[0]) == expected, (len(zeros[0]), expected)
    weights.trim()
    return Pattern(rows, cols, count, zeros)


def sliced(p: Pattern, rows: np.ndarray | None, cols: np.ndarray | None) -> Pattern | None:
    """The pattern of W[rows][:, cols] (sorted index arrays; None: all) from W's, without a pass
    over the slice; None when W's is not exact."""
    if p.zeros is None:
        return None
    k, n = len(p.rows), len(p.cols)
    kr = np.ones(k, bool) if rows is None else np.isin(np.arange(k), rows)
    kc = np.ones(n, bool) if cols is None else np.isin(np.arange(n), cols)
    # a row (column) of the slice is non-zero when one of its kept columns (rows) is
    r = p.rows_reading(kc)[kr]
    c = p.reached(kr[None, :])[0][kc]
    new_r, new_c = _renumber(np.flatnonzero(kr), k), _renumber(np.flatnonzero(kc), n)
    zr, zc = new_r[p.zeros[0]], new_c[p.zeros[1]]
    inside = (zr >= 0) & (zc >= 0)
    zr, zc = zr[inside], zc[inside]
    inside = r[zr] & c[zc]
    zeros = (zr[inside], zc[inside])
    return Pattern(r, c, int(r.sum()) * int(c.sum()) - int(inside.sum()), zeros)


def zeroed(p: Pattern, rows: np.ndarray | None, cols: np.ndarray | None) -> Pattern | None:
    """The pattern of W with rows `rows` and columns `cols` set to zero (index arrays; None:
    none), from W's, without a pass over it; None when W's is not exact. A row (column) stays
    non-zero when it is not zeroed and one of its columns (rows) that are not holds a non-zero;
    the zeros inside are W's that lie in the rows and columns still non-zero."""
    if p.zeros is None:
        return None
    kr = np.ones(len(p.rows), bool)
    kc = np.ones(len(p.cols), bool)
    if rows is not None:
        kr[rows] = False
    if cols is not None:
        kc[cols] = False
    r = p.rows_reading(kc) & kr
    c = p.reached(kr[None, :])[0] & kc
    zr, zc = p.zeros
    inside = r[zr] & c[zc]
    return Pattern(r, c, int(r.sum()) * int(c.sum()) - int(inside.sum()), (zr[inside], zc[inside]))


def _renumber(index: np.ndarray, size: int) -> np.ndarray:
    out = np.full(size, -1, np.int64)
    out[index] = np.arange(len(index))
    return out


def known(w: np.ndarray) -> Pattern | None:
    """The pattern of a mapped 2-D weight if a pass already computed it, else None."""
    return weights.peek(w, "nonzero")


def remember(w: np.ndarray, p: Pattern) -> None:
    """Record the pattern of a mapped weight that was derived without a pass (see `sliced`)."""
    weights.memo(w, "nonzero", lambda: p)


def pattern(w: np.ndarray) -> Pattern:
    """The pattern of a 2-D array (memoized when it is a mapped weight; a transposed view of
    one is answered from the same pass)."""
    assert w.ndim == 2, w.shape
    if w.flags.c_contiguous or not w.T.flags.c_contiguous:
        return weights.memo(w, "nonzero", lambda: _scan(w))
    return weights.memo(w.T, "nonzero", lambda: _scan(w.T)).T
