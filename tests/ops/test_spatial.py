"""Pad, Resize, Tile: untouched axes pass their indices through."""

import numpy as np
from conftest import init, shapes, shrink_checked, tiny

PAD = """
agraph (float[1, 3, 4, 4] x, float[5, 3, 1, 1] W1, float[5] B1, int64[8] P, float[2, 5, 3, 3] W2) => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1, B1)
  r = Relu (c)
  p = Pad <mode = "reflect"> (r, P)
  y = Conv (p, W2)
}
"""


def test_spatial_pad_passes_channels_and_constants():
    model = tiny(PAD, zero={"W1": np.s_[[1, 2]]}, values={"P": [0, 0, 1, 1, 0, 0, 1, 1], "B1": [0.1, 0.5, -0.3, 0.2, 0.4]})
    result = shrink_checked(model)
    assert shapes(result.model)["W2"] == (2, 3, 3, 3)
    assert [f.into for f in result.folds] == ["bias"]  # reflect padding keeps the constant uniform


RESIZE = """
agraph (float[1, 3, 4, 4] x, float[5, 3, 1, 1] W1, float[5] B1, float[4] Sc, float[2, 5, 1, 1] W2) => (float[1, 2, 8, 8] y)
{
  c = Conv (x, W1, B1)
  r = Relu (c)
  u = Resize <mode = "linear"> (r, , Sc)
  y = Conv (u, W2)
}
"""


def test_resize_passes_channels():
    model = tiny(RESIZE, zero={"W1": np.s_[[0, 4]], "B1": np.s_[[0]]}, values={"Sc": [1, 1, 2, 2], "B1": [0, 1, 1, 1, 0.6]})
    result = shrink_checked(model, )
    assert shapes(result.model)["W1"] == (3, 3, 1, 1)


RESIZE_SIZES = """
agraph (float[1, 3, 4, 4] x, float[5, 3, 1, 1] W1, float[5] B1, int64[4] Sz, float[2, 5, 1, 1] W2) => (float[1, 2, 6, 6] y)
{
  c = Conv (x, W1, B1)
  u = Resize <mode = "nearest"> (c, , , Sz)
  y = Conv (u, W2)
}
"""


def test_resize_sizes_input_is_rewritten_for_pruned_channels():
    model = tiny(RESIZE_SIZES, zero={"W1": np.s_[[1]], "B1": np.s_[[1]]}, values={"Sz": [1, 5, 6, 6]})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 3, 1, 1)
    resize = next(n for n in result.model.graph.node if n.op_type == "Resize")
    assert init(result.model, resize.input[3]).tolist() == [1, 4, 6, 6]


TILE = """
agraph (float[1, 3, 2, 2] x, float[5, 3, 1, 1] W1, float[5] B1, int64[4] R, float[2, 5, 1, 1] W2) => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1, B1)
  t = Tile (c, R)
  y = Conv (t, W2)
}
"""


def test_tile_along_space_passes_channels():
    model = tiny(TILE, zero={"W1": np.s_[[3]], "B1": np.s_[[3]]}, values={"R": [1, 1, 2, 2]})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 3, 1, 1)


TILE_CONCAT = """
agraph (float[N, 3, 4, 4] x, float[6, 3, 1, 1] W, float[6] B, int64[4] R, float[5, 12, 1, 1] W2) => (float[N, 5, 4, 8] y)
{
  c = Conv (x, W, B)
  t = Tile (c, R)
  k = Concat <axis = 1> (t, t)
  y = Conv (k, W2)
}
"""


def test_constant_channels_through_tile_and_concat_with_a_dynamic_batch():
    model = tiny(TILE_CONCAT, zero={"W": np.s_[[1, 4]]}, values={"R": [1, 1, 1, 2]})
    result = shrink_checked(model, input_shapes={"x": [2, 3, 4, 4]})
    assert shapes(result.model)["W"] == (4, 3, 1, 1)
    assert shapes(result.model)["W2"] == (5, 8, 1, 1)  # both copies of the channels go
    assert [f.into for f in result.folds] == ["bias"]
