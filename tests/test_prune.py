"""`--prune`: whole groups chosen by importance, shrunk exactly against the model with them
zeroed, and the same size as the model built natively with the channels kept."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import (
    ROOT,
    WIDE,
    WIDE_BEFORE,
    WIDE_PER_CHANNEL,
    error_against,
    export_cached,
    init,
    params,
    run,
    tiny,
    with_masks,
)

from models.zoo import BENCH, ZOO, randomize
from onnxshrink import shrink
from onnxshrink.cli import main
from onnxshrink.prune import find_groups, prune, scores
from onnxshrink.prune.select import choose


def zeroed(model, result) -> onnx.ModelProto:
    """The reference a prune is exact against, made here: the input model with every member
    slice of the removed groups set to zero with numpy (each such initializer's values read by
    one node, so zeroing it zeroes that reader's slice only)."""
    model = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    readers = Counter(i for n in model.graph.node if n.op_type not in ("Shape", "Size") for i in n.input)
    masks: dict[str, np.ndarray] = {}
    for g in (result.groups.groups[i] for i in result.removed()):
        for m in g.members:
            assert readers[m.initializer] == 1, m.initializer
            mask = masks.setdefault(m.initializer, np.ones(tuple(init(model, m.initializer).shape), np.uint8))
            index = [slice(None)] * mask.ndim
            index[m.axis] = np.asarray(m.indices)
            mask[tuple(index)] = 0
    assert masks
    return with_masks(model, masks)


def native_widths(module, ratio: float) -> dict[str, int]:
    """Torch-Pruning's per-layer count: a layer of n channels keeps int(n * (1 - ratio))."""
    return {g: int(n * (1 - ratio)) for g, n in module.widths.items()}


def exports(zoo_dir, entry, name: str, **kwargs):
    def full():
        return randomize(entry.build(), seed=1), entry.input_shape, kwargs

    def native():
        widths = native_widths(entry.build(), 0.5)
        return randomize(entry.build(widths), seed=3), entry.input_shape, kwargs

    key = tuple(sorted(kwargs.items()))
    return export_cached(zoo_dir, ("prune", name, key), full), export_cached(
        zoo_dir, ("prune-native", name, key), native
    )


def test_resnet50_at_half_reaches_the_native_size_and_is_proven(zoo_dir):
    path, native = exports(zoo_dir, BENCH["resnet50"], "resnet50")
    result = prune(path, 0.5, draws=1)
    assert result.shrink.validation.passed  # against the model with the chosen groups zeroed
    assert result.model.graph.initializer[0].data_type == onnx.TensorProto.FLOAT
    assert params(result.model) == result.shrink.after.params == params(onnx.load(native))  # 6.9 M of 25.5 M
    assert result.original.params > 3.5 * result.shrink.after.params
    assert error_against(zeroed(path, result), result.model, draws=1) <= 1e-5


def tp_l1_choice(module, gset, ratio: float) -> list[set[tuple[str, int]]]:
    """Per layer, the channels Torch-Pruning's group L1 (MagnitudeImportance(p=1), mean over
    the weights of conv, linear and BatchNorm layers, biases excluded) removes, computed here
    from the PyTorch module's own parameters, each as (parameter, index) of its producers."""
    state = module.state_dict()
    out = []
    for layer in gset.layers:
        groups = [gset.groups[i] for i in layer.groups if gset.groups[i].exact]
        if not groups or layer.kind == "block":  # blocks go only when asked (--units)
            continue

        def l1(g):
            terms = []
            for m in g.members:
                for p in m.params:
                    owner = module.get_submodule(p.name.rsplit(".", 1)[0])
                    if p.name.endswith(".weight") and isinstance(
                        owner, torch.nn.Conv2d | torch.nn.Linear | torch.nn.BatchNorm2d
                    ):
                        idx = torch.tensor(m.indices)
                        terms.append(float(state[p.name].index_select(p.axis, idx).abs().sum()))
            return sum(terms) / len(terms)

        n = len(groups)
        drop = sorted(groups, key=lambda g: (l1(g), g.id))[: n - int(n * (1 - ratio))]
        out.append({(m.params[0].name, int(i)) for g in drop for m in g.members if m.side == "out" and m.params for i in m.indices})
    return out


def test_mobilenetv2_l1_removes_the_channels_torch_pruning_l1_removes(zoo_dir):
    # With BatchNorm kept as a node (optimize=False) the ONNX weights are the module's: the
    # criterion is Torch-Pruning's, and so must be the channels.
    entry = ZOO["mobilenetv2"]
    path, native = exports(zoo_dir, entry, "mobilenetv2", optimize=False)
    result = prune(path, 0.5, validate=False)
    assert error_against(zeroed(path, result), result.model) <= 1e-5
    assert params(result.model) == result.shrink.after.params == params(onnx.load(native))
    module = randomize(entry.build(), seed=1)
    removed = [
        {(m.params[0].name, int(i)) for i in p.removed for m in result.groups.groups[i].members if m.side == "out" and m.params for i in m.indices}
        for p in result.plans
        if p.total and p.layer.kind != "block"
    ]
    assert removed == tp_l1_choice(module, result.groups, 0.5)


KERAS = ROOT / "models/keras/keras_cnn.onnx"


def test_a_keras_model_exported_with_tf2onnx_is_pruned_and_proven(tmp_path):
    # tools/keras_export.py wrote it (and what Keras computed on an input).
    x = np.load(KERAS.with_suffix(".input.npy"))
    assert np.abs(run(onnx.load(KERAS), {"image": x})[0] - np.load(KERAS.with_suffix(".expected.npy"))).max() < 1e-5
    out = tmp_path / "small.onnx"
    assert main([str(KERAS), "--prune", "0.5", "-o", str(out), "-q"]) == 0
    result = prune(KERAS, 0.5, validate=False)
    assert params(onnx.load(out)) == result.shrink.after.params
    kinds = {p.layer.name: (len(p.removed), p.total) for p in result.plans if p.total}
    # conv1 (24), the residual stream with its depthwise conv (16), project (32), fc1 (20); its
    # one residual block (not pruned unless asked: --units)
    assert sorted(kinds.values()) == [(0, 1), (8, 16), (10, 20), (12, 24), (16, 32)]
    assert error_against(zeroed(KERAS, result), result.model) <= 1e-5
    assert result.shrink.after.params < 0.4 * result.original.params


def test_masks_out_reapply_to_the_unpruned_model(zoo_dir, tmp_path):
    path, _ = exports(zoo_dir, ZOO["resnet_basic"], "resnet_basic")
    out, masks = tmp_path / "small.onnx", tmp_path / "masks.pt"
    assert main([str(path), "--prune", "0.5", "-o", str(out), "--masks-out", str(masks), "-q"]) == 0
    saved = torch.load(masks, weights_only=True)
    assert "stem.1.weight" in saved and saved["stem.1.weight"].shape == (8,)  # a folded BatchNorm
    again = shrink(path, masks, validate=False, input_masked=False)
    assert params(again.model) == again.after.params == params(onnx.load(out))
    # both against the input with the chosen groups zeroed here (the same choice, made again)
    reference = zeroed(path, prune(path, 0.5, validate=False))
    assert error_against(reference, onnx.load(out)) <= 1e-5
    assert error_against(reference, again.model) <= 1e-5


CHAIN = """
g (float[2, 3, 5, 5] x, float[8, 3, 3, 3] W1, float[8] B1, float[4, 8, 1, 1] W2) => (float[2, 4, 3, 3] y) {
  h = Conv (x, W1, B1)
  r = Relu (h)
  y = Conv (r, W2)
}
"""


def test_activation_criterion_is_mean_abs_activation_times_the_weights_reading_it():
    model = tiny(CHAIN)
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 5)).astype(np.float32)
    gset = find_groups(model)
    got = scores(gset, "activation", model=model, inputs=[{"x": x}])
    w1 = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, None))
    r = run(probe, {"x": x})[1]
    want = np.abs(r).mean(axis=(0, 2, 3)) * np.abs(w1["W2"]).sum(axis=(0, 2, 3))
    [layer] = [layer for layer in gset.layers if gset.groups[layer.groups[0]].exact]
    np.testing.assert_allclose([got[i] for i in layer.groups], want, rtol=1e-6)


def test_round_to_ignore_max_ratio_and_global(zoo_dir):
    path, _ = exports(zoo_dir, ZOO["resnet_basic"], "resnet_basic")
    gset = find_groups(onnx.load(path))
    imp = scores(gset, "l1")
    by = {p.layer.name: p for p in choose(gset, imp, 0.3, round_to=8)}
    sizes = {name: p.total - len(p.removed) for name, p in by.items() if p.total and p.layer.kind != "block"}
    # 32 channels at 0.3 keep int(22.4) = 22, rounded down to 16; 16 keep 11 -> 8; 8 keep 5 -> 1 (at least one)
    assert sorted(sizes.values()) == [1, 1, 1, 8, 8, 16, 16]
    plans = choose(gset, imp, 0.5, ignore=["blocks_.3.*"], max_layer_ratio=0.25)
    for p in plans:
        if p.total:
            assert len(p.removed) == (0 if p.ignored else int(p.total * 0.25))
    # both layers blocks_.3's convs produce (and the blocks: not asked for)
    assert sorted(p.layer.kind for p in plans if p.ignored) == ["block", "channel", "channel"]
    plans = choose(gset, imp, 0.5, global_ranking=True)
    total = sum(p.total for p in plans if not p.ignored)
    assert sum(len(p.removed) for p in plans) == total - int(total * 0.5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prune", "1.5"], "give a ratio in [0, 1)"),
        (["--prune", "0.5", "--criterion", "activation"], "--inputs"),
        (["--prune", "0.5", "--round-to", "0"], "--round-to 0"),
        (["--prune", "0.5", "--units", "head", "layer"], "--units layer: choose among"),
    ],
)
def test_bad_prune_options_are_exit_2_naming_them(zoo_dir, capsys, args, message):
    path, _ = exports(zoo_dir, ZOO["resnet_basic"], "resnet_basic")
    assert main([str(path), *args]) == 2
    assert message in capsys.readouterr().err


def test_prune_with_a_masks_file_is_refused(tmp_path, capsys):
    model = tmp_path / "m.onnx"
    onnx.save(tiny(CHAIN), str(model))
    masks = tmp_path / "masks.npz"
    np.savez(masks, W1=np.ones((8, 3, 3, 3)))
    assert main([str(model), str(masks), "--prune", "0.5"]) == 2
    assert "drop the masks file" in capsys.readouterr().err
    assert Path(model).exists()


# Two layers with a coupling: W1's 8 channels are read by W2 and W3; W2's and W3's 6 channels
# meet in an Add (one group each: rows of both, and W4's column). W4's rows are the output's.
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


def _zeroed_along(mask: np.ndarray, axis: int) -> list[int]:
    other = tuple(a for a in range(mask.ndim) if a != axis)
    return np.flatnonzero((mask == 0).all(axis=other)).tolist()


@pytest.mark.parametrize(
    "options, layer1, layer2, after",
    [
        # per layer, L1: 8 - int(8 * 0.5) = 4 and 6 - int(6 * 0.5) = 3 groups go
        ({}, [0, 2, 3, 7], [0, 1, 3], 4 * 37 + 2 * 3 * 5 + 2 * 4),
        # global, L2: the groups least important relative to their layer's mean, as many as
        # remove the parameters uniform removes (186 left), as near as whole groups come: 198
        (
            {"criterion": "l2", "global_ranking": True},
            [0, 2, 4, 7],
            [0, 4],
            4 * 37 + 2 * (4 * 4 + 4) + 2 * 4 + 2,
        ),
    ],
)
def test_the_choice_on_a_small_model_is_pinned(options, layer1, layer2, after):
    # The channels chosen (as main chose them before prune was made fast), recomputed here
    # from the weights: a group's importance is the mean over its weights (biases excluded)
    # of the sum of |w|^p over its slice; Torch-Pruning's group magnitude.
    model = tiny(BRANCHES, seed=7)
    w = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    p = 2 if options.get("criterion") == "l2" else 1

    def norm(name: str, axis: int) -> np.ndarray:
        other = tuple(a for a in range(w[name].ndim) if a != axis)
        return (np.abs(w[name]) ** p).sum(axis=other)

    imp1 = (norm("W1", 0) + norm("W2", 1) + norm("W3", 1)) / 3
    imp2 = (norm("W2", 0) + norm("W3", 0) + norm("W4", 1)) / 3
    if options.get("global_ranking"):
        # the prefix of the global order whose parameters come nearest uniform's (k1 = 4, k2 = 3)
        def count(k1: int, k2: int) -> int:  # W1, B1; W2, B2, W3, B3; W4, B4
            return 37 * k1 + 2 * (k2 * k1 + k2) + 2 * k2 + 2

        order = np.argsort(np.concatenate([imp1 / imp1.mean(), imp2 / imp2.mean()]), kind="stable")
        n = min(range(15), key=lambda n: abs(count(8 - int((order[:n] < 8).sum()), 6 - int((order[:n] >= 8).sum())) - count(4, 3)))
        expected1, expected2 = order[:n][order[:n] < 8], order[:n][order[:n] >= 8] - 8
    else:
        expected1 = np.argsort(imp1, kind="stable")[:4]
        expected2 = np.argsort(imp2, kind="stable")[:3]
    assert sorted(expected1.tolist()) == layer1 and sorted(expected2.tolist()) == layer2

    result = prune(model, 0.5, draws=1, **options)
    masks = result.masks
    assert _zeroed_along(masks["W1"], 0) == layer1
    assert _zeroed_along(masks["W2"], 1) == _zeroed_along(masks["W3"], 1) == layer1
    assert _zeroed_along(masks["W2"], 0) == _zeroed_along(masks["W3"], 0) == layer2
    assert _zeroed_along(masks["W4"], 1) == layer2
    assert result.original.params == 418
    assert result.shrink.after.params == after
    assert result.shrink.validation.passed
    assert error_against(zeroed(model, result), result.model, draws=1) <= 1e-5


@pytest.mark.parametrize("block", [None, 8 * 300 * 3])  # 300 x 7 in blocks of 3 columns: one left
def test_matrix_norms_are_the_blockwise_sums_bit_for_bit(monkeypatch, block):
    # A matrix's norms read in row blocks add the same numbers in the same order as the
    # block-wise pass over the moved axis (the scores, hence the choice, are unchanged), and
    # are the sums of |w|^p.
    from onnxshrink.prune import importance

    if block is not None:
        monkeypatch.setattr(importance, "NORM_BLOCK_BYTES", block)
    rng = np.random.default_rng(3)
    for shape in [(300, 7), (7, 300), (1, 9), (9, 1), (257, 129)]:
        for dtype in (np.float32, np.float16, np.float64):
            w = rng.standard_normal(shape).astype(dtype)
            w[rng.random(shape) < 0.2] = 0
            for axis in (0, 1):
                for p in (1, 2):
                    fast, blockwise = importance._matrix_norms(w, p)[axis], importance._norms(w, axis, p)
                    assert fast.tobytes() == blockwise.tobytes()
                    expected = (np.abs(w.astype(np.float64)) ** p).sum(axis=1 - axis)
                    np.testing.assert_allclose(fast, expected, rtol=1e-12)


MLP = """
g (float[1,6] x, float[6,8] W1, float[8] B1, float[8,5] W2, float[5] B2, float[5,3] W3) => (float[1,3] y) {
  a = MatMul(x, W1)
  b = Add(a, B1)
  r = Relu(b)
  c = MatMul(r, W2)
  d = Add(c, B2)
  s = Relu(d)
  y = MatMul(s, W3)
}
"""


@pytest.mark.parametrize("text", [MLP, BRANCHES])
@pytest.mark.parametrize("p", [1, 2])
def test_weights_norms_computed_two_at_a_time_are_those_computed_one_at_a_time(monkeypatch, text, p):
    # importance.all_norms passes over NORM_THREADS weights at once: each weight's sums are the
    # same bits as one at a time (so are the scores, hence the choice), and are sum |w|^p.
    from onnxshrink.prune import importance

    model = tiny(text, seed=3)
    got = {}
    for threads in (1, 2):
        monkeypatch.setattr(importance, "NORM_THREADS", threads)
        gset = find_groups(model, verify=False)
        got[threads] = (scores(gset, "l1" if p == 1 else "l2"), dict(gset.norms), gset.arrays)
    assert got[1][0].tobytes() == got[2][0].tobytes()
    assert got[1][1].keys() == got[2][1].keys() and len(got[2][1]) >= 4
    for (tensor, axis, q), norms in got[2][1].items():
        assert norms.tobytes() == got[1][1][tensor, axis, q].tobytes()
        w = got[2][2][tensor].astype(np.float64)
        other = tuple(a for a in range(w.ndim) if a != axis)
        np.testing.assert_allclose(norms, (np.abs(w) ** q).sum(axis=other), rtol=1e-12)


def test_the_groups_are_left_out_of_collections_while_the_prune_runs_and_given_back(monkeypatch):
    # run._out_of_collections: after the groups are found, what is alive is frozen (gc.freeze),
    # so that the shrink's full collections do not scan every member again; the prune gives it
    # back (the count 0 again), and leaves a process's own freeze as it was.
    import gc

    from onnxshrink.prune import run as prune_run

    seen: list[int] = []
    real = prune_run.shrink_reference

    def shrink_reference(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return real(*args, **kwargs)

    monkeypatch.setattr(prune_run, "shrink_reference", shrink_reference)
    model = tiny(BRANCHES, seed=7)
    assert gc.get_freeze_count() == 0
    result = prune(model, 0.5, draws=1)
    assert seen[-1] > 0 and gc.get_freeze_count() == 0
    assert result.shrink.validation.passed and result.shrink.after.params == 4 * 37 + 2 * 3 * 5 + 2 * 4
    gc.freeze()  # the process's own
    try:
        own = gc.get_freeze_count()  # (it falls as frozen objects are freed, never rises)
        again = prune(model, 0.5, draws=1)
        assert seen[-1] <= own and gc.get_freeze_count() > 0
        assert again.shrink.after.params == result.shrink.after.params
    finally:
        gc.unfreeze()


def test_an_input_with_external_data_gives_an_output_with_external_data_and_is_never_overwritten(
    tmp_path, capsys
):
    """As a plain shrink does: the pruned model's weights go to `<output>.data` when the input's
    were in external data, and `-o` naming the input or its data is refused before any work."""
    model = tmp_path / "m.onnx"
    onnx.save_model(
        tiny(WIDE, seed=5), str(model), save_as_external_data=True, location="m.onnx.data"
    )
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for target in ("m.onnx", "m.onnx.data"):
        assert main([str(model), "--prune", "0.5", "-o", str(tmp_path / target), "-q"]) == 2
        assert "refusing to overwrite the input model or its data" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    out, masks = tmp_path / "small.onnx", tmp_path / "masks.npz"
    assert main([str(model), "--prune", "0.5", "-o", str(out), "--masks-out", str(masks), "-q"]) == 0
    assert (tmp_path / "small.onnx.data").stat().st_size > 0  # W1's kept rows: 18 KiB
    assert onnx.load(str(out), load_external_data=False).graph.initializer[0].data_location == (
        onnx.TensorProto.EXTERNAL
    )
    shrunk = onnx.load(str(out))
    assert params(shrunk) == WIDE_BEFORE - 32 * WIDE_PER_CHANNEL  # half of W1's 64 channels
    # independently: the input with the written masks applied computes what the output does
    reference = onnx.load(str(model))
    chosen = dict(np.load(masks))
    for t in reference.graph.initializer:
        if t.name in chosen:
            w = onnx.numpy_helper.to_array(t)
            t.CopyFrom(onnx.numpy_helper.from_array((w * chosen[t.name]).astype(w.dtype), t.name))
    assert error_against(reference, shrunk, draws=2) <= 1e-5
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("m.")} == before


RESIDUAL = """
g (float[2, 4, 6] x, float[6, 6] W1, float[6, 6] W2, float[6, 3] Wo) => (float[2, 4, 3] y) {
  f1 = MatMul (x, W1)
  h1 = Add (x, f1)
  f2 = MatMul (h1, W2)
  h2 = Add (h1, f2)
  y = MatMul (h2, Wo)
}
"""


def test_blocks_are_ranked_by_their_influence_and_pruned_only_when_asked():
    # ShortGPT's Block Influence: 1 - the mean cosine of the stream before and after a block.
    model = tiny(RESIDUAL, values={"W2": 0.05 * np.random.default_rng(3).standard_normal((6, 6))})
    x = np.random.default_rng(0).standard_normal((2, 4, 6)).astype(np.float32)
    gset = find_groups(model)
    blocks = [gset.groups[i] for i in next(la for la in gset.layers if la.kind == "block").groups]
    assert [sorted(m.initializer for m in b.members) for b in blocks] == [["W1"], ["W2"]]
    got = scores(gset, "activation", model=model, inputs=[{"x": x}])
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_tensor_value_info("h1", onnx.TensorProto.FLOAT, None))
    probe.graph.output.append(onnx.helper.make_tensor_value_info("h2", onnx.TensorProto.FLOAT, None))
    _, h1, h2 = (a.astype(np.float64) for a in run(probe, {"x": x}))

    def influence(a, b):
        return 1 - np.mean(np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)))

    want = [influence(x.astype(np.float64), h1), influence(h1, h2)]
    np.testing.assert_allclose([got[b.id] for b in blocks], want, rtol=1e-6)
    assert want[1] < want[0]  # W2 is small: the second block changes the stream least
    assert all(not p.removed for p in prune(model, 0.5, validate=False).plans if p.layer.kind == "block")
    result = prune(model, 0.5, units=["block"], criterion="activation", data=[{"x": x}])
    assert result.shrink.passed
    assert result.original.params - result.shrink.after.params == 36  # W2, and its MatMul and Add
    assert [n.op_type for n in result.model.graph.node] == ["MatMul", "Add", "MatMul"]


def test_block_influence_is_measured_in_the_calibration_run_itself(monkeypatch):
    # The blocks' cosines come from the same onnxruntime runs as the channels' statistics: the
    # calibration feeds run once per prune, not again for the blocks.
    from onnxshrink.prune import calibrate

    model = tiny(RESIDUAL, values={"W2": 0.05 * np.random.default_rng(3).standard_normal((6, 6))})
    feeds = [{"x": np.random.default_rng(s).standard_normal((2, 4, 6)).astype(np.float32)} for s in range(3)]
    calls = []
    real = calibrate.run_feeds
    monkeypatch.setattr(calibrate, "run_feeds", lambda *a: calls.append(len(a[1])) or real(*a))
    result = prune(model, 0.5, units=["block"], criterion="activation", data=feeds, validate=False, price=False)
    assert calls == [3]
    assert result.original.params - result.shrink.after.params == 36


UNEVEN = """
g (float[1,16,8,8] x, float[48,16,3,3] W1, float[48] B1, float[8,48,3,3] W2, float[8] B2,
   float[8,8,3,3] W3, float[8] B3) => (float[1,8,8,8] y) {
  h1 = Conv<pads=[1,1,1,1]>(x, W1, B1)
  r1 = Relu(h1)
  h2 = Conv<pads=[1,1,1,1]>(r1, W2, B2)
  r2 = Relu(h2)
  y = Conv<pads=[1,1,1,1]>(r2, W3, B3)
}
"""


def _chain_counts(c1: int, c2: int) -> tuple[int, int]:
    """Parameters and MACs of UNEVEN with c1 and c2 channels, counted here."""
    params = c1 * 16 * 9 + c1 + c2 * c1 * 9 + c2 + 8 * c2 * 9 + 8  # every parameter but B3 prunable
    macs = 64 * 9 * (c1 * 16 + c2 * c1 + 8 * c2)
    return params, macs


def test_prune_ratio_means_one_parameter_fraction_under_every_allocation(tmp_path, capsys):
    """`--prune 0.25` is printed first as what it removes (a quarter of each layer's channels:
    36 of 48 and 6 of 8 kept, which compound: 30.9% of the parameters, counted here); global and
    sensitivity remove the same fraction of the parameters, to within 2 points (before, they
    removed 29.2% and 27.6%: R was a share of the groups, whatever they cost)."""
    model = tiny(UNEVEN, seed=21)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=np.random.default_rng(4).standard_normal((1, 16, 8, 8)).astype(np.float32))
    (p0, m0), (p1, m1) = _chain_counts(48, 8), _chain_counts(36, 6)
    removed = {}
    for allocation in ("uniform", "global", "sensitivity"):
        out = tmp_path / f"{allocation}.onnx"
        argv = [str(path), "--prune", "0.25", "--allocation", allocation, "--no-price", "-o", str(out)]
        assert main([*argv, "--inputs", str(calib)] if allocation == "sensitivity" else argv) == 0
        printed = capsys.readouterr().out
        line = next(t for t in printed.splitlines() if "--prune 0.25 means" in t)
        assert f"{1 - p1 / p0:.1%} of the parameters and {1 - m1 / m0:.1%} of the MACs" in line
        assert printed.index("--prune 0.25 means") < printed.index("validating")
        assert "--prune-to-params" in line
        removed[allocation] = 1 - params(onnx.load(out)) / p0
    assert removed["uniform"] == pytest.approx(1 - p1 / p0, abs=1e-9)
    assert abs(removed["global"] - removed["uniform"]) <= 0.02
    assert abs(removed["sensitivity"] - removed["uniform"]) <= 0.02


GRU_THEN_LINEAR = """
g (float[5, 2, 3] x, float[1, 24, 3] W, float[1, 24, 8] R, float[1, 48] B, float[8, 4] V) => (float[5, 1, 2, 4] y) {
  s, last = GRU <hidden_size = 8> (x, W, R, B)
  y = MatMul (s, V)
}
"""


def test_prune_ratio_meaning_charges_a_recurrent_ops_macs_once_across_its_w_and_r(tmp_path, capsys):
    """A GRU's MACs are its input and recurrent products (W and R, each step): `--prune 0.25`
    (2 of its 8 units) takes out the fraction of the MACs counted here, not W's and R's each
    charged the node's whole MACs (before: 64.0% printed where 37.2% goes; lac's GRUs: 101.1%)."""
    path = tmp_path / "gru.onnx"
    onnx.save(tiny(GRU_THEN_LINEAR, seed=5), path)

    def macs(h: int) -> int:
        return 5 * 2 * (3 * h * 3 + 3 * h * h) + 5 * 2 * h * 4  # GRU steps x (W + R), then the MatMul

    def params(h: int) -> int:
        return 3 * h * 3 + 3 * h * h + 6 * h + h * 4

    out = tmp_path / "out.onnx"
    assert main([str(path), "--prune", "0.25", "--no-price", "-o", str(out)]) == 0
    line = next(t for t in capsys.readouterr().out.splitlines() if "--prune 0.25 means" in t)
    assert f"{1 - params(6) / params(8):.1%} of the parameters and {1 - macs(6) / macs(8):.1%} of the MACs" in line
    [gru] = [n for n in onnx.load(out).graph.node if n.op_type == "GRU"]
    assert onnx.helper.get_attribute_value(next(a for a in gru.attribute if a.name == "hidden_size")) == 6


def test_help_says_what_prune_ratio_means():
    from onnxshrink.cli.parser import build_parser

    text = " ".join(next(a.help for a in build_parser()._actions if "--prune" in a.option_strings).split())
    assert "each layer's groups" in text and "compound" in text
    assert "the same fraction of the parameters" in text and "--prune-to-params" in text


def test_the_time_line_holds_every_phase_of_a_prune_and_they_sum_to_its_wall_time(tmp_path, capsys):
    """Groups, the ratio's meaning, calibration, importance, compensation, sensitivity,
    allocation, the shrink (its own phases inside), the price and the save: each in the Time
    line and the report, their total within 5% of the run's wall time, measured here."""
    import json
    import re
    import time

    model = tiny(UNEVEN, seed=21)
    path, out, r, calib = tmp_path / "m.onnx", tmp_path / "small.onnx", tmp_path / "r.json", tmp_path / "c.npz"
    onnx.save(model, path)
    np.savez(calib, x=np.random.default_rng(4).standard_normal((1, 16, 8, 8)).astype(np.float32))
    argv = [str(path), "--prune", "0.25", "--allocation", "sensitivity", "--compensate", "bias", "--inputs", str(calib), "-o", str(out), "--report", str(r)]
    t0 = time.perf_counter()
    assert main(argv) == 0
    wall = time.perf_counter() - t0
    line = next(t for t in capsys.readouterr().out.splitlines() if t.startswith("Time: "))
    phases = dict(re.findall(r"(?:^Time: | \| )([a-z.]+) ([0-9.]+) s", line))
    assert list(phases) == [
        "start", "load", "groups", "target", "calibrate", "importance", "compensation", "sensitivity",
        "allocation", "price.input", "zero", "masks", "shrink", "price", "save", "total",
    ]
    assert re.search(r"shrink [0-9.]+ s \(load [0-9.]+, bind [0-9.]+, analyze [0-9.]+, rewrite [0-9.]+, validate [0-9.]+\)", line)
    total = float(phases.pop("total"))
    assert total == pytest.approx(sum(map(float, phases.values())), abs=0.01 * len(phases))
    assert abs(total - wall) <= 0.05 * wall
    timings = json.loads(r.read_text())["timings"]
    assert set(phases) - {"start"} <= set(timings) and "shrink.validate" in timings


def test_a_prune_on_a_terminal_counts_its_long_phases_and_is_quiet_with_q(tmp_path):
    """The analysis finding the groups (its first pass, its closure's visits), their listing, the
    sensitivity runs and the price show bars with counts on a terminal (the sensitivity: one run per family and ratio measured, 2 families here; the
    price: one input here); -q shows none."""
    from conftest import cli_on_terminal

    model = tiny(UNEVEN, seed=21)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(4).standard_normal((1, 16, 8, 8)).astype(np.float32))
    argv = ["m.onnx", "--prune", "0.25", "--allocation", "sensitivity", "--inputs", "c.npz", "-o", "s.onnx"]
    code, printed, shown = cli_on_terminal(*argv, cwd=tmp_path)
    assert code == 0, shown
    assert len(re.findall(r"^\[I\] sensitivity \d/2: ", printed, re.M)) == 2
    assert re.search(r"analysis: reading weights: +\d+%\|[^|]*\| \d+/\d+ \[", shown)
    assert re.search(r"analysis: the keep closure: \d+visit \[", shown)  # no total: a count
    assert re.search(r"groups: listing them: +\d+%\|[^|]*\| \d+/\d+ \[", shown)
    assert re.search(r"sensitivity: +\d+%\|[^|]*\| \d+/\d+ \[", shown)
    assert re.search(r"price: the input and the pruned model: +\d+%\|[^|]*\| [01]/1 \[", shown)
    code, printed, shown = cli_on_terminal(*argv, "-q", cwd=tmp_path)
    assert code == 0 and printed == "" and shown == ""


def test_a_parameter_targets_candidates_are_gone_once_counted(tmp_path, monkeypatch):
    """Each candidate `--prune-to-params` shrinks to count is freed before the chosen groups are
    zeroed: its analysis's graph (nodes and tensors referring to each other, its constants the
    weights' values) is a reference cycle, so with the collector idle every candidate stayed
    through the final shrink (SmolLM2-135M in memory: 1.1 GiB). No more graphs are alive then
    than when `--prune` shrank no candidate (3 against 1 on the code before)."""
    import gc

    import onnx_graphsurgeon as gs

    from models.llama import LlamaConfig, build
    from onnxshrink.prune import run as prune_run

    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=8), path)
    alive: list[int] = []
    zero = prune_run._zero

    def zeroing(*args, **kwargs):
        alive.append(sum(isinstance(o, gs.Graph) for o in gc.get_objects()))
        return zero(*args, **kwargs)

    monkeypatch.setattr(prune_run, "_zero", zeroing)
    gc.collect()
    gc.disable()  # the collector idle, as over a large model's long phases
    try:
        plain = prune(path, 0.3, tmp_path / "plain.onnx", validate=False, price=False)
        gc.collect()
        result = prune(path, None, tmp_path / "out.onnx", params=0.7, validate=False, price=False)
    finally:
        gc.enable()
    assert plain.removed() and len(alive) == 2 and alive[1] <= alive[0], alive
    assert result.reached is not None and abs(result.reached - 0.7) <= 0.005
    assert result.shrink.after.params == round(result.reached * result.original.params)
