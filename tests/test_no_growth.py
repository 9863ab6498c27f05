"""No output larger than its input unless asked (stages/save.no_growth): a shrink whose model
would take more bytes than the input's files (here a weight two readers slice differently,
stored twice) writes the reference instead, and says so; --allow-growth writes the shrunk model."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import error_against, params, tiny, with_masks

from onnxshrink import shrink
from onnxshrink.cli import main

# V's column 5 is zero, so a's channel 5 is zero and the first reader of W could drop W's row 5;
# the second reader needs all of W: W is stored twice (64 x 64 + 63 x 64) to save 8 weights.
SHARED = """
g (float[1, 8] x, float[1, 64] z, float[8, 64] V, float[64, 64] W) => (float[1, 64] y1, float[1, 64] y2) {
  a = MatMul (x, V)
  y1 = MatMul (a, W)
  y2 = MatMul (z, W)
}
"""


def shared(zero: bool = True) -> onnx.ModelProto:
    return tiny(SHARED, zero={"V": np.s_[:, 5]} if zero else None, seed=1)


def test_a_shrink_that_would_grow_writes_the_input_unchanged(tmp_path, capsys):
    path, out = tmp_path / "m.onnx", tmp_path / "small.onnx"
    onnx.save(shared(), path)
    assert main([str(path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_bytes() == path.read_bytes()
    assert "larger than the input's" in printed and "--allow-growth" in printed
    # asked for: the shrunk model, larger, computing the same function
    grown = tmp_path / "grown.onnx"
    assert main([str(path), "-o", str(grown), "--allow-growth"]) == 0
    assert grown.stat().st_size > path.stat().st_size
    big = onnx.load(grown)
    assert params(big) == 8 * 63 + 64 * 64 + 63 * 64 > params(shared())
    assert error_against(shared(), big) <= 1e-5


def test_masks_applied_to_a_model_that_would_grow_write_the_masked_model(tmp_path):
    model = shared(zero=False)
    path, out = tmp_path / "m.onnx", tmp_path / "small.onnx"
    onnx.save(model, path)
    masks = {"V": np.ones((8, 64), np.float32)}
    masks["V"][:, 5] = 0
    result = shrink(str(path), masks, str(out), input_masked=False)
    assert result.grew is not None and "larger than the input's" in result.grew
    written = onnx.load(out)
    assert out.stat().st_size <= path.stat().st_size
    assert params(written) == params(model) == result.after.params
    assert error_against(with_masks(model, masks), written) <= 1e-6
    v = onnx.numpy_helper.to_array(next(t for t in written.graph.initializer if t.name == "V"))
    assert not v[:, 5].any() and v[:, 4].all()
    assert result.to_dict()["grew"] == result.grew


def test_a_tiny_shrink_whose_inferred_shapes_outweigh_its_savings_is_written_without_them(tmp_path):
    # filter 1 of W1 zeroed: 27 + 1 + 4 weights (128 bytes) go, while the rewrite's inferred
    # shapes (value_info of the two long-named tensors) add more; without them it is smaller
    long = "hidden_activation_of_the_first_convolution_" * 4
    text = f"""g (float[1,3,8,8] x, float[6,3,3,3] W1, float[6] B1, float[4,6,1,1] W2, float[4] B2)
      => (float[1,4,8,8] y) {{
      {long}h = Conv<pads=[1,1,1,1]>(x, W1, B1)
      {long}r = Relu({long}h)
      y = Conv({long}r, W2, B2)
    }}"""
    model = tiny(text, seed=11, zero={"W1": np.s_[1], "B1": np.s_[1]})
    path, out, grown = tmp_path / "m.onnx", tmp_path / "small.onnx", tmp_path / "grown.onnx"
    onnx.save(model, path)
    asked = shrink(str(path), None, str(grown), allow_growth=True)
    assert grown.stat().st_size > path.stat().st_size and asked.grew is None
    result = shrink(str(path), None, str(out))
    small = onnx.load(out)
    assert out.stat().st_size <= path.stat().st_size == result.before.file_bytes
    assert result.after.file_bytes == out.stat().st_size
    assert result.grew is not None and "value_info" in result.grew and len(small.graph.value_info) == 0
    assert params(small) == params(model) - (27 + 1 + 4) == result.after.params
    assert error_against(model, small) <= 1e-5


def test_a_prune_larger_than_its_input_in_every_form_writes_nothing(tmp_path, capsys):
    # the prune's reference holds W once per reader, and so does its shrink: both outgrow the input
    path, out = tmp_path / "m.onnx", tmp_path / "small.onnx"
    onnx.save(shared(zero=False), path)
    assert main([str(path), "--prune", "0.5", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "both larger than the input's" in err and "nothing written" in err and "--allow-growth" in err
    assert not out.exists() and not list(tmp_path.glob(".onnxshrink-*"))
    assert main([str(path), "--prune", "0.5", "-o", str(out), "--allow-growth"]) == 0
    assert out.stat().st_size > path.stat().st_size
