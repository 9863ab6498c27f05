"""A reference that is not finite on the proof's inputs: NaN where both models give NaN, and the
same infinity in both, are equal; a NaN or infinity in one only is a difference, and where the
reference itself is not finite the run says so (exit 2) instead of a failed proof."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import ort_run, tiny

from onnxshrink import shrink
from onnxshrink.cli import main
from onnxshrink.proof import compare
from onnxshrink.proof.verdict import float_error

NAN, INF = float("nan"), float("inf")


def test_float_error_counts_nan_and_infinities_equal_only_where_both_agree():
    r = np.array([NAN, INF, -INF, 1.0, 2.0], np.float32)
    assert float_error(r, r.copy()) == 0.0
    assert float_error(r, np.array([NAN, INF, -INF, 1.0, 2.5], np.float32)) == 0.5
    assert float_error(r, np.array([1.0, INF, -INF, 1.0, 2.0], np.float32)) == INF  # NaN in one
    assert float_error(r, np.array([NAN, -INF, -INF, 1.0, 2.0], np.float32)) == INF  # other sign
    assert float_error(r, np.array([NAN, INF, -INF, NAN, 2.0], np.float32)) == INF


# The output is the log of a ReLU: -inf wherever the ReLU is 0, in the reference and the shrunk
# model alike; the zeroed filter 2 of W1 (bias 0) is a zero channel, removed.
LOG_RELU = """
g (float[1, 3, 8, 8] x, float[4, 3, 3, 3] W1, float[4] B1, float[2, 4, 1, 1] W2) => (float[1, 2, 6, 6] y) {
  c = Conv (x, W1, B1)
  r = Relu (c)
  o = Conv (r, W2)
  p = Relu (o)
  y = Log (p)
}
"""


def test_infinities_at_the_same_places_pass_the_proof():
    model = tiny(LOG_RELU, zero={"W1": np.s_[2], "B1": np.s_[2]}, seed=5)
    result = shrink(model)
    assert result.validation is not None and result.validation.passed
    w1 = next(t for t in result.model.graph.initializer if t.name == "W1")
    assert list(w1.dims) == [3, 3, 3, 3]
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    want, got = ort_run(model, {"x": x})[0], ort_run(result.model, {"x": x})[0]
    assert np.isneginf(want).any() and np.isfinite(want).any()  # -inf where the ReLU is 0
    assert (np.isneginf(got) == np.isneginf(want)).all()
    ok = np.isfinite(want)
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-6)


SQRT = """
g (float[2, 8] x, float[8, 4] W) => (float[2, 4] y) {
  m = MatMul (x, W)
  y = Sqrt (m)
}
"""


def test_a_reference_not_finite_where_the_models_differ_is_said_so(tmp_path, capsys):
    import pytest

    from onnxshrink.errors import ShrinkError

    reference = tiny(SQRT, seed=2)
    other = tiny(SQRT, seed=2)
    w = onnx.numpy_helper.to_array(other.graph.initializer[0]).copy()
    w *= 1.01
    other.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(w, "W"))
    with pytest.raises(ShrinkError) as err:
        compare(reference, other)
    text = str(err.value)
    assert "is not finite on the random inputs" in text and "output 'y' holds" in text
    assert "--inputs FILE.npz" in text
    # finite inputs given: the proof runs and fails as a proof (the models differ)
    feeds = tmp_path / "x.npz"
    np.savez(feeds, x=np.abs(np.random.default_rng(0).standard_normal((2, 8))).astype(np.float32))
    from onnxshrink.options import ShrinkOptions
    from onnxshrink.proof import load_inputs

    positive = reference.graph.initializer[0]
    positive.CopyFrom(onnx.numpy_helper.from_array(np.abs(w), "W"))
    other.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(np.abs(w) * 1.01, "W"))
    report = compare(reference, other, ShrinkOptions(inputs=[load_inputs(str(feeds))], draws=0))
    assert not report.passed and report.outputs[0].max_rel_error > 1e-3


def test_the_command_line_says_the_reference_is_not_finite(tmp_path, capsys, monkeypatch):
    # a shrink the proof finds different, on a model NaN on random inputs: exit 2, said so
    from onnxshrink.proof import comparison

    model = tiny(SQRT.replace("y = Sqrt (m)", "s = Sqrt (m)\n  y = Mul (s, s)"), zero={"W": np.s_[:, 1]}, seed=4)
    path, out = tmp_path / "m.onnx", tmp_path / "small.onnx"
    onnx.save(model, path)
    real = comparison._checks

    def off(proof, tally, ref_out, new_out, noise_out, noise):  # the shrunk model made to differ
        new_out = [[np.where(np.isnan(o), 1.0, o).astype(o.dtype) for o in run] for run in new_out]
        return real(proof, tally, ref_out, new_out, noise_out, noise)

    monkeypatch.setattr(comparison, "_checks", off)
    assert main([str(path), "-o", str(out), "--no-recover"]) == 2
    err = capsys.readouterr().err
    assert "the reference model (the input, masks applied) is not finite on the random inputs" in err
    assert "max relative error nan" not in err and not out.exists()
