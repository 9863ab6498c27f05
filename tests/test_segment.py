"""Cutting a model for the proof: the repeated blocks are found from the nodes that read
weights, whatever shared nodes an exporter hoists into the first block."""

from __future__ import annotations

from conftest import tiny

from onnxshrink.proof.segment import blocks, prefix

# Three residual blocks; the first also computes a shared table (s) the later ones read, as
# exporters hoist rotary tables into the first layer.
THREE = """
g (float[1, 4, 8] x, float[8, 8] W0, float[8, 8] W1, float[8, 8] W2, float[8] S) => (float[1, 4, 8] y) {
  s = Sigmoid (S)
  a0 = MatMul (x, W0)
  m0 = Mul (a0, s)
  h0 = Add (x, m0)
  a1 = MatMul (h0, W1)
  m1 = Mul (a1, s)
  h1 = Add (h0, m1)
  a2 = MatMul (h1, W2)
  m2 = Mul (a2, s)
  y = Add (h1, m2)
}
"""


def test_blocks_from_the_weight_readers():
    model = tiny(THREE)
    found = blocks(model)
    assert found is not None and found.count == 3 and found.period == 1
    names = [n.output[0] for n in model.graph.node]
    # after block 1: the residual stream h0 and the shared table s cross the cut
    assert names[found.end(1) - 1] == "h0"
    head = prefix(model, found.end(1))
    assert head is not None and sorted(head.outputs) == ["h0", "s"] and head.nodes == 4
    assert names[found.end(2) - 1] == "h1"


def test_the_tensors_crossing_each_cut_counted_in_one_pass():
    """`_crossing` (what `blocks` picks the narrowest cut by) counts, at every cut, the tensors
    made before it and read from it on or given out: s from its making to the last block's
    Mul, the stream one block at a time, and y, a graph output, after the last node alone."""
    from onnxshrink.proof.segment import _crossing, _frontier

    model = tiny(THREE)
    nodes = list(model.graph.node)
    counts = _crossing(nodes, {"y"}).tolist()
    assert counts == [0, 1, 2, 2, 2, 3, 3, 2, 3, 2, 1]
    assert counts == [len(_frontier(nodes, c, {"y"})) for c in range(len(nodes) + 1)]


# Three residual blocks of int8 weights, each dequantized at the top of the graph, as
# onnxruntime's quantize_static writes them: a layer uses its weights where its MatMul is.
HOISTED = """
g (float[1, 4, 8] x, int8[8, 8] W0, int8[8, 8] W1, int8[8, 8] W2, float S, int8 Z) => (float[1, 4, 8] y) {
  d0 = DequantizeLinear (W0, S, Z)
  d1 = DequantizeLinear (W1, S, Z)
  d2 = DequantizeLinear (W2, S, Z)
  a0 = MatMul (x, d0)
  h0 = Add (x, a0)
  a1 = MatMul (h0, d1)
  h1 = Add (h0, a1)
  a2 = MatMul (h1, d2)
  y = Add (h1, a2)
}
"""


def test_blocks_of_weights_dequantized_at_the_top_are_where_they_are_read():
    model = tiny(HOISTED)
    found = blocks(model)
    assert found is not None and found.count == 3 and found.period == 1
    names = [n.output[0] for n in model.graph.node]
    assert names[found.end(1) - 1] == "h0" and names[found.end(2) - 1] == "h1"
    # the later blocks' dequantized weights are theirs, not the first block's result
    head = prefix(model, found.end(1))
    assert head is not None and head.outputs == ["h0"] and head.nodes == 3
