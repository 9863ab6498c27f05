"""Pad, Resize, Tile: untouched axes pass their indices through."""

import numpy as np
import pytest
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


# A BlazeFace block: the shortcut pads x's channels with zeros to the branch's width. x's
# channel i is the pad's channel i + pads_begin; the padded channels are zero, so removing one
# of the Add's channels there removes a branch channel only (the pads shrink instead).
BLAZE = """
agraph (float[1, 3, 8, 8] inp, float[4, 3, 3, 3] W0, float[4] B0, float[4, 1, 3, 3] Wd, float[4] Bd,
        float[7, 4, 1, 1] Wp, float[7] Bp, int64[PN] P, float[3, 7, 1, 1] W2, float[3] B2) => (float[1, 3, 8, 8] y)
{
  x = Conv <pads = [1, 1, 1, 1]> (inp, W0, B0)
  d = Conv <group = 4, pads = [1, 1, 1, 1]> (x, Wd, Bd)
  c = Conv (d, Wp, Bp)
  s = Pad (x, P)
  a = Add (c, s)
  r = Relu (a)
  y = Conv (r, W2, B2)
}
"""


def _blaze(pads, zero, opset=18, axes=None, default_init=False):
    text, values = BLAZE, {"P": pads}
    if axes is not None:  # opset 18: the axes the pads are given for
        text = text.replace("int64[PN] P,", f"int64[PN] P, int64[{len(axes)}] A,").replace("Pad (x, P)", "Pad (x, P, , A)")
        values["A"] = axes
    text = text.replace("PN", str(len(pads)))
    if default_init:  # zero biases, as torch initializes none of them here
        values |= {b: [0.0] * n for b, n in (("B0", 4), ("Bd", 4), ("Bp", 7), ("B2", 3))}
    return tiny(text, zero=zero, values=values, opset=opset)


def _pads(model) -> list[int]:
    pad = next(n for n in model.graph.node if n.op_type == "Pad")
    return [a.ints for a in pad.attribute if a.name == "pads"][0] if pad.input[1:] == [] else init(model, pad.input[1]).tolist()


@pytest.mark.parametrize("default_init", [False, True])
def test_channel_pad_removes_padded_channels_from_the_branch_only(default_init):
    # x's 4 channels are the Add's channels 1..4; 0, 5 and 6 are padded with zeros
    pads = [0, 1, 0, 0, 0, 2, 0, 0]
    model = _blaze(pads, {"Wp": np.s_[[0, 6]], "Bp": np.s_[[0, 6]]}, default_init=default_init)
    result = shrink_checked(model)
    assert shapes(result.model)["Wp"] == (5, 4, 1, 1) and shapes(result.model)["W2"] == (3, 5, 1, 1)
    assert shapes(result.model)["W0"] == (4, 3, 3, 3)  # x keeps its channels
    assert _pads(result.model) == [0, 0, 0, 0, 0, 1, 0, 0]


def test_channel_pad_given_with_axes_and_as_an_attribute():
    model = _blaze([1, 2], {"Wp": np.s_[[5]], "Bp": np.s_[[5]]}, axes=[-3])
    result = shrink_checked(model)
    assert shapes(result.model)["Wp"] == (6, 4, 1, 1) and _pads(result.model) == [1, 1]
    old = tiny(BLAZE.replace("int64[PN] P, ", "").replace("Pad (x, P)", "Pad <pads = [0, 2, 0, 0, 0, 1, 0, 0]> (x)"),
               zero={"Wp": np.s_[[0, 1]], "Bp": np.s_[[0, 1]]}, opset=10)
    result = shrink_checked(old)
    assert shapes(result.model)["Wp"] == (5, 4, 1, 1) and _pads(result.model) == [0, 0, 0, 0, 0, 1, 0, 0]


def test_channel_pad_maps_channel_i_to_i_plus_begin():
    # x's channel 1 (W0's row 1) is zero, the branch's channel 2 too: the Add's channel 2 is
    # zero, and both go (a channel of x is the pad's channel i + 1)
    model = _blaze([0, 1, 0, 0, 0, 2, 0, 0], {"W0": np.s_[[1]], "B0": np.s_[[1]], "Wp": np.s_[[2]], "Bp": np.s_[[2]],
                                                "Wd": np.s_[[1]], "Bd": np.s_[[1]]})
    result = shrink_checked(model)
    assert shapes(result.model)["W0"] == (3, 3, 3, 3) and shapes(result.model)["Wp"] == (6, 3, 1, 1)
    assert _pads(result.model) == [0, 1, 0, 0, 0, 2, 0, 0]


def test_channel_pad_groups_pad_only_channels_without_the_shortcut():
    from onnxshrink.prune import find_groups

    gset = find_groups(_blaze([0, 1, 0, 0, 0, 2, 0, 0], {}))
    by_row = {}
    for g in gset.groups:
        for m in g.members:
            if m.tensor == "Wp" and m.axis == 0 and len(m.indices) == 1:
                by_row[int(m.indices[0])] = g
    assert sorted(by_row) == list(range(7))
    for row in (0, 5, 6):  # padded: the branch's channel alone
        g = by_row[row]
        assert g.exact, g.reason
        assert sorted({m.tensor for m in g.members}) == ["Bp", "W2", "Wp"]
    for row in (1, 2, 3, 4):  # x's channel row - 1: its producer, the depthwise conv, the branch
        members = {(m.tensor, m.axis): sorted(int(i) for i in m.indices) for m in by_row[row].members}
        assert members[("W0", 0)] == [row - 1] and members[("Wp", 0)] == [row]
        assert by_row[row].exact, by_row[row].reason


def test_channel_crop_drops_the_unread_channels():
    text = BLAZE.replace("float[7, 4, 1, 1] Wp, float[7] Bp", "float[3, 4, 1, 1] Wp, float[3] Bp").replace(
        "float[3, 7, 1, 1] W2", "float[3, 3, 1, 1] W2")
    model = tiny(text.replace("PN", "8"), values={"P": [0, -1, 0, 0, 0, 0, 0, 0]}, zero={"Wp": np.s_[:, [0]]}, opset=18)
    result = shrink_checked(model)
    # the pad crops x's channel 0, which the branch does not read (Wp's column 0 is zero): its
    # filter goes, and the crop
    assert shapes(result.model)["W0"] == (3, 3, 3, 3) and _pads(result.model) == [0, 0, 0, 0, 0, 0, 0, 0]


def test_pads_computed_at_run_time_keep_the_channels():
    from onnxshrink.testing import analyze_node

    text = BLAZE.replace("int64[PN] P, ", "").replace("(float[1, 3, 8, 8] inp,", "(float[1, 3, 8, 8] inp, int64[8] P,")
    bench = analyze_node(text, opset=18, zero={"Wp": np.s_[[6]], "Bp": np.s_[[6]]})
    assert bench.kept("c", 1) == list(range(7)) and bench.kept("x", 1) == list(range(4))


def test_channels_padded_with_a_nonzero_value_are_that_constant():
    # the pad value 0.5 fills channels 5 and 6; the branch's channel 6 is zero there: the Add's
    # channel 6 is 0.5 after the Relu, folded into W2's bias, and leaves with the pad
    text = BLAZE.replace("int64[PN] P,", "int64[8] P, float[] V,").replace("Pad (x, P)", "Pad (x, P, V)")
    model = tiny(text, values={"P": [0, 0, 0, 0, 0, 3, 0, 0], "V": 0.5}, zero={"Wp": np.s_[[6]], "Bp": np.s_[[6]]}, opset=18)
    result = shrink_checked(model)
    assert shapes(result.model)["Wp"] == (6, 4, 1, 1) and _pads(result.model) == [0, 0, 0, 0, 0, 2, 0, 0]
    assert [f.into for f in result.folds] == ["bias"]
