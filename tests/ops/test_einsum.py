"""Einsum (ops/einsum.py): matrix-product equations behave as MatMul with their axes mapped;
other equations are barriers."""

import numpy as np
import pytest
from conftest import shapes, shrink_checked, tiny

from onnxshrink.ops.einsum import product_terms


@pytest.mark.parametrize(
    "eq, terms",
    [
        ("bij,bjk->bik", ("bij", "bjk", "bik")),
        ("bhqd,bhkd->bhqk", ("bhqd", "bhkd", "bhqk")),
        ("bsd, df -> bsf", ("bsd", "df", "bsf")),
        ("ij->ji", None),  # one operand
        ("bij,bjk->bk", None),  # i summed from one operand alone
        ("bii,bij->bj", None),  # a repeated letter
        ("...ij,jk->...ik", None),  # an ellipsis
        ("ij,jk", None),  # implicit output
    ],
)
def test_which_equations_are_matrix_products(eq, terms):
    assert product_terms(eq) == terms


FFN = """
g (float[1, 4, 8] x, float[8, 16] W1, float[16] B1, float[16, 8] W2) => (float[1, 4, 8] y) {
  h = Einsum <equation = "bsd,df->bsf"> (x, W1)
  a = Add (h, B1)
  r = Relu (a)
  y = Einsum <equation = "bsf,fd->bsd"> (r, W2)
}"""
NEURONS = [1, 4, 6, 9, 12]


def test_einsum_ffn_neurons_go_like_matmul():
    result = shrink_checked(tiny(FFN, zero={"W1": np.s_[:, NEURONS], "B1": np.s_[NEURONS]}))
    assert shapes(result.model)["W1"] == (8, 11) and shapes(result.model)["W2"] == (11, 8)
    assert not result.barriers


def test_einsum_unread_features_go_by_the_weights_nonzeros():
    result = shrink_checked(tiny(FFN, zero={"W2": np.s_[NEURONS]}))
    assert shapes(result.model)["W1"] == (8, 11) and shapes(result.model)["B1"] == (11,)


def test_a_constant_feature_einsum_cannot_absorb_stays():
    # relu(bias) of a masked neuron is a non-zero constant: an Einsum folds nothing, it stays
    model = tiny(FFN, zero={"W1": np.s_[:, NEURONS]}, values={"B1": np.linspace(0.1, 1, 16)})
    result = shrink_checked(model)
    assert shapes(result.model)["W2"] == (16, 8)


ATTN = """
g (float[1, 6, 8] x, float[8, 8] Wq, float[8, 8] Wk, float[8, 8] Wv, float[8, 8] Wo) => (float[1, 6, 8] y) {
  q = MatMul (x, Wq)
  k = MatMul (x, Wk)
  v = MatMul (x, Wv)
  shape = Constant <value = int64[4] {1, 6, 4, 2}> ()
  q4 = Reshape (q, shape)
  k4 = Reshape (k, shape)
  v4 = Reshape (v, shape)
  s = Einsum <equation = "bqhd,bkhd->bhqk"> (q4, k4)
  p = Softmax <axis = -1> (s)
  c = Einsum <equation = "bhqk,bkhd->bqhd"> (p, v4)
  back = Constant <value = int64[3] {1, 6, 8}> ()
  c3 = Reshape (c, back)
  y = MatMul (c3, Wo)
}"""


def test_einsum_attention_heads_go_as_units():
    # heads 1 and 2 (head_dim 2): their output-projection rows masked
    result = shrink_checked(tiny(ATTN, zero={"Wo": np.s_[[2, 3, 4, 5]]}))
    s = shapes(result.model)
    assert s["Wq"] == s["Wk"] == s["Wv"] == (8, 4) and s["Wo"] == (4, 8)
    assert not result.barriers


def test_other_equations_are_barriers():
    text = """
    g (float[1, 4, 8] x, float[8, 16] W1, float[16, 8] W2) => (float[1, 8] y) {
      h = MatMul (x, W1)
      s = Einsum <equation = "bsf->bf"> (h)
      y = MatMul (s, W2)
    }"""
    result = shrink_checked(tiny(text, zero={"W2": np.s_[NEURONS]}))
    assert shapes(result.model)["W1"] == (8, 16)
    assert [b["op"] for b in result.barriers] == ["Einsum"]
