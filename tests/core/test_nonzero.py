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


def test_zeroed_pattern_is_the_scanned_one():
    """A zeroed weight's pattern derived from its original's (the prune's reference) equals a
    pass over the zeroed weight; and a store's memo of a tensor it wrote serves a later map of
    the same bytes (the shrink reading the spill file)."""
    from onnxshrink.core.nonzero import zeroed

    rng = np.random.default_rng(2)
    for _ in range(300):
        w = _random_weight(rng)
        k, n = w.shape
        rows = rng.choice(k, rng.integers(0, k + 1), replace=False) if rng.random() < 0.7 else None
        cols = rng.choice(n, rng.integers(0, n + 1), replace=False) if rng.random() < 0.7 else None
        z = w.copy()
        if rows is not None:
            z[rows] = 0
        if cols is not None:
            z[:, cols] = 0
        derived, scanned = zeroed(_scan(w), rows, cols), _scan(z)
        assert derived is not None
        assert np.array_equal(derived.rows, scanned.rows) and np.array_equal(derived.cols, scanned.cols)
        assert derived.count == scanned.count == np.count_nonzero(z)
        assert sorted(zip(*derived.zeros, strict=True)) == sorted(zip(*scanned.zeros, strict=True))


def test_a_written_tensor_keeps_its_memo_when_mapped_again(tmp_path):
    from onnxshrink.io.weights import WeightStore, tensor_proto

    store = WeightStore()
    writer = store.writer(tmp_path / "w.data")
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    made = writer.write("w", iter([w[:2], w[2:]]), w.shape, w.dtype)
    writer.close()
    assert store.memo(made, "k", lambda: 7) == 7
    t = tensor_proto("w", made, store.location(made), None)
    again = store.array(t, str(tmp_path))
    assert again.__array_interface__["data"][0] != made.__array_interface__["data"][0]
    assert np.array_equal(again, w) and store.peek(again, "k") == 7
    assert store.peek(again.T, "k") is None  # another view: its own memo
    other = WeightStore()  # a store that did not write it: nothing known
    assert other.peek(other.array(t, str(tmp_path)), "k") is None
