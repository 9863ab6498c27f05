"""The non-zero pattern of a weight (one pass) answers what MatMul/Gemm ask exactly as the
matrix itself does: which output columns live rows reach, which rows kept columns read, and the
pattern of a slice."""

from __future__ import annotations

import numpy as np

from onnxshrink.core.nonzero import _scan, pattern, sliced
from onnxshrink.ops.linear import _const_through, _live_product, _rows_read


def _random_weight(rng: np.random.Generator) -> np.ndarray:
    k, n = rng.integers(1, 9, 2)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[rng.random((k, n)) < rng.choice([0.0, 0.05, 0.3])] = 0  # scattered zeros, or none
    if rng.random() < 0.5:
        w[rng.integers(0, k)] = -0.0  # a masked row (a negative weight times 0)
    if rng.random() < 0.5:
        w[:, rng.integers(0, n)] = 0
    return w


def test_pattern_answers_as_the_matrix_does():
    rng = np.random.default_rng(1)
    for _ in range(300):
        w = _random_weight(rng)
        k, n = w.shape
        for view in (w, np.ascontiguousarray(w.T).T):  # a transposed view is answered alike
            p = pattern(view)
            assert p.exact
            assert p.count == np.count_nonzero(view)
            live = rng.random((3, k)) < 0.5
            assert np.array_equal(_const_through(live, view), ~_live_product(live, view != 0))
            cols = rng.random(n) < 0.5
            assert np.array_equal(_rows_read(view, cols), (view != 0)[:, cols].any(axis=1))
        rows = np.sort(rng.choice(k, rng.integers(1, k + 1), replace=False))
        cols_i = np.sort(rng.choice(n, rng.integers(1, n + 1), replace=False))
        derived, scanned = sliced(_scan(w), rows, cols_i), _scan(w[rows][:, cols_i])
        assert derived is not None
        assert np.array_equal(derived.rows, scanned.rows) and np.array_equal(derived.cols, scanned.cols)
        assert derived.count == scanned.count
        assert sorted(zip(*derived.zeros, strict=True)) == sorted(zip(*scanned.zeros, strict=True))


def test_many_scattered_zeros_fall_back_to_the_matrix(monkeypatch):
    from onnxshrink.core import nonzero

    monkeypatch.setattr(nonzero, "MAX_SCATTERED", 2)
    w = np.eye(4, dtype=np.float16) + np.eye(4, k=1, dtype=np.float16)
    p = pattern(w)
    assert not p.exact and p.count == 7
    cols = np.array([True, False, False, False])
    assert np.array_equal(_rows_read(w, cols), [True, False, False, False])
