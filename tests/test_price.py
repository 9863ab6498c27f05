"""The price of a prune is the pruned model against the INPUT model (issue 32), whatever chose
the size (`--prune`, `--prune-to-params`, with or without compensation), on the held-out
inputs, else the calibration inputs, else the proof's random draws, each labelled so.

Every figure it gives (relative error, cosine mean and min, top-1 agreement) is computed here
independently: onnxruntime on the input model and on the written or returned pruned model, on
the same inputs, and numpy in float64. Before the fix, `--prune RATIO` without compensation
zeroed the chosen groups in the copy it had read and then priced the pruned model against
that: a relative error of ~0 for any prune.
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from conftest import cli, ort_run, tiny

from onnxshrink.prune import prune

# a small classifier: two convolutions (the first through a BatchNormalization), global average
# pooling and a linear head over 10 classes
CNN = """
g (float[16,3,8,8] x, float[8,3,3,3] W1, float[8] B1, float[8] S, float[8] T, float[8] M, float[8] V,
   float[12,8,3,3] W2, float[12] B2, float[10,12] W3, float[10] B3) => (float[16,10] y) {
  c1 = Conv<pads=[1,1,1,1]>(x, W1, B1)
  n1 = BatchNormalization(c1, S, T, M, V)
  r1 = Relu(n1)
  c2 = Conv<pads=[1,1,1,1]>(r1, W2, B2)
  r2 = Relu(c2)
  p = GlobalAveragePool(r2)
  f = Flatten(p)
  y = Gemm<transB=1>(f, W3, B3)
}
"""

# a pre-norm transformer block: LayerNorm, 4 attention heads of 4 (Reshape, Transpose,
# Softmax), the output projection and residual, then LayerNorm, a ReLU FFN of 32 and residual
BLOCK = """
g (float[2,6,16] x, float[16] G1, float[16] H1, float[16,16] Wq, float[16] Bq, float[16,16] Wk,
   float[16] Bk, float[16,16] Wv, float[16] Bv, float[16,16] Wo, float[16] Bo, float[16] G2,
   float[16] H2, float[16,32] Wf, float[32] Bf, float[32,16] Wg, float[16] Bg,
   int64[4] Heads, int64[3] Back, float Scale) => (float[2,6,16] y) {
  a = LayerNormalization<axis=-1>(x, G1, H1)
  q0 = MatMul(a, Wq)
  q1 = Add(q0, Bq)
  q2 = Reshape(q1, Heads)
  q = Transpose<perm=[0,2,1,3]>(q2)
  k0 = MatMul(a, Wk)
  k1 = Add(k0, Bk)
  k2 = Reshape(k1, Heads)
  k = Transpose<perm=[0,2,3,1]>(k2)
  v0 = MatMul(a, Wv)
  v1 = Add(v0, Bv)
  v2 = Reshape(v1, Heads)
  v = Transpose<perm=[0,2,1,3]>(v2)
  s0 = MatMul(q, k)
  s = Mul(s0, Scale)
  p = Softmax<axis=-1>(s)
  o0 = MatMul(p, v)
  o1 = Transpose<perm=[0,2,1,3]>(o0)
  o2 = Reshape(o1, Back)
  o3 = MatMul(o2, Wo)
  o = Add(o3, Bo)
  h = Add(x, o)
  b = LayerNormalization<axis=-1>(h, G2, H2)
  f0 = MatMul(b, Wf)
  f1 = Add(f0, Bf)
  f = Relu(f1)
  g0 = MatMul(f, Wg)
  g1 = Add(g0, Bg)
  y = Add(h, g1)
}
"""


def trained_like(text: str, seed: int, default_init: bool = False) -> onnx.ModelProto:
    """Weights scaled by their fan-in, biases and norm parameters of both signs and sizes (a
    trained model's spread of channel importance); `default_init`: what a library's fresh model
    holds instead (zero biases, unit gains, zero shifts, BatchNorm at its defaults)."""
    model = onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]>\n' + text)
    rng = np.random.default_rng(seed)
    columns = "MatMul" in text  # MatMul weights are [in, out]; Conv and Gemm(transB) ones [out, in, ...]
    values: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        name, dims = inp.name, [d.dim_value for d in inp.type.tensor_type.shape.dim]
        if not name[:1].isupper() or name in ("Heads", "Back", "Scale"):
            continue
        if len(dims) >= 2:  # a weight: [out, in, ...] for Conv and Gemm (transB), [in, out] for MatMul
            fan_in = dims[0] if columns else int(np.prod(dims[1:]))
            values[name] = rng.normal(0, (2.0 / fan_in) ** 0.5, dims)
        elif default_init:
            values[name] = np.ones(dims) if name[0] in "GSV" else np.zeros(dims)
        elif name[0] in "GS":
            values[name] = rng.uniform(0.3, 1.7, dims)
        elif name[0] == "V":
            values[name] = rng.uniform(0.5, 1.5, dims)
        else:
            values[name] = rng.normal(0.1, 0.6, dims)
    values |= {"Heads": np.array([2, 6, 4, 4]), "Back": np.array([2, 6, 16]), "Scale": np.array(0.5, np.float32)}
    return tiny(text, seed=seed, values={k: v for k, v in values.items() if k in {i.name for i in model.graph.input}})


def feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return {model.graph.input[0].name: np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def independent(model: onnx.ModelProto, pruned: onnx.ModelProto, inputs: list[dict[str, np.ndarray]]) -> dict:
    """The price computed here: relative L2 error over every feed, the cosine of each sample's
    output (a row of the batch axis) with the input model's, top-1 agreement of [batch, classes]."""
    y0 = [ort_run(model, f)[0].astype(np.float64) for f in inputs]
    y = [ort_run(pruned, f)[0].astype(np.float64) for f in inputs]
    rel = np.sqrt(sum(np.sum((b - a) ** 2) for a, b in zip(y0, y, strict=True)) / sum(np.sum(a**2) for a in y0))
    rows0 = np.concatenate([a.reshape(a.shape[0], -1) for a in y0])
    rows = np.concatenate([b.reshape(b.shape[0], -1) for b in y])
    cos = np.sum(rows0 * rows, axis=1) / np.linalg.norm(rows0, axis=1) / np.linalg.norm(rows, axis=1)
    top1 = float(np.mean(rows0.argmax(1) == rows.argmax(1))) if y0[0].ndim == 2 else None
    return {"rel_error": rel, "cosine_mean": cos.mean(), "cosine_min": cos.min(), "top1": top1}


def assert_price(price, expected: dict) -> None:
    (out,) = price.outputs if not isinstance(price, dict) else price["outputs"]
    got = out if isinstance(out, dict) else out.__dict__
    assert expected["rel_error"] > 1e-3  # a real prune: the zeroed-reference figure would be ~0
    for key in ("rel_error", "cosine_mean", "cosine_min"):
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    if expected["top1"] is None:
        assert got["top1"] is None
    else:
        assert got["top1"] == pytest.approx(expected["top1"], abs=1e-12)


MODELS = {"cnn": CNN, "block": BLOCK}


@pytest.mark.parametrize("name", ["cnn", "block"])
@pytest.mark.parametrize(
    "how",
    [
        {"ratio": 0.3},
        {"ratio": 0.3, "compensate": "bias"},
        {"params": 0.7},
        {"params": 0.7, "compensate": "bias"},
    ],
    ids=["ratio", "ratio-bias", "params", "params-bias"],
)
def test_the_price_is_the_pruned_model_against_the_input(name, how):
    model = trained_like(MODELS[name], seed=3)
    kept = model.SerializeToString()
    cal, held = [feeds(model, 1), feeds(model, 2)], [feeds(model, 3), feeds(model, 4)]
    result = prune(model, data=cal, held_out=held, validate=False, **how)
    assert model.SerializeToString() == kept  # the caller's model is not changed
    assert result.shrink.after.params < result.original.params
    assert result.price.inputs == "held-out inputs (the given inputs)"
    assert_price(result.price, independent(model, result.model, held))
    assert result.price.latency_before_ms > 0 and result.price.latency_after_ms > 0


@pytest.mark.parametrize("given", ["calibration", "none"])
def test_without_held_out_inputs_the_price_says_which_it_took(given):
    from onnxshrink.proof.inputs import make_inputs, resolve_shapes

    model = trained_like(CNN, seed=5)
    if given == "calibration":  # the calibration inputs, which the criterion has also read
        cal = [feeds(model, 1), feeds(model, 2)]
        result = prune(model, 0.3, criterion="wanda", data=cal, validate=False)
        assert result.price.inputs.startswith("calibration inputs (the given inputs; no held-out set given")
        inputs = cal
    else:  # the proof's random draws (3, seed 0 by default)
        result = prune(model, 0.3, validate=False)
        assert result.price.inputs.startswith("random inputs (no --inputs given")
        inputs = make_inputs(model, resolve_shapes(model, {}), 3, 0)
    assert_price(result.price, independent(model, result.model, inputs))


def test_library_default_init_is_priced_against_the_input():
    model = trained_like(BLOCK, seed=7, default_init=True)
    held = [feeds(model, 3)]
    result = prune(model, 0.3, held_out=held, validate=False)
    assert_price(result.price, independent(model, result.model, held))


PRICE_LINE = re.compile(
    r"    y: relative error (\S+), cosine mean (\S+) / min (\S+)(?:, top-1 agreement (\S+)%)?$", re.M
)


@pytest.mark.parametrize("name", ["cnn", "block"])
def test_the_command_line_prints_the_price_against_the_input(tmp_path, name):
    model = trained_like(MODELS[name], seed=11)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", **feeds(model, 1))
    np.savez(tmp_path / "held.npz", **feeds(model, 2))
    p = cli(
        "m.onnx", "--prune", "0.3", "--inputs", "cal.npz", "--held-out", "held.npz",
        "-o", "out.onnx", "--report", "r.json", cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    expected = independent(model, onnx.load(tmp_path / "out.onnx"), [feeds(model, 2)])
    report = json.loads((tmp_path / "r.json").read_text())
    assert_price(report["price"], expected)
    assert "price on the held-out inputs (held.npz):" in p.stdout
    (line,) = PRICE_LINE.findall(p.stdout)
    rel, cos_mean, cos_min, top1 = line
    assert float(rel) == pytest.approx(expected["rel_error"], rel=6e-4)
    assert float(cos_mean) == pytest.approx(expected["cosine_mean"], abs=6e-5)
    assert float(cos_min) == pytest.approx(expected["cosine_min"], abs=6e-5)
    if expected["top1"] is None:
        assert top1 == ""
    else:
        assert float(top1) == pytest.approx(100 * expected["top1"], abs=0.06)


# three layers of a ReLU MLP over 4 samples, 10 classes: run in segments of one layer each
MLP = """
g (float[4,16] x, float[16,48] W1, float[48] B1, float[48,40] W2, float[40] B2, float[40,10] W3,
   float[10] B3) => (float[4,10] y) {
  h1 = MatMul(x, W1)
  a1 = Add(h1, B1)
  r1 = Relu(a1)
  h2 = MatMul(r1, W2)
  a2 = Add(h2, B2)
  r2 = Relu(a2)
  h3 = MatMul(r2, W3)
  y = Add(h3, B3)
}
"""


class _Cuts(list):
    """The segment count of each model cut, in order, and the thread that cut it (`on`)."""

    on: list[str]


def _segments(monkeypatch, budget: int) -> _Cuts:
    """Models past `budget` bytes of weights run in segments (proof.sessions.SEGMENT_BYTES);
    the segment count of each model cut, in order, and on which thread."""
    import threading

    from onnxshrink.proof import segment, sessions

    cut = _Cuts()
    cut.on = []
    pieces = segment.pieces

    def counted(model, size):
        parts = pieces(model, size)
        cut.append(len(parts) if parts else 1)
        cut.on.append(threading.current_thread().name)
        return parts

    monkeypatch.setattr(sessions, "SEGMENT_BYTES", budget)
    monkeypatch.setattr(segment, "pieces", counted)
    return cut


@pytest.mark.parametrize(
    ("how", "streamed"),
    [({"ratio": 0.3}, False), ({"ratio": 0.3}, True), ({"params": 0.6, "compensate": "bias"}, False)],
    ids=["ratio", "ratio-streamed", "params-bias"],
)
def test_a_model_the_proof_runs_in_segments_is_priced_in_segments_against_the_input(
    tmp_path, monkeypatch, streamed, how
):
    """The input file (external data) and the pruned model, each run segment by segment as the
    proof runs a model past SEGMENT_BYTES: the price is the written output against the input
    file, computed here whole. `streamed`: the large model's path (weights mapped, the zeroed
    ones spilled, the pruned model's weights in a scratch file at price time; a compensated
    reference is made in memory)."""
    from onnxshrink.io.weights import absolute
    from onnxshrink.prune import run as prune_run

    model = trained_like(MLP, seed=13)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    if streamed:  # the sizes that decide it lowered (see test_prune_streamed)
        monkeypatch.setattr("onnxshrink.result.IN_MEMORY_BYTES", 0)
        monkeypatch.setattr("onnxshrink.prune.spill.SPILL_BYTES", 0)
    # W1 is 3 KB, W2 7.5 KB, W3 1.6 KB: the proof's segments of 3000 bytes are three, the
    # price's pieces (a quarter: price.piece_bytes) four, W3's Add in a piece of its own
    cut = _segments(monkeypatch, 3000)
    measured = prune_run.measure
    where: list[object] = []  # the pruned model's data folder, at price time
    monkeypatch.setattr(prune_run, "measure", lambda *a: where.append(a[3]) or measured(*a))
    held = [feeds(model, 3), feeds(model, 4)]
    said: list[str] = []
    out = tmp_path / "out.onnx"
    result = prune(tmp_path / "m.onnx", output=out, data=[feeds(model, 1)], held_out=held, log=said.append, **how)
    assert result.shrink.passed and result.shrink.after.params < result.original.params
    spilled = any(absolute(t) for t in result.shrink.reference.graph.initializer)
    assert spilled == streamed and (where[0] is not None) == streamed
    expected = independent(onnx.load(tmp_path / "m.onnx"), onnx.load(out), held)
    assert_price(result.price, expected)
    assert result.price.latency_before_ms is None and result.price.latency_after_ms is None
    # the price ran the input in 4 pieces, on a thread of its own from before the zeroing (the
    # proof's segments come after it), then the pruned model
    pruned = cut[-1]
    (ahead,) = [k for k, name in enumerate(cut.on) if name == "onnxshrink-price"]
    assert cut[ahead] == 4 and pruned >= 2 and cut.on[-1] == "MainThread"
    assert result.price.note == (
        "latency not measured: a model whose weights pass 2.8e-06 GiB is run here as the proof runs "
        f"it, one segment's session at a time (the input in 4 segments, the pruned model in {pruned} segments): "
        "not its latency deployed"
    )
    printed = "\n".join(said)
    (line,) = PRICE_LINE.findall(printed)
    assert float(line[0]) == pytest.approx(expected["rel_error"], rel=6e-4)
    assert float(line[3]) == pytest.approx(100 * expected["top1"], abs=0.06)
    assert printed.endswith("    " + result.price.note)


def test_a_prune_that_fails_after_the_input_went_ahead_waits_for_its_run(tmp_path, monkeypatch):
    """The input's run on the price's inputs (started on its own thread before the zeroing) is
    waited for when the prune fails after it started: no thread is left inside onnxruntime as
    the process exits (the interpreter would end it by force)."""
    import threading
    import time

    from onnxshrink.errors import ShrinkError
    from onnxshrink.prune import price as price_mod
    from onnxshrink.prune import run as prune_run

    model = trained_like(MLP, seed=19)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    _segments(monkeypatch, 3000)
    ran = price_mod._run
    finished: list[str] = []

    def slow(*args, **kwargs):
        time.sleep(0.5)  # still running when the shrink below fails
        out = ran(*args, **kwargs)
        finished.append(threading.current_thread().name)
        return out

    def failing(*args, **kwargs):
        raise ShrinkError("the shrink failed here")

    monkeypatch.setattr(price_mod, "_run", slow)
    monkeypatch.setattr(prune_run, "_shrink_and_write", failing)
    with pytest.raises(ShrinkError, match="the shrink failed here"):
        prune(tmp_path / "m.onnx", 0.3, tmp_path / "out.onnx", held_out=[feeds(model, 3)], validate=False)
    assert finished == ["onnxshrink-price"]
    assert not [t for t in threading.enumerate() if t.name == "onnxshrink-price"]
    assert not (tmp_path / "out.onnx").exists()


def test_a_streamed_model_run_whole_is_priced_with_the_pruned_weights_where_the_shrink_wrote_them(
    tmp_path, monkeypatch
):
    """A model streamed (external data past the in-memory size) but run whole: the pruned
    model's weights are in the shrink's scratch file at price time, read there by its session."""
    from onnxshrink.prune import run as prune_run

    model = trained_like(MLP, seed=17)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    monkeypatch.setattr("onnxshrink.result.IN_MEMORY_BYTES", 0)
    monkeypatch.setattr("onnxshrink.prune.spill.SPILL_BYTES", 0)
    measured = prune_run.measure
    where: list[object] = []
    monkeypatch.setattr(prune_run, "measure", lambda *a: where.append(a[3]) or measured(*a))
    held = [feeds(model, 3), feeds(model, 4)]
    out = tmp_path / "out.onnx"
    result = prune(tmp_path / "m.onnx", 0.3, out, held_out=held, validate=False)
    assert where[0] is not None  # the pruned model's weights in a file at price time
    assert_price(result.price, independent(onnx.load(tmp_path / "m.onnx"), onnx.load(out), held))
    assert result.price.latency_before_ms > 0 and result.price.latency_after_ms > 0


@pytest.mark.parametrize("given", ["random", "calibration"])
def test_a_given_model_the_proof_runs_in_segments_is_priced_against_it(monkeypatch, given):
    """The caller's ModelProto, run in segments: the price is against it, not against the
    prune's copy with the chosen groups zeroed (in place, by --prune RATIO); on the calibration
    inputs, the input's outputs are the calibration's (only the pruned model runs)."""
    from onnxshrink.proof.inputs import make_inputs, resolve_shapes

    model = trained_like(CNN, seed=5)
    kept = model.SerializeToString()
    weights = sum(int(np.prod(t.dims)) * 4 for t in model.graph.initializer)  # all float32
    cut = _segments(monkeypatch, weights // 3)
    if given == "random":
        inputs = make_inputs(model, resolve_shapes(model, {}), 3, 0)  # the proof's draws
        result = prune(model, 0.3, validate=False)
        assert cut[-2] >= 2  # the input, in segments, then the pruned model
    else:
        inputs = [feeds(model, 1), feeds(model, 2)]
        result = prune(model, 0.3, criterion="wanda", data=inputs, validate=False)
        assert cut == [3]  # the pruned model alone, in three pieces (price.piece_bytes)
    assert model.SerializeToString() == kept
    assert result.price.inputs.startswith(given)
    assert_price(result.price, independent(model, result.model, inputs))


@pytest.mark.parametrize(
    ("warm", "runs", "blocks"),
    [(False, ([], []), 2 + 6), (True, ([], []), 2 + 4), (False, ([5.0, 4.0], [3.0, 2.0]), 2)],
)
def test_the_latency_counts_the_warm_runs_it_is_given_as_rounds(monkeypatch, warm, runs, blocks):
    """Three rounds, blocks of one run (no time budget): after a warm-up pair (sessions that
    have not run), after a pair that is a round (sessions that have), after two given rounds."""
    from onnxshrink.prune.targets import LatencyMeter

    model = trained_like(CNN, seed=5)
    meter = LatencyMeter(model, feeds(model, 1), rounds=3, budget=0.0)
    timed: list[object] = []
    block = meter._block
    monkeypatch.setattr(meter, "_block", lambda sess, n: timed.append(sess) or block(sess, n))
    before, after = meter.compare(meter.session(model), warm=warm, runs=runs)
    assert len(timed) == blocks and timed[::2] == [meter.base] * (blocks // 2)
    assert 0 < before <= min(runs[0], default=np.inf) and 0 < after <= min(runs[1], default=np.inf)


SCORE = """
g (float[4, 8] x, float[8, 16] W1, float[16] B1, float[16, 1] W2) => (float[4, 1] y) {
  h = MatMul (x, W1)
  hb = Add (h, B1)
  r = Relu (hb)
  s = MatMul (r, W2)
  y = Sigmoid (s)
}
"""


def test_an_output_of_one_value_per_sample_gets_no_cosine(capsys):
    """A score per sample ([batch, 1]: openWakeWord's heads) has a cosine of +-1, its sign
    alone: a sigmoid's was 'cosine mean 1.0000 / min 1.0000' beside a relative error of 0.15
    (hey_mycroft). The price gives the relative error alone, computed here, and says why."""
    model = tiny(SCORE, seed=4)
    held = [{"x": np.random.default_rng(s).standard_normal((4, 8)).astype(np.float32)} for s in (1, 2)]
    result = prune(model, 0.5, held_out=held, validate=False)
    (out,) = result.price.outputs
    expected = independent(model, result.model, held)
    assert expected["rel_error"] > 1e-3 and expected["cosine_min"] == pytest.approx(1.0)
    assert out.rel_error == pytest.approx(expected["rel_error"], abs=1e-9)
    assert out.cosine_mean is None and out.cosine_min is None and out.top1 is None
    line = next(t for t in result.price.lines() if t.startswith("    y:"))
    assert line == f"    y: relative error {out.rel_error:.4g}, no cosine (one value per sample: its cosine would be its sign alone)"
