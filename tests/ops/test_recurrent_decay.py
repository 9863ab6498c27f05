"""LSTM and GRU units whose initial states are graph inputs (ops/recurrent.py, issue 33), as
madmom's LSTM and GRU trackers ship: a unit whose W, R, B and peephole rows and R column are
zero decays from its initial state by sigmoid(0) = 0.5 a step (GRU: h_t = 0.5 h_{t-1}; LSTM:
c_t = 0.5 c_{t-1}, h_t = 0.5 tanh(c_t)), so its last states have a closed form in X's sequence
length T: Y_h = 0.5^T h0 (GRU), Y_c = 0.5^T c0 and Y_h = 0.5 tanh(0.5^T c0) (LSTM). The unit
goes; the shrunk layer reads the kept units of the states (a Gather) and the last states a graph
output (or a reader) keeps get the closed form written there. Compared here with onnxruntime on
the input model (onnx's reference evaluator for layout 1, which onnxruntime does not run), over
random states up to 1e30 and sequences of 200 steps (0.5^200 underflows float32: the form is
computed in float64).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import error_against, init, node_attr, ort_run, params, zero_slices
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxshrink import shrink
from onnxshrink.prune import find_groups, prune

GATES = {"GRU": 3, "LSTM": 4}
H, F, OUT = 6, 3, 4
UNITS = [1, 4]
KEPT = [u for u in range(H) if u not in UNITS]


def rows(units, blocks: int, h: int = H) -> list[int]:
    return [b * h + u for b in range(blocks) for u in units]


def model(op, direction="bidirectional", layout=0, peepholes=False, acts=None, seq_lens=False, state_head=False,
          y_out=False, states_out=True, opset=17, seed=0):  # fmt: skip
    """x -> op (initial states graph inputs: h0, and c0 for LSTM) -> Y -> [.., .., dirs * H]
    -> MatMul V -> y. Graph outputs: y, Y_h and (LSTM) Y_c (not with `states_out` False), and
    with `y_out` Y itself (s); with `state_head` Y_h is read by a MatMul U -> z instead of being
    an output. `seq_lens`: a sequence_lens, a graph input (True) or these constant lengths.
    Batch-first axes with `layout` 1 (an attribute since opset 14)."""
    rng = np.random.default_rng(seed)
    g, dirs = GATES[op], 2 if direction == "bidirectional" else 1
    w = {"W": rng.normal(size=(dirs, g * H, F)) * 0.6, "R": rng.normal(size=(dirs, g * H, H)) * 0.4,
         "B": rng.normal(size=(dirs, 2 * g * H)) * 0.3}  # fmt: skip
    state = [dirs, "N", H] if layout == 0 else ["N", dirs, H]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", F] if layout == 0 else ["N", "T", F])]
    if seq_lens is True:
        inputs.append(helper.make_tensor_value_info("seq", TensorProto.INT32, ["N"]))
    inputs.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, state))
    ins, outs = ["x", "W", "R", "B", "seq" if seq_lens is not False else "", "h0"], ["s", "s_h"]
    if op == "LSTM":
        inputs.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, state))
        ins.append("c0")
        outs.append("s_c")
        if peepholes:
            w["P"] = rng.normal(size=(dirs, 3 * H)) * 0.5
            ins.append("P")
    attrs = {"hidden_size": H, "direction": direction} | ({"layout": layout} if opset >= 14 else {})
    if acts:
        attrs["activations"] = acts
    nodes = [helper.make_node(op, ins, outs, **attrs)]
    w["V"], w["shape"] = rng.normal(size=(dirs * H, OUT)), np.array([0, 0, -1])
    if layout == 0:
        nodes.append(helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1, 3]))
    nodes += [helper.make_node("Reshape", ["t" if layout == 0 else "s", "shape"], ["f"]), helper.make_node("MatMul", ["f", "V"], ["y"])]
    y = ["T", "N", OUT] if layout == 0 else ["N", "T", OUT]
    graph_outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)]
    if y_out:
        dims = ["T", dirs, "N", H] if layout == 0 else ["N", "T", dirs, H]
        graph_outs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, dims))
    graph_outs += [helper.make_tensor_value_info(o, TensorProto.FLOAT, state) for o in outs[1 + state_head:] if states_out]
    if state_head:
        w["U"] = rng.normal(size=(H, OUT))
        nodes.append(helper.make_node("MatMul", ["s_h", "U"], ["z"]))
        graph_outs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [*state[:2], OUT]))
    inits = [numpy_helper.from_array(v.astype(np.int64 if k == "shape" else np.float32), k) for k, v in w.items()]
    if seq_lens is not True and seq_lens is not False:
        inits.append(numpy_helper.from_array(np.asarray(seq_lens, np.int32), "seq"))
    graph = helper.make_graph(nodes, "g", inputs, graph_outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def zeroed(m: onnx.ModelProto, op: str, units: list[int], readers: bool = True) -> onnx.ModelProto:
    """`m` with hidden `units` zeroed here in every direction: their gate rows of W and R, R's
    columns, both halves of B, the peepholes, and (`readers`) V's rows (Y's reader)."""
    g = GATES[op]
    dirs = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "W")).shape[0]
    where = {"W": [(1, rows(units, g))], "R": [(1, rows(units, g)), (2, units)], "B": [(1, rows(units, 2 * g))],
             "P": [(1, rows(units, 3))], "V": [(0, rows(units, dirs))] if readers else []}  # fmt: skip
    return zero_slices(m, where)



def feeds(m: onnx.ModelProto, t: int, n: int, seed: int, lens=None) -> dict[str, np.ndarray]:
    """x ~ N(0, 1); initial states N(0, 1) times 10^U(-3, 30) (large cells: 0.5^T c0 stays a
    float32 long after 0.5^T underflows); a sequence_lens input `lens` (default: all t)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in m.graph.input:
        if i.name in ("seq", "lens"):  # sequence_lens (torch's lens: int64)
            dtype = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
            out[i.name] = np.asarray(lens if lens is not None else [t] * n, dtype)
            continue
        dims = [d.dim_value or {"T": t, "N": n}[d.dim_param] for d in i.type.tensor_type.shape.dim]
        scale = 10.0 ** rng.uniform(-3, 30, dims) if i.name != "x" else 1.0
        out[i.name] = (rng.normal(size=dims) * scale).astype(np.float32)
    return out


def run(m: onnx.ModelProto, feed: dict[str, np.ndarray], layout: int) -> list[np.ndarray]:
    return ort_run(m, feed) if layout == 0 else list(ReferenceEvaluator(m).run(None, feed))


def assert_written(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """A removed unit's entries `b` written in closed form against onnxruntime's `a`: the same
    float wherever a is a normal float; below, within 1.5e-43. onnxruntime halves the cell step by
    step, rounding each time once it is denormal (one denormal step, 1.4e-45, off the single
    rounding of 0.5^t c0), and LSTM's tanh of a denormal cell is coarse (MLAS's tanh takes
    adjacent denormals 102 steps apart: 1.43e-43, measured)."""
    normal = np.abs(a) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(b[normal], a[normal], err_msg=what)
    np.testing.assert_allclose(b, a, rtol=0, atol=1.5e-43, err_msg=what)


def assert_same(reference, shrunk, sizes, layout=0, y_written=False, lens=None) -> None:
    """Every output of `shrunk` equals the reference's at each (T, batch) of `sizes`: the
    removed units' entries of the last states (and, `y_written`, of Y: s) bit for bit in the
    normal range (`assert_written`), the rest relative 1e-5. `lens`: per size, the lengths
    fed as sequence_lens."""
    names = [o.name for o in reference.graph.output]
    assert [o.name for o in shrunk.graph.output] == names
    for k, (t, n) in enumerate(sizes):
        feed = feeds(reference, t, n, seed=20 + k, lens=lens[k] if lens else None)
        for name, a, b in zip(names, run(reference, feed, layout), run(shrunk, feed, layout), strict=True):
            assert a.shape == b.shape, (name, t, n)
            if name in ("s_h", "s_c") or (y_written and name == "s"):
                assert_written(a[..., UNITS], b[..., UNITS], f"{name} T={t}")
                a, b = a[..., KEPT], b[..., KEPT]
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(a).max(initial=0))), err_msg=name)


@pytest.mark.parametrize(
    "op, direction, peepholes, acts",
    [("LSTM", "forward", True, None), ("LSTM", "reverse", False, None), ("LSTM", "bidirectional", True, None),
     ("LSTM", "bidirectional", False, ["Sigmoid", "Tanh", "Relu"] * 2), ("GRU", "forward", False, None),
     ("GRU", "reverse", False, None), ("GRU", "bidirectional", False, None)],
)  # fmt: skip
def test_decaying_units_go_and_their_last_states_are_written_in_closed_form(op, direction, peepholes, acts):
    m = model(op, direction, peepholes=peepholes, acts=acts, seed=len(direction))
    reference = zeroed(m, op, UNITS)
    result = shrink(reference, validate=False)
    out, g, dirs = result.model, GATES[op], 2 if direction == "bidirectional" else 1
    assert node_attr(out, op, "hidden_size") == H - 2 and not result.kept_zeroed
    np.testing.assert_array_equal(init(out, "W"), np.delete(init(m, "W"), rows(UNITS, g), axis=1))
    np.testing.assert_array_equal(init(out, "R"), np.delete(np.delete(init(m, "R"), rows(UNITS, g), 1), UNITS, 2))
    assert init(out, "V").shape == (dirs * (H - 2), OUT)
    if peepholes:
        assert init(out, "P").shape == (dirs, 3 * (H - 2))
    # the interface as it was: states in and out [dirs, N, H]
    assert [[d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in out.graph.input][1:] == [
        [dirs, "N", H]] * (2 if op == "LSTM" else 1)  # fmt: skip
    assert params(out) == result.after.params < params(reference)
    assert_same(reference, out, [(1, 1), (7, 2), (200, 3)])
    # the removed units' last cell is 0.5^T c0 (GRU: state, 0.5^T h0), computed here, for
    # states of +-1e30 after 200 steps (0.5^200 = 6e-61 is 0 in float32; 1e30 * 0.5^200 is not)
    feed = feeds(reference, 200, 2, seed=5)
    source, last = ("c0", "s_c") if op == "LSTM" else ("h0", "s_h")
    feed[source][..., UNITS] = np.float32(1e30) * np.sign(feed[source][..., UNITS])
    got = dict(zip([o.name for o in out.graph.output], ort_run(out, feed), strict=True))
    want = (feed[source][..., UNITS].astype(np.float64) * 0.5**200).astype(np.float32)
    assert np.all(np.abs(want) > 6e-31)
    np.testing.assert_array_equal(got[last][..., UNITS], want)
    np.testing.assert_array_equal(got[last][..., UNITS], ort_run(reference, feed)[[o.name for o in reference.graph.output].index(last)][..., UNITS])


CASES = [("LSTM", "forward", True, None), ("LSTM", "reverse", False, None), ("LSTM", "bidirectional", True, None),
         ("LSTM", "bidirectional", False, ["Sigmoid", "Tanh", "Relu"] * 2), ("GRU", "forward", False, None),
         ("GRU", "reverse", False, None), ("GRU", "bidirectional", False, None)]  # fmt: skip


@pytest.mark.parametrize("op, direction, peepholes, acts", CASES)
def test_decaying_units_whose_y_is_read_go_and_every_step_is_written_in_closed_form(op, direction, peepholes, acts):
    """V's rows for the units not zeroed (it reads every step of them), Y a graph output too:
    step t's state is 0.5^(t+1) s0 (reverse: 0.5^(T-t) s0), LSTM's output 0.5 h(c_t)."""
    m = model(op, direction, peepholes=peepholes, acts=acts, y_out=True, seed=10 + len(direction))
    reference = zeroed(m, op, UNITS, readers=False)
    result = shrink(reference, validate=False)
    out, g, dirs = result.model, GATES[op], 2 if direction == "bidirectional" else 1
    assert node_attr(out, op, "hidden_size") == H - 2 and not result.kept_zeroed
    np.testing.assert_array_equal(init(out, "V"), init(m, "V"))  # it reads the closed form
    removed = dirs * len(UNITS) * (g * (F + H + 2) + g * (H - 2)) + (dirs * 3 * len(UNITS) if peepholes else 0)
    rates = dirs * (4 if op == "LSTM" else 2)  # 0.5 per direction: Pow's base for Y and the last states, (LSTM) h's factor
    assert params(out) == result.after.params == params(reference) - removed + rates
    assert_same(reference, out, [(1, 1), (7, 2), (200, 3)], y_written=True)
    # states of +-1e30: after 200 steps Y's removed units are still normal floats (1e30 * 0.5^200
    # = 6e-31), exact
    feed = feeds(reference, 200, 2, seed=6)
    source = "c0" if op == "LSTM" else "h0"
    feed[source][..., UNITS] = np.float32(1e30) * np.sign(feed[source][..., UNITS])
    names = [o.name for o in reference.graph.output]
    want, got = (dict(zip(names, ort_run(x, feed), strict=True))["s"][..., UNITS] for x in (reference, out))
    live = want != 0  # all but a Relu's negative cells
    assert np.all(np.abs(want[live]) >= np.finfo(np.float32).tiny) and live.mean() > 0.4
    np.testing.assert_array_equal(got, want)


def test_y_of_a_decaying_unit_below_opset_11_is_not_written_and_says_why():
    """Its steps are indexed with Range (opset 11): at opset 10 a unit Y's reader reads stays."""
    reference = zeroed(model("GRU", "bidirectional", opset=10, seed=2), "GRU", UNITS, readers=False)
    result = shrink(reference, validate=False)
    assert node_attr(result.model, "GRU", "hidden_size") == H and params(result.model) == params(reference)
    count, why = {(k.tensor, k.axis): (k.count, k.reason) for k in result.kept_zeroed}[("W", 1)]
    assert count == 2 * 3 and "Y reads it at every step" in why and "Range (opset 11)" in why
    assert_same(reference, result.model, [(1, 1), (5, 2)])


def torch_model(kind: str, units: list[int], packed: bool = False, states_out: bool = True):
    """nn.LSTM / nn.GRU bidirectional at the library's default init (uniform, biases included),
    `units` zeroed in it (their rows of both weights and biases, their columns of weight_hh),
    a Linear on every step of its output (its columns for them not zeroed), the initial states
    graph inputs and (`states_out`) the last states graph outputs; exported with torch.onnx
    (TorchScript), T and N dynamic. `packed`: x read through pack_padded_sequence with lengths
    from a graph input (lens), Y through pad_packed_sequence."""
    import io
    import warnings

    import torch
    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(nn, kind)(F, H, bidirectional=True)
            self.head = nn.Linear(2 * H, OUT)

        def forward(self, x, *args):
            lens, states = (args[0], args[1:]) if packed else (None, args)
            seq = x if lens is None else pack_padded_sequence(x, lens)
            y, last = self.rnn(seq, states if kind == "LSTM" else states[0])
            y = y if lens is None else pad_packed_sequence(y)[0]
            return (self.head(y), *(last if kind == "LSTM" else (last,))) if states_out else self.head(y)

    torch.manual_seed({"LSTM": 1, "GRU": 2}[kind])
    layer = Layer().eval()
    g = GATES[kind]
    with torch.no_grad():
        for name, p in layer.rnn.named_parameters():
            p[rows(units, g)] = 0
            if name.startswith("weight_hh"):
                p[:, units] = 0
    states = ["h0", "c0"] if kind == "LSTM" else ["h0"]
    outs = ["y", "s_h", "s_c"][: 1 + len(states) if states_out else 1]
    ins = ["x", "lens", *states] if packed else ["x", *states]
    args = (torch.randn(5, 2, F), *([torch.tensor([5, 3])] if packed else []), *(torch.randn(2, 2, H) for _ in states))
    axes = {"x": {0: "T", 1: "N"}, "lens": {0: "N"}, **{n: {1: "N"} for n in states + outs[1:]}, "y": {0: "T", 1: "N"}}
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(layer, args, buf, dynamo=False, opset_version=17, input_names=ins,
                          output_names=outs, dynamic_axes={k: v for k, v in axes.items() if k in ins + outs})  # fmt: skip
    return onnx.load_from_string(buf.getvalue())


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_torch_default_init_units_whose_y_is_read_go(kind):
    reference = torch_model(kind, UNITS)
    [node] = [n for n in reference.graph.node if n.op_type == kind]
    assert list(node.input[5:]) == (["h0", "c0"] if kind == "LSTM" else ["h0"])  # the graph's inputs, as read
    result = shrink(reference, validate=False)
    assert node_attr(result.model, kind, "hidden_size") == H - 2 and not result.kept_zeroed
    g = GATES[kind]
    rates = 2 * (4 if kind == "LSTM" else 2)  # as in the test above
    assert params(result.model) == params(reference) - 2 * len(UNITS) * g * (F + H + 2 + H - 2) + rates
    assert_same(reference, result.model, [(1, 1), (7, 2), (200, 3)])


@pytest.mark.parametrize(
    "op, direction, lens, sizes",
    [("LSTM", "bidirectional", [1, 3, 2], [(3, 3), (8, 3)]), ("GRU", "bidirectional", [1, 3, 2], [(3, 3), (8, 3)]),
     ("LSTM", "reverse", [200, 1, 137], [(200, 3)]), ("GRU", "forward", [200, 1, 137], [(200, 3)])],
)  # fmt: skip
def test_constant_sequence_lens_write_each_sequences_closed_form(op, direction, lens, sizes):
    """sequence_lens a constant of lengths >= 1: sequence b's last states are the closed form at
    T_b = lens[b] and its Y is 0 past T_b (onnxruntime's), Y read by V and a graph output."""
    m = model(op, direction, seq_lens=lens, y_out=True, seed=5)
    reference = zeroed(m, op, UNITS, readers=False)
    result = shrink(reference, validate=False)
    assert node_attr(result.model, op, "hidden_size") == H - 2 and not result.kept_zeroed
    assert_same(reference, result.model, sizes, y_written=True)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_sequence_lens_input_writes_y_past_each_end_as_zero(op):
    """sequence_lens a graph input, the last states no output: Y's closed form is 0 past each
    sequence's length, at lengths 0, < T and T (onnxruntime's Y is 0 there: no step is
    written). The last states, no step's where a length is 0, are not needed."""
    m = model(op, "bidirectional", seq_lens=True, y_out=True, states_out=False, seed=6)
    reference = zeroed(m, op, UNITS, readers=False)
    result = shrink(reference, validate=False)
    assert node_attr(result.model, op, "hidden_size") == H - 2 and not result.kept_zeroed
    sizes, lens = [(1, 2), (5, 3), (200, 4)], [[0, 1], [0, 2, 5], [200, 0, 37, 1]]
    assert_same(reference, result.model, sizes, y_written=True, lens=lens)
    # the removed units' Y past each length is exactly 0, and not before
    feed = feeds(reference, 5, 3, seed=1, lens=[0, 2, 5])
    y = dict(zip([o.name for o in result.model.graph.output], ort_run(result.model, feed), strict=True))["s"]
    removed = y[..., UNITS]  # [T, dirs, N, units]
    within = np.broadcast_to((np.arange(5)[:, None] < np.array([0, 2, 5]))[:, None, :, None], removed.shape)
    assert np.all(removed[~within] == 0) and np.all(removed[within] != 0)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("states_out", [False, True])
def test_torch_packed_sequences(kind, states_out):
    """torch's pack_padded_sequence exports its lengths as the layer's sequence_lens, from a graph
    input: the units whose Y is read go; with the last states graph outputs they stay (a length
    may be 0 there, where the last states are no step's)."""
    reference = torch_model(kind, UNITS, packed=True, states_out=states_out)
    [node] = [n for n in reference.graph.node if n.op_type == kind]
    assert node.input[4]  # a sequence_lens, computed from the graph input "lens"
    result = shrink(reference, validate=False)
    if states_out:
        assert node_attr(result.model, kind, "hidden_size") == H
        count, why = {(k.tensor, k.axis): (k.count, k.reason) for k in result.kept_zeroed}[(node.input[1], 1)]
        assert count == 2 * GATES[kind] and "sequence_lens may hold 0" in why
    else:
        assert node_attr(result.model, kind, "hidden_size") == H - 2 and not result.kept_zeroed
    sizes, lens = [(1, 2), (6, 3), (200, 3)], [[1, 1], [6, 3, 1], [200, 199, 17]]
    assert_same(reference, result.model, sizes, lens=lens)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
@pytest.mark.parametrize("y_read", [False, True])
def test_batch_first_layout(op, y_read):
    """onnxruntime runs layout 0 only: both models run in onnx's reference evaluator. With
    `y_read` V reads the units' every step and Y is a graph output ([N, T, dirs, H])."""
    m = model(op, "bidirectional", layout=1, y_out=y_read, seed=3)
    reference = zeroed(m, op, UNITS, readers=not y_read)
    out = shrink(reference, validate=False).model
    assert node_attr(out, op, "hidden_size") == H - 2
    assert_same(reference, out, [(1, 2), (30, 3)], layout=1, y_written=y_read)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_a_reader_of_the_last_state_reads_the_closed_form(op):
    """Y_h no graph output, read by a MatMul whose rows for the units are not zero: it reads
    their closed form (and the LSTM's Y_c, a graph output, gets it too)."""
    m = model(op, "bidirectional", state_head=True, seed=4)
    reference = zeroed(m, op, UNITS)
    result = shrink(reference, validate=False)
    assert node_attr(result.model, op, "hidden_size") == H - 2
    assert init(result.model, "U").shape == (H, OUT)
    assert_same(reference, result.model, [(1, 1), (9, 2), (200, 2)])


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_prune_removes_decaying_units_and_masks_out_round_trips(op):
    m = model(op, "bidirectional", peepholes=True, seed=7)
    result = prune(m, 0.3, draws=1)
    assert result.shrink.validation.passed
    [lay] = [la for la in result.groups.layers if la.kind == "recurrent_unit"]
    assert len(lay.groups) == H and all(result.groups.groups[i].exact for i in lay.groups)
    # a unit: its rows, R column, peepholes and V's rows; no state (h0, c0 are the user's inputs)
    members = {"W", "R", "B", "V"} | ({"P"} if op == "LSTM" else set())
    for gid in lay.groups:
        assert {m_.initializer for m_ in result.groups.groups[gid].members} == members
    units = sorted(int(i) for gid in result.removed() for mb in result.groups.groups[gid].members
                   if (mb.initializer, mb.axis) == ("R", 2) for i in mb.indices)  # fmt: skip
    assert len(units) >= 1 and node_attr(result.model, op, "hidden_size") == H - len(units)
    assert params(result.model) == result.shrink.after.params < params(m)
    assert error_against(zeroed(m, op, units), result.model) <= 1e-5
    masks = {k: np.asarray(v) for k, v in result.masks.items()}
    again = shrink(m, masks, validate=False, input_masked=False)
    assert again.after.params == params(result.model)
    assert error_against(result.model, again.model) <= 1e-5


@pytest.mark.parametrize(
    "op, kwargs, reason",
    [("GRU", {"acts": ["HardSigmoid", "Tanh"] * 2}, "is not Sigmoid"),
     ("LSTM", {"acts": ["Sigmoid", "Tanh", "LeakyRelu"] * 2}, "is not Tanh or Relu"),
     ("LSTM", {"seq_lens": True}, "sequence_lens may hold 0"), ("GRU", {"seq_lens": True}, "sequence_lens may hold 0"),
     ("GRU", {"seq_lens": [2, 0]}, "sequence_lens may hold 0")],
)  # fmt: skip
def test_units_without_a_closed_form_stay_and_say_why(op, kwargs, reason):
    """HardSigmoid's rate at 0 is not the one the closed form reproduces; LeakyRelu is no
    output activation it applies; where a sequence_lens may hold 0 (a graph input, or a constant
    0) the last states are no step's (onnxruntime writes 0, the spec says nothing)."""
    reference = zeroed(model(op, "bidirectional", seed=9, **kwargs), op, UNITS)
    result = shrink(reference, validate=False)
    assert node_attr(result.model, op, "hidden_size") == H and params(result.model) == params(reference)
    count, why = {(k.tensor, k.axis): (k.count, k.reason) for k in result.kept_zeroed}[("W", 1)]
    assert count == 2 * GATES[op] and "decays" in why and reason in why
    feeds_ = [feeds(reference, t, 2, seed=t) for t in ((2, 6) if isinstance(kwargs.get("seq_lens"), list) else (1, 6))]
    for feed in feeds_:
        for a, b in zip(ort_run(reference, feed), ort_run(result.model, feed), strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(a).max(initial=0))))
    gset = find_groups(model(op, "bidirectional", seed=9, **kwargs))
    [lay] = [la for la in gset.layers if la.kind == "recurrent_unit"]
    assert not any(gset.groups[i].exact for i in lay.groups)
