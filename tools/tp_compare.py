"""onnxshrink --prune 0.5 (L1) against Torch-Pruning's MagnitudePruner on torchvision models.

Needs torchvision and torch-pruning, which cannot live beside the project's torch: use a
separate environment, e.g.

    python3 -m venv .venv-tv && . .venv-tv/bin/activate
    pip install torch==2.14.1 torchvision==0.29.1 torch-pruning onnx onnxscript onnxruntime onnx-graphsurgeon
    pip install --no-deps -e .
    python tools/tp_compare.py [--models resnet50 mobilenet_v2]

For each model (weights randomized): Torch-Pruning's parameter count at ratio 0.5 (group L1,
p=1, its default "mean" group reduction, the classifier ignored), onnxshrink's on the default
export, and the share of Torch-Pruning's removed channels onnxshrink removed too on an export
that keeps BatchNorm as a node (optimize=False: the same weights, so the same criterion).

`--masked convnext_tiny` instead zeroes Torch-Pruning's own groups at 0.5 (every member: conv
and linear slices, LayerNorm weights and biases, ConvNeXt's layer scales) in the model, exports
the masked model and shrinks it: its parameters against Torch-Pruning's pruned model, and the
shrunk model against the masked export in onnxruntime. Torch-Pruning's model is not the masked
one (its LayerNorms average over fewer channels): the error of its export against the masked
export is printed too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
import warnings
from pathlib import Path

import torch


def randomized(name: str):
    import torchvision

    model = getattr(torchvision.models, name)(weights=None).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim == 1 else 0.05) + (1.0 if p.ndim == 1 else 0))
        for n, b in model.named_buffers():
            if n.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)
            elif n.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def export(model, path: Path, **kw) -> None:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 3, 224, 224),), str(path), **kw)


def torch_pruning(model):
    import torch_pruning as tp

    classifier = model.fc if hasattr(model, "fc") else model.classifier[-1]
    pruner = tp.pruner.MagnitudePruner(
        model,
        torch.randn(1, 3, 224, 224),
        importance=tp.importance.MagnitudeImportance(p=1),
        pruning_ratio=0.5,
        ignored_layers=[classifier],
    )
    removed: set[tuple[str, int]] = set()
    names = {m: n for n, m in model.named_modules()}
    for group in pruner.step(interactive=True):
        for dep, idxs in group:
            if pruner.DG.is_out_channel_pruning_fn(dep.handler) and isinstance(dep.target.module, torch.nn.Conv2d):
                removed |= {(names[dep.target.module] + ".weight", int(i)) for i in idxs}
        group.prune()
    return model, removed


def removed_channels(result) -> set[tuple[str, int]]:
    """(conv weight name, output channel) of every conv channel a prune removed."""
    return {
        (m.params[0].name, int(i))
        for k in result.removed()
        for m in result.groups.groups[k].members
        if m.side == "out" and m.op == "Conv" and m.params
        for i in m.indices
    }


def prune_as_torch_pruning(path: Path, model):
    """onnxshrink's L1 prune with the importance Torch-Pruning 1.6 computes: its
    GroupMagnitudeImportance skips a depthwise conv (the conv's pruning function there is
    DepthwiseConvPruner's, not one of those it weighs), so the depthwise weights do not count.
    onnxshrink counts them; this shows that the choices differ by that alone."""

    import onnxshrink.prune.importance as importance
    from onnxshrink.prune import prune

    depthwise = {
        f"{n}.weight"
        for n, mod in model.named_modules()
        if isinstance(mod, torch.nn.Conv2d) and mod.groups > 1
    }
    weighed = importance.weighed

    def without_depthwise(g):
        return [
            m
            for m in g.members
            if m.role == "weight" and not (m.params and m.params[0].name in depthwise)
        ]

    importance.weighed = without_depthwise
    try:
        return prune(path, 0.5, validate=False)
    finally:
        importance.weighed = weighed


def layer_scales(model) -> list:
    """ConvNeXt's layer scales ([C, 1, 1] parameters of its blocks), pruned along dim 0."""
    return [(m.layer_scale, 0) for m in model.modules() if hasattr(m, "layer_scale")]


def torch_pruning_groups(model, ratio: float = 0.5):
    """Torch-Pruning's MagnitudePruner (L1) at `ratio`: the model it prunes, and every member of
    every group it removed as (parameter name, axis, indices)."""
    import torch_pruning as tp

    classifier = model.fc if hasattr(model, "fc") else model.classifier[-1]
    pruner = tp.pruner.MagnitudePruner(
        model,
        torch.randn(1, 3, 224, 224),
        importance=tp.importance.MagnitudeImportance(p=1),
        pruning_ratio=ratio,
        ignored_layers=[classifier],
        unwrapped_parameters=layer_scales(model),
    )
    names = {m: n for n, m in model.named_modules()}
    params = {id(p): n for n, p in model.named_parameters()}
    members: list[tuple[str, int, list[int]]] = []
    for group in pruner.step(interactive=True):
        for dep, idxs in group:
            target, idxs = dep.target.module, [int(i) for i in idxs]
            out = pruner.DG.is_out_channel_pruning_fn(dep.handler)
            if isinstance(target, torch.nn.Parameter):
                members.append((params[id(target)], 0, idxs))
            elif isinstance(target, torch.nn.LayerNorm):
                members += [(f"{names[target]}.{k}", 0, idxs) for k in ("weight", "bias") if getattr(target, k) is not None]
            elif isinstance(target, torch.nn.Conv2d | torch.nn.Linear):
                axis = 0 if out or (isinstance(target, torch.nn.Conv2d) and target.groups > 1) else 1
                members.append((f"{names[target]}.weight", axis, idxs))
                if axis == 0 and target.bias is not None:
                    members.append((f"{names[target]}.bias", 0, idxs))
            elif any(True for _ in target.parameters(recurse=False)):
                raise SystemExit(f"no zeroing rule for {type(target).__name__} {names.get(target)}")
        group.prune()
    return model, members


def masked_check(name: str) -> None:
    """Torch-Pruning's groups zeroed in the model (norm weights included), shrunk exactly."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from onnxshrink import shrink
    from onnxshrink.report import model_stats

    tp_model, members = torch_pruning_groups(randomized(name))
    masked = randomized(name)
    state = dict(masked.named_parameters())
    with torch.no_grad():
        for pname, axis, idxs in members:
            state[pname].index_fill_(axis, torch.tensor(idxs), 0.0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {k: Path(tmp) / f"{k}.onnx" for k in ("masked", "tp")}
        export(masked, paths["masked"])
        export(tp_model, paths["tp"])
        t = time.perf_counter()
        r = shrink(paths["masked"], validate=False)
        took = time.perf_counter() - t
        tp_params = model_stats(onnx.load(paths["tp"])).params
        sessions = {}
        for k, m in (("masked", str(paths["masked"])), ("shrunk", r.model.SerializeToString()), ("tp", str(paths["tp"]))):
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            sessions[k] = ort.InferenceSession(m, so, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        err = {"shrunk": 0.0, "tp": 0.0}
        for _ in range(3):
            x = {"x": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)}
            feed = {sessions["masked"].get_inputs()[0].name: x["x"]}
            ref = sessions["masked"].run(None, feed)[0]
            for k in err:
                out = sessions[k].run(None, {sessions[k].get_inputs()[0].name: x["x"]})[0]
                err[k] = max(err[k], float(np.abs(out - ref).max() / np.abs(ref).max()))
        forms = sorted({f.into for f in r.folds if "normalization" in f.into})
        print(
            f"{name}: Torch-Pruning's groups at 0.5 zeroed ({len(members)} member slices): "
            f"parameters {r.before.params} -> onnxshrink {r.after.params} "
            f"({took:.1f} s), Torch-Pruning {tp_params}: "
            f"{100 * (r.after.params - tp_params) / tp_params:+.2f}%; max rel error against the "
            f"masked model: onnxshrink {err['shrunk']:.1e}, Torch-Pruning's model {err['tp']:.2f}; "
            f"kept zeroed slices {sum(g.count for g in r.kept_zeroed)}; norms: {'; '.join(forms)}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["resnet50", "mobilenet_v2"])
    p.add_argument("--masked", nargs="+", default=[], help="zero Torch-Pruning's groups in these models and shrink (e.g. convnext_tiny)")
    args = p.parse_args()
    for name in args.masked:
        masked_check(name)
    if args.masked:
        return
    from onnxshrink.prune import prune
    from onnxshrink.report import model_stats

    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            full, plain = Path(tmp) / "full.onnx", Path(tmp) / "plain.onnx"
            export(randomized(name), full)
            export(randomized(name), plain, optimize=False)
            t = time.perf_counter()
            tp_model, tp_removed = torch_pruning(randomized(name))
            tp_time = time.perf_counter() - t
            tp_path = Path(tmp) / "tp.onnx"
            export(tp_model, tp_path)
            import onnx

            tp_params = model_stats(onnx.load(tp_path)).params
            t = time.perf_counter()
            ours = prune(full, 0.5, draws=1)
            ours_time = time.perf_counter() - t
            same = prune(plain, 0.5, validate=False)
            ours_removed = removed_channels(same)
            before = ours.original.params
            after = ours.shrink.after.params
            agree = len(tp_removed & ours_removed) / max(len(tp_removed), 1)
            as_tp = removed_channels(prune_as_torch_pruning(plain, randomized(name)))
            agree_as_tp = len(tp_removed & as_tp) / max(len(tp_removed), 1)
            print(
                f"{name}: parameters {before / 1e6:.2f} M -> onnxshrink {after / 1e6:.3f} M "
                f"({ours_time:.1f} s, proof {'PASSED' if ours.shrink.passed else 'FAILED'}, "
                f"max rel error {ours.shrink.validation.outputs[0].max_rel_error:.1e}), "
                f"Torch-Pruning {tp_params / 1e6:.3f} M ({tp_time:.1f} s): "
                f"{100 * (after - tp_params) / tp_params:+.2f}%; "
                f"conv channels removed by both: {100 * agree:.1f}% of Torch-Pruning's "
                f"{len(tp_removed)} (onnxshrink {len(ours_removed)}); "
                f"{100 * agree_as_tp:.1f}% with depthwise weights left out of the importance "
                "as Torch-Pruning does"
            )


if __name__ == "__main__":
    main()
