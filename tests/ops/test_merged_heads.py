"""Attention heads through an einsum lowering's batched MatMuls (tf2onnx's and Keras 3's export
of MultiHeadAttention): (batch, heads) merged into one axis by a Reshape whose target is computed
at run time, Concat(ReduceProd(Gather(Shape(t), [0, 1])), -1, ...), and split back with
Concat(Max(Gather(Shape(a), [0, 1]), Gather(Shape(b), [0, 1])), ...). A masked head goes from the
Q, K and V projections, their biases and the output projection; with a dynamic batch the merged
index is b * heads + h, and the shrunk model's sizes, computed at run time from the shrunk
tensors, must be right for every batch size.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import error_against, params, shapes, shrink_checked, tiny, with_masks

from onnxshrink.options import ShrinkOptions
from onnxshrink.stages.attempt import analyze_model

E, H, D, S = 8, 4, 2, 3  # model width, heads, head dim, sequence

# Q, K, V projections to [N, S, H, D] plus per-head biases (as tf2onnx writes Keras's
# EinsumDense), the einsum lowering's merges and splits, the output projection.
ATTENTION = """
agraph ({batch} x, float[8, 8] Wq, float[4, 2] Bq, float[8, 8] Wk, float[4, 2] Bk,
        float[8, 8] Wv, float[4, 2] Bv, float[8, 8] Wo, float[8] Bo,
        int64[4] Heads, int64[3] Back, int64[2] BatchAxes, int64[1] Minus1, int64[1] Ax2, int64[1] Ax3)
        => ({batch} y)
{{
  q0 = MatMul (x, Wq)
  q1 = Reshape (q0, Heads)
  q = Add (q1, Bq)
  qt = Transpose <perm = [0, 2, 1, 3]> (q)
  k0 = MatMul (x, Wk)
  k1 = Reshape (k0, Heads)
  k = Add (k1, Bk)
  kt = Transpose <perm = [0, 2, 3, 1]> (k)
  v0 = MatMul (x, Wv)
  v1 = Reshape (v0, Heads)
  v = Add (v1, Bv)
  vt = Transpose <perm = [0, 2, 1, 3]> (v)

  sq = Shape (qt)
  bq = Gather (sq, BatchAxes)
  nq = ReduceProd <keepdims = 1> (bq)
  dq = Gather (sq, Ax3)
  tq = Concat <axis = 0> (nq, Minus1, dq)
  q3 = Reshape (qt, tq)
  sk = Shape (kt)
  bk = Gather (sk, BatchAxes)
  nk = ReduceProd <keepdims = 1> (bk)
  dk = Gather (sk, Ax3)
  tk = Concat <axis = 0> (nk, Minus1, dk)
  k3 = Reshape (kt, tk)
  s3 = MatMul (q3, k3)
  bs = Max (bq, bk)
  mq = Gather (sq, Ax2)
  ts = Concat <axis = 0> (bs, mq, dk)
  s4 = Reshape (s3, ts)
  p = Softmax <axis = -1> (s4)

  sp = Shape (p)
  bp = Gather (sp, BatchAxes)
  np_ = ReduceProd <keepdims = 1> (bp)
  dp = Gather (sp, Ax3)
  tp = Concat <axis = 0> (np_, Minus1, dp)
  p3 = Reshape (p, tp)
  sv = Shape (vt)
  bv = Gather (sv, BatchAxes)
  nv = ReduceProd <keepdims = 1> (bv)
  dv = Gather (sv, Ax3)
  tv = Concat <axis = 0> (nv, Minus1, dv)
  v3 = Reshape (vt, tv)
  o3 = MatMul (p3, v3)
  bo = Max (bv, bp)
  mp = Gather (sp, Ax2)
  to = Concat <axis = 0> (bo, mp, dv)
  o4 = Reshape (o3, to)
  ot = Transpose <perm = [0, 2, 1, 3]> (o4)
  o = Reshape (ot, Back)
  y0 = MatMul (o, Wo)
  y = Add (y0, Bo)
}}
"""
SHAPES = {"Heads": [-1, S, H, D], "Back": [-1, S, E], "BatchAxes": [0, 1], "Minus1": [-1], "Ax2": [2], "Ax3": [3]}
DYNAMIC, STATIC = "float[N, 3, 8]", "float[2, 3, 8]"
BEFORE = 4 * E * E + 3 * H * D + E  # 288
PER_HEAD = 3 * E * D + 3 * D + D * E  # Q, K, V columns, their biases, the output rows: 70


def head_masks(model: onnx.ModelProto, heads: list[int]) -> dict[str, np.ndarray]:
    """Masks (1 keeps) that zero these heads' Q/K/V columns and biases and output rows."""
    cols = np.ones(E, np.float32)
    for h in heads:
        cols[h * D : (h + 1) * D] = 0
    per_head = np.ones((H, D), np.float32)
    per_head[heads] = 0
    out = {f"W{n}": np.broadcast_to(cols, (E, E)).copy() for n in "qkv"}
    out |= {f"B{n}": per_head for n in "qkv"}
    out["Wo"] = np.broadcast_to(cols[:, None], (E, E)).copy()
    return out


def attention(batch: str, seed: int = 0, zero_biases: bool = False) -> onnx.ModelProto:
    values: dict = dict(SHAPES)
    if zero_biases:  # library-default initialization
        values |= {"Bq": np.zeros((H, D)), "Bk": np.zeros((H, D)), "Bv": np.zeros((H, D)), "Bo": np.zeros(E)}
    return tiny(ATTENTION.format(batch=batch), seed=seed, values=values)


@pytest.mark.parametrize("batch", [DYNAMIC, STATIC], ids=["dynamic-batch", "static-batch"])
@pytest.mark.parametrize("zero_biases", [False, True], ids=["random", "zero-biases"])
def test_a_masked_head_goes_through_the_merged_batch_and_heads(batch: str, zero_biases: bool):
    model = attention(batch, seed=3, zero_biases=zero_biases)
    assert params(model) == BEFORE
    masks = head_masks(model, [2])
    result = shrink_checked(model, masks=masks)
    assert params(result.model) == BEFORE - PER_HEAD
    got = shapes(result.model)
    assert got["Wq"] == got["Wk"] == got["Wv"] == (E, E - D)
    assert got["Bq"] == got["Bk"] == got["Bv"] == (H - 1, D)
    assert got["Wo"] == (E - D, E)
    if batch == DYNAMIC:  # the sizes computed at run time follow every batch size
        reference = with_masks(model, masks)
        for n in (1, 3, 5):
            assert error_against(reference, result.model, {"x": [n, S, E]}) <= 1e-5


def test_two_masked_heads_go_and_the_rest_stay_in_order():
    model = attention(DYNAMIC, seed=5)
    result = shrink_checked(model, masks=head_masks(model, [0, 3]))
    assert params(result.model) == BEFORE - 2 * PER_HEAD
    assert shapes(result.model)["Bq"] == (H - 2, D)


def test_a_head_masked_only_in_part_stays():
    """Half of head 1's Q columns zeroed: its scores still depend on the other half, so the
    whole head stays (the merged axis keeps heads whole); only nothing else goes."""
    model = attention(DYNAMIC, seed=7)
    wq = np.ones((E, E), np.float32)
    wq[:, 2] = 0
    result = shrink_checked(model, masks={"Wq": wq})
    assert params(result.model) == BEFORE


def test_the_merged_axis_is_kept_by_heads_and_the_sizes_are_products_and_maxima():
    """What the analysis reads: ReduceProd of two gathered dims is their product, the Max of
    two gathered dim pairs their larger, and the merged (batch * heads) axis keeps heads."""
    model = with_masks(attention(DYNAMIC, seed=1), head_masks(attention(DYNAMIC, seed=1), [1]))
    analysis = analyze_model(model, None, ShrinkOptions())
    syms = analysis.syms
    assert str(syms["nq"].items[0]).startswith("Prod(")
    assert str(syms["bo"].items[1]).startswith("MaxOf(")
    keep = analysis.keep
    for name in ("q3", "k3", "s3", "p3", "v3", "o3"):
        kept = keep.kept(keep.tensors[name], 0)
        assert kept is not None and np.flatnonzero(kept).tolist() == [0, 2, 3], name
        assert keep.periodic(keep.tensors[name], 0)


# One K head broadcast against four Q heads in a 4-D batched MatMul, its batch size computed as
# Max(Gather(Shape(qt), [0, 1]), Gather(Shape(kt), [0, 1])): the larger is 4, not the K side's 1.
SHARED_KEY = """
agraph (float[N, 3, 8] x, float[8, 8] Wq, float[4, 2] Bq, float[8, 2] Wk, float[8, 6] Wo,
        int64[4] Heads, int64[4] OneHead, int64[3] Back, int64[2] BatchAxes, int64[1] Ax2, int64[1] Ax3)
        => (float[N, 3, 6] y)
{
  q0 = MatMul (x, Wq)
  q1 = Reshape (q0, Heads)
  q = Add (q1, Bq)
  qt = Transpose <perm = [0, 2, 1, 3]> (q)
  k0 = MatMul (x, Wk)
  k1 = Reshape (k0, OneHead)
  kt = Transpose <perm = [0, 2, 3, 1]> (k1)
  s = MatMul (qt, kt)
  sq = Shape (qt)
  sk = Shape (kt)
  bk = Gather (sk, BatchAxes)
  bq = Gather (sq, BatchAxes)
  bs = Max (bk, bq)
  mq = Gather (sq, Ax2)
  dk = Gather (sk, Ax3)
  ts = Concat <axis = 0> (bs, mq, dk)
  s4 = Reshape (s, ts)
  p = Softmax <axis = -1> (s4)
  pv = MatMul (p, qt)
  pt = Transpose <perm = [0, 2, 1, 3]> (pv)
  o = Reshape (pt, Back)
  y = MatMul (o, Wo)
}
"""


def test_the_larger_of_two_sizes_is_never_assumed_equal_to_the_smaller():
    """A head masked in Q: the scores Reshape's size is the larger of Q's 4 heads and K's 1;
    the two are not one axis, and K's one head stays whatever Q loses; exact."""
    values = {"Heads": [-1, S, H, D], "OneHead": [-1, S, 1, D], "Back": [-1, S, E], "BatchAxes": [0, 1], "Ax2": [2], "Ax3": [3]}
    model = tiny(SHARED_KEY, seed=2, values=values)
    masks = {k: v for k, v in head_masks(model, [1]).items() if k in ("Wq", "Bq")}
    result = shrink_checked(model, masks=masks)
    assert shapes(result.model)["Wk"] == (E, D)


# The merged (batch * heads) tensor is itself a graph output: every head of it stays.
MERGED_OUTPUT = """
agraph (float[N, 3, 8] x, float[8, 8] Wq, float[4, 2] Bq, int64[4] Heads, int64[2] BatchAxes, int64[1] Minus1, int64[1] Ax3)
        => (float[M, 3, 2] q3)
{
  q0 = MatMul (x, Wq)
  q1 = Reshape (q0, Heads)
  q = Add (q1, Bq)
  qt = Transpose <perm = [0, 2, 1, 3]> (q)
  sq = Shape (qt)
  bq = Gather (sq, BatchAxes)
  nq = ReduceProd <keepdims = 1> (bq)
  dq = Gather (sq, Ax3)
  tq = Concat <axis = 0> (nq, Minus1, dq)
  q3 = Reshape (qt, tq)
}
"""


def test_a_merged_axis_the_interface_shows_keeps_every_head():
    values = {"Heads": [-1, S, H, D], "BatchAxes": [0, 1], "Minus1": [-1], "Ax3": [3]}
    model = tiny(MERGED_OUTPUT, seed=4, values=values)
    masks = {k: v for k, v in head_masks(model, [2]).items() if k in ("Wq", "Bq")}
    result = shrink_checked(model, masks=masks)
    assert params(result.model) == params(model) == E * E + H * D
