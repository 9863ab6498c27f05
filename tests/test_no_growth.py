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
