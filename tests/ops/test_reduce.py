"""Reductions: reduced axes keep every index, the others pass through; opset 13/18 axes inputs."""

import numpy as np
import pytest
from conftest import shapes, shrink_checked, tiny


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_reduce_mean_over_space_prunes_channels(opset):
    axes_attr = "<axes = [2, 3], keepdims = 0>" if opset < 18 else "<keepdims = 0>"
    axes_in = ", Axes" if opset >= 18 else ""
    head = "float[4, 3, 1, 1] W1, float[4] B1, float[2, 4] F" + (", int64[2] Axes" if opset >= 18 else "")
    text = f"""
agraph (float[1, 3, 5, 5] x, {head}) => (float[1, 2] y)
{{
  c = Conv (x, W1, B1)
  r = Relu (c)
  m = ReduceMean {axes_attr} (r{axes_in})
  y = Gemm <transB = 1> (m, F)
}}
"""
    model = tiny(text, zero={"W1": np.s_[[2]]}, values={"Axes": [2, 3], "B1": [0.1, 0.2, 0.7, 0.4]}, opset=opset)
    result = shrink_checked(model)
    assert shapes(result.model)["F"] == (2, 3)
    assert [f.into for f in result.folds] == ["bias"]


def test_reduce_sum_over_channels_keeps_them():
    text = """
agraph (float[1, 3, 5, 5] x, float[4, 3, 1, 1] W1, float[4] B1) => (float[1, 1, 5, 5] y)
{
  c = Conv (x, W1, B1)
  y = ReduceSum <keepdims = 1> (c, Axes)
}
"""
    model = tiny(text.replace("float[4] B1)", "float[4] B1, int64[1] Axes)"), zero={"W1": np.s_[[1]], "B1": np.s_[[1]]},
                 values={"Axes": [1]}, opset=13)
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 3, 1, 1)
    assert {g.kind for g in result.kept_zeroed if g.tensor == "W1"} == {"structure"}


def test_reduce_prod_of_gathered_sizes_is_a_reshape_target():
    # tf2onnx lowers MatMul/Einsum on [B, T, C] to a Reshape whose merged size is
    # ReduceProd(Gather(Shape(h), [0, 1])): the channels (C) pass through it and are removed.
    text = """
agraph (float[2, 8, 3] x, float[3, 6] W, float[6] B, float[6, 5] W2, int64[2] Bt, int64[1] Ch) => (float[16, 5] y)
{
  m = MatMul (x, W)
  h = Add (m, B)
  r = Relu (h)
  s = Shape (r)
  bt = Gather (s, Bt)
  n = ReduceProd <keepdims = 1> (bt)
  c = Gather (s, Ch)
  t = Concat <axis = 0> (n, c)
  f = Reshape (r, t)
  y = MatMul (f, W2)
}
"""
    model = tiny(text, zero={"W": np.s_[:, [1, 4]], "B": np.s_[[1, 4]]}, values={"Bt": [0, 1], "Ch": [2]})
    result = shrink_checked(model)
    assert shapes(result.model)["W"] == (3, 4)
    assert shapes(result.model)["W2"] == (4, 5)
