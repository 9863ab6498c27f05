"""Pooling keeps channels one-to-one; constants pass through it (with padding minded)."""

import numpy as np
import pytest
from conftest import shapes, shrink_checked, tiny

POOLS = {
    "MaxPool": "MaxPool <kernel_shape = [3, 3], pads = [1, 1, 1, 1], strides = [2, 2]>",
    "AveragePool": "AveragePool <kernel_shape = [2, 2], strides = [2, 2]>",
    "AveragePoolPadded": "AveragePool <kernel_shape = [3, 3], pads = [1, 1, 1, 1], count_include_pad = 1>",
    "GlobalAveragePool": "GlobalAveragePool",
    "GlobalMaxPool": "GlobalMaxPool",
    "LpPool": "LpPool <kernel_shape = [2, 2], strides = [2, 2]>",
}


@pytest.mark.parametrize("pool", list(POOLS))
def test_pool_passes_channels_and_constants(pool):
    text = f"""
agraph (float[1, 3, 6, 6] x, float[5, 3, 1, 1] W1, float[5] B1, float[2, 5, 1, 1] W2) => (float[1, 2, H, W] y)
{{
  c = Conv (x, W1, B1)
  r = Relu (c)
  p = {POOLS[pool]} (r)
  y = Conv (p, W2)
}}
"""
    zero = {"W1": np.s_[[0, 3]], "B1": np.s_[[0]]}  # channel 0 is 0, channel 3 is relu(b3)
    model = tiny(text, zero=zero, values={"B1": [0.0, 0.4, -0.2, 1.5, 0.8]})
    result = shrink_checked(model)
    if pool == "AveragePoolPadded":
        # Padding counted in the average: constant channel 3 varies at the borders. Folding it
        # needs a 6 x 6 constant map per output channel, to save one weight each: it stays.
        assert shapes(result.model)["W1"] == (4, 3, 1, 1)
        [kept] = [g for g in result.kept_zeroed if g.tensor == "W1"]
        assert kept.kind == "not-absorbable"
        return
    assert shapes(result.model)["W1"] == (3, 3, 1, 1)
    assert shapes(result.model)["W2"] == (2, 3, 1, 1)


def test_maxpool_indices_output_pins_the_channels():
    text = """
agraph (float[1, 3, 4, 4] x, float[4, 3, 1, 1] W1, float[4] B1) => (float[1, 4, 2, 2] y, int64[1, 4, 2, 2] i)
{
  c = Conv (x, W1, B1)
  y, i = MaxPool <kernel_shape = [2, 2], strides = [2, 2]> (c)
}
"""
    result = shrink_checked(tiny(text, zero={"W1": np.s_[[1]], "B1": np.s_[[1]]}))
    assert shapes(result.model)["W1"] == (4, 3, 1, 1)
