"""Real HuggingFace architectures: half the heads and FFN neurons masked, shrunk, checked.

Needs `transformers` (not a project dependency: `pip install transformers`). For BERT, ViT,
GPT-2 and LLaMA (grouped-query attention, rotary, SwiGLU) built from small random configs
(2 layers, hidden 64, 4 heads of 16, FFN 128; LLaMA with 2 K/V heads), every layer gets the
masks a head/neuron pruner leaves: heads 0 and 2 (LLaMA: K/V head 1 with its two query heads)
zeroed in the Q, K, V rows and biases and the output-projection columns, and every other FFN
neuron zeroed in the up (and gate) rows and the down columns. The model is exported, shrunk
with validation, and the parameters removed are compared with the count those heads and
neurons own, computed from the config. Prints one line per case; exit status 1 on a mismatch
or a failed validation.

    python tools/hf_check.py                          # dynamo exporter, eager attention
    python tools/hf_check.py --attn sdpa --dynamic    # SDPA attention, dynamic batch/sequence
    python tools/hf_check.py --legacy --models bert,vit
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.zoo import randomize  # noqa: E402  (the repository root, for `models`)

L, D, H, F = 2, 64, 4, 128  # layers, hidden, heads, FFN width
HD = D // H
HEADS = [0, 2]
NEURONS = list(range(0, F, 2))


def head_rows(heads: list[int]) -> list[int]:
    return [r for h in heads for r in range(h * HD, (h + 1) * HD)]


def zero(linear: nn.Module, rows=None, cols=None) -> None:
    with torch.no_grad():
        if rows is not None:
            linear.weight[rows] = 0
            if getattr(linear, "bias", None) is not None:
                linear.bias[rows] = 0
        if cols is not None:
            linear.weight[:, cols] = 0


def per_head(bias: bool = True) -> int:
    return 3 * (D * HD + (HD if bias else 0)) + HD * D


def bert(t, attn):
    cfg = t.BertConfig(
        vocab_size=100, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
        intermediate_size=F, max_position_embeddings=64, attn_implementation=attn,
    )  # fmt: skip
    m = randomize(t.BertModel(cfg))
    for layer in m.encoder.layer:
        a = layer.attention.self
        for lin in (a.query, a.key, a.value):
            zero(lin, rows=head_rows(HEADS))
        zero(layer.attention.output.dense, cols=head_rows(HEADS))
        zero(layer.intermediate.dense, rows=NEURONS)
        zero(layer.output.dense, cols=NEURONS)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    owned = L * (len(HEADS) * per_head() + len(NEURONS) * (2 * D + 1))
    return m, {"input_ids": ids, "attention_mask": torch.ones(1, 8, dtype=torch.long)}, owned


def vit(t, attn):
    cfg = t.ViTConfig(
        image_size=32, patch_size=8, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
        intermediate_size=F, attn_implementation=attn,
    )  # fmt: skip
    m = randomize(t.ViTModel(cfg, add_pooling_layer=False))
    for layer in m.layers if hasattr(m, "layers") else m.encoder.layer:
        a = layer.attention
        if hasattr(a, "q_proj"):  # transformers >= 5
            q, k, v, o, up, down = (
                a.q_proj,
                a.k_proj,
                a.v_proj,
                a.o_proj,
                layer.mlp.fc1,
                layer.mlp.fc2,
            )
        else:
            s = a.attention
            q, k, v, o = s.query, s.key, s.value, a.output.dense
            up, down = layer.intermediate.dense, layer.output.dense
        for lin in (q, k, v):
            zero(lin, rows=head_rows(HEADS))
        zero(o, cols=head_rows(HEADS))
        zero(up, rows=NEURONS)
        zero(down, cols=NEURONS)
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return m, {"pixel_values": pixels}, L * (len(HEADS) * per_head() + len(NEURONS) * (2 * D + 1))


def gpt2(t, attn):
    cfg = t.GPT2Config(
        vocab_size=100, n_embd=D, n_layer=L, n_head=H, n_inner=F, n_positions=64,
        use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    m = randomize(t.GPT2Model(cfg))
    qkv = [s * D + r for s in range(3) for r in head_rows(HEADS)]
    with torch.no_grad():
        for block in m.h:  # Conv1D layers store weights as [in, out]
            block.attn.c_attn.weight[:, qkv] = 0
            block.attn.c_attn.bias[qkv] = 0
            block.attn.c_proj.weight[head_rows(HEADS)] = 0
            block.mlp.c_fc.weight[:, NEURONS] = 0
            block.mlp.c_fc.bias[NEURONS] = 0
            block.mlp.c_proj.weight[NEURONS] = 0
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    return m, {"input_ids": ids}, L * (len(HEADS) * per_head() + len(NEURONS) * (2 * D + 1))


def llama(t, attn):
    kv, rep = 2, H // 2
    cfg = t.LlamaConfig(
        vocab_size=100, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=kv, intermediate_size=F, max_position_embeddings=64, use_cache=False,
        attn_implementation=attn,
    )  # fmt: skip
    m = randomize(t.LlamaModel(cfg))
    kv_heads = [1]
    q_heads = [j * rep + r for j in kv_heads for r in range(rep)]  # the query heads it serves
    for layer in m.layers:
        a = layer.self_attn
        zero(a.k_proj, rows=head_rows(kv_heads))
        zero(a.v_proj, rows=head_rows(kv_heads))
        zero(a.q_proj, rows=head_rows(q_heads))
        zero(a.o_proj, cols=head_rows(q_heads))
        for lin in (layer.mlp.gate_proj, layer.mlp.up_proj):
            zero(lin, rows=NEURONS)
        zero(layer.mlp.down_proj, cols=NEURONS)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    owned = L * (len(q_heads) * 2 * D * HD + len(kv_heads) * 2 * D * HD + len(NEURONS) * 3 * D)
    return m, {"input_ids": ids}, owned


MODELS = {"bert": bert, "vit": vit, "gpt2": gpt2, "llama": llama}


class Positional(nn.Module):
    """The legacy exporter passes inputs positionally; HF forwards want keywords."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        return self.model(**dict(zip(self.names, args, strict=True))).last_hidden_state


@contextlib.contextmanager
def silenced():
    """The exporters print from C++ too (the legacy one dumps its whole graph on failure)."""
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def export(model, inputs: dict, path: Path, legacy: bool, dynamic: bool) -> None:
    names = list(inputs)
    axes = {0: "batch"} if names == ["pixel_values"] else {0: "batch", 1: "seq"}
    with silenced():
        warnings.simplefilter("ignore")
        if legacy:
            torch.onnx.export(
                Positional(model.eval(), names),
                tuple(inputs.values()),
                str(path),
                dynamo=False,
                input_names=names,
                dynamic_axes={n: axes for n in names} if dynamic else None,
            )
            return
        dims = {"batch": torch.export.Dim("batch", min=1), "seq": torch.export.Dim("seq", min=2)}
        shapes = {n: {a: dims[d] for a, d in axes.items()} for n in names} if dynamic else None
        torch.onnx.export(model.eval(), (), str(path), kwargs=inputs, dynamic_shapes=shapes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {list(MODELS)}")
    ap.add_argument("--attn", default="eager", help="attn_implementation: eager or sdpa")
    ap.add_argument("--legacy", action="store_true", help="the TorchScript exporter")
    ap.add_argument("--dynamic", action="store_true", help="dynamic batch and sequence axes")
    args = ap.parse_args(argv)
    try:
        import transformers
    except ImportError:
        ap.error("needs transformers: pip install transformers")
    transformers.logging.set_verbosity_error()
    from onnxshrink import shrink

    bad = 0
    exporter = "legacy" if args.legacy else "dynamo"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {exporter} "
          f"exporter, {args.attn} attention, {'dynamic' if args.dynamic else 'static'} shapes")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model, inputs, owned = MODELS[name](transformers, args.attn)
            path = Path(tmp) / f"{name}.onnx"
            try:
                export(model, inputs, path, args.legacy, args.dynamic)
            except Exception as e:  # an exporter limitation, not ours: report and go on
                print(
                    f"{name:6s} export failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
                )
                continue
            r = shrink(path)
            removed = r.before.params - r.after.params
            err = max(o.max_rel_error for o in r.validation.outputs)
            ok = r.validation.passed and removed == owned
            bad += not ok
            barriers = sorted({b["op"] for b in r.barriers})
            print(
                f"{name:6s} {'ok  ' if ok else 'FAIL'} params {r.before.params} -> {r.after.params}"
                f" (removed {removed}, heads and neurons own {owned}), max rel err {err:.1e}"
                + (f", barriers {barriers}" if barriers else "")
                + (f", kept zeroed {sum(g.count for g in r.kept_zeroed)}" if r.kept_zeroed else "")
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
