"""README promises no other test ran through the interface the README shows: each command-line
flag on a command line, each API form as written there. Every shrunk model is checked here
against the input with its masks applied by the test (`error_against`, `with_masks`), and its
parameters are counted here (`params`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import CONV2, ROOT, error_against, export_cached, params, run, tiny, with_masks

import onnxshrink
from onnxshrink.cli import main

# CONV2: Conv(3->6, 3x3, padded) -> Relu -> Conv(6->4, 1x1), 196 parameters. One W1 filter, its
# bias and its W2 column: 27 + 1 + 4.
PER_FILTER = 27 + 1 + 4
DROP = [1, 4]


def filter_masks(rows: list[int]) -> dict[str, np.ndarray]:
    """W1's filters `rows` and their biases masked, by initializer name."""
    w1, b1 = np.ones((6, 3, 3, 3), np.float32), np.ones(6, np.float32)
    w1[rows], b1[rows] = 0, 0
    return {"W1": w1, "B1": b1}


@pytest.fixture
def conv2(tmp_path):
    """(unmasked model file, masks file of filters 1 and 4, the model with them applied)."""
    model = tiny(CONV2, seed=11)
    path, masks = tmp_path / "m.onnx", tmp_path / "masks.npz"
    onnx.save(model, path)
    np.savez(masks, **filter_masks(DROP))
    return path, masks, with_masks(model, filter_masks(DROP))


def report(path) -> dict:
    return json.loads(path.read_text())


def test_python_m_onnxshrink_is_the_command(conv2, tmp_path):
    path, masks, reference = conv2
    proc = subprocess.run(
        [sys.executable, "-m", "onnxshrink", path.name, masks.name, "-o", "small.onnx"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "PASSED | All outputs matched" in proc.stdout
    small = onnx.load(tmp_path / "small.onnx")
    assert params(small) == 196 - 2 * PER_FILTER
    assert error_against(reference, small) <= 1e-5


def test_provider_cpu_runs_the_proof_there_and_cuda_without_its_provider_is_exit_2(
    conv2, tmp_path, capsys, monkeypatch
):
    path, masks, reference = conv2
    out, r = tmp_path / "small.onnx", tmp_path / "r.json"
    assert main([str(path), str(masks), "-o", str(out), "--provider", "cpu", "--report", str(r)]) == 0
    assert "3 draw(s) on cpu" in capsys.readouterr().out
    v = report(r)["validation"]
    assert v["provider"] == "cpu" and v["passed"] and len(v["outputs"]) == 1
    assert error_against(reference, onnx.load(out)) <= 1e-5
    out.unlink()
    # onnxruntime without CUDA (made so here, whatever is installed): refused by name
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert main([str(path), str(masks), "-o", str(out), "--provider", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--provider cuda: onnxruntime here has no CUDAExecutionProvider" in err
    assert "Install onnxruntime-gpu for CUDA" in err and "Traceback" not in err
    assert not out.exists()


def test_masks_format_names_how_to_read_the_masks(tmp_path, capsys):
    """The same 0/1 arrays read as masks (flat) or as a masked state dict (their zeros are the
    masks) give the same model; read in a format they are not in, exit 2 saying what was read."""
    model = tiny(CONV2, seed=11)
    path, masks = tmp_path / "m.onnx", tmp_path / "masks.npz"
    onnx.save(model, path)
    np.savez(masks, **filter_masks(DROP))
    for fmt in ("flat", "state-dict"):
        out = tmp_path / f"{fmt}.onnx"
        assert main([str(path), str(masks), "-o", str(out), "--masks-format", fmt]) == 0
        assert capsys.readouterr().out.startswith(f"[I] onnxshrink {onnxshrink.__version__}")
        assert params(onnx.load(out)) == 196 - 2 * PER_FILTER
        assert error_against(with_masks(model, filter_masks(DROP)), onnx.load(out)) <= 1e-5
    # read as DPU-style per-layer masks, each array is layer W1's mask: of parameter W1.weight
    out = tmp_path / "other.onnx"
    assert main([str(path), str(masks), "-o", str(out), "--masks-format", "dpu"]) == 2
    err = capsys.readouterr().err
    assert "2 mask(s) match no initializer of the model: 'W1.weight', 'B1.weight'" in err
    assert main([str(path), str(masks), "-o", str(out), "--masks-format", "torch-ao"]) == 2
    err = capsys.readouterr().err
    assert "no masks found in it as format 'torch-ao'" in err and "Traceback" not in err
    assert not out.exists()


def test_analysis_replay_on_the_command_line_reaches_the_rules_result(conv2, tmp_path, capsys):
    path, masks, reference = conv2
    sizes = {}
    for analysis in ("rules", "replay"):
        out = tmp_path / f"{analysis}.onnx"
        assert main([str(path), str(masks), "-o", str(out), "--analysis", analysis, "-q"]) == 0
        small = onnx.load(out)
        sizes[analysis] = {t.name: tuple(t.dims) for t in small.graph.initializer}
        assert error_against(reference, small) <= 1e-5
    assert sizes["replay"] == sizes["rules"]
    assert sizes["replay"]["W1"] == (4, 3, 3, 3) and sizes["replay"]["W2"] == (4, 4, 1, 1)


def test_unmasked_input_applies_masks_the_model_only_partly_holds(tmp_path, capsys):
    """A second round of pruning: the model holds filters 1 and 4 zeroed; the masks add filter
    2. Refused by default (the model contradicts a mask), applied with --unmasked-input."""
    model = tiny(CONV2, seed=11, zero={"W1": np.s_[DROP], "B1": np.s_[DROP]})
    path, masks, out = tmp_path / "m.onnx", tmp_path / "masks.npz", tmp_path / "small.onnx"
    onnx.save(model, path)
    np.savez(masks, **filter_masks([1, 2, 4]))
    assert main([str(path), str(masks), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'W1'" in err and "--unmasked-input" in err and "Traceback" not in err
    assert not out.exists()
    assert main([str(path), str(masks), "-o", str(out), "--unmasked-input"]) == 0
    small = onnx.load(out)
    assert params(small) == 196 - 3 * PER_FILTER
    assert error_against(with_masks(model, filter_masks([1, 2, 4])), small) <= 1e-5


def test_inputs_file_joins_the_random_draws_of_a_passing_proof(conv2, tmp_path, capsys):
    path, masks, reference = conv2
    data, out, r = tmp_path / "x.npz", tmp_path / "small.onnx", tmp_path / "r.json"
    x = np.random.default_rng(5).standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.savez(data, x=x)
    assert main([str(path), str(masks), "-o", str(out), "--inputs", str(data), "--report", str(r)]) == 0
    assert "4 draw(s) on cpu" in capsys.readouterr().out  # the file's input and 3 random ones
    assert report(r)["validation"]["draws"] == 4 and report(r)["validation"]["passed"]
    small = onnx.load(out)
    got, want = run(small, {"x": x})[0], run(reference, {"x": x})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert error_against(reference, small) <= 1e-5


# Two layers with a coupling (as in test_prune): W1's 8 channels, read by W2 and W3; W2's and
# W3's 6 channels meet in an Add (one group each: rows of both, and W4's column).
BRANCHES = """
g (float[1,4,8,8] x, float[8,4,3,3] W1, float[8] B1, float[6,8,1,1] W2, float[6] B2,
   float[6,8,1,1] W3, float[6] B3, float[2,6,1,1] W4, float[2] B4) => (float[1,2,8,8] y) {
  h = Conv<pads=[1,1,1,1]>(x, W1, B1)
  r = Relu(h)
  a = Conv(r, W2, B2)
  b = Conv(r, W3, B3)
  s = Add(a, b)
  t = Relu(s)
  y = Conv(t, W4, B4)
}
"""


def branches_params(k1: int, k2: int) -> int:
    """BRANCHES' parameters with k1 of W1's channels and k2 of the Add's: W1 and B1; W2, B2,
    W3, B3; W4 and B4."""
    return k1 * (4 * 9 + 1) + 2 * (k2 * k1 + k2) + 2 * k2 + 2


def _prune_cli(tmp_path, *flags) -> tuple[onnx.ModelProto, onnx.ModelProto, dict, dict]:
    model = tiny(BRANCHES, seed=7)
    path, out, masks, r = (tmp_path / n for n in ("m.onnx", "small.onnx", "masks.npz", "r.json"))
    onnx.save(model, path)
    argv = [str(path), "--prune", "0.5", "-o", str(out), "--masks-out", str(masks), "--report", str(r), "-q"]
    assert main([*argv, *flags]) == 0
    chosen = dict(np.load(masks))
    return model, onnx.load(out), chosen, report(r)


def test_global_ranking_and_max_layer_ratio_on_the_command_line(tmp_path):
    # local (the default): 8 - int(8 * 0.5) = 4 and 6 - int(6 * 0.5) = 3 groups go
    model, small, chosen, r = _prune_cli(tmp_path)
    assert sorted(layer["removed"] for layer in r["layers"]) == [3, 4]
    assert params(small) == branches_params(8 - 4, 6 - 3) == 186
    assert error_against(with_masks(model, chosen), small) <= 1e-5
    # global (test_prune pins this choice with L2): 7 of the 14 groups, ranked across layers
    model, small, chosen, r = _prune_cli(tmp_path, "--global-ranking")
    assert sum(layer["removed"] for layer in r["layers"]) == 14 - int(14 * 0.5)
    assert error_against(with_masks(model, chosen), small) <= 1e-5
    # at most a quarter of any layer: int(8 * 0.25) = 2 and int(6 * 0.25) = 1
    model, small, chosen, r = _prune_cli(tmp_path, "--global-ranking", "--max-layer-ratio", "0.25")
    assert sorted(layer["removed"] for layer in r["layers"]) == [1, 2]
    assert params(small) == branches_params(8 - 2, 6 - 1)
    assert error_against(with_masks(model, chosen), small) <= 1e-5


def test_groups_with_prune_writes_both(tmp_path):
    model = tiny(BRANCHES, seed=7)
    path, out, groups, masks = (tmp_path / n for n in ("m.onnx", "small.onnx", "g.json", "masks.npz"))
    onnx.save(model, path)
    argv = [str(path), "--groups", str(groups), "--prune", "0.5", "-o", str(out), "--masks-out", str(masks), "-q"]
    assert main(argv) == 0
    g = json.loads(groups.read_text())
    assert g["schema"] == "onnxshrink.groups/1"
    sizes = sorted(len(layer["groups"]) for layer in g["layers"])
    assert sizes[-2:] == [6, 8]  # W1's 8 channels, the Add's 6
    small = onnx.load(out)
    assert params(small) == branches_params(8 - 4, 6 - 3)
    assert error_against(with_masks(model, dict(np.load(masks))), small) <= 1e-5
    # the members of the removed groups are exactly what left W1 (its rows)
    # W1's output channels: 8 exact groups, of which the 4 removed left W1 (its rows)
    w1 = [grp for grp in g["groups"] if any(m["initializer"] == "W1" and m["side"] == "out" for m in grp["members"])]
    assert len(w1) == 8 and all(grp["exact"] for grp in w1)
    rows = {i for grp in w1 for m in grp["members"] if m["initializer"] == "W1" for i in m["indices"]}
    assert rows == set(range(8))
    assert {t.name: tuple(t.dims) for t in small.graph.initializer}["W1"] == (4, 4, 3, 3)


def test_an_internal_error_is_exit_3_only_without_the_proof(conv2, tmp_path, capsys, monkeypatch):
    """A rewrite that breaks (simulated: the Conv handler raises) is exit 3 with --no-validate;
    with the proof it is a failed proof: exit 1 (--no-recover), or, recovering, the removals it
    breaks are kept and the rest written (exit 0)."""
    from onnxshrink.errors import InternalError
    from onnxshrink.ops import conv

    def broken(self, node, rw):
        raise InternalError(f"simulated failure rewriting {node.name!r}")

    monkeypatch.setattr(conv.Conv, "rewrite", broken)
    path, masks, reference = conv2
    out = tmp_path / "small.onnx"
    assert main([str(path), str(masks), "-o", str(out), "--no-validate"]) == 3
    err = capsys.readouterr().err
    assert "[E] internal error: InternalError: simulated failure" in err and "Traceback" not in err
    assert not out.exists()
    assert main([str(path), str(masks), "-o", str(out), "--no-recover"]) == 1
    captured = capsys.readouterr()
    assert "simulated failure" in captured.out + captured.err
    assert not out.exists()


def test_shrink_options_are_kept_and_reused(tmp_path):
    """One ShrinkOptions for several models (`options=`), and keyword arguments over it."""
    opts = onnxshrink.ShrinkOptions(validate=False, input_shapes={"x": [2, 3, 8, 8]})
    dyn = CONV2.replace("float[1,3,8,8] x", "float[N,3,8,8] x").replace("float[1,4,8,8] y", "float[N,4,8,8] y")
    for rows in ([1], [0, 3, 5]):
        model = tiny(dyn, seed=11, zero={"W1": np.s_[rows], "B1": np.s_[rows]})
        result = onnxshrink.shrink(model, options=opts)
        assert result.validation is None  # validate=False: no proof
        assert params(result.model) == 196 - len(rows) * PER_FILTER
        assert error_against(model, result.model, {"x": [2, 3, 8, 8]}) <= 1e-5
    proven = onnxshrink.shrink(model, options=opts, validate=True, draws=2)
    assert proven.validation.passed and proven.validation.draws == 2
    assert proven.validation.input_shapes == {"x": [2, 3, 8, 8]}
    assert opts.validate is False  # the options object itself is left as it was
    with pytest.raises(TypeError, match="unknown shrink option"):
        onnxshrink.shrink(model, options=opts, valdiate=True)


# A Conv whose channels an If reads: one branch reads r as it is, the other through a Sigmoid
# (a zero channel of r is 0.5 there: a constant, folded into that branch's bias).
IF_MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,3,8,8] x, bool c) => (float[1,4,8,8] y) {
  h = Conv<pads=[1,1,1,1]>(x, W1, B1)
  r = Relu(h)
  y = If (c) <
    then_branch = then_g () => (float[1,4,8,8] t) { t = Conv(r, W2, B2) },
    else_branch = else_g () => (float[1,4,8,8] e) { s = Sigmoid(r)  e = Conv(s, W2, B2) }
  >
}
"""


def test_if_bodies_are_analyzed_in_place_and_exact():
    """docs/models.md, Control flow: bodies are analyzed in place; a weight both branches read (W2) is
    sliced once where it is stored; each branch computes as before."""
    rng = np.random.default_rng(3)
    model = onnx.parser.parse_model(IF_MODEL)
    values = {"W1": rng.standard_normal((6, 3, 3, 3)), "B1": rng.standard_normal(6),
              "W2": rng.standard_normal((4, 6, 1, 1)), "B2": rng.standard_normal(4)}
    values["W1"][DROP], values["B1"][DROP] = 0, 0
    model.graph.initializer.extend(
        onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in values.items()
    )
    onnx.checker.check_model(model)
    result = onnxshrink.shrink(model, validate=False)
    assert result.barriers == []

    def weights(m):
        graphs = [m.graph, *(a.g for n in m.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)]
        return {t.name: onnx.numpy_helper.to_array(t) for g in graphs for t in g.initializer}

    shrunk = weights(result.model)
    kept = 6 - len(DROP)
    assert shrunk["W1"].shape == (kept, 3, 3, 3) and shrunk["W2"].shape == (4, kept, 1, 1)
    # the dropped filters, their biases and W2's columns go; the Sigmoid branch's constant
    # channels fold into a bias of its own (the then-branch keeps B2 as it was)
    assert params(result.model) == params(model) - len(DROP) * (27 + 1 + 4) + 4
    np.testing.assert_array_equal(shrunk["B2"], values["B2"].astype(np.float32))
    for c in (True, False):
        x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
        feed = {"x": x, "c": np.array(c)}
        got, want = run(result.model, feed)[0], run(model, feed)[0]
        assert got.shape == want.shape == (1, 4, 8, 8)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert error_against(model, result.model) <= 1e-5


def test_the_readme_api_example_as_written(conv2, tmp_path, monkeypatch):
    """`onnxshrink.shrink("model.onnx", "masks.pt", "small.onnx")` and the fields it prints."""
    import torch

    path, _, reference = conv2
    torch.save({k: torch.from_numpy(v) for k, v in filter_masks(DROP).items()}, tmp_path / "masks.pt")
    monkeypatch.chdir(tmp_path)
    result = onnxshrink.shrink("m.onnx", "masks.pt", "small.onnx")
    assert (result.before.params, result.after.params) == (196, 196 - 2 * PER_FILTER)
    assert result.validation.outputs[0].max_rel_error <= 1e-5
    assert result.to_dict()["after"]["params"] == params(onnx.load("small.onnx")) == result.after.params
    assert error_against(reference, result.model) <= 1e-5
    assert (ROOT / "README.md").read_text().count('onnxshrink.shrink("model.onnx", "masks.pt", "small.onnx")') == 1


def test_draws_seed_rtol_and_atol_on_the_command_line(conv2, tmp_path, capsys):
    path, masks, reference = conv2
    out, r = tmp_path / "small.onnx", tmp_path / "r.json"
    argv = [str(path), str(masks), "-o", str(out), "--report", str(r)]
    assert main([*argv, "--draws", "5", "--seed", "7", "--rtol", "1e-4", "--atol", "1e-6"]) == 0
    assert "5 draw(s) on cpu" in capsys.readouterr().out
    v = report(r)["validation"]
    assert (v["draws"], v["rtol"], v["atol"], v["passed"]) == (5, 1e-4, 1e-6, True)
    assert error_against(reference, onnx.load(out)) <= 1e-5


def test_weights_bind_masks_by_value_on_the_command_line(tmp_path, capsys):
    """Masks named after parameters the model does not name (an exporter renamed them): the
    original weights given with --weights find their initializers by value."""
    model = tiny(CONV2, seed=11)
    path, masks, weights, out = (tmp_path / n for n in ("m.onnx", "masks.npz", "orig.npz", "small.onnx"))
    onnx.save(model, path)
    mask = filter_masks(DROP)["W1"]
    np.savez(masks, **{"features.0.weight": mask})
    np.savez(weights, **{"features.0.weight": onnx.numpy_helper.to_array(model.graph.initializer[0])})
    assert model.graph.initializer[0].name == "W1"
    assert main([str(path), str(masks), "-o", str(out)]) == 2  # no name binds it
    assert "'features.0.weight'" in capsys.readouterr().err
    assert main([str(path), str(masks), "-o", str(out), "--weights", str(weights)]) == 0
    assert "1 of 1 bound (value)" in capsys.readouterr().out
    small = onnx.load(out)
    # the filters go; their biases stay constants relu(B1), folded into W2's bias
    assert params(small) == 196 - 2 * PER_FILTER
    assert error_against(with_masks(model, {"W1": mask}), small) <= 1e-5


def test_prune_criteria_ignore_and_round_to_on_the_command_line(tmp_path):
    # --ignore W1: the layer W1 produces is left alone; --round-to 2: 6 keep int(3) -> 2
    model, small, chosen, r = _prune_cli(tmp_path, "--ignore", "W1", "--round-to", "2", "--criterion", "l2")
    removed = {layer["layer"]: (layer["removed"], layer["ignored"]) for layer in r["layers"]}
    assert sorted(removed.values()) == [(0, True), (4, False)]
    assert params(small) == branches_params(8, 2)
    assert error_against(with_masks(model, chosen), small) <= 1e-5
    # data-driven: mean |activation| on the --inputs given
    data = tmp_path / "x.npz"
    np.savez(data, x=np.random.default_rng(2).standard_normal((1, 4, 8, 8)).astype(np.float32))
    model, small, chosen, r = _prune_cli(tmp_path, "--criterion", "activation", "--inputs", str(data))
    assert sorted(layer["removed"] for layer in r["layers"]) == [3, 4]
    assert params(small) == branches_params(4, 3)
    assert error_against(with_masks(model, chosen), small) <= 1e-5


def test_the_demo_prints_the_figures_the_readme_shows(tmp_path, capsys):
    """`onnxshrink models/demo/resnet_demo.onnx models/demo/resnet_demo_masks.pt -o small.onnx`:
    half of every conv's filters masked, BatchNorms untouched."""
    import torch

    demo = ROOT / "models/demo"
    out = tmp_path / "small.onnx"
    assert main([str(demo / "resnet_demo.onnx"), str(demo / "resnet_demo_masks.pt"), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    model, small = onnx.load(demo / "resnet_demo.onnx"), onnx.load(out)
    assert (f"{params(model) / 1000:.2f} K", f"{params(small) / 1000:.2f} K") == ("174.70 K", "46.11 K")
    assert "[I]     PASSED | All outputs matched | Outputs: ['linear']" in text
    assert "| Parameters      |     174.70 K |      46.11 K |       -73.6% |" in text
    assert (
        "[I] folded 139 constant channel(s) into 15 consumer(s) (12 as border corrections, for zero "
        "padding at the borders)"
    ) in text
    assert sum(n.op_type == "ConstantOfShape" for n in small.graph.node) == 3  # one map per size
    masks = {k: v.numpy() for k, v in torch.load(demo / "resnet_demo_masks.pt", weights_only=True).items()}
    assert error_against(with_masks(model, masks), small) <= 1e-5


def test_groups_to_masks_builds_masks_an_unmasked_input_shrinks_with(tmp_path):
    """tools/groups_to_masks.py --onnx: masks by initializer from groups.json, then
    `onnxshrink model.onnx masks.npz --unmasked-input -o small.onnx`."""
    model = tiny(BRANCHES, seed=7)
    path, groups, masks, out = (tmp_path / n for n in ("m.onnx", "g.json", "masks.npz", "small.onnx"))
    onnx.save(model, path)
    assert main([str(path), "--groups", str(groups), "-q"]) == 0
    tool = [sys.executable, str(ROOT / "tools/groups_to_masks.py"), str(groups), "--onnx", str(path), "-o", str(masks)]
    proc = subprocess.run(tool, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("7 group(s) chosen")  # int(8 * 0.5) + int(6 * 0.5)
    assert main([str(path), str(masks), "--unmasked-input", "-o", str(out), "-q"]) == 0
    small = onnx.load(out)
    assert params(small) == branches_params(4, 3)
    assert error_against(with_masks(model, dict(np.load(masks))), small) <= 1e-5


# Three 3x3 convs at 24x24 (16 -> 48 -> 48 -> 8 channels): about 16 M multiply-adds, enough
# for onnxruntime's run time to follow the channels removed.
TIMED = """
g (float[1,16,24,24] x, float[48,16,3,3] W1, float[48] B1, float[48,48,3,3] W2, float[48] B2,
   float[8,48,3,3] W3, float[8] B3) => (float[1,8,24,24] y) {
  a = Conv<pads=[1,1,1,1]>(x, W1, B1)
  r = Relu(a)
  b = Conv<pads=[1,1,1,1]>(r, W2, B2)
  s = Relu(b)
  y = Conv<pads=[1,1,1,1]>(s, W3, B3)
}
"""


def test_prune_to_latency_is_measured_and_the_result_proven(tmp_path):
    """README, Prune: `--prune-to-latency 0.6`: the plan is searched on the latency onnxruntime
    measures (never predicted); the model written is the input with the chosen groups zeroed,
    and it runs faster than the input."""
    model = tiny(TIMED, seed=3)
    path, out, masks, r = (tmp_path / n for n in ("m.onnx", "small.onnx", "masks.npz", "r.json"))
    onnx.save(model, path)
    argv = [str(path), "--prune-to-latency", "0.6", "-o", str(out), "--masks-out", str(masks), "--report", str(r), "-q"]
    assert main(argv) == 0
    rep, small = report(r), onnx.load(out)
    assert rep["target"] == {"kind": "latency", "value": 0.6}
    assert 0 < rep["reached"] < 1  # the measured ratio of the model written: faster than the input
    assert params(small) < params(model)
    assert error_against(with_masks(model, dict(np.load(masks))), small) <= 1e-5


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where a file the documents name by its path (`rewrite.py`, `ops/conv.py`, `tools/bench.py`) lives.
SOURCES = [p.relative_to(ROOT).as_posix() for d in ("onnxshrink", "tools", "models", "tests") for p in (ROOT / d).rglob("*.py")]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_documents_links_and_named_files_exist():
    """Every link between the README and docs/ reaches a file and a heading there, and every
    source file they name (`analyze/fallback.py`, `tools/kv_check.py`) exists: a module that
    moved in the package is followed in the documents."""
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("http"):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                missing.append(f"{doc.name}: link {target}")
            elif anchor:
                headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    missing.append(f"{doc.name}: anchor {target}")
        for name in set(re.findall(r"`(?:python )?([\w/]+\.py)\b", text)):
            if not any(s == name or s.endswith("/" + name) for s in SOURCES):
                missing.append(f"{doc.name}: {name}")
    assert missing == []


def _test_exists(ref: str) -> bool:
    """`file` (a test module or folder under tests/) or `file::test` (a test function in it)."""
    file, _, test = ref.strip().partition("::")
    path = ROOT / "tests" / file
    source = path.with_suffix(".py")
    if not test:
        return source.exists() or path.is_dir()
    return source.exists() and re.search(rf"^def {re.escape(test)}\(", source.read_text(), re.M) is not None


def test_every_test_the_promises_name_exists():
    """tests/PROMISES.md: each test it names (`file`, `file::test`) is there to run."""
    table = (ROOT / "tests" / "PROMISES.md").read_text()
    refs = [ref for line in table.splitlines()[4:] for ref in line.rstrip(" |").rpartition(" | ")[2].split(", ")]
    assert len(refs) > 100
    assert [ref for ref in refs if not _test_exists(ref)] == []


def test_prune_takes_its_options_whole_or_as_keywords(tmp_path):
    """`prune("model.onnx", output="small.onnx", how=PruneOptions(params=0.9))` and the same
    choice as a keyword give the same model, counted here, within the target; an unknown keyword
    is refused by name."""
    from onnxshrink.options import PruneOptions
    from onnxshrink.prune import prune

    model = tiny(CONV2, seed=12)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    whole = prune(str(path), output=str(tmp_path / "a.onnx"), how=PruneOptions(params=0.9))
    keyword = prune(str(path), output=str(tmp_path / "b.onnx"), params=0.9)
    a, b = onnx.load(tmp_path / "a.onnx"), onnx.load(tmp_path / "b.onnx")
    assert params(a) == params(b) == whole.shrink.after.params == keyword.shrink.after.params
    assert 0.8 * 196 < params(a) <= 0.9 * 196
    assert {t.name: tuple(t.dims) for t in a.graph.initializer} == {t.name: tuple(t.dims) for t in b.graph.initializer}
    with pytest.raises(TypeError, match="unknown shrink option.*criterium"):
        prune(str(path), 0.5, criterium="l2")
    assert 'how=PruneOptions(params=0.9)' in (ROOT / "README.md").read_text()


def test_onnxshrink_prune_after_a_plain_import_as_the_readme_writes_it(tmp_path):
    """The README's `onnxshrink.prune.prune("model.onnx", 0.5, "small.onnx")` after only
    `import onnxshrink`, in a fresh interpreter (no other test's import of onnxshrink.prune
    helps): the written model is the input with the chosen groups zeroed, counted here."""
    readme = (ROOT / "README.md").read_text()
    call = 'onnxshrink.prune.prune("model.onnx", 0.5, "small.onnx")'
    assert call in readme and "import onnxshrink\n" in readme
    onnx.save(tiny(CONV2, seed=12), tmp_path / "model.onnx")
    code = f"import onnxshrink\nr = {call}\nprint(r.shrink.after.params)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    small = onnx.load(tmp_path / "small.onnx")
    # W1's 6 filters keep int(6 * 0.5) = 3: 3 of 32 parameters each go
    assert int(proc.stdout.split()[-1]) == params(small) == 196 - 3 * PER_FILTER


def _help_of(flag: str) -> str:
    """The --help text of one option, its lines joined."""
    from onnxshrink.cli.parser import build_parser

    for action in build_parser()._actions:
        if flag in action.option_strings or action.dest == flag:
            return " ".join(str(action.help).split())
    raise AssertionError(f"{flag} not in --help")


def _readme_row(option: str) -> str:
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| `{option}")]
    assert len(rows) == 1, option
    return rows[0]


def test_help_and_readme_say_the_same_default_rtol():
    """The README's default rtol (twice the reference's noise, floored at ten machine epsilons:
    1e-5, 9.8e-3, 7.8e-2) is what --help says, and both are what the proof derives
    (test_draws_seed_rtol_and_atol_on_the_command_line and test_proof check the derivation)."""
    row, text = _readme_row("--rtol R"), _help_of("--rtol")
    for phrase in ("twice the reference's own noise", "ten machine epsilons", "1e-5 for fp32",
                   "9.8e-3 for fp16", "7.8e-2 for bf16", "float64 judge", "max |shrunk - reference| <= atol + rtol * max |reference|",
                   "A given rtol wins", "smallest rtol that would have passed"):
        assert phrase in row.replace("\\|", "|"), phrase
        assert phrase in text, phrase


def test_help_and_readme_name_masks_the_same_way():
    """README: masks name the framework's parameters (state_dict names); --help says so too, and
    lists the formats the README's table lists."""
    readme = (ROOT / "README.md").read_text()
    assert "Masks name the framework's parameters" in readme
    text = _help_of("masks")
    assert "named by the framework's parameters" in text and "state_dict names" in text
    assert "initializer name: 0/1 mask" not in text
    section = readme.split("## Masks")[1].split("\n## ")[0]
    formats = [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")]
    assert len(formats) == 8
    from onnxshrink.cli.parser import build_parser

    choices = next(a.choices for a in build_parser()._actions if "--masks-format" in a.option_strings)
    assert sorted(formats) == sorted(c for c in choices if c != "auto")


def test_every_option_the_readme_lists_is_in_help():
    readme = (ROOT / "README.md").read_text()
    # the tool's own flags: not those of the tools/ scripts the README mentions
    paragraphs = [p for p in readme.split("\n\n") if "tools/sweep.py" not in p]
    flags = set(re.findall(r"`(--[a-z][a-z0-9-]*)", "\n\n".join(paragraphs)))
    from onnxshrink.cli.parser import build_parser

    known = {o for a in build_parser()._actions for o in a.option_strings}
    assert len(flags) > 30
    assert sorted(flags - known) == []


def test_a_no_op_on_a_transformer_writes_its_graph_unchanged(zoo_dir, tmp_path, capsys):
    """README: a shrink that removes nothing writes the input itself (with external data, only
    the data file's name changes). A BERT-like encoder built in torch, exported with the dynamo
    exporter (its weights in external data), holding no zero slice."""
    from models.transformers import TRANSFORMERS
    from models.zoo import randomize

    entry = TRANSFORMERS["bert"]
    # the key and build of tests/test_groups.py's `exported`: one export per session
    path = export_cached(zoo_dir, ("groups", "bert", ()), lambda: (randomize(entry.build(), seed=1), entry.inputs(), {}))
    out = tmp_path / "out.onnx"
    assert main([str(path), "-o", str(out)]) == 0
    a, b = onnx.load(path), onnx.load(out)
    assert len(b.graph.node) == len(a.graph.node) == 68
    assert [n.SerializeToString() for n in b.graph.node] == [n.SerializeToString() for n in a.graph.node]
    assert params(a) == params(b) and error_against(a, b) <= 1e-6
