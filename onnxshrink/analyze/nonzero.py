"""The non-zero pattern of a weight matrix, from one streaming pass over it.

Handlers of ops that read large weights (MatMul, Gemm) ask which rows and columns of a weight
hold non-zeros, and which rows the kept columns read. Computed on the whole matrix each time,
that is a full pass (and a temporary as large as the weight) per question, and the keep closure
asks several times per node. `pattern(w)` answers from one pass, in blocks of rows, memoized
for mapped (immutable) weights: per row and per column whether it holds a non-zero, and the
count of non-zeros. When every zero of the matrix lies in a zero row or a zero column (what
structured masks leave), the pattern is their product (`product`), and every question about
rows and columns has an exact answer from the two vectors; otherwise the caller asks the
matrix itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxshrink.io import weights


@dataclass(frozen=True)
class Pattern:
    rows: np.ndarray  # bool [K]: row k holds a non-zero
    cols: np.ndarray  # bool [N]: column n holds a non-zero
    count: int  # non-zeros

    @property
    def product(self) -> bool:
        """Is W != 0 exactly outer(rows, cols)?"""
        return self.count == int(self.rows.sum()) * int(self.cols.sum())

    def rows_reading(self, cols: np.ndarray) -> np.ndarray:
        """Rows holding a non-zero in one of `cols` (bool [N]); only for a `product` pattern."""
        return self.rows & bool((self.cols & cols).any())

    def cols_reading(self, rows: np.ndarray) -> np.ndarray:
        """Columns holding a non-zero in one of `rows` (bool [K]); only for a `product` pattern."""
        return self.cols & bool((self.rows & rows).any())


def _scan(w: np.ndarray) -> Pattern:
    weights.populate(w)
    k, n = w.shape
    rows = np.zeros(k, bool)
    cols = np.zeros(n, bool)
    count = 0
    start = 0
    for block in weights.row_blocks(w):
        nz = block != 0
        rows[start : start + len(block)] = nz.any(axis=1)
        cols |= nz.any(axis=0)
        count += int(np.count_nonzero(nz))
        start += len(block)
    weights.trim()
    return Pattern(rows, cols, count)


def sliced(p: Pattern, rows: np.ndarray | None, cols: np.ndarray | None) -> Pattern | None:
    """The pattern of W[rows][:, cols] (index arrays; None: all), when W's is a product: known
    without a pass over the slice."""
    if not p.product:
        return None
    r = p.rows if rows is None else p.rows[rows]
    c = p.cols if cols is None else p.cols[cols]
    return Pattern(r, c, int(r.sum()) * int(c.sum()))


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
    p = weights.memo(w.T, "nonzero", lambda: _scan(w.T))
    return Pattern(p.cols, p.rows, p.count)
