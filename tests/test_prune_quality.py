"""Pruning well (issue 22): calibrated criteria, bias compensation and the refit, sensitivity and
its picture, targets in parameters and MACs, the price, and the framework round trip.

Every figure is checked against what the test computes itself: the activations and their means
from onnxruntime runs of the input model, the compensated reference built here with numpy from
the definition, the pruned model's outputs run here in onnxruntime (validation off)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import numpy as np
import onnx
import pytest
import torch
from conftest import cli, error_against, init, ort_run, tiny
from onnx import numpy_helper
from torch import nn

from onnxshrink.prune import prune

MLP = """
g (float[8,16] x, float[16,32] W1, float[32] B1, float[32,12] W2, float[12] B2) => (float[8,12] y) {
  h = MatMul(x, W1)
  hb = Add(h, B1)
  r = Relu(hb)
  z = MatMul(r, W2)
  y = Add(z, B2)
}
"""


def mlp(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed + 100)
    # biases of both signs and sizes: some neurons are nearly constant, some dead, some live
    return tiny(MLP, seed=seed, values={"B1": rng.normal(0.5, 1.5, 32), "B2": rng.normal(0, 1, 12)})


def feeds(seed: int, shape=(8, 16)) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def hidden(model: onnx.ModelProto, feed, name: str = "r") -> np.ndarray:
    """The activation `name` of the input model, run here with onnxruntime."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.ValueInfoProto(name=name))
    return ort_run(probe, feed)[-1].astype(np.float64)


def removed_columns(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(mask.reshape(mask.shape[0], -1).max(axis=0) == 0)


@pytest.mark.parametrize("mode", ["bias", "refit", "refit by blocks"])
def test_compensation_is_the_mean_or_the_ridge_refit(mode, monkeypatch):
    if mode == "refit by blocks":  # a weight refit a few outputs at a time, as a large one is
        monkeypatch.setattr("onnxshrink.prune.compensate.REFIT_BLOCK_BYTES", 3 * 8 * 32)
        mode = "refit"
    model, cal, held = mlp(), feeds(1), feeds(2)
    result = prune(model, 0.25, criterion="fluctuation", compensate=mode, data=[cal], held_out=[held], validate=False)
    W1, B1, W2, B2 = (init(model, n).astype(np.float64) for n in ("W1", "B1", "W2", "B2"))
    r = hidden(model, cal)
    # fluctuation: each neuron's variance on the calibration rows x the sum of W2[j]^2
    score = r.var(axis=0) * (W2**2).sum(axis=1)
    gone = removed_columns(result.masks["W1"])
    assert sorted(gone) == sorted(np.argsort(score)[:8])  # 32 - int(32 * 0.75)
    kept = np.setdiff1d(np.arange(32), gone)
    if mode == "bias":
        w2, b2 = W2[kept], B2 + r[:, gone].mean(axis=0) @ W2[gone]
    else:  # x_gone ~ x_kept B + c, ridge lambda = 1 x the kept channels' mean variance
        xc = r - r.mean(axis=0)
        gram = xc[:, kept].T @ xc[:, kept] / len(r)
        lam = np.mean(np.diag(gram))
        fit = np.linalg.solve(gram + lam * np.eye(len(kept)), xc[:, kept].T @ xc[:, gone] / len(r))
        const = r[:, gone].mean(axis=0) - r[:, kept].mean(axis=0) @ fit
        w2, b2 = W2[kept] + fit @ W2[gone], B2 + const @ W2[gone]
    x = held["x"].astype(np.float64)
    expected = np.maximum(x @ W1[:, kept] + B1[kept], 0) @ w2 + b2
    (got,) = ort_run(result.model, held)
    assert result.shrink.after.params == result.original.params - 8 * (16 + 1 + 12)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    # what it buys: the plain zeroing of the same neurons is further from the input model
    (y0,) = ort_run(model, held)
    plain = np.maximum(x @ W1[:, kept] + B1[kept], 0) @ W2[kept] + B2
    assert np.linalg.norm(got - y0) < np.linalg.norm(plain - y0)
    # the price, as the test measures it on the held-out rows
    (out,) = result.price.outputs
    assert out.rel_error == pytest.approx(np.linalg.norm(got - y0) / np.linalg.norm(y0), rel=1e-4)
    cos = (got * y0).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(y0, axis=1)
    assert out.cosine_mean == pytest.approx(cos.mean(), abs=1e-5)
    assert out.cosine_min == pytest.approx(cos.min(), abs=1e-5)
    assert out.top1 == pytest.approx(np.mean(got.argmax(1) == y0.argmax(1)))
    assert result.price.inputs.startswith("held-out inputs")
    assert result.price.latency_before_ms > 0 and result.price.latency_after_ms > 0


NO_BIAS = """
g (float[8,16] x, float[16,32] W1, float[32] B1, float[32,12] W2) => (float[8,12] y) {
  h = MatMul(x, W1)
  hb = Add(h, B1)
  r = Relu(hb)
  y = MatMul(r, W2)
}
"""
GEMM = """
g (float[8,16] x, float[16,32] W1, float[32] B1, float[12,32] W2, float[12] B2) => (float[8,12] y) {
  h = MatMul(x, W1)
  hb = Add(h, B1)
  r = Relu(hb)
  y = Gemm<transB=1, alpha=0.5, beta=2.0>(r, W2, B2)
}
"""


@pytest.mark.parametrize("form", ["no bias", "gemm"])
def test_a_consumer_without_a_bias_gets_one_and_gemm_scales_it(form):
    """A MatMul whose output no bias Add reads gets an Add of the compensation; Gemm computes
    alpha * A @ B + beta * C, so its C takes the compensation times alpha / beta."""
    rng = np.random.default_rng(9)
    model = tiny(NO_BIAS if form == "no bias" else GEMM, seed=5, values={"B1": rng.normal(0.5, 1.5, 32)})
    cal, held = feeds(1), feeds(2)
    result = prune(model, 0.25, criterion="wanda", compensate="bias", data=[cal], price=False, validate=False)
    W1, B1 = init(model, "W1").astype(np.float64), init(model, "B1").astype(np.float64)
    w2 = init(model, "W2").astype(np.float64)
    w2 = w2 if form == "no bias" else 0.5 * w2.T  # as [in, out], alpha folded
    b2 = 0.0 if form == "no bias" else 2.0 * init(model, "B2").astype(np.float64)
    r = hidden(model, cal)
    gone = removed_columns(result.masks["W1"])
    kept = np.setdiff1d(np.arange(32), gone)
    x = held["x"].astype(np.float64)
    expected = np.maximum(x @ W1[:, kept] + B1[kept], 0) @ w2[kept] + b2 + r[:, gone].mean(axis=0) @ w2[gone]
    (got,) = ort_run(result.model, held)
    assert len(gone) == 8
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    if form == "no bias":  # the Add it needed, with 12 values: no framework name, under its own
        assert [n.op_type for n in result.model.graph.node][-1] == "Add"
        assert result.shrink.after.params == result.original.params - 8 * (16 + 1 + 12) + 12
        assert list(result.weights) == result.unnamed_weights == ["y.compensation"]


CONV_BN = """
g (float[2,3,8,8] x, float[8,3,3,3] W1, float[8] B1, float[6,8,3,3] W2, float[6] S, float[6] T,
   float[6] M, float[6] V) => (float[2,6,8,8] y) {
  h = Conv<pads=[1,1,1,1]>(x, W1, B1)
  r = Relu(h)
  c = Conv<pads=[1,1,1,1]>(r, W2)
  y = BatchNormalization(c, S, T, M, V)
}
"""


def test_a_bias_free_conv_is_compensated_in_the_batchnorm_after_it():
    rng = np.random.default_rng(7)
    model = tiny(CONV_BN, seed=3, values={"V": rng.uniform(0.5, 2, 6), "B1": rng.normal(1, 1, 8)})
    cal = feeds(4, (2, 3, 8, 8))
    result = prune(model, 0.25, criterion="wanda", compensate="bias", data=[cal], price=False, validate=False)
    r = hidden(model, cal)
    W2 = init(model, "W2").astype(np.float64)
    # wanda: each channel's RMS x the sum of |W2[:, c]|
    score = np.sqrt((r**2).mean(axis=(0, 2, 3))) * np.abs(W2).sum(axis=(0, 2, 3))
    gone = np.argsort(score)[:2]
    assert sorted(np.flatnonzero(result.masks["W2"].max(axis=(0, 2, 3)) == 0)) == sorted(gone)
    # the reference by its definition: zeroed, and T += gamma / sqrt(var + eps) x what they added
    ref = onnx.ModelProto()
    ref.CopyFrom(model)
    values = {t.name: numpy_helper.to_array(t).copy() for t in ref.graph.initializer}
    delta = np.einsum("c,ocij->o", r.mean(axis=(0, 2, 3))[gone], W2[:, gone])
    values["T"] = (values["T"] + values["S"] / np.sqrt(values["V"] + 1e-5) * delta).astype(np.float32)
    values["W1"][gone] = 0
    values["B1"][gone] = 0
    values["W2"][:, gone] = 0
    for t in ref.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
    assert error_against(ref, result.model) <= 1e-5
    assert result.model.graph.initializer  # and it is smaller: 2 of 8 channels gone
    assert result.shrink.after.params == result.original.params - 2 * (27 + 1 + 6 * 9)


class Net(nn.Module):
    """conv -> BN -> ReLU, conv (no bias) -> BN -> ReLU, mean, Linear -> GELU -> Linear."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc2(torch.nn.functional.gelu(self.fc1(x.mean((2, 3)))))


def trained_like(seed: int) -> Net:
    from models.zoo import randomize

    net = randomize(Net(), seed=seed).eval()
    with torch.no_grad():  # positive running variances, biases that move the means
        for bn in (net.bn1, net.bn2):
            bn.running_var.uniform_(0.5, 2.0)
    return net


@pytest.mark.parametrize("mode", ["bias", "refit", "refit by blocks"])
def test_masks_and_weights_out_applied_in_torch_make_the_pruned_model(tmp_path, mode, monkeypatch):
    from models.zoo import export

    if mode == "refit by blocks":  # a convolution's output channels two at a time
        monkeypatch.setattr("onnxshrink.prune.compensate.REFIT_BLOCK_BYTES", 2 * 8 * 16 * 9)
        mode = "refit"

    net = trained_like(3)
    shape = (4, 3, 8, 8)
    export(net, tmp_path / "net.onnx", shape, optimize=False)  # BatchNorms kept: named by torch
    cal = feeds(6, shape)
    result = prune(
        str(tmp_path / "net.onnx"), 0.4, criterion="fluctuation", compensate=mode, data=[cal],
        masks_out=tmp_path / "masks.pt", weights_out=tmp_path / "weights.pt", price=False, validate=False,
    )  # fmt: skip
    masks = torch.load(tmp_path / "masks.pt")
    weights = torch.load(tmp_path / "weights.pt")
    state = net.state_dict()
    assert set(weights) <= set(state), sorted(set(weights) - set(state))  # framework names only
    assert {"bn2.bias", "fc1.bias", "fc2.bias"} <= set(weights)  # the consumers' biases
    if mode == "refit":
        assert {"conv2.weight", "fc1.weight", "fc2.weight"} <= set(weights)
    assert not torch.equal(weights["fc2.bias"], state["fc2.bias"])
    state.update(weights)
    for name, m in masks.items():
        if not name.startswith("onnx/"):  # ONNX-only tensors (a strict loader drops them)
            state[name] = state[name] * m
    net.load_state_dict(state)
    export(net, tmp_path / "again.onnx", shape, optimize=False)
    # the framework's model, masked and updated, is the pruned model (within float rounding)
    assert error_against(tmp_path / "again.onnx", result.model, draws=2) <= 1e-5
    assert result.shrink.after.params < result.original.params


MLP2 = """
g (float[16,12] x, float[12,32] W1, float[32] B1, float[32,24] W2, float[24] B2, float[24,6] W3,
   float[6] B3) => (float[16,6] y) {
  h1 = MatMul(x, W1)
  g1 = Add(h1, B1)
  a = Relu(g1)
  h2 = MatMul(a, W2)
  g2 = Add(h2, B2)
  b = Relu(g2)
  h3 = MatMul(b, W3)
  y = Add(h3, B3)
}
"""


def l1_order(model: onnx.ModelProto, w_out: str, b_out: str, w_in: str) -> np.ndarray:
    """Torch-Pruning's group L1: the mean over the group's weights of each one's sum |w|."""
    wo, wi = init(model, w_out), init(model, w_in)
    score = (np.abs(wo).sum(axis=0) + np.abs(wi).sum(axis=1)) / 2
    return np.argsort(score, kind="stable")


def test_sensitivity_curves_are_measured_drawn_and_allocated(tmp_path):
    model = tiny(MLP2, seed=2, values={"B1": np.full(32, 0.3), "B2": np.full(24, 0.3)})
    cal = feeds(8, (16, 12))
    page = tmp_path / "sens.html"
    result = prune(model, 0.3, allocation="sensitivity", sensitivity=page, data=[cal], price=False, validate=False)
    fams = result.families
    assert [f.kind for f in fams] == ["neuron", "neuron"] and sorted(len(f.order) for f in fams) == [24, 32]
    # one point checked here: the first layer alone, its k least important (L1) neurons zeroed
    first = next(f for f in fams if len(f.order) == 32)
    k = first.counts[0]
    gone = l1_order(model, "W1", "B1", "W2")[:k]
    zeroed = onnx.ModelProto()
    zeroed.CopyFrom(model)
    for t in zeroed.graph.initializer:
        v = numpy_helper.to_array(t).copy()
        if t.name in ("W1", "B1"):
            v[..., gone] = 0
        elif t.name == "W2":
            v[gone] = 0
        t.CopyFrom(numpy_helper.from_array(v, t.name))
    (y0,), (y,) = ort_run(model, cal), ort_run(zeroed, cal)
    assert first.deviation[0] == pytest.approx(np.linalg.norm(y - y0) / np.linalg.norm(y0), rel=1e-4)
    # the picture: it parses, and holds one curve per family, one point per measured ratio and 0
    text = page.read_text()
    svg = ET.fromstring(re.search(r"<svg.*?</svg>", text, re.S).group(0))
    curves = [e for e in svg.iter() if e.tag.endswith("polyline") and e.get("class") == "curve"]
    assert len(curves) == len(fams)
    for c, f in zip(curves, fams, strict=True):
        assert c.get("data-family") == f"{f.name} ({f.kind})"
        assert len(c.get("points").split()) == len(f.counts) + 1
    data = json.loads(re.search(r'id="sensitivity-data">(.*?)</script>', text, re.S).group(1))
    assert [f["deviation"] for f in data["families"]] == [f.deviation for f in fams]
    # the allocation removes the parameters uniform 0.3 removes (22 of 32 and 16 of 24 neurons
    # kept: 44.3%), to within 2 points, where the curves are flattest
    def count(k1: int, k2: int) -> int:  # W1, B1; W2, B2; W3, B3
        return 12 * k1 + k1 + k1 * k2 + k2 + k2 * 6 + 6

    kept = {p.total: p.total - len(p.removed) for p in result.plans if p.total}
    assert abs(count(kept[32], kept[24]) - count(22, 16)) <= 0.02 * count(32, 24)


WIDE_CONV = """
g (float[1,8,10,10] x, float[32,8,3,3] W1, float[32] B1, float[24,32,3,3] W2, float[24] B2,
   float[10,24,1,1] W3, float[10] B3) => (float[1,10,10,10] y) {
  h1 = Conv<pads=[1,1,1,1]>(x, W1, B1)
  a = Relu(h1)
  h2 = Conv<pads=[1,1,1,1]>(a, W2, B2)
  b = Relu(h2)
  y = Conv(b, W3, B3)
}
"""


@pytest.mark.parametrize("kind", ["macs", "params"])
def test_a_target_in_macs_or_parameters_is_met(kind):
    model = tiny(WIDE_CONV, seed=4)
    result = prune(model, **{kind: 0.5}, price=False, validate=False)
    # counted here from the pruned model's weights: MACs of a conv are H x W x its weight's size
    weights = {t.name: tuple(t.dims) for t in result.model.graph.initializer}
    convs = [n for n in result.model.graph.node if n.op_type == "Conv"]
    macs = sum(100 * int(np.prod(weights[n.input[1]])) for n in convs)
    params = sum(int(np.prod(d)) for d in weights.values())
    before = {"macs": 100 * (32 * 8 * 9 + 24 * 32 * 9 + 10 * 24), "params": result.original.params}[kind]
    after = {"macs": macs, "params": params}[kind]
    # one channel of a layer is 1.6% of the MACs at most here: within a channel of the goal
    assert abs(after / before - 0.5) <= 0.02
    assert result.reached == pytest.approx(after / before)


def test_the_command_line_refuses_what_cannot_mean_anything(tmp_path):
    onnx.save(mlp(), tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", **feeds(1))
    cases = [
        (["--prune", "0.3", "--compensate", "bias"], "--compensate bias read(s) the model's activations"),
        (["--prune", "0.3", "--prune-to-macs", "0.5"], "--prune and --prune-to-macs: give one target"),
        (["--prune-to-latency", "1.5"], "--prune-to-latency 1.5: give the fraction"),
        (["--prune", "0.3", "--inputs", "cal.npz", "--weights-out", "w.pt"], "--weights-out w.pt: it writes"),
        (["--held-out", "cal.npz"], "--held-out cal.npz: it goes with --prune"),
    ]
    for args, message in cases:
        p = cli("m.onnx", *args, "-o", "out.onnx", cwd=tmp_path)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
        assert message in p.stderr, (args, p.stderr)
        assert not (tmp_path / "out.onnx").exists()


def test_the_command_line_prints_the_price_and_writes_the_weights(tmp_path):
    model = mlp()
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", **feeds(1))
    np.savez(tmp_path / "held.npz", **feeds(2))
    p = cli(
        "m.onnx", "--prune", "0.25", "--criterion", "fluctuation", "--compensate", "bias",
        "--inputs", "cal.npz", "--held-out", "held.npz", "-o", "out.onnx",
        "--weights-out", "w.npz", "--report", "r.json", cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    price = report["price"]
    (y0,) = ort_run(model, feeds(2))
    (y,) = ort_run(onnx.load(tmp_path / "out.onnx"), feeds(2))
    rel = np.linalg.norm(y - y0) / np.linalg.norm(y0)
    assert price["outputs"][0]["rel_error"] == pytest.approx(rel, rel=1e-4)
    assert f"relative error {price['outputs'][0]['rel_error']:.4g}" in p.stdout
    assert p.stdout.index("price on the held-out inputs (held.npz)") < p.stdout.index("saved ")
    with np.load(tmp_path / "w.npz") as w:  # an ONNX-text model has no framework names
        assert sorted(w.files) == ["B2"]
        np.testing.assert_array_equal(w["B2"], init(onnx.load(tmp_path / "out.onnx"), "B2"))
    assert report["compensate"] == "bias" and report["weights_out"] == ["B2"]


def test_the_kernel_advice_follows_a_slower_prune_and_never_an_unchanged_model():
    from onnxshrink.prune.price import Price

    advice = "prune again with --round-to 16"
    slower = Price("inputs", latency_before_ms=10.0, latency_after_ms=11.9, macs_ratio=0.5)
    unchanged = Price("inputs", latency_before_ms=10.0, latency_after_ms=11.9, macs_ratio=1.0)
    faster = Price("inputs", latency_before_ms=10.0, latency_after_ms=6.0, macs_ratio=0.5)
    assert [any(advice in line for line in p.lines()) for p in (slower, unchanged, faster)] == [True, False, False]


@pytest.mark.parametrize("n", [40, 300])
def test_the_refit_regression_is_the_ridge_formula_with_fewer_or_more_samples_than_channels(n):
    from onnxshrink.prune.compensate import _regress

    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 6)) @ rng.standard_normal((6, 120)) + 0.1 * rng.standard_normal((n, 120))
    removed, kept = np.arange(0, 120, 7), np.setdiff1d(np.arange(120), np.arange(0, 120, 7))
    mean = x.mean(axis=0)
    for ridge in (1.0, 0.01):
        fit, const = _regress(x, mean, kept, removed, ridge)
        xc = x - mean
        gram = xc[:, kept].T @ xc[:, kept] / n  # the k x k system, as written in the docs
        lam = ridge * np.mean(np.diag(gram))
        want = np.linalg.solve(gram + lam * np.eye(len(kept)), xc[:, kept].T @ xc[:, removed] / n)
        assert np.abs(fit - want).max() <= 1e-9 * np.abs(want).max()
        assert np.abs(const - (mean[removed] - mean[kept] @ want)).max() <= 1e-9 * np.abs(mean).max()


def test_a_refit_fit_goes_after_the_last_consumer_of_its_activation(tmp_path, monkeypatch):
    """One fit per activation and removed set (q, k and v share theirs), dropped once the last
    consumer of that activation is refit: never every layer's fits at once (TinyLlama's
    down_proj fits alone were 1.4 GiB, held to the end)."""
    from models.llama import LlamaConfig, build
    from onnxshrink.prune import compensate

    path = tmp_path / "llama.onnx"
    build(LlamaConfig.preset("tiny", seed=21), path)
    rng = np.random.default_rng(5)
    feeds = [{"input_ids": rng.integers(0, 128, (1, 16)).astype(np.int64)} for _ in range(2)]
    held: list[int] = []  # the fits held as each consumer is refit
    seen: set[str] = set()  # the activations fit
    refit = compensate._compensate

    def counted(c, ms, *args):
        held.append(len(args[-1]))
        seen.add(compensate._activation(ms))
        return refit(c, ms, *args)

    monkeypatch.setattr(compensate, "_compensate", counted)
    result = prune(path, 0.25, criterion="fluctuation", compensate="refit", data=feeds)
    assert result.shrink.passed and len(seen) >= 4
    assert len(held) > len(seen) and max(held) <= 1
