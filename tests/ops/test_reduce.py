"""Reductions: zero indices leave sums and means, reduced axes keep the rest; the others pass
through; opset 13/18 axes inputs."""

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


REDUCE_CHANNELS = """
agraph (float[1, 3, 5, 5] x, float[4, 3, 1, 1] W1, float[4] B1, int64[1] Axes) => (float[1, 1, 5, 5] y)
{
  c = Conv (x, W1, B1)
  y = OP <keepdims = 1> (c, Axes)
}
"""


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL2"])
def test_a_zero_channel_adds_nothing_to_a_sum_and_leaves(op):
    # ReduceMean keeps its divisor: its result is multiplied by kept / original.
    text = REDUCE_CHANNELS.replace("OP", op)
    zero = {"W1": np.s_[[1]], "B1": np.s_[[1]]}
    result = shrink_checked(tiny(text, zero=zero, values={"Axes": [1]}, opset=18))
    assert shapes(result.model)["W1"] == (3, 3, 1, 1)
    muls = [n for n in result.model.graph.node if n.op_type == "Mul"]
    assert len(muls) == (op == "ReduceMean")


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceProd", "ReduceLogSumExp"])
def test_a_zero_channel_counts_in_a_max_or_product_and_stays(op):
    text = REDUCE_CHANNELS.replace("OP", op)
    zero = {"W1": np.s_[[1]], "B1": np.s_[[1]]}
    result = shrink_checked(tiny(text, zero=zero, values={"Axes": [1]}, opset=18))
    assert shapes(result.model)["W1"] == (4, 3, 1, 1)
    assert {g.kind for g in result.kept_zeroed if g.tensor == "W1"} == {"structure"}


def test_a_constant_channel_that_is_not_zero_stays_in_a_sum():
    text = REDUCE_CHANNELS.replace("OP", "ReduceSum")
    zero = {"W1": np.s_[[1]]}  # the bias is left: the channel is the constant B1[1]
    model = tiny(text, zero=zero, values={"Axes": [1], "B1": [0.1, 0.5, 0.2, 0.3]}, opset=13)
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 3, 1, 1)


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


# Einsum's zero channels are recorded with one value for them all (mask [1, C, 1, 1], value
# [1, 1, 1, 1]): the fold reduces over the shape the two make together (the sweep's crash,
# opset 21: "operands could not be broadcast together with remapped shapes (1,6,1,1) and
# requested shape (1,1,1,1)")
EINSUM_REDUCE = """
agraph (float[1, 6, HH, WW] x, float[6, 6] E, int64[2] A, float[3, 6, 1, 1] W2) => (float[1, 3, 1, 1] y)
{
  e = Einsum <equation = "nchw,dc->ndhw"> (x, E)
  r = OP <keepdims = 1> (e, A)
  y = Conv (r, W2)
}
"""


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceMax", "ReduceSum"])
@pytest.mark.parametrize("dims", [(4, 5), ("H", "W")])
def test_reduce_of_channels_constant_with_one_value_for_all(op, dims):
    text = EINSUM_REDUCE.replace("HH", str(dims[0])).replace("WW", str(dims[1])).replace("OP", op)
    model = tiny(text, values={"A": [2, 3]}, zero={"E": np.s_[[1, 4]]}, opset=21)
    result = shrink_checked(model, input_shapes={"x": [1, 6, 4, 5]})
    assert shapes(result.model)["E"] == (4, 6) and shapes(result.model)["W2"] == (3, 4, 1, 1)
