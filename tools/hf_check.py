"""Real HuggingFace architectures: half the heads and FFN neurons masked, shrunk, checked.

Needs `transformers` (not a project dependency: `pip install transformers`). For BERT, ViT,
GPT-2 and LLaMA (grouped-query attention, rotary, SwiGLU) built from small configs (2 layers,
hidden 64, 4 heads of 16, FFN 128; LLaMA with 2 K/V heads), every layer gets the masks a
head/neuron pruner leaves: heads 0 and 2 (LLaMA: K/V head 1 with its two query heads) zeroed in
the Q, K, V rows and biases and the output-projection columns, and every other FFN neuron
zeroed in the up (and gate) rows and the down columns. Parameters are randomized, or keep the
library's own initialization (`--init default`: zero biases, unit LayerNorms, square
projections, which the exporters merge and store transposed).

Three ways in, each shrunk with validation off and compared here, with onnxruntime, with the
model exported from the masked module (never with onnxshrink's own reference):
- `zeros`: the masked export, no masks file (its zeros are the masks);
- `file`: the masked export with the masks file of state_dict names;
- `unmasked`: the export of the unmasked module with that masks file.
With random parameters the parameters removed must equal those the heads and neurons own
(computed from the config); with the library's initialization (equal parameters merged
differently) the three ways must reach the same size. Prints one line per case; exit status 1
on any mismatch.

    python tools/hf_check.py                          # dynamo exporter, eager attention
    python tools/hf_check.py --init default           # the library's initialization
    python tools/hf_check.py --attn sdpa --dynamic    # SDPA attention, dynamic batch/sequence
    python tools/hf_check.py --legacy --models bert,vit
    python tools/hf_check.py --ort-optimize --models bert,gpt2   # onnxruntime's fused ops
    python tools/hf_check.py --attn sdpa --opset 23               # ONNX's Attention op
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.zoo import distinct_params, randomize  # noqa: E402  (the repository root)

L, D, H, F = 2, 64, 4, 128  # layers, hidden, heads, FFN width
HD = D // H
HEADS = [0, 2]
NEURONS = list(range(0, F, 2))


def head_rows(heads: list[int]) -> list[int]:
    return [r for h in heads for r in range(h * HD, (h + 1) * HD)]


MASKS: dict[int, torch.Tensor] = {}  # id(parameter) -> its mask, as a pruner records it


def mask(p: nn.Parameter, index) -> None:
    """Zero p[index] and record it in p's mask."""
    m = MASKS.setdefault(id(p), torch.ones_like(p))
    with torch.no_grad():
        m[index] = 0
        p[index] = 0


def zero(linear: nn.Module, rows=None, cols=None) -> None:
    if rows is not None:
        mask(linear.weight, rows)
        if getattr(linear, "bias", None) is not None:
            mask(linear.bias, rows)
    if cols is not None:
        mask(linear.weight, (slice(None), cols))


INIT = {"random": randomize, "default": lambda m: m.eval()}


def per_head(bias: bool = True) -> int:
    return 3 * (D * HD + (HD if bias else 0)) + HD * D


def bert(t, attn, init):
    cfg = t.BertConfig(
        vocab_size=100, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
        intermediate_size=F, max_position_embeddings=64, attn_implementation=attn,
    )  # fmt: skip
    m = init(t.BertModel(cfg))
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


def vit(t, attn, init):
    cfg = t.ViTConfig(
        image_size=32, patch_size=8, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
        intermediate_size=F, attn_implementation=attn,
    )  # fmt: skip
    m = init(t.ViTModel(cfg, add_pooling_layer=False))
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


def gpt2(t, attn, init):
    cfg = t.GPT2Config(
        vocab_size=100, n_embd=D, n_layer=L, n_head=H, n_inner=F, n_positions=64,
        use_cache=False, bos_token_id=0, eos_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    m = init(t.GPT2Model(cfg))
    qkv = [s * D + r for s in range(3) for r in head_rows(HEADS)]
    for block in m.h:  # Conv1D layers store weights as [in, out]
        mask(block.attn.c_attn.weight, (slice(None), qkv))
        mask(block.attn.c_attn.bias, qkv)
        mask(block.attn.c_proj.weight, head_rows(HEADS))
        mask(block.mlp.c_fc.weight, (slice(None), NEURONS))
        mask(block.mlp.c_fc.bias, NEURONS)
        mask(block.mlp.c_proj.weight, NEURONS)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    return m, {"input_ids": ids}, L * (len(HEADS) * per_head() + len(NEURONS) * (2 * D + 1))


def llama(t, attn, init):
    kv, rep = 2, H // 2
    cfg = t.LlamaConfig(
        vocab_size=100, hidden_size=D, num_hidden_layers=L, num_attention_heads=H,
        num_key_value_heads=kv, intermediate_size=F, max_position_embeddings=64, use_cache=False,
        attn_implementation=attn,
    )  # fmt: skip
    m = init(t.LlamaModel(cfg))
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


def run(model, feed: dict) -> list:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


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


# onnxruntime's transformer optimizer: the model type each architecture's fusions go by
ORT_TYPES = {"bert": "bert", "vit": "vit", "gpt2": "gpt2", "llama": "gpt2"}


def ort_optimize(path: Path, name: str) -> None:
    """Rewrite the export as onnxruntime's transformer optimizer does before serving (its
    fusions only: SkipLayerNormalization, BiasGelu/FastGelu, Attention where it matches)."""
    from onnxruntime.transformers.optimizer import optimize_model

    with silenced():
        opt = optimize_model(str(path), model_type=ORT_TYPES[name], num_heads=H, hidden_size=D, opt_level=0)
        opt.save_model_to_file(str(path))


def export(
    model, inputs: dict, path: Path, legacy: bool, dynamic: bool, opset: int | None = None
) -> None:
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
        extra = {"opset_version": opset} if opset else {}
        torch.onnx.export(model.eval(), (), str(path), kwargs=inputs, dynamic_shapes=shapes, **extra)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {list(MODELS)}")
    ap.add_argument("--attn", default="eager", help="attn_implementation: eager or sdpa")
    ap.add_argument("--legacy", action="store_true", help="the TorchScript exporter")
    ap.add_argument("--dynamic", action="store_true", help="dynamic batch and sequence axes")
    ap.add_argument("--init", choices=sorted(INIT), default="random", help="parameters: randomized, or the library's default initialization")
    ap.add_argument("--opset", type=int, help="export at this opset (23: SDPA becomes ONNX's Attention op)")
    ap.add_argument("--ort-optimize", action="store_true", help="pass the exports through onnxruntime's transformer optimizer first")
    args = ap.parse_args(argv)
    try:
        import transformers
    except ImportError:
        ap.error("needs transformers: pip install transformers")
    transformers.logging.set_verbosity_error()
    from onnxshrink import shrink
    from onnxshrink.proof.inputs import make_inputs, resolve_shapes

    bad = 0
    exporter = "legacy" if args.legacy else "dynamo"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {exporter} "
          f"exporter, {args.attn} attention, {'dynamic' if args.dynamic else 'static'} shapes, "
          f"{args.init} parameters" + (f", opset {args.opset}" if args.opset else "")
          + (", onnxruntime-optimized" if args.ort_optimize else ""))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            MASKS.clear()
            unmasked_module = []

            def init(m, _keep=unmasked_module):
                m = INIT[args.init](m)
                _keep.append(copy.deepcopy(m))
                return m

            model, inputs, owned = MODELS[name](transformers, args.attn, init)
            prefix = "model." if args.legacy else ""  # the Positional wrapper's attribute
            masks = {
                prefix + n: MASKS[id(p)].numpy() for n, p in model.named_parameters() if id(p) in MASKS
            }
            paths = {k: Path(tmp) / f"{name}_{k}.onnx" for k in ("masked", "unmasked")}
            try:
                export(model, inputs, paths["masked"], args.legacy, args.dynamic, args.opset)
                export(unmasked_module[0], inputs, paths["unmasked"], args.legacy, args.dynamic, args.opset)
                if args.ort_optimize:
                    for path in paths.values():
                        ort_optimize(path, name)
            except Exception as e:  # an exporter limitation, not ours: report and go on
                print(
                    f"{name:6s} export failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
                )
                continue
            reference = onnx.load(str(paths["masked"]))
            fused = sorted(
                {n.op_type for n in reference.graph.node if n.domain or n.op_type == "Attention" or not onnx.defs.has(n.op_type)}
            )
            if fused:
                print(f"{name:6s} fused ops: {', '.join(fused)}")
            feeds = make_inputs(reference, resolve_shapes(reference, {}), 3, seed=11)
            expected = [run(reference, f) for f in feeds]
            before = distinct_params(reference) if args.init == "default" else None
            sizes = []
            for way, path, given in (
                ("zeros", paths["masked"], None),
                ("file", paths["masked"], masks),
                ("unmasked", paths["unmasked"], masks),
            ):
                r = shrink(path, given, validate=False)
                err = max(
                    float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
                    for f, exp in zip(feeds, expected, strict=True)
                    for a, b in zip(exp, run(r.model, f), strict=True)
                )
                if args.init == "default":
                    after = distinct_params(r.model)
                    sizes.append(after)
                    ok = err <= 1e-5 and after == sizes[0]
                    size = f"distinct params {before} -> {after}"
                else:
                    removed = r.before.params - r.after.params
                    ok = err <= 1e-5 and removed == owned
                    size = f"params {r.before.params} -> {r.after.params} (removed {removed}, heads and neurons own {owned})"
                bad += not ok
                barriers = sorted({b["op"] for b in r.barriers})
                print(
                    f"{name:6s} {way:8s} {'ok  ' if ok else 'FAIL'} {size}, max rel err {err:.1e}"
                    + (f", barriers {barriers}" if barriers else "")
                    + (f", kept zeroed {sum(g.count for g in r.kept_zeroed)}" if r.kept_zeroed else "")
                )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
