"""Width and depth of normalized HuggingFace networks: zeroed, shrunk, checked against the native model.

Needs `transformers` (not a project dependency). Three checks, each model exported with torch's
dynamo exporter (dynamic batch and sequence), shrunk with validation off and compared here, with
onnxruntime, with the masked export itself:

- `width`: LLaMA (RMSNorm, decomposed by the exporter), BERT and ViT (LayerNorm, exported as
  LayerNormalization), small configs with random parameters, with a quarter of the hidden
  channels zeroed everywhere they live (embedding columns, every write into the residual
  stream and its bias, every norm's scale and bias, every read of the stream, the classifier's
  input). The attention keeps its width (4 heads of 16, as LLaMA's head_dim says): the shrunk
  model must have the parameters of the same class built with the smaller hidden size (BERT
  ties its head size to hidden / heads: its attention modules are built at 4 x 16).
- `depth`: LLaMA with 8 blocks, two of them with o_proj and down_proj zeroed: those blocks must
  be gone (nodes and parameters of the natively built 6-block model) and run as fast.
- `prune`: all-MiniLM-L6-v2 (trained weights), `--prune` with heads and FFN neurons only, and
  with hidden width and blocks too, at the same parameter counts: held-out cosine of the
  mean-pooled sentence embeddings (see `prune_table`).

    python tools/norm_check.py width
    python tools/norm_check.py depth
    python tools/norm_check.py prune --minilm PATH   # the model folder (config.json, weights)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_check import silenced  # noqa: E402  (tools/)

from models.zoo import randomize  # noqa: E402  (the repository root)

D, HEADS, HD, F = 64, 4, 16, 128
CUT = list(range(0, D, 4))  # the hidden channels zeroed: a quarter


class Logits(torch.nn.Module):
    """The model's logits alone, from keyword inputs given positionally."""

    def __init__(self, model: torch.nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        return self.model(**dict(zip(self.names, args, strict=True))).logits


def export(model: torch.nn.Module, inputs: dict[str, torch.Tensor], path: Path) -> None:
    names = list(inputs)
    axes = {0: "batch"} if names == ["pixel_values"] else {0: "batch", 1: "seq"}
    dims = {"batch": torch.export.Dim("batch", min=1), "seq": torch.export.Dim("seq", min=2)}
    shapes = {n: {a: dims[d] for a, d in axes.items()} for n in names}
    with silenced():
        torch.onnx.export(
            Logits(model.eval(), names), tuple(inputs.values()), str(path),
            input_names=names, dynamic_shapes=(tuple(shapes.values()),),
        )  # fmt: skip


@torch.no_grad()
def zero_rows(linear, rows) -> None:
    linear.weight[rows] = 0
    if getattr(linear, "bias", None) is not None:
        linear.bias[rows] = 0


@torch.no_grad()
def zero_cols(linear, cols) -> None:
    linear.weight[:, cols] = 0


@torch.no_grad()
def zero_norm(norm, cols) -> None:
    norm.weight[cols] = 0
    if getattr(norm, "bias", None) is not None:
        norm.bias[cols] = 0


# ---------------------------------------------------------------------- the models
def llama(t, hidden=D, layers=2, ffn=F):
    cfg = t.LlamaConfig(
        vocab_size=100, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=2, head_dim=HD, intermediate_size=ffn, max_position_embeddings=256,
        use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    return randomize(t.LlamaForCausalLM(cfg)), {"input_ids": torch.randint(0, 100, (2, 8))}


@torch.no_grad()
def llama_width(m) -> None:
    m.model.embed_tokens.weight[:, CUT] = 0
    for layer in m.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, mlp.gate_proj, mlp.up_proj):
            zero_cols(lin, CUT)
        for lin in (a.o_proj, mlp.down_proj):
            zero_rows(lin, CUT)
        zero_norm(layer.input_layernorm, CUT)
        zero_norm(layer.post_attention_layernorm, CUT)
    zero_norm(m.model.norm, CUT)
    zero_cols(m.lm_head, CUT)


def bert(t, hidden=D):
    cfg = t.BertConfig(
        vocab_size=100, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=HEADS,
        intermediate_size=F, max_position_embeddings=64, num_labels=3, attn_implementation="eager",
    )  # fmt: skip
    m = t.BertForSequenceClassification(cfg)
    if hidden != D:  # BERT's head size is hidden / heads: keep the attention at 4 x 16
        for layer in m.bert.encoder.layer:
            s = layer.attention.self
            s.attention_head_size, s.all_head_size, s.scaling = HD, HEADS * HD, HD**-0.5
            s.query, s.key, s.value = (torch.nn.Linear(hidden, HEADS * HD) for _ in range(3))
            layer.attention.output.dense = torch.nn.Linear(HEADS * HD, hidden)
    ids = torch.randint(0, 100, (2, 8))
    return randomize(m), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@torch.no_grad()
def bert_width(m) -> None:
    e = m.bert.embeddings
    for table in (e.word_embeddings, e.position_embeddings, e.token_type_embeddings):
        table.weight[:, CUT] = 0
    zero_norm(e.LayerNorm, CUT)
    for layer in m.bert.encoder.layer:
        s = layer.attention.self
        for lin in (s.query, s.key, s.value):
            zero_cols(lin, CUT)
        zero_rows(layer.attention.output.dense, CUT)
        zero_norm(layer.attention.output.LayerNorm, CUT)
        zero_cols(layer.intermediate.dense, CUT)
        zero_rows(layer.output.dense, CUT)
        zero_norm(layer.output.LayerNorm, CUT)
    zero_cols(m.bert.pooler.dense, CUT)
    zero_rows(m.bert.pooler.dense, CUT)
    zero_cols(m.classifier, CUT)


def vit(t, hidden=D):
    cfg = t.ViTConfig(
        image_size=32, patch_size=8, hidden_size=hidden, num_hidden_layers=2,
        num_attention_heads=HEADS, head_dim=HD, intermediate_size=F, num_labels=3,
        attn_implementation="eager",
    )  # fmt: skip
    return randomize(t.ViTForImageClassification(cfg)), {"pixel_values": torch.randn(2, 3, 32, 32)}


@torch.no_grad()
def vit_width(m) -> None:
    e = m.vit.embeddings
    e.cls_token[..., CUT] = 0
    e.position_embeddings[..., CUT] = 0
    zero_rows(e.patch_embeddings.projection, CUT)
    for layer in m.vit.layers:
        a = layer.attention
        for lin in (a.q_proj, a.k_proj, a.v_proj):
            zero_cols(lin, CUT)
        zero_rows(a.o_proj, CUT)
        zero_norm(layer.layernorm_before, CUT)
        zero_norm(layer.layernorm_after, CUT)
        zero_cols(layer.mlp.fc1, CUT)
        zero_rows(layer.mlp.fc2, CUT)
    zero_norm(m.vit.layernorm, CUT)
    zero_cols(m.classifier, CUT)


WIDTH = {"llama": (llama, llama_width), "bert": (bert, bert_width), "vit": (vit, vit_width)}


# ---------------------------------------------------------------------- checks
def ort_session(model: onnx.ModelProto | Path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def error(reference: Path, shrunk: onnx.ModelProto, shapes: dict) -> float:
    """Max relative error of `shrunk` against the masked export, on random inputs, in onnxruntime."""
    from onnxshrink.proof.inputs import make_inputs, resolve_shapes

    ref = onnx.load(str(reference))
    a_sess, b_sess = ort_session(ref), ort_session(shrunk)
    worst = 0.0
    for feed in make_inputs(ref, resolve_shapes(ref, shapes), 3, seed=7):
        for a, b in zip(a_sess.run(None, feed), b_sess.run(None, feed), strict=True):
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
    return worst


def shapes_of(inputs: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in inputs.items()}


def width(names: list[str]) -> int:
    import transformers

    from onnxshrink import shrink
    from onnxshrink.report import model_stats

    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            build, cut = WIDTH[name]
            model, inputs = build(transformers)
            cut(model)
            masked = Path(tmp) / f"{name}.onnx"
            export(model, inputs, masked)
            t0 = time.perf_counter()
            r = shrink(masked, validate=False)
            took = time.perf_counter() - t0
            err = error(masked, r.model, shapes_of(inputs))
            native_model, _ = build(transformers, hidden=D - len(CUT))
            native = Path(tmp) / f"{name}_native.onnx"
            export(native_model, inputs, native)
            want = model_stats(onnx.load(str(native))).params
            ok = err <= 1e-5 and r.after.params == want
            bad += not ok
            forms = sorted({f.into for f in r.folds if "normalization" in f.into or "divisor" in f.into})
            print(
                f"{name:6s} {'ok  ' if ok else 'FAIL'} params {r.before.params} -> {r.after.params} "
                f"(native, hidden {D - len(CUT)}: {want}), max rel err {err:.1e}, {took:.1f} s; "
                f"norms: {'; '.join(forms) or 'none rewritten'}"
                + (f"; kept zeroed {sum(g.count for g in r.kept_zeroed)}" if r.kept_zeroed else "")
            )
    return bad


def latency(path: Path | onnx.ModelProto, feed: dict[str, np.ndarray], runs: int) -> float:
    sess = ort_session(path)
    for _ in range(5):
        sess.run(None, feed)
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        sess.run(None, feed)
        best = min(best, time.perf_counter() - t)
    return best


def depth(runs: int) -> int:
    import transformers

    from onnxshrink import shrink
    from onnxshrink.report import model_stats

    hidden, ffn, gone = 256, 688, (2, 5)
    with tempfile.TemporaryDirectory() as tmp:
        model, inputs = llama(transformers, hidden=hidden, layers=8, ffn=ffn)
        with torch.no_grad():
            for i in gone:
                model.model.layers[i].self_attn.o_proj.weight.zero_()
                model.model.layers[i].mlp.down_proj.weight.zero_()
        masked = Path(tmp) / "llama8.onnx"
        export(model, inputs, masked)
        r = shrink(masked, validate=False)
        err = error(masked, r.model, shapes_of(inputs))
        native_model, _ = llama(transformers, hidden=hidden, layers=8 - len(gone), ffn=ffn)
        native = Path(tmp) / "llama6.onnx"
        export(native_model, inputs, native)
        want = model_stats(onnx.load(str(native)))
        feed = {"input_ids": np.random.default_rng(0).integers(0, 100, (1, 128)).astype(np.int64)}
        times = {"masked": [], "shrunk": [], "native": []}
        for _ in range(5):  # interleaved: the machine is shared
            for k, m in (("masked", masked), ("shrunk", r.model), ("native", native)):
                times[k].append(latency(m, feed, runs))
        t = {k: min(v) * 1e3 for k, v in times.items()}
        ok = err <= 1e-5 and r.after.params == want.params and r.after.nodes == want.nodes
        ok = ok and t["shrunk"] <= 1.05 * t["native"]
        print(
            f"llama, 8 blocks (hidden {hidden}, FFN {ffn}), blocks {list(gone)} zeroed: "
            f"{'ok' if ok else 'FAIL'}; params {r.before.params} -> {r.after.params} (native 6 blocks "
            f"{want.params}), nodes {r.before.nodes} -> {r.after.nodes} (native {want.nodes}), "
            f"max rel err {err:.1e}; latency (1 thread, seq 128, min of 5x{runs}) masked "
            f"{t['masked']:.2f} ms, shrunk {t['shrunk']:.2f} ms, native {t['native']:.2f} ms "
            f"({t['shrunk'] / t['native']:.3f}x)"
        )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("check", choices=["width", "depth", "prune"])
    ap.add_argument("--models", default=",".join(WIDTH), help=f"width: of {list(WIDTH)}")
    ap.add_argument("--runs", type=int, default=30, help="depth: timed runs per round")
    ap.add_argument("--minilm", help="prune: the all-MiniLM-L6-v2 folder")
    args = ap.parse_args(argv)
    try:
        import transformers
    except ImportError:
        ap.error("needs transformers: pip install transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if args.check == "width":
        return width(args.models.split(","))
    if args.check == "depth":
        return depth(args.runs)
    from prune_table import main as prune_main  # tools/

    return prune_main(args.minilm)


if __name__ == "__main__":
    sys.exit(main())
