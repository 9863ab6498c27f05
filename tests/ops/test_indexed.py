"""CumSum, GatherND, ScatterElements: the axes they do not index pass their channels through."""

import numpy as np
import pytest
from conftest import shapes, shrink_checked, tiny

from onnxshrink.testing import analyze_node

# position-ids style: a running sum along the sequence of a [1, T, C] tensor
CUMSUM = """
agraph (float[1, 6, 4] x, float[4, 5] W1, float[5] B1, int64[] A, float[5, 3] W2) => (float[1, 6, 3] y)
{
  h = MatMul (x, W1)
  b = Add (h, B1)
  c = CumSum <reverse = REV> (b, A)
  y = MatMul (c, W2)
}
"""


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("default_init", [False, True])
def test_cumsum_along_the_sequence_passes_channels(reverse, default_init):
    values = {"A": 1} | ({"B1": [0.0] * 5} if default_init else {})
    model = tiny(CUMSUM.replace("REV", str(reverse)), zero={"W1": np.s_[:, [1, 3]], "B1": np.s_[[1, 3]]}, values=values)
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 3) and shapes(result.model)["W2"] == (3, 3)


def test_cumsum_along_the_channels_keeps_them():
    bench = analyze_node(CUMSUM.replace("REV", "0"), values={"A": -1}, zero={"W1": np.s_[:, [0, 1, 3]], "B1": np.s_[[0, 1, 3]]})
    assert bench.kept("b", 2) == list(range(5))
    # a running sum is constant where every term is: channels 0 and 1, not 3 (2 is live)
    assert bench.constant_indices("c", 2) == [0, 1]


def test_cumsum_of_a_constant_channel_is_its_running_sum():
    bench = analyze_node(CUMSUM.replace("REV", "1"), values={"A": 1, "B1": [0.5, 2.0, 0, 0, 0]}, zero={"W1": np.s_[:, [1]]})
    c = bench.constant("c")
    assert c is not None
    got = np.broadcast_to(c.value, (1, 6, 5))[0, :, 1]
    np.testing.assert_allclose(got, 2.0 * np.arange(6, 0, -1))


# a graph network: the node table's features gathered by edge, scattered back by node
GRAPH = """
agraph (float[5, 4] x, float[4, 6] W1, int64[7, 1] I, float[6, 3] W2) => (float[7, 3] y)
{
  h = MatMul (x, W1)
  e = GatherND (h, I)
  y = MatMul (e, W2)
}
"""


def test_gather_nd_passes_the_features_of_the_rows_it_looks_up():
    idx = [[0], [4], [2], [2], [1], [3], [0]]
    model = tiny(GRAPH, zero={"W1": np.s_[:, [0, 5]]}, values={"I": idx})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 4) and shapes(result.model)["W2"] == (4, 3)


def test_gather_nd_by_run_time_indices_keeps_the_rows_and_ties_the_features():
    text = GRAPH.replace("float[5, 4] x, float[4, 6] W1, int64[7, 1] I,", "float[5, 4] x, int64[7, 1] i, float[4, 6] W1,")
    bench = analyze_node(text.replace("GatherND (h, I)", "GatherND (h, i)"), zero={"W1": np.s_[:, [0, 5]]})
    assert bench.kept("h", 1) == [1, 2, 3, 4] and bench.kept("h", 0) == list(range(5))
    assert bench.constant_indices("e", 1) == [0, 5]


def test_gather_nd_with_batch_dims():
    text = """
    agraph (float[2, 5, 4] x, float[4, 6] W1, int64[2, 3, 1] I, float[6, 3] W2) => (float[2, 3, 3] y)
    {
      h = MatMul (x, W1)
      e = GatherND <batch_dims = 1> (h, I)
      y = MatMul (e, W2)
    }
    """
    model = tiny(text, zero={"W1": np.s_[:, [2]]}, values={"I": [[[0], [4], [1]], [[3], [3], [2]]]})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 5)


SCATTER = """
agraph (float[5, 4] x, float[4, 6] W1, float[3, 4] u, float[4, 6] Wu, int64[3, 6] I, float[6, 2] W2) => (float[5, 2] y)
{
  h = MatMul (x, W1)
  v = MatMul (u, Wu)
  s = ScatterElements <axis = 0, reduction = "add"> (h, I, v)
  y = MatMul (s, W2)
}
"""


def test_scatter_elements_passes_the_channels_it_does_not_index():
    idx = [[0, 1, 2, 3, 4, 0], [4, 2, 2, 1, 0, 3], [1, 1, 0, 4, 4, 2]]
    # channel 3 zero in both the table and the updates: it goes from both
    model = tiny(SCATTER, zero={"W1": np.s_[:, [3]], "Wu": np.s_[:, [3]]}, values={"I": idx})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 5) and shapes(result.model)["Wu"] == (4, 5)
    assert shapes(result.model)["I"] == (3, 5)


def test_scatter_elements_with_fewer_update_channels():
    text = SCATTER.replace("float[4, 6] Wu, int64[3, 6] I", "float[4, 4] Wu, int64[3, 4] I")
    idx = [[0, 1, 2, 3], [4, 2, 2, 1], [1, 1, 0, 4]]
    # channel 5 is written by no update: the table's zero channel goes alone; channel 1 is zero
    # in both; channel 2 only in the table (the updates keep it live)
    model = tiny(text, zero={"W1": np.s_[:, [1, 2, 5]], "Wu": np.s_[:, [1]]}, values={"I": idx})
    result = shrink_checked(model)
    assert shapes(result.model)["W1"] == (4, 4) and shapes(result.model)["Wu"] == (4, 3)
