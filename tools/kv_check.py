"""Acceptance check of KV-cache decoders (issue 24): optimum's merged decoder of a small LLaMA.

    python tools/kv_check.py [--work /tmp/kv_check] [--ratio 0.3] [--tokens 8]
        [--optimum-python /work/venvs/optimum/bin/python]

1. A LLaMA from a HuggingFace config (4 layers, hidden 64, 8 query heads over 4 KV heads, MLP
   128, random weights) exported by optimum as its merged decoder (the decoder without past and
   the one with past, merged by `optimum.onnx.merge_decoders` into an If on use_cache_branch),
   its config.json beside it. Run in the optimum venv (transformers < 5).
2. `onnxshrink.prune(..., ratio, validate=False)`: the groups found (the KV groups are read
   inside the If's branches), the groups removed, the inputs and outputs whose shape changed,
   the config.json written beside the output.
3. Independent check in onnxruntime against the input with the removed groups zeroed here (from
   the groups' own member slices, numpy): both branches; the first-token step tells which cache
   heads were kept (each shrunk head matched to the reference head it equals), the with-cache step
   then feeds the reference the whole random cache and the shrunk model its kept heads.
4. Generation with optimum's ORTModelForCausalLM (greedy, `--tokens` new tokens): the shrunk model
   with the written config.json against the zeroed input with the input's config.json: the same
   tokens.

Prints the figures; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("ONNXSHRINK_THREADS", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

MODEL = "decoder_model_merged.onnx"

EXPORT = r'''
import sys, torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
from optimum.exporters.onnx import export
from optimum.exporters.onnx.model_configs import LlamaOnnxConfig
from optimum.onnx import merge_decoders
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                  tie_word_embeddings=False)
model = LlamaForCausalLM(cfg).eval()
with torch.no_grad():
    for n, p in model.named_parameters():
        if "norm" in n:
            p.uniform_(0.5, 1.5)  # not library-default unit norms
tmp = out / "parts"; tmp.mkdir(exist_ok=True)
for name, past_in in (("decoder_model", False), ("decoder_with_past_model", True)):
    oc = LlamaOnnxConfig(cfg, task="text-generation", use_past=True, use_past_in_inputs=past_in)
    export(model, oc, tmp / f"{name}.onnx", opset=18)
merge_decoders(tmp / "decoder_model.onnx", tmp / "decoder_with_past_model.onnx", save_path=out / "decoder_model_merged.onnx")
cfg.save_pretrained(out)
'''

GENERATE = r'''
import json, sys, torch
from optimum.onnxruntime import ORTModelForCausalLM
folder, n = sys.argv[1], int(sys.argv[2])
model = ORTModelForCausalLM.from_pretrained(folder, file_name="decoder_model_merged.onnx", use_cache=True, use_io_binding=False)
head_dim = getattr(model.config, "head_dim", None)
patched = None
if head_dim is not None and getattr(model, "embed_size_per_head", head_dim) != head_dim:
    # optimum derives the cache's head size as hidden_size // num_attention_heads for llama,
    # not from the config's head_dim
    patched = [model.embed_size_per_head, head_dim]
    model.embed_size_per_head = head_dim
ids = torch.tensor([[1, 5, 9, 23, 42, 77]])
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, min_new_tokens=n)
print(json.dumps({"tokens": out[0, ids.shape[1]:].tolist(), "patched": patched,
                  "kv_heads": model.num_key_value_heads}))
'''


def say(text: str) -> None:
    print(text, flush=True)


def run_in(python: str, script: str, *args: str) -> str:
    done = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{python} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def zeroed_input(model: onnx.ModelProto, members) -> onnx.ModelProto:
    """The input with the removed groups' member slices set to zero, here with numpy."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    by_name = {t.name: t for t in out.graph.initializer}
    arrays = {}
    for m in members:
        t = by_name[m.initializer]
        a = arrays.setdefault(m.initializer, numpy_helper.to_array(t).copy())
        index = [slice(None)] * a.ndim
        index[m.axis] = np.asarray(m.indices)
        a[tuple(index)] = 0
    for name, a in arrays.items():
        by_name[name].CopyFrom(numpy_helper.from_array(a, name))
    return out


def session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def feeds(sess, batch: int, seq: int, past: int, use_cache: bool, rng, heads: dict | None = None) -> dict:
    out = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            out[i.name] = rng.integers(0, 256, (batch, seq)).astype(np.int64)
        elif i.name == "attention_mask":
            out[i.name] = np.ones((batch, past + seq), np.int64)
        elif i.name == "position_ids":
            out[i.name] = np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1))
        elif i.name == "use_cache_branch":
            out[i.name] = np.array([use_cache])
        else:
            n = int(i.shape[1]) if heads is None else heads[i.name]
            out[i.name] = rng.standard_normal((batch, n, past, int(i.shape[3]))).astype(np.float32)
    return out


def check(reference: Path, shrunk: Path) -> tuple[float, dict[str, list[int]]]:
    """Max relative error of the shrunk model's outputs against the reference's (kept heads),
    over both branches; the kept cache heads by name."""
    ref, new = session(reference), session(shrunk)
    names = [o.name for o in ref.get_outputs()]
    rng = np.random.default_rng(0)
    # First token (the branch without past): every head of present is computed from the input
    # ids alone; each shrunk head is the reference head it equals.
    f = feeds(ref, 2, 5, 0, False, rng)
    r, s = ref.run(None, f), new.run(None, {k: v for k, v in f.items() if not k.startswith("past")} | {
        i.name: np.zeros((2, int(i.shape[1]), 0, int(i.shape[3])), np.float32) for i in new.get_inputs() if i.name.startswith("past")
    })
    worst = float(np.abs(s[0] - r[0]).max() / np.abs(r[0]).max())
    kept: dict[str, list[int]] = {}
    for k, name in enumerate(names[1:], start=1):
        match = []
        for j in range(s[k].shape[1]):
            hits = [h for h in range(r[k].shape[1]) if np.allclose(s[k][:, j], r[k][:, h], rtol=1e-4, atol=1e-5)]
            if len(hits) != 1:
                raise SystemExit(f"{name}: shrunk head {j} matches reference heads {hits}")
            match.append(hits[0])
        kept[name.replace("present", "past_key_values")] = match
        worst = max(worst, float(np.abs(s[k] - r[k][:, match]).max() / np.abs(r[k]).max()))
    # With the cache: the reference fed a whole random cache, the shrunk model its kept heads.
    f = feeds(ref, 2, 3, 7, True, rng)
    r = ref.run(None, f)
    g = {k: (v[:, kept[k]] if k in kept else v) for k, v in f.items()}
    s = new.run(None, g)
    worst = max(worst, float(np.abs(s[0] - r[0]).max() / np.abs(r[0]).max()))
    for k, name in enumerate(names[1:], start=1):
        idx = kept[name.replace("present", "past_key_values")]
        worst = max(worst, float(np.abs(s[k] - r[k][:, idx]).max() / np.abs(r[k]).max()))
    return worst, kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/kv_check")
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--optimum-python", default="/work/venvs/optimum/bin/python")
    args = ap.parse_args(argv)
    work = Path(args.work)
    src, out, ref = work / "in", work / "out", work / "ref"
    for d in (out, ref):
        d.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    if not (src / MODEL).exists():
        run_in(args.optimum_python, EXPORT, str(src))
    say(f"[1] optimum merged decoder: {src / MODEL} ({(src / MODEL).stat().st_size / 2**20:.2f} MiB, {time.perf_counter() - t0:.1f} s)")
    model = onnx.load(src / MODEL)
    say(f"    top-level nodes: {[n.op_type for n in model.graph.node]}; branches: "
        + ", ".join(f"{a.name} {len(a.g.node)} nodes" for a in model.graph.node[-1].attribute if a.type == onnx.AttributeProto.GRAPH))

    from onnxshrink.prune import prune

    t0 = time.perf_counter()
    result = prune(str(src / MODEL), args.ratio, str(out / MODEL), validate=False, price=False)
    took = time.perf_counter() - t0
    gset = result.groups
    inner = {n.name for g in onnx.load(src / MODEL).graph.node[-1].attribute if g.type == onnx.AttributeProto.GRAPH for n in g.g.node}
    kinds: dict[str, list[int]] = {}
    for p in result.plans:
        if p.total:
            kinds.setdefault(p.layer.kind, [0, 0])
            kinds[p.layer.kind][0] += p.total
            kinds[p.layer.kind][1] += len(p.removed)
    kv_layers = [ly for ly in gset.layers if ly.kind == "kv_group"]
    read_inside = all(m.node in inner for ly in kv_layers for i in ly.groups for m in gset.groups[i].members)
    say(f"[2] prune {args.ratio} (validation off) in {took:.1f} s: {len(gset.groups)} groups, {len(gset.exact())} exact; "
        f"{len(kv_layers)} KV-group layers, their members read inside the If's branches: {read_inside}")
    for kind, (total, removed) in kinds.items():
        say(f"    {kind}: {removed} of {total} removed")
    say(f"    parameters {result.original.params} -> {result.shrink.after.params} "
        f"({(result.shrink.after.params / result.original.params - 1) * 100:+.1f}%)")
    say(f"    {len(result.shrink.interface_changes)} inputs/outputs changed shape, e.g.:")
    for c in result.shrink.interface_changes[:2] + result.shrink.interface_changes[-1:]:
        say(f"      {c.text()}")
    for note in result.shrink.runtime_configs:
        say(f"    {note['text']}")
    ok = bool(read_inside and kinds.get("kv_group", [0, 0])[1] and result.shrink.interface_changes)

    zeroed = zeroed_input(model, gset.zeroed_members([gset.groups[i] for p in result.plans for i in p.removed]))
    onnx.save(zeroed, ref / MODEL)
    (ref / "config.json").write_bytes((src / "config.json").read_bytes())
    worst, kept = check(ref / MODEL, out / MODEL)
    exact = worst < 1e-4
    ok &= exact
    say(f"[3] onnxruntime, both branches, against the input with the removed groups zeroed: max rel error {worst:.2e} "
        f"({'exact' if exact else 'DIFFERS'}); kept cache heads, layer 0: {kept.get('past_key_values.0.key')}")

    gens = {}
    for label, folder in (("zeroed input", ref), ("shrunk", out)):
        t0 = time.perf_counter()
        gens[label] = json.loads(run_in(args.optimum_python, GENERATE, str(folder), str(args.tokens)).strip().splitlines()[-1])
        gens[label]["seconds"] = time.perf_counter() - t0
    same = gens["shrunk"]["tokens"] == gens["zeroed input"]["tokens"]
    ok &= same
    cfg = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    say(f"[4] ORTModelForCausalLM.generate, {args.tokens} tokens: zeroed input {gens['zeroed input']['tokens']}, "
        f"shrunk {gens['shrunk']['tokens']}: {'the same' if same else 'DIFFERENT'}")
    say(f"    shrunk loaded with the written config.json (num_key_value_heads {cfg.get('num_key_value_heads')}, "
        f"num_attention_heads {cfg.get('num_attention_heads')}, head_dim {cfg.get('head_dim')}); optimum's cache "
        f"KV heads {gens['shrunk']['kv_heads']}")
    if gens["shrunk"]["patched"]:
        a, b = gens["shrunk"]["patched"]
        say(f"    note: optimum 2.1 sizes a llama cache's head as hidden_size // num_attention_heads ({a}), not the "
            f"config's head_dim ({b}): set embed_size_per_head = head_dim after loading")
    say("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
