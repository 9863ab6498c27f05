"""Plain RNN units with the layer's initial state a graph input and its last state (and Y) graph
outputs (ops/recurrent.py), as madmom's RNN models ship: a unit whose W and R rows, biases and R
column are zero (under activations with f(0) = 0 in every direction) is h_t = f(0) = 0 at every
step t >= 1 whatever its initial state, so it goes. The shrunk RNN reads the kept units of the
initial state (a Gather); every output that keeps the unit's index gets an exact 0 there (Pad,
then Gather). LSTM and GRU units do not forget their initial state (a zero-gate LSTM cell is
0.5^t * c0, a GRU state 0.5^t * h0): every step of Y and their last states have a closed form
(tests/ops/test_recurrent_decay.py), written where they are read.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import error_against, init, node_attr, ort_run, params, zero_slices
from onnx import TensorProto, helper, numpy_helper

from onnxshrink import shrink
from onnxshrink.prune import find_groups, prune

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
H, F, OUT = 6, 3, 4
UNITS = [1, 4]


def rows(units, blocks: int, h: int = H) -> list[int]:
    return [b * h + u for b in range(blocks) for u in units]


def model(op="RNN", dirs=2, default=False, y_out=False, acts=None, seq_lens=False, head=True, seed=0):
    """x [T, N, F] (dynamic T, N) -> op with initial states as graph inputs (h0, and c0 for
    LSTM) -> Y -> Transpose, Reshape [T, N, dirs * H] -> MatMul V -> y. Graph outputs: y, Y_h
    (Y_c), and Y itself with `y_out`. `default`: zero biases; `acts`: the activations attribute;
    `seq_lens`: a sequence_lens input; `head`: without it, Y is the only reader's output."""
    rng = np.random.default_rng(seed)
    g = GATES[op]
    w = {"W": rng.normal(size=(dirs, g * H, F)) * 0.6, "R": rng.normal(size=(dirs, g * H, H)) * 0.4,
         "B": np.zeros((dirs, 2 * g * H)) if default else rng.normal(size=(dirs, 2 * g * H)) * 0.3}  # fmt: skip
    state = helper.make_tensor_value_info("h0", TensorProto.FLOAT, [dirs, "N", H])
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", F])]
    if seq_lens:
        inputs.append(helper.make_tensor_value_info("seq", TensorProto.INT32, ["N"]))
    inputs.append(state)
    ins = ["x", "W", "R", "B", "seq" if seq_lens else "", "h0"]
    outs = ["s", "s_h"]
    if op == "LSTM":
        inputs.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, [dirs, "N", H]))
        ins.append("c0")
        outs.append("s_c")
    attrs = {"hidden_size": H, "direction": "bidirectional" if dirs == 2 else "forward"}
    if acts:
        attrs["activations"] = acts
    nodes = [helper.make_node(op, ins, outs, **attrs)]
    graph_outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [dirs, "N", H]) for o in outs[1:]]
    if y_out or not head:
        graph_outs.insert(0, helper.make_tensor_value_info("s", TensorProto.FLOAT, ["T", dirs, "N", H]))
    if head:
        w["V"] = rng.normal(size=(dirs * H, OUT))
        w["shape"] = np.array([0, 0, -1])
        nodes += [helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", ["t", "shape"], ["f"]), helper.make_node("MatMul", ["f", "V"], ["y"])]  # fmt: skip
        graph_outs.insert(0, helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", "N", OUT]))
    inits = [numpy_helper.from_array(v.astype(np.int64 if k == "shape" else np.float32), k) for k, v in w.items()]
    graph = helper.make_graph(nodes, "g", inputs, graph_outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def zeroed(m: onnx.ModelProto, op: str, units: list[int], readers: int = 0, columns: bool = True) -> onnx.ModelProto:
    """`m` with hidden `units` zeroed here, in every direction: their gate rows of W and R, both
    halves of B, (`columns`) their columns of R; with `readers` (the directions) V's rows too."""
    g = GATES[op]
    where = {"W": [(1, rows(units, g))], "R": [(1, rows(units, g))], "B": [(1, rows(units, 2 * g))]}
    if columns:
        where["R"].append((2, units))
    if readers:
        where["V"] = [(0, rows(units, readers))]
    return zero_slices(m, where)



def feeds(m: onnx.ModelProto, t: int, n: int, seed: int, lens=None) -> dict[str, np.ndarray]:
    """Random x and initial states (made here) at sequence length t and batch n."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in m.graph.input:
        if i.name == "seq":
            out["seq"] = np.asarray(lens if lens is not None else [t] * n, np.int32)
            continue
        dims = [d.dim_value or {"T": t, "N": n}[d.dim_param] for d in i.type.tensor_type.shape.dim]
        out[i.name] = rng.normal(size=dims).astype(np.float32) * 2
    return out


def assert_same(reference: onnx.ModelProto, shrunk: onnx.ModelProto, sizes, lens=None) -> None:
    """Every output of `shrunk` equals the reference's in onnxruntime (relative 1e-5), at each
    (sequence length, batch) of `sizes`, on random initial states."""
    names = [o.name for o in reference.graph.output]
    assert [o.name for o in shrunk.graph.output] == names
    for k, (t, n) in enumerate(sizes):
        feed = feeds(reference, t, n, seed=10 + k, lens=lens)
        for name, a, b in zip(names, ort_run(reference, feed), ort_run(shrunk, feed), strict=True):
            assert a.shape == b.shape, (name, t, n)
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(a).max(initial=0))))


def placed(m: onnx.ModelProto, name: str) -> list[int]:
    """The indices of the Gather that writes output `name` from a Pad of one zero on the last
    axis of the recurrent node's own output."""
    by_out = {o: n for n in m.graph.node for o in n.output}
    gather = by_out[name]
    pad = by_out[gather.input[0]]
    assert (gather.op_type, pad.op_type) == ("Gather", "Pad") and by_out[pad.input[0]].op_type in GATES
    pads = init(m, pad.input[1])
    assert pads.tolist() == [0] * (len(pads) - 1) + [1]
    return init(m, gather.input[1]).tolist()


def stored(dirs: int, h: int, v_rows: int) -> int:
    """The RNN model's parameters at hidden size h, V with `v_rows` rows (counted from its
    definition: W, R, B, V)."""
    return dirs * h * F + dirs * h * h + dirs * 2 * h + v_rows * OUT


@pytest.mark.parametrize("dirs, default, y_out", [(1, False, False), (2, False, False), (2, True, False), (1, True, True), (2, False, True)])
def test_rnn_units_with_graph_input_states_and_output_states_go(dirs, default, y_out):
    m = model(dirs=dirs, default=default, y_out=y_out, seed=dirs)
    reference = zeroed(m, "RNN", UNITS)  # V's rows for the units not zeroed: Y is 0 there
    result = shrink(reference, validate=False)
    out = result.model
    assert node_attr(out, "RNN", "hidden_size") == H - 2
    g = out.graph
    assert [tuple(d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim) for i in g.input] == [
        ("T", "N", F), (dirs, "N", H)]  # the interface as it was  # fmt: skip
    np.testing.assert_array_equal(init(out, "W"), np.delete(init(m, "W"), UNITS, axis=1))
    np.testing.assert_array_equal(init(out, "R"), np.delete(np.delete(init(m, "R"), UNITS, 1), UNITS, 2))
    np.testing.assert_array_equal(init(out, "B"), np.delete(init(m, "B"), rows(UNITS, 2), axis=1))
    # Y a graph output keeps its width (zeros written), so V reads all of it; else V's rows go
    v_rows = dirs * H if y_out else dirs * (H - 2)
    assert init(out, "V").shape == (v_rows, OUT)
    kept = [k for k in range(H) if k not in UNITS]
    # Y_h (and Y): the RNN's output padded by one zero on the hidden axis, gathered in place
    for name in ["s_h"] + (["s"] if y_out else []):
        assert placed(out, name) == [kept.index(k) if k in kept else H - 2 for k in range(H)]
    # (int64 index maps and the Reshape target are no parameters)
    assert params(reference) == stored(dirs, H, dirs * H)
    assert params(out) == result.after.params == stored(dirs, H - 2, v_rows)
    assert_same(reference, out, [(1, 1), (4, 2), (9, 3)])
    # the removed units' last states are exact zeros, and so is the reference's there
    feed = feeds(reference, 5, 2, seed=3)
    got = dict(zip([o.name for o in g.output], ort_run(out, feed), strict=True))
    assert not got["s_h"][:, :, UNITS].any() and got["s_h"][:, :, kept].all()
    if y_out:
        assert not got["s"][..., UNITS].any()


def test_sequence_lens_that_may_hold_0_keeps_the_units_and_lengths_of_at_least_1_do_not():
    """Where a sequence_lens entry is 0, onnxruntime's Y_h is no step's output (backward: the
    initial state itself), so the units stay when sequence_lens is a graph input; a constant
    one of lengths >= 1 gives every sequence a step, and they go."""
    m = model(dirs=2, seq_lens=True, head=False, seed=5)
    reference = zeroed(m, "RNN", UNITS)
    result = shrink(reference, validate=False)
    assert node_attr(result.model, "RNN", "hidden_size") == H and params(result.model) == params(reference)
    count, reason = {(k.tensor, k.axis): (k.count, k.reason) for k in result.kept_zeroed}[("W", 1)]
    assert count == 2 and "sequence_lens may hold 0" in reason
    assert_same(reference, result.model, [(3, 2)], lens=[1, 3])
    # sequence_lens stored: 2, 4 and 1 steps of 4
    fixed = onnx.ModelProto()
    fixed.CopyFrom(reference)
    del fixed.graph.input[1]
    fixed.graph.initializer.append(numpy_helper.from_array(np.array([2, 4, 1], np.int32), "seq"))
    out = shrink(fixed, validate=False).model
    assert node_attr(out, "RNN", "hidden_size") == H - 2 and params(out) == stored(2, H - 2, 0) + 3
    assert_same(fixed, out, [(4, 3)])


@pytest.mark.parametrize("dirs, default", [(2, False), (1, True)])
def test_prune_removes_rnn_units_at_the_interface_and_masks_out_round_trips(dirs, default):
    m = model(dirs=dirs, default=default, seed=7)
    result = prune(m, 0.3, draws=1)
    assert result.shrink.validation.passed
    [lay] = [la for la in result.groups.layers if la.kind == "recurrent_unit"]
    assert len(lay.groups) == H and all(result.groups.groups[i].exact for i in lay.groups)
    # a unit: its rows, R column and V's rows; no state (h0 is the user's input)
    for gid in lay.groups:
        assert {m_.initializer for m_ in result.groups.groups[gid].members} == {"W", "R", "B", "V"}
    units = sorted(int(i) for gid in result.removed() for mb in result.groups.groups[gid].members
                   if (mb.initializer, mb.axis) == ("R", 2) for i in mb.indices)  # fmt: skip
    assert len(units) == 2 and node_attr(result.model, "RNN", "hidden_size") == H - 2
    assert params(m) == result.original.params == stored(dirs, H, dirs * H)
    assert params(result.model) == result.shrink.after.params == stored(dirs, H - 2, dirs * (H - 2))
    assert error_against(zeroed(m, "RNN", units, readers=dirs), result.model) <= 1e-5
    masks = {k: np.asarray(v) for k, v in result.masks.items()}
    again = shrink(m, masks, validate=False, input_masked=False)
    assert again.after.params == params(result.model)
    assert error_against(result.model, again.model) <= 1e-5


@pytest.mark.parametrize("acts", [["Sigmoid", "Sigmoid"], ["Tanh", "HardSigmoid"]])
def test_a_unit_under_an_activation_not_zero_at_zero_stays(acts):
    """Sigmoid(0) = 0.5: the unit is 0.5 at every step, not 0 (in one direction is enough)."""
    m = model(dirs=2, acts=acts, seed=8)
    reference = zeroed(m, "RNN", UNITS)
    out = shrink(reference, validate=False).model
    assert node_attr(out, "RNN", "hidden_size") == H and params(out) == params(reference)
    assert error_against(reference, out) <= 1e-5
    gset = find_groups(m)
    [lay] = [la for la in gset.layers if la.kind == "recurrent_unit"]
    assert not any(gset.groups[i].exact for i in lay.groups)
    assert all("graph input or output" in gset.groups[i].reason for i in lay.groups)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_lstm_and_gru_units_with_graph_input_states_whose_y_is_read_go(op):
    """Their state decays from the initial state (0.5^t at zero gates): every step of Y and the
    last states have a closed form (tests/ops/test_recurrent_decay.py), written where V reads Y."""
    m = model(op=op, dirs=2, seed=9)
    reference = zeroed(m, op, UNITS)  # V's rows for them not zeroed
    result = shrink(reference, validate=False)
    assert node_attr(result.model, op, "hidden_size") == H - 2 and params(result.model) < params(reference)
    assert not result.kept_zeroed
    assert error_against(reference, result.model) <= 1e-5
    gset = find_groups(m)  # a unit's group holds V's rows: zeroed with them, it goes
    [lay] = [la for la in gset.layers if la.kind == "recurrent_unit"]
    assert all(gset.groups[i].exact for i in lay.groups)


def test_an_rnn_unit_whose_state_others_read_stays():
    """Its R column not zeroed: the other units read its initial state at the first step."""
    m = model(dirs=1, seed=11)
    reference = zeroed(m, "RNN", UNITS, columns=False)
    result = shrink(reference, validate=False)
    assert node_attr(result.model, "RNN", "hidden_size") == H
    count, reason = {(k.tensor, k.axis): (k.count, k.reason) for k in result.kept_zeroed}[("W", 1)]
    assert count == 2 and "read it at the first step" in reason
    assert error_against(reference, result.model) <= 1e-5


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_zero_lstm_and_gru_units_at_zero_initial_states_go_from_graph_outputs_too(op):
    """No initial state given (ONNX's default: 0): a unit with zero rows is 0 at every step (and
    for an empty sequence onnxruntime writes 0); Y and Y_h graph outputs keep their width, the
    unit written as 0 there."""
    g = GATES[op]
    rng = np.random.default_rng(12)
    w = {"W": rng.normal(size=(2, g * H, F)), "R": rng.normal(size=(2, g * H, H)) * 0.5, "B": rng.normal(size=(2, 2 * g * H))}
    outs = ["s", "s_h"] + (["s_c"] if op == "LSTM" else [])
    node = helper.make_node(op, ["x", "W", "R", "B"], outs, hidden_size=H, direction="bidirectional")
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", F])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["T", 2, "N", H] if o == "s" else [2, "N", H]) for o in outs],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in w.items()],
    )  # fmt: skip
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    reference = zeroed(m, op, UNITS, columns=False)  # R's columns for them read zeros: not zeroed
    out = shrink(reference, validate=False).model
    assert node_attr(out, op, "hidden_size") == H - 2
    assert params(out) == 2 * g * (H - 2) * (F + H - 2 + 2)
    kept = [k for k in range(H) if k not in UNITS]
    for name in outs:
        assert placed(out, name) == [kept.index(k) if k in kept else H - 2 for k in range(H)]
    assert_same(reference, out, [(1, 1), (5, 2)])
