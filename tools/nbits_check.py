"""int4 LLaMA (onnxruntime's MatMulNBits) pruned by `--prune`, side by side with the float model and
with onnxsim 0.8's `apply_structured_pruning_matmul_nbits`.

A HuggingFace LlamaForCausalLM from a small config (default: 4 layers, hidden 256, 8 heads of 32,
2 K/V heads, FFN 512, vocabulary 512; random weights) is exported with torch's dynamo exporter and
quantized with onnxruntime's `MatMulNBitsQuantizer` (block 32, symmetric and asymmetric; as
MatMulNBits, and in its QDQ form: opset 21 int4/uint4 DequantizeLinear with block_size). The
export, the quantization and onnxsim run in another environment (`--peers`: one with
transformers, torch and onnxsim); onnxshrink runs here.

For each model (float; MatMulNBits and QDQ, each symmetric and asymmetric) it prints:
- the analysis alone (`onnxshrink MODEL`, no masks: what every node needs; its wall time and the
  analysis phase's), and the groups (`--groups`) by kind;
- `--prune RATIO -o` with the proof on (wall time of the command; what it removed per layer kind;
  weight bytes before and after: every initializer, and the MatMulNBits inputs alone);
- an independent check: the input model with the masks `--masks-out` wrote applied here (a
  MatMulNBits weight's zeroed bytes set to its blocks' zero points, read here from the op's
  definition; floats to 0), run in onnxruntime against the pruned model (max relative error);
- onnxsim's prune of the same int4 model at the same ratio: its time, bytes, and the cosine of its
  logits with the input's (it removes channels that are not zero: a different function).
`--replay` also times the analysis of the int4 models at static shapes with the MatMulNBits rule
and with it taken out (each node replayed in onnxruntime, as before the rule).

    python tools/nbits_check.py                       # /tmp/nbits_check, ratio 0.3
    python tools/nbits_check.py --replay --layers 4 --ratio 0.3

Measured (the default config, a shared 2-core machine; --prune wall time the fastest of 3
rounds, the models alternating): float 3.60 s; int4 MatMulNBits 4.14 s (symmetric) and 3.93 s
(asymmetric), QDQ 3.91 / 4.05 s; each int4 prune removed 4 of 8 K/V heads, 20 of 64 blocks of
32 FFN neurons and 3 of 8 blocks of 32 hidden channels, proof passed, its int4 weights with
their scales and zero points 59% fewer bytes (every initializer: 53-56%), max relative error
against the masks applied here 1.2e-6 / 1.3e-6 / 6.0e-7 / 4.9e-7. The analysis of the int4 model
took 0.7-1.2 s (no node replayed). onnxsim's apply_structured_pruning_matmul_nbits at 0.3 ran
(0.03-0.1 s) and returned the models unchanged (0 bytes fewer; by its docstring it prunes a
MatMulNBits whose output reaches exactly one matrix product through unary ops only, and a
LLaMA's projections feed a SwiGLU product, reshapes or a residual Add).
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

ROOT = Path(__file__).resolve().parents[1]
MS = "com.microsoft"


# ---------------------------------------------------------------------- the other environment
def child_export(workdir: Path, cfg: dict, ratio: float) -> None:
    """In the peers environment: export, quantize, onnxsim. Writes workdir/peers.json."""
    import contextlib
    import io
    import warnings

    import onnx
    import torch
    import transformers as t
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    torch.manual_seed(0)
    config = t.LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
        intermediate_size=cfg["ffn"], max_position_embeddings=128, use_cache=False,
        attn_implementation="eager",
    )  # fmt: skip
    model = t.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random weights: matrices by fan-in, norms near one (no equal ones)
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    ids = torch.randint(0, cfg["vocab"], (1, 16), generator=g)
    seq = torch.export.Dim("seq", min=2, max=128)

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids).logits

    out: dict = {}
    float_path = workdir / "float.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        if cfg["exporter"] == "dynamo":
            torch.onnx.export(
                model, (), str(float_path), kwargs={"input_ids": ids},
                dynamic_shapes={"input_ids": {1: seq}}, output_names=["logits"],
            )  # fmt: skip
        else:  # TorchScript (no onnxscript needed)
            torch.onnx.export(
                Logits(model), (ids,), str(float_path), dynamo=False, input_names=["input_ids"],
                output_names=["logits"], dynamic_axes={"input_ids": {1: "seq"}}, opset_version=17,
            )  # fmt: skip
        out["export_s"] = time.perf_counter() - start
    m = onnx.load(str(float_path))
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig

    for name, symmetric in (("int4_sym", True), ("int4_asym", False), ("qdq_sym", True), ("qdq_asym", False)):
        copy = onnx.ModelProto()
        copy.CopyFrom(m)
        start = time.perf_counter()
        fmt = QuantFormat.QDQ if name.startswith("qdq") else QuantFormat.QOperator
        config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric, quant_format=fmt)
        q = MatMulNBitsQuantizer(copy, algo_config=config)
        q.process()
        out[f"{name}_quantize_s"] = time.perf_counter() - start
        onnx.save(q.model.model, str(workdir / f"{name}.onnx"))
    try:
        from onnxsim.pruning import apply_structured_pruning_matmul_nbits
    except ImportError as exc:
        out["onnxsim"] = f"not importable: {exc}"
    else:
        for name in ("int4_sym", "int4_asym"):  # (its MatMulNBits pruning; the QDQ form is not)
            try:
                start = time.perf_counter()
                pruned = apply_structured_pruning_matmul_nbits(str(workdir / f"{name}.onnx"), sparsity=ratio)
                seconds = time.perf_counter() - start
                onnx.save(pruned, str(workdir / f"{name}_onnxsim.onnx"))
                out[f"{name}_onnxsim_s"] = seconds
            except Exception as exc:  # report what it says, whatever it is
                out[f"{name}_onnxsim_error"] = f"{type(exc).__name__}: {exc}"[:300]
    (workdir / "peers.json").write_text(json.dumps(out))


# ---------------------------------------------------------------------- here
def weight_bytes(path: Path) -> tuple[int, int]:
    """(bytes of every initializer, bytes of the int4 weights with their scales and zero points:
    MatMulNBits inputs, block-wise DequantizeLinear inputs)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path))
    nbits = {x for n in m.graph.node if n.op_type == "MatMulNBits" for x in n.input[1:]}
    nbits |= {x for n in m.graph.node if n.op_type == "DequantizeLinear" and any(a.name == "block_size" for a in n.attribute) for x in n.input}
    sizes = {t.name: numpy_helper.to_array(t, str(path.parent)).nbytes for t in m.graph.initializer}
    return sum(sizes.values()), sum(v for k, v in sizes.items() if k in nbits)


def masked_by_hand(src: Path, masks: Path):
    """The input model with the masks --masks-out wrote applied here: a MatMulNBits weight's
    masked bytes set to the byte holding its block's zero point twice (zero points packed two a
    byte per row, low bits first, absent: 8), a block-wise DequantizeLinear's int4 values to
    their block's zero point (absent: 0), a float tensor's to 0."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(src))
    inits = {t.name: t for t in m.graph.initializer}
    with np.load(masks) as f:
        mask = {k.removeprefix("onnx/"): f[k] for k in f.files}
    for name, keep in mask.items():
        if name not in inits:  # a framework parameter the exporter stored transposed
            return None
        v = numpy_helper.to_array(inits[name], str(src.parent)).copy()
        node = next(n for n in m.graph.node if name in n.input)
        if node.op_type == "MatMulNBits" and list(node.input).index(name) == 1:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert attrs.get("bits", 4) == 4
            n, nb, _ = v.shape
            if len(node.input) > 3 and node.input[3]:
                z = numpy_helper.to_array(inits[node.input[3]]).reshape(n, -1)
                zero = np.stack([z & 15, z >> 4], axis=-1).reshape(n, -1)[:, :nb]
            else:
                zero = np.full((n, nb), 8, np.uint8)
            fill = np.broadcast_to((zero | (zero << 4)).astype(np.uint8)[:, :, None], v.shape)
            v = np.where(keep.astype(bool), v, fill)
        elif node.op_type == "DequantizeLinear" and list(node.input).index(name) == 0:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            axis, block = attrs.get("axis", 1) % v.ndim, attrs["block_size"]
            if len(node.input) > 2 and node.input[2]:
                z = numpy_helper.to_array(inits[node.input[2]]).astype(np.int64)
                zero = np.repeat(z, block, axis=axis).take(np.arange(v.shape[axis]), axis=axis)
            else:
                zero = np.zeros(v.shape, np.int64)
            v = np.where(keep.astype(bool), v.astype(np.int64), zero).astype(v.dtype)
        else:
            v = np.where(keep.astype(bool), v, np.zeros((), v.dtype)).astype(v.dtype)
        inits[name].CopyFrom(numpy_helper.from_array(v, name))
    return m


def logits(model, ids: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, OMP_NUM_THREADS="1", ONNXSHRINK_THREADS="1")
    start = time.perf_counter()
    done = subprocess.run(["nice", *cmd], capture_output=True, text=True, env=env)
    return time.perf_counter() - start, done


def check(workdir: Path, name: str, ratio: float, vocab: int) -> dict:
    import onnx

    src = workdir / f"{name}.onnx"
    exe = [sys.executable, "-m", "onnxshrink.cli"]
    rec: dict = {"model": name}
    seconds, done = timed([*exe, str(src), "--report", str(workdir / f"{name}_analysis.json"), "-q"])
    report = json.loads((workdir / f"{name}_analysis.json").read_text())
    rec["analysis_s"] = seconds
    rec["analyze_phase_s"] = report["timings"]["analyze"]
    rec["replayed"] = len(report.get("replayed") or [])
    groups = workdir / f"{name}_groups.json"
    seconds, done = timed([*exe, str(src), "--groups", str(groups), "-q"])
    kinds: dict[str, list[int]] = {}
    for g in json.loads(groups.read_text())["groups"]:
        k = f"{g['unit']['kind']}/{g['unit']['channels']}"
        kinds.setdefault(k, [0, 0])[0 if g["exact"] else 1] += 1
    rec["groups_s"], rec["groups"] = seconds, kinds
    out, masks, rpt = workdir / f"{name}_pruned.onnx", workdir / f"{name}_masks.npz", workdir / f"{name}_prune.json"
    seconds, done = timed([*exe, str(src), "--prune", str(ratio), "-o", str(out), "--masks-out", str(masks), "--report", str(rpt), "-q"])
    rec["prune_s"], rec["prune_exit"] = seconds, done.returncode
    if done.returncode != 0:
        rec["prune_error"] = (done.stderr or done.stdout).strip().splitlines()[-1:]
        return rec
    pr = json.loads(rpt.read_text())
    rec["removed"] = {}
    for layer in pr["layers"]:
        if layer["removed"]:
            k = layer["kind"]
            before = rec["removed"].get(k, [0, 0])
            rec["removed"][k] = [before[0] + layer["removed"], before[1] + layer["groups"]]
    rec["proof"] = pr["shrink"]["passed"]
    rec["bytes"] = (weight_bytes(src), weight_bytes(out))
    reference = masked_by_hand(src, masks)
    if reference is None:
        return rec  # (the float export: its masks name torch's parameters, not initializers)
    pruned = onnx.load(str(out))
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(3):
        ids = rng.integers(0, vocab, (1, 16)).astype(np.int64)
        a, b = logits(reference, ids), logits(pruned, ids)
        worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
    rec["independent_error"] = worst
    return rec


def onnxsim_record(workdir: Path, name: str, peers: dict, vocab: int) -> dict:
    import onnx

    rec: dict = {"model": f"{name} (onnxsim)"}
    if f"{name}_onnxsim_error" in peers or f"{name}_onnxsim_s" not in peers:
        rec["error"] = peers.get(f"{name}_onnxsim_error", peers.get("onnxsim", "did not run"))
        return rec
    src, out = workdir / f"{name}.onnx", workdir / f"{name}_onnxsim.onnx"
    rec["prune_s"] = peers[f"{name}_onnxsim_s"]
    rec["bytes"] = (weight_bytes(src), weight_bytes(out))
    rng = np.random.default_rng(0)
    cos = []
    for _ in range(3):
        ids = rng.integers(0, vocab, (1, 16)).astype(np.int64)
        a = logits(onnx.load(str(src)), ids).reshape(-1)
        b = logits(onnx.load(str(out)), ids).reshape(-1)
        cos.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    rec["cosine"] = min(cos)
    return rec


def replay_baseline(workdir: Path, name: str) -> None:
    """The analysis at static input shapes (the replay needs them), with the MatMulNBits rule and
    with it taken out (its nodes replayed in onnxruntime, as before the rule)."""
    for rule in (True, False):
        code = (
            "from onnxshrink.ops import registry; from onnxshrink import shrink\n"
            + ("" if rule else f"registry._REGISTRY.pop(({MS!r}, 'MatMulNBits'))\n")
            + f"r = shrink({str(workdir / (name + '.onnx'))!r}, validate=False, "
            "input_shapes={'input_ids': [1, 16]})\n"
            "d = r.to_dict(); b = [x for x in d['barriers'] if x['op'] == 'MatMulNBits']\n"
            "print(r.timings['analyze'], len(d.get('replayed') or []), len(b))\n"
        )
        _, done = timed([sys.executable, "-c", code])
        if done.returncode != 0:
            raise SystemExit(done.stderr[-2000:])
        seconds, replayed, barriers = done.stdout.split()[-3:]
        what = "the rule" if rule else "no rule"
        print(
            f"  analysis at input_ids:1,16 with {what}: {float(seconds):.2f} s, {replayed} node(s) "
            f"replayed, {barriers} MatMulNBits barrier(s)"
        )


def render(rec: dict) -> list[str]:
    if "error" in rec:
        return [f"{rec['model']}: {rec['error']}"]
    (b0, n0), (b1, n1) = rec["bytes"]
    lines = [f"{rec['model']}:"]
    if "analysis_s" in rec:
        lines.append(
            f"  analysis: {rec['analysis_s']:.2f} s wall ({rec['analyze_phase_s']:.2f} s analyze phase), "
            f"{rec['replayed']} node(s) replayed; groups ({rec['groups_s']:.2f} s): "
            + ", ".join(f"{k} {v[0]} exact" + (f" +{v[1]} not" if v[1] else "") for k, v in sorted(rec["groups"].items()))
        )
        removed = ", ".join(f"{k} {r} of {n}" for k, (r, n) in sorted(rec["removed"].items()))
        lines.append(f"  --prune: {rec['prune_s']:.2f} s wall, proof {'passed' if rec['proof'] else 'FAILED'}; removed {removed}")
    else:
        lines.append(f"  prune: {rec['prune_s']:.2f} s; logits cosine with the input (min of 3): {rec['cosine']:.4f}")
    frac = 1 - b1 / b0
    line = f"  weight bytes {b0 / 1024:.1f} KiB -> {b1 / 1024:.1f} KiB (-{100 * frac:.1f}%)"
    if n0:
        line += f"; int4 weights with their parameters {n0 / 1024:.1f} -> {n1 / 1024:.1f} KiB (-{100 * (1 - n1 / n0):.1f}%)"
    lines.append(line)
    if "independent_error" in rec:
        lines.append(f"  independent check (masks applied here, onnxruntime): max rel error {rec['independent_error']:.3g}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/nbits_check"))
    ap.add_argument("--peers", default="/work/venvs/nbits/bin/python", help="python with transformers, torch, onnxscript, onnxsim (/work/venvs/nbits: peers + onnxscript)")
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--exporter", choices=("dynamo", "legacy"), default="dynamo", help="torch's exporter (dynamo needs onnxscript in --peers)")
    ap.add_argument("--repeat", type=int, default=3, help="timing rounds of each --prune (the fastest is compared)")
    ap.add_argument("--replay", action="store_true", help="also time the analysis without the MatMulNBits rule")
    ap.add_argument("--child-export", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "exporter")}
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.child_export:
        child_export(args.workdir, cfg, args.ratio)
        return 0
    print(f"LLaMA {cfg}, block 32, --prune {args.ratio}; workdir {args.workdir}")
    cmd = [args.peers, __file__, "--child-export", "--workdir", str(args.workdir), "--ratio", str(args.ratio)]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(["nice", *cmd], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(done.stderr[-3000:])
        return 2
    peers = json.loads((args.workdir / "peers.json").read_text())
    print(f"export {peers['export_s']:.1f} s; quantize {peers['int4_sym_quantize_s']:.1f} s / {peers['int4_asym_quantize_s']:.1f} s")
    records = {}
    for name in ("float", "int4_sym", "int4_asym", "qdq_sym", "qdq_asym"):
        records[name] = check(args.workdir, name, args.ratio, args.vocab)
        if records[name].get("prune_exit"):
            print(f"{name}: --prune exit {records[name]['prune_exit']}: {records[name].get('prune_error')}")
            continue
        print("\n".join(render(records[name])))
        if name.startswith("int4"):
            print("\n".join(render(onnxsim_record(args.workdir, name, peers, args.vocab))))
            if args.replay:
                replay_baseline(args.workdir, name)
    for _ in range(args.repeat - 1):  # more timing rounds, the models alternating: the fastest
        for name, rec in records.items():
            if "prune_s" in rec and not rec.get("prune_exit"):
                src, out = args.workdir / f"{name}.onnx", args.workdir / f"{name}_again.onnx"
                exe = [sys.executable, "-m", "onnxshrink.cli", str(src), "--prune", str(args.ratio)]
                seconds, _ = timed([*exe, "-o", str(out), "-q"])
                rec["prune_s"] = min(rec["prune_s"], seconds)
    if args.repeat > 1:
        print(f"--prune wall time, fastest of {args.repeat} rounds: " + ", ".join(f"{k} {r['prune_s']:.2f} s" for k, r in records.items() if "prune_s" in r))
    base = records["float"].get("prune_s")
    ok = True
    for name in ("int4_sym", "int4_asym", "qdq_sym", "qdq_asym"):
        rec = records[name]
        if "bytes" not in rec or base is None:
            ok = False
            continue
        (b0, _), (b1, _) = rec["bytes"]
        kinds = set(rec["removed"])
        verdict = {
            "KV groups and FFN neurons removed": {"kv_group", "gated_neuron"} <= kinds,
            "proof passed": bool(rec["proof"]),
            "independent error <= 1e-5": rec["independent_error"] <= 1e-5,
            ">= 25% fewer weight bytes": 1 - b1 / b0 >= 0.25,
            f"time {rec['prune_s']:.1f} s < 2 x float's {base:.1f} s": rec["prune_s"] < 2 * base,
        }
        print(f"{name}: " + "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in verdict.items()))
        ok = ok and all(verdict.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
