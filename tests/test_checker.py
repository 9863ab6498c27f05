"""The tests' own exactness checker (conftest.error_against): every wrong model fails it, float32
rounding of the same function does not."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import error_against, output_error, params, random_feeds, tiny, with_masks

CONV = """
g (float[1,3,8,8] x, float[4,3,1,1] W, float[4] B) => (float[1,4,8,8] y) {
  y = Conv(x, W, B)
}
"""


def conv(**values) -> object:
    return tiny(CONV, seed=4, values=values or None)


def test_the_same_model_is_exact():
    model = conv()
    assert error_against(model, model) == 0.0


def test_a_nan_or_inf_in_one_channel_is_an_error():
    model = conv()
    w = np.random.default_rng(4).standard_normal((4, 3, 1, 1)).astype(np.float32)
    b = np.random.default_rng(5).standard_normal(4).astype(np.float32)
    for bad in (np.nan, np.inf):
        broken = b.copy()
        broken[2] = bad
        assert error_against(conv(W=w, B=b), conv(W=w, B=broken)) == math.inf
    assert error_against(model, model) == 0.0


def test_a_slightly_wrong_model_measures_its_error():
    w = np.random.default_rng(4).standard_normal((4, 3, 1, 1)).astype(np.float32)
    b = np.random.default_rng(5).standard_normal(4).astype(np.float32)
    err = error_against(conv(W=w, B=b), conv(W=w, B=b * np.float32(1.001)))
    assert 1e-5 < err < 1e-2


def test_shapes_dtypes_and_output_names_must_agree():
    with pytest.raises(AssertionError, match="shape"):
        output_error(np.zeros((1, 4), np.float32), np.zeros((1, 3), np.float32))
    with pytest.raises(AssertionError, match="dtype"):
        output_error(np.zeros(4, np.float32), np.zeros(4, np.float64))
    assert output_error(np.arange(4), np.arange(4)) == 0.0
    assert output_error(np.arange(4), np.arange(4) + (np.arange(4) == 3)) == math.inf  # integers: equal
    other = tiny(CONV.replace("y)", "z)").replace("y =", "z ="), seed=4)
    with pytest.raises(AssertionError, match="outputs differ"):
        error_against(conv(), other)


def test_where_the_reference_is_not_finite_the_same_value_is_required():
    ref = np.array([1.0, np.inf, np.nan], np.float32)
    assert output_error(ref, ref.copy()) == 0.0
    assert output_error(ref, np.array([1.0, -np.inf, np.nan], np.float32)) == math.inf
    assert output_error(ref, np.array([1.0, np.inf, 0.0], np.float32)) == math.inf


# The same function: y = (x + C) - C, and y = x. In float32 the first loses x's low bits to C's
# magnitude (an error of ~1e-4 relative); in float64 both are x to 1e-12. A cancellation like
# this is what folding a large constant into a bias does to an output: rounding, not a wrong model.
CANCEL = """
g (float[1,64] x, float[64] C) => (float[1,64] y) {
  a = Add(x, C)
  y = Sub(a, C)
}
"""
IDENTITY = """
g (float[1,64] x) => (float[1,64] y) {
  y = Identity(x)
}
"""
SCALED = """
g (float[1,64] x, float[1] S) => (float[1,64] y) {
  y = Mul(x, S)
}
"""


def test_float32_rounding_of_the_same_function_is_not_an_error_but_a_wrong_function_is():
    cancel = tiny(CANCEL, values={"C": np.full(64, 3000.0)})
    [feed] = random_feeds(cancel, draws=1)
    in_float32 = (feed["x"] + np.float32(3000.0)) - np.float32(3000.0)
    assert output_error(feed["x"], in_float32) > 1e-5  # what a float32 comparison would call wrong
    assert error_against(cancel, tiny(IDENTITY)) <= 1e-9  # judged in float64: the same function
    assert error_against(tiny(IDENTITY), cancel) <= 1e-9
    # a function off by 1e-4 differs in float64 as much: an error
    assert error_against(tiny(IDENTITY), tiny(SCALED, values={"S": [1.0001]})) > 5e-5


def test_with_masks_multiplies_by_name_and_params_counts_here():
    model = conv()
    mask = np.ones((4, 3, 1, 1), np.float32)
    mask[1] = 0
    masked = with_masks(model, {"W": mask})
    w = {t.name: t for t in masked.graph.initializer}["W"]
    from onnx import numpy_helper

    assert not numpy_helper.to_array(w)[1].any() and numpy_helper.to_array(w)[0].all()
    assert params(model) == params(masked) == 4 * 3 + 4
    with pytest.raises(AssertionError, match="name no initializer"):
        with_masks(model, {"V": mask})
