"""Conv / ConvTranspose: channels through weights, groups, constants folded into biases."""

import numpy as np
import onnx
from conftest import error_against, init, params, shapes, shrink_checked, tiny

CHAIN = """
agraph (float[1, 3, 8, 8] x, float[6, 3, 3, 3] W1, float[6] B1, float[5, 6, 3, 3] W2, float[5] B2) => (float[1, 5, 8, 8] y)
{
  a = Conv <pads = [1, 1, 1, 1]> (x, W1, B1)
  r = Relu (a)
  y = Conv <pads = [1, 1, 1, 1]> (r, W2, B2)
}
"""


def chain(**zero):
    return tiny(CHAIN, zero=zero, values={"B1": [1.0, -0.5, 0.3, 2.0, -1.0, 0.7]})


def test_zeroed_filters_and_bias_remove_the_channel_from_both_convs():
    result = shrink_checked(chain(W1=np.s_[[1, 4]], B1=np.s_[[1, 4]]))
    s = shapes(result.model)
    assert s["W1"] == (4, 3, 3, 3)
    assert s["B1"] == (4,)
    assert s["W2"] == (5, 4, 3, 3)
    assert not result.folds  # a zero constant contributes nothing


def test_unread_input_channels_are_removed_from_the_producer_too():
    # W2 never reads channel 2 ("indirect sparsity"): W1's live filter 2 goes as well.
    result = shrink_checked(chain(W2=np.s_[:, [2]]))
    s = shapes(result.model)
    assert s["W1"] == (5, 3, 3, 3)
    assert s["W2"] == (5, 5, 3, 3)


def test_constant_channels_through_a_padded_conv_get_a_border_correction():
    # Filters zeroed, biases kept: relu(1.0) and relu(2.0) are constant channels. Through zero
    # padding their contribution differs at the borders: a one-channel conv over a map of ones,
    # with the kernel 1.0 * W2[:, 0] + 2.0 * W2[:, 3], adds exactly that.
    model = chain(W1=np.s_[[0, 3]])
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 3, 3, 3)
    assert shapes(result.model)["W2"] == (5, 4, 3, 3)
    assert [f.into for f in result.folds] == ["border correction"]
    assert result.after.ops["Conv"] == 3 and result.after.ops["Add"] == 1
    w2 = init(model, "W2")
    [kernel] = [init(result.model, t.name) for t in result.model.graph.initializer if t.name.endswith("_border")]
    assert np.allclose(kernel[:, 0], 1.0 * w2[:, 0] + 2.0 * w2[:, 3], rtol=1e-6)
    assert not result.kept_zeroed


ONE_BY_ONE = """
agraph (float[1, 3, 6, 6] x, float[4, 3, 3, 3] W1, float[4] B1, float[2, 4, 1, 1] W2, float[2] B2) => (float[1, 2, 6, 6] y)
{
  a = Conv <pads = [1, 1, 1, 1]> (x, W1, B1)
  r = Relu (a)
  y = Conv (r, W2, B2)
}
"""


def test_constant_channel_into_unpadded_conv_folds_into_the_bias():
    model = tiny(ONE_BY_ONE, zero={"W1": np.s_[[3]]}, values={"B1": [0.5, -1.0, 2.0, 1.5]})
    result = shrink_checked(model)
    assert shapes(result.model)["W2"] == (2, 3, 1, 1)
    assert [f.into for f in result.folds] == ["bias"]
    assert result.after.ops == {"Conv": 2, "Relu": 1}
    # relu(1.5) * W2[:, 3] was added to B2
    b2 = init(result.model, next(t.name for t in result.model.graph.initializer if t.dims == [2]))
    w2 = init(model, "W2")[:, 3, 0, 0]
    assert np.allclose(b2, init(model, "B2") + 1.5 * w2, rtol=1e-6)


GROUPED_PADDED = """
agraph (float[1, 4, H, W] x, float[4, 4, 1, 1] W1, float[4] B1, float[4, 2, 3, 3] W2, float[4] B2) => (float[1, 4, H, W] y)
{
  a = Conv (x, W1, B1)
  r = Relu (a)
  y = Conv <pads = [1, 1, 1, 1], group = 2> (r, W2, B2)
}
"""


def test_grouped_padded_conv_border_correction_reads_each_group():
    # Channels 0 (group 0) and 2 (group 1) are constant: each output's correction kernel holds
    # the constant of its own group only. Works with a dynamic spatial size.
    model = tiny(GROUPED_PADDED, zero={"W1": np.s_[[0, 2]]}, values={"B1": [0.5, 1.0, 2.0, 1.5]})
    result = shrink_checked(model, input_shapes={"x": [1, 4, 7, 9]})
    assert shapes(result.model)["W1"] == (2, 4, 1, 1)
    assert shapes(result.model)["W2"] == (4, 1, 3, 3)
    assert [(f.into, f.channels) for f in result.folds] == [("border correction", 2)]
    w2 = init(model, "W2")
    [kernel] = [init(result.model, t.name) for t in result.model.graph.initializer if t.name.endswith("_border")]
    assert np.allclose(kernel[:2, 0], 0.5 * w2[:2, 0], rtol=1e-6)
    assert np.allclose(kernel[2:, 0], 2.0 * w2[2:, 0], rtol=1e-6)


NON_UNIFORM = """
agraph (float[1, 3, 6, 6] x, float[3, 3, 1, 1] Wa, float[3] Ba, float[3, 3, 3, 3] Wb, float[3] Bb, float[2, 3, 3, 3] Wc) => (float[1, 2, 6, 6] y)
{
  a = Conv (x, Wa, Ba)
  r = Relu (a)
  b = Conv <pads = [1, 1, 1, 1]> (r, Wb, Bb)
  s = Relu (b)
  y = Conv <pads = [1, 1, 1, 1]> (s, Wc)
}
"""


def test_a_constant_that_varies_at_the_borders_becomes_a_constant_map_where_that_pays():
    # Channel 0 of r is a uniform constant (border-corrected in conv b); channel 0 of b reads
    # only it, through zero padding, so it is a constant that differs at the borders: no kernel
    # reproduces it, and conv c folds it as a constant map (static shapes) when the map, 2 x 2
    # per output channel here, is no larger than the 3 x 3 weights its removal saves.
    small = NON_UNIFORM.replace("6, 6", "2, 2")
    model = tiny(small, zero={"Wa": np.s_[[0]], "Wb": np.s_[[0], 1:]}, values={"Ba": [1.0, 0.2, 0.3], "Bb": [5.0, 0.1, 0.1]})
    result = shrink_checked(model)
    assert shapes(result.model)["Wb"] == (2, 2, 3, 3)
    assert sorted(f.into for f in result.folds) == ["border correction", "constant map"]
    assert result.after.ops.get("Add") == 2


def test_a_constant_map_larger_than_the_weights_it_saves_is_not_made():
    # The same on 6 x 6 maps: a 2 x 6 x 6 constant map to save 2 x 3 x 3 weights. The channel
    # stays (exactly), and the report says why.
    model = tiny(NON_UNIFORM, zero={"Wa": np.s_[[0]], "Wb": np.s_[[0], 1:]}, values={"Ba": [1.0, 0.2, 0.3], "Bb": [5.0, 0.1, 0.1]})
    result = shrink_checked(model)
    assert shapes(result.model)["Wb"] == (3, 2, 3, 3)
    assert result.after.params <= result.before.params
    assert [f.into for f in result.folds] == ["border correction"]
    [kept] = [g for g in result.kept_zeroed if g.tensor == "Wb"]
    assert kept.kind == "not-absorbable" and "larger than the weights" in kept.reason


def test_with_a_dynamic_size_that_constant_cannot_be_computed_and_stays():
    model = tiny(NON_UNIFORM.replace("6, 6", "H, W"), zero={"Wa": np.s_[[0]], "Wb": np.s_[[0], 1:]},
                 values={"Ba": [1.0, 0.2, 0.3], "Bb": [5.0, 0.1, 0.1]})
    result = shrink_checked(model, input_shapes={"x": [1, 3, 5, 7]})
    assert shapes(result.model)["Wb"] == (3, 2, 3, 3)
    assert [f.into for f in result.folds] == ["border correction"]


GROUPED = """
agraph (float[1, 4, 6, 6] x, float[8, 4, 1, 1] W1, float[8] B1, float[8, 4, 3, 3] W2, float[8] B2, float[3, 8, 1, 1] W3) => (float[1, 3, 6, 6] y)
{
  a = Conv (x, W1, B1)
  r = Relu (a)
  g = Conv <group = 2, pads = [1, 1, 1, 1]> (r, W2, B2)
  s = Relu (g)
  y = Conv (s, W3)
}
"""


def test_grouped_conv_keeps_its_group_structure():
    # One channel of each group (1 and 5) removed from the producer and the grouped conv.
    zero = {"W1": np.s_[[1, 5]], "B1": np.s_[[1, 5]], "W2": np.s_[[1, 5]], "B2": np.s_[[1, 5]]}
    result = shrink_checked(tiny(GROUPED, zero=zero))
    s = shapes(result.model)
    assert s["W1"] == (6, 4, 1, 1)
    assert s["W2"] == (6, 3, 3, 3)
    assert s["W3"] == (3, 6, 1, 1)
    conv = [n for n in result.model.graph.node if n.op_type == "Conv"][1]
    assert next(a.i for a in conv.attribute if a.name == "group") == 2


def test_grouped_conv_drops_a_whole_group():
    zero = {"W1": np.s_[4:], "B1": np.s_[4:], "W2": np.s_[4:], "B2": np.s_[4:]}
    result = shrink_checked(tiny(GROUPED, zero=zero))
    s = shapes(result.model)
    assert s["W2"] == (4, 4, 3, 3)
    conv = [n for n in result.model.graph.node if n.op_type == "Conv"][1]
    assert next(a.i for a in conv.attribute if a.name == "group") == 1


def test_uneven_group_masks_keep_equal_counts_per_group():
    # Two channels pruned in group 0, none in group 1: a grouped conv needs the same count
    # in every group, so group 0 keeps them.
    zero = {"W1": np.s_[[0, 1]], "B1": np.s_[[0, 1]], "W2": np.s_[[0, 1]], "B2": np.s_[[0, 1]]}
    result = shrink_checked(tiny(GROUPED, zero=zero))
    assert shapes(result.model)["W2"] == (8, 4, 3, 3)
    assert {g.kind for g in result.kept_zeroed if g.tensor == "W2"} == {"structure"}


DEPTHWISE = """
agraph (float[1, 3, 6, 6] x, float[6, 3, 1, 1] W1, float[6] B1, float[6, 1, 3, 3] D, float[6] DB, float[2, 6, 1, 1] W3) => (float[1, 2, 6, 6] y)
{
  a = Conv (x, W1, B1)
  r = Clip <min = 0.0, max = 6.0> (a)
  d = Conv <group = 6, pads = [1, 1, 1, 1]> (r, D, DB)
  s = Clip <min = 0.0, max = 6.0> (d)
  y = Conv (s, W3)
}
"""


def test_depthwise_conv_loses_the_channels_of_its_input():
    zero = {"W1": np.s_[[0, 3, 4]], "B1": np.s_[[0, 3, 4]], "D": np.s_[[0, 3, 4]], "DB": np.s_[[0, 3, 4]]}
    result = shrink_checked(tiny(DEPTHWISE, zero=zero, opset=10))
    s = shapes(result.model)
    assert s["D"] == (3, 1, 3, 3)
    assert s["W3"] == (2, 3, 1, 1)
    dw = [n for n in result.model.graph.node if n.op_type == "Conv"][1]
    assert next(a.i for a in dw.attribute if a.name == "group") == 3


CONV1D = """
agraph (float[1, 3, 16] x, float[5, 3, 3] W1, float[5] B1, float[4, 5, 3] W2) => (float[1, 4, 16] y)
{
  a = Conv <pads = [1, 1]> (x, W1, B1)
  r = Relu (a)
  y = Conv <pads = [1, 1]> (r, W2)
}
"""

CONV3D = """
agraph (float[1, 2, 4, 4, 4] x, float[5, 2, 3, 3, 3] W1, float[5] B1, float[3, 5, 1, 1, 1] W2) => (float[1, 3, 4, 4, 4] y)
{
  a = Conv <pads = [1, 1, 1, 1, 1, 1]> (x, W1, B1)
  r = Relu (a)
  y = Conv (r, W2)
}
"""


def test_conv1d_and_conv3d():
    r1 = shrink_checked(tiny(CONV1D, zero={"W1": np.s_[[2]], "B1": np.s_[[2]]}))
    assert shapes(r1.model)["W2"] == (4, 4, 3)
    r3 = shrink_checked(tiny(CONV3D, zero={"W1": np.s_[[0, 1]], "B1": np.s_[[0, 1]]}))
    assert shapes(r3.model)["W2"] == (3, 3, 1, 1, 1)


TRANSPOSED = """
agraph (float[1, 3, 5, 5] x, float[4, 3, 1, 1] W1, float[4] B1, float[4, 6, 2, 2] T, float[6] TB, float[2, 6, 1, 1] W3) => (float[1, 2, 10, 10] y)
{
  a = Conv (x, W1, B1)
  r = Relu (a)
  t = ConvTranspose <strides = [2, 2]> (r, T, TB)
  s = Relu (t)
  y = Conv (s, W3)
}
"""


def test_conv_transpose_prunes_input_and_output_channels():
    zero = {"W1": np.s_[[1]], "B1": np.s_[[1]], "T": np.s_[:, [0, 5]], "TB": np.s_[[0, 5]]}
    result = shrink_checked(tiny(TRANSPOSED, zero=zero))
    s = shapes(result.model)
    assert s["T"] == (3, 4, 2, 2)
    assert s["W3"] == (2, 4, 1, 1)
    assert s["W1"] == (3, 3, 1, 1)


def test_conv_transpose_border_correction():
    # Each output pixel of a stride-2, kernel-2 transposed conv sees one kernel tap: a constant
    # input repeats the kernel pattern, which the correction (a transposed conv of ones) adds.
    model = tiny(TRANSPOSED, zero={"W1": np.s_[[1, 2]]}, values={"B1": [1.0, 0.5, 2.0, -1.0]})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (2, 3, 1, 1)
    assert shapes(result.model)["T"] == (2, 6, 2, 2)
    assert [f.into for f in result.folds] == ["border correction"]


def test_constant_channel_folds_into_the_bias_add_after_a_bias_less_conv():
    # paddle2onnx writes a conv's bias as Conv (no bias) + Add of a [1, C, 1, 1] constant: the
    # removed constant channel goes into that constant, not into a new bias input.
    text = """
g (float[1, 3, 6, 6] x, float[4, 3, 1, 1] W1, float[4] B1, float[5, 4, 1, 1] W2, float[1, 5, 1, 1] C) => (float[1, 5, 6, 6] y) {
  h = Conv (x, W1, B1)
  r = Relu (h)
  c = Conv (r, W2)
  y = Add (c, C)
}
"""
    model = tiny(text, zero={"W1": np.s_[[1]]}, values={"B1": [0.1, 0.5, 0.3, 0.2]})
    result = shrink_checked(model)
    assert shapes(result.model)["W2"] == (5, 3, 1, 1)
    [conv2] = [n for n in result.model.graph.node if n.op_type == "Conv" and "W2" in n.input]
    assert len(conv2.input) == 2
    [add] = [n for n in result.model.graph.node if n.op_type == "Add"]
    assert shapes(result.model)[add.input[1]] == (1, 5, 1, 1)
    assert [(f.op, f.into) for f in result.folds] == [("Conv", "bias")]


# Issue 33 (sweep seed 4000745): channels 1, 3 and 5 of h are constant (zeroed filters, biases
# kept), the MatMul over the width makes them vary along it, and the grouped padded conv reads
# only channel 1 (its second filter is zeroed). Folding channel 1 stores a 2 x 6 x 4 map to take
# out one 3 x 3 column (of the one kept filter of its group): the fold counted channels 3 and 5,
# which no kept output reads, and the map of one output channel, and the shrink grew 10
# parameters (the CLI's guard then wrote the input). Kept, the rest still goes: the zero
# channel 3 of `a` (a's filter and bias, h's column).
GROUPED_FOLD = """
agraph (float[1, 3, 6, 6] x, float[4, 3, 1, 1] W0, float[4] B0, float[6, 4, 1, 1] W1, float[6] B1,
        float[6, 4] M, float[2, 3, 3, 3] W2) => (float[1, 2, 6, 4] y)
{
  a = Conv (x, W0, B0)
  r = Relu (a)
  h = Conv (r, W1, B1)
  m = MatMul (h, M)
  y = Conv <group = 2, pads = [1, 1, 1, 1]> (m, W2)
}
"""


def test_a_fold_that_stores_more_than_it_removes_is_not_made_and_the_rest_still_goes(tmp_path):
    from onnx import numpy_helper

    from onnxshrink import shrink

    model = tiny(GROUPED_FOLD, seed=7, zero={"W0": np.s_[[3]], "B0": np.s_[[3]], "W1": np.s_[[1, 3, 5]], "W2": np.s_[[1]]})
    b1 = init(model, "B1")
    assert np.all(b1[[1, 3, 5]] != 0)  # the constants: the biases, random
    path, out = tmp_path / "m.onnx", tmp_path / "s.onnx"
    onnx.save(model, path)
    result = shrink(path, output=out, validate=False)
    shrunk = onnx.load(out)
    assert error_against(model, shrunk) <= 1e-5
    s = shapes(shrunk)
    assert s["W2"] == (2, 3, 3, 3) and s["W0"] == (3, 3, 1, 1) and s["W1"] == (6, 3, 1, 1)
    assert not result.folds
    assert params(shrunk) == params(model) - (3 + 1 + 6) < params(model)
    assert out.stat().st_size <= path.stat().st_size
    assert not [t for t in shrunk.graph.initializer if numpy_helper.to_array(t).ndim == 4 and t.dims[2:] == [6, 4]]
    # the report says why channel 1 stayed (on main: 124 -> 136 parameters, a 2 x 6 x 4 map)
    [kept] = [g for g in result.kept_zeroed if g.kind == "not-absorbable"]
    assert (kept.tensor, kept.count) == ("W1", 1) and "larger than the weights" in kept.reason
