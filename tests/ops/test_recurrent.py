"""LSTM, GRU and RNN (ops/recurrent.py): hidden units removed with their gate rows, R columns,
states and outputs; hidden_size rewritten; a unit a kept unit reads through R stays."""

import numpy as np
import onnx
import pytest
from conftest import (
    export_cached,
    half_masked,
    init,
    params,
    shapes,
    shrink_checked,
    tiny,
    zero_slices,
)

from models.recurrent import RECURRENT

H = 6
DEAD = [1, 4]


def unit_rows(units, gates, h=H):
    return [g * h + u for g in range(gates) for u in units]


RNN = """
g (float[5, 2, 3] x, float[1, {gh}, 3] W, float[1, {gh}, 6] R, float[1, {bh}] B, float[4, 6] V) => (float[5, 1, 2, 4] y) {{
  s, last = {op} <hidden_size = 6{attrs}> (x, W, R, B)
  y = MatMul (s, V)
}}"""


def rnn(op, zero, attrs="", values=None):
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    text = RNN.format(op=op, gh=gates * H, bh=2 * gates * H, attrs=attrs)
    text = text.replace("float[4, 6] V", "float[6, 4] V")
    return tiny(text, zero=zero, values=values), gates


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_units_no_output_reads_go_with_their_rows_and_r_columns(op):
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    rows = unit_rows(DEAD, gates)
    # the units' output rows of V masked, and R's columns for them (no kept unit reads them)
    model, _ = rnn(op, {"V": np.s_[DEAD], "R": np.s_[:, :, DEAD]})
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["W"] == (1, gates * 4, 3) and s["R"] == (1, gates * 4, 4) and s["B"] == (1, 2 * gates * 4)
    assert s["V"] == (4, 4)
    [node] = [n for n in result.model.graph.node if n.op_type == op]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}["hidden_size"] == 4
    # exactly the units' rows went (one per gate), and their R columns and B entries (two halves)
    got = {n: init(result.model, n) for n in ("W", "R", "B")}
    np.testing.assert_array_equal(got["W"], np.delete(init(model, "W"), rows, axis=1))
    np.testing.assert_array_equal(got["R"], np.delete(np.delete(init(model, "R"), rows, axis=1), DEAD, axis=2))
    np.testing.assert_array_equal(got["B"], np.delete(init(model, "B"), unit_rows(DEAD, 2 * gates), axis=1))


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_a_unit_a_kept_unit_reads_through_r_stays(op):
    model, gates = rnn(op, {"V": np.s_[DEAD]})  # R's columns for them are not masked
    result = shrink_checked(model)
    assert shapes(result.model)["R"] == (1, gates * H, H)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_a_zeroed_unit_is_zero_and_goes_even_when_others_read_it(op):
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    rows = unit_rows(DEAD, gates)
    brows = unit_rows(DEAD, 2 * gates)
    # W, R rows and B zeroed: the unit is 0 at every step; R's columns and V's rows not masked
    model, _ = rnn(op, {"W": np.s_[:, rows], "R": np.s_[:, rows], "B": np.s_[:, brows]})
    result = shrink_checked(model)
    assert shapes(result.model)["R"] == (1, gates * 4, 4) and shapes(result.model)["V"] == (4, 4)


def test_a_zeroed_unit_with_a_non_default_activation_stays():
    rows = unit_rows(DEAD, 1)
    model, _ = rnn(
        "RNN",
        {"W": np.s_[:, rows], "R": np.s_[:, rows], "B": np.s_[:, unit_rows(DEAD, 2)]},
        attrs=', activations = ["Affine"], activation_alpha = [0.5], activation_beta = [1.0]',
    )
    result = shrink_checked(model)  # Affine(0) = 1: not a zero unit
    assert shapes(result.model)["R"] == (1, H, H)


LSTM_BI = """
g (float[5, 2, 3] x, float[2, 24, 3] W, float[2, 24, 6] R, float[2, 48] B, float[2, 18] P, float[2, 2, 6] H0, float[2, 2, 6] C0, float[12, 4] V) => (float[5, 2, 4] y) {
  s, hn, cn = LSTM <hidden_size = 6, direction = "bidirectional"> (x, W, R, B, , H0, C0, P)
  t = Transpose <perm = [0, 2, 1, 3]> (s)
  shape = Constant <value = int64[3] {5, 2, 12}> ()
  f = Reshape (t, shape)
  y = MatMul (f, V)
}"""


def test_bidirectional_lstm_with_peepholes_and_initial_states():
    rows = unit_rows(DEAD, 4)
    cols = [d * H + u for d in range(2) for u in DEAD]
    model = tiny(LSTM_BI, zero={"V": np.s_[cols], "R": np.s_[:, :, DEAD]})
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["W"] == (2, 16, 3) and s["R"] == (2, 16, 4) and s["B"] == (2, 32) and s["P"] == (2, 12)
    assert s["H0"] == s["C0"] == (2, 2, 4) and s["V"] == (8, 4)
    # in both directions: the units' gate rows, peepholes and initial states; V's rows for them
    np.testing.assert_array_equal(init(result.model, "W"), np.delete(init(model, "W"), rows, axis=1))
    np.testing.assert_array_equal(init(result.model, "P"), np.delete(init(model, "P"), unit_rows(DEAD, 3), axis=1))
    np.testing.assert_array_equal(init(result.model, "H0"), np.delete(init(model, "H0"), DEAD, axis=2))
    np.testing.assert_array_equal(init(result.model, "V"), np.delete(init(model, "V"), cols, axis=0))


def test_batch_first_layout_maps_the_axes():
    # onnxruntime runs layout 0 only: the rule is checked on the analysis
    from onnxshrink.testing import analyze_node

    bench = analyze_node(
        """g (float[2, 5, 3] x, float[1, 24, 3] W, float[1, 24, 6] R, float[2, 1, 6] H0) => (float[2, 5, 1, 6] y) {
          s, hn, cn = LSTM <hidden_size = 6, layout = 1> (x, W, R, , , H0)
          y = Identity (s)
        }""",
        needs={"y": {3: [0, 2]}},
        zero={"R": np.s_[:, :, [1, 3, 4, 5]]},
    )
    assert bench.kept("s", 3) == [0, 2] and bench.kept("H0", 2) == [0, 2]
    assert bench.kept("W", 1) == unit_rows([0, 2], 4) and bench.kept("R", 2) == [0, 2]
    assert bench.kept("x", 0) == [0, 1] and bench.barriers == []


def test_zero_units_need_zero_initial_states():
    rows, brows = unit_rows(DEAD, 4), unit_rows(DEAD, 8)
    zero = {"W": np.s_[:, rows], "R": np.s_[:, rows], "B": np.s_[:, brows], "P": np.s_[:, unit_rows(DEAD, 3)]}
    result = shrink_checked(tiny(LSTM_BI, zero=zero))  # random initial states: not zero units
    assert shapes(result.model)["R"] == (2, 24, 6)
    result = shrink_checked(tiny(LSTM_BI, zero={**zero, "H0": np.s_[:, :, DEAD], "C0": np.s_[:, :, DEAD]}))
    assert shapes(result.model)["R"] == (2, 16, 4)


@pytest.mark.parametrize("dynamo", [False, True])
def test_lstm_bilstm_gru_model_reaches_the_native_size(zoo_dir, dynamo):
    masked = export_cached(zoo_dir, ("rnn", "masked", dynamo), half_masked(RECURRENT, "masked", dynamo=dynamo))
    native = export_cached(zoo_dir, ("rnn", "native", dynamo), half_masked(RECURRENT, "native", dynamo=dynamo))
    result = shrink_checked(masked)
    assert params(result.model) == result.after.params == params(onnx.load(native))
    assert result.after.params < 0.4 * result.before.params
    assert not result.barriers and not result.kept_zeroed


LSTM_BI_PLAIN = """
g (float[5, 2, 3] x, float[2, 24, 3] W, float[2, 24, 6] R, float[2, 48] B, float[12, 4] V) => (float[5, 2, 4] y) {
  s, hn, cn = LSTM <hidden_size = 6, direction = "bidirectional"> (x, W, R, B)
  t = Transpose <perm = [0, 2, 1, 3]> (s)
  shape = Constant <value = int64[3] {5, 2, 12}> ()
  f = Reshape (t, shape)
  y = MatMul (f, V)
}"""


def test_masks_that_differ_per_direction_keep_their_union():
    """hidden_size is one attribute for both directions: a unit goes only when it is zero in
    both. Masks (a dict, applied to the unmasked model) make units 1, 4 zero forward and 1, 2
    backward: unit 1 goes, 2 and 4 stay in both directions."""
    model = tiny(LSTM_BI_PLAIN, seed=3)
    masks = {n: np.ones(init(model, n).shape, np.float32) for n in ("W", "R", "B")}
    for d, units in enumerate([[1, 4], [1, 2]]):
        masks["W"][d, unit_rows(units, 4)] = 0
        masks["R"][d, unit_rows(units, 4)] = 0
        masks["B"][d, unit_rows(units, 8)] = 0
    result = shrink_checked(model, masks=masks)  # against the model with the masks applied here
    assert result.input_masked is False
    s = shapes(result.model)
    assert s["W"] == (2, 20, 3) and s["R"] == (2, 20, 5) and s["B"] == (2, 40) and s["V"] == (10, 4)
    [node] = [n for n in result.model.graph.node if n.op_type == "LSTM"]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}["hidden_size"] == 5
    # unit 1's rows went from both directions; the rows zero in one direction only stayed, zero
    w = init(model, "W") * masks["W"]
    np.testing.assert_array_equal(init(result.model, "W"), np.delete(w, unit_rows([1], 4), axis=1))
    assert (params(model), params(result.model)) == (576, 2 * 20 * 3 + 2 * 20 * 5 + 2 * 40 + 10 * 4)


# ------------------------------------------------------------------ DynamicQuantizeLSTM
# onnxruntime.quantization's quantize_dynamic writes it for LSTM (ddddocr's common_old.onnx):
# integer W [dirs, input, 4h] and R [dirs, h, 4h], their scale and zero point per direction or
# per column. The kernel quantizes X and every step's hidden state from their ranges, so only
# units zero at every step and input features that are zero go.
QLSTM = """<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (float[5, 2, 4] x, float[4, 3] U, int8[2, 3, 24] Wq, {ps} Ws, {pz} Wz, int8[2, 6, 24] Rq, {ps} Rs,
   {pz} Rz, float[2, 48] B, float[6, 4] V) => (float[5, 2, 2, 4] y) {{
  u = MatMul (x, U)
  s, yh, yc = com.microsoft.DynamicQuantizeLSTM <hidden_size = 6, direction = "bidirectional">
      (u, Wq, Rq, B, , , , , Ws, Wz, Rs, Rz)
  y = MatMul (s, V)
}}"""


def qlstm(per_column: bool, default: bool, dead_units=(1, 4), dead_features=(2,), live_unread=()):
    """Units `dead_units` at their zero points (W and R columns, B 0): zero at every step; U's
    columns `dead_features` zero (X's features there are 0); `live_unread`: units V does not read
    (its rows zero) but live."""
    rng = np.random.default_rng(21)
    shape = (2, 24) if per_column else (2,)
    # onnxruntime takes per-column zero points only when they are 0 (symmetric int8)
    zw = np.zeros(shape, np.int64) if default or per_column else rng.integers(-4, 4, shape)
    zr = np.zeros(shape, np.int64) if default or per_column else rng.integers(-4, 4, shape)
    wq, rq = rng.integers(-100, 100, (2, 3, 24)), rng.integers(-100, 100, (2, 6, 24))
    b = np.zeros((2, 48)) if default else rng.uniform(-0.5, 0.5, (2, 48))
    cols, bcols = unit_rows(list(dead_units), 4), unit_rows(list(dead_units), 8)
    for q, z in ((wq, zw), (rq, zr)):
        q[:, :, cols] = z[:, None, cols] if per_column else z[:, None, None]
    b[:, bcols] = 0
    u = rng.normal(size=(4, 3))
    u[:, list(dead_features)] = 0
    v = rng.normal(size=(6, 4))
    v[list(live_unread)] = 0
    scale = (lambda: np.ones(shape)) if default else (lambda: rng.uniform(0.002, 0.01, shape))
    values = {"U": u, "Wq": wq, "Ws": scale(), "Wz": zw, "Rq": rq, "Rs": scale(), "Rz": zr, "B": b, "V": v}
    text = QLSTM.format(ps=f"float[{', '.join(map(str, shape))}]", pz=f"int8[{', '.join(map(str, shape))}]")
    return tiny(text, values=values)


@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("default", [False, True])
def test_dynamic_quantize_lstm_zero_units_and_zero_features_go(per_column, default):
    model = qlstm(per_column, default)
    result = shrink_checked(model)
    s = shapes(result.model)
    assert s["Wq"] == (2, 2, 16) and s["Rq"] == (2, 4, 16) and s["B"] == (2, 32)
    assert s["U"] == (4, 2) and s["V"] == (4, 4)
    assert s["Ws"] == s["Wz"] == s["Rs"] == s["Rz"] == ((2, 16) if per_column else (2,))
    [node] = [n for n in result.model.graph.node if n.op_type == "DynamicQuantizeLSTM"]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}["hidden_size"] == 4
    # W, R, B, U's column, V's rows, and per column the four scales' and zero points' columns
    removed = (144 - 64) + (288 - 128) + (96 - 64) + 4 + 8 + (4 * (48 - 32) if per_column else 0)
    assert params(result.model) == params(model) - removed
    assert not result.barriers


def test_dynamic_quantize_lstm_a_live_unit_no_one_reads_stays():
    """Its value moves the range the hidden state is quantized with at every step."""
    model = qlstm(False, False, dead_units=(), dead_features=(), live_unread=(0, 3))
    result = shrink_checked(model)
    assert shapes(result.model)["Rq"] == (2, 6, 24)


def test_quantize_dynamic_lstm_model_reaches_the_quantized_native_size(zoo_dir):
    """The zoo's recurrent model with half its units masked, quantized by quantize_dynamic (its
    LSTMs become DynamicQuantizeLSTM, int8 weights symmetric: a masked unit's columns are their
    zero point 0), shrinks to the parameters of the natively smaller model quantized alike."""
    import logging

    from onnxruntime.quantization import quantize_dynamic

    paths = {}
    for which in ("masked", "native"):
        path = export_cached(zoo_dir, ("rnn", which, False), half_masked(RECURRENT, which, dynamo=False))
        paths[which] = path.with_name(f"{path.stem}_dynamic.onnx")
        if not paths[which].exists():
            logging.disable(logging.WARNING)
            try:
                quantize_dynamic(path, paths[which])
            finally:
                logging.disable(logging.NOTSET)
    masked = onnx.load(paths["masked"])
    assert sum(n.op_type == "DynamicQuantizeLSTM" for n in masked.graph.node) == 2
    result = shrink_checked(paths["masked"])
    assert params(result.model) == result.after.params == params(onnx.load(paths["native"]))
    assert result.after.params < 0.4 * result.before.params
    assert not result.barriers


TILED_STATE = """
g (float[5, 2, 3] x, float[2, {gh}, 3] W, float[2, {gh}, 6] R, float[2, {bh}] B, float[1, 2, 6] C, float[12, 4] V)
  => (float[5, 2, 4] y) {{
  one = Constant <value = int64[1] {{1}}> ()
  two = Constant <value = int64[1] {{2}}> ()
  ones = Constant <value = int64[2] {{1, 1}}> ()
  xs = Shape (x)
  n = Slice (xs, one, two)
  reps = Concat <axis = 0> (n, ones)
  t = Tile (C, reps)
  s0 = Transpose <perm = [1, 0, 2]> (t)
  s, last{cell} = {op} <hidden_size = 6, direction = "bidirectional"> (x, W, R, B, , s0{c0})
  shape = Constant <value = int64[3] {{0, 0, -1}}> ()
  st = Transpose <perm = [0, 2, 1, 3]> (s)
  r = Reshape (st, shape)
  y = MatMul (r, V)
}}"""


@pytest.mark.parametrize("state", ["zero", "random"])
@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_units_go_from_an_initial_state_tiled_to_the_batch_at_run_time(op, state):
    """paddle2onnx's LSTMs (PP-OCRv2's recognizer) start from a constant Tiled to the batch
    size the graph reads at run time, so shape inference knows no width of the state: the
    units whose rows, R columns and Y readers are zero go, the state read through a Gather of
    the kept units (before: left whole, and onnxruntime refused the shrunk op: 'Input
    initial_h must have shape {2,2,4}. Actual:{2,2,6}'); a zero constant Tiled is 0 whatever
    the repeats, and the zero state is left out (ONNX's default)."""
    gates = {"GRU": 3, "LSTM": 4}[op]
    rows = unit_rows(DEAD, gates)
    text = TILED_STATE.format(op=op, gh=gates * H, bh=2 * gates * H, cell=", cell" if op == "LSTM" else "",
                              c0=", s0" if op == "LSTM" else "")  # fmt: skip
    c = np.zeros((1, 2, H)) if state == "zero" else np.random.default_rng(1).standard_normal((1, 2, H))
    zero = {"W": np.s_[:, rows], "R": np.s_[:, rows], "B": np.s_[:, unit_rows(DEAD, 2 * gates)],
            "V": np.s_[[d * H + u for d in range(2) for u in DEAD]]}  # fmt: skip
    model = zero_slices(tiny(text, zero=zero, values={"C": c}), {"R": [(2, DEAD)]})  # no unit reads them
    result = shrink_checked(model)
    [node] = [n for n in result.model.graph.node if n.op_type == op]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}["hidden_size"] == H - len(DEAD)
    states = [x for x in node.input[5:] if x]
    assert len(states) == (0 if state == "zero" else 2 if op == "LSTM" else 1)
    # the Tile kept whole is reported where the shrunk model still holds it (it makes the state
    # the Gather reads), not where the zero state it made was left out
    tiles = [n for n in result.model.graph.node if n.op_type == "Tile"]
    assert [b["op"] for b in result.barriers] == [n.op_type for n in tiles] == ([] if state == "zero" else ["Tile"])
    kept = H - len(DEAD)
    got = shapes(result.model)
    assert (got["W"], got["R"], got["B"], got["V"]) == ((2, gates * kept, 3), (2, gates * kept, kept), (2, 2 * gates * kept), (2 * kept, 4))
