"""prepare: the shapes the analysis sees, including those only constant folding reveals."""

import numpy as np
from conftest import shapes, shrink_checked, tiny

from onnxshrink.prepare import inferred_shapes

# Token ids expanded to a target the legacy exporter computes from constants, then a split into
# heads whose count is left to the -1: without the folded target, the batch dim of `e` (and all
# that follows) is unknown, and so is the head count.
FOLDED_TARGET = """
agraph (float[1, 4, 6] x, int64[1, 4] Ids, int64[2] Target, int64[2] NegOnes, int64[2] Ones, float[10, 6] Table, float[6, 8] W1, int64[4] Heads, int64[3] Back, float[8, 3] W2) => (float[1, 4, 3] y)
{
  unset = Equal (Target, NegOnes)
  size = Where (unset, Ones, Target)
  ids = Expand (Ids, size)
  e = Gather (Table, ids)
  h = Add (e, x)
  p = MatMul (h, W1)
  q = Reshape (p, Heads)
  r = Relu (q)
  z = Reshape (r, Back)
  y = MatMul (z, W2)
}
"""
VALUES = {
    "Ids": [[1, 2, 3, 4]],
    "Target": [1, 4],
    "NegOnes": [-1, -1],
    "Ones": [1, 1],
    "Heads": [1, 4, -1, 4],
    "Back": [1, 4, 8],
}


def test_shape_arithmetic_on_constants_is_folded_for_shape_inference():
    model = tiny(FOLDED_TARGET, values=VALUES)
    dims = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in inferred_shapes(model)}
    assert dims["ids"] == [1, 4] and dims["e"] == [1, 4, 6] and dims["q"] == [1, 4, 2, 4]
    assert len(model.graph.node) == 10  # the model itself is left as it is


def test_a_head_behind_a_folded_target_is_removed():
    model = tiny(FOLDED_TARGET, zero={"W1": np.s_[:, 4:]}, values=VALUES)
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (6, 4)
    assert shapes(result.model)["W2"] == (4, 3)
