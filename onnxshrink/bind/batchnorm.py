"""Masks on a BatchNorm that the exporter folded into the conv before it.

The fused conv computes W' = W * s and b' = (b - mean) * s + beta, with s = gamma / sqrt(var +
eps) per output channel. A channel whose masked gamma and beta are both zero is zero in the
masked model: W' and b' are masked there, whatever its statistics (masks on running_mean and
running_var of such a channel are redundant). Any other masked parameter changes W' or b' to
values that only the original weights can give (`--weights`): they are computed here and
replace those channels' fused values.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from onnxshrink.bind.binding import Binding
from onnxshrink.bind.graph import ModelIndex, Site, is_fused_batchnorm
from onnxshrink.masks import value_shape

PARAMS = ("weight", "bias", "running_mean", "running_var")
DEFAULT_EPS = 1e-5  # torch's BatchNorm default; inferred from the fused values when they allow

NEEDS_VALUES = (
    "the BatchNorm is folded into the conv before it, and its masks change the fused weights in "
    "a way only the original weights give: pass them (--weights state_dict.pt), mask its weight "
    "and bias together (a channel whose scale and shift are both zero is zero), or export with "
    "optimize=False so that the BatchNorm stays a node"
)


def fused_conv(index: ModelIndex, values: Mapping[str, np.ndarray], module: str) -> tuple[int, str | None] | str | None:
    """(node index, name of the conv's original weight in `values`) of the conv this
    BatchNorm was folded into: recorded by the dynamo exporter's optimizer on the node, or found
    by value (the fused weights are a conv's scaled per channel by s = gamma / sqrt(var + eps),
    the fused bias is (b - mean) * s + beta). A hint when the values fit several convs (a fresh
    BatchNorm's parameters are the same as every other's of its width), None when none."""
    for k in index.scopes.get(module, []):
        n = index.nodes[k]
        if is_fused_batchnorm(n) and _conv_weight(index, k) is not None:
            w = index.resolve(n.input[1])
            return k, (w if w in values else None)
    g, v = values.get(f"{module}.weight"), values.get(f"{module}.running_var")
    beta, mean = values.get(f"{module}.bias"), values.get(f"{module}.running_mean")
    if g is None or v is None or beta is None or mean is None:
        return None
    scale = g.astype(np.float64).reshape(-1) / np.sqrt(v.astype(np.float64).reshape(-1) + DEFAULT_EPS)
    candidates = []  # (node index, fused weight, fused bias) of the convs this BatchNorm may be in
    for k, n in enumerate(index.nodes):
        w = _conv_weight(index, k)
        if w is None or index.shapes[w][0] != scale.shape[0]:
            continue
        b = index.resolve(n.input[2]) if len(n.input) > 2 and n.input[2] else None
        fused_b = index.array(b).astype(np.float64) if b else np.zeros(scale.shape[0])
        candidates.append((k, index.array(w), fused_b))
    hits: list[tuple[int, int, str]] = []
    for order, name in enumerate(values):  # each original read once (a lazy file re-reads it)
        shape = value_shape(values, name)
        if not any(shape == fused.shape for _, fused, _ in candidates):
            continue  # not read
        orig = values[name]
        conv_b = values.get(name[: -len("weight")] + "bias") if name.endswith("weight") else None
        b0 = 0.0 if conv_b is None else conv_b.astype(np.float64).reshape(-1)
        want = (b0 - mean.astype(np.float64).reshape(-1)) * scale + beta.reshape(-1)
        scaled = orig * scale.reshape((-1,) + (1,) * (orig.ndim - 1))
        for k, fused, fused_b in candidates:
            if fused.shape != shape or not np.allclose(scaled, fused, rtol=1e-4, atol=1e-6):
                continue
            if np.allclose(fused_b, want, rtol=1e-4, atol=1e-6):
                hits.append((k, order, name))
    found = [(k, name) for k, _, name in sorted(hits)]  # by conv, then the file's order
    if len({k for k, _ in found}) > 1:
        convs = ", ".join(sorted({index.nodes[k].name or f"#{k}" for k, _ in found})[:4])
        return (
            f"its values fit the folded weights of {len(found)} convs ({convs}): several "
            "BatchNorms have equal parameters (e.g. freshly initialized ones), and this export "
            "does not record which conv each was folded into. Export with the dynamo exporter "
            "(torch.onnx.export's default records the fold), or with optimize=False"
        )
    return found[0] if found else None


FUSED_SHIFT = (
    "the exporter folded a BatchNorm into the conv reading it, so it holds the fused shift "
    "(b - mean) * s + beta, which masking b does not zero: if the model was exported masked, omit "
    "the masks file (the zeros in the model are the masks); else apply the masks to the PyTorch "
    "module before export (onnxshrink.export_and_shrink does), or export with optimize=False so "
    "that the BatchNorm stays a node"
)


def mask_commutes(index: ModelIndex, site: Site) -> bool:
    """Does masking what `site` reads mask the parameter it stands for? Yes, unless the node is a
    conv the exporter fused with the BatchNorm after it and the input is not its weight: the
    fused weight is the conv's scaled per output channel (a mask commutes with that), the fused
    bias is (b - mean) * s + beta (not zero where b is)."""
    if not is_fused_batchnorm(index.node(site)):
        return True
    return site.input == 1 and _conv_weight(index, site.node) is not None


def _conv_weight(index: ModelIndex, k: int) -> str | None:
    """The initializer node k reads as a conv weight with output channels first (what a
    BatchNorm after it folds into), if it is such a conv."""
    n = index.nodes[k]
    w = index.resolve(n.input[1]) if len(n.input) > 1 else None
    if w is None:
        return None
    axes = index.axes(Site(k, 1))
    return w if axes is not None and axes.family == "conv" and axes.out == 0 else None


def bind_folded(
    index: ModelIndex, values: Mapping[str, np.ndarray], module: str, masks: dict[str, np.ndarray]
) -> list[Binding] | str | None:
    """Bindings for the masks of a folded BatchNorm `module`; a hint when they need values the
    user did not give; None when the BatchNorm was not folded into a conv here."""
    found = fused_conv(index, values, module)
    if found is None or isinstance(found, str):
        return found
    k, w_name = found
    conv = index.nodes[k]
    w_init = index.resolve(conv.input[1])
    assert w_init is not None  # fused_conv found a conv weight
    b_init = index.resolve(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else None
    fused_w = index.array(w_init)
    n = fused_w.shape[0]
    zero = {}
    for p in PARAMS:
        m = masks.get(f"{module}.{p}")
        if m is not None and m.size != n:
            return f"its masks must have one flag per channel ({n}), '{module}.{p}' has {m.size}"
        zero[p] = np.zeros(n, bool) if m is None else np.asarray(m).reshape(-1) == 0
    orig = {p: values.get(f"{module}.{p}") for p in PARAMS}
    w_orig = values.get(w_name) if w_name else None
    known = all(v is not None for v in orig.values()) and w_orig is not None
    touched = zero["weight"] | zero["bias"] | zero["running_mean"] | zero["running_var"]
    if known:
        g, beta, mean, var = (
            np.where(zero[p], 0.0, np.asarray(orig[p], dtype=np.float64).reshape(-1)) for p in PARAMS
        )
        dead = touched & (g == 0) & (beta == 0)
    else:
        dead = zero["weight"] & zero["bias"]
    rest = touched & ~dead
    if rest.any() and not known:
        return NEEDS_VALUES
    keep = ~dead
    w_rows = b_rows = None
    if rest.any():  # new fused values for these channels, from the masked parameters
        assert w_name is not None and w_orig is not None  # known
        eps = _eps(fused_w, w_orig, orig, ~touched)
        s = g / np.sqrt(var + eps)
        idx = np.flatnonzero(rest)
        conv_b = values.get(w_name[: -len("weight")] + "bias") if w_name.endswith("weight") else None
        b0 = np.zeros(n) if conv_b is None else conv_b.astype(np.float64).reshape(-1)
        w_rows = (idx, w_orig.astype(np.float64)[idx] * s[idx].reshape((-1,) + (1,) * (fused_w.ndim - 1)))
        b_rows = (idx, (b0[idx] - mean[idx]) * s[idx] + beta[idx])
    how = "folded BatchNorm"
    out = [
        Binding(f"{module}.weight", w_init, _rows(keep, fused_w.shape), _own(index, w_init, (Site(k, 1),)), how, w_rows)
    ]
    if b_init is not None:
        out.append(
            Binding(f"{module}.bias", b_init, keep.astype(np.uint8), _own(index, b_init, (Site(k, 2),)), how, b_rows)
        )
    elif b_rows is not None and np.any(b_rows[1]):  # the exporter dropped a zero bias: add one
        out.append(
            Binding(f"{module}.bias", f"{w_init}_bias", keep.astype(np.uint8), None, how, b_rows, attach=Site(k, 2))
        )
    return out


def _rows(keep: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.broadcast_to(keep.astype(np.uint8).reshape((-1,) + (1,) * (len(shape) - 1)), shape)


def _own(index: ModelIndex, init: str, sites: tuple[Site, ...]) -> tuple[Site, ...] | None:
    """`sites`, or None when they are all the initializer's readers."""
    return None if set(index.sites[init]) <= set(sites) else sites


def _eps(fused: np.ndarray, w: np.ndarray, orig: Mapping[str, np.ndarray | None], untouched: np.ndarray) -> float:
    """The BatchNorm's epsilon as the fold used it: from s = W'/W = gamma / sqrt(var + eps) on
    channels the masks leave alone (torch's default when no channel tells)."""
    gain, running_var = orig["weight"], orig["running_var"]
    assert gain is not None and running_var is not None  # the caller's `known`
    g = gain.astype(np.float64).reshape(-1)
    var = running_var.astype(np.float64).reshape(-1)
    w2 = w.reshape(w.shape[0], -1).astype(np.float64)
    f2 = fused.reshape(fused.shape[0], -1).astype(np.float64)
    found = []
    for c in np.flatnonzero(untouched):
        j = int(np.argmax(np.abs(w2[c])))
        if w2[c, j] == 0 or f2[c, j] == 0 or g[c] == 0:
            continue
        found.append((g[c] * w2[c, j] / f2[c, j]) ** 2 - var[c])
    eps = float(np.median(found)) if found else DEFAULT_EPS
    return eps if eps > 0 else DEFAULT_EPS
