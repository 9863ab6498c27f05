"""KeepState: what a barrier holds, including what a control-flow body reads from outside."""

import numpy as np
from conftest import shapes, shrink_checked, tiny

LOOP = """
agraph (float[1, 3, 4, 4] x, float[6, 3, 1, 1] W1, float[6] B1, float[2, 6, 1, 1] W2, int64 N, bool Go, float[1, 6, 4, 4] Zero) => (float[1, 2, 4, 4] y)
{
  c = Conv (x, W1, B1)
  r = Relu (c)
  s = Loop (N, Go, Zero) <body = body (int64 i, bool go, float[1, 6, 4, 4] acc) => (bool go_out, float[1, 6, 4, 4] acc_out) {
      go_out = Identity (go)
      acc_out = Add (acc, r)
  }>
  y = Conv (s, W2)
}
"""


def test_a_loop_body_reading_an_outer_tensor_keeps_it_and_its_producer():
    # `r` has no consumer in the main graph: only the body reads it. Channels 1 and 4 are zero
    # but summed by the loop into a live output, so nothing may go.
    zero = {"W1": np.s_[[1, 4]], "B1": np.s_[[1, 4]], "Zero": np.s_[:]}
    result = shrink_checked(tiny(LOOP, zero=zero, values={"N": 2, "Go": True}))
    assert shapes(result.model)["W1"] == (6, 3, 1, 1)
    assert [n.op_type for n in result.model.graph.node] == ["Conv", "Relu", "Loop", "Conv"]
    # The loop is analyzed, not kept whole: the zero channels stay because the body adds them
    # to the live loop-carried sum.
    assert result.barriers == []
    [kept] = result.kept_zeroed
    assert (kept.tensor, kept.axis, kept.count, kept.kind) == ("W1", 0, 2, "meets-live")
