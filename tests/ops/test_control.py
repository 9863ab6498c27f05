"""If, Loop and Scan (ops/control.py): channels inside bodies are channels; weights read inside
bodies are sliced where they are, once; a model never grows.

Each shrunk model is checked here, with validation off, against the model as given (its zeros
are the masks) in onnxruntime, on both branch conditions and several trip counts."""

import numpy as np
import onnx
import pytest
from conftest import params, run, tiny
from onnx import helper, numpy_helper

from onnxshrink import ir, shrink
from onnxshrink.prune import prune


def body_weights(model: onnx.ModelProto, values: dict, as_nodes: bool) -> onnx.ModelProto:
    """Give the bodies' placeholder Constant nodes (`W = Constant <value_float = 0.0> ()`) their
    values: as Constant nodes (how spox and paddle2onnx store weights) or as initializers of the
    body that reads them."""
    for g in list(ir.all_graphs(model.graph))[1:]:
        for n in list(g.node):
            if n.op_type != "Constant" or n.output[0] not in values:
                continue
            v = np.asarray(values[n.output[0]], np.float32)
            if as_nodes:
                del n.attribute[:]
                n.attribute.append(helper.make_attribute("value", numpy_helper.from_array(v)))
            else:
                g.node.remove(n)
                g.initializer.append(numpy_helper.from_array(v, n.output[0]))
    onnx.checker.check_model(model)
    return model


def check(model: onnx.ModelProto, shrunk: onnx.ModelProto, feeds: list[dict]) -> None:
    """The shrunk model computes what the model as given computes, on every feed; its declared
    shapes (the bodies' inputs and outputs included) agree with onnx's strict inference."""
    onnx.checker.check_model(shrunk, full_check=True)
    for feed in feeds:
        for a, b in zip(run(model, feed), run(shrunk, feed), strict=True):
            assert a.shape == b.shape
            if a.size:  # a loop run zero times stacks nothing
                assert np.abs(a - b).max() <= 1e-5 * max(np.abs(a).max(), 1e-30), feed


def weights(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every initializer of every graph, by name, with its shape; each name stored once."""
    found = [(t.name, tuple(t.dims)) for g in ir.all_graphs(model.graph) for t in g.initializer]
    assert len({n for n, _ in found}) == len(found), "an initializer is stored more than once"
    return dict(found)


def bodies_weights(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(t.dims) for g in list(ir.all_graphs(model.graph))[1:] for t in g.initializer}


def rng_feeds(seed: int = 0, **fixed: np.ndarray) -> dict:
    x = np.random.default_rng(seed).standard_normal((1, 3, 4, 4)).astype(np.float32)
    return {"x": x, **fixed}


# ---------------------------------------------------------------------------------- If
# A conv stem, an If whose branches both read the outer weight W2 (and B2), and a conv after it.
IF_SHARED = """
agraph (float[1, 3, 4, 4] x, bool c, float[{c1}, 3, 1, 1] W1, float[{c1}] B1, float[{c2}, {c1}, 1, 1] W2, float[{c2}] B2, float[2, {c2}, 1, 1] W3) => (float[1, 2, 4, 4] y)
{{
  h = Conv (x, W1, B1)
  r = Relu (h)
  b = If (c) <then_branch = then_g () => (float[1, {c2}, 4, 4] t) {{
      t0 = Conv (r, W2, B2)
      t = Relu (t0)
  }}, else_branch = else_g () => (float[1, {c2}, 4, 4] e) {{
      e0 = Conv (r, W2, B2)
      e = Tanh (e0)
  }}>
  y = Conv (b, W3)
}}
"""
FEEDS_C = [rng_feeds(s, c=np.array(v)) for s in range(2) for v in (True, False)]


@pytest.mark.parametrize("init", ["random", "default"])
def test_weights_both_branches_read_are_sliced_once_as_a_native_model(init):
    # Stem channels 1 and 4 masked (filters and biases): W2 loses those input columns in both
    # branches. W2's filters 0 and 3 masked with their biases: Relu and Tanh both give 0 there,
    # a constant whichever branch runs; W3 then loses those columns.
    values = {"B1": np.zeros(6), "B2": np.zeros(5)} if init == "default" else None
    zero = {"W1": np.s_[[1, 4]], "B1": np.s_[[1, 4]], "W2": np.s_[[0, 3]], "B2": np.s_[[0, 3]]}
    model = tiny(IF_SHARED.format(c1=6, c2=5), zero=zero, values=values)
    result = shrink(model, validate=False)
    check(model, result.model, FEEDS_C)
    w = weights(result.model)
    assert w["W1"] == (4, 3, 1, 1) and w["W2"] == (3, 4, 1, 1) and w["W3"] == (2, 3, 1, 1)
    assert bodies_weights(result.model) == {}  # W2 and B2 stay in the main graph, once
    native = tiny(IF_SHARED.format(c1=4, c2=3))
    assert params(result.model) == params(native) < params(model)
    assert result.barriers == []


def test_a_constant_channel_both_branches_absorb_is_folded_into_their_shared_bias_once():
    # Stem filters 1 and 4 masked, their biases left: relu(bias) is a constant each branch's
    # conv folds into B2, which both read: the folded bias is stored once, as B2 was.
    model = tiny(IF_SHARED.format(c1=6, c2=5), zero={"W1": np.s_[[1, 4]]}, values={"B1": np.linspace(0.5, 1.0, 6)})
    result = shrink(model, validate=False)
    check(model, result.model, FEEDS_C)
    assert weights(result.model) == {"W1": (4, 3, 1, 1), "B1": (4,), "W2": (5, 4, 1, 1), "B2": (5,), "W3": (2, 5, 1, 1)}
    assert [f.channels for f in result.folds] == [2, 2]
    assert params(result.model) == params(model) - 2 * 3 - 2 - 2 * 5


def test_a_weight_read_outside_and_inside_a_branch_is_sliced_once_for_both():
    # W2 is read by a conv of the main graph and by both branches: one tensor, one slice, the
    # stem's masked channels gone from its columns and its own masked filters from its rows.
    text = IF_SHARED.format(c1=6, c2=5).replace(
        ") => (float[1, 2, 4, 4] y)", ", float[2, 5, 1, 1] W4) => (float[1, 2, 4, 4] y, float[1, 2, 4, 4] z)"
    ).replace("  y = Conv (b, W3)", "  y = Conv (b, W3)\n  p = Conv (r, W2)\n  z = Conv (p, W4)")
    zero = {"W1": np.s_[[1, 4]], "B1": np.s_[[1, 4]], "W2": np.s_[[0, 3]], "B2": np.s_[[0, 3]]}
    model = tiny(text, zero=zero)
    result = shrink(model, validate=False)
    check(model, result.model, FEEDS_C)
    w = weights(result.model)
    assert w["W2"] == (3, 4, 1, 1) and w["W3"] == (2, 3, 1, 1) and w["W4"] == (2, 3, 1, 1)
    assert bodies_weights(result.model) == {}


IF_OWN = """
agraph (float[1, 3, 4, 4] x, bool c, float[6, 3, 1, 1] W1, float[2, 4, 1, 1] W3) => (float[1, 2, 4, 4] y)
{
  r = Conv (x, W1)
  b = If (c) <then_branch = then_g () => (float[1, 4, 4, 4] t) {
      Wt = Constant <value_float = 0.0> ()
      Bt = Constant <value_float = 0.0> ()
      Vt = Constant <value_float = 0.0> ()
      t0 = Conv (r, Wt, Bt)
      t1 = Relu (t0)
      t = Conv (t1, Vt)
  }, else_branch = else_g () => (float[1, 4, 4, 4] e) {
      We = Constant <value_float = 0.0> ()
      e0 = Conv (r, We)
      e = Tanh (e0)
  }>
  y = Conv (b, W3)
}
"""


def own_weights(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"Wt": (5, 6, 1, 1), "Bt": (5,), "Vt": (4, 5, 1, 1), "We": (4, 6, 1, 1)}
    return {k: rng.standard_normal(v) for k, v in shapes.items()}


@pytest.mark.parametrize("as_nodes", [True, False], ids=["constant-nodes", "initializers"])
def test_channels_inside_a_branch_go_with_the_branchs_own_weights(as_nodes):
    w = own_weights(1)
    w["Wt"][[1, 3]], w["Bt"][[1, 3]] = 0, 0  # filters of the then-branch's hidden layer
    model = body_weights(tiny(IF_OWN), w, as_nodes)
    result = shrink(model, validate=False)
    check(model, result.model, FEEDS_C)
    inner = bodies_weights(result.model)
    # the then-branch's hidden channels 1 and 3 go (Wt filters, Bt entries, Vt columns): sliced
    # where they live, in the branch
    assert inner["Wt"] == (3, 6, 1, 1) and inner["Bt"] == (3,) and inner["Vt"] == (4, 3, 1, 1)
    assert inner["We"] == (4, 6, 1, 1) and weights(result.model)["W1"] == (6, 3, 1, 1)


def test_an_outer_channel_no_branch_reads_goes_and_one_output_channel_goes_from_both():
    # Stem channels 2 and 5: neither branch reads them (Wt's, We's input columns zero); If
    # output channel 0 is zero in both branches (Vt's and We's filter 0) and W3 reads it not.
    w = own_weights(2)
    w["Wt"][:, [2, 5]], w["We"][:, [2, 5]] = 0, 0
    w["Vt"][0], w["We"][0] = 0, 0
    model = body_weights(tiny(IF_OWN, zero={"W3": np.s_[:, [0]]}), w, True)
    result = shrink(model, validate=False)
    check(model, result.model, FEEDS_C)
    inner, outer = bodies_weights(result.model), weights(result.model)
    assert outer["W1"] == (4, 3, 1, 1) and outer["W3"] == (2, 3, 1, 1)
    assert inner["Wt"] == (5, 4, 1, 1) and inner["Vt"] == (3, 5, 1, 1) and inner["We"] == (3, 4, 1, 1)


WRAPPED = """
agraph (float[1, 3, 4, 4] x, int64 sr) => (float[1, 2, 4, 4] y) {
  k = Constant <value_int = 16000> ()
  c = Equal (sr, k)
  y = If (c) <then_branch = then_g () => (float[1, 2, 4, 4] t) {
      A = Constant <value_float = 0.0> ()
      B = Constant <value_float = 0.0> ()
      t0 = Conv (x, A)
      t1 = Relu (t0)
      t = Conv (t1, B)
  }, else_branch = else_g () => (float[1, 2, 4, 4] e) {
      C = Constant <value_float = 0.0> ()
      D = Constant <value_float = 0.0> ()
      e0 = Conv (x, C)
      e1 = Relu (e0)
      e = Conv (e1, D)
  }>
}"""
SR_FEEDS = [{"x": rng_feeds(s)["x"], "sr": np.array(sr, np.int64)} for s in range(2) for sr in (16000, 8000)]


def test_a_model_wrapped_whole_in_an_if_loses_channels():
    # spox writes Silero VAD so: the whole model in the branches of an If on an input (the
    # sample rate), every weight a Constant node inside them.
    rng = np.random.default_rng(3)
    shapes = dict(A=(6, 3, 1, 1), B=(2, 6, 1, 1), C=(8, 3, 1, 1), D=(2, 8, 1, 1))
    values = {k: rng.standard_normal(v) for k, v in shapes.items()}
    values["A"][[0, 2]], values["C"][[1, 5, 6]] = 0, 0
    model = body_weights(tiny(WRAPPED), values, as_nodes=True)
    result = shrink(model, validate=False)
    check(model, result.model, SR_FEEDS)
    inner = bodies_weights(result.model)
    assert inner == {"A": (4, 3, 1, 1), "B": (2, 4, 1, 1), "C": (5, 3, 1, 1), "D": (2, 5, 1, 1)}
    assert params(result.model) == params(model) - 2 * 3 - 2 * 2 - 3 * 3 - 3 * 2


def test_branches_of_different_ranks_keep_the_channels_they_return_and_say_why():
    # Squeeze in one branch, Identity in the other (torch's export of a conditional squeeze):
    # the If's output has no one rank, so the channels it carries are kept whole.
    text = """
    agraph (float[1, 3, 4] x, bool c, float[6, 3, 1] W1, float[6, 1] W2) => (float[1, 1] y) {
      h = Conv (x, W1)
      a = ReduceMean <axes = [2], keepdims = 1> (h)
      s = If (c) <then_branch = then_g () => (float[1, 6] t) {
          k = Constant <value_ints = [2]> ()
          t = Squeeze (a, k)
      }, else_branch = else_g () => (float[1, 6, 1] e) {
          e = Identity (a)
      }>
      f = Flatten (s)
      y = MatMul (f, W2)
    }"""
    model = tiny(text, zero={"W1": np.s_[[1, 4]]})
    result = shrink(model, validate=False)
    rng = np.random.default_rng(0)
    check(model, result.model, [{"x": rng.standard_normal((1, 3, 4)).astype(np.float32), "c": np.array(True)}])
    assert weights(result.model)["W1"] == (6, 3, 1)
    [kept] = [g for g in result.kept_zeroed if g.tensor == "W1"]
    assert "If" in kept.reason and "ranks" in kept.reason


def test_an_if_output_nothing_reads_leaves_the_if_and_both_branches():
    text = """
    agraph (float[1, 3, 4, 4] x, bool c, float[4, 3, 1, 1] W1, float[4, 3, 1, 1] W2) => (float[1, 4, 4, 4] y) {
      y, unused = If (c) <then_branch = then_g () => (float[1, 4, 4, 4] t, float[1, 4, 4, 4] tu) {
          t = Conv (x, W1)
          tu = Conv (x, W2)
      }, else_branch = else_g () => (float[1, 4, 4, 4] e, float[1, 4, 4, 4] eu) {
          e0 = Conv (x, W1)
          e = Relu (e0)
          eu = Conv (x, W2)
      }>
    }"""
    model = tiny(text)
    result = shrink(model, validate=False)
    check(model, result.model, FEEDS_C)
    [node] = [n for n in result.model.graph.node if n.op_type == "If"]
    assert len(node.output) == 1 and "W2" not in weights(result.model)
    assert [len(a.g.output) for a in node.attribute] == [1, 1]


# ---------------------------------------------------------------------------------- Loop
# h0 = x @ W0; each iteration: h = tanh(h @ U + x @ Wx), U held by the body; the final state
# and the states of every step (a scan output) read through V and V2.
LOOP = """
agraph (float[1, 3] x, int64 m, float[3, 6] W0, float[3, 6] Wx, float[6, 2] V, float[6, 2] V2) => (float[1, 2] y, float[steps, 1, 2] z)
{
  go = Constant <value = bool {1}> ()
  h0 = MatMul (x, W0)
  hT, seq = Loop (m, go, h0) <body = body (int64 i, bool go_in, float[1, 6] h) => (bool go_out, float[1, 6] h1, float[1, 6] ys) {
      U = Constant <value_float = 0.0> ()
      go_out = Identity (go_in)
      a = MatMul (h, U)
      b = MatMul (x, Wx)
      s = Add (a, b)
      h1 = Tanh (s)
      ys = Identity (h1)
  }>
  y = MatMul (hT, V)
  z = MatMul (seq, V2)
}
"""
LOOP_FEEDS = [
    {"x": np.random.default_rng(s).standard_normal((1, 3)).astype(np.float32), "m": np.array(m, np.int64)}
    for s in range(2)
    for m in (0, 1, 3)
]


@pytest.mark.parametrize("default", [False, True], ids=["random", "identity-U"])
def test_a_unit_no_step_needs_goes_from_the_carried_value_and_the_scan_output(default):
    u = np.eye(6) if default else np.random.default_rng(4).standard_normal((6, 6))  # square
    u[[1, 4]] = 0  # no unit reads units 1 and 4 through U
    model = body_weights(tiny(LOOP, zero={"V": np.s_[[1, 4]], "V2": np.s_[[1, 4]]}), {"U": u}, False)
    result = shrink(model, validate=False)
    check(model, result.model, LOOP_FEEDS)
    w = weights(result.model)
    assert w["W0"] == (3, 4) and w["Wx"] == (3, 4) and w["V"] == (4, 2) and w["V2"] == (4, 2)
    assert bodies_weights(result.model)["U"] == (4, 4)
    assert result.barriers == []


def test_a_unit_the_scan_output_reads_stays_in_every_step():
    u = np.random.default_rng(4).standard_normal((6, 6))
    u[[1, 4]] = 0
    model = body_weights(tiny(LOOP, zero={"V": np.s_[[1, 4]]}), {"U": u}, False)  # V2 reads them
    result = shrink(model, validate=False)
    check(model, result.model, LOOP_FEEDS)
    assert bodies_weights(result.model)["U"] == (6, 6) and weights(result.model)["W0"] == (3, 6)


LOOP_NO_SCAN = """
agraph (float[1, 3] x, int64 m, float[3, 6] W0, float[3, 6] Wx, float[6, 2] V) => (float[1, 2] y)
{
  go = Constant <value = bool {1}> ()
  h0 = MatMul (x, W0)
  hT = Loop (m, go, h0) <body = body (int64 i, bool go_in, float[1, 6] h) => (bool go_out, float[1, 6] h1) {
      U = Constant <value_float = 0.0> ()
      go_out = Identity (go_in)
      a = MatMul (h, U)
      b = MatMul (x, Wx)
      s = Add (a, b)
      h1 = Tanh (s)
  }>
  y = MatMul (hT, V)
}
"""


@pytest.mark.parametrize("default", [False, True], ids=["random", "identity-U"])
@pytest.mark.parametrize("as_nodes", [True, False], ids=["constant-nodes", "initializers"])
def test_a_loop_carried_unit_goes_from_the_initial_value_the_body_and_the_output(default, as_nodes):
    rng = np.random.default_rng(5)
    u = np.eye(6) if default else rng.standard_normal((6, 6))
    u[[1, 4]] = 0
    model = body_weights(tiny(LOOP_NO_SCAN, zero={"V": np.s_[[1, 4]]}), {"U": u}, as_nodes)
    result = shrink(model, validate=False)
    check(model, result.model, LOOP_FEEDS)
    w = weights(result.model)
    assert w["W0"] == (3, 4) and w["Wx"] == (3, 4) and w["V"] == (4, 2)  # outer, read inside too
    assert bodies_weights(result.model)["U"] == (4, 4)
    assert result.barriers == []


def test_a_unit_a_kept_unit_reads_through_the_loop_stays():
    rng = np.random.default_rng(6)
    u = rng.standard_normal((6, 6))  # rows 1 and 4 not zero: kept units read the dead ones
    model = body_weights(tiny(LOOP_NO_SCAN, zero={"V": np.s_[[1, 4]]}), {"U": u}, False)
    result = shrink(model, validate=False)
    check(model, result.model, LOOP_FEEDS)
    assert bodies_weights(result.model)["U"] == (6, 6) and weights(result.model)["W0"] == (3, 6)


# ---------------------------------------------------------------------------------- Scan
# xs = x @ Win, scanned over its first axis: h = tanh(h @ U + x_t @ Wx); y = h_T @ V.
SCAN = """
agraph (float[5, 1, 3] x, float[1, 6] H0, float[3, 4] Win, float[4, 6] Wx, float[6, 2] V) => (float[1, 2] y, float[5, 1, 6] hs)
{
  xs = MatMul (x, Win)
  h0 = Relu (H0)
  hT, ys = Scan (h0, xs) <num_scan_inputs = 1, body = body (float[1, 6] h, float[1, 4] xt) => (float[1, 6] h1, float[1, 6] yt) {
      U = Constant <value_float = 0.0> ()
      a = MatMul (h, U)
      b = MatMul (xt, Wx)
      s = Add (a, b)
      h1 = Tanh (s)
      yt = Identity (h1)
  }>
  y = MatMul (hT, V)
  hs = Identity (ys)
}
"""


def test_scan_features_constant_in_every_slice_go_and_states_stay_with_their_output():
    # Win's feature columns 0 and 2 are zero: those features of xs are 0 in every slice, so
    # the body's x_t has them as constants its MatMul absorbs: Wx's rows 0 and 2 go, and Win's
    # columns. The scanned states are a graph output: every unit stays.
    rng = np.random.default_rng(7)
    u = rng.standard_normal((6, 6))
    model = body_weights(tiny(SCAN, zero={"Win": np.s_[:, [0, 2]]}), {"U": u}, True)
    result = shrink(model, validate=False)
    feeds = [
        {"x": np.random.default_rng(s).standard_normal((5, 1, 3)).astype(np.float32)} for s in range(3)
    ]
    check(model, result.model, feeds)
    w = weights(result.model)
    assert w["Win"] == (3, 2) and w["Wx"] == (2, 6) and w["V"] == (6, 2)
    assert bodies_weights(result.model)["U"] == (6, 6)


def test_scan_states_no_output_needs_go():
    text = SCAN.replace(", float[5, 1, 6] hs)", ")").replace("  hs = Identity (ys)\n", "")
    rng = np.random.default_rng(8)
    u = rng.standard_normal((6, 6))
    u[[0, 5]] = 0
    model = body_weights(tiny(text, zero={"V": np.s_[[0, 5]], "H0": np.s_[:, [0, 5]]}), {"U": u}, False)
    result = shrink(model, validate=False)
    feeds = [{"x": np.random.default_rng(s).standard_normal((5, 1, 3)).astype(np.float32)} for s in range(3)]
    check(model, result.model, feeds)
    w = weights(result.model)
    assert w["H0"] == (1, 4) and w["Wx"] == (4, 4) and w["V"] == (4, 2)
    assert bodies_weights(result.model)["U"] == (4, 4)


# ---------------------------------------------------------------------------------- never grows
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5])
def test_pruning_a_model_whose_branches_share_weights_never_grows(ratio, tmp_path):
    model = tiny(IF_SHARED.format(c1=8, c2=8))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    feeds = [{"x": f["x"], "c": f["c"]} for f in FEEDS_C]
    result = prune(path, ratio, tmp_path / "out.onnx", validate=False)
    out = onnx.load(tmp_path / "out.onnx")
    assert params(out) <= params(model) and (tmp_path / "out.onnx").stat().st_size <= path.stat().st_size
    weights(out)  # each weight stored once
    if ratio:
        assert params(out) < params(model)
    # the pruned model computes what the model with the chosen groups zeroed computes
    zeroed = onnx.ModelProto()
    zeroed.CopyFrom(model)
    for t in zeroed.graph.initializer:
        if t.name in result.masks:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * result.masks[t.name], t.name))
    check(zeroed, out, feeds)


def test_a_shrink_that_removes_nothing_writes_the_input_itself():
    model = body_weights(tiny(IF_OWN), {"Wt": np.ones((5, 6, 1, 1)), "Bt": np.ones(5), "Vt": np.ones((4, 5, 1, 1)), "We": np.ones((4, 6, 1, 1))}, True)
    result = shrink(model, validate=False)
    assert result.model.SerializeToString() == model.SerializeToString()


# ---------------------------------------------------------------------------------- more forms
def test_an_if_on_a_constant_condition_takes_its_constants_from_the_branch_that_runs():
    # The condition is a constant (exporters leave such Ifs behind): the else-branch never runs,
    # so the then-branch's zero channels are constants of the If's output, which W3 absorbs.
    text = IF_SHARED.format(c1=6, c2=5).replace("bool c, ", "").replace(
        "  b = If (c)", "  c = Constant <value = bool {1}> ()\n  b = If (c)"
    )
    text = text.replace("e = Tanh (e0)", "e = Sigmoid (e0)")  # 0.5 where the then-branch has 0
    model = tiny(text, zero={"W2": np.s_[[0, 3]], "B2": np.s_[[0, 3]]})
    result = shrink(model, validate=False)
    check(model, result.model, [{"x": f["x"]} for f in FEEDS_C])
    assert weights(result.model)["W3"] == (2, 3, 1, 1) and weights(result.model)["W2"] == (3, 6, 1, 1)


def test_an_if_inside_an_if_branch_shrinks_with_it():
    text = """
    agraph (float[1, 3, 4, 4] x, bool c, bool d, float[6, 3, 1, 1] W1, float[2, 6, 1, 1] W2) => (float[1, 2, 4, 4] y) {
      h = Conv (x, W1)
      y = If (c) <then_branch = then_g () => (float[1, 2, 4, 4] t) {
          u = If (d) <then_branch = inner_t () => (float[1, 6, 4, 4] it) {
              it = Relu (h)
          }, else_branch = inner_e () => (float[1, 6, 4, 4] ie) {
              ie = Tanh (h)
          }>
          t = Conv (u, W2)
      }, else_branch = else_g () => (float[1, 2, 4, 4] e) {
          e = Conv (h, W2)
      }>
    }"""
    model = tiny(text, zero={"W2": np.s_[:, [0, 2, 5]]})
    result = shrink(model, validate=False)
    feeds = [rng_feeds(s, c=np.array(c), d=np.array(d)) for s in range(2) for c in (True, False) for d in (True, False)]
    check(model, result.model, feeds)
    assert weights(result.model) == {"W1": (3, 3, 1, 1), "W2": (2, 3, 1, 1)}




@pytest.mark.parametrize("criterion", ["l1", "activation"])
def test_pruning_a_model_wrapped_in_an_if_prunes_both_branches_weights_in_place(tmp_path, criterion):
    rng = np.random.default_rng(9)
    values = {k: rng.standard_normal(s) for k, s in dict(A=(8, 3, 1, 1), B=(2, 8, 1, 1), C=(6, 3, 1, 1), D=(2, 6, 1, 1)).items()}
    model = body_weights(tiny(WRAPPED), values, as_nodes=True)
    path = tmp_path / "wrapped.onnx"
    onnx.save(model, path)
    # activations inside a body are no outputs onnxruntime gives: those groups rank by magnitude
    data = SR_FEEDS if criterion == "activation" else None
    result = prune(path, 0.5, tmp_path / "out.onnx", validate=False, criterion=criterion, data=data)
    out = onnx.load(tmp_path / "out.onnx")
    assert bodies_weights(out) == {"A": (4, 3, 1, 1), "B": (2, 4, 1, 1), "C": (3, 3, 1, 1), "D": (2, 3, 1, 1)}
    assert set(weights(out)) == {"k", "A", "B", "C", "D"}  # each in its branch, once
    # the masks name the branches' weights; applied by hand, they give what the output computes
    assert sorted(result.masks) == ["A", "B", "C", "D"]
    for g in list(ir.all_graphs(model.graph))[1:]:
        for n in g.node:
            if n.output[0] in result.masks:
                v = numpy_helper.to_array(n.attribute[0].t) * result.masks[n.output[0]]
                n.attribute[0].t.CopyFrom(numpy_helper.from_array(v.astype(np.float32)))
    check(model, out, SR_FEEDS)


def test_masks_bind_to_weights_a_branch_holds_and_the_masks_out_round_trip(tmp_path):
    rng = np.random.default_rng(10)
    values = {k: rng.standard_normal(s) for k, s in dict(A=(8, 3, 1, 1), B=(2, 8, 1, 1), C=(6, 3, 1, 1), D=(2, 6, 1, 1)).items()}
    model = body_weights(tiny(WRAPPED), values, as_nodes=False)
    path = tmp_path / "wrapped.onnx"
    onnx.save(model, path)
    pruned = prune(path, 0.5, tmp_path / "out.onnx", validate=False, masks_out=tmp_path / "m.npz")
    # the masks written, applied to the unmasked original by the shrink, give the same model
    again = shrink(path, tmp_path / "m.npz", validate=False, input_masked=False)
    assert bodies_weights(again.model) == bodies_weights(pruned.model)
    assert params(again.model) == params(pruned.model) < params(model)
    masked = onnx.ModelProto()
    masked.CopyFrom(model)
    for g in list(ir.all_graphs(masked.graph))[1:]:
        for t in g.initializer:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * pruned.masks[t.name].astype(np.float32), t.name))
    check(masked, again.model, SR_FEEDS)


def test_weights_a_branch_holds_in_external_data_are_read_sliced_and_written_there(tmp_path):
    rng = np.random.default_rng(11)
    text = WRAPPED.replace("Conv (x, A)", "Conv <pads = [1, 1, 1, 1]> (x, A)").replace(
        "Conv (x, C)", "Conv <pads = [1, 1, 1, 1]> (x, C)"
    )
    values = {k: rng.standard_normal(s) for k, s in dict(A=(64, 3, 3, 3), B=(2, 64, 1, 1), C=(48, 3, 3, 3), D=(2, 48, 1, 1)).items()}
    values["A"][[0, 2]], values["C"][[1, 5, 6]] = 0, 0
    model = body_weights(tiny(text), values, as_nodes=False)
    stored = onnx.ModelProto()
    stored.CopyFrom(model)
    onnx.save(stored, tmp_path / "m.onnx", save_as_external_data=True, location="m.onnx.data", size_threshold=1024)
    result = shrink(tmp_path / "m.onnx", None, tmp_path / "out.onnx", draws=0, inputs=SR_FEEDS)
    assert result.passed and (tmp_path / "out.onnx.data").exists()  # external in, external out
    out = onnx.load(tmp_path / "out.onnx")
    assert bodies_weights(out) == {"A": (62, 3, 3, 3), "B": (2, 62, 1, 1), "C": (45, 3, 3, 3), "D": (2, 45, 1, 1)}
    check(model, out, SR_FEEDS)


@pytest.mark.parametrize("init", ["random", "default"])
def test_an_embedding_bag_torch_exports_as_a_loop_loses_its_masked_features(init):
    # torch.onnx's (legacy) export of nn.EmbeddingBag: a Loop over the bags whose body gathers
    # rows of the outer table by computed offsets and averages them.
    import io
    import warnings

    import torch

    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(30, 12, mode="mean")
            self.head = torch.nn.Linear(12, 3)

        def forward(self, ids, offsets):
            return self.head(self.bag(ids, offsets))

    torch.manual_seed(0)
    module = Bag().eval()
    with torch.no_grad():
        if init == "default":
            module.head.bias.zero_()
        module.bag.weight[:, [1, 5, 9]] = 0  # features no token has
    ids, offsets = torch.randint(0, 30, (10,)), torch.tensor([0, 3, 7])
    f = io.BytesIO()
    with warnings.catch_warnings():  # the legacy exporter's deprecation notices
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module, (ids, offsets), f, dynamo=False, opset_version=17, input_names=["ids", "offsets"])
    model = onnx.load_from_string(f.getvalue())
    assert "Loop" in [n.op_type for n in model.graph.node]
    result = shrink(model, validate=False)
    feeds = [{"ids": torch.randint(0, 30, (10,)).numpy(), "offsets": np.array(o)} for o in ([0, 3, 7], [0, 0, 9])]
    check(model, result.model, feeds)
    assert weights(result.model)["bag.weight"] == (30, 9) and weights(result.model)["head.weight"] == (3, 9)


def test_a_scan_of_opset_8_is_kept_whole_and_says_so():
    # Scan-8 has a batch axis and sequence lengths: not analyzed, its body and what it reads
    # kept whole (W's zero filters included), exactly.
    text = """
    agraph (float[1, 5, 3] x, float[3, 4] W, float[4, 2] V) => (float[1, 4] hT, float[1, 5, 2] z) {
      xs = MatMul (x, W)
      h0 = ReduceSum <axes = [1], keepdims = 0> (xs)
      hT, ys = Scan (, h0, xs) <num_scan_inputs = 1, body = body (float[4] h, float[4] xt) => (float[4] h1, float[4] yt) {
          s = Add (h, xt)
          h1 = Tanh (s)
          yt = Identity (h1)
      }>
      z = MatMul (ys, V)
    }"""
    model = tiny(text, zero={"W": np.s_[:, [1]], "V": np.s_[[1]]}, opset=8)
    result = shrink(model, validate=False)
    feeds = [{"x": np.random.default_rng(s).standard_normal((1, 5, 3)).astype(np.float32)} for s in range(2)]
    check(model, result.model, feeds)
    assert weights(result.model)["W"] == (3, 4)
    assert [(b["op"], b["reason"]) for b in result.barriers] == [("Scan", "an unnamed Scan node keeps all its channels: Scan of opset 8 is not analyzed")]


def test_branches_that_name_their_tensors_alike_are_told_apart():
    # Sibling bodies may reuse names (onnx allows it); the analysis reads tensors by name.
    text = """
    agraph (float[1, 3, 4, 4] x, bool c, float[6, 3, 1, 1] W1, float[2, 6, 1, 1] W2, float[2, 6, 1, 1] W3) => (float[1, 2, 4, 4] y) {
      h = Conv (x, W1)
      y = If (c) <then_branch = then_g () => (float[1, 2, 4, 4] o) {
          a = Relu (h)
          o = Conv (a, W2)
      }, else_branch = else_g () => (float[1, 2, 4, 4] o) {
          a = Tanh (h)
          o = Conv (a, W3)
      }>
    }"""
    model = tiny(text, zero={"W2": np.s_[:, [0, 3]], "W3": np.s_[:, [0, 3, 4]]})
    onnx.checker.check_model(model, full_check=True)
    result = shrink(model, validate=False)
    check(model, result.model, FEEDS_C)
    assert weights(result.model) == {"W1": (4, 3, 1, 1), "W2": (2, 4, 1, 1), "W3": (2, 4, 1, 1)}
