"""No output larger than its input unless asked (stages/save.no_growth): a shrink whose model
would take more bytes than the input's files (here the nodes of a border correction
outweigh the weights removed) writes the reference instead, and says so; --allow-growth writes the shrunk model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import error_against, params, tiny, with_masks
from test_reports import PADDED

from onnxshrink import shrink
from onnxshrink.cli import main

# Filters 1 and 3 of W1 zeroed, their biases positive: constant channels relu(b) > 0 that the
# shrink folds into W2's consumer with a border correction (zero padding at the borders). On a
# model this small the correction's nodes outweigh the 2 filters removed: it would grow.
# (test_reports' PADDED, whose report of that growth is tested there.)
B1 = np.asarray([0.3, 0.7, -0.2, 1.1, 0.5, -0.4], np.float32)
ZEROED = [1, 3]


def padded(zero: bool = True) -> onnx.ModelProto:
    return tiny(PADDED, seed=2, values={"B1": B1}, zero={"W1": np.s_[ZEROED]} if zero else None)


def test_a_shrink_that_would_grow_writes_the_input_unchanged(tmp_path, capsys):
    path, out = tmp_path / "m.onnx", tmp_path / "small.onnx"
    onnx.save(padded(), path)
    assert main([str(path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_bytes() == path.read_bytes()
    assert "larger than the input's" in printed and "--allow-growth" in printed
    # asked for: the shrunk model, larger, computing the same function
    grown = tmp_path / "grown.onnx"
    assert main([str(path), "-o", str(grown), "--allow-growth"]) == 0
    assert grown.stat().st_size > path.stat().st_size
    big = onnx.load(grown)
    # 2 filters (27 + 1) and W2's 2 columns (4 x 9) go; the correction kernel (4 x 9) comes
    assert params(big) == params(padded()) - 2 * 28 - 2 * 36 + 36
    assert error_against(padded(), big) <= 1e-5


def test_masks_applied_to_a_model_that_would_grow_write_the_masked_model(tmp_path):
    model = padded(zero=False)
    path, out = tmp_path / "m.onnx", tmp_path / "small.onnx"
    onnx.save(model, path)
    masks = {"W1": np.ones((6, 3, 3, 3), np.float32)}
    masks["W1"][ZEROED] = 0
    result = shrink(str(path), masks, str(out), input_masked=False)
    assert result.grew is not None and "larger than the input's" in result.grew
    written = onnx.load(out)
    assert out.stat().st_size <= path.stat().st_size
    assert params(written) == params(model) == result.after.params
    assert error_against(with_masks(model, masks), written) <= 1e-6
    w1 = onnx.numpy_helper.to_array(next(t for t in written.graph.initializer if t.name == "W1"))
    assert not w1[ZEROED].any() and w1[[0, 2, 4, 5]].all()
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


def test_a_model_larger_than_the_limit_in_every_form_writes_nothing(tmp_path):
    # the last resort: when even the input with the masks applied is over the limit (a prune's
    # reference can be), nothing is left written and the run is NotShrunk (exit 1)
    from onnxshrink.errors import NotShrunk
    from onnxshrink.options import ShrinkOptions
    from onnxshrink.stages.growth import no_growth
    from onnxshrink.stages.read import read_model
    from onnxshrink.stages.save import _write

    path, out = tmp_path / "m.onnx", tmp_path / "small.onnx"
    onnx.save(padded(), path)
    result = shrink(str(path), None, str(out), allow_growth=True)
    assert result.grew is None and out.stat().st_size > path.stat().st_size
    limit = path.stat().st_size // 2
    with pytest.raises(NotShrunk, match="both larger than the input's.*nothing written"):
        no_growth(result, read_model(str(path)), out, ShrinkOptions(), limit, _write)
    assert not out.exists() and not list(tmp_path.glob(".onnxshrink-*")) and result.written == []
