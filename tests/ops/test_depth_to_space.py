"""DepthToSpace (ops/depth_to_space.py): channels go as whole blocks, constants fold after it.

Also the worked example of docs/architecture.md's "Adding an op": the handler's rules checked on one node
with the test bench (onnxshrink.testing), then end to end with validation off.
"""

import numpy as np
import pytest
from conftest import shapes, shrink_checked, tiny

from onnxshrink.testing import analyze_node

# A conv in front: graph inputs are the interface and keep every channel; its output does not.
LONE = """
g (float[1, 3, 2, 2] x, float[8, 3, 1, 1] W) => (float[1, 2, 4, 4] y) {{
  c = Conv (x, W)
  y = DepthToSpace <blocksize = 2{mode}> (c)
}}"""


@pytest.mark.parametrize(
    "mode, block", [("", [1, 3, 5, 7]), (', mode = "DCR"', [1, 3, 5, 7]), (', mode = "CRD"', [4, 5, 6, 7])]
)
def test_an_output_channel_needs_its_whole_block(mode, block):
    bench = analyze_node(LONE.format(mode=mode), needs={"y": {1: [1]}})
    assert bench.kept("y", 1) == [1]
    assert bench.kept("c", 1) == block
    assert bench.kept("W", 0) == block  # and so the conv's filters
    assert bench.kept("c", 2) == [0, 1]  # the spatial axes stay whole
    assert bench.barriers == []


def test_constant_output_channels_are_the_blocks_whose_inputs_are_all_constant():
    text = """
    g (float[1, 3, 2, 2] x, float[8, 3, 1, 1] W, float[8] B) => (float[1, 2, 4, 4] y) {
      c = Conv (x, W, B)
      y = DepthToSpace <blocksize = 2> (c)
    }"""
    # Output channel 1's block (DCR: 1, 3, 5, 7) has its filters zeroed: the biases remain.
    bench = analyze_node(text, zero={"W": np.s_[[1, 3, 5, 7]]})
    assert bench.constant_indices("c", 1) == [1, 3, 5, 7]
    assert bench.constant_indices("y", 1) == [1]
    bench = analyze_node(text, zero={"W": np.s_[[1, 3, 5]]})  # one filter of the block is live
    assert bench.constant_indices("y", 1) == []


CHAIN = """
agraph (float[1, 3, 4, 4] x, float[8, 3, 3, 3] W1, float[8] B1, float[3, 2, 1, 1] W2, float[3] B2) => (float[1, 3, 8, 8] y)
{
  c = Conv <pads = [1, 1, 1, 1]> (x, W1, B1)
  r = Relu (c)
  d = DepthToSpace <blocksize = 2> (r)
  y = Conv (d, W2, B2)
}
"""
BLOCK = np.s_[[1, 3, 5, 7]]  # output channel 1 of the DepthToSpace (DCR, C = 2)


def test_a_zeroed_block_is_removed_with_its_filters():
    result = shrink_checked(tiny(CHAIN, zero={"W1": BLOCK, "B1": BLOCK}))
    assert shapes(result.model)["W1"] == (4, 3, 3, 3)
    assert shapes(result.model)["W2"] == (3, 1, 1, 1)
    assert not result.barriers and not result.folds


SMALL = """
agraph (float[1, 3, 1, 1] x, float[8, 3, 1, 1] W1, float[8] B1, float[3, 2, 2, 2] W2, float[3] B2) => (float[1, 3, 1, 1] y)
{
  c = Conv (x, W1, B1)
  r = Relu (c)
  d = DepthToSpace <blocksize = 2> (r)
  y = Conv (d, W2, B2)
}
"""


def test_a_constant_block_is_folded_into_the_next_conv():
    # Filters zeroed, biases kept: relu(bias) of the block's 4 channels, interleaved as 2x2
    # pixels, is a constant (non-uniform) channel after the DepthToSpace; the 2x2 conv after it
    # absorbs it (its output is 1x1: a bias-sized constant for 4 weights saved per filter).
    model = tiny(SMALL, zero={"W1": BLOCK}, values={"B1": np.linspace(0.1, 0.8, 8)})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 3, 1, 1)
    assert shapes(result.model)["W2"] == (3, 1, 2, 2)
    assert [f.channels for f in result.folds] == [1]
    assert result.after.params < result.before.params


def test_a_constant_block_whose_fold_would_not_pay_stays():
    # Folding it before a 1x1 conv would add an 8x8 constant map per output channel to save one
    # weight each: it stays, exactly, and is explained.
    model = tiny(CHAIN, zero={"W1": BLOCK}, values={"B1": np.linspace(0.1, 0.8, 8)})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (8, 3, 3, 3)
    [kept] = [g for g in result.kept_zeroed if g.tensor == "W1"]
    assert kept.count == 4 and kept.kind == "not-absorbable"


def test_a_half_zeroed_block_stays_whole_and_is_explained():
    result = shrink_checked(tiny(CHAIN, zero={"W1": np.s_[[1, 3]], "B1": np.s_[[1, 3]]}))
    assert shapes(result.model)["W1"] == (8, 3, 3, 3)
    [kept] = [g for g in result.kept_zeroed if g.tensor == "W1"]
    assert kept.count == 2 and kept.kind == "live"


def test_a_block_of_channels_is_one_group_with_the_output_channel_it_becomes():
    """The handler ties each input channel to the output channel its block becomes (`ks.unit`),
    so that the coupled groups see what keep() does: conv filters 4c..4c+3 (CRD) go with output
    channel c and the next conv's input column c; and a block whose channel is a graph output is
    no exact group (a pixel-shuffle head: its filters were listed exact, and a prune that chose
    them had to choose again)."""
    import onnx

    from onnxshrink.prune import find_groups

    shuffled = """
    g (float[1, 3, 2, 2] x, float[8, 3, 1, 1] W, float[3, 2, 1, 1] V) => (float[1, 3, 4, 4] y) {
      c = Conv (x, W)
      s = DepthToSpace <blocksize = 2, mode = "CRD"> (c)
      y = Conv (s, V)
    }"""
    gset = find_groups(tiny(shuffled, seed=3))
    w_groups = sorted(
        (sorted(int(i) for m in g.members if m.initializer == "W" for i in m.indices), g.exact,
         sorted(int(i) for m in g.members if m.initializer == "V" for i in m.indices))
        for g in gset.groups if any(m.initializer == "W" and m.axis == 0 for m in g.members)
    )  # fmt: skip
    assert w_groups == [([0, 1, 2, 3], True, [0]), ([4, 5, 6, 7], True, [1])]
    lone = tiny(LONE.format(mode=', mode = "CRD"'), seed=3)
    assert isinstance(lone, onnx.ModelProto)
    heads = [g for g in find_groups(lone).groups if any(m.initializer == "W" and m.axis == 0 for m in g.members)]
    assert heads and not any(g.exact for g in heads)
    assert all("graph input or output" in (g.reason or "") for g in heads)
