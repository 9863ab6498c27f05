"""Recurrent hidden units as prune units (ops/recurrent.py, prune/groups.py): an LSTM, GRU or RNN
hidden unit is one `recurrent_unit` group, in every direction (hidden_size is one attribute):
its gate rows of W and R, both halves of B, its peepholes, its column of R, its initial states
and its index in Y and in Y's readers (a bidirectional Y's 2 * hidden features after a
Transpose and Reshape). `--prune` removes such units, exactly against the input with the units
zeroed here by the test, from the unit indices alone.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import error_against, init, params, shrink_checked
from onnx import TensorProto, helper, numpy_helper

from onnxshrink.prune import find_groups, prune

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
H, F, SEQ, BATCH, OUT = 6, 3, 5, 2, 4


def rows(units, blocks: int, h: int = H) -> list[int]:
    """The rows of `units` in `blocks` stacked blocks of h (the gates; B's two halves)."""
    return [b * h + u for b in range(blocks) for u in units]


def layer(op: str, dirs: int, default: bool, seed: int = 0, peepholes: bool = False, layout: int = 0) -> onnx.ModelProto:
    """x -> op (W, R, B, initial states, peepholes) -> Y -> [Transpose] -> Reshape to dirs * H
    features -> MatMul V -> y. `default`: zero biases and zero initial states (ONNX's defaults),
    else all random; layout 1: batch first."""
    rng = np.random.default_rng(seed)
    g = GATES[op]
    w = {
        "W": rng.normal(size=(dirs, g * H, F)) * 0.6,
        "R": rng.normal(size=(dirs, g * H, H)) * 0.4,
        "B": np.zeros((dirs, 2 * g * H)) if default else rng.normal(size=(dirs, 2 * g * H)) * 0.3,
        "V": rng.normal(size=(dirs * H, OUT)),
    }
    state = (BATCH, dirs, H) if layout else (dirs, BATCH, H)
    w["H0"] = np.zeros(state) if default else rng.normal(size=state) * 0.5
    ins = ["x", "W", "R", "B", "", "H0"]
    if op == "LSTM":
        w["C0"] = np.zeros(state) if default else rng.normal(size=state) * 0.5
        ins.append("C0")
        if peepholes:
            w["P"] = rng.normal(size=(dirs, 3 * H)) * 0.3
            ins.append("P")
    attrs = {"hidden_size": H, "direction": "bidirectional" if dirs == 2 else "forward"}
    if layout:
        attrs["layout"] = 1
    outs = ["s", "s_h"] + (["s_c"] if op == "LSTM" else [])
    nodes = [helper.make_node(op, ins, outs, **attrs)]
    if layout:  # Y [batch, seq, dirs, hidden]
        x_dims, feat = [BATCH, SEQ, F], [BATCH, SEQ, dirs * H]
        nodes.append(helper.make_node("Reshape", ["s", "shape"], ["f"]))
    else:  # Y [seq, dirs, batch, hidden]
        x_dims, feat = [SEQ, BATCH, F], [SEQ, BATCH, dirs * H]
        nodes += [
            helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["t", "shape"], ["f"]),
        ]
    nodes.append(helper.make_node("MatMul", ["f", "V"], ["y"]))
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in w.items()]
    inits.append(numpy_helper.from_array(np.array(feat, np.int64), "shape"))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*feat[:2], OUT])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def zero_units(model: onnx.ModelProto, op: str, units: list[int], state_axis: int = 2, readers: int = 0) -> onnx.ModelProto:
    """The input with hidden `units` zeroed here, in every direction: their gate rows in W, R,
    B and P, their initial states; with `readers` (the directions), also what reads them: R's
    columns and V's rows. (Without: the units are 0 at every step, under zero-keeping
    activations.)"""
    g = GATES[op]
    out = onnx.ModelProto()
    out.CopyFrom(model)
    where = {"W": [(1, rows(units, g))], "R": [(1, rows(units, g))], "B": [(1, rows(units, 2 * g))],
             "P": [(1, rows(units, 3))], "H0": [(state_axis, units)], "C0": [(state_axis, units)]}  # fmt: skip
    if readers:
        where["R"].append((2, units))
        where["V"] = [(0, rows(units, readers))]
    for t in out.graph.initializer:
        for axis, idx in where.get(t.name, []):
            v = numpy_helper.to_array(t).copy()
            v[(slice(None),) * axis + (idx,)] = 0
            t.CopyFrom(numpy_helper.from_array(v, t.name))
    return out


def removed_units(result) -> list[int]:
    """The hidden units a prune removed: their R column, from its groups' members."""
    return sorted(
        int(i)
        for gid in result.removed()
        for m in result.groups.groups[gid].members
        if (m.initializer, m.axis) == ("R", 2)
        for i in m.indices
    )


def stored(op: str, dirs: int, h: int, peepholes: bool = False) -> int:
    """The model's parameters at hidden size h, counted from the layer's definition."""
    g = GATES[op]
    n = dirs * g * h * F + dirs * g * h * h + dirs * 2 * g * h + dirs * h * OUT + (dirs * 3 * h if peepholes else 0)
    return n + dirs * BATCH * h * (2 if op == "LSTM" else 1)  # the initial states


def attr(model: onnx.ModelProto, op: str, name: str):
    [node] = [n for n in model.graph.node if n.op_type == op]
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}[name]


CASES = [("LSTM", 2, False), ("LSTM", 1, True), ("GRU", 2, False), ("GRU", 1, True), ("RNN", 2, True), ("RNN", 1, False)]


@pytest.mark.parametrize("op, dirs, default", CASES)
def test_each_hidden_unit_is_one_recurrent_unit_group_in_every_direction(op, dirs, default):
    peepholes = op == "LSTM" and not default
    model = layer(op, dirs, default, peepholes=peepholes)
    gset = find_groups(model)
    [lay] = [la for la in gset.layers if la.kind == "recurrent_unit"]
    assert len(lay.groups) == H and all(gset.groups[i].exact for i in lay.groups)
    # the rest is the interface: x's features (W's columns), y's features (V's columns)
    assert not any(gset.groups[i].exact for la in gset.layers if la.kind != "recurrent_unit" for i in la.groups)
    g = GATES[op]
    for k, gid in enumerate(lay.groups):
        group = gset.groups[gid]
        got = {(m.initializer, m.axis, tuple(int(i) for i in m.indices)) for m in group.members}
        j = int(next(m.indices[0] for m in group.members if (m.initializer, m.axis) == ("R", 2)))
        want = {("W", 1, tuple(rows([j], g))), ("R", 1, tuple(rows([j], g))), ("R", 2, (j,)),
                ("B", 1, tuple(rows([j], 2 * g))), ("V", 0, tuple(d * H + j for d in range(dirs)))}  # fmt: skip
        if not default:  # a zero initial state is no unit's parameter
            want |= {("H0", 2, (j,))} | ({("C0", 2, (j,))} if op == "LSTM" else set())
        if peepholes:
            want.add(("P", 1, tuple(rows([j], 3))))
        assert got == want, (k, sorted(got ^ want))
        assert group.unit.kind == "recurrent_unit" and group.unit.channels == 1


def test_batch_first_layout_units_take_their_states_and_outputs_axes():
    """layout 1 (onnxruntime runs layout 0 only: the groups are checked on the analysis):
    states [batch, dirs, hidden], Y [batch, seq, dirs, hidden] read as dirs * hidden features."""
    gset = find_groups(layer("LSTM", 2, default=False, layout=1))
    [lay] = [la for la in gset.layers if la.kind == "recurrent_unit"]
    assert len(lay.groups) == H and all(gset.groups[i].exact for i in lay.groups)
    group = gset.groups[lay.groups[3]]
    got = {(m.initializer, m.axis): [int(i) for i in m.indices] for m in group.members}
    j = got[("R", 2)][0]
    assert got[("H0", 2)] == got[("C0", 2)] == [j] and got[("V", 0)] == [j, H + j]
    assert got[("W", 1)] == rows([j], 4)


@pytest.mark.parametrize("op, dirs, default", CASES)
def test_prune_removes_units_exactly_against_them_zeroed_here(op, dirs, default):
    peepholes = op == "LSTM" and not default
    model = layer(op, dirs, default, seed=1, peepholes=peepholes)
    result = prune(model, 0.3, draws=1)
    assert result.shrink.validation.passed
    units = removed_units(result)
    assert len(units) == H - int(H * 0.7) == 2  # uniform: 2 of the layer's 6 units
    out = result.model
    assert attr(out, op, "hidden_size") == H - 2
    g = GATES[op]
    np.testing.assert_array_equal(init(out, "W"), np.delete(init(model, "W"), rows(units, g), axis=1))
    np.testing.assert_array_equal(init(out, "R"), np.delete(np.delete(init(model, "R"), rows(units, g), 1), units, 2))
    np.testing.assert_array_equal(init(out, "V"), np.delete(init(model, "V"), rows(units, dirs), axis=0))
    assert params(model) == stored(op, dirs, H, peepholes) == result.original.params
    assert params(out) == stored(op, dirs, H - 2, peepholes) == result.shrink.after.params
    assert error_against(zero_units(model, op, units), out) <= 1e-5


def test_a_unit_with_a_non_zero_preserving_activation_goes_with_its_readers():
    """RNN with Affine (beta 1): a zeroed unit is Affine(0) = 1 at every step, not 0; the group
    also zeroes what reads it (its R column, V's rows), so it still goes, exactly."""
    model = layer("RNN", 2, default=False, seed=4)
    [node] = model.graph.node[:1]
    node.attribute.extend([helper.make_attribute("activations", ["Affine"] * 2),
                           helper.make_attribute("activation_alpha", [0.5] * 2),
                           helper.make_attribute("activation_beta", [1.0] * 2)])  # fmt: skip
    result = prune(model, 0.3, draws=1)
    assert result.shrink.validation.passed and attr(result.model, "RNN", "hidden_size") == H - 2
    units = removed_units(result)
    assert error_against(zero_units(model, "RNN", units), result.model) > 1e-3  # not zero units
    assert error_against(zero_units(model, "RNN", units, readers=2), result.model) <= 1e-5


def test_explicit_zero_preserving_activations_and_a_clip_keep_units_exact():
    """LSTM with its activations spelled out (Sigmoid, Relu, Softsign) and a cell clip: a
    zeroed unit's gate inputs are 0, clipped to 0, and Relu(0) = Softsign(0) = 0."""
    model = layer("LSTM", 2, default=False, seed=2)
    [node] = model.graph.node[:1]
    node.attribute.extend([helper.make_attribute("activations", ["Sigmoid", "Relu", "Softsign"] * 2),
                           helper.make_attribute("clip", 2.0)])  # fmt: skip
    result = prune(model, 0.3, draws=1)
    assert result.shrink.validation.passed and attr(result.model, "LSTM", "hidden_size") == H - 2
    assert error_against(zero_units(model, "LSTM", removed_units(result)), result.model) <= 1e-5
    # and the handler finds such units zero from their weights alone (R's columns, V's rows
    # not zeroed): a shrink with no masks removes them
    shrunk = shrink_checked(zero_units(model, "LSTM", [1, 4])).model
    assert attr(shrunk, "LSTM", "hidden_size") == H - 2


# ------------------------------------------------------------------ torch exports
def torch_layer(kind: str):
    """nn.LSTM / GRU / RNN (library-default init: uniform, biases included), bidirectional and
    batch first, started from random initial states held as buffers, then a Linear on its
    outputs at every step."""
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(nn, kind)(F, H, batch_first=True, bidirectional=True)
            self.register_buffer("h0", torch.randn(2, BATCH, H))
            if kind == "LSTM":
                self.register_buffer("c0", torch.randn(2, BATCH, H))
            self.head = nn.Linear(2 * H, OUT)

        def forward(self, x):
            state = (self.h0, self.c0) if kind == "LSTM" else self.h0
            y, _ = self.rnn(x, state)
            return self.head(y)

    torch.manual_seed({"LSTM": 1, "GRU": 2, "RNN": 3}[kind])
    return Layer().eval()


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_torch_batch_first_bidirectional_layer_with_initial_states_is_pruned_exactly(tmp_path, kind, capsys):
    from models.zoo import export
    from onnxshrink import shrink
    from onnxshrink.cli import main

    path = tmp_path / "layer.onnx"
    export(torch_layer(kind), path, (BATCH, SEQ, F), dynamo=False)
    model = onnx.load(path)
    [node] = [n for n in model.graph.node if n.op_type == kind]
    result = prune(path, 0.3, draws=1)
    assert result.shrink.validation.passed
    [lay] = [la for la in result.groups.layers if la.kind == "recurrent_unit"]
    assert len(lay.groups) == H and all(result.groups.groups[i].exact for i in lay.groups)
    assert attr(result.model, kind, "hidden_size") == H - 2
    # the layer is named by its node (its packed weights have no framework name), its units
    # by their kind, as the command line prints them
    assert lay.name == f"{node.name} ({kind})" == f"/rnn/{kind} ({kind})"
    if kind == "LSTM":
        assert main([str(path), "--prune", "0.3", "--no-price", "-o", str(tmp_path / "small.onnx")]) == 0
        assert f"/rnn/LSTM (LSTM): 2 of {H} recurrent_unit(s)" in capsys.readouterr().out
    # the units zeroed here in the exported weights (found by the node's inputs) give the same
    units = sorted(int(i) for gid in result.removed() for m in result.groups.groups[gid].members
                   if (m.initializer, m.axis) == (node.input[2], 2) for i in m.indices)  # fmt: skip
    assert len(units) == 2
    g = GATES[kind]
    masks = {node.input[1]: (1, rows(units, g)), node.input[2]: (1, rows(units, g)), node.input[3]: (1, rows(units, 2 * g))}
    states = node.input[5:7]
    assert states == (["h0", "c0"] if kind == "LSTM" else ["h0"])  # the buffers, as stored
    masks.update({s: (2, units) for s in states})
    reference = onnx.ModelProto()
    reference.CopyFrom(model)
    for t in reference.graph.initializer:
        if t.name in masks:
            v = numpy_helper.to_array(t).copy()
            axis, idx = masks[t.name]
            v[(slice(None),) * axis + (idx,)] = 0
            t.CopyFrom(numpy_helper.from_array(v, t.name))
    assert error_against(reference, result.model) <= 1e-5
    # the masks-out round trip: the prune's masks applied to the input, the same model
    masks_path = tmp_path / "masks.npz"
    np.savez(masks_path, **result.masks)
    again = shrink(path, masks_path, validate=False, input_masked=False)
    assert again.after.params == params(result.model) == result.shrink.after.params
    assert error_against(result.model, again.model) <= 1e-5


# ------------------------------------------------------------------ DynamicQuantizeLSTM
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_dynamic_lstm_units_are_pruned_exactly(tmp_path, per_channel):
    """onnxruntime's quantize_dynamic turns the LSTM into DynamicQuantizeLSTM (int8 W and R
    transposed, [dirs, input, 4h] and [dirs, h, 4h], a scale and zero point per direction or
    per column) and V's MatMul into MatMulInteger. A unit's columns go to their zero point with
    its B, P and states: it is 0 at every step, and 0 is in every range the kernels quantize
    with, so the prune is exact against the quantized input with the units zeroed here."""
    import logging

    from onnxruntime.quantization import quantize_dynamic

    src, path = tmp_path / "lstm.onnx", tmp_path / "lstm_dynamic.onnx"
    onnx.save(layer("LSTM", 2, default=False, seed=5, peepholes=True), src)
    logging.disable(logging.WARNING)
    try:
        quantize_dynamic(src, path, per_channel=per_channel)
    finally:
        logging.disable(logging.NOTSET)
    model = onnx.load(path)
    [node] = [n for n in model.graph.node if n.op_type == "DynamicQuantizeLSTM"]
    assert init(model, node.input[8]).shape == ((2, 4 * H) if per_channel else (2,))
    result = prune(model, 0.3, draws=1)
    assert result.shrink.validation.passed
    [lay] = [la for la in result.groups.layers if la.kind == "recurrent_unit"]
    assert len(lay.groups) == H and all(result.groups.groups[i].exact for i in lay.groups)
    assert attr(result.model, "DynamicQuantizeLSTM", "hidden_size") == H - 2
    units = sorted(int(i) for gid in result.removed() for m in result.groups.groups[gid].members
                   if (m.initializer, m.axis) == (node.input[2], 1) for i in m.indices)  # fmt: skip
    assert len(units) == 2
    cols = rows(units, 4)
    reference = onnx.ModelProto()
    reference.CopyFrom(model)
    values = {t.name: numpy_helper.to_array(t).copy() for t in reference.graph.initializer}
    for q, zp in ((node.input[1], node.input[9]), (node.input[2], node.input[11])):
        z = values[zp]
        values[q][:, :, cols] = (z[:, None, cols] if z.ndim == 2 else z[:, None, None]).astype(values[q].dtype)
    values["B"][:, rows(units, 8)] = 0
    values["P"][:, rows(units, 3)] = 0
    values["H0"][:, :, units] = values["C0"][:, :, units] = 0
    for t in reference.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
    assert error_against(reference, result.model) <= 1e-5
    # the integer weights lost the units' columns; their per-column scales too
    np.testing.assert_array_equal(init(result.model, node.input[2]), np.delete(np.delete(values[node.input[2]], cols, 2), units, 1))
    if per_channel:
        assert init(result.model, node.input[8]).shape == (2, 4 * (H - 2))


GRU_LAST = """
g (float[5, 2, 3] x, float[1, 18, 3] W, float[1, 18, 6] R, float[1, 36] B, float[6, 4] V) => (float[2, 4] y) {
  s, last = GRU <hidden_size = 6, linear_before_reset = 1> (x, W, R, B)
  axes = Constant <value = int64[1] {0}> ()
  q = Squeeze (last, axes)
  y = MatMul (q, V)
}"""


def test_a_gru_read_through_its_last_state_loses_units():
    """Y_h alone is read (a classifier on the last step), through a Squeeze; torch's GRU form
    (linear_before_reset 1: r multiplies R h + Rb, 0 for a zeroed unit)."""
    from conftest import tiny

    model = tiny(GRU_LAST, seed=6)
    result = prune(model, 0.3, draws=1)
    assert result.shrink.validation.passed and attr(result.model, "GRU", "hidden_size") == H - 2
    units = removed_units(result)
    np.testing.assert_array_equal(init(result.model, "V"), np.delete(init(model, "V"), units, axis=0))
    assert params(model) == 18 * 3 + 18 * 6 + 36 + 6 * 4  # W, R, B, V at 6 units; at 4:
    assert params(result.model) == result.shrink.after.params == 12 * 3 + 12 * 4 + 24 + 4 * 4
    assert error_against(zero_units(model, "GRU", units), result.model) <= 1e-5


def test_a_legacy_exported_crnn_with_a_dynamic_width_loses_conv_channels_and_units(tmp_path):
    """A CRNN as OCR models are (ddddocr's): convs, the feature map reshaped to (width, batch,
    channels x height) by a target computed from Shape (the width is dynamic), a two-layer
    bidirectional LSTM, a Linear per step. The legacy exporter gives the Reshape and the
    Transpose after it no shape; their ranks are the target's length and the input's, so the
    first LSTM's input is known rank 3 (it was a barrier that kept the whole head)."""
    import torch
    from torch import nn

    from models.zoo import export

    class CRNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.cnn = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                     nn.Conv2d(8, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d((4, 1)))  # fmt: skip
            self.rnn = nn.LSTM(6 * 2, 8, num_layers=2, bidirectional=True)
            self.fc = nn.Linear(16, 5)

        def forward(self, x):
            f = self.cnn(x)
            b, c, h, w = f.shape
            y, _ = self.rnn(f.view(b, c * h, w).permute(2, 0, 1))
            return self.fc(y)

    torch.manual_seed(7)
    path = tmp_path / "crnn.onnx"
    export(CRNN().eval(), path, (1, 1, 16, 12), dynamic={3: "width"}, dynamo=False)
    model = onnx.load(path)
    [x] = model.graph.input
    assert x.type.tensor_type.shape.dim[3].dim_param  # the width is dynamic
    result = prune(path, 0.3, draws=1, input_shapes={x.name: [1, 1, 16, 12]})
    assert result.shrink.validation.passed
    exact = {la.name: (la.kind, len(la.groups)) for la in result.groups.layers
             if la.groups and all(result.groups.groups[i].exact for i in la.groups)}  # fmt: skip
    assert sorted(exact.values()) == [("channel", 6), ("channel", 8), ("recurrent_unit", 8), ("recurrent_unit", 8)]
    sizes = [{a.name: helper.get_attribute_value(a) for a in n.attribute}["hidden_size"]
             for n in result.model.graph.node if n.op_type == "LSTM"]  # fmt: skip
    assert sizes == [int(8 * 0.7)] * 2 and not result.shrink.barriers  # 3 of 8 units went
    # one ConstantOfShape of zeros is both layers' initial states: each layer keeps other units
    assert not result.shrink.kept_after_failed_proof
    assert params(result.model) == result.shrink.after.params < 0.6 * params(model)
