"""The forms deployment pipelines hold, shrunk and checked: figures per family.

For each family, the zoo's model with half of every channel group masked (heads, FFN neurons,
filters, hidden units) and the same architecture built natively with the kept channels go
through the same deployment step; the masked one is shrunk with validation off and compared
here, with onnxruntime, with its own input (the optimized or quantized model: its zeros and
zero points are the masks). Prints parameters before / after / natively built, and the error.

- optimized: BERT-, GPT- and ViT-like transformers passed through onnxruntime's transformer
  optimizer (SkipLayerNormalization, BiasGelu, and Attention where its patterns match);
- quantized: a ResNet-like and the BERT-like model, quantize_static (QDQ, per channel) and
  quantize_dynamic;
- recurrent: a bidirectional LSTM, an LSTM and a GRU, with both torch exporters;
- einsum: a transformer FFN written with torch.einsum (the legacy exporter keeps Einsum).

    python tools/deploy_check.py                      # every family
    python tools/deploy_check.py --families quantized
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.recurrent import RECURRENT  # noqa: E402  (the repository root)
from models.transformers import TRANSFORMERS  # noqa: E402
from models.zoo import (  # noqa: E402
    ZOO,
    Entry,
    Grouped,
    choose_kept,
    export,
    native_widths,
    randomize,
    zero_groups,
)


class EinsumFFN(Grouped):
    """x + W2 gelu(W1 x + b1) + b2, written with torch.einsum; FFN neurons are the group."""

    def __init__(self, widths: dict[str, int] | None = None, d: int = 16):
        super().__init__(widths or {}, {"ffn": 32})
        f = self.w("ffn")
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)
        self.produce("ffn", self.up)
        self.claim("ffn", self.down, "weight", 1, lambda i: np.array([i]))

    def forward(self, x):
        h = torch.einsum("bsd,fd->bsf", x, self.up.weight) + self.up.bias
        return x + torch.einsum("bsf,df->bsd", nn.functional.gelu(h), self.down.weight) + self.down.bias


EINSUM = Entry(lambda w=None: EinsumFFN(w), (1, 6, 16))


def pair(entry: Entry, folder: Path, tag: str, **kw) -> tuple[Path, Path]:
    """The masked and the natively built model, exported."""
    kept = choose_kept(randomize(entry.build(), seed=1), 0.5, seed=2)
    masked = randomize(entry.build(), seed=1)
    zero_groups(masked, kept)
    native = randomize(entry.build(native_widths(kept)), seed=3)
    paths = folder / f"{tag}_masked.onnx", folder / f"{tag}_native.onnx"
    for module, path in zip((masked, native), paths, strict=True):
        export(module, path, entry.inputs(), **kw)
    return paths


def optimized(path: Path, model_type: str) -> Path:
    from onnxruntime.transformers.optimizer import optimize_model

    out = path.with_name(path.stem + "_ortopt.onnx")
    opt = optimize_model(str(path), model_type=model_type, num_heads=4, hidden_size=32, opt_level=0)
    opt.save_model_to_file(str(out))
    return out


def quantized(path: Path, how: str) -> Path:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        quantize_dynamic,
        quantize_static,
    )

    from onnxshrink.proof.inputs import make_inputs, resolve_shapes

    out = path.with_name(f"{path.stem}_{how}.onnx")
    if how == "dynamic":
        quantize_dynamic(path, out, per_channel=True)
        return out
    model = onnx.load(path)
    feeds = iter(make_inputs(model, resolve_shapes(model, {}), 4, seed=5))

    class Reader(CalibrationDataReader):
        def get_next(self):
            return next(feeds, None)

    quantize_static(path, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    return out


ANALYSIS = "rules"  # --analysis: the handlers' rules, or the replay of every node


def check(label: str, masked: Path, native: Path) -> bool:
    """Shrink `masked` (validation off), compare with it in onnxruntime; print one line."""
    import onnxruntime as ort

    from onnxshrink import shrink
    from onnxshrink.proof.inputs import make_inputs, resolve_shapes
    from onnxshrink.report import model_stats

    reference = onnx.load(masked)
    result = shrink(reference, validate=False, analysis=ANALYSIS)
    sessions = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        for m in (reference, result.model)
    ]
    err, exact = 0.0, True
    for feed in make_inputs(reference, resolve_shapes(reference, {}), 3, seed=11):
        for a, b in zip(*(s.run(None, feed) for s in sessions), strict=True):
            if np.issubdtype(a.dtype, np.floating):
                err = max(err, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
            else:
                exact &= bool(np.array_equal(a, b))
    native_params = model_stats(onnx.load(native)).params
    ok = err <= 1e-5 and exact and result.after.params == native_params
    barriers = sorted({b["op"] for b in result.barriers})
    print(
        f"{label:52s} {'ok  ' if ok else 'FAIL'} params {result.before.params:7d} -> "
        f"{result.after.params:7d} (native {native_params:7d}), max rel err {err:.1e}"
        + ("" if exact else ", integer outputs differ")
        + (f", barriers {barriers}" if barriers else "")
    )
    return ok


def optimized_family(folder: Path) -> list[bool]:
    out = []
    for name, model_type in (("bert", "bert"), ("gpt", "gpt2"), ("vit", "vit")):
        masked, native = pair(TRANSFORMERS[name], folder, f"opt_{name}")
        masked, native = optimized(masked, model_type), optimized(native, model_type)
        fused = sorted({n.op_type for n in onnx.load(masked).graph.node if n.domain})
        out.append(check(f"optimized {name} ({', '.join(fused)})", masked, native))
    return out


def quantized_family(folder: Path) -> list[bool]:
    out = []
    for name, entry in (("resnet_basic", ZOO["resnet_basic"]), ("bert", TRANSFORMERS["bert"])):
        masked, native = pair(entry, folder, f"q_{name}", dynamo=False)
        for how in ("static", "dynamic"):
            out.append(check(f"quantized {how} {name}", quantized(masked, how), quantized(native, how)))
    return out


def recurrent_family(folder: Path) -> list[bool]:
    out = []
    for dynamo in (False, True):
        masked, native = pair(RECURRENT, folder, f"rnn_{dynamo}", dynamo=dynamo)
        out.append(check(f"recurrent ({'dynamo' if dynamo else 'legacy'} export)", masked, native))
    return out


def einsum_family(folder: Path) -> list[bool]:
    masked, native = pair(EINSUM, folder, "einsum", dynamo=False)
    ops = {n.op_type for n in onnx.load(masked).graph.node}
    assert "Einsum" in ops, ops
    return [check("einsum FFN (legacy export)", masked, native)]


FAMILIES: dict[str, Callable[[Path], list[bool]]] = {
    "optimized": optimized_family,
    "quantized": quantized_family,
    "recurrent": recurrent_family,
    "einsum": einsum_family,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"of {list(FAMILIES)}")
    ap.add_argument("--analysis", choices=("rules", "replay"), default="rules")
    args = ap.parse_args(argv)
    global ANALYSIS
    ANALYSIS = args.analysis
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    results: list[bool] = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            results += FAMILIES[family](Path(tmp))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
