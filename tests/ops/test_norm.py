"""Normalizations: BatchNorm/InstanceNorm per channel; Softmax mixes channels; LayerNorm and GroupNorm
mix them but let zero ones go (tests/ops/test_norm_width.py)."""

import numpy as np
from conftest import shapes, shrink_checked, tiny

BN = """
agraph (float[1, 3, 5, 5] x, float[4, 3, 3, 3] W1, float[4] S, float[4] B, float[4] M, float[4] V, float[2, 4, 1, 1] W2) => (float[1, 2, 5, 5] y)
{
  c = Conv <pads = [1, 1, 1, 1]> (x, W1)
  n = BatchNormalization (c, S, B, M, V)
  r = Relu (n)
  y = Conv (r, W2)
}
"""

VAR = {"V": [0.5, 1.2, 2.0, 0.8]}


def test_unfolded_batchnorm_channels_go_with_the_conv():
    zero = {"W1": np.s_[[1]], "S": np.s_[[1]], "B": np.s_[[1]]}
    result = shrink_checked(tiny(BN, zero=zero, values=VAR))
    s = shapes(result.model)
    assert s["W1"] == (3, 3, 3, 3)
    assert s["S"] == s["B"] == s["M"] == s["V"] == (3,)
    assert s["W2"] == (2, 3, 1, 1)


def test_zero_bn_scale_makes_a_constant_folded_into_the_next_bias():
    # Scale 0: the channel is BN's shift whatever the conv; the conv keeps no filter for it.
    model = tiny(BN, zero={"S": np.s_[[2]]}, values={**VAR, "B": [0.1, 0.2, 0.9, 0.3]})
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["W1"] == (3, 3, 3, 3)
    assert s["W2"] == (2, 3, 1, 1)
    assert [f.into for f in result.folds] == ["bias"]


def test_conv_only_mask_leaves_a_batchnorm_shift_constant_and_folds_it():
    # The usual pruner mask: the filter is zero, BatchNorm untouched.
    model = tiny(BN, zero={"W1": np.s_[[0]]}, values={**VAR, "B": [2.0, 0.1, 0.2, 0.3]})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (3, 3, 3, 3)
    assert [f.into for f in result.folds] == ["bias"]


LAYERNORM = """
agraph (float[2, 3, 6] x, float[6, 4] W1, float[4] B1, float[4] G, float[4] Z, float[4, 2] W2) => (float[2, 3, 2] y)
{
  m = MatMul (x, W1)
  a = Add (m, B1)
  n = LayerNormalization <axis = -1> (a, G, Z)
  y = MatMul (n, W2)
}
"""


def test_layernorm_keeps_every_hidden_channel_and_says_why():
    result = shrink_checked(tiny(LAYERNORM, zero={"W1": np.s_[:, [1]], "B1": np.s_[[1]]}, opset=17))
    assert shapes(result.model)["W1"] == (6, 4)
    [group] = [g for g in result.kept_zeroed if g.tensor == "W1" and g.axis == 1]
    assert group.kind == "normalization" and "LayerNormalization" in group.reason


SOFTMAX = """
agraph (float[2, 6] x, float[5, 6] W1, float[5] B1, float[3, 5] W2) => (float[2, 3] y)
{
  a = Gemm <transB = 1> (x, W1, B1)
  p = Softmax <axis = 1> (a)
  y = Gemm <transB = 1> (p, W2)
}
"""


def test_softmax_over_the_pruned_axis_keeps_it():
    result = shrink_checked(tiny(SOFTMAX, zero={"W1": np.s_[[0]], "B1": np.s_[[0]]}))
    assert shapes(result.model)["W1"] == (5, 6)
    assert {g.kind for g in result.kept_zeroed if g.tensor == "W1"} == {"normalization"}


INSTANCENORM = """
agraph (float[1, 3, 5, 5] x, float[4, 3, 3, 3] W1, float[4] B1, float[4] S, float[4] T, float[2, 4, 1, 1] W2) => (float[1, 2, 5, 5] y)
{
  c = Conv <pads = [1, 1, 1, 1]> (x, W1, B1)
  n = InstanceNormalization (c, S, T)
  r = Relu (n)
  y = Conv (r, W2)
}
"""


def test_instance_norm_is_per_channel():
    zero = {"W2": np.s_[:, [3]]}
    result = shrink_checked(tiny(INSTANCENORM, zero=zero))
    s = shapes(result.model)
    assert s["W1"] == (3, 3, 3, 3)
    assert s["S"] == s["T"] == (3,)


GROUPNORM = """
agraph (float[1, 3, 5, 5] x, float[4, 3, 1, 1] W1, float[4] B1, float[4] S, float[4] T, float[2, 4, 1, 1] W2) => (float[1, 2, 5, 5] y)
  <float[1, 4, 5, 5] n>
{
  c = Conv (x, W1, B1)
  n = GroupNormalization <num_groups = 2> (c, S, T)
  y = Conv (n, W2)
}
"""


def test_group_norm_keeps_a_group_that_is_not_wholly_zero():
    # Channel 0 is zero, channel 1 of its group is not: the group's statistics need both.
    result = shrink_checked(tiny(GROUPNORM, zero={"W1": np.s_[[0]], "B1": np.s_[[0]]}, opset=21))
    assert shapes(result.model)["W1"] == (4, 3, 1, 1)
    assert {g.kind for g in result.kept_zeroed if g.tensor == "W1"} == {"normalization"}
    assert not result.barriers


ZERO_SCALE_GATHER = """
agraph (float[N, 3, 4, 4] x, float[6, 3, 1, 1] W, float[6] Sc, float[6] Bi, float[6] Mu, float[6] Va, int64 I, float[6] S2, float[6] B2, float[5, 6, 1] W3) => (float[N, 5, 4] y)
{
  c = Conv (x, W)
  b = BatchNormalization (c, Sc, Bi, Mu, Va)
  g = Gather <axis = 3> (b, I)
  i = InstanceNormalization (g, S2, B2)
  y = Conv (i, W3)
}
"""


def test_batchnorm_with_zero_scales_then_a_scalar_gather_and_instance_norm():
    # A zero scale makes the channel BN's constant shift; InstanceNorm of a constant channel
    # is its own shift: constant again, folded into the last conv. Dynamic batch.
    model = tiny(ZERO_SCALE_GATHER, zero={"Sc": np.s_[[1, 4]]}, values={"I": 2, "Va": np.ones(6)})
    result = shrink_checked(model, input_shapes={"x": [2, 3, 4, 4]})
    assert shapes(result.model)["W"] == (4, 3, 1, 1)
    assert shapes(result.model)["W3"] == (5, 4, 1)


# InstanceNorm's statistics cancel where its gain is zero (whatever the input: the channel is
# its bias) and where its input channel is one constant all over the map (x - mean is 0); a
# constant channel that varies over the map (a transposed conv's borders) is computed at full
# shape. The removed channels fold into the next transposed conv, borders and all.
IN_CHAIN = """
agraph (float[1, 3, 6, 6] x, float[4, 3, 3, 3] W0, float[4] B0, float[4, 1, KK, KK] Wd, float[4] Bd,
        float[4] S1, float[4] T1, float[4] M1, float[4] V1, float[4] G, float[4] Bi,
        float[4, 3, 3, 3] W2, float[3] B2, float[2, 3, 3, 3] W3) => (float[1, 2, 6, 6] y)
{
  c = Conv <pads = [1, 1, 1, 1]> (x, W0, B0)
  p = MaxPool <kernel_shape = [2, 2], pads = [0, 0, 1, 1]> (c)
  d = ConvTranspose <group = 4, pads = [PP, PP, PP, PP]> (p, Wd, Bd)
  n = BatchNormalization (d, S1, T1, M1, V1)
  i = InstanceNormalization (n, G, Bi)
  t = ConvTranspose (i, W2, B2)
  y = Conv (t, W3)
}
"""


def _in_chain(k: int, **values):
    text = IN_CHAIN.replace("KK", str(k)).replace("PP", str(k // 2))
    return text, values


def test_instance_norm_with_zero_gain_and_bias_gives_zero_channels():
    text, values = _in_chain(3, G=[1.2, 0.0, 0.8, 0.0], Bi=[0.3, 0.0, -0.2, 0.0], V1=[1, 1, 1, 1])
    result = shrink_checked(tiny(text, values=values))  # channels 1 and 3 are 0 for any input
    assert shapes(result.model)["W2"] == (2, 3, 3, 3) and shapes(result.model)["Wd"] == (2, 1, 3, 3)
    assert shapes(result.model)["W0"] == (2, 3, 3, 3)  # nothing else reads them


def test_instance_norm_of_a_channel_uniform_over_the_map_is_its_bias():
    # BN's zero scale makes channel 2 its shift, one value all over the map (a short binary
    # fraction, so that the runtime's own statistics of it are exact too): InstanceNorm gives
    # its bias there, a constant the transposed conv after it folds with its borders
    text, values = _in_chain(1, S1=[1.1, 0.9, 0.0, 1.3], T1=[0.1, -0.2, 0.375, 0.4], V1=[1, 1, 1, 1],
                             G=[0.7, 1.1, 1.4, 0.9], Bi=[0.1, 0.2, 0.6, -0.3])
    result = shrink_checked(tiny(text, values=values))
    assert shapes(result.model)["W2"] == (3, 3, 3, 3)
    assert [f.into for f in result.folds] == ["border correction"]


def test_a_constant_channel_through_a_transposed_conv_with_borders_is_computed_at_full_shape():
    # W0's filter 1 is zero: channel 1 is B0's value, uniform; the depthwise transposed conv
    # with padding gives it borders (they see fewer taps), InstanceNorm normalizes that map
    # (computed at full shape, not its bias); folding a map that varies into the next
    # transposed conv would take more than the 9 weights per filter it saves: it stays
    text, values = _in_chain(3, B0=[0.2, 0.5, -0.1, 0.3], V1=[1, 1, 1, 1])
    model = tiny(text, values=values, zero={"W0": np.s_[[1]]})
    from onnxshrink.testing import analyze_node

    bench = analyze_node(model)
    d = np.broadcast_to(bench.constant("d").value, (1, 4, 6, 6))[0, 1]
    assert d[0, 0] != d[2, 2] and d[2, 2] == d[3, 3]  # its borders differ from its interior
    i = np.broadcast_to(bench.constant("i").value, (1, 4, 6, 6))[0, 1]
    assert i[0, 0] != i[2, 2]  # normalized, not the bias
    result = shrink_checked(model)
    assert shapes(result.model)["W2"] == (4, 3, 3, 3) and result.folds == []


def test_library_default_instance_norm_keeps_every_live_channel():
    # unit gain, zero bias (torch's default): no channel is constant unless its input is
    text, values = _in_chain(3, G=[1.0] * 4, Bi=[0.0] * 4, B0=[0.0] * 4, Bd=[0.0] * 4)
    result = shrink_checked(tiny(text, values=values, zero={"W0": np.s_[[2]]}))
    # W0's filter 2 is zero with a zero bias: 0 through the chain, then the bias of the
    # depthwise conv (0), BN's shift, InstanceNorm of a uniform map: its bias, 0 -> it goes
    assert shapes(result.model)["W2"] == (3, 3, 3, 3)


GROUPNORM_UNIFORM = """
agraph (float[1, 3, 5, 5] x, float[6, 3, 1, 1] W1, float[6] S1, float[6] T1, float[6] M1, float[6] V1,
        float[6] S, float[6] T, float[2, 6, 3, 3] W2) => (float[1, 2, 3, 3] y)
  <float[1, 6, 5, 5] n>
{
  c = Conv (x, W1)
  b = BatchNormalization (c, S1, T1, M1, V1)
  n = GroupNormalization <num_groups = 3> (b, S, T)
  y = Conv (n, W2)
}
"""


def test_group_norm_lets_a_group_of_one_constant_go():
    # BN's zero scales make channels 2 and 3 (group 1) one constant, 0.25: the group's
    # statistics cancel, it is its bias and leaves whole
    values = {"S1": [1, 1, 0, 0, 1, 0], "T1": [0.1, 0.2, 0.25, 0.25, 0.3, 0.5], "V1": [1] * 6}
    result = shrink_checked(tiny(GROUPNORM_UNIFORM, values=values, opset=21))
    assert shapes(result.model)["W2"] == (2, 4, 3, 3) and shapes(result.model)["W1"] == (4, 3, 1, 1)
    gn = next(n for n in result.model.graph.node if n.op_type == "GroupNormalization")
    assert [a.i for a in gn.attribute if a.name == "num_groups"] == [2]
